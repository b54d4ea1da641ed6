"""Text <-> token ids: sentencepiece and Hugging Face `tokenizers` behind one interface.

The model file stores the tokenizer as bytes (docs/MODEL_FILE.md): either a sentencepiece model
proto or a Hugging Face tokenizers JSON. `Tokenizer.from_blob` wraps the matching library, so the
splitting rules are the libraries' own, not a re-implementation that could drift.

A GGUF file carries a vocabulary instead of a tokenizer file: the converter turns it into a
tokenizers JSON (pycalm.convert.gguf.tokenizer_json_from_gguf), so the runtime sees only these
two kinds.

What pycalm adds on top:
- `StreamDecoder`: generation prints one token at a time, but one character may be spread over
  several tokens (byte-level BPE, sentencepiece byte fallback). The stream decoder works on bytes
  and only hands out whole UTF-8 characters.
- `apply_chat_template`: the model's own Jinja template, rendered the way transformers does.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pycalm.errors import PycalmError

TOKENIZER_KINDS = ("sentencepiece", "tokenizers-json")  # the model file's pycalm.tokenizer values

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


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
# str.translate's table for byte-level pieces: each alphabet character to the latin-1 character of
# its byte, every other character below 256 deleted (a character of 256 and up outside the
# alphabet is left, and _byte_level_pieces drops it the slow way)
_BYTE_LEVEL_TABLE = {c: None for c in range(256)} | {ord(c): chr(b) for c, b in _UNICODE_TO_BYTE.items()}


def _byte_level_pieces(pieces: list[str]) -> list[bytes]:
    """The bytes of byte-level BPE pieces: each character of GPT-2's alphabet is one byte,
    characters outside it are dropped."""
    parts = "\uffff".join(pieces).translate(_BYTE_LEVEL_TABLE).split("\uffff")  # U+FFFF: kept
    if len(parts) == len(pieces):  # (no piece holds U+FFFF itself)
        try:
            return [p.encode("latin-1") for p in parts]
        except UnicodeEncodeError:  # a character outside the alphabet: the slow way
            pass
    return [bytes(_UNICODE_TO_BYTE[c] for c in p if c in _UNICODE_TO_BYTE) for p in pieces]


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
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    tools: list[dict] | None = None,
) -> str:
    """Render a Hugging Face chat template the way transformers does (sandboxed jinja2); `tools`
    (OpenAI's function tools) go in as the template's `tools`, left undefined when None."""
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
            **({} if tools is None else {"tools": tools}),
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
        vocab = model.get("vocab")  # BPE's piece -> id (already parsed; Unigram's is a list)
        if not isinstance(vocab, dict):
            vocab = tok.get_vocab(with_added_tokens=True)
        pieces = [""] * n  # id -> vocabulary entry ("" for an id without one)
        for piece, i in vocab.items():
            if 0 <= i < n:
                pieces[i] = piece
        if byte_level:  # the whole vocabulary through one translate (pieces joined by U+FFFF)
            pieces = _byte_level_pieces(pieces)
        token_bytes = []
        for i, piece in enumerate(pieces):
            if i in added:
                token_bytes.append(str(added[i]["content"]).encode())
            elif byte_level:
                token_bytes.append(piece)
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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (a piece of a UTF-8 character where a token splits one)."""
        return bytes(self._token_bytes[token_id])

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (for display and the chat template's bos/eos variables)."""
        if self.kind == "tokenizers-json":
            return self._backend.id_to_token(token_id) or ""
        return self._backend.id_to_piece(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text for a conversation, from the model's template (ChatML if it has none);
        `tools` go to the template as its `tools` (pycalm.app.tools prepares them)."""
        if not self.chat_template:
            return chatml(messages, add_generation_prompt)
        bos = self.token_text(self.bos_id) if self.bos_id >= 0 else ""
        eos = self.token_text(self.eos_ids[0]) if self.eos_ids else ""
        return render_chat_template(self.chat_template, messages, add_generation_prompt, bos, eos, tools)


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
