"""Text <-> token ids: sentencepiece and Hugging Face `tokenizers` behind one interface.

The model file stores the tokenizer as bytes (docs/MODEL_FILE.md): either a sentencepiece model
proto or a Hugging Face tokenizers JSON. `Tokenizer.from_blob` wraps the matching library, so the
splitting rules are the libraries' own, not a re-implementation that could drift.

What pycalm adds on top:
- `tokenizer_json_from_gguf`: GGUF files carry a vocabulary (tokens, merges, token types and a
  pre-tokenizer name) instead of a tokenizer file; it is turned into a tokenizers JSON here, the
  way llama.cpp interprets those fields.
- `StreamDecoder`: generation prints one token at a time, but one character may be spread over
  several tokens (byte-level BPE, sentencepiece byte fallback). The stream decoder works on bytes
  and only hands out whole UTF-8 characters.
- `apply_chat_template`: the model's own Jinja template, rendered the way transformers does.
"""

from __future__ import annotations

import codecs
import json
import mmap
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pycalm.errors import PycalmError

TOKENIZER_KINDS = ("sentencepiece", "tokenizers-json")

# =============================================================================================
# GGUF vocabulary -> tokenizers JSON
# =============================================================================================

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns, as the models' own tokenizer.json files write them.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama 3's pattern with single digits instead of runs of up to three.
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

GGUF_FIELD_NAMES = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)


def _byte_level_split(pattern: str) -> list[dict[str, Any]]:
    """A regex split followed by the byte-level mapping, as Llama 3 and Qwen2 tokenizer.json do."""
    return [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ]


def _byte_level_pre_tokenizer(pre: str) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
    """(pre_tokenizer, normalizer, ignore_merges) for llama.cpp's pre-tokenizer name `pre`."""
    gpt2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in ("gpt-2", "default"):
        return gpt2, None, False
    if pre == "smollm":  # StarCoder-style: every digit its own pre-token, then the GPT-2 regex
        digits = {"type": "Digits", "individual_digits": True}
        return {"type": "Sequence", "pretokenizers": [digits, gpt2]}, None, False
    if pre == "qwen2":
        # Qwen2's own tokenizer.json also NFC-normalizes; llama.cpp and transformers' GGUF loader
        # do not, and pycalm follows them (it only matters for decomposed accents in the input).
        return {"type": "Sequence", "pretokenizers": _byte_level_split(_QWEN2_PATTERN)}, None, False
    if pre == "llama-bpe":
        # Llama 3 looks a whole pre-token up in the vocabulary before merging (ignore_merges)
        return {"type": "Sequence", "pretokenizers": _byte_level_split(_LLAMA3_PATTERN)}, None, True
    raise PycalmError(
        f"GGUF pre-tokenizer {pre!r} is not supported (pycalm knows gpt-2, default, smollm, qwen2, llama-bpe)"
    )


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[dict[str, Any]]:
    """Control and user-defined tokens are matched whole in the input text, before any splitting."""
    added = []
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            added.append(
                {
                    "id": i,
                    "content": tok,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": typ == TOKEN_CONTROL,
                }
            )
    return added


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id; a token string that appears twice keeps its first id (as llama.cpp's lookup)."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _split_merge(merge: str) -> list[str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise PycalmError(f"GGUF tokenizer merge {merge!r} has no space between its two parts")
    return [left, right]


def _gpt2_json(fields: dict[str, Any], tokens: list[str], types: list[int]) -> dict[str, Any]:
    pre_tokenizer, normalizer, ignore_merges = _byte_level_pre_tokenizer(
        str(fields.get("tokenizer.ggml.pre", "default"))
    )
    merges = fields.get("tokenizer.ggml.merges")
    if merges is None:
        raise PycalmError("GGUF file has a gpt2 tokenizer but no tokenizer.ggml.merges")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,  # BOS is added by Tokenizer.encode, from the model config
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": _vocab_dict(tokens),
            "merges": [_split_merge(m) for m in merges],
        },
    }


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """Merges for a sentencepiece BPE vocabulary, ranked by the score of the merged piece.

    sentencepiece BPE has no merge list: at each step it joins the adjacent pair whose joined
    piece has the highest score. A BPE merge list ordered by that score does the same.
    """
    vocab = {tok: i for i, tok in enumerate(tokens) if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED)}
    ranked = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [[left, right] for _, _, _, left, right in ranked]


