"""GGUF files -> a pycalm conversion plan: the metadata, the tensors, the vocabulary.

A GGUF file (llama.cpp's format) holds key/value metadata (the hyperparameters under
"<arch>.", the tokenizer under "tokenizer.ggml.") and tensors, float or block-quantized.
`from_gguf` (called by pycalm.convert.main.convert) reads the hyperparameters into the model config,
plans each pycalm tensor as rows of GGUF tensors, dequantized by gguf.quants as they are read,
and turns the vocabulary into a Hugging Face tokenizers JSON (`tokenizer_json_from_gguf`), the
way llama.cpp interprets those fields, so every GGUF model runs with the one tokenizer kind.

Shapes: GGUF lists a tensor's dimensions innermost first (ne[0] is the row length); `source`
reverses them into numpy order, so a matrix is (rows, cols) = (out_features, in_features) as in
a Hugging Face checkpoint. The q/k rows of llama-architecture files are already in interleaved
rotary pairs; those of qwen2 files are permuted (pycalm.convert.common.make_plan).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pycalm.convert.common import Converted, Source, make_config, make_plan, rope_inv_freq, whole
from pycalm.convert.gguf_header import read_gguf_header, read_gguf_metadata
from pycalm.convert.quantize import Q4_BLOCK, TRANSCODED, q4_from_gguf
from pycalm.errors import PycalmError
from pycalm.model.formats import Quantized

GGUF_ARCHS = ("llama", "qwen2")  # Mixtral GGUF files say "llama" and carry expert_count

# the GGUF tensor of each role of pycalm.convert.common.make_plan (per layer: after "blk.<layer>.";
# Mixtral's stacked experts: ffn_gate_exps.weight, ...)
GGUF_NAMES = {
    "tok_embeddings": "token_embd.weight",
    "norm": "output_norm.weight",
    "output": "output.weight",
    "attn_norm": "attn_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "wo": "attn_output.weight",
    "moe_gate": "ffn_gate_inp.weight",
    "w1": "ffn_gate.weight",
    "w2": "ffn_down.weight",
    "w3": "ffn_up.weight",
}

# =============================================================================================
# metadata


# the tokenizer keys the conversion reads (tokenizer_json_from_gguf, gguf_special_ids)
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


def tokenizer_fields(metadata: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer keys of a GGUF file's metadata, ready for `tokenizer_json_from_gguf`."""
    return {k: v for k, v in metadata.items() if k in GGUF_FIELD_NAMES}


