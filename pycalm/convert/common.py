"""What a conversion is made of: row sources, the config and the plan (`Converted`).

A conversion is a plan: the config (`make_config`) and, for each output tensor, the source rows
it is made of (`make_plan`; `Source`: read, permuted, scaled, concatenated). The two readers,
pycalm.convert.hf (Hugging Face folders) and pycalm.convert.gguf (GGUF files), build it;
pycalm.convert.main streams it into a file.

Shapes: a source matrix is (rows, cols) = (out_features, in_features) in both HF and GGUF.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pycalm.errors import PycalmError
from pycalm.model import formats
from pycalm.model.config import ModelConfig

DEFAULT_BITS = 5.0  # q4's budget: bits a weight on average over the matrices, scales included
CHUNK_ELEMS = 1 << 21  # values per encoded chunk: 8 MB of float32; the encoders make float64 temporaries

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

    def encode_rows(self, idx: np.ndarray, dtype: str, group: int = 32) -> np.ndarray | formats.Quantized:
        """Rows idx in a weight dtype (q4: groups of `group`): read as float32 and encoded
        (pycalm.model.formats); a GGUF source on q4's grid transcodes its blocks instead."""
        return formats.encode(self.take(idx), dtype, group=group)

    def origin(self, dtype: str, group: int = 32) -> str:
        """How this source becomes `dtype`, for the converter's summary."""
        return f"{self.kind} quantized once" if dtype in formats.QUANTIZED else f"{self.kind} encoded"

    kind = "float"  # the source's number format (GGUF: its tensor type)
    on_q4_grid = False  # True: its rows transcode into q4 at groups of 32 without rounding


class Permuted(Source):
    """Rows of another source in a new order: new row j is old row perm[j]."""

    def __init__(self, base: Source, perm: np.ndarray) -> None:
        super().__init__(base.label, base.rows, base.cols)
        self.base = base
        self.perm = perm

    def take(self, idx: np.ndarray) -> np.ndarray:
        return self.base.take(self.perm[idx])

    def encode_rows(self, idx: np.ndarray, dtype: str, group: int = 32) -> np.ndarray | formats.Quantized:
        return self.base.encode_rows(self.perm[idx], dtype, group)

    def origin(self, dtype: str, group: int = 32) -> str:
        return self.base.origin(dtype, group)

    @property
    def kind(self) -> str:
        return self.base.kind

    @property
    def on_q4_grid(self) -> bool:
        return self.base.on_q4_grid


class Scaled(Source):
    """Rows of another source, each times its factor: row j is base row j * scale[j]. YaRN's
    attention factor enters the q and k rows this way (pycalm.convert.hf.yarn_rope)."""

    def __init__(self, base: Source, scale: np.ndarray) -> None:
        super().__init__(base.label, base.rows, base.cols)
        self.base = base
        self.scale = scale.astype(np.float32)  # (rows,)

    def take(self, idx: np.ndarray) -> np.ndarray:
        return self.base.take(idx) * self.scale[idx, None]

    @property
    def kind(self) -> str:
        return self.base.kind


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

    def encode_rows(self, idx: np.ndarray, dtype: str, group: int = 32) -> np.ndarray | formats.Quantized:
        """Each part's rows encoded its own way (every format encodes rows independently)."""
        if dtype not in formats.QUANTIZED:
            return super().encode_rows(idx, dtype, group)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        codes, scales = [], []
        for k, part in enumerate(self.parts):
            sel = np.nonzero(which == k)[0]
            if len(sel):
                enc = part.encode_rows(idx[sel] - self.starts[k], dtype, group)
                codes.append((sel, enc.codes))
                scales.append((sel, enc.scales))
        out = [np.empty((len(idx), *a[0][1].shape[1:]), a[0][1].dtype) for a in (codes, scales)]
        for (sel, c), (_, s) in zip(codes, scales, strict=True):
            out[0][sel], out[1][sel] = c, s
        return formats.Quantized(*out)

    def origin(self, dtype: str, group: int = 32) -> str:
        return " + ".join(dict.fromkeys(p.origin(dtype, group) for p in self.parts))

    @property
    def kind(self) -> str:
        return "+".join(dict.fromkeys(p.kind for p in self.parts))

    @property
    def on_q4_grid(self) -> bool:
        return all(p.on_q4_grid for p in self.parts)


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


