"""Device helpers shared by the kernels: the state layout, warp and block reductions, and the
bit-level decoders / encoders of the number formats (pycalm.formats is their spec; the tests tie
them to it bit for bit).

Decoding without conversion instructions (ARCHITECTURE.md, "the arithmetic budget"):

* fp16 and fp8 e5m2 share the fp16 layout (e5m2 is the top byte of an fp16). An fp16 bit pattern
  h placed in the top half of a 32-bit word, shifted right by 3 *arithmetically* and masked with
  0x8FFFE000, is an fp32 whose sign is h's sign and whose exponent and mantissa are h's, moved to
  the fp32 positions; read as a float it equals value(h) * 2**-112, exactly, for normals and
  subnormals alike (the fp32 result is subnormal or normal, never rounded). So one shift and one
  AND (two integer ops, no int-to-float conversion) decode a weight, and the factor 2**112
  (FP_RAW_SCALE) is applied once to the row's sum. For e5m2 the mask is 0x8FE00000 (the two
  mantissa bits only), and the byte is moved to the top of the word first (a left shift, free
  for the top byte).
* gf4: code q in bits p..p+2 of a word, masked in place and ORed with the exponent field
  (150 - p) << 23, reads as the float 2**(23-p) + q (the code lands in the mantissa with unit
  weight). Subtracting the constant 2**(23-p) + 4 leaves q - 4 exactly: one logic op and one
  float add per weight, no shift and no conversion. The group scale -s/4 is applied once per
  group of 8.

All integer work is in int32 (arithmetic right shifts, no signed/unsigned mixing: numba promotes
int32 op uint32 to int64, and uint64 op int64 to float64). Every literal is typed.

Under the simulator (NUMBA_ENABLE_CUDASIM=1) libdevice is missing, so the two bit casts fall
back to NumPy views; everything else is the same code.
"""

from __future__ import annotations

import math

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32
from numba.types import float16

STATE_TOKEN = 0  # state[0]: the current token id (int32, device memory)
STATE_POS = 1  # state[1]: the current position pos, 0-based; attention spans 0..pos

WARP = 32
FULL_MASK = 0xFFFFFFFF

FP_RAW_SCALE = float(2.0**112)  # raw decoded fp16 / e5m2 floats times this are the values
GF4_RAW_SCALE = float(-(2.0**110))  # raw gf4 sums times this: 2**112 / 4, and the minus of -s/4
FP16_MAX = 65504.0
FP8_MAX_BYTE = 0x7B  # e5m2 57344: exponent 30, mantissa 3
# int32 masks keeping the sign and the fp16 (e5m10) / e5m2 fields after the >> 3 that moves them
_MASK_FP16 = 0x8FFFE000 - (1 << 32)
_MASK_E5M2 = 0x8FE00000 - (1 << 32)

# ---------------------------------------------------------------------------------------------
# bit casts

if _numba_config.ENABLE_CUDASIM:

    def as_f32(i: int) -> np.float32:
        """int32 bit pattern -> float32 (simulator: a NumPy view)."""
        return np.array(int(i) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]

    def as_i32(f: float) -> np.int32:
        """float32 -> its int32 bit pattern (simulator: a NumPy view)."""
        return np.array(f, dtype=np.float32).view(np.int32)[()]

    def _sin_fast(r: float) -> np.float32:
        return np.float32(np.sin(np.float32(r)))

    def _cos_fast(r: float) -> np.float32:
        return np.float32(np.cos(np.float32(r)))

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _sin_fast(r: float) -> float:
        return libdevice.fast_sinf(float32(r))

    @cuda.jit(device=True, inline=True)
    def _cos_fast(r: float) -> float:
        return libdevice.fast_cosf(float32(r))

    @cuda.jit(device=True, inline=True)
    def as_f32(i: int) -> float:
        """int32 bit pattern -> float32 (a register move on the GPU)."""
        return libdevice.int_as_float(int32(i))

    @cuda.jit(device=True, inline=True)
    def as_i32(f: float) -> int:
        """float32 -> its int32 bit pattern (a register move on the GPU)."""
        return libdevice.float_as_int(float32(f))


@cuda.jit(device=True, inline=True)
def sincos(angle: float) -> tuple[float, float]:
    """(sin, cos) of a float32 angle (RoPE: pos * freq, |angle| < 4e5), to ~1e-6 absolute.

    libdevice's precise sinf/cosf carry a Payne-Hanek slow path (a local-memory array, float64);
    instead the angle is reduced to [-pi, pi] with a two-constant Cody-Waite step (2 pi =
    6.28125 + 1.9353e-3; k * 6.28125 is exact for k < 2**16) and the fast hardware sin / cos
    (absolute error ~2**-21 on [-pi, pi]) finish it."""
    k = math.floor(angle * float32(0.15915494309189535) + float32(0.5))
    r = angle - k * float32(6.28125)
    r = r - k * float32(0.0019353071795864769)
    return _sin_fast(r), _cos_fast(r)


