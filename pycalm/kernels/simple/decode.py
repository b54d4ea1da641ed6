"""Weight (r, c) of a stored matrix as float32: one device function a format.

Every simple kernel that reads weights (embed, matvec, matmul; the matmul's q8 aside, below)
calls `DECODE[dtype](w, scales, r, c)`, and attention reads the fp16 / fp8 KV cache through the
same two functions. The formats are pycalm.model.formats (the bit-level spec; formats.decode is
the NumPy twin of each):

    fp16  w (rows, cols) float16                      float32(w[r, c])
    fp8   w (rows, cols) uint8, e5m2                  e5m2_to_f32(w[r, c])
    gf4   w (rows, cols / 8) uint32, 8 a word         (q - 4) * (-s / 4): s the word's low byte
                                                      (e5m2), q bits 8 + 3k .. 10 + 3k, k = c % 8
    q8    codes (rows, cols) int8, scales (rows,)     scales[r] * codes[r, c]
    q4    codes (rows, cols / 8) uint32, 8 nibbles    d * q + m: q nibble k = c % 8 of word c / 8,
          scales (rows, groups, 2) float16 (d, m)     (d, m) of the group of G = cols / groups

Every decode is exact (the same float32 as formats.decode). It decodes one weight and reads its
word again for the next: the fast kernels (pycalm.kernels.common) decode a whole word at once.

The tensor-core matmul takes fp16 operands, where s * code of a q8 weight would lose up to 20
of its 31 bits: it takes the code (exact in fp16) from MMA_OPERAND and multiplies the row's
float32 sum by its scale (ROW_SCALE; 1 for the other formats), as the fast matmul does.
"""

from __future__ import annotations

from numba import cuda, float32, int32

from pycalm.kernels.common import as_f32

# fp32's exponent bias (127) minus e5m2's (15): an e5m2 byte's bits moved into an fp32 read as
# its value times 2**-112, for normals and subnormals alike
E5M2_IN_F32 = float(2.0**112)


@cuda.jit(device=True, inline=True)
def e5m2_to_f32(b):  # noqa: ANN001, ANN201
    """One e5m2 byte (sign, 5 exponent bits, 2 mantissa bits) -> float32: the sign to bit 31,
    the exponent and mantissa to bits 21..27 (the low end of fp32's exponent field and the top
    of its mantissa), read as fp32, times 2**112 to undo the difference of the biases."""
    b = int32(b)  # (a uint8 shifted left would keep 8 bits)
    return as_f32(((b & 0x80) << 24) | ((b & 0x7F) << 21)) * float32(E5M2_IN_F32)


@cuda.jit(device=True, inline=True)
def decode_fp16(w, scales, r, c):  # noqa: ANN001, ANN201
    return float32(w[r, c])


@cuda.jit(device=True, inline=True)
def decode_fp8(w, scales, r, c):  # noqa: ANN001, ANN201
    return e5m2_to_f32(w[r, c])


@cuda.jit(device=True, inline=True)
def decode_gf4(w, scales, r, c):  # noqa: ANN001, ANN201
    word = w[r, c // 8]
    q = int32((word >> (8 + 3 * (c % 8))) & 7)  # the code, 0..7 (signed: q - 4 may be negative)
    return float32(q - 4) * e5m2_to_f32(word & 0xFF) * float32(-0.25)


@cuda.jit(device=True, inline=True)
def decode_q8(w, scales, r, c):  # noqa: ANN001, ANN201
    return scales[r] * float32(w[r, c])


@cuda.jit(device=True, inline=True)
def decode_q4(w, scales, r, c):  # noqa: ANN001, ANN201
    q = (w[r, c // 8] >> (4 * (c % 8))) & 15  # the code, 0..15
    g = c // (8 * w.shape[1] // scales.shape[1])  # its group
    return float32(scales[r, g, 0]) * float32(q) + float32(scales[r, g, 1])


DECODE = {"fp16": decode_fp16, "fp8": decode_fp8, "gf4": decode_gf4, "q8": decode_q8, "q4": decode_q4}


@cuda.jit(device=True, inline=True)
def code_q8(w, scales, r, c):  # noqa: ANN001, ANN201
    return float32(w[r, c])


@cuda.jit(device=True, inline=True)
def unscaled(scales, r):  # noqa: ANN001, ANN201
    return float32(1.0)


@cuda.jit(device=True, inline=True)
def scale_q8(scales, r):  # noqa: ANN001, ANN201
    return scales[r] if r < scales.shape[0] else float32(0.0)


# the matmul's fp16 operand for W[r, c], and what row r's sums are multiplied by
MMA_OPERAND = {**DECODE, "q8": code_q8}
ROW_SCALE = {d: scale_q8 if d == "q8" else unscaled for d in DECODE}


def arrays(w: object, dtype: str) -> tuple[object, object]:
    """(w, scales) for the kernels: a q8 / q4 matrix's codes and scales (a formats.Quantized),
    any other matrix twice (its scales never read)."""
    return (w.codes, w.scales) if dtype in ("q8", "q4") else (w, w)
