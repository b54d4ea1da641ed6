"""Grouped-query attention of one query position over the KV cache.

The reference is pycalm.cpu.reference.attention_ref. For query head h (kv head g = h // (n_heads //
n_kv_heads)) and cached positions t in [start, n_pos), start = max(0, n_pos - window) with a
sliding window, else 0:
  score_t = q_h . k_t,g / sqrt(head_dim);  p = softmax(score);  out_h = sum_t p_t v_t,g
A layer's cache (KVCache) holds (seq_len, n_kv_heads * head_dim) keys and values, fp16 or fp8
e5m2.

GPU: one kernel, grid (n_heads, n_chunks), THREADS threads a block. Block (h, c) takes query
head h and the c-th chunk of `chunk` positions (a power of two, sized so that a thread's share
of the chunk's K and V rows fits in REG_WORDS int64 registers each). A captured grid cannot
depend on pos, so n_chunks covers a span of positions (attention_span: the engine captures a
step for each power-of-two multiple of the chunk) and blocks past the live chunks exit at once.
A block:

1. issues ALL its K and V loads first, before any arithmetic: one DRAM round trip for the chunk.
   K: teams of K_TEAM lanes, one position a team, each lane K_LANE_WORDS interleaved int64 words
   of the row (about K_WORDS: a few shuffles per position). V: teams of V_TEAM lanes,
   V_LANE_WORDS words a lane (about V_WORDS).
2. scores: each team dots its K row with the lane's slice of q (held in registers, times
   1/sqrt(head_dim)), xor-shuffles the partial dots inside the team, and writes the score to
   shared memory. One barrier.
3. softmax: EVERY warp reads the chunk's scores and computes their max m and sum of
   exp(score - m) itself (a few shared loads a lane, then shuffles): no second barrier.
4. p V: each V team takes its positions, p = exp(score - m) (read back from shared memory),
   and accumulates p * v for its slice of the row; the teams of a warp are added by xor
   shuffles, the warps through shared memory (one barrier).
5. one live chunk (every context up to `chunk` positions): out = sum / sum of exp, done.
   Several: the block writes (unnormalised out, m, sum) to its slot of `part`, and the LAST
   block of the head to finish (a per-head atomic counter) combines the chunks' partials and
   resets the counter. Each (head, chunk) slot of `part` is padded to whole 128-byte lines, so
   no line the combining block reads was ever cached in its SM's L1 before it was written.

Why this shape: at short context attention costs latency, not bytes (TinyLlama's KV read at 256
positions is 128 KB a layer). Every load of a block is in flight at once, a warp's dependent
chain is a few hundred instructions, and up to `chunk` positions there is one kernel and no
partials. The `group` query heads of a kv head read the same K and V rows: the first block
brings them into L2, the others read them from there. The price is at long context, where every
head's block decodes the rows itself and the blocks run in waves. The measurements behind these
choices, and the variants tried (scripts/kernels/attention.py), are in docs/BENCHMARKS.md at b282afd.

Decode of the caches in registers: fp16 and e5m2 are both "sign, 5-bit exponent, mantissa",
so shifting the bits into an fp32 (sign to bit 31, the rest to bits 13 / 21 on) gives the
value / 2^112 exactly (subnormals included). The 2^112 is folded into q (for scores) and into
the final output, so the inner loops are 2-3 integer ops and an FMA per element. The decoders
here wrap every shift in int32() (real numba computes int32 shifts in int64).

Bytes moved: n attended positions x kv_dim x 2 (K and V) x bytes per element from DRAM (plus
(group - 1) times that from L2), q, the partials of a multi-chunk context (written and read)
and out (pycalm.gpu.engine.step_bytes counts them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, int64, uint32
from numba.cuda import libdevice

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    FP_RAW_SCALE,
    MASK_E5M2,
    MASK_FP16,
    STATE_POS,
    as_f32,
    dependent_start,
    warp_reduce_max,
    warp_reduce_sum,
)
from pycalm.model.config import KV_DTYPES, ModelConfig

# ---------------------------------------------------------------------------------------------
# GPU kernel


# the kernel's sizes (scripts/kernels/attention.py times other values). Under the CUDA simulator (a
# Python thread per CUDA thread) smaller blocks and chunks of the same kernel, so that the tests'
# short contexts still cover several chunks.
SIM = _numba_config.ENABLE_CUDASIM
THREADS = 64 if SIM else 256  # threads a block
MAX_CHUNK = 16 if SIM else 256  # most positions a block takes
REG_WORDS = 16  # int64 words of K (and as many of V) a thread holds in flight: 64 registers
K_WORDS = 4  # words of a K row a lane takes (fewer lanes a position: fewer shuffles)
V_WORDS = 2  # words of a V row a lane takes (more lanes a position: fewer team merges)
UNROLL = 8  # independent partial loads in flight per thread of the combine
# registers a thread at most, so that two blocks of 256 threads fit an SM's 64k (tests/test_ptx.py
# checks it with ptxas): one block an SM runs the blocks of a long context in twice the waves
MAX_REGISTERS = 65536 // (2 * 256)
NEG = -1.0e30  # "no score yet": finite, so exp(NEG - m) is 0, not NaN
_LINE = 32  # floats in a 128-byte cache line


def _elems_per_word(kv_dtype: str) -> int:
    return 8 if kv_dtype == "fp8" else 4


def attention_chunk_len(head_dim: int, kv_dtype: str) -> int:
    """Positions a block takes: MAX_CHUNK, or fewer (a power of two) where a thread's share of
    the chunk's K words (chunk x words a row / THREADS) would exceed REG_WORDS."""
    row_words = head_dim // _elems_per_word(kv_dtype)
    chunk = MAX_CHUNK
    while chunk > 1 and chunk * row_words > REG_WORDS * THREADS:
        chunk //= 2
    return chunk


