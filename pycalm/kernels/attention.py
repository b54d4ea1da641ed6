"""Grouped-query attention of one query position over the KV cache.

For query head h (kv head g = h // (n_heads // n_kv_heads)) and cached positions t in
[start, n_pos), start = max(0, n_pos - window) with a sliding window, else 0:
  score_t = q_h . k_t,g / sqrt(head_dim);  p = softmax(score);  out_h = sum_t p_t v_t,g
The caches hold (seq_len, n_kv_heads * head_dim) per layer, fp16 or fp8 e5m2.

GPU: flash-decoding in two kernels.

1. `attention_chunk_kernel`, grid (n_chunks, n_kv_heads), 128 threads. Block (c, g) takes the
   c-th chunk of the positions for kv head g and ALL the query heads of its group, so each K and
   V row is read from memory once for the whole group. The threads form teams of `lanes` (8 for
   head_dim 64 and 128) lanes; a team takes one position at a time, each lane reads interleaved
   int64 words of the row (8 lanes x 8 bytes = 64 contiguous bytes per load instruction) and
   keeps its slice of the group's queries in registers. Scores: per-lane partial dots, a
   3-shuffle xor reduction inside the team, into shared memory. The block then takes the
   chunk's max and sum of exp per head (one warp per head), and the teams accumulate
   p_t * v_t into registers, reduced across teams (shuffles, then shared memory) at the end. The
   block writes (unnormalised out, max, sum) per head to `part[c]`.
2. `attention_combine_kernel`, grid n_heads, head_dim threads: the log-sum-exp merge of the
   chunks' partial results into out.

How positions are split (the grid is captured once, so it cannot depend on pos): the grid has a
fixed n_chunks = about 512 / n_kv_heads (enough blocks to fill 132 SMs ~4 deep), and the chunk
length adapts on the device: clen = max(16, ceil(n / n_chunks)) for the n positions attended;
blocks past ceil(n / clen) exit at once. At 4000 positions every block works on ~63 positions
(Llama-3-8B: 64 chunks x 8 kv heads), so all SMs stream the cache; at 256 positions only 16
chunks of 16 are live, so the combine reads 16 partials per head, not 64. A fixed chunk length
with a grid sized for seq_len would either starve the SMs at 256 positions (long chunks) or
make the combine read many partials at 4000 (short chunks); this adapts to both.

Decode of the caches in registers: fp16 and e5m2 are both "sign, 5-bit exponent, mantissa",
so shifting the bits into an fp32 (sign to bit 31, the rest to bits 13 / 21 on) gives the
value / 2^112 exactly (subnormals included). The 2^112 is folded into q (for scores) and into
p (for the V sum), so the inner loops are shift, mask and FMA.

Bytes moved: n attended positions x kv_dim x 2 (K and V) x bytes per element, plus q, the
partials (written and read) and out.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    FP_RAW_SCALE,
    STATE_POS,
    fp8_byte_raw,
    fp16_hi_raw,
    fp16_lo_raw,
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

MIN_CHUNK = 16  # fewest positions a chunk takes: below this the per-block overhead dominates
TARGET_BLOCKS = 512  # chunk blocks to aim for at long context: ~4 per SM on a 132-SM H200
MAX_SCORE_BYTES = 32 * 1024  # dynamic shared memory for one block's scores (no opt-in needed)
THREADS = 128  # threads of a chunk block: 4 warps
WARPS = THREADS // 32
KV_DTYPES = ("fp16", "fp8")


def attention_chunks(n_heads: int, n_kv_heads: int, seq_len: int) -> int:
    """How many chunks (blocks per kv head) the grid has; fixed for a run (module docstring).

    TARGET_BLOCKS / n_kv_heads, no more than seq_len needs at MIN_CHUNK positions a chunk, and
    enough that one chunk's scores (group x chunk length floats) fit MAX_SCORE_BYTES.
    """
    group = n_heads // n_kv_heads
    n = max(1, min(-(-TARGET_BLOCKS // n_kv_heads), -(-seq_len // MIN_CHUNK)))
    while group * _max_chunk_len(seq_len, n) * 4 > MAX_SCORE_BYTES:
        n *= 2
    return n


def _max_chunk_len(seq_len: int, n_chunks: int) -> int:
    return max(MIN_CHUNK, -(-seq_len // n_chunks))


def attention_scratch_shape(
    n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int
) -> tuple[int, int, int]:
    """Shape of the float32 scratch `part` that the caller allocates once (one serves every
    layer: the layers run one after another on one stream).

    (n_chunks, n_heads, head_dim + 2): per chunk and query head the unnormalised sum of p*V
    (head_dim floats), then the chunk's score max and its sum of exp(score - max).
    """
    return attention_chunks(n_heads, n_kv_heads, seq_len), n_heads, head_dim + 2


@cuda.jit(device=True, inline=True)
def _chunk_range(state, window, n_chunks, c):  # noqa: ANN001, ANN202
    """(first position, end position, live chunks) of chunk c: the same formula in both kernels."""
    n_pos = state[STATE_POS] + 1
    start = int32(0)
    if window > 0 and n_pos > window:
        start = n_pos - window
    n = n_pos - start
    clen = max(int32(MIN_CHUNK), (n + n_chunks - 1) // n_chunks)
    live = (n + clen - 1) // clen
    t0 = start + c * clen
    return t0, min(t0 + clen, n_pos), live


@cuda.jit(device=True, inline=True)
def _decode_word(w, e, fp8):  # noqa: ANN001, ANN202
    """Element e (a constant after unrolling) of an int64 word of the cache, 4 fp16 or 8 e5m2
    from the lowest address up, as value * 2**-112 (common's raw decoders)."""
    x = int32(w >> int64(32)) if e >= (4 if fp8 else 2) else int32(w)
    if fp8:
        return fp8_byte_raw(x, e & 3)
    return fp16_hi_raw(x) if e & 1 else fp16_lo_raw(x)


def team_lanes(head_dim: int, kv_dtype: str) -> int:
    """Lanes per position team: up to 8, a power of two dividing the int64 words of a row."""
    words = head_dim // (8 if kv_dtype == "fp8" else 4)
    lanes = 8
    while words % lanes:
        lanes //= 2
    return lanes


@functools.cache
def attention_kernels(head_dim: int, group: int, kv_dtype: str) -> tuple[object, object]:
    """(chunk kernel, combine kernel) specialised for a head_dim, group size and KV dtype.

    The sizes are compile-time constants so the per-lane query slice and accumulators are
    fixed-size local arrays the compiler keeps in registers (all loops over them unroll).
    """
    FP8 = kv_dtype == "fp8"
    EPW = 8 if FP8 else 4  # elements per int64 word
    LANES = team_lanes(head_dim, kv_dtype)
    W = head_dim // EPW // LANES  # words per lane per row
    D = W * EPW  # elements per lane per row
    G = group
    TEAMS = THREADS // LANES
    HEAD_WORDS = head_dim // EPW
    HD = head_dim
    GHD = group * head_dim
    GD = group * D
    Q_SCALE = FP_RAW_SCALE / math.sqrt(head_dim)  # 1/sqrt(head_dim) and the decode's 2^112

    @cuda.jit(fastmath=False)
    def attention_chunk_kernel(q, k_cache, v_cache, state, part, window, score_stride):  # noqa: ANN001, ANN202
        # q (n_heads*HD,) f32; caches (seq_len, kv_words) int64; part (n_chunks, n_heads, HD+2)
        c = cuda.blockIdx.x
        g = cuda.blockIdx.y
        n_chunks = cuda.gridDim.x
        t0, t1, live = _chunk_range(state, window, n_chunks, c)
        if c >= live:
            return  # the whole block leaves together: no barrier is left waiting
        tid = cuda.threadIdx.x
        team = tid // LANES
        lane = tid % LANES
        scores = cuda.shared.array(0, float32)  # (G, score_stride): this chunk's scores, then p
        red = cuda.shared.array((WARPS, GHD), float32)  # per-warp V sums

        # this lane's slice of the group's queries, times Q_SCALE
        qs = float32(Q_SCALE)
        qr = cuda.local.array(GD, float32)
        for h in range(G):
            for j in range(W):
                for e in range(EPW):
                    qr[h * D + j * EPW + e] = q[(g * G + h) * HD + (lane + LANES * j) * EPW + e] * qs

        # scores: a team per position; the loop bound is uniform so every lane shuffles
        w0 = g * HEAD_WORDS + lane
        kw = cuda.local.array(W, int64)
        acc = cuda.local.array(G, float32)
        for base in range(t0, t1, TEAMS):
            t = base + team
            for j in range(W):
                kw[j] = k_cache[t, w0 + LANES * j] if t < t1 else int64(0)
            for h in range(G):
                acc[h] = float32(0.0)
            for j in range(W):
                for e in range(EPW):
                    x = _decode_word(kw[j], e, FP8)
                    for h in range(G):
                        acc[h] += qr[h * D + j * EPW + e] * x
            for h in range(G):
                s = acc[h]
                off = LANES // 2
                while off > 0:  # xor tree inside the team: every lane ends with the dot
                    s += cuda.shfl_xor_sync(0xFFFFFFFF, s, off)
                    off //= 2
                if lane == 0 and t < t1:
                    scores[h * score_stride + t - t0] = s
        cuda.syncthreads()  # all scores of the chunk are in shared memory

        # softmax statistics: warp w takes heads w, w + WARPS, ...
        n = t1 - t0
        warp = tid // 32
        wl = tid % 32
        for h in range(warp, G, WARPS):
            m = float32(-math.inf)
            for i in range(wl, n, 32):
                m = max(m, scores[h * score_stride + i])
            m = warp_reduce_max(m)
            lsum = float32(0.0)
            for i in range(wl, n, 32):
                p = math.exp(scores[h * score_stride + i] - m)
                scores[h * score_stride + i] = p * float32(FP_RAW_SCALE)
                lsum += p
            lsum = warp_reduce_sum(lsum)
            if wl == 0:
                part[c, g * G + h, HD] = m
                part[c, g * G + h, HD + 1] = lsum
        cuda.syncthreads()  # p (times 2^112) replaces the scores

        # V: each team sums p_t v_t over its positions in registers
        o = cuda.local.array(GD, float32)
        for i in range(GD):
            o[i] = float32(0.0)
        vw = cuda.local.array(W, int64)
        for t in range(t0 + team, t1, TEAMS):
            for j in range(W):
                vw[j] = v_cache[t, w0 + LANES * j]
            for j in range(W):
                for e in range(EPW):
                    x = _decode_word(vw[j], e, FP8)
                    for h in range(G):
                        o[h * D + j * EPW + e] += scores[h * score_stride + t - t0] * x
        # reduce over the teams of a warp: lanes lane, lane + LANES, ... hold the same dims
        for i in range(GD):
            s = o[i]
            off = 16
            while off >= LANES:
                s += cuda.shfl_xor_sync(0xFFFFFFFF, s, off)
                off //= 2
            o[i] = s
        wl = tid % 32
        if wl < LANES:
            for h in range(G):
                for j in range(W):
                    for e in range(EPW):
                        red[warp, h * HD + (lane + LANES * j) * EPW + e] = o[h * D + j * EPW + e]
        cuda.syncthreads()  # every warp's sums are in `red`
        for i in range(tid, G * HD, THREADS):
            s = float32(0.0)
            for w in range(WARPS):
                s += red[w, i]
            part[c, g * G + i // HD, i % HD] = s

    @cuda.jit(fastmath=False)
    def attention_combine_kernel(part, state, out, window):  # noqa: ANN001, ANN202
        # block h: one query head; thread d: one output element
        h = cuda.blockIdx.x
        d = cuda.threadIdx.x
        n_chunks = part.shape[0]
        _, _, live = _chunk_range(state, window, n_chunks, 0)
        m = float32(-math.inf)
        for c in range(live):
            m = max(m, part[c, h, HD])
        num = float32(0.0)
        den = float32(0.0)
        for c in range(live):
            f = math.exp(part[c, h, HD] - m)
            num += f * part[c, h, d]
            den += f * part[c, h, HD + 1]
        out[h * HD + d] = num / den

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
    chunk, combine = attention_kernels(head_dim, group, kv_dtype)
    k64 = k_cache.view(np.int64)
    v64 = v_cache.view(np.int64)
    stride = _max_chunk_len(seq_len, n_chunks)
    chunk[(n_chunks, n_kv_heads), THREADS, stream, group * stride * 4](
        q, k64, v64, state, part, int32(window), int32(stride)
    )
    combine[n_heads, head_dim, stream](part, state, out, int32(window))
    return attention_bytes(seq_len, n_heads, n_kv_heads, head_dim, kv_dtype, n_chunks)


def attention_bytes(
    n_pos: int, n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype: str, n_chunks: int
) -> int:
    """Bytes the two kernels move at n_pos attended positions (all chunks live: an upper bound)."""
    kv = n_pos * n_kv_heads * head_dim * 2 * (1 if kv_dtype == "fp8" else 2)
    partials = 2 * n_chunks * n_heads * (head_dim + 2) * 4
    return kv + partials + 2 * n_heads * head_dim * 4


def _compile_check() -> list[tuple[object, str]]:
    """Every kernel variant the models in use need: head_dim 64 / 128, groups 1..8, both KV dtypes."""
    checks = []
    for kv_dtype in KV_DTYPES:
        for head_dim, group in ((64, 3), (64, 7), (64, 8), (128, 1), (128, 4)):
            chunk, combine = attention_kernels(head_dim, group, kv_dtype)
            checks.append(
                (
                    chunk,
                    "void(float32[::1], int64[:, ::1], int64[:, ::1], int32[::1], float32[:, :, ::1], int32, int32)",
                )
            )
            checks.append((combine, "void(float32[:, :, ::1], int32[::1], float32[::1], int32)"))
    return checks


COMPILE_CHECK = _compile_check()