# ---------------------------------------------------------------------------------------------
# reductions


@cuda.jit(device=True, inline=True)
def warp_reduce_sum(v: float) -> float:
    """Sum over the 32 lanes of a warp; every lane gets the result (xor butterfly).
    All 32 lanes must call it."""
    v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
    return v


@cuda.jit(device=True, inline=True)
def warp_reduce_max(v: float) -> float:
    """Maximum over the 32 lanes of a warp; every lane gets the result. All lanes must call."""
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 8))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 4))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 2))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 1))
    return v


@cuda.jit(device=True, inline=True)
def block_reduce_sum(v: float, scratch: cuda.devicearray) -> float:
    """Sum over all threads of the block (blockDim.x a multiple of 32, at most 1024); every
    thread gets the result. scratch: a float32 shared array of >= 32 elements. Every thread
    must call it; it contains two barriers, so scratch may be reused right after it returns."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    n_warps = cuda.blockDim.x // WARP
    v = warp_reduce_sum(v)
    if lane == 0:
        scratch[warp] = v
    cuda.syncthreads()  # every warp's partial sum is in scratch
    total = float32(0.0)
    for i in range(n_warps):
        total += scratch[i]
    cuda.syncthreads()  # everyone has read scratch before a later call overwrites it
    return total


@cuda.jit(device=True, inline=True)
def block_reduce_max(v: float, scratch: cuda.devicearray) -> float:
    """Maximum over all threads of the block; same contract as block_reduce_sum."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    n_warps = cuda.blockDim.x // WARP
    v = warp_reduce_max(v)
    if lane == 0:
        scratch[warp] = v
    cuda.syncthreads()  # every warp's partial maximum is in scratch
    total = scratch[0]
    for i in range(1, n_warps):
        total = max(total, scratch[i])
    cuda.syncthreads()  # everyone has read scratch before a later call overwrites it
    return total


# ---------------------------------------------------------------------------------------------
# decoders: "raw" results are value * 2**-112 (multiply by FP_RAW_SCALE once, outside loops)


@cuda.jit(device=True, inline=True)
def fp16_hi_raw(w: int) -> float:
    """The fp16 in bits 16-31 of the int32 w -> float32 value * 2**-112 (2 int ops)."""
    return as_f32((int32(w) >> int32(3)) & int32(_MASK_FP16))


@cuda.jit(device=True, inline=True)
def fp16_lo_raw(w: int) -> float:
    """The fp16 in bits 0-15 of the int32 w -> float32 value * 2**-112 (3 int ops)."""
    return as_f32(((int32(w) << int32(16)) >> int32(3)) & int32(_MASK_FP16))


@cuda.jit(device=True, inline=True)
def fp8_byte_raw(w: int, k: int) -> float:
    """Byte k (0..3, k a constant after inlining) of the int32 w as e5m2 -> value * 2**-112."""
    return as_f32(((int32(w) << int32(24 - 8 * k)) >> int32(3)) & int32(_MASK_E5M2))


@cuda.jit(device=True, inline=True)
def fp8x4_raw(w: int) -> tuple[float, float, float, float]:
    """Four e5m2 bytes of the int32 w (byte 0 first) -> four floats, value * 2**-112 each."""
    m = int32(_MASK_E5M2)  # 0x8FE00000: sign, then the 5 + 2 exponent / mantissa bits
    w = int32(w)
    f3 = as_f32((w >> int32(3)) & m)
    f2 = as_f32(((w << int32(8)) >> int32(3)) & m)
    f1 = as_f32(((w << int32(16)) >> int32(3)) & m)
    f0 = as_f32(((w << int32(24)) >> int32(3)) & m)
    return f0, f1, f2, f3


@cuda.jit(device=True, inline=True)
def fp8_decode(b: int) -> float:
    """One e5m2 byte (the low 8 bits of b) -> its float32 value (exact)."""
    return fp8_byte_raw(int32(b), 0) * float32(FP_RAW_SCALE)


@cuda.jit(device=True, inline=True)
def fp16_decode_bits(h: int) -> float:
    """One fp16 bit pattern (the low 16 bits of h) -> its float32 value (exact)."""
    return fp16_lo_raw(int32(h)) * float32(FP_RAW_SCALE)


@cuda.jit(device=True, inline=True)
def gf4_scale(w: int) -> float:
    """The group factor -s/4 of a gf4 word (s: its low byte as e5m2), exact: weight k of the
    group is (q_k - 4) * gf4_scale(w)."""
    return fp8_byte_raw(int32(w), 0) * float32(GF4_RAW_SCALE)


