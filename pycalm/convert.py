"""Convert a Hugging Face folder or a GGUF file into one pycalm model file.

    python -m pycalm.convert SRC OUT --dtype fp16|fp8|gf4

Every model quirk is settled here, so the runtime sees one layout (docs/MODEL_FILE.md):
- q/k rows of each head are permuted from rotate-half order (HF checkpoints, Qwen2 GGUF files)
  to interleaved rotary pairs, biases too; Llama-architecture GGUF files already are;
- q, k and v are fused into one `wqkv` matrix (and `bqkv` bias) so one matvec produces all three;
- RoPE inverse frequencies, with Llama-3 scaling applied, are stored as `rope_freqs`;
- Mixtral's experts are stacked into (n_experts, rows, cols) tensors, the router kept in float32;
- the tokenizer (sentencepiece proto or HF tokenizers JSON) and chat template travel inside.

Conversion streams: each output tensor is read from the source (dequantized, for GGUF), encoded
(pycalm.formats) and written in row chunks of at most CHUNK_ELEMS values, so memory stays bounded
whatever the model size. The file appears under its final name only when complete.

Shapes: a source matrix is (rows, cols) = (out_features, in_features) in both HF and GGUF (gguf's
reader already reverses GGUF's ne[] order into numpy order).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pycalm import formats
from pycalm.config import WEIGHT_DTYPES, ModelConfig
from pycalm.errors import OneLineParser, PycalmError
from pycalm.loader import ModelWriter, TensorSpec, read_safetensors_header

CHUNK_ELEMS = 1 << 21  # values per encoded chunk: 8 MB of float32; the encoders make float64 temporaries

HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}
GGUF_ARCHS = ("llama", "qwen2")


# ---------------------------------------------------------------------------------------------
# Row sources: a source matrix read by rows, so a chunk can be read, encoded and dropped


class Source:
    """A (rows, cols) float matrix in the source file, read row by row as float32."""

    def __init__(self, label: str, rows: int, cols: int) -> None:
        self.label = label  # the source tensor name(s), for error messages
        self.rows = rows
        self.cols = cols

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Rows idx (an int array) as float32 (len(idx), cols)."""
        raise NotImplementedError


class ArraySource(Source):
    """A memory-mapped HF safetensors tensor in F32, F16 or BF16 (raw uint16 bits)."""

    def __init__(self, label: str, array: np.ndarray, kind: str) -> None:
        super().__init__(label, array.shape[0], int(np.prod(array.shape[1:], dtype=np.int64)))
        self.array = array.reshape(array.shape[0], -1)
        self.kind = kind

    def take(self, idx: np.ndarray) -> np.ndarray:
        rows = self.array[idx]
        if self.kind == "BF16":  # bf16 is the top half of a float32; numpy has no bf16 type
            return (rows.astype(np.uint32) << 16).view(np.float32)
        return rows.astype(np.float32)


class GGUFSource(Source):
    """A GGUF tensor (float or block-quantized), dequantized by gguf.quants row by row."""

    def __init__(self, label: str, data: np.ndarray, qtype: Any, rows: int, cols: int) -> None:
        super().__init__(label, rows, cols)
        self.data = data.reshape(rows, -1)  # quantized: (rows, bytes per row); float: (rows, cols)
        self.qtype = qtype

    def take(self, idx: np.ndarray) -> np.ndarray:
        from gguf.quants import dequantize

        out = dequantize(np.ascontiguousarray(self.data[idx]), self.qtype)
        return np.asarray(out, dtype=np.float32).reshape(len(idx), self.cols)


class Permuted(Source):
    """Rows of another source in a new order: new row j is old row perm[j]."""

    def __init__(self, base: Source, perm: np.ndarray) -> None:
        super().__init__(base.label, base.rows, base.cols)
        self.base = base
        self.perm = perm

    def take(self, idx: np.ndarray) -> np.ndarray:
        return self.base.take(self.perm[idx])


