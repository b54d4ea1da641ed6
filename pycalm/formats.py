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

Stored arrays (rows, cols) of a matrix: fp16 -> float16 (rows, cols); fp8 -> uint8 (rows, cols);
gf4 -> uint32 (rows, cols // 8), cols a multiple of 8.
"""

from __future__ import annotations

import numpy as np

FP8_MAX = 57344.0  # largest finite e5m2: 1.75 * 2**15
FP8_MAX_BYTE = 0x7B  # its byte: exponent field 30, mantissa 3 (0x7C.. are inf and NaN)
FP16_MAX = 65504.0  # largest finite fp16
GF4_GROUP = 8

STORAGE_DTYPE = {"fp16": np.dtype(np.float16), "fp8": np.dtype(np.uint8), "gf4": np.dtype(np.uint32)}


def storage_shape(rows: int, cols: int, dtype: str) -> tuple[int, int]:
    """Shape of the stored array of a (rows, cols) matrix in a weight dtype."""
    if dtype == "gf4":
        if cols % GF4_GROUP:
            raise ValueError(f"gf4 needs rows whose length is a multiple of {GF4_GROUP}, got {cols}")
        return rows, cols // GF4_GROUP
    return rows, cols


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


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """Encode a float matrix (..., cols) into the stored array of a weight dtype."""
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
    raise ValueError(f"unknown weight dtype {dtype!r}")


def decode(w: np.ndarray, dtype: str) -> np.ndarray:
    """Decode a stored array back to float32 (..., cols). dtype "fp32": already decoded."""
    if dtype == "fp32":
        return np.asarray(w, dtype=np.float32)
    if dtype == "fp16":
        return fp16_decode(w)
    if dtype == "fp8":
        return fp8_decode(w)
    if dtype == "gf4":
        return gf4_decode(w)
    raise ValueError(f"unknown weight dtype {dtype!r}")
