"""Grouped-query attention of one query position over the KV cache.

For query head h (kv head g = h // (n_heads // n_kv_heads)) and cached positions t in
[start, n_pos), start = max(0, n_pos - window) with a sliding window, else 0:
  score_t = q_h . k_t,g / sqrt(head_dim);  p = softmax(score);  out_h = sum_t p_t v_t,g
The caches hold (seq_len, n_kv_heads * head_dim) per layer, fp16 or fp8 e5m2.

GPU: flash-decoding in two kernels.

1. `attention_chunk_kernel`, grid (n_chunks, n_kv_heads), 128 threads. Block (c, g) takes the
   c-th chunk of the positions for kv head g and ALL the query heads of its group, so each K and
   V row is read from memory once for the whole group. A warp is split into teams of `lanes`
   lanes (8 for the usual head_dim 64 / 128); a team takes one position per step (the block
   16 positions a step), each lane reading interleaved int64 words of that position's K AND V
   rows (K and V loads in flight together; 8 lanes x 8 bytes = 64 contiguous bytes a load), the
   next step's loads issued before this step's arithmetic (double-buffered). The lane keeps its slice of the group's queries and its slice of each head's output
   in registers, and runs an online softmax per team: the score is reduced inside the team by
   log2(lanes) xor shuffles (every lane gets it), and the running max is raised lazily (the
   output is rescaled only when a score beats it, which is rare after the first few steps). No
   shared memory and no barrier per position: the teams of a warp are merged by xor shuffles
   and the warps through shared memory ONCE at the end, and the block writes (unnormalised
   out, max, sum of exp) per head to `part[c]`.
2. `attention_combine_kernel`, grid n_heads, 512 threads: every warp finds the largest chunk
   maximum and the softmax denominator itself (a few loads a lane, then shuffles: no barrier),
   then every thread sums weight * partial over a slice of the chunks with 8 independent loads
   in flight, and the slices are added in shared memory (one barrier).

What a live block costs at short context, measured with Nsight Compute on the H200: not the
bytes but its chain of ~2,000 dependent instructions a warp at 6-7 cycles each (one or two
live warps a scheduler, nothing to hide latency behind). Hence the 32-bit chunk arithmetic
(Python's // on int32 compiled to a 64-bit division subroutine, paid three times by every block,
even those that exit at once), ex2.approx for exp, and the prefetch of the next step.

Why the first version was slow (14 us a layer at 256 positions, 30-38 us at 4000): its combine
kernel walked the chunks one dependent L2 load at a time (2 x live chunks x ~0.3 us of L2
latency per thread), and its chunk kernel wrote every score to shared memory and passed three
barriers per block with K and V read in separate phases; its decoders also computed in int64.

How positions are split (the grid is captured once, so it cannot depend on pos): the grid has a
fixed n_chunks = about TARGET_BLOCKS / n_kv_heads, and the chunk length adapts on the device:
clen = max(MIN_CHUNK, ceil(n / n_chunks)) rounded up to the block's positions per step, for the
n positions attended; blocks past ceil(n / clen) exit at once. At 4000 positions every block
works on ~63 positions (Llama-3-8B: 64 chunks x 8 kv heads), so all SMs stream the cache; at
256 positions only 16 chunks of 16 are live and the combine reads 16 partials per head.

Decode of the caches in registers: fp16 and e5m2 are both "sign, 5-bit exponent, mantissa",
so shifting the bits into an fp32 (sign to bit 31, the rest to bits 13 / 21 on) gives the
value / 2^112 exactly (subnormals included). The 2^112 is folded into q (for scores) and into
the final output, so the inner loops are 2-3 integer ops and G FMAs per element. The decoders
here wrap every shift in int32() (real numba computes int32 shifts in int64).

Bytes moved: n attended positions x kv_dim x 2 (K and V) x bytes per element, plus q, the
partials (written and read) and out.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, int64, uint32
from numba.cuda import libdevice

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    FP_RAW_SCALE,
    STATE_POS,
    as_f32,
    warp_reduce_max,
    warp_reduce_sum,
)


def attention_ref(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    n_pos: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    window: int = 0,
) -> np.ndarray:
    """q: (n_heads*head_dim,); caches: (>= n_pos, n_kv_heads*head_dim) float32 (already decoded).

    -> (n_heads*head_dim,) float32.
    """
    start = max(0, n_pos - window) if window > 0 else 0
    qh = q.astype(np.float32).reshape(n_heads, head_dim)
    k = k_cache[start:n_pos].astype(np.float32).reshape(n_pos - start, n_kv_heads, head_dim)
    v = v_cache[start:n_pos].astype(np.float32).reshape(n_pos - start, n_kv_heads, head_dim)
    group = n_heads // n_kv_heads
    kh = np.repeat(k, group, axis=1)  # (T, n_heads, head_dim)
    vh = np.repeat(v, group, axis=1)
    scores = np.einsum("hd,thd->ht", qh, kh) / np.float32(np.sqrt(head_dim))  # (n_heads, T)
    scores = scores - scores.max(axis=1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", p, vh).reshape(-1).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# GPU kernels

# Tuning knobs, read by the launchers and attention_scratch_shape (scripts/bench_attention.py
# varies them; the scratch must be allocated with the values the launches use).
MIN_CHUNK = 16  # fewest positions a chunk takes: below this the per-block overhead dominates
TARGET_BLOCKS = 512  # chunk blocks to aim for at long context: ~4 per SM on a 132-SM H200
STEPS = 1  # positions a team loads per step before using them (loads in flight: 2 * STEPS rows)
# under the CUDA simulator (a Python thread per CUDA thread) smaller blocks of the same kernels
THREADS = 64 if _numba_config.ENABLE_CUDASIM else 128  # threads of a chunk block: 4 warps
WARPS = THREADS // 32
COMBINE_THREADS = 64 if _numba_config.ENABLE_CUDASIM else 512
UNROLL = 8  # independent partial loads in flight per combine thread
REG_BUDGET = 32  # floats of queries (and as many of outputs) a lane holds: ~128 registers, 4 blocks an SM
NEG = -1.0e30  # "no score yet": finite, so that merging two empty runs gives 0 * 1, not NaN
KV_DTYPES = ("fp16", "fp8")
_MASK_FP16 = 0x8FFFE000 - (1 << 32)  # int32: sign and the e5m10 fields after an arithmetic >> 3
_MASK_E5M2 = 0x8FE00000 - (1 << 32)  # int32: sign and the e5m2 fields after an arithmetic >> 3


def attention_chunks(n_heads: int, n_kv_heads: int, seq_len: int) -> int:
    """How many chunks (blocks per kv head) the grid has; fixed for a run (module docstring):
    TARGET_BLOCKS / n_kv_heads, no more than seq_len needs at MIN_CHUNK positions a chunk."""
    return max(1, min(-(-TARGET_BLOCKS // n_kv_heads), -(-seq_len // MIN_CHUNK)))


def attention_scratch_shape(
    n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int
) -> tuple[int, int, int]:
    """Shape of the float32 scratch `part` that the caller allocates once (one serves every
    layer: the layers run one after another on one stream). No initial contents are needed.

    (n_chunks, n_heads, head_dim + 2): per chunk and query head the unnormalised sum of p*V
    (head_dim floats), then the chunk's score max and its sum of exp(score - max).
    """
    return attention_chunks(n_heads, n_kv_heads, seq_len), n_heads, head_dim + 2


@cuda.jit(device=True, inline=True)
def _exp(x):  # noqa: ANN001, ANN202
    """exp(x) as ex2.approx(x log2 e): two instructions instead of the accurate expf's ~10
    (relative error ~1e-7 for the |x| < 20 that carry weight in a softmax; 0 for -1e30)."""
    return libdevice.fast_expf(x)


@cuda.jit(device=True, inline=True)
def _div(a, b):  # noqa: ANN001, ANN202
    """a // b for 0 <= a, 0 < b < 2**24, in 32-bit arithmetic: a float quotient corrected by one
    either way. (Python's // on int32 compiles to a 64-bit division, a ~100-instruction
    subroutine that every block, even one that exits at once, would pay three times.)"""
    f = int32(float32(a) / float32(b))
    if int32(f * b) > a:
        f = int32(f - 1)
    if int32((f + 1) * b) <= a:
        f = int32(f + 1)
    return f


@cuda.jit(device=True, inline=True)
def _chunk_range(state, window, min_chunk, n_chunks, c):  # noqa: ANN001, ANN202
    """(first position, end position, live chunks) of chunk c: the same formula in both kernels.
    min_chunk is a multiple of the chunk kernel's positions per step."""
    n_pos = int32(state[STATE_POS] + 1)
    start = int32(0)
    if window > 0 and n_pos > window:
        start = int32(n_pos - window)
    n = int32(n_pos - start)
    clen = _div(int32(n + n_chunks - 1), int32(n_chunks))
    clen = int32(_div(int32(clen + min_chunk - 1), min_chunk) * min_chunk)
    live = _div(int32(n + clen - 1), clen)
    t0 = int32(start + c * clen)
    return t0, min(int32(t0 + clen), n_pos), live