class Concat(Source):
    """Sources stacked by rows: fuses q, k, v into wqkv and stacks Mixtral's experts."""

    def __init__(self, parts: list[Source]) -> None:
        cols = {p.cols for p in parts}
        if len(cols) != 1:
            raise PycalmError(
                f"cannot stack {', '.join(p.label for p in parts)}: row lengths differ {sorted(cols)}"
            )
        super().__init__(" + ".join(p.label for p in parts), sum(p.rows for p in parts), cols.pop())
        self.parts = parts
        self.starts = np.cumsum([0] + [p.rows for p in parts])

    def take(self, idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx), self.cols), dtype=np.float32)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        for k, part in enumerate(self.parts):
            sel = np.nonzero(which == k)[0]
            if len(sel):
                out[sel] = part.take(idx[sel] - self.starts[k])
        return out


def whole(src: Source, flat: bool = False) -> Callable[[], np.ndarray]:
    """A deferred read of a whole small source (norm, bias, router) as float32."""

    def read() -> np.ndarray:
        x = src.take(np.arange(src.rows))
        return x.reshape(-1) if flat else x

    return read


def rotary_perm(n_heads: int, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Row order taking rotate-half heads to interleaved pairs: new row j = old row perm[j].

    Within each head, rotate-half pairs row i with row i + rotary_dim/2; pycalm pairs rows 2i
    and 2i+1. So new row 2i = old row i, new row 2i+1 = old row i + rotary_dim/2; rows from
    rotary_dim on are not rotated and stay in place.
    """
    half = rotary_dim // 2
    head = np.arange(head_dim)
    head[0:rotary_dim:2] = np.arange(half)
    head[1:rotary_dim:2] = np.arange(half) + half
    return (np.arange(n_heads)[:, None] * head_dim + head[None, :]).reshape(-1)


# ---------------------------------------------------------------------------------------------
# RoPE frequencies


def rope_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """Inverse frequency of each rotary pair, float32, as HF computes it: 1 / theta^(2i/d)."""
    exps = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama-3.1 RoPE scaling, as HF transformers' _compute_llama3_parameters computes it.

    Long wavelengths (beyond old_context / low_freq_factor) are slowed by `factor`, short ones
    (below old_context / high_freq_factor) kept, and those between blended smoothly.
    """
    try:
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        raise PycalmError(
            f"llama3 rope scaling needs factor and original_max_position_embeddings: {scaling}"
        ) from None
    inv = inv_freq.astype(np.float32)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The conversion plan: what each output tensor is made of


class Converted:
    """Everything the writer needs: config, per-tensor plan, tokenizer and chat template.

    plan maps each output tensor name to a Source (matrices, encoded in the weight dtype) or to
    a function returning a float32 array (norms, biases, router, rope_freqs).
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: dict[str, Any],
        tokenizer_kind: str,
        tokenizer_blob: bytes,
        chat_template: str,
    ) -> None:
        self.config = config
        self.plan = plan
        self.tokenizer_kind = tokenizer_kind
        self.tokenizer_blob = tokenizer_blob
        self.chat_template = chat_template


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PycalmError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise PycalmError(f"{path}: expected a JSON object")
    return data


class HFCheckpoint:
    """The safetensors shards of an HF folder, indexed by tensor name (headers only)."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map", {})
            files = sorted({folder / f for f in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise PycalmError(
                f"{folder}: no *.safetensors weights (pycalm does not read .bin/.pth checkpoints)"
            )
        self.entries: dict[str, tuple[Path, Any]] = {}
        for f in files:
            if not f.is_file():
                raise PycalmError(f"{f}: listed in model.safetensors.index.json but missing")
            tensors, _ = read_safetensors_header(f)
            for name, entry in tensors.items():
                self.entries[name] = (f, entry)

    def has(self, name: str) -> bool:
        return name in self.entries

    def source(self, name: str) -> ArraySource:
        if name not in self.entries:
            raise PycalmError(f"checkpoint has no tensor {name!r}")
        path, e = self.entries[name]
        np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(e.dtype)
        if np_dtype is None:
            raise PycalmError(
                f"{path}: tensor {name!r} is {e.dtype}; pycalm converts F32, F16 and BF16 checkpoints"
            )
        shape = e.shape if len(e.shape) > 1 else (*e.shape, 1)
        array = np.memmap(path, dtype=np_dtype, mode="r", offset=e.begin, shape=shape)
        return ArraySource(name, array, e.dtype)

    def vector(self, name: str) -> Callable[[], np.ndarray]:
        return whole(self.source(name), flat=True)


def _hf_rope(cfg: dict[str, Any], rotary_dim: int) -> tuple[float, np.ndarray]:
    """(rope_theta, inverse frequencies) from an HF config, with its rope scaling applied."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    inv = rope_inv_freq(theta, rotary_dim)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, inv
    if kind == "linear":
        return theta, (inv / np.float32(params["factor"])).astype(np.float32)
    if kind == "llama3":
        return theta, llama3_inv_freq(inv, params)
    raise PycalmError(f"unsupported rope scaling {kind!r} (pycalm supports default, linear and llama3)")


def _hf_tokenizer(folder: Path) -> tuple[str, bytes, int | None]:
    """(kind, blob, bos id the tokenizer itself prepends or None if it says nothing)."""
    tj = folder / "tokenizer.json"
    if tj.is_file():
        blob = tj.read_bytes()
        try:
            post = json.loads(blob).get("post_processor") or {}
        except ValueError:
            raise PycalmError(f"{tj}: not valid JSON") from None
        return "tokenizers-json", blob, _template_bos(post)
    sp = folder / "tokenizer.model"
    if sp.is_file():
        return "sentencepiece", sp.read_bytes(), None
    raise PycalmError(f"{folder}: no tokenizer.json or tokenizer.model")


def _template_bos(post: dict[str, Any]) -> int:
    """The BOS id a tokenizers post-processor prepends to a single sequence, or -1.

    Llama-3's TemplateProcessing starts with <|begin_of_text|>; Qwen2's and SmolLM2's
    ByteLevel post-processors add nothing. This is what HF's own tokenizer does, so it decides.
    """
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            if single and "SpecialToken" in single[0]:
                tok = single[0]["SpecialToken"]["id"]
                ids = (p.get("special_tokens", {}).get(tok) or {}).get("ids") or []
                if ids:
                    return int(ids[0])
        if p.get("type") == "BertProcessing" or p.get("type") == "RobertaProcessing":
            return int(p["cls"][1])
    return -1


def _hf_chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str) and template:
        return template
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return ""


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value)]


def from_hf(folder: Path, dtype: str) -> Converted:
    """Plan the conversion of an HF folder (config.json, *.safetensors, tokenizer files)."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise PycalmError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    cfg = _read_json(cfg_path)
    archs = cfg.get("architectures") or []
    arch_name = archs[0] if archs else cfg.get("model_type", "?")
    if arch_name not in HF_ARCHS:
        raise PycalmError(f"unsupported architecture {arch_name} (pycalm converts {', '.join(HF_ARCHS)})")
    arch = HF_ARCHS[arch_name]
    try:
        dim = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or dim // n_heads)
        n_layers = int(cfg["num_hidden_layers"])
        hidden_dim = int(cfg["intermediate_size"])
        vocab_size = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise PycalmError(f"{cfg_path}: missing or bad field {e}") from None
    rope_params = cfg.get("rope_parameters") or {}
    partial = float(cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    theta, inv_freq = _hf_rope(cfg, rotary_dim)
    sliding = 0
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        # transformers windows only layers >= max_window_layers; pycalm has one window for all
        raise PycalmError(f"{folder}: Qwen2 with use_sliding_window (per-layer windows) is not supported")
    if arch in ("mistral", "mixtral"):
        sliding = int(cfg.get("sliding_window") or 0)
    n_experts = int(cfg.get("num_local_experts") or 0) if arch == "mixtral" else 0

    kind, blob, template_bos = _hf_tokenizer(folder)
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    bos = cfg.get("bos_token_id")
    bos_id = -1 if bos is None else int(bos)
    if template_bos is not None:  # tokenizer.json: its post-processor says what it prepends
        bos_id = template_bos
    if tok_cfg.get("add_bos_token") is False or ("bos_token" in tok_cfg and tok_cfg["bos_token"] is None):
        bos_id = -1
    eos = _eos_list(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():  # instruct models list their end-of-turn tokens here (Llama-3: eot_id)
        eos += [e for e in _eos_list(_read_json(gen_path).get("eos_token_id")) if e not in eos]

    ckpt = HFCheckpoint(folder)
    tied = bool(cfg.get("tie_word_embeddings", False)) or not ckpt.has("lm_head.weight")
    try:
        config = ModelConfig(
            arch=arch,
            dim=dim,
            hidden_dim=hidden_dim,
            head_dim=head_dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=vocab_size,
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rotary_dim=rotary_dim,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            bos_id=bos_id,
            eos_ids=tuple(eos),
            qkv_bias=arch == "qwen2",
            tied_embeddings=tied,
            n_experts=n_experts,
            n_experts_active=int(cfg.get("num_experts_per_tok") or 0) if n_experts else 0,
            sliding_window=sliding,
            weight_dtype=dtype,
        )
    except PycalmError as e:  # ModelConfig's own checks: name the file they came from
        raise PycalmError(f"{cfg_path}: {e}") from None

    q_perm = rotary_perm(n_heads, head_dim, rotary_dim)
    k_perm = rotary_perm(n_kv_heads, head_dim, rotary_dim)
    plan: dict[str, Any] = {
        "tok_embeddings": ckpt.source("model.embed_tokens.weight"),
        "rope_freqs": lambda: inv_freq,
        "norm": ckpt.vector("model.norm.weight"),
    }
    if not tied:
        plan["output"] = ckpt.source("lm_head.weight")
    for layer in range(n_layers):
        hf = f"model.layers.{layer}."
        p = f"layers.{layer}."
        att = hf + "self_attn."
        plan[p + "attn_norm"] = ckpt.vector(hf + "input_layernorm.weight")
        plan[p + "ffn_norm"] = ckpt.vector(hf + "post_attention_layernorm.weight")
        plan[p + "wqkv"] = Concat(
            [
                Permuted(ckpt.source(att + "q_proj.weight"), q_perm),
                Permuted(ckpt.source(att + "k_proj.weight"), k_perm),
                ckpt.source(att + "v_proj.weight"),
            ]
        )
        if config.qkv_bias:
            bias = Concat(
                [
                    Permuted(ckpt.source(att + "q_proj.bias"), q_perm),
                    Permuted(ckpt.source(att + "k_proj.bias"), k_perm),
                    ckpt.source(att + "v_proj.bias"),
                ]
            )
            plan[p + "bqkv"] = whole(bias, flat=True)
        plan[p + "wo"] = ckpt.source(att + "o_proj.weight")
        if n_experts:
            moe = hf + "block_sparse_moe."
            plan[p + "moe_gate"] = whole(ckpt.source(moe + "gate.weight"))
            for ours, theirs in (("w1", "w1"), ("w2", "w2"), ("w3", "w3")):
                plan[p + ours] = Concat(
                    [ckpt.source(f"{moe}experts.{e}.{theirs}.weight") for e in range(n_experts)]
                )
        else:
            plan[p + "w1"] = ckpt.source(hf + "mlp.gate_proj.weight")
            plan[p + "w2"] = ckpt.source(hf + "mlp.down_proj.weight")
            plan[p + "w3"] = ckpt.source(hf + "mlp.up_proj.weight")
    return Converted(config, plan, kind, blob, _hf_chat_template(folder, tok_cfg))


# ---------------------------------------------------------------------------------------------
# GGUF files


def _gguf_supported() -> dict[Any, str]:
    from gguf import GGMLQuantizationType as T

    return {
        t: t.name
        for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)
    }


class GGUFFile:
    """A GGUF file's key/values and tensors (memory-mapped by gguf.GGUFReader)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, IndexError, KeyError, OSError, TypeError) as e:
            raise PycalmError(
                f"{path}: not a readable GGUF file, truncated or corrupt ({e or type(e).__name__})"
            ) from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.supported = _gguf_supported()

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def source(
        self, name: str, shape: tuple[int, ...], rows_cols: tuple[int, int] | None = None
    ) -> GGUFSource:
        """Tensor `name`, checked to have numpy shape `shape`, as a source of rows.

        Rows are all leading axes flattened (experts first), unless rows_cols says otherwise
        (a bias of n values is read as n rows of one value, so it can be permuted like q/k rows).
        """
        t = self.tensors.get(name)
        if t is None:
            raise PycalmError(f"{self.path}: missing tensor {name!r}")
        if t.tensor_type not in self.supported:
            raise PycalmError(
                f"{self.path}: tensor {name!r} has type {t.tensor_type.name}; pycalm converts "
                f"{', '.join(self.supported.values())}"
            )
        got = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF ne[0] is the row length
        if got != shape:
            raise PycalmError(f"{self.path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        rows, cols = rows_cols or (int(np.prod(shape[:-1], dtype=np.int64)), shape[-1])
        return GGUFSource(name, t.data, t.tensor_type, rows, cols)

    def vector(self, name: str, n: int) -> Callable[[], np.ndarray]:
        return whole(self.source(name, (n,), (1, n)), flat=True)


def _gguf_tokenizer_fields(g: GGUFFile) -> dict[str, Any]:
    """The tokenizer.ggml.* key/values as plain Python values."""
    return {key: g.get(key) for key in g.reader.fields if key.startswith("tokenizer.ggml.")}


def _gguf_tokenizer(g: GGUFFile) -> bytes:
    """Build an HF tokenizers JSON from the GGUF vocabulary (pycalm.tokenizer does the work)."""
    fields = _gguf_tokenizer_fields(g)
    if "tokenizer.ggml.model" not in fields or "tokenizer.ggml.tokens" not in fields:
        raise PycalmError(f"{g.path}: no tokenizer vocabulary (tokenizer.ggml.model / tokens)")
    try:
        from pycalm.tokenizer import tokenizer_json_from_gguf
    except ImportError:
        raise PycalmError(
            "this pycalm cannot build a tokenizer from GGUF (pycalm.tokenizer missing)"
        ) from None
    text = tokenizer_json_from_gguf(fields)
    return text.encode("utf-8")


def _f32(value: float) -> float:
    """A GGUF float32 key as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def from_gguf(path: Path, dtype: str) -> Converted:
    """Plan the conversion of a GGUF file (llama or qwen2 architecture)."""
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
    theta = _f32(key("rope.freq_base", 10000.0))
    if "token_embd.weight" not in g.tensors:
        raise PycalmError(f"{path}: missing tensor 'token_embd.weight'")
    vocab_size = int(g.tensors["token_embd.weight"].shape[1])

    inv_freq = rope_inv_freq(theta, rotary_dim)
    scaling = g.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        inv_freq = (inv_freq / np.float32(key("rope.scaling.factor"))).astype(np.float32)
    elif scaling not in ("none", ""):
        raise PycalmError(f"{path}: unsupported rope scaling {scaling!r}")
    if g.has("rope_freqs.weight"):  # Llama-3.1: per-pair divisors of the inverse frequency
        divisors = g.vector("rope_freqs.weight", rotary_dim // 2)()
        inv_freq = (inv_freq / divisors).astype(np.float32)

    from pycalm.tokenizer import gguf_special_ids

    bos_id, eos_ids = gguf_special_ids(_gguf_tokenizer_fields(g))
    tied = not g.has("output.weight")
    try:
        config = ModelConfig(
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
            n_experts_active=int(key("expert_used_count", 0)) if n_experts else 0,
            sliding_window=0,
            weight_dtype=dtype,
        )
    except PycalmError as e:  # ModelConfig's own checks: name the file they came from
        raise PycalmError(f"{path}: {e}") from None

    # llama.cpp stores llama q/k already interleaved; qwen2 (NEOX rope) keeps rotate-half order
    permute = arch == "qwen2"
    q_dim, kv_dim = config.q_dim, config.kv_dim

    def qk(name: str, heads: int, shape: tuple[int, ...], rows_cols: tuple[int, int] | None = None) -> Source:
        src = g.source(name, shape, rows_cols)
        return Permuted(src, rotary_perm(heads, head_dim, rotary_dim)) if permute else src

    plan: dict[str, Any] = {
        "tok_embeddings": g.source("token_embd.weight", (vocab_size, dim)),
        "rope_freqs": lambda: inv_freq,
        "norm": g.vector("output_norm.weight", dim),
    }
    if not tied:
        plan["output"] = g.source("output.weight", (vocab_size, dim))
    for layer in range(n_layers):
        b = f"blk.{layer}."
        p = f"layers.{layer}."
        plan[p + "attn_norm"] = g.vector(b + "attn_norm.weight", dim)
        plan[p + "ffn_norm"] = g.vector(b + "ffn_norm.weight", dim)
        plan[p + "wqkv"] = Concat(
            [
                qk(b + "attn_q.weight", n_heads, (q_dim, dim)),
                qk(b + "attn_k.weight", n_kv_heads, (kv_dim, dim)),
                g.source(b + "attn_v.weight", (kv_dim, dim)),
            ]
        )
        if config.qkv_bias:
            bias = Concat(
                [
                    qk(b + "attn_q.bias", n_heads, (q_dim,), (q_dim, 1)),
                    qk(b + "attn_k.bias", n_kv_heads, (kv_dim,), (kv_dim, 1)),
                    g.source(b + "attn_v.bias", (kv_dim,), (kv_dim, 1)),
                ]
            )
            plan[p + "bqkv"] = whole(bias, flat=True)
        plan[p + "wo"] = g.source(b + "attn_output.weight", (dim, q_dim))
        if n_experts:
            gate = g.source(b + "ffn_gate_inp.weight", (n_experts, dim))
            plan[p + "moe_gate"] = whole(gate)
            plan[p + "w1"] = g.source(b + "ffn_gate_exps.weight", (n_experts, hidden_dim, dim))
            plan[p + "w2"] = g.source(b + "ffn_down_exps.weight", (n_experts, dim, hidden_dim))
            plan[p + "w3"] = g.source(b + "ffn_up_exps.weight", (n_experts, hidden_dim, dim))
        else:
            plan[p + "w1"] = g.source(b + "ffn_gate.weight", (hidden_dim, dim))
            plan[p + "w2"] = g.source(b + "ffn_down.weight", (dim, hidden_dim))
            plan[p + "w3"] = g.source(b + "ffn_up.weight", (hidden_dim, dim))
    blob = _gguf_tokenizer(g)
    return Converted(config, plan, "tokenizers-json", blob, g.get("tokenizer.chat_template", "") or "")


# ---------------------------------------------------------------------------------------------
# Writing


class Progress:
    """A one-line progress bar on stderr (tensors and megabytes written); silent when off."""

    def __init__(self, n_tensors: int, total_bytes: int, enabled: bool) -> None:
        self.n_tensors = n_tensors
        self.total = max(total_bytes, 1)
        self.enabled = enabled
        self.done_tensors = 0
        self.done_bytes = 0
        self.start = time.perf_counter()
        self._drawn = 0.0  # when the bar was last redrawn: at most ten redraws a second

    def update(self, nbytes: int, tensor_done: bool = False) -> None:
        self.done_bytes += nbytes
        self.done_tensors += tensor_done
        now = time.perf_counter()
        if not self.enabled or (now - self._drawn < 0.1 and self.done_tensors < self.n_tensors):
            return
        self._drawn = now
        frac = self.done_bytes / self.total
        bar = "#" * int(30 * frac)
        sys.stderr.write(
            f"\rconverting [{bar:<30}] {self.done_tensors}/{self.n_tensors} tensors "
            f"{self.done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB {now - self.start:.0f}s"
        )
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _write_matrix(w: ModelWriter, spec: TensorSpec, src: Source, dtype: str, progress: Progress) -> None:
    rows = int(np.prod(spec.shape[:-1], dtype=np.int64))
    cols = spec.shape[-1] * (formats.GF4_GROUP if dtype == "gf4" else 1)
    if (src.rows, src.cols) != (rows, cols):
        raise PycalmError(
            f"{src.label}: shape ({src.rows}, {src.cols}) does not make {spec.name} ({rows}, {cols})"
        )
    step = max(1, CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = src.take(np.arange(r0, r1))
        try:
            data = formats.encode(x, dtype)
        except ValueError as e:
            raise PycalmError(f"{src.label}: {e}") from None
        w.write(spec.name, data)
        progress.update(data.nbytes, tensor_done=r1 == rows)


def write_converted(conv: Converted, out: Path, progress: bool = True) -> Path:
    """Stream every planned tensor into the model file at `out`."""
    try:
        w = ModelWriter(out, conv.config, conv.tokenizer_kind, conv.tokenizer_blob, conv.chat_template)
    except ValueError as e:
        raise PycalmError(str(e)) from None
    bar = Progress(len(w.specs), w.total_bytes, progress)
    with w:
        for spec in w.pending():
            item = conv.plan[spec.name]
            if isinstance(item, Source):
                _write_matrix(w, spec, item, conv.config.weight_dtype, bar)
                continue
            vec = np.asarray(item(), dtype=np.float32)
            if vec.shape != spec.shape:
                raise PycalmError(
                    f"{spec.name}: source has shape {list(vec.shape)}, expected {list(spec.shape)}"
                )
            if not np.all(np.isfinite(vec)):
                raise PycalmError(f"{spec.name}: contains NaN or infinity")
            w.write(spec.name, vec)
            bar.update(vec.nbytes, tensor_done=True)
    bar.update(len(conv.tokenizer_blob), tensor_done=True)
    bar.finish()
    return out


def convert(src: str | Path, out: str | Path, dtype: str = "fp16", progress: bool = True) -> Path:
    """Convert an HF folder or a .gguf file at `src` into a pycalm model file at `out`."""
    src, out = Path(src), Path(out)
    if dtype not in WEIGHT_DTYPES:
        raise PycalmError(f"unsupported weight dtype {dtype!r} (one of {', '.join(WEIGHT_DTYPES)})")
    if not src.exists():
        raise PycalmError(f"source not found: {src}")
    if src.is_dir():
        conv = from_hf(src, dtype)
    else:
        with open(src, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise PycalmError(f"{src}: neither a Hugging Face folder nor a GGUF file")
        conv = from_gguf(src, dtype)
    return write_converted(conv, out, progress)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m pycalm.convert",
        description="Convert an HF folder or GGUF file to a pycalm model file.",
    )
    parser.add_argument("src", help="Hugging Face model folder, or a .gguf file")
    parser.add_argument("out", help="output pycalm model file (.safetensors)")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default="fp16", help="weight format (default fp16)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = convert(args.src, args.out, args.dtype, progress=not args.quiet)
    except PycalmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = path.stat().st_size
    print(
        f"wrote {path} ({size / 1e6:.1f} MB, {args.dtype}) in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