def read_gguf_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The tokenizer keys of the GGUF file at `path`."""
    return tokenizer_fields(read_gguf_metadata(path))


# =============================================================================================
# tensors


class GGUFSource(Source):
    """A GGUF tensor (float or block-quantized), dequantized by gguf.quants row by row."""

    def __init__(self, label: str, data: np.ndarray, qtype: Any, rows: int, cols: int) -> None:
        super().__init__(label, rows, cols)
        self.data = data.reshape(rows, -1)  # quantized: (rows, bytes per row); float: (rows, cols)
        self.qtype = qtype
        self._count = threading.Lock()  # rounded_groups: the converter encodes chunks on threads

    def take(self, idx: np.ndarray) -> np.ndarray:
        from gguf.quants import dequantize

        out = dequantize(np.ascontiguousarray(self.data[idx]), self.qtype)
        return np.asarray(out, dtype=np.float32).reshape(len(idx), self.cols)

    @property
    def kind(self) -> str:
        return self.qtype.name

    @property
    def on_q4_grid(self) -> bool:
        return self.qtype.name in TRANSCODED

    def encode_rows(self, idx: np.ndarray, dtype: str, group: int = 32) -> np.ndarray | Quantized:
        """q4 at groups of 32 from Q4_0 / Q4_1 / Q4_K blocks: transcoded (pycalm.convert.quantize)."""
        if dtype != "q4" or group != Q4_BLOCK or not self.on_q4_grid:
            return super().encode_rows(idx, dtype, group)
        out, rounded = q4_from_gguf(self.data[idx], self.kind, self.cols)
        with self._count:
            self.rounded_groups += rounded
        return out

    rounded_groups = 0  # Q4_K sub-blocks whose d or m was rounded to fp16 on transcoding

    def origin(self, dtype: str, group: int = 32) -> str:
        if dtype == "q4" and group == Q4_BLOCK and self.on_q4_grid:
            if self.rounded_groups:
                return f"{self.kind} transcoded, some scales rounded once to fp16 (codes kept)"
            return f"{self.kind} transcoded exactly"
        return super().origin(dtype, group)


def _gguf_supported() -> dict[Any, str]:
    from gguf import GGMLQuantizationType as T

    return {
        t: t.name
        for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)
    }


class GGUFFile:
    """A GGUF file's key/values and tensors, from read_gguf_header (every count, offset and
    length checked against the file), the tensors' data memory-mapped. (gguf.GGUFReader would
    also parse every element of every metadata array: about 12 s for Qwen2.5's vocabulary.)"""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata, self.tensors = read_gguf_header(path)  # name -> gguf_header.TensorInfo
        try:
            self.mapped = np.memmap(path, np.uint8, mode="r")  # the tensors' data, read on demand
        except (ValueError, OSError) as e:
            raise PycalmError(f"{path}: not a readable GGUF file ({e or type(e).__name__})") from None
        self.supported = _gguf_supported()

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def source(
        self, name: str, shape: tuple[int, ...], rows_cols: tuple[int, int] | None = None
    ) -> GGUFSource:
        """Tensor `name`, checked to have numpy shape `shape`, as a source of rows.

        Rows are all leading axes flattened (experts first), unless rows_cols says otherwise
        (a bias of n values is read as n rows of one value, so it can be permuted like q/k rows).
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self.tensors.get(name)
        if t is None:
            raise PycalmError(f"{self.path}: missing tensor {name!r}")
        qtype = GGMLQuantizationType(t.qtype)  # a known type: read_gguf_header checked it
        if qtype not in self.supported:
            raise PycalmError(
                f"{self.path}: tensor {name!r} has type {qtype.name}; pycalm converts "
                f"{', '.join(self.supported.values())}"
            )
        got = t.dims[::-1]  # GGUF ne[0] is the row length
        if got != shape:
            raise PycalmError(f"{self.path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        rows, cols = rows_cols or (int(np.prod(shape[:-1], dtype=np.int64)), shape[-1])
        if cols % GGML_QUANT_SIZES[qtype][0]:  # a vector read as rows of one value needs a float type
            raise PycalmError(
                f"{self.path}: tensor {name!r} of {qtype.name} cannot be read in rows of {cols}"
            )
        return GGUFSource(name, self.mapped[t.start : t.start + t.nbytes], qtype, rows, cols)

    def vector(self, name: str, n: int) -> Callable[[], np.ndarray]:
        return whole(self.source(name, (n,), (1, n)), flat=True)


# =============================================================================================
# vocabulary -> tokenizers JSON


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


# =============================================================================================
# the conversion plan


def _f32(value: float) -> float:
    """A GGUF float32 key as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def from_gguf(path: Path, dtype: str) -> Converted:
    """Plan the conversion of a GGUF file (llama or qwen2 architecture). Any problem with the
    file, its metadata's types and values included, is a PycalmError naming it."""
    try:
        return _plan_gguf(path, dtype)
    except PycalmError as e:
        if str(path) in str(e):
            raise
        raise PycalmError(f"{path}: {e}") from None
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError) as e:
        raise PycalmError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None


