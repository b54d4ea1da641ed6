"""q8 and q4 models: GGUF blocks transcoded without rounding, and the mixed-precision policy.

Transcoding (docs/QUANTIZATION.md). A q4 group of 32 weights is llama.cpp's Q4_1 block
(w = d q + m, d and m fp16), so GGUF blocks on that grid become q4 codes and scales as they
are, never dequantized and quantized again:

    Q4_0  w = d (q - 8)           -> d, m = -8 d (exact: a power-of-two multiple of an fp16)
    Q4_1  w = d q + m             -> d, m
    Q4_K  w = (d sc) q - dmin mn  per sub-block of 32 (6-bit sc and mn, fp16 d and dmin of the
                                    super-block of 256) -> d sc and -dmin mn, exact when both
                                    products are fp16 numbers; otherwise they are rounded to
                                    fp16 once and the codes kept (q4_from_gguf counts them)

Every other source (F32, F16, BF16, Q8_0, Q5_*, Q6_K) is dequantized exactly and quantized
once by pycalm.model.formats' encoders: Q8_0 into q8 is one rounding, since its scale is per block
of 32 and q8's per row.

The policy (`--dtype q4`, the converter's default for q4) decides each matrix's format and
q4 group within a budget of bits a weight (scales included, over every matrix): sensitive
matrices in q8, the others in q4, groups of 32 where the source is on that grid and 64 for
the freshly quantized ones, then finer groups where the budget has room (plan_dtypes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pycalm.model import formats
from pycalm.model.config import ModelConfig

Q4_BLOCK = 32  # weights in a Q4_0 / Q4_1 block and a Q4_K sub-block: q4's group of 32
Q4_K_BLOCK = 256  # weights in a Q4_K super-block
# bytes of a block: Q4_0: fp16 d, 16 bytes of nibbles; Q4_1: fp16 d, m, nibbles;
# Q4_K: fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
TRANSCODED = tuple(BLOCK_BYTES)  # the GGUF types that become q4 (groups of 32) as they are


# ---------------------------------------------------------------------------------------------
# GGUF blocks -> q4


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) little-endian bytes -> (...) float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes of a Q4_0 / Q4_1 block -> (..., 32) codes: byte j holds weight j in its
    low nibble and weight j + 16 in its high one."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def q4_from_gguf(raw: np.ndarray, qtype: str, cols: int) -> tuple[formats.Quantized, int]:
    """Rows of GGUF blocks (rows, bytes per row) uint8 of type `qtype` (one of TRANSCODED) ->
    (q4 at groups of 32, how many groups had their d or m rounded to fp16: 0 but for Q4_K
    sub-blocks whose products are not fp16 numbers)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    if qtype == "Q4_K":
        sb = raw.reshape(rows, cols // Q4_K_BLOCK, BLOCK_BYTES[qtype])  # (rows, super-blocks, 144)
        d, dmin = _f16(sb[..., 0:2]).astype(np.float32), _f16(sb[..., 2:4]).astype(np.float32)
        sc, mn = _q4_k_scales(sb[..., 4:16])  # (rows, super-blocks, 8) each
        qs = sb[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 chunks of 64 weights
        q = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(rows, cols)  # low: sub-block 2c
        step = (d[..., None] * sc).reshape(rows, -1)  # float32, exact: 11 + 6 bits
        offset = -(dmin[..., None] * mn).reshape(rows, -1)
        scales = np.stack([step.astype(np.float16), offset.astype(np.float16)], axis=-1)
        rounded = (scales[..., 0] != step) | (scales[..., 1] != offset)
        return formats.Quantized(formats.q4_pack(q), scales), int(rounded.sum())
    blocks = raw.reshape(rows, cols // Q4_BLOCK, BLOCK_BYTES[qtype])
    d = _f16(blocks[..., 0:2])
    if qtype == "Q4_0":
        m = (d.astype(np.float32) * np.float32(-8)).astype(np.float16)  # exact unless |d| > 8188
        q = _nibbles(blocks[..., 2:])
    else:
        m = _f16(blocks[..., 2:4])
        q = _nibbles(blocks[..., 4:])
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(m))):
        raise ValueError(f"{qtype} blocks with a scale that is not finite (or too large for q4)")
    return formats.Quantized(formats.q4_pack(q.reshape(rows, cols)), np.stack([d, m], axis=-1)), 0


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K super-blocks (..., 12) -> the 8 sub-blocks' 6-bit scales and
    mins (..., 8) float32, unpacked as llama.cpp's get_scale_min_k4."""
    s = s.astype(np.uint8)
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63  # sub-blocks 0..3
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)  # sub-blocks 4..7
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = np.concatenate([lo_sc, hi_sc], axis=-1).astype(np.float32)
    mn = np.concatenate([lo_mn, hi_mn], axis=-1).astype(np.float32)
    return sc, mn


