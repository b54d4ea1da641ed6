"""Weight number formats: the bit-level spec, encode and decode in NumPy.

This module is the single definition of each format. The converter encodes with it, the
reference engine decodes with it, and the GPU decoders (pycalm.kernels.common) are tested
against it.

fp16  IEEE e5m10, stored as float16.
fp8   e5m2: the top byte of an fp16. Encoding rounds to nearest, ties to even, straight from
      the source value (no double rounding through fp16) and saturates to +-57344, the largest
      finite e5m2. There is no per-tensor scale.
gf4   8 consecutive weights of a row in one uint32. Bits 0-7: the group scale s as e5m2: the
      group's largest-magnitude element, keeping its sign, rounded to e5m2. Bits 8+3k..10+3k:
      code q_k in 0..7. Weight k = (q_k - 4) * (-s / 4), so the codes map to
      s * {1, .75, .5, .25, 0, -.25, -.5, -.75}. Encoder: q = rint(clip(-4 x / s + 4, 0, 7));
      s == 0 gives all-zero weights (codes 4).

q8    int8 codes with one scale per row. Codes: int8 (rows, cols), two's complement, values in
      -127..127 (-128 is never written). Scales: float32 (rows,). Weight (r, c) =
      scales[r] * codes[r, c], a float32 product (one rounding: the code has 8 bits).
      8 + 32 / cols bits a weight.
q4    4-bit codes in groups of G consecutive columns of a row (G = 32 or 64, cols a multiple of
      G), an fp16 step d and offset m per group. Codes: uint32 (rows, cols // 8): the code q
      (0..15) of column 8j + k (k = 0..7) is bits 4k..4k+3 of word j (little-endian nibbles in
      natural order). Scales: float16 (rows, cols // G, 2), [..., 0] = d and [..., 1] = m of
      group g = col // G. Weight = float32(d) * q + float32(m): d * q is exact in float32 (11 + 4
      bits), so the one rounding is the addition, fused or not. At G = 32 this is llama.cpp's
      Q4_1 block exactly (Q4_0 is m = -8 d, also exact in fp16). 4 + 32 / G bits a weight.

Stored arrays (rows, cols) of a matrix: fp16 -> float16 (rows, cols); fp8 -> uint8 (rows, cols);
gf4 -> uint32 (rows, cols // 8), cols a multiple of 8; q8 and q4 -> a Quantized(codes, scales)
pair of arrays as above. Stacked matrices (MoE experts, (n_experts, rows, cols)) carry the same
leading dims on every array, codes and scales alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

FP8_MAX = 57344.0  # largest finite e5m2: 1.75 * 2**15
FP8_MAX_BYTE = 0x7B  # its byte: exponent field 30, mantissa 3 (0x7C.. are inf and NaN)
FP16_MAX = 65504.0  # largest finite fp16
GF4_GROUP = 8
Q8_MAX = 127  # q8 codes are -127..127: symmetric, so -128 is never written
Q4_GROUPS = (32, 64)  # the q4 group sizes the format allows; 32 is llama.cpp's Q4_0/Q4_1 block
Q4_NIBBLES = 8  # q4 codes in one uint32 word
# the encoders' searches: q8 scales tried, as fractions of absmax / 127; q4 ranges tried, as
# extra steps over a group's min..max (negative: codes clip at the ends, positive: finer steps)
Q8_CANDIDATES = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8, 0.75)
Q4_CANDIDATES = (-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0)
ENCODE_BLOCK_ELEMS = 1 << 18  # values q8 / q4's searches take at a time (1 MB of float32: about an L2)

STORAGE_DTYPE = {"fp16": np.dtype(np.float16), "fp8": np.dtype(np.uint8), "gf4": np.dtype(np.uint32)}
STORAGE_DTYPE.update(q8=np.dtype(np.int8), q4=np.dtype(np.uint32))  # the codes array
SCALES_DTYPE = {"q8": np.dtype(np.float32), "q4": np.dtype(np.float16)}
QUANTIZED = tuple(SCALES_DTYPE)  # the dtypes stored as codes + scales


class Quantized(NamedTuple):
    """A q8 or q4 matrix: its codes and scales (NumPy arrays on the CPU, device arrays on the
    GPU), shapes as in the module docstring."""

    codes: object
    scales: object


def bits_per_weight(dtype: str, cols: int, group: int = 32) -> float:
    """Stored bits a weight of a row of `cols` weights, scales included."""
    return {"fp16": 16.0, "fp8": 8.0, "gf4": 4.0, "q8": 8.0 + 32.0 / cols, "q4": 4.0 + 32.0 / group}[dtype]


def storage_shape(rows: int, cols: int, dtype: str) -> tuple[int, int]:
    """Shape of the stored array of a (rows, cols) matrix in a weight dtype."""
    if dtype == "gf4":
        if cols % GF4_GROUP:
            raise ValueError(f"gf4 needs rows whose length is a multiple of {GF4_GROUP}, got {cols}")
        return rows, cols // GF4_GROUP
    if dtype == "q4":
        if cols % Q4_GROUPS[0]:
            raise ValueError(f"q4 needs rows whose length is a multiple of {Q4_GROUPS[0]}, got {cols}")
        return rows, cols // Q4_NIBBLES
    return rows, cols


def scales_shape(rows: int, cols: int, dtype: str, group: int = 32) -> tuple[int, ...]:
    """Shape of the scales array of a (rows, cols) q8 or q4 matrix (q4: groups of `group`)."""
    if dtype == "q8":
        return (rows,)
    if group not in Q4_GROUPS or cols % group:
        raise ValueError(f"q4 groups of {group} do not fit rows of {cols} (groups of {Q4_GROUPS})")
    return rows, cols // group, 2


# ---------------------------------------------------------------------------------------------
# fp16


def fp16_encode(x: np.ndarray) -> np.ndarray:
    """float -> float16, round to nearest even, saturating instead of overflowing to inf."""
    return np.clip(np.asarray(x, dtype=np.float32), -FP16_MAX, FP16_MAX).astype(np.float16)


def fp16_decode(w: np.ndarray) -> np.ndarray:
    return np.asarray(w, dtype=np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# fp8 e5m2


FP8_NAN_BYTE = 0x7F
_FP8_MIN_NORMAL = np.float32(2.0**-14)  # smallest normal e5m2; below it the quantum is 2**-16


def fp8_encode(x: np.ndarray) -> np.ndarray:
    """float -> e5m2 byte (uint8), round to nearest even from the source, saturating.

    float16 and float32 inputs take an integer path on the float32 bits (no float64 copy of the
    tensor, about 4x faster); other inputs take the float64 path, which is the same definition.
    """
    x = np.asarray(x)
    if x.dtype not in (np.float16, np.float32):
        return _fp8_encode_f64(x)
    x = x.astype(np.float32, copy=False)
    bits = x.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    mag = bits & np.uint32(0x7FFFFFFF)  # |x| as bits; monotone in |x|
    # Normal range (|x| >= 2**-14): keep the top 2 of float32's 23 mantissa bits, rounding the
    # 21 dropped bits to nearest even by adding 0xFFFFF plus the lowest kept bit; a carry moves
    # into the exponent, which is right. Then rebias the exponent from 127 to 15 (112 << 2).
    kept = (mag + (np.uint32(0xFFFFF) + ((mag >> 21) & 1))) >> 21
    normal = np.minimum(kept, np.uint32(FP8_MAX_BYTE + (112 << 2))) - np.uint32(112 << 2)
    # Below 2**-14 the step is 2**-16: |x| * 2**16 is exact in float32, and rint rounds it to
    # nearest even; the result 0..4 is the byte itself (4 is the smallest normal, 2**-14).
    ax = np.abs(x)
    small = np.rint(np.fmin(ax, _FP8_MIN_NORMAL) * np.float32(65536.0))  # fmin: no overflow, NaN -> 4
    out = np.where(ax < _FP8_MIN_NORMAL, small, normal).astype(np.uint8) | sign
    nan = np.isnan(x)
    if nan.any():
        out[nan] = FP8_NAN_BYTE  # converters reject NaN weights before this
    return out


def _fp8_encode_f64(x: np.ndarray) -> np.ndarray:
    """The same encoding through float64 arithmetic, for inputs wider than float32."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    _, e = np.frexp(ax)  # ax = m * 2**e, 0.5 <= m < 1, so floor(log2 ax) = e - 1
    # quantum of e5m2 at this magnitude: 2 mantissa bits; subnormals share 2**-16
    exp = np.maximum(e - 1, -14)
    quantum = np.ldexp(1.0, exp - 2)
    y = np.rint(ax / quantum) * quantum  # exact in float64; rint is ties-to-even
    y = np.minimum(np.where(np.isfinite(y), y, FP8_MAX), FP8_MAX)
    y = np.copysign(y, x)
    bits = y.astype(np.float16).view(np.uint16)  # exact: y is representable in e5m2
    out = (bits >> 8).astype(np.uint8)
    out[np.isnan(x)] = FP8_NAN_BYTE
    return out