@cuda.jit(device=True, inline=True)
def gf4_code(w: int, k: int) -> float:
    """q_k - 4 of a gf4 word as an exact float32 (k a constant after inlining): the code is
    masked in place and given an exponent that makes its mantissa unit 1, see the docstring.
    Codes 5..7 (bits 23..31) are moved down 12 bits first so that their mantissa fits."""
    w = int32(w)
    if k >= 5:
        w = w >> int32(12)  # arithmetic: the copied sign bits land above bit 22, masked off
        p = 8 + 3 * k - 12
    else:
        p = 8 + 3 * k
    e = int32(150 - p) << int32(23)  # exponent field: the mantissa unit becomes 1
    return (as_f32((w & (int32(7) << int32(p))) | e) - as_f32(e)) - float32(4.0)


@cuda.jit(device=True, inline=True)
def gf4_decode(w: int, k: int) -> float:
    """Weight k (0..7) of a gf4 word -> float32 (exact)."""
    return gf4_code(w, k) * gf4_scale(w)


@cuda.jit(device=True, inline=True)
def gf4_dot8_raw(
    w: int, x0: float, x1: float, x2: float, x3: float, x4: float, x5: float, x6: float, x7: float
) -> float:
    """sum_k weight_k * x_k over one gf4 group, times -2**-110 * ... i.e. "raw": multiply by
    GF4_RAW_SCALE once per row. 8 FMAs on exact codes q - 4, then the group's raw e5m2 scale."""
    w = int32(w)
    u = w >> int32(12)
    acc = (as_f32((w & int32(0x700)) | int32(142 << 23)) - float32(2.0**15 + 4.0)) * x0
    acc += (as_f32((w & int32(0x3800)) | int32(139 << 23)) - float32(2.0**12 + 4.0)) * x1
    acc += (as_f32((w & int32(0x1C000)) | int32(136 << 23)) - float32(2.0**9 + 4.0)) * x2
    acc += (as_f32((w & int32(0xE0000)) | int32(133 << 23)) - float32(2.0**6 + 4.0)) * x3
    acc += (as_f32((w & int32(0x700000)) | int32(130 << 23)) - float32(2.0**3 + 4.0)) * x4
    acc += (as_f32((u & int32(0x3800)) | int32(139 << 23)) - float32(2.0**12 + 4.0)) * x5
    acc += (as_f32((u & int32(0x1C000)) | int32(136 << 23)) - float32(2.0**9 + 4.0)) * x6
    acc += (as_f32((u & int32(0xE0000)) | int32(133 << 23)) - float32(2.0**6 + 4.0)) * x7
    return acc * fp8_byte_raw(w, 0)


@cuda.jit(device=True, inline=True)
def gf4_dot8(
    w: int, x0: float, x1: float, x2: float, x3: float, x4: float, x5: float, x6: float, x7: float
) -> float:
    """sum_k weight_k * x_k over one gf4 group (the scale applied)."""
    return gf4_dot8_raw(w, x0, x1, x2, x3, x4, x5, x6, x7) * float32(GF4_RAW_SCALE)


# ---------------------------------------------------------------------------------------------
# encoders for the KV-cache write (bit-exact with pycalm.formats)


@cuda.jit(device=True, inline=True)
def fp16_encode(x: float) -> float:
    """float32 -> float16, round to nearest even, saturating at +-65504 (formats.fp16_encode)."""
    return float16(min(max(float32(x), float32(-FP16_MAX)), float32(FP16_MAX)))


@cuda.jit(device=True, inline=True)
def fp8_encode(x: float) -> int:
    """float32 -> e5m2 byte (int32 0..255): round to nearest even straight from the float32,
    saturating to +-57344 (formats.fp8_encode). NaN -> 0x7F."""
    u = as_i32(float32(x))
    sign = (u >> int32(24)) & int32(0x80)
    a = u & int32(0x7FFFFFFF)
    if a > int32(0x7F800000):  # NaN
        return int32(0x7F)
    if a >= int32(0x47600000):  # >= 57344 (and inf): saturate
        return sign | int32(FP8_MAX_BYTE)
    if a >= int32(0x38800000):  # >= 2**-14: normal in e5m2; round the low 21 bits to even
        r = a + int32(0xFFFFF) + ((a >> int32(21)) & int32(1))
        return sign | ((r >> int32(21)) - int32(448))  # 448 = (127 - 15) << 2, the exponent rebias
    # subnormal in e5m2: a multiple of 2**-16; round |x| * 2**16 (exact) to an integer, ties to
    # even, with the 1.5 * 2**23 magic: the float32 add rounds to nearest even and leaves the
    # integer in the low mantissa bits
    y = as_f32(a) * float32(65536.0)
    return sign | (as_i32(y + float32(12582912.0)) - int32(0x4B400000))