# ---------------------------------------------------------------------------------------------
# bits a weight


def matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every matrix of a model: name -> (weights, cols), the weights counting every expert."""
    experts = max(config.n_experts, 1)
    shapes = {"tok_embeddings": (config.vocab_size * config.dim, config.dim)}
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        shapes[p + "wqkv"] = (config.qkv_dim * config.dim, config.dim)
        shapes[p + "wo"] = (config.dim * config.q_dim, config.q_dim)
        shapes[p + "w1"] = (experts * config.hidden_dim * config.dim, config.dim)
        shapes[p + "w2"] = (experts * config.dim * config.hidden_dim, config.hidden_dim)
        shapes[p + "w3"] = (experts * config.hidden_dim * config.dim, config.dim)
    if not config.tied_embeddings:
        shapes["output"] = (config.vocab_size * config.dim, config.dim)
    return shapes


def tensor_bits(config: ModelConfig, name: str, cols: int) -> float:
    """Stored bits a weight of matrix `name` in `config` (its scales included)."""
    return formats.bits_per_weight(config.dtype_of(name), cols, config.group_of(name))


def average_bits(config: ModelConfig) -> float:
    """Stored bits a weight over every matrix of the model, scales included (the norms, biases
    and router, float32 and a few thousandths of the weights, are not counted)."""
    shapes = matrix_shapes(config)
    total = sum(n * tensor_bits(config, name, cols) for name, (n, cols) in shapes.items())
    return total / sum(n for n, _ in shapes.values())


# ---------------------------------------------------------------------------------------------
# the mixed-precision policy


@dataclass(frozen=True)
class Step:
    """One change the policy may make: matrix `name` to `dtype` (and q4 `group`)."""

    name: str
    dtype: str
    group: int = 32


def sensitive(config: ModelConfig) -> list[str]:
    """The matrices known to be sensitive, most first: the embedding table when the classifier
    is tied to it, the classifier, then the first and last layers' down projection."""
    names = ["tok_embeddings"] if config.tied_embeddings else ["output"]
    return [*names, "layers.0.w2", f"layers.{config.n_layers - 1}.w2"]


def default_steps(config: ModelConfig, on_grid: set[str]) -> list[Step]:
    """The policy without calibration: the sensitive matrices to q8, then the freshly
    quantized matrices from groups of 64 to 32, the classifier's first, then in file order."""
    steps = [Step(name, "q8") for name in sensitive(config)]
    for name in ["output", "tok_embeddings", *matrix_shapes(config)]:
        if name in matrix_shapes(config) and name not in on_grid and Step(name, "q4") not in steps:
            steps.append(Step(name, "q4"))
    return steps


def plan_dtypes(
    config: ModelConfig, on_grid: set[str], bits: float, steps: Sequence[Step] | None = None
) -> ModelConfig:
    """The config of a q4 model under the policy, at most `bits` a weight on average.

    Start: every matrix q4, in groups of 32 where the source is on q4's grid (`on_grid`: GGUF
    Q4_0 / Q4_1 / Q4_K, transcoded without rounding) and of 64 elsewhere (where the row length
    allows). Then take `steps` in order (default_steps, or the calibration's ranking), each only
    if the average stays within `bits`: a matrix to q8, or a q4 matrix to groups of 32. Matrices
    on the grid stay as transcoded: q8 would round their exact values again.
    """
    shapes = matrix_shapes(config)
    dtypes = {name: "q4" for name in shapes}
    groups = {name: 32 if name in on_grid or shapes[name][1] % 64 else 64 for name in shapes}

    def made() -> ModelConfig:
        return config.replace(
            weight_dtype="q4",
            tensor_dtypes=tuple((n, d) for n, d in dtypes.items() if d != "q4"),
            q4_group=32,
            q4_groups=tuple((n, g) for n, g in groups.items() if g != 32 and dtypes[n] == "q4"),
        )

    for step in default_steps(config, on_grid) if steps is None else steps:
        if step.name not in shapes:
            continue
        if step.name in on_grid:
            continue  # transcoded without rounding: any other format would round it again
        cols = shapes[step.name][1]
        before = dtypes[step.name], groups[step.name]
        if formats.bits_per_weight(step.dtype, cols, step.group) <= formats.bits_per_weight(
            before[0], cols, before[1]
        ):
            continue  # the step would not add precision (the matrix already has as much)
        dtypes[step.name], groups[step.name] = step.dtype, step.group
        if average_bits(made()) > bits + 1e-9:
            dtypes[step.name], groups[step.name] = before
    return made()