def _plan_gguf(path: Path, dtype: str) -> Converted:
    g = GGUFFile(path)
    arch = g.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise PycalmError(
            f"{path}: unsupported GGUF architecture {arch!r} (pycalm converts {', '.join(GGUF_ARCHS)})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = g.get(f"{arch}.{name}", default)
        if value is None:
            raise PycalmError(f"{path}: missing key {arch}.{name}")
        return value

    dim = int(key("embedding_length"))
    n_layers = int(key("block_count"))
    n_heads = int(key("attention.head_count"))
    n_kv_heads = int(key("attention.head_count_kv", n_heads))
    head_dim = int(key("attention.key_length", dim // n_heads))
    rotary_dim = int(key("rope.dimension_count", head_dim))
    hidden_dim = int(key("feed_forward_length"))
    n_experts = int(key("expert_count", 0))
    # each size within what the file can hold, before anything (rotary_perm, ...) is sized by it
    size = path.stat().st_size
    sizes = {"embedding_length": dim, "feed_forward_length": hidden_dim, "block_count": n_layers}
    sizes.update({"attention.head_count": n_heads, "attention.head_count_kv": n_kv_heads})
    sizes.update({"attention.key_length": head_dim, "query width": n_heads * head_dim})
    for name, value in sizes.items():
        if not 0 < value <= size:
            raise PycalmError(f"{path}: {arch}.{name} = {value} does not fit a file of {size} bytes")
    if not 0 <= rotary_dim <= head_dim or not 0 <= n_experts <= size or n_layers > len(g.tensors):
        raise PycalmError(
            f"{path}: rope dimensions {rotary_dim}, {n_experts} experts or {n_layers} layers do not "
            f"fit a file of {len(g.tensors)} tensors with heads of {head_dim}"
        )
    theta = _f32(key("rope.freq_base", 10000.0))
    if "token_embd.weight" not in g.tensors:
        raise PycalmError(f"{path}: missing tensor 'token_embd.weight'")
    vocab_size = g.tensors["token_embd.weight"].dims[1]

    inv_freq = rope_inv_freq(theta, rotary_dim)
    scaling = g.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        inv_freq = (inv_freq / np.float32(key("rope.scaling.factor"))).astype(np.float32)
    elif scaling not in ("none", ""):
        raise PycalmError(f"{path}: unsupported rope scaling {scaling!r}")
    if g.has("rope_freqs.weight"):  # Llama-3.1: per-pair divisors of the inverse frequency
        divisors = g.vector("rope_freqs.weight", rotary_dim // 2)()
        inv_freq = (inv_freq / divisors).astype(np.float32)

    fields = tokenizer_fields(g.metadata)
    bos_id, eos_ids = gguf_special_ids(fields)
    tied = not g.has("output.weight")
    config = make_config(
        path,
        arch="mixtral" if n_experts else arch,
        dim=dim,
        hidden_dim=hidden_dim,
        head_dim=head_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        max_seq_len=int(key("context_length", 4096)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        bos_id=bos_id,
        eos_ids=eos_ids,
        qkv_bias=g.has("blk.0.attn_q.bias"),
        tied_embeddings=tied,
        n_experts=n_experts,
        n_experts_active=int(key("expert_used_count", 0)),
        weight_dtype=dtype,
    )

    q_dim, kv_dim, experts = config.q_dim, config.kv_dim, (n_experts,) if n_experts else ()
    shapes = {  # numpy shapes; a vector of n values is read as n rows of one value
        "tok_embeddings": (vocab_size, dim),
        "norm": (dim,),
        "output": (vocab_size, dim),
        "attn_norm": (dim,),
        "ffn_norm": (dim,),
        "q": (q_dim, dim),
        "k": (kv_dim, dim),
        "v": (kv_dim, dim),
        "q_bias": (q_dim,),
        "k_bias": (kv_dim,),
        "v_bias": (kv_dim,),
        "wo": (dim, q_dim),
        "moe_gate": (n_experts, dim),
        "w1": (*experts, hidden_dim, dim),
        "w2": (*experts, dim, hidden_dim),
        "w3": (*experts, hidden_dim, dim),
    }

    def tensor(role: str, layer: int) -> Source:
        """The GGUF tensor of a role (pycalm.convert.common.make_plan), checked against its shape."""
        name = GGUF_NAMES[role] if layer < 0 else f"blk.{layer}." + GGUF_NAMES[role]
        if n_experts and role in ("w1", "w2", "w3"):
            name = name.replace(".weight", "_exps.weight")
        shape = shapes[role]
        return g.source(name, shape, (shape[0], 1) if len(shape) == 1 else None)

    # llama.cpp stores llama q/k already interleaved; qwen2 (NEOX rope) keeps rotate-half order
    plan = make_plan(config, inv_freq, tensor, permute_qk=arch == "qwen2")
    if "tokenizer.ggml.model" not in fields or "tokenizer.ggml.tokens" not in fields:
        raise PycalmError(f"{path}: no tokenizer vocabulary (tokenizer.ggml.model / tokens)")
    blob = tokenizer_json_from_gguf(fields).encode("utf-8")
    return Converted(config, plan, "tokenizers-json", blob, fields.get("tokenizer.chat_template") or "")