@cuda.jit(device=True, inline=True)
def _decode(w, e, fp8):  # noqa: ANN001, ANN202
    """Element e (a constant after unrolling) of an int64 word of the cache, 4 fp16 or 8 e5m2
    from the lowest address up, as value * 2**-112. Every shift is wrapped in int32(): real
    numba computes int32 << / >> in int64, and the sign must come from bit 31 of the word."""
    half = e >= (4 if fp8 else 2)
    x = int32(w >> 32) if half else int32(w)
    if fp8:
        k = e & 3
        if k < 3:
            x = int32(x << int32(24 - 8 * k))
        return as_f32(int32(x >> int32(3)) & int32(_MASK_E5M2))
    if (e & 1) == 0:
        x = int32(x << int32(16))
    return as_f32(int32(x >> int32(3)) & int32(_MASK_FP16))


def team_lanes(head_dim: int, group: int, kv_dtype: str) -> int:
    """Lanes per position team: the fewest (4 to 32, a power of two dividing the int64 words
    of a row) that keep a lane's group x slice of queries within REG_BUDGET floats (read at
    call time: the benchmark varies it)."""
    epw = 8 if kv_dtype == "fp8" else 4
    words = head_dim // epw
    for lanes in (4, 8, 16, 32):
        if words % lanes == 0 and group * (words // lanes) * epw <= REG_BUDGET:
            return lanes
    lanes = 32
    while words % lanes:
        lanes //= 2
    return lanes


@functools.cache
def attention_kernels(
    head_dim: int, group: int, kv_dtype: str, steps: int, lanes: int
) -> tuple[object, object]:
    """(chunk kernel, combine kernel) specialised for a head_dim, group size, KV dtype, steps
    (positions a team loads before using them) and lanes per team (team_lanes).

    The sizes are compile-time constants so the per-lane query slice and accumulators are
    fixed-size local arrays the compiler keeps in registers (all loops over them unroll).
    """
    FP8 = kv_dtype == "fp8"
    EPW = 8 if FP8 else 4  # elements per int64 word
    LANES = lanes
    W = head_dim // EPW // LANES  # words per lane per row
    D = W * EPW  # elements per lane per row
    G = group
    TPW = 32 // LANES  # teams per warp
    P = THREADS // LANES  # positions per step of the block, per STEPS
    S = steps
    SW = steps * (head_dim // EPW // LANES)
    HEAD_WORDS = head_dim // EPW
    HD = head_dim
    HD2 = head_dim + 2
    GD = group * D
    Q_SCALE = FP_RAW_SCALE / math.sqrt(head_dim)  # 1/sqrt(head_dim) and the decode's 2^112
    SLICES = COMBINE_THREADS // HD if HD <= COMBINE_THREADS else 1
    CT = SLICES * HD if HD <= COMBINE_THREADS else COMBINE_THREADS
    U = UNROLL

    @cuda.jit(fastmath=False)
    def attention_chunk_kernel(q, k_cache, v_cache, state, part, window, min_chunk):  # noqa: ANN001, ANN202
        # q (n_heads*HD,) f32; caches (seq_len, kv_words) int64; part (n_chunks, n_heads, HD+2)
        c = cuda.blockIdx.x
        g = cuda.blockIdx.y
        t0, t1, live = _chunk_range(state, window, min_chunk, cuda.gridDim.x, c)
        if c >= live:
            return  # the whole block leaves together: no barrier is left waiting
        tid = cuda.threadIdx.x
        warp = tid // 32
        wl = tid % 32
        lane = wl % LANES
        slot = warp * TPW + wl // LANES  # this team's position within a step
        red = cuda.shared.array((WARPS, G, HD2), float32)  # per-warp (out, max, sum)

        # this lane's slice of the group's queries, times Q_SCALE
        qs = float32(Q_SCALE)
        qr = cuda.local.array(GD, float32)
        for h in range(G):
            for j in range(W):
                for e in range(EPW):
                    qr[h * D + j * EPW + e] = q[(g * G + h) * HD + (lane + LANES * j) * EPW + e] * qs
        m = cuda.local.array(G, float32)
        lsum = cuda.local.array(G, float32)
        o = cuda.local.array(GD, float32)
        for h in range(G):
            m[h] = float32(NEG)
            lsum[h] = float32(0.0)
        for i in range(GD):
            o[i] = float32(0.0)

        w0 = g * HEAD_WORDS + lane
        kw = cuda.local.array(SW, int64)  # this step's K and V words
        vw = cuda.local.array(SW, int64)
        kn = cuda.local.array(SW, int64)  # the next step's, loading while this one is used
        vn = cuda.local.array(SW, int64)
        acc = cuda.local.array(G, float32)
        p = cuda.local.array(G, float32)
        last = t1 - 1
        for s in range(S):  # the first step's K and V loads: 2 * S * W in flight
            t = uint32(min(t0 + s * P + slot, last))  # unsigned: no negative-index code
            for j in range(W):
                kn[s * W + j] = k_cache[t, uint32(w0 + LANES * j)]
                vn[s * W + j] = v_cache[t, uint32(w0 + LANES * j)]
        for base in range(t0, t1, P * S):  # uniform trip count: every lane takes the shuffles
            for i in range(SW):
                kw[i] = kn[i]
                vw[i] = vn[i]
            for s in range(S):  # issue the next step's loads first (past the end: reloads of last)
                t = uint32(min(base + P * S + s * P + slot, last))
                for j in range(W):
                    kn[s * W + j] = k_cache[t, uint32(w0 + LANES * j)]
                    vn[s * W + j] = v_cache[t, uint32(w0 + LANES * j)]
            for s in range(S):
                valid = base + s * P + slot <= last
                for h in range(G):
                    acc[h] = float32(0.0)
                for j in range(W):
                    for e in range(EPW):
                        x = _decode(kw[s * W + j], e, FP8)
                        for h in range(G):
                            acc[h] += qr[h * D + j * EPW + e] * x
                for h in range(G):
                    sc = acc[h]
                    off = LANES // 2
                    while off > 0:  # xor tree inside the team: every lane ends with the score
                        sc += cuda.shfl_xor_sync(0xFFFFFFFF, sc, off)
                        off //= 2
                    if valid and sc > m[h]:  # a new max: rescale what was summed (rare)
                        a = _exp(m[h] - sc)
                        lsum[h] *= a
                        for i in range(D):
                            o[h * D + i] *= a
                        m[h] = sc
                    p[h] = _exp(sc - m[h]) if valid else float32(0.0)
                    lsum[h] += p[h]
                for j in range(W):
                    for e in range(EPW):
                        x = _decode(vw[s * W + j], e, FP8)
                        for h in range(G):
                            o[h * D + j * EPW + e] += p[h] * x

        # merge the teams of a warp (xor over the team bits of the lane id)
        off = LANES
        while off < 32:
            for h in range(G):
                m2 = cuda.shfl_xor_sync(0xFFFFFFFF, m[h], off)
                l2 = cuda.shfl_xor_sync(0xFFFFFFFF, lsum[h], off)
                mm = max(m[h], m2)
                a = _exp(m[h] - mm)
                b = _exp(m2 - mm)
                lsum[h] = lsum[h] * a + l2 * b
                m[h] = mm
                for i in range(D):
                    o2 = cuda.shfl_xor_sync(0xFFFFFFFF, o[h * D + i], off)
                    o[h * D + i] = o[h * D + i] * a + o2 * b
            off *= 2
        if wl < LANES:  # the first team holds the warp's result
            for h in range(G):
                for j in range(W):
                    for e in range(EPW):
                        red[warp, h, (lane + LANES * j) * EPW + e] = o[h * D + j * EPW + e]
                if lane == 0:
                    red[warp, h, HD] = m[h]
                    red[warp, h, HD + 1] = lsum[h]
        cuda.syncthreads()  # every warp's (out, max, sum) is in `red`
        for i in range(tid, G * HD, THREADS):
            h = i // HD
            d = i % HD
            mm = red[0, h, HD]
            for w in range(1, WARPS):
                mm = max(mm, red[w, h, HD])
            so = float32(0.0)
            sl = float32(0.0)
            for w in range(WARPS):
                f = _exp(red[w, h, HD] - mm)
                so += f * red[w, h, d]
                sl += f * red[w, h, HD + 1]
            part[c, g * G + h, d] = so * float32(FP_RAW_SCALE)
            if d == 0:
                part[c, g * G + h, HD] = mm
                part[c, g * G + h, HD + 1] = sl

    @cuda.jit(fastmath=False)
    def attention_combine_kernel(part, state, out, window, min_chunk):  # noqa: ANN001, ANN202
        # block h: one query head; thread (slice s, dim d) sums chunks s*U.., SLICES*U apart
        h = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        n_chunks = part.shape[0]
        _, _, live = _chunk_range(state, window, min_chunk, n_chunks, 0)
        red = cuda.shared.array((SLICES, HD), float32)
        # every warp computes the max of the chunk maxima and the softmax denominator itself
        # (a few loads a lane, L1 hits after the first warp): no barrier before the sums
        mm = float32(NEG)
        for c in range(lane, live, 32):
            mm = max(mm, part[c, h, HD])
        mm = warp_reduce_max(mm)
        den = float32(0.0)
        for c in range(lane, live, 32):
            den += _exp(part[c, h, HD] - mm) * part[c, h, HD + 1]
        den = warp_reduce_sum(den)
        if tid < CT:
            s = tid // HD
            d = tid % HD
            acc = float32(0.0)
            for c0 in range(s * U, live, SLICES * U):
                for u in range(U):  # U independent loads; past-the-end ones read chunk live-1
                    c = c0 + u
                    cc = min(c, live - 1)
                    x = _exp(part[cc, h, HD] - mm) * part[cc, h, d]
                    acc += x if c < live else float32(0.0)
            red[s, d] = acc
        cuda.syncthreads()  # every slice's sum is in `red`
        for d in range(tid, HD, CT):
            acc = float32(0.0)
            for s in range(SLICES):
                acc += red[s, d]
            out[h * HD + d] = acc / den

    return attention_chunk_kernel, attention_combine_kernel


def attention(
    q: object,
    k_cache: object,
    v_cache: object,
    state: object,
    out: object,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    window: int,
    part: object,
    *,
    stream: object,
) -> int:
    """out (n_heads*head_dim,) f32 = attention of q over positions [start, state[STATE_POS]].

    k_cache / v_cache: this layer's (seq_len, n_kv_heads*head_dim) float16 or uint8 (e5m2);
    part: float32 scratch of attention_scratch_shape(n_heads, n_kv_heads, head_dim, seq_len).
    Returns the bytes moved at the longest context the cache holds (the real figure depends on
    pos, which lives on the device); bench_attention computes it per n_pos.
    """
    if kv_dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {kv_dtype!r} (one of {', '.join(KV_DTYPES)})")
    if head_dim % (8 if kv_dtype == "fp8" else 4):
        raise PycalmError(f"head_dim {head_dim} is not a multiple of 8 (fp8 KV) or 4 (fp16 KV)")
    group = n_heads // n_kv_heads
    seq_len = k_cache.shape[0]
    n_chunks = part.shape[0]
    lanes = team_lanes(head_dim, group, kv_dtype)
    chunk, combine = attention_kernels(head_dim, group, kv_dtype, STEPS, lanes)
    pstep = THREADS // lanes * STEPS  # positions a block covers per step
    min_chunk = int32(-(-MIN_CHUNK // pstep) * pstep)
    k64 = k_cache.view(np.int64)
    v64 = v_cache.view(np.int64)
    chunk[(n_chunks, n_kv_heads), THREADS, stream](q, k64, v64, state, part, int32(window), min_chunk)
    combine[n_heads, COMBINE_THREADS, stream](part, state, out, int32(window), min_chunk)
    return attention_bytes(seq_len, n_heads, n_kv_heads, head_dim, kv_dtype, n_chunks)


def attention_bytes(
    n_pos: int, n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype: str, n_chunks: int
) -> int:
    """Bytes the two kernels move at n_pos attended positions (all chunks live: an upper bound)."""
    kv = n_pos * n_kv_heads * head_dim * 2 * (1 if kv_dtype == "fp8" else 2)
    partials = 2 * n_chunks * n_heads * (head_dim + 2) * 4
    return kv + partials + 2 * n_heads * head_dim * 4


_CHUNK_SIG = "void(float32[::1], int64[:, ::1], int64[:, ::1], int32[::1], float32[:, :, ::1], int32, int32)"
_COMBINE_SIG = "void(float32[:, :, ::1], int32[::1], float32[::1], int32, int32)"


def _compile_check() -> list[tuple[object, str]]:
    """Every kernel variant the models in use need: head_dim 64 / 128, groups 1..8, both KV dtypes."""
    checks = []
    for kv_dtype in KV_DTYPES:
        for head_dim, group in ((64, 3), (64, 7), (64, 8), (128, 1), (128, 4)):
            lanes = team_lanes(head_dim, group, kv_dtype)
            chunk, combine = attention_kernels(head_dim, group, kv_dtype, STEPS, lanes)
            checks.append((chunk, _CHUNK_SIG))
            checks.append((combine, _COMBINE_SIG))
    return checks


COMPILE_CHECK = _compile_check()