@dataclass(frozen=True)
class KVCache:
    """One layer's KV cache: rows are positions, each row the n_kv_heads heads side by side."""

    k: object  # (seq_len, n_kv_heads * head_dim) float16, or uint8 holding fp8 e5m2
    v: object  # (seq_len, n_kv_heads * head_dim), as k
    dtype: str  # "fp16" or "fp8" (pycalm.model.config.kv_dtype_for decides)


@dataclass(frozen=True)
class AttentionScratch:
    """Device scratch one engine allocates once; every layer shares it (the layers run one
    after another on one stream).

    part: (n_heads, n_chunks, padded head_dim + 2) float32, per head and chunk the unnormalised
      sum of p*V, then the chunk's score max and its sum of exp(score - max); padded to 128-byte
      lines. Written before it is read: no initial contents needed.
    count: (n_heads,) int32, chunks of the head finished in the running launch; zero between
      launches (the last block resets it), so it must start zeroed.
    chunk: positions a block takes.
    """

    part: object
    count: object
    chunk: int


def attention_scratch(
    n_heads: int,
    head_dim: int,
    kv_dtype: str,
    seq_len: int,
    *,
    chunk: int | None = None,
    stream: object = 0,
) -> AttentionScratch:
    """Allocate the scratch for contexts of up to seq_len positions (see AttentionScratch).
    chunk: positions a block takes, a power of two no larger than attention_chunk_len (the
    default); the tests take short chunks to cover the combine at short contexts."""
    longest = attention_chunk_len(head_dim, kv_dtype)
    chunk = longest if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1) or chunk > longest:
        raise PycalmError(f"attention chunk {chunk} is not a power of two up to {longest}")
    n_chunks = -(-seq_len // chunk)
    padded = -(-(head_dim + 2) // _LINE) * _LINE
    part = cuda.device_array((n_heads, n_chunks, padded), np.float32, stream=stream)
    count = cuda.to_device(np.zeros(n_heads, np.int32), stream=stream)
    return AttentionScratch(part, count, chunk)


@cuda.jit(device=True, inline=True)
def _exp(x):  # noqa: ANN001, ANN202
    """exp(x) as ex2.approx(x log2 e): two instructions instead of the accurate expf's ~10
    (relative error ~1e-7 for the |x| < 20 that carry weight in a softmax; 0 for -1e30)."""
    return libdevice.fast_expf(x)


@cuda.jit(device=True, inline=True)
def _decode(w, e, fp8):  # noqa: ANN001, ANN202
    """Element e (a constant after unrolling) of an int64 word of the cache, 4 fp16 or 8 e5m2
    from the lowest address up, as value * 2**-112. Every shift is wrapped in int32(): real
    numba computes int32 << / >> in int64, and the sign must come from bit 31 of the word."""
    half = e >= (4 if fp8 else 2)
    x = int32(w >> 32) if half else int32(w)
    if fp8:
        byte = e & 3
        if byte < 3:
            x = int32(x << int32(24 - 8 * byte))
        return as_f32(int32(x >> int32(3)) & int32(MASK_E5M2))
    if (e & 1) == 0:
        x = int32(x << int32(16))
    return as_f32(int32(x >> int32(3)) & int32(MASK_FP16))


def _team(row_words: int, words_a_lane: int) -> int:
    """Lanes a team: a power of two (1 to 32) dividing the words of a row, about
    row_words / words_a_lane of them."""
    lanes = 1
    while lanes < 32 and row_words % (2 * lanes) == 0 and row_words // (2 * lanes) >= words_a_lane:
        lanes *= 2
    return lanes


@functools.cache
def attention_kernel(head_dim: int, group: int, kv_dtype: str, chunk: int) -> object:
    """The kernel specialised for a head_dim, group size (query heads a kv head), KV dtype and
    chunk length (a power of two), in blocks of THREADS. The sizes are compile-time constants so
    the per-lane loads, query slice and accumulators are fixed-size local arrays that the
    compiler keeps in registers (all loops over them unroll)."""
    IS_FP8 = kv_dtype == "fp8"
    ELEMS_PER_WORD = _elems_per_word(kv_dtype)  # cache elements an int64 word holds
    ROW_WORDS = head_dim // ELEMS_PER_WORD  # words of one head's K (or V) row
    N_WARPS = THREADS // 32
    CHUNK_LOG2 = chunk.bit_length() - 1
    # K loads: a team of K_TEAM lanes takes one position, each lane K_LANE_WORDS words of its
    # row (interleaved: lane l of the team takes words l, l + K_TEAM, ...); one load step of the
    # block covers K_STEP_POSITIONS positions, K_STEPS steps cover the chunk, and a lane holds
    # K_REG_WORDS words in all
    K_TEAM = _team(ROW_WORDS, K_WORDS)
    K_LANE_WORDS = ROW_WORDS // K_TEAM
    K_LANE_ELEMS = K_LANE_WORDS * ELEMS_PER_WORD
    K_STEP_POSITIONS = N_WARPS * (32 // K_TEAM)
    K_STEPS = -(-chunk // K_STEP_POSITIONS)
    K_REG_WORDS = K_STEPS * K_LANE_WORDS
    # V loads: the same, with V's team
    V_TEAM = _team(ROW_WORDS, V_WORDS)
    V_LANE_WORDS = ROW_WORDS // V_TEAM
    V_LANE_ELEMS = V_LANE_WORDS * ELEMS_PER_WORD
    V_STEP_POSITIONS = N_WARPS * (32 // V_TEAM)
    V_STEPS = -(-chunk // V_STEP_POSITIONS)
    V_REG_WORDS = V_STEPS * V_LANE_WORDS
    Q_SCALE = FP_RAW_SCALE / math.sqrt(head_dim)  # 1/sqrt(head_dim) and the decode's 2^112
    SLICES = max(1, THREADS // head_dim)  # combine: thread (slice, d) sums every SLICES-th chunk

    @cuda.jit(fastmath=False, cache=True)
    def attention_kernel(q, k_cache, v_cache, state, part, count, out, window):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        # q (n_heads * head_dim,) f32; caches (seq_len, kv_words) int64; part (n_heads, n_chunks,
        # >= head_dim + 2) f32; count (n_heads,) i32; out (n_heads * head_dim,) f32
        head = cuda.blockIdx.x
        chunk_id = cuda.blockIdx.y
        n_pos = int32(state[STATE_POS] + 1)
        start = int32(0)
        if window > 0 and n_pos > window:
            start = int32(n_pos - window)
        live_chunks = int32(int32(n_pos - start + chunk - 1) >> int32(CHUNK_LOG2))
        if chunk_id >= live_chunks:
            return  # the whole block leaves together: no barrier is left waiting
        first = int32(start + chunk_id * chunk)  # this chunk's first position
        n_here = min(int32(n_pos - first), int32(chunk))  # positions of this chunk
        last = int32(first + n_here - 1)
        kv_head = int32(head // group)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        k_lane = lane % K_TEAM  # lane in its K team
        k_team = warp * (32 // K_TEAM) + lane // K_TEAM  # the team's position in a load step
        v_lane = lane % V_TEAM  # the same for V
        v_team = warp * (32 // V_TEAM) + lane // V_TEAM
        scores = cuda.shared.array(chunk, float32)  # the chunk's scores
        warp_sums = cuda.shared.array((N_WARPS, head_dim), float32)  # per-warp sum of p*v
        slice_sums = cuda.shared.array((SLICES, head_dim), float32)  # combine: per-slice sums
        is_last = cuda.shared.array(1, int32)  # combine: 1 in the last block of the head

        # 1. every K and V load of the chunk (past the end: reloads of the last row)
        k_regs = cuda.local.array(K_REG_WORDS, int64)
        v_regs = cuda.local.array(V_REG_WORDS, int64)
        k_col = kv_head * ROW_WORDS + k_lane
        v_col = kv_head * ROW_WORDS + v_lane
        for s in range(K_STEPS):
            if (
                s * K_STEP_POSITIONS < n_here
            ):  # block-uniform: a short chunk issues (and later uses) fewer steps
                t = uint32(
                    min(first + s * K_STEP_POSITIONS + k_team, last)
                )  # unsigned: no negative-index code
                for j in range(K_LANE_WORDS):
                    k_regs[s * K_LANE_WORDS + j] = k_cache[t, uint32(k_col + K_TEAM * j)]
        for s in range(V_STEPS):
            if s * V_STEP_POSITIONS < n_here:
                t = uint32(min(first + s * V_STEP_POSITIONS + v_team, last))
                for j in range(V_LANE_WORDS):
                    v_regs[s * V_LANE_WORDS + j] = v_cache[t, uint32(v_col + V_TEAM * j)]
        q_lane = cuda.local.array(K_LANE_ELEMS, float32)  # this lane's slice of q, times Q_SCALE
        for j in range(K_LANE_WORDS):
            for e in range(ELEMS_PER_WORD):
                q_lane[j * ELEMS_PER_WORD + e] = q[
                    head * head_dim + (k_lane + K_TEAM * j) * ELEMS_PER_WORD + e
                ] * float32(Q_SCALE)

        # 2. scores
        for s in range(K_STEPS):
            if s * K_STEP_POSITIONS >= n_here:
                continue  # block-uniform: every lane of a team skips together
            acc = float32(0.0)
            for j in range(K_LANE_WORDS):
                for e in range(ELEMS_PER_WORD):
                    acc += q_lane[j * ELEMS_PER_WORD + e] * _decode(k_regs[s * K_LANE_WORDS + j], e, IS_FP8)
            off = K_TEAM // 2
            while off > 0:  # xor tree inside the team: every lane ends with the score
                acc += cuda.shfl_xor_sync(0xFFFFFFFF, acc, off)
                off //= 2
            slot = s * K_STEP_POSITIONS + k_team  # the team's position within the chunk
            if k_lane == 0 and slot < chunk:
                scores[slot] = acc
        cuda.syncthreads()  # every score of the chunk is in scores

        # 3. the chunk's max and sum of exp, by every warp
        chunk_max = float32(NEG)
        for i in range(lane, n_here, 32):
            chunk_max = max(chunk_max, scores[i])
        chunk_max = warp_reduce_max(chunk_max)
        chunk_sum = float32(0.0)
        for i in range(lane, n_here, 32):
            chunk_sum += _exp(scores[i] - chunk_max)
        chunk_sum = warp_reduce_sum(chunk_sum)

        # 4. sum of p * v
        v_acc = cuda.local.array(V_LANE_ELEMS, float32)
        for i in range(V_LANE_ELEMS):
            v_acc[i] = float32(0.0)
        for s in range(V_STEPS):
            if s * V_STEP_POSITIONS >= n_here:
                continue  # block-uniform
            slot = s * V_STEP_POSITIONS + v_team
            p = _exp(scores[min(slot, n_here - 1)] - chunk_max)
            p = p if slot < n_here else float32(0.0)
            for j in range(V_LANE_WORDS):
                for e in range(ELEMS_PER_WORD):
                    v_acc[j * ELEMS_PER_WORD + e] += p * _decode(v_regs[s * V_LANE_WORDS + j], e, IS_FP8)
        off = V_TEAM
        while off < 32:  # add the teams of a warp (xor over the team bits of the lane id)
            for i in range(V_LANE_ELEMS):
                v_acc[i] += cuda.shfl_xor_sync(0xFFFFFFFF, v_acc[i], off)
            off *= 2
        if lane < V_TEAM:  # the first team holds the warp's sum
            for j in range(V_LANE_WORDS):
                for e in range(ELEMS_PER_WORD):
                    warp_sums[warp, (v_lane + V_TEAM * j) * ELEMS_PER_WORD + e] = v_acc[
                        j * ELEMS_PER_WORD + e
                    ]
        cuda.syncthreads()  # every warp's sum is in warp_sums

        # 5. one chunk: the output; several: this chunk's partial, and the last block combines
        for d in range(tid, head_dim, THREADS):
            acc = float32(0.0)
            for w in range(N_WARPS):
                acc += warp_sums[w, d]
            acc *= float32(FP_RAW_SCALE)
            if live_chunks == 1:
                out[head * head_dim + d] = acc / chunk_sum
            else:
                part[head, chunk_id, d] = acc
        if live_chunks == 1:
            return
        if tid == 0:
            part[head, chunk_id, head_dim] = chunk_max
            part[head, chunk_id, head_dim + 1] = chunk_sum
        cuda.threadfence()  # this thread's part of the partial is visible device-wide ...
        cuda.syncthreads()  # ... for every thread, before the chunk is counted
        if tid == 0:
            done = cuda.atomic.add(count, head, 1)
            is_last[0] = int32(1) if done == live_chunks - 1 else int32(0)
        cuda.syncthreads()  # is_last is set
        if is_last[0] == 0:
            return
        cuda.threadfence()  # the other chunks' partials are read after their count
        # every warp finds the largest chunk max and the denominator itself (no barrier)
        head_max = float32(NEG)
        for c in range(lane, live_chunks, 32):
            head_max = max(head_max, part[head, c, head_dim])
        head_max = warp_reduce_max(head_max)
        denom = float32(0.0)
        for c in range(lane, live_chunks, 32):
            denom += _exp(part[head, c, head_dim] - head_max) * part[head, c, head_dim + 1]
        denom = warp_reduce_sum(denom)
        for i in range(tid, SLICES * head_dim, THREADS):
            sl = i // head_dim  # this thread's slice of the chunks
            d = i % head_dim
            acc = float32(0.0)
            for c0 in range(sl * UNROLL, live_chunks, SLICES * UNROLL):
                for u in range(UNROLL):  # independent loads; past-the-end ones read chunk live_chunks - 1
                    c = min(c0 + u, live_chunks - 1)
                    x = _exp(part[head, c, head_dim] - head_max) * part[head, c, d]
                    acc += x if c0 + u < live_chunks else float32(0.0)
            slice_sums[sl, d] = acc
        cuda.syncthreads()  # every slice's sum is in slice_sums
        for d in range(tid, head_dim, THREADS):
            acc = float32(0.0)
            for sl in range(SLICES):
                acc += slice_sums[sl, d]
            out[head * head_dim + d] = acc / denom
        if tid == 0:
            count[head] = 0  # for the next launch (the next layer)

    return attention_kernel


def attention(
    q: object,
    cache: KVCache,
    state: object,
    out: object,
    cfg: ModelConfig,
    scratch: AttentionScratch,
    *,
    stream: object,
    span: int | None = None,
) -> None:
    """out (n_heads * head_dim,) f32 = attention of q (n_heads * head_dim,) f32 over the
    positions [start, state[STATE_POS]] of one layer's cache (see the module docstring).

    cfg: n_heads, n_kv_heads, head_dim and sliding_window are read from it. scratch: from
    attention_scratch(n_heads, head_dim, cache.dtype, >= seq_len); its chunk picks the kernel.
    span: the grid covers positions 0..span-1 (ceil(span / chunk) blocks a head; default the
    whole cache): the launch is right only while state[STATE_POS] < span. A graph captured at
    seq_len 4096 would otherwise launch 16 blocks a head where a short context has one live
    (attention_span: the spans an engine captures).
    """
    n_heads, n_kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if cache.dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {cache.dtype!r} (one of {', '.join(KV_DTYPES)})")
    if head_dim % _elems_per_word(cache.dtype):
        raise PycalmError(f"head_dim {head_dim} is not a multiple of 8 (fp8 KV) or 4 (fp16 KV)")
    seq_len = cache.k.shape[0]
    part = scratch.part
    n_chunks = part.shape[1]
    if part.shape[0] != n_heads or n_chunks * scratch.chunk < seq_len or part.shape[2] < head_dim + 2:
        raise PycalmError(
            f"attention scratch {part.shape} does not fit {n_heads} heads of {seq_len} positions"
        )
    span = seq_len if span is None else span
    if not 0 < span <= seq_len:
        raise PycalmError(f"attention span {span} is outside the cache's 1..{seq_len} positions")
    grid_chunks = -(-span // scratch.chunk)
    kernel = attention_kernel(head_dim, n_heads // n_kv_heads, cache.dtype, scratch.chunk)
    k64, v64 = cache.k.view(np.int64), cache.v.view(np.int64)
    window = int32(cfg.sliding_window)
    kernel[(n_heads, grid_chunks), THREADS, stream](q, k64, v64, state, part, scratch.count, out, window)


def attention_span(pos: int, chunk: int, seq_len: int) -> int:
    """The span (see attention) of a step at pos: chunk times the smallest power of two that
    covers pos + 1, at most seq_len. An engine captures one step a span: at most
    log2(seq_len / chunk) + 1 of them, and a grid at most twice the live chunks."""
    if not 0 <= pos < seq_len:
        raise PycalmError(f"position {pos} is outside the context of {seq_len} positions")
    span = chunk
    while span <= pos:
        span *= 2
    return min(span, seq_len)