def _llama_json(fields: dict[str, Any], tokens: list[str], types: list[int]) -> dict[str, Any]:
    scores = fields.get("tokenizer.ggml.scores")
    if scores is None:
        raise PycalmError("GGUF file has a llama (sentencepiece) tokenizer but no tokenizer.ggml.scores")
    scores = [float(s) for s in scores]
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        unk_ids = [i for i, t in enumerate(types) if t == TOKEN_UNKNOWN]
        unk = unk_ids[0] if unk_ids else None
    # sentencepiece puts a space in front of the text (add_dummy_prefix); llama.cpp does it again
    # after every special token. A Prepend normalizer does both: it runs on each stretch of text
    # between added tokens. (Metaspace's prepend_scheme would skip text that starts with a space.)
    add_space = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    replace_spaces = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    normalizer = (
        {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, replace_spaces]}
        if add_space
        else replace_spaces
    )
    # User-defined pieces are plain vocabulary entries to sentencepiece; only control tokens are
    # matched whole in the text.
    added = [t for t in _added_tokens(tokens, types) if t["special"]]
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[int(unk)] if unk is not None else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": _vocab_dict(tokens),
            "merges": _spm_merges(tokens, scores, types),
        },
    }


def tokenizer_json_from_gguf(fields: dict[str, Any]) -> str:
    """A Hugging Face tokenizers JSON equivalent to a GGUF file's vocabulary.

    `fields` holds plain Python values keyed by GGUF key name (see `read_gguf_tokenizer_fields`).
    "gpt2" (byte-level BPE) and "llama" (sentencepiece-style BPE with scores and byte fallback)
    vocabularies are supported. The JSON adds no BOS: `Tokenizer.encode` does that from bos_id.
    """
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise PycalmError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    tokens = [str(t) for t in tokens]
    types = fields.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise PycalmError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    if model == "gpt2":
        data = _gpt2_json(fields, tokens, types)
    elif model == "llama":
        data = _llama_json(fields, tokens, types)
    else:
        raise PycalmError(f"GGUF tokenizer model {model!r} is not supported (pycalm supports gpt2 and llama)")
    return json.dumps(data, ensure_ascii=False)