# ---------------------------------------------------------------------------------------------
# The conversion plan: what each output tensor is made of


@dataclass
class Converted:
    """Everything the writer needs: config, per-tensor plan, tokenizer and chat template.

    plan maps each output tensor name to a Source (matrices, encoded in the weight dtype) or to
    a function returning a float32 array (norms, biases, router, rope_freqs).
    """

    config: ModelConfig
    plan: dict[str, Any]
    tokenizer_kind: str
    tokenizer_blob: bytes
    chat_template: str
    origins: dict[str, int] = field(default_factory=dict)  # how matrices were made: count


def make_config(source: Path, **hyperparameters: Any) -> ModelConfig:
    """The ModelConfig of a source's hyperparameters, named as ModelConfig's fields (from_hf and
    from_gguf read them). A dense model has no active experts; ModelConfig checks the rest, and
    its errors name the source file."""
    if not hyperparameters.get("n_experts"):
        hyperparameters.update(n_experts=0, n_experts_active=0)
    try:
        return ModelConfig(**hyperparameters)
    except PycalmError as e:
        raise PycalmError(f"{source}: {e}") from None


def rotary_scale(n_heads: int, head_dim: int, rotary_dim: int, factor: float) -> np.ndarray:
    """(n_heads * head_dim,) float32: `factor` on each head's rotated rows (the first rotary_dim,
    in either row order), 1 on the rest, which RoPE leaves alone."""
    rotated = np.arange(n_heads * head_dim) % head_dim < rotary_dim
    return np.where(rotated, np.float32(factor), np.float32(1.0)).astype(np.float32)


def make_plan(
    config: ModelConfig,
    rope_freqs: np.ndarray,
    tensor: Callable[[str, int], Source],
    permute_qk: bool,
    rope_scale: float = 1.0,
) -> dict[str, Any]:
    """The plan of every pycalm tensor, from `tensor(role, layer)`: the source of one of pycalm's
    tensors by name (layer -1 for the global ones), or of q, k, v and q_bias, k_bias, v_bias,
    fused here into wqkv / bqkv. q and k rows (biases too) go from rotate-half order to
    interleaved pairs when `permute_qk`. Mixtral's w1 / w2 / w3 are (n_experts, rows, cols).

    `rope_scale` multiplies RoPE's cos and sin in the source model (YaRN's attention factor). The
    rotation is linear, so rotating (a q) is a times rotating q: the rotated rows of q and k, and
    of their biases, are multiplied by it here, before encoding, and the runtime's RoPE stays
    plain. (A model with a norm on q and k after the projection would need it after the norm.)"""
    q_perm = rotary_perm(config.n_heads, config.head_dim, config.rotary_dim)
    k_perm = rotary_perm(config.n_kv_heads, config.head_dim, config.rotary_dim)
    q_scale = rotary_scale(config.n_heads, config.head_dim, config.rotary_dim, rope_scale)
    k_scale = rotary_scale(config.n_kv_heads, config.head_dim, config.rotary_dim, rope_scale)

    def fused(layer: int, suffix: str) -> Source:
        q, k, v = (tensor(name + suffix, layer) for name in ("q", "k", "v"))
        if rope_scale != 1.0:
            q, k = Scaled(q, q_scale), Scaled(k, k_scale)
        if permute_qk:
            q, k = Permuted(q, q_perm), Permuted(k, k_perm)
        return Concat([q, k, v])

    plan: dict[str, Any] = {
        "tok_embeddings": tensor("tok_embeddings", -1),
        "rope_freqs": lambda: rope_freqs,
        "norm": whole(tensor("norm", -1), flat=True),
    }
    if not config.tied_embeddings:
        plan["output"] = tensor("output", -1)
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        plan[p + "attn_norm"] = whole(tensor("attn_norm", layer), flat=True)
        plan[p + "ffn_norm"] = whole(tensor("ffn_norm", layer), flat=True)
        plan[p + "wqkv"] = fused(layer, "")
        if config.qkv_bias:
            plan[p + "bqkv"] = whole(fused(layer, "_bias"), flat=True)
        plan[p + "wo"] = tensor("wo", layer)
        if config.n_experts:
            plan[p + "moe_gate"] = whole(tensor("moe_gate", layer))  # float32 (n_experts, dim)
        for name in ("w1", "w2", "w3"):
            plan[p + name] = tensor(name, layer)
    return plan
