"""The device functions of the row-group kernels (pycalm.kernels.matvec, qkv, moe): x staged in
shared memory, a row group's loads and its dot products, and the weight decoders of each dtype.
pycalm.kernels.matvec's docstring has the thread mapping, the layout of x and the decode
instruction counts; this module is their code.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from pycalm.cpu.reference import X_GROUP
from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    FULL_MASK,
    GF4_RAW_SCALE,
    WARP,
    as_f32,
    as_i32,
    block_reduce_sum,
    fp8x4_cvt,
    gf4_dot8_raw,
    h2f2,
    ldg128,
    shl32,
    warp_reduce_sum,
)
from pycalm.kernels.qdecode import XQ, limb_byte, limb_sum, q4_dot8, q8_dot4, x_limbs
from pycalm.model.formats import Quantized

XCHUNK = 8192  # floats of x staged in shared memory at a time (32 KiB, as 4096 uint64 pairs)
XPAIRS = XCHUNK // 2
PART_WEIGHTS = {"fp16": 2, "fp8": 4, "gf4": 8, "q8": 4, "q4": 8}  # weights in one 32-bit part of a load
# the loads of rows not a multiple of 16 bytes (q4 rows always are: cols is a multiple of 32)
NARROW_BYTES = {"fp16": 8, "fp8": 8, "gf4": 4, "q8": 8}
ROW_SCALE = {
    "fp16": 1.0,
    "fp8": 1.0,
    "gf4": GF4_RAW_SCALE,
    "q8": 1.0,
    "q4": 1.0,
}  # a row's raw sum times this


@cuda.jit(device=True, inline=True)
def fp16_part_dot(t: int, xv: cuda.devicearray, acc: float) -> float:
    """acc + the two fp16 weights of the int32 t (low half first) times xv[0], xv[1]."""
    f0, f1 = h2f2(t)
    acc += f0 * xv[0]
    acc += f1 * xv[1]
    return acc


@cuda.jit(device=True, inline=True)
def fp8_part_dot(t: int, xv: cuda.devicearray, acc: float) -> float:
    """acc + the four e5m2 weights of the int32 t (byte 0 first) times xv[0..3]."""
    f0, f1, f2, f3 = fp8x4_cvt(t)
    acc += f0 * xv[0]
    acc += f1 * xv[1]
    acc += f2 * xv[2]
    acc += f3 * xv[3]
    return acc


@cuda.jit(device=True, inline=True)
def gf4_part_dot(t: int, xv: cuda.devicearray, acc: float) -> float:
    """acc + the gf4 group t (8 codes and its scale) times xv[0..7], raw: times GF4_RAW_SCALE
    for the value."""
    return acc + gf4_dot8_raw(t, xv[0], xv[1], xv[2], xv[3], xv[4], xv[5], xv[6], xv[7])


PART_DOT = {
    "fp16": fp16_part_dot,
    "fp8": fp8_part_dot,
    "gf4": gf4_part_dot,
}  # q8, q4: pycalm.kernels.qdecode's integer dot products


@cuda.jit(device=True, inline=True)
def pair_times(v: int, norm_w: cuda.devicearray, i: int) -> int:
    """A uint64 pair of floats (x[i], x[i + 1]) times (norm_w[i], norm_w[i + 1]), repacked (i
    uint64: no negative-index code)."""
    lo = as_f32(v) * norm_w[i]
    hi = as_f32(v >> uint64(32)) * norm_w[i + uint64(1)]
    return uint64(uint32(as_i32(lo))) | (uint64(uint32(as_i32(hi))) << uint64(32))


@cuda.jit(device=True, inline=True)
def pair_sq(v: int) -> float:
    """x[i]^2 + x[i + 1]^2 of a uint64 pair of floats."""
    lo = as_f32(v)
    hi = as_f32(v >> uint64(32))
    return lo * lo + hi * hi


@cuda.jit(device=True, inline=True)
def staged_rms(ss: float, n: int, eps: float, scratch: cuda.devicearray) -> float:
    """rsqrt(mean(x^2) + eps) from every thread's stage_x sum of squares over all n values of
    x. Its barrier also publishes what stage_x wrote to shared memory, so a fused RMSNorm costs
    no extra pass over x and no extra barrier. All threads must call it."""
    ss = warp_reduce_sum(ss)
    if cuda.threadIdx.x % WARP == 0:
        scratch[cuda.threadIdx.x // WARP] = ss
    cuda.syncthreads()  # the warps' sums, and the staged x, are in shared memory
    t = float32(0.0)
    for w in range(cuda.blockDim.x // WARP):
        t += scratch[w]
    return float32(1.0) / math.sqrt(t / float32(n) + float32(eps))


@cuda.jit(device=True, inline=True)
def rms_factor(x: cuda.devicearray, eps: float, scratch: cuda.devicearray) -> float:
    """rsqrt(mean(x^2) + eps) over the whole of x, computed by the whole block (for x longer
    than a chunk; x is small and in L2). Contains barriers: all threads must call it."""
    s = float32(0.0)
    for i in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        v = x[i]
        s += v * v
    s = block_reduce_sum(s, scratch)
    return float32(1.0) / math.sqrt(s / float32(x.shape[0]) + float32(eps))


class RowGroup(NamedTuple):
    """The device functions of a row-group kernel (see row_group), and the sizes of the arrays a
    kernel allocates for them."""

    stage_x: object
    load_first: object
    group_dot: object
    group_shift: object
    xsums: int  # shared float32 (q4, q8: a sum and a scale a load of the chunk; else 1, unused)
    scales: int  # local scale slots a lane holds (q4: a word a load of a step; q8: a row's scale)
    scale_type: object  # their numba type


@functools.cache
def row_group(dtype: str, load_bytes: int, rows: int, unroll: int, split: int) -> RowGroup:
    """The device functions that read a row group, for compile-time sizes: the weight dtype, the
    bytes a load (16: ldg128; 8: one uint64; 4: one uint32), rows a warp, loads a row a lane a
    step, and the warps that share a group. The loaded words, the x values of a part and the
    row sums are cuda.local.array of constant size indexed in loops of constant trip count:
    LLVM unrolls the loops fully and keeps the arrays in registers.

    q8 and q4 also read scales (sa, sb: those of wa, wb): q8 a float32 a row, loaded with the
    group's first step and multiplied into the lane's sums at the end of group_dot; q4 a uint32
    word a group (its fp16 step d and offset m), loaded with each 16-byte load (32 weights: a
    group of 32, or half a group of 64: group index = load index >> group_shift) and applied
    once a load, with the load's sum of X. Both multiply the codes by x in 16-bit integers
    (stage_limbs stages them, dot_load sums with dp4a; pycalm.kernels.qdecode)."""
    WORDS = max(1, load_bytes // 8)  # array elements a load (uint64; uint32 for 4-byte loads)
    PARTS = load_bytes // 4  # int32 parts a load
    PW = PART_WEIGHTS[dtype]
    E = PARTS * PW  # weights a load
    CW = XCHUNK // E  # loads a chunk
    HALF_E = E // 2  # x pairs a load
    STEP = uint64(WARP * unroll * split)  # a warp's loads a row a step
    SPAN = uint64(WARP * (unroll - 1))  # a step is whole when its last load is in the row
    HALF = max(1, rows // 2)  # GATE: rows of W1 (the rest are W3's)
    part_dot = PART_DOT.get(dtype)
    wide = load_bytes == 16
    Q4 = dtype == "q4"  # a group scale a load
    SUMS = dtype in ("q4", "q8")  # x in 16-bit integers (two byte limbs); a scale and a sum of X a load
    XQ_F = float32(XQ)
    WORD_PAIRS = PW // 2  # float pairs of a 32-bit word's columns
    LPW_LOG = int(math.log2(X_GROUP // PW))  # log2(the lanes, a word each, of an x group: q4 4, q8 8)
    if Q4 and not wide:
        raise PycalmError("q4 rows are read in 16-byte loads only")

    if Q4:

        @cuda.jit(device=True, inline=True)
        def load_scales(sa, sb, row, j, sc, u, sha, shb):  # noqa: ANN001, ANN202
            """The (d, m) word of load j's group of each row into slot u of sc."""
            for r in range(rows):
                if r < HALF:  # PLAIN / RESIDUAL pass sb = sa
                    sc[u * rows + r] = sa[row[r], j >> sha]
                else:
                    sc[u * rows + r] = sb[row[r], j >> shb]

        @cuda.jit(device=True, inline=True)
        def group_shift(w, s):  # noqa: ANN001, ANN202
            """log2(loads a group): 0 for groups of 32 columns, 1 for 64."""
            return uint64(1) if w.shape[1] // WORDS > s.shape[1] else uint64(0)

    else:

        @cuda.jit(device=True, inline=True)
        def load_scales(sa, sb, row, j, sc, u, sha, shb):  # noqa: ANN001, ANN202
            """(no group scales)"""

        @cuda.jit(device=True, inline=True)
        def group_shift(w, s):  # noqa: ANN001, ANN202
            return uint64(0)

    if dtype == "q8":

        @cuda.jit(device=True, inline=True)
        def row_scales(sa, sb, row, sc):  # noqa: ANN001, ANN202
            """The scale of each row of the group into sc."""
            for r in range(rows):
                sc[r] = sa[row[r]] if r < HALF else sb[row[r]]

        @cuda.jit(device=True, inline=True)
        def scale_rows(acc, sc):  # noqa: ANN001, ANN202
            """The lane's sums of codes times the rows' scales."""
            for r in range(rows):
                acc[r] *= sc[r]

    else:

        @cuda.jit(device=True, inline=True)
        def row_scales(sa, sb, row, sc):  # noqa: ANN001, ANN202
            """(no row scales)"""

        @cuda.jit(device=True, inline=True)
        def scale_rows(acc, sc):  # noqa: ANN001, ANN202
            """(no row scales)"""

    @cuda.jit(device=True, inline=True)
    def stage_limbs(x64, norm_w, xs, xsum, c0, n, normed):  # noqa: ANN001, ANN202
        """stage_x for q4 and q8: x[c0 : c0 + n] into xs as 16-bit integers in two byte limbs
        (pycalm.kernels.qdecode) -> this thread's sum of x^2 (0 unless normed). A thread takes
        the columns of one 32-bit word of codes (q4 8, q8 4; the block's threads take words t,
        t + blockDim, .., every lane of a warp the same number of times), the LPW lanes of an x
        group find its max |x| by xor shuffles, and each lane stores its word's limbs: q4 word
        i of load j (columns 8i .. 8i + 7, the even columns' bytes in the low word) at
        xs[j + 2i CW] (h) and xs[j + (2i + 1) CW] (l), q8's (columns 4i .. 4i + 3, h low, l
        high) at xs[j + i CW]. The first lane of a load writes its scale to xsum[CW + j] and
        (q4) its sum of X to xsum[j]."""
        ss = float32(0.0)
        pv = cuda.local.array(WORD_PAIRS, uint64)  # the word's columns as float pairs
        lane = cuda.threadIdx.x % WARP
        n_words = n // E * PARTS
        for w0 in range(cuda.threadIdx.x - lane, (n_words + WARP - 1) // WARP * WARP, cuda.blockDim.x):
            w = w0 + lane  # (w0: warp-uniform, so every lane reaches the shuffles)
            ok = w < n_words
            b = c0 // 2 + min(w, n_words - 1) * WORD_PAIRS  # x64 index of the word's first pair
            a = float32(0.0)
            for p in range(WORD_PAIRS):
                v = x64[b + p] if ok else uint64(0)
                if normed:
                    ss += pair_sq(v)
                    v = pair_times(v, norm_w, uint64(2 * (b + p)))
                pv[p] = v
                a = max(a, max(abs(as_f32(v)), abs(as_f32(v >> uint64(32)))))
            for m in range(LPW_LOG):  # the group's max |x|: its LPW lanes are aligned in the warp
                a = max(a, cuda.shfl_xor_sync(FULL_MASK, a, 1 << m))
            inv = XQ_F / a if a > float32(0.0) else float32(0.0)
            hw = uint64(0)
            lw = uint64(0)
            xi = int32(0)
            for k in range(PW):
                h, lb = x_limbs(as_f32(pv[k // 2] >> uint64(32 * (k % 2))), inv)
                xi += int32(shl32(h, 8) + lb)
                if Q4:  # even columns' bytes in the low word, odd ones' in the high word
                    hw |= limb_byte(h, k // 2 + 4 * (k % 2))
                    lw |= limb_byte(lb, k // 2 + 4 * (k % 2))
                else:
                    hw |= limb_byte(h, k) | limb_byte(lb, k + 4)
            if Q4:  # the load's sum of X: its 4 words' lanes
                xi += cuda.shfl_xor_sync(FULL_MASK, xi, 1)
                xi += cuda.shfl_xor_sync(FULL_MASK, xi, 2)
            j = uint64(w // PARTS)  # the load and the word in it
            i = uint64(w % PARTS)
            if ok:
                if Q4:
                    xs[j + i * uint64(2 * CW)] = hw
                    xs[j + i * uint64(2 * CW) + uint64(CW)] = lw
                else:
                    xs[j + i * uint64(CW)] = hw
                if i == uint64(0):
                    xsum[j] = float32(xi)
                    xsum[j + uint64(CW)] = a / XQ_F
        return ss

    @cuda.jit(device=True, inline=True)
    def stage_x(x64, norm_w, xs, xsum, c0, n, normed):  # noqa: ANN001, ANN202
        """Copy x[c0 : c0 + n] into xs as transposed float pairs (times norm_w when `normed`)
        -> this thread's sum of x^2 over what it staged (0 unless normed), which staged_rms
        finishes. Thread t takes loads t, t + blockDim, ..: its E/2 pairs (E/2 consecutive
        uint64 of x64, all issued together) go to xs[p * CW + j], so consecutive threads store
        consecutive slots (no bank conflicts). q4, q8: stage_limbs. All threads call it,
        between two barriers."""
        if SUMS:
            return stage_limbs(x64, norm_w, xs, xsum, c0, n, normed)
        ss = float32(0.0)
        v = cuda.local.array(HALF_E, uint64)  # one load's pairs
        for j in range(cuda.threadIdx.x, n // E, cuda.blockDim.x):
            b = c0 // 2 + j * HALF_E  # x64 index of the load's first pair
            for p in range(HALF_E):
                v[p] = x64[b + p]
            if normed:
                for p in range(HALF_E):
                    ss += pair_sq(v[p])
                for p in range(HALF_E):
                    v[p] = pair_times(v[p], norm_w, uint64(2 * (b + p)))
            for p in range(HALF_E):  # (unsigned indices: numba adds no negative-index code)
                xs[uint64(j + p * CW)] = v[p]
        return ss

    @cuda.jit(device=True, inline=True)
    def load_rows(wa, wb, sa, sb, row, j, words, sc, u, sha, shb):  # noqa: ANN001, ANN202
        """Load j (uint64) of each row of the group into slot u of words (q4: its scale word
        into slot u of sc)."""
        for r in range(rows):
            m = wa if r < HALF else wb  # PLAIN / RESIDUAL pass wb = wa
            k = (u * rows + r) * WORDS
            if wide:
                words[k], words[k + 1] = ldg128(m, row[r], j)
            else:
                words[k] = uint64(m[row[r], j])
        load_scales(sa, sb, row, j, sc, u, sha, shb)

    @cuda.jit(device=True, inline=True)
    def load_first(wa, wb, sa, sb, row, j0, n, first, words, sc, sha, shb):  # noqa: ANN001, ANN202
        """The first step's loads of the group into words (indices clamped to the row, so
        always valid; group_dot uses them only when the step is whole), and q8's row scales."""
        last = uint64(n - 1)
        for u in range(unroll):
            jg = uint64(j0) + min(uint64(first + WARP * u), last)
            load_rows(wa, wb, sa, sb, row, jg, words, sc, u, sha, shb)
        row_scales(sa, sb, row, sc)

    @cuda.jit(device=True, inline=True)
    def dot_load(words, sc, u, xs, xsum, j, acc):  # noqa: ANN001, ANN202
        """acc[r] += row r's weights of load u of the step times x (j: the chunk-local load
        index). fp16, fp8, gf4: part by part, a part's x values read once (64-bit shared loads)
        for all rows, and only they live. q4, q8: the codes times x's integer limbs summed in
        int32 (dp4a), S = sum q X; once a load q4 adds s (d S + m sum X), the sum of (d q + m) s X,
        and q8 adds s S (the row's scale comes at the end); s the load's scale."""
        if SUMS:
            ah = cuda.local.array(rows, int32)  # the load's sums of q h and q l
            al = cuda.local.array(rows, int32)
            for r in range(rows):
                ah[r] = int32(0)
                al[r] = int32(0)
            for i in range(PARTS):
                if Q4:
                    hx = xs[j + uint64(2 * i * CW)]
                    lx = xs[j + uint64((2 * i + 1) * CW)]
                else:
                    hx = xs[j + uint64(i * CW)]
                for r in range(rows):
                    w = int32(words[(u * rows + r) * WORDS + i // 2] >> uint64(32 * (i % 2)))
                    if Q4:
                        ah[r], al[r] = q4_dot8(w, hx, lx, ah[r], al[r])
                    else:
                        ah[r], al[r] = q8_dot4(w, hx, ah[r], al[r])
            sj = xsum[j + uint64(CW)]
            if Q4:
                xj = xsum[j]  # the load's sum of X
                for r in range(rows):
                    d, m = h2f2(int32(sc[u * rows + r]))
                    acc[r] += (d * limb_sum(ah[r], al[r]) + m * xj) * sj
            else:
                for r in range(rows):
                    acc[r] += limb_sum(ah[r], al[r]) * sj
        else:
            xv = cuda.local.array(PW, float32)  # the x values of one part
            for i in range(PARTS):
                for p in range(PW // 2):
                    v = xs[j + uint64((i * (PW // 2) + p) * CW)]
                    xv[2 * p] = as_f32(v)
                    xv[2 * p + 1] = as_f32(v >> uint64(32))
                for r in range(rows):
                    w = int32(words[(u * rows + r) * WORDS + i // 2] >> uint64(32 * (i % 2)))
                    acc[r] = part_dot(w, xv, acc[r])

    @cuda.jit(device=True, inline=True)
    def group_dot(words, sc, wa, wb, sa, sb, row, xs, xsum, j0, n, first, sha, shb, acc):  # noqa: ANN001, ANN202
        """acc[r] = this lane's raw partial sum of row r over the loads j0 .. j0 + n - 1, x in
        xs (chunk-local load index); words (and sc) hold the first step's loads (load_first).
        first: the lane's first load; with split S the S warps of a group take the steps of
        unroll * 32 loads in turn (warp p starts at lane + p unroll 32)."""
        for r in range(rows):
            acc[r] = float32(0.0)
        j = uint64(first)
        j0 = uint64(j0)
        n = uint64(n)
        if j + SPAN < n:  # the first step: its loads are in words already
            for u in range(unroll):
                dot_load(words, sc, u, xs, xsum, j + uint64(WARP * u), acc)
            j += STEP
            while j + SPAN < n:
                for u in range(unroll):  # all rows * unroll loads before the first use
                    load_rows(wa, wb, sa, sb, row, j0 + j + uint64(WARP * u), words, sc, u, sha, shb)
                for u in range(unroll):
                    dot_load(words, sc, u, xs, xsum, j + uint64(WARP * u), acc)
                j += STEP
        while j < n:  # the last loads, one a step
            load_rows(wa, wb, sa, sb, row, j0 + j, words, sc, 0, sha, shb)
            dot_load(words, sc, 0, xs, xsum, j, acc)
            j += uint64(WARP)
        scale_rows(acc, sc)

    return RowGroup(
        stage_x,
        load_first,
        group_dot,
        group_shift,
        2 * (XCHUNK // E) if SUMS else 1,
        rows * unroll if Q4 else rows if dtype == "q8" else 1,
        float32 if dtype == "q8" else uint32,
    )


def load_bytes(w: object, dtype: str) -> int:
    """The bytes a load of the row-group kernels takes from the stored weights w (q8 / q4: the
    codes): 16 where a row is a multiple of 16 bytes (every real model shape), else NARROW_BYTES
    (test shapes)."""
    if dtype not in PART_WEIGHTS:
        raise PycalmError(f"unsupported weight dtype {dtype!r} (one of {', '.join(PART_WEIGHTS)})")
    row_bytes = w.shape[1] * w.dtype.itemsize
    if row_bytes % 16 == 0:
        return 16
    if dtype not in NARROW_BYTES or row_bytes % NARROW_BYTES[dtype]:
        raise PycalmError(f"{dtype} rows of {row_bytes} bytes: the matvec kernels read whole 8-byte loads")
    return NARROW_BYTES[dtype]


def word_view(w: object, nbytes: int) -> object:
    """The stored weights as the kernels read them: uint32 words for 4-byte loads, else uint64."""
    return w.view(np.uint32 if nbytes == 4 else np.uint64)


def codes_and_scales(w: object, dtype: str, dummy: object) -> tuple[object, object]:
    """(codes, scales) of a stored matrix or stack of matrices as the kernels read them: the
    codes (or the plain stored array); q8's scales flattened to (rows,) float32 (a stack's rows
    one after another, as the codes' 2-D view has them); q4's as (rows, groups) uint32 words,
    each the two fp16 halves (d, m); `dummy` for dtypes without scales (never read)."""
    if not isinstance(w, Quantized):
        return w, dummy
    codes, scales = w.codes, w.scales
    if dtype == "q8":
        return codes, scales.reshape(scales.size)
    words = scales.view(np.uint32)  # (..., groups, 1): a word a group
    groups = words.shape[len(words.shape) - 2]
    return codes, words.reshape(words.size // groups, groups)