def gguf_special_ids(fields: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    """(bos_id, eos_ids) as the model config wants them, from GGUF tokenizer fields.

    bos_id is -1 when the tokenizer adds no BOS (add_bos_token false; llama.cpp's default is true
    for sentencepiece vocabularies and false for gpt2 ones). eos_ids is the EOS token plus the
    end-of-turn / end-of-message tokens when the file names them, so chat generation stops there.
    """
    default_add_bos = fields.get("tokenizer.ggml.model") == "llama"
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", default_add_bos))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    bos_id = int(bos) if add_bos and bos is not None else -1
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = fields.get(key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    return bos_id, tuple(eos_ids)


# GGUF metadata value types -> numpy dtypes (8 = string, 9 = array are handled apart)
_GGUF_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_BOOL = 8, 9, 7


class _GGUFMeta:
    """Reads GGUF key/value metadata from a buffer (gguf.GGUFReader parses every array element
    into its own numpy view, which takes tens of seconds for a 150k-token vocabulary)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError("file ends inside its metadata")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def string(self) -> str:
        return bytes(self.take(self.u64())).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            etype, count = self.u32(), self.u64()
            if etype == _GGUF_STRING:
                return [self.string() for _ in range(count)]
            if etype == _GGUF_ARRAY:
                return [self.value(_GGUF_ARRAY) for _ in range(count)]
            dtype = np.dtype(_GGUF_SCALARS[etype])
            values = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            return [bool(v) for v in values] if etype == _GGUF_BOOL else values.tolist()
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        dtype = np.dtype(_GGUF_SCALARS[vtype])
        value = np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0].item()
        return bool(value) if vtype == _GGUF_BOOL else value


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (str, int, float, bool, list)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta = _GGUFMeta(memoryview(mm))
            try:
                if bytes(meta.take(4)) != b"GGUF":
                    raise ValueError("not a GGUF file (bad magic)")
                version = meta.u32()
                if version not in (2, 3):
                    raise ValueError(f"unsupported GGUF version {version}")
                meta.u64()  # tensor count
                fields = {}
                for _ in range(meta.u64()):
                    key = meta.string()
                    fields[key] = meta.value(meta.u32())
                return fields
            finally:
                meta.buf.release()
    except FileNotFoundError:
        raise PycalmError(f"GGUF file not found: {path}") from None
    except (ValueError, KeyError, OSError) as e:
        raise PycalmError(f"cannot read GGUF file {path}: {e}") from None


def read_gguf_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The tokenizer.* fields of a GGUF file, ready for `tokenizer_json_from_gguf`."""
    return {k: v for k, v in read_gguf_metadata(path).items() if k in GGUF_FIELD_NAMES}


# =============================================================================================
# Streaming decode: bytes in, whole characters out
# =============================================================================================


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte gets a printable character (spaces become 'Ġ')."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class StreamDecoder:
    """Turns ids into text one at a time, never splitting a multi-byte UTF-8 character.

    `token_bytes[id]` is the raw bytes a token stands for. `strip_first_space`: sentencepiece
    models put a space in front of the text when encoding; decoding drops it from the first
    piece (and only there).
    """

    token_bytes: list[bytes]
    strip_first_space: bool = False
    _utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )
    _started: bool = False

    def push(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still incomplete)."""
        data = self.token_bytes[token_id]
        if not self._started and data:
            self._started = True
            if self.strip_first_space and data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is left at the end; an unfinished character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


# =============================================================================================
# The Tokenizer
# =============================================================================================


def _raise_exception(message: str) -> None:
    raise PycalmError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' version: templates expect non-ASCII text kept as is
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def render_chat_template(
    template: str, messages: list[dict[str, str]], add_generation_prompt: bool, bos_token: str, eos_token: str
) -> str:
    """Render a Hugging Face chat template the way transformers does (sandboxed jinja2)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise PycalmError("the chat template needs jinja2: pip install jinja2") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        compiled = env.from_string(template)
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as e:
        raise PycalmError(f"chat template error: {e}") from None


def chatml(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The plain ChatML layout, for models whose file carries no template."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Tokenizer:
    """encode / decode / stream / chat template over a sentencepiece or tokenizers backend."""

    def __init__(
        self,
        kind: str,
        backend: Any,
        bos_id: int,
        eos_ids: tuple[int, ...],
        chat_template: str,
        token_bytes: list[bytes],
        special_ids: frozenset[int],
        strip_first_space: bool,
        special_pattern: re.Pattern[str] | None,
        special_by_text: dict[str, int],
    ) -> None:
        # use Tokenizer.from_blob; this only stores what it worked out
        self.kind = kind
        self._backend = backend
        self.bos_id = int(bos_id)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.chat_template = chat_template
        self._token_bytes = token_bytes
        self._special_ids = special_ids
        self._strip_first_space = strip_first_space
        self._special_pattern = special_pattern  # sentencepiece only: control tokens written in text
        self._special_by_text = special_by_text

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_blob(
        cls, kind: str, blob: bytes, bos_id: int, eos_ids: tuple[int, ...], chat_template: str = ""
    ) -> Tokenizer:
        """Build from the bytes stored in the model file (docs/MODEL_FILE.md)."""
        if kind == "sentencepiece":
            return cls._from_sentencepiece(bytes(blob), bos_id, eos_ids, chat_template)
        if kind == "tokenizers-json":
            return cls._from_tokenizers_json(bytes(blob), bos_id, eos_ids, chat_template)
        raise PycalmError(f"unknown tokenizer kind {kind!r} (one of {', '.join(TOKENIZER_KINDS)})")

    @classmethod
    def _from_sentencepiece(
        cls, blob: bytes, bos_id: int, eos_ids: tuple[int, ...], chat_template: str
    ) -> Tokenizer:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(blob)
        except (RuntimeError, OSError) as e:
            raise PycalmError(f"the model file's sentencepiece tokenizer is corrupt: {e}") from None
        n = sp.get_piece_size()
        token_bytes = []
        special = set()
        for i in range(n):
            piece = sp.id_to_piece(i)
            if sp.is_control(i):
                token_bytes.append(b"")  # sentencepiece's decode drops control pieces
                special.add(i)
            elif sp.is_byte(i):
                m = _BYTE_PIECE.fullmatch(piece)
                token_bytes.append(bytes([int(m.group(1), 16)]) if m else b"")
            elif sp.is_unknown(i):
                token_bytes.append(" \u2047 ".encode())  # what sentencepiece decodes <unk> to
            else:
                token_bytes.append(piece.replace("\u2581", " ").encode())
        # Does the model put a space in front of the text (add_dummy_prefix)? Reading the flag
        # needs protobuf; encoding one letter shows it just as well.
        first = sp.encode("a", out_type=str)
        strip_first_space = bool(first) and first[0].startswith("\u2581")
        by_text = {sp.id_to_piece(i): i for i in sorted(special)}
        pattern = None
        if by_text:
            alternatives = sorted(by_text, key=len, reverse=True)
            pattern = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")
        return cls(
            "sentencepiece",
            sp,
            bos_id,
            eos_ids,
            chat_template,
            token_bytes,
            frozenset(special),
            strip_first_space,
            pattern,
            by_text,
        )

    @classmethod
    def _from_tokenizers_json(
        cls, blob: bytes, bos_id: int, eos_ids: tuple[int, ...], chat_template: str
    ) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            text = blob.decode("utf-8")
            data = json.loads(text)
            tok = HFTokenizer.from_str(text)
        except (UnicodeDecodeError, ValueError, Exception) as e:  # tokenizers raises plain Exception
            raise PycalmError(
                f"the model file's tokenizers JSON is corrupt: {str(e).splitlines()[0]}"
            ) from None
        n = tok.get_vocab_size(with_added_tokens=True)
        added = {int(t["id"]): t for t in data.get("added_tokens", [])}
        special = frozenset(i for i, t in added.items() if t.get("special"))
        decoders = _decoder_types(data.get("decoder"))
        byte_level = "ByteLevel" in decoders
        model = data.get("model") or {}
        byte_fallback = "ByteFallback" in decoders or bool(model.get("byte_fallback"))
        unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        token_bytes = []
        for i in range(n):
            piece = tok.id_to_token(i)
            if piece is None:
                token_bytes.append(b"")
            elif i in added:
                token_bytes.append(str(added[i]["content"]).encode())
            elif byte_level:
                token_bytes.append(bytes(unicode_to_byte[c] for c in piece if c in unicode_to_byte))
            elif byte_fallback and _BYTE_PIECE.fullmatch(piece):
                token_bytes.append(bytes([int(piece[3:5], 16)]))
            else:
                token_bytes.append(piece.replace("\u2581", " ").encode())
        # Llama-2 style JSON strips with a Strip decoder, newer ones with a Metaspace decoder
        strip_first_space = "Strip" in decoders or _metaspace_strips(data.get("decoder"))
        return cls(
            "tokenizers-json",
            tok,
            bos_id,
            eos_ids,
            chat_template,
            token_bytes,
            special,
            strip_first_space,
            None,
            {},
        )

    # ---- the interface -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    def is_special(self, token_id: int) -> bool:
        """Control tokens (BOS, EOS, <|im_start|>, ...), which a chat UI would not print."""
        return token_id in self._special_ids or token_id == self.bos_id or token_id in self.eos_ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it become their single ids."""
        ids: list[int] = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        if self.kind == "tokenizers-json":
            ids += self._backend.encode(text, add_special_tokens=False).ids
        elif self._special_pattern is None:
            ids += self._backend.encode(text)
        else:
            for part in self._special_pattern.split(text):
                if part in self._special_by_text:
                    ids.append(self._special_by_text[part])
                elif part:
                    ids += self._backend.encode(part)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, as the backend library decodes it."""
        ids = [int(i) for i in ids]
        if self.kind == "tokenizers-json":
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._backend.decode(ids)

    def stream(self) -> StreamDecoder:
        """A decoder for ids that arrive one at a time; its pieces join to `decode(all ids)`."""
        return StreamDecoder(self._token_bytes, self._strip_first_space)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (for display and the chat template's bos/eos variables)."""
        if self.kind == "tokenizers-json":
            return self._backend.id_to_token(token_id) or ""
        return self._backend.id_to_piece(token_id)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, from the model's template (ChatML if it has none)."""
        if not self.chat_template:
            return chatml(messages, add_generation_prompt)
        bos = self.token_text(self.bos_id) if self.bos_id >= 0 else ""
        eos = self.token_text(self.eos_ids[0]) if self.eos_ids else ""
        return render_chat_template(self.chat_template, messages, add_generation_prompt, bos, eos)


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    """The decoder types in a tokenizers JSON decoder spec, looking inside Sequence."""
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in decoder.get("decoders", [])))
    return {str(decoder.get("type"))}


def _metaspace_strips(decoder: dict[str, Any] | None) -> bool:
    """Whether a Metaspace decoder (possibly inside a Sequence) drops the first piece's space."""
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(_metaspace_strips(d) for d in decoder.get("decoders", []))
    if decoder.get("type") != "Metaspace":
        return False
    return decoder.get("prepend_scheme", "always") != "never" and decoder.get("add_prefix_space", True)
