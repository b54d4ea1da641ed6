"""The q8 and q4 dot products of the token step's row-group kernels (pycalm.kernels.matvec, qkv,
moe): integer codes times x in 16-bit integers, four products an instruction (dp4a).
pycalm.model.formats is the codes' spec; pycalm.cpu.reference.x_int16_ref is x's; tests/test_matvec.py ties
the kernels to both.

x in 16 bits. Each group of X_GROUP = 32 columns of x (the last group of a row may be shorter) is
staged as integers X_k = round(x_k / s) with s = max_k |x_k| / XQ, XQ = 32639, split into two
signed bytes X = 256 h + l (h, l in -128..127; XQ = 127 * 256 + 127 keeps h a byte): a q4 load
(32 columns) is one group, two q8 loads are one (four narrow ones). The rounding error |x_k - s X_k| <= s / 2 is at
most 1.5e-5 of the group's largest |x| (fp16 x would be 4.9e-4 of each value). Each load's scale
s and its sum of X are staged next to the limbs (pycalm.cpu.reference.x_int16_ref is the spec).

* q4 (4-bit codes, an fp16 step d and offset m a group of 32 or 64 columns): a word's eight codes
  are two words of four bytes, c0 = w & 0x0F0F0F0F (nibbles 0, 2, 4, 6) and c1 = (w >> 4) &
  0x0F0F0F0F (1, 3, 5, 7); x is staged in that order. Four dp4a sum the codes times both limbs:
  three integer instructions and four dp4a for eight weights. Once a load (32 columns, one group
  or half of one): S = 256 sum(q h) + sum(q l) (exact in int32 and in float32: |S| < 2^24), and
  the load adds s (d S + m sum X), which is sum (d q + m) s X: W times x as staged, exactly but
  for float32 rounding.
* q8 (int8 codes, a float32 scale a row): the stored bytes are dp4a's operand as they are: two
  dp4a (the two limbs) for four weights, no decode at all. Once a load the row's sum takes s S,
  and the row's sum is times its scale at the end.

The row-group kernels keep the two limbs' integer sums of a load apart (int32 accumulators, two
a row), so there is no float work a weight.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, uint64

from pycalm.cpu.reference import X_INT16_MAX  # x's 16-bit form, as the reference specifies it
from pycalm.kernels.common import dp4a_ss, dp4a_us, sar32, shl32

XQ = float(X_INT16_MAX)  # the largest |X|: 127 * 256 + 127 (h stays a signed byte)
NIBBLES = 0x0F0F0F0F  # the low nibble of each byte


@cuda.jit(device=True, inline=True)
def x_limbs(v: float, inv: float) -> tuple[int, int]:
    """x value v, the load's XQ / max |x| -> (h, l): X = round(v inv) = 256 h + l, both in
    -128..127 (|v inv| <= XQ)."""
    q = int32(math.floor(v * inv + float32(0.5)))
    h = sar32(int32(q + int32(128)), 8)
    return h, int32(q - shl32(h, 8))


@cuda.jit(device=True, inline=True)
def limb_byte(b: int, k: int) -> int:
    """A limb (-128..127) as byte k of a uint64 (its two's complement byte)."""
    return uint64(b & 0xFF) << uint64(8 * k)


@cuda.jit(device=True, inline=True)
def q4_dot8(w: int, hx: int, lx: int, ah: int, al: int) -> tuple[int, int]:
    """(ah + sum q_k h_k, al + sum q_k l_k) over the eight q4 codes of the int32 w (nibble k =
    bits 4k..4k+3) and the staged limb words hx, lx (uint64: the even-nibble columns' bytes in
    the low word, the odd ones' in the high word): two LOP3, one shift and four dp4a."""
    c0 = int32(int32(w) & int32(NIBBLES))  # nibbles 0, 2, 4, 6, one a byte
    c1 = int32(sar32(w, 4) & int32(NIBBLES))  # nibbles 1, 3, 5, 7
    ah = dp4a_us(c0, int32(hx), ah)
    ah = dp4a_us(c1, int32(hx >> uint64(32)), ah)
    al = dp4a_us(c0, int32(lx), al)
    al = dp4a_us(c1, int32(lx >> uint64(32)), al)
    return ah, al


@cuda.jit(device=True, inline=True)
def q8_dot4(w: int, x2: int, ah: int, al: int) -> tuple[int, int]:
    """(ah + sum q_k h_k, al + sum q_k l_k) over the four int8 codes of the int32 w and the
    staged limbs x2 (uint64: h bytes low, l bytes high): two dp4a."""
    ah = dp4a_ss(w, int32(x2), ah)
    al = dp4a_ss(w, int32(x2 >> uint64(32)), al)
    return ah, al


@cuda.jit(device=True, inline=True)
def limb_sum(ah: int, al: int) -> float:
    """256 ah + al as a float32 (the load's sum of codes times X)."""
    return float32(int32(shl32(ah, 8) + al))
