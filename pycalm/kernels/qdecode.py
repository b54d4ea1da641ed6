"""The q8 and q4 decoders of the token step's row-group kernels (pycalm.kernels.matvec, qkv, moe);
pycalm.formats is their spec, tests/test_matvec.py ties them to it.

Both build fp16 halves by the magic-number trick: a small integer placed in the mantissa under a
fixed exponent reads as that power of two plus the integer, so one 32-bit operation makes two
values, and a cvt.f32.f16 (Hopper's HADD2.F32, no conversion unit) widens each exactly.

* q8 (int8 codes, a float32 scale a row): one XOR biases the four signed bytes of a word by 128,
  two byte permutes (prmt) put them under the exponent of 1024 (0x64 over a byte is the fp16
  1024 + byte, so each half reads as 1152 + code). No subtraction a weight: the kernels sum
  (1152 + q) x over a 16-column load and subtract 1152 X once a load (X: the load's x sum,
  staged with x), 7 instructions for 4 weights (a sub.f16x2 a pair would make it 9). The row's
  dot product is summed over the codes and times the scale once. The offset is large against
  the codes (|q| <= 127), so the load's sum is kept apart from the row's and its rounding is that
  of 16 terms of about 1152 |x|: tests/test_matvec.py holds the result to the same 1e-5 of
  sum |w| |x| as every other format.
* q4 (4-bit codes, an fp16 step d and offset m a group of 32 or 64 columns): a shift moves
  nibbles k and k + 4 of a word to bits 6..9 of its two halves and one LOP3 masks them under the
  exponent of 16 (0x4C00 | q << 6 reads as 16 + q): no subtraction a weight. A load's 32 weights
  sum (16 + q_k) x_k, and the group's step and offset come in once a load:
  d (S - 16 X) + m X = d S + (m - 16 d) X, X the sum of the load's x values (staged with x).
  The offset is 16 rather than the usual 1024 (nibble at bits 0..3) so that the folded sum
  loses no precision: S is at most 31 times the x sum, and its float32 rounding stays far below
  the weights' own.

All integer work is int32, shifts through shl32 / sar32 (pycalm.kernels.common: real numba
computes int32 shifts in int64).
"""

from __future__ import annotations

from numba import cuda, int32

from pycalm.kernels.common import and_or, h2f2, prmt, sar32, shl32

Q8_HALVES = 0x64646464  # prmt's second operand: 0x64 over a byte is the fp16 1024 + byte
Q4_NIBBLE_MASK = 0x03C003C0  # bits 6..9 of each half: a nibble there has the mantissa unit 1 ...
Q4_HALVES = 0x4C004C00  # ... under the fp16 exponent of 16: the half reads as 16 + q
Q4_OFFSET = 16.0  # what q4x8_raw adds to every code
Q8_OFFSET = 1152.0  # what q8x4_raw adds to every code


@cuda.jit(device=True, inline=True)
def q8x4_raw(w: int) -> tuple[float, float, float, float]:
    """Four q8 codes (the int8 bytes of the int32 w, byte 0 first) -> four exact float32
    1152 + code: XOR, two prmt, four cvt.f32.f16 (7 instructions for 4 weights)."""
    u = int32(int32(w) ^ int32(0x80808080 - (1 << 32)))  # signed b -> b + 128, 0..255
    f0, f1 = h2f2(prmt(u, int32(Q8_HALVES), int32(0x4140)))  # bytes 0, 1: 1024 + 128 + code
    f2, f3 = h2f2(prmt(u, int32(Q8_HALVES), int32(0x4342)))  # bytes 2, 3
    return f0, f1, f2, f3


@cuda.jit(device=True, inline=True)
def q4x8_raw(w: int) -> tuple[float, float, float, float, float, float, float, float]:
    """The eight q4 codes of the int32 w (nibble k = bits 4k..4k+3, k = 0 first) -> eight exact
    float32 16 + q_k: four shifts, four LOP3, eight cvt.f32.f16 (16 instructions for 8 weights)."""
    t = int32(w)
    mask, halves = int32(Q4_NIBBLE_MASK), int32(Q4_HALVES)
    f0, f4 = h2f2(and_or(shl32(t, 6), mask, halves))  # nibbles 0, 4: bits 0, 16 -> 6, 22
    f1, f5 = h2f2(and_or(shl32(t, 2), mask, halves))  # nibbles 1, 5: bits 4, 20
    f2, f6 = h2f2(and_or(sar32(t, 2), mask, halves))  # nibbles 2, 6: bits 8, 24
    f3, f7 = h2f2(and_or(sar32(t, 6), mask, halves))  # nibbles 3, 7: bits 12, 28 (sign copies masked)
    return f0, f1, f2, f3, f4, f5, f6, f7