def fp8_decode(b: np.ndarray) -> np.ndarray:
    """e5m2 byte -> float32 (exact)."""
    b = np.asarray(b, dtype=np.uint8)
    return (b.astype(np.uint16) << 8).view(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# gf4


def gf4_encode(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols // 8) uint32, per the spec above."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    storage_shape(rows, cols, "gf4")
    g = x.reshape(rows, cols // GF4_GROUP, GF4_GROUP)
    idx = np.argmax(np.abs(g), axis=-1)[..., None]
    s_byte = fp8_encode(np.take_along_axis(g, idx, axis=-1)[..., 0])  # (rows, groups)
    s = fp8_decode(s_byte)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(np.clip(-4.0 * g / s + 4.0, 0.0, 7.0))
    q = np.where(s == 0, 4.0, q).astype(np.uint32)
    shifts = (8 + 3 * np.arange(GF4_GROUP, dtype=np.uint32)).astype(np.uint32)
    packed = np.bitwise_or.reduce(q << shifts, axis=-1)
    return (packed | s_byte.astype(np.uint32)).astype(np.uint32)


def gf4_decode(w: np.ndarray) -> np.ndarray:
    """(rows, cols // 8) uint32 -> (rows, cols) float32."""
    w = np.asarray(w, dtype=np.uint32)
    s = fp8_decode((w & 0xFF).astype(np.uint8))[..., None]
    shifts = (8 + 3 * np.arange(GF4_GROUP, dtype=np.uint32)).astype(np.uint32)
    q = ((w[..., None] >> shifts) & 7).astype(np.float32)
    out = (q - 4.0) * (-s / 4.0)
    return out.reshape(*w.shape[:-1], w.shape[-1] * GF4_GROUP).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# the quantized formats' searches, a block of rows at a time


def _in_blocks(search: Callable[[np.ndarray], Quantized], x: np.ndarray) -> Quantized:
    """search(rows) over x (..., cols) float32 in blocks of about ENCODE_BLOCK_ELEMS values (whole
    rows), joined: the searches' dozens of passes over a block stay in the CPU's caches (a
    matrix of 7-10M weights: q4 1.8x and q8 2.7-4x faster than in one piece; the converter's chunks of
    2M values 1.2-1.5x), and the bits are the same (each row's, or each group's, search is its
    own)."""
    cols, lead = x.shape[-1], x.shape[:-1]
    rows = x.reshape(-1, cols)
    step = max(1, ENCODE_BLOCK_ELEMS // max(cols, 1))
    parts = [search(rows[r : r + step]) for r in range(0, rows.shape[0], step)] or [search(rows)]
    codes, scales = (np.concatenate([getattr(p, name) for p in parts]) for name in ("codes", "scales"))
    return Quantized(codes.reshape(*lead, *codes.shape[1:]), scales.reshape(*lead, *scales.shape[1:]))


# ---------------------------------------------------------------------------------------------
# q8


def q8_encode(x: np.ndarray) -> Quantized:
    """(..., cols) float -> Quantized(int8 (..., cols), float32 (...,)).

    Each row's scale is the one of Q8_CANDIDATES x absmax / 127 whose nearest codes give the
    smallest squared error, refined once by least squares (sum q x / sum q^2 for those codes);
    absmax / 127 itself is a candidate, so the search never does worse than it. The rows are
    searched a block at a time (_in_blocks).
    """
    return _in_blocks(_q8_search, np.asarray(x, dtype=np.float32))


def _q8_search(x: np.ndarray) -> Quantized:
    """q8_encode's search over every row of x (rows, cols) at once."""
    absmax = (np.abs(x).max(axis=-1) / np.float32(Q8_MAX)).astype(np.float32)
    best, best_err = absmax, np.full(absmax.shape, np.inf, np.float32)
    for factor in Q8_CANDIDATES:
        scale = (absmax * np.float32(factor)).astype(np.float32)
        for _ in range(2):  # the candidate, then its least-squares refinement
            codes = q8_codes(x, scale)
            err = _sq_error(x, q8_decode(Quantized(codes, scale)))
            better = err < best_err
            best, best_err = np.where(better, scale, best), np.where(better, err, best_err)
            q = codes.astype(np.float32)
            qq = _row_dot(q, q)
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = np.where(qq > 0, _row_dot(q, x) / qq, 0).astype(np.float32)
    return Quantized(q8_codes(x, best), best.astype(np.float32))


def q8_encode_absmax(x: np.ndarray) -> Quantized:
    """The plain encoder: scale absmax / 127 (the comparison for q8_encode's search)."""
    x = np.asarray(x, dtype=np.float32)
    scale = (np.abs(x).max(axis=-1) / np.float32(Q8_MAX)).astype(np.float32)
    return Quantized(q8_codes(x, scale), scale)


def _sq_error(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Squared error of each row (the last axis summed), float32."""
    d = y - x
    return _row_dot(d, d)


def _row_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The dot product of each row (the last axis), float32: NumPy's pairwise sum along the row,
    which gives a row the same bits whatever the rows beside it (np.einsum's can differ in the
    last bit between calls of different row counts: 2 rows against 9 at 14,336 columns)."""
    return (a * b).sum(axis=-1)


def q8_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest code of each weight for given row scales (a zero scale gives zero codes)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(np.asarray(x, np.float32) / scale[..., None])
    q = np.where(scale[..., None] == 0, 0, np.clip(q, -Q8_MAX, Q8_MAX))
    return q.astype(np.int8)


def q8_decode(w: Quantized) -> np.ndarray:
    codes, scales = np.asarray(w.codes, np.int8), np.asarray(w.scales, np.float32)
    return (scales[..., None] * codes.astype(np.float32)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# q4


def q4_pack(q: np.ndarray) -> np.ndarray:
    """(..., cols) codes 0..15 -> (..., cols // 8) uint32, column 8j + k in bits 4k..4k+3 of word j."""
    q = np.asarray(q, dtype=np.uint32)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // Q4_NIBBLES, Q4_NIBBLES)
    shifts = (4 * np.arange(Q4_NIBBLES)).astype(np.uint32)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def q4_unpack(w: np.ndarray) -> np.ndarray:
    """(..., cols // 8) uint32 -> (..., cols) uint8 codes 0..15."""
    w = np.asarray(w, dtype=np.uint32)
    shifts = (4 * np.arange(Q4_NIBBLES)).astype(np.uint32)
    q = (w[..., None] >> shifts) & np.uint32(15)
    return q.reshape(*w.shape[:-1], w.shape[-1] * Q4_NIBBLES).astype(np.uint8)


def q4_encode(x: np.ndarray, group: int = 32) -> Quantized:
    """(..., cols) float -> Quantized(uint32 (..., cols // 8), float16 (..., cols // group, 2)).

    Each group's d and m are chosen to minimise its squared error, as llama.cpp's make_qkx
    does: for each of Q4_CANDIDATES, codes from a shrunk or stretched min..max range, then the
    least-squares d and m for those codes; every candidate is rounded to fp16 and scored with
    its own nearest codes, and the best is kept. The plain min..max range (q4_encode_minmax) is
    the first candidate, so the search never does worse than it.

    The groups are searched a block of rows at a time (_in_blocks).
    """
    x = np.asarray(x, dtype=np.float32)
    scales_shape(1, x.shape[-1], "q4", group)
    return _in_blocks(lambda rows: _q4_search(rows, group), x)


def _q4_search(x: np.ndarray, group: int) -> Quantized:
    """q4_encode's search over every group of x (rows, cols) at once."""
    cols = x.shape[-1]
    g = x.reshape(*x.shape[:-1], cols // group, group)  # (..., groups, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    span = hi - lo
    best = q4_encode_minmax(x, group).scales
    best_err = _sq_error(g, _q4_group_decode(g, best))
    for stretch in Q4_CANDIDATES:  # codes spread over 15 + stretch steps of the range
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(span > 0, (15 + stretch) / span, 0).astype(np.float32)
        q = np.clip(np.rint((g - lo[..., None]) * inv[..., None]), 0, 15)
        # least squares for d, m over the fixed codes: min sum (d q + m - x)^2
        n = np.float32(group)
        sq, sx = q.sum(-1), g.sum(-1)
        sqq, sqx = (q * q).sum(-1), (q * g).sum(-1)
        det = n * sqq - sq * sq
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.where(det > 0, (n * sqx - sq * sx) / det, 0)
            m = np.where(det > 0, (sx - d * sq) / n, lo)
        scales = np.stack([fp16_encode(d), fp16_encode(m)], axis=-1)
        err = _sq_error(g, _q4_group_decode(g, scales))
        better = (err < best_err)[..., None]
        best, best_err = np.where(better, scales, best), np.minimum(err, best_err)
    return Quantized(q4_pack(q4_codes(x, best)), best.astype(np.float16))


def q4_encode_minmax(x: np.ndarray, group: int = 32) -> Quantized:
    """The plain encoder: each group's m is its min and d (max - min) / 15, both rounded to
    fp16; the codes are then the nearest for the stored d and m."""
    x = np.asarray(x, dtype=np.float32)
    cols = x.shape[-1]
    scales_shape(1, cols, "q4", group)
    g = x.reshape(*x.shape[:-1], cols // group, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    m = fp16_encode(lo)
    d = fp16_encode((hi - m.astype(np.float32)) / np.float32(15))
    scales = np.stack([d, m], axis=-1)
    return Quantized(q4_pack(q4_codes(x, scales)), scales)


def _q4_group_decode(g: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Groups g (..., groups, group) through their nearest codes for `scales` and back."""
    q = q4_codes(g.reshape(*g.shape[:-2], -1), scales).reshape(g.shape).astype(np.float32)
    return scales[..., 0:1].astype(np.float32) * q + scales[..., 1:2].astype(np.float32)


def q4_codes(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The nearest code 0..15 of each weight (..., cols) for given fp16 scales (..., groups, 2)."""
    x = np.asarray(x, dtype=np.float32)
    groups = scales.shape[-2]
    g = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    d = scales[..., 0:1].astype(np.float32)
    m = scales[..., 1:2].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((g - m) / d)
    q = np.where(d == 0, 0, np.clip(q, 0, 15))
    return q.astype(np.uint8).reshape(x.shape)


def q4_decode(w: Quantized) -> np.ndarray:
    q = q4_unpack(w.codes).astype(np.float32)
    scales = np.asarray(w.scales, dtype=np.float16)
    groups = scales.shape[-2]
    g = q.reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    d = scales[..., 0:1].astype(np.float32)
    m = scales[..., 1:2].astype(np.float32)
    return (d * g + m).astype(np.float32).reshape(q.shape)


# ---------------------------------------------------------------------------------------------


def take_rows(w: np.ndarray | Quantized, idx: int | np.ndarray) -> np.ndarray | Quantized:
    """Rows idx of a stored matrix (an embedding lookup): of each array, for a Quantized."""
    if isinstance(w, Quantized):
        return Quantized(w.codes[idx], w.scales[idx])
    return w[idx]


def encode(x: np.ndarray, dtype: str, *, group: int = 32) -> np.ndarray | Quantized:
    """Encode a float matrix (..., cols) into the stored array of a weight dtype (a Quantized
    for q8 and q4; `group` is q4's group size)."""
    x = np.asarray(x, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("weights contain NaN or infinity")
    if dtype == "fp16":
        return fp16_encode(x)
    if dtype == "fp8":
        return fp8_encode(x)
    if dtype == "gf4":
        lead = x.shape[:-1]
        return gf4_encode(x.reshape(-1, x.shape[-1])).reshape(*lead, -1)
    if dtype == "q8":
        return q8_encode(x)
    if dtype == "q4":
        return q4_encode(x, group)
    raise ValueError(f"unknown weight dtype {dtype!r}")


def decode(w: np.ndarray | Quantized, dtype: str) -> np.ndarray:
    """Decode a stored array (a Quantized for q8 and q4) back to float32 (..., cols).
    dtype "fp32": already decoded."""
    if dtype == "fp32":
        return np.asarray(w, dtype=np.float32)
    if dtype == "fp16":
        return fp16_decode(w)
    if dtype == "fp8":
        return fp8_decode(w)
    if dtype == "gf4":
        return gf4_decode(w)
    if dtype == "q8":
        return q8_decode(w)
    if dtype == "q4":
        return q4_decode(w)
    raise ValueError(f"unknown weight dtype {dtype!r}")
