"""Grouped-query attention of one query position over the KV cache, split over the keys
(flash-decoding).

The reference is pycalm.cpu.reference.attention_ref. For query head h (kv head g = h // group,
group = n_heads // n_kv_heads) and cached positions t in [start, n_pos), start = max(0, n_pos -
window) with a sliding window, else 0:
  score_t = q_h . k_t,g / sqrt(head_dim);  p = softmax(score);  out_h = sum_t p_t v_t,g
A layer's cache (KVCache) holds (seq_len, n_kv_heads * head_dim) keys and values, fp16 or fp8
e5m2.

GPU: one kernel, grid (n_kv_heads, n_splits), THREADS threads a block. Block (g, s) takes kv
head g and ALL its query heads (each K and V row is read from memory once, for the whole
group), over the s-th split of `split` positions of [start, n_pos). The split grows with the
context (split_len: the grid stays near TARGET_BLOCKS blocks, a few waves of the SMs), so a
short context has many short splits and a long one a few hundred long ones; a captured grid
cannot depend on pos, so it covers a span of positions (attention_span: the engine captures a
step for each power-of-two span) and the blocks past the live splits exit at once. A block:

1. streams its split through shared memory in tiles of TILE positions, the K and V rows of the
   kv head as stored (cp.async, 16 bytes a copy, no registers), two stages: tile i + 1 is in
   flight while tile i is used. Barrier once a tile has landed; barrier before its stage is
   refilled.
2. scores: warp w takes TILE / N_WARPS positions of the tile. A team of T lanes holds a row
   (lane i of the team: int32 words i, i + T, ... of it, conflict-free shared loads), 32 / T
   positions a warp at a time. Each lane dots its words with its slice of every query head of
   the group (q in registers, times 1/sqrt(head_dim)), then a transposing butterfly over the
   team sums the warp's (position, head) partial dots: each xor step hands half of the values
   to the partner and adds the other half, so n sums over T lanes cost about n shuffles, not
   n log2 T. The scores go to the warp's shared row. (__syncwarp)
3. online softmax, per warp and head (every lane alike): m = max(m, the tile's scores), the old
   sum and accumulators times exp(m_old - m), l += sum of p = exp(score - m).
4. p V: each lane adds p times its slice of the V rows of its team's positions, for every head.
5. after the last tile: the teams of a warp are added (xor shuffles), the warps' (m, l, acc)
   meet in shared memory (barrier) and the block's (head, dim) outputs are merged by rescaling.
   One live split (every context up to `split`): out = acc / l. Several: the block writes its
   (unnormalised acc, m, l) to its slot of `part`, and the LAST block of the kv head to finish
   (a per-kv-head atomic counter) merges the splits' partials and resets the counter. Each
   (head, split) slot of `part` is padded to whole 128-byte lines, so no line the merging block
   reads was ever cached in its SM's L1 before it was written.

Why this shape: at long context attention is bound by bytes, and a grid of one block per query
head and chunk (the earlier design, scripts/kernels/attention.py times it) read each K/V row
once per query head (from L2 after the first) and decoded it as often, and ran short blocks in
many waves. Here a row is read and decoded once; the two-stage stream keeps a tile in flight
per block while the last one is used, and a few blocks an SM (MAX_REGISTERS) overlap their
stalls.

Decode of the caches in registers: fp16 and e5m2 are both "sign, 5-bit exponent, mantissa",
so shifting the bits into an fp32 (sign to bit 31, the rest to bits 13 / 21 on) gives the
value / 2^112 exactly (subnormals included). The 2^112 is folded into q (for scores) and into
the final output, so the inner loops are 2-3 integer ops and an FMA per element. The decoders
here wrap every shift in int32() (real numba computes int32 shifts in int64).

Bytes moved: n attended positions x kv_dim x 2 (K and V) x bytes per element from DRAM, once;
q, out, and with several live splits their partials (written, then read by the merging block)
(pycalm.gpu.engine.step_bytes counts them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, uint32
from numba.cuda import libdevice

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    FULL_MASK,
    STATE_POS,
    as_f32,
    as_i32,
    dependent_start,
    h2f2,
    prmt,
    warp_reduce_max,
    warp_reduce_sum,
)
from pycalm.kernels.tensorcore import (
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_16816,
    pack_f16x2,
)
from pycalm.model.config import KV_DTYPES, ModelConfig

# ---------------------------------------------------------------------------------------------
# GPU kernel


# the kernel's sizes (scripts/kernels/attention.py times other values). Under the CUDA simulator (a
# Python thread per CUDA thread) smaller blocks, tiles and grids of the same kernel, so that the
# tests' short contexts still stream several tiles and merge several splits.
SIM = _numba_config.ENABLE_CUDASIM
THREADS = 64  # threads a block: two warps
KEYS = 16  # keys a warp tile: one k-step of P V, two 8-key tiles of the scores
STAGES = 2  # a warp's ring: the next warp tile in flight while one is used
# blocks a launch at most, where the splits can grow (split_len): fewer, longer splits pay less for
# the merge; under the simulator few, so that the tests' short contexts still grow them
TARGET_BLOCKS = 16 if SIM else 512
CHUNK = KEYS * THREADS // 32  # the shortest split: a warp tile a warp
UNROLL = 4  # independent partial loads in flight per output of the merge
MAX_REGISTERS = 65536 // (
    6 * THREADS
)  # launch bounds: six blocks an SM, as many as their shared memory allows (tests/test_ptx.py checks)
NEG = -1.0e30  # "no score": finite, so exp(NEG - m) is 0, not NaN
_LINE = 32  # floats in a 128-byte cache line


def check_head(head_dim: int, group: int, kv_dtype: str) -> None:
    """Raise PycalmError unless the kernel takes these sizes: head_dim a multiple of 16 (the mma
    k-steps and 16-byte copies of a row) and at most 8 query heads a kv head (an mma's n)."""
    if head_dim % 16 or not 0 < group <= 8:
        raise PycalmError(
            f"head_dim {head_dim} with {group} query heads a kv head ({kv_dtype} KV): attention takes"
            " head_dim a multiple of 16 and 1 to 8 query heads a kv head"
        )


def attention_chunk_len(head_dim: int, kv_dtype: str) -> int:
    """The shortest split (the default chunk of attention_scratch): CHUNK positions."""
    check_head(head_dim, 1, kv_dtype)
    return CHUNK


def split_len(span: int, chunk: int, n_kv_heads: int, target: int = TARGET_BLOCKS) -> int:
    """Positions a block takes in a launch over `span` positions: chunk times the smallest power
    of two that keeps the grid (n_kv_heads x splits) within `target` blocks, or the whole span."""
    split = chunk
    while split < span and n_kv_heads * -(-span // split) > target:
        split *= 2
    return split


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

    part: (n_heads, max splits, padded head_dim + 2) float32, per head and split the
      unnormalised sum of p*V, then the split's score max and its sum of exp(score - max);
      padded to 128-byte lines. Written before it is read: no initial contents needed.
    count: (n_kv_heads,) int32, splits of the kv head finished in the running launch; zero
      between launches (the last block resets it), so it must start zeroed.
    chunk: the shortest split (split_len).
    """

    part: object
    count: object
    chunk: int


def attention_scratch(
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    seq_len: int,
    *,
    chunk: int | None = None,
    stream: object = 0,
) -> AttentionScratch:
    """Allocate the scratch for contexts of up to seq_len positions (see AttentionScratch).
    chunk: the shortest split, a power of two (default attention_chunk_len); the tests take short
    ones to cover the merge at short contexts."""
    chunk = attention_chunk_len(head_dim, kv_dtype) if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1):
        raise PycalmError(f"attention chunk {chunk} is not a power of two")
    n_splits = max(-(-span // split_len(span, chunk, n_kv_heads)) for span in _spans(chunk, seq_len))
    padded = -(-(head_dim + 2) // _LINE) * _LINE
    part = cuda.device_array((n_heads, n_splits, padded), np.float32, stream=stream)
    count = cuda.to_device(np.zeros(n_kv_heads, np.int32), stream=stream)
    return AttentionScratch(part, count, chunk)


def _spans(chunk: int, seq_len: int) -> list[int]:
    """Every span a launch may cover: the splits of a span of s positions are as many as those
    of the power of two at or above s (split_len), so these bound them all."""
    spans, span = [], chunk
    while span < seq_len:
        spans.append(span)
        span *= 2
    return [*spans, span]


@cuda.jit(device=True, inline=True)
def _exp(x):  # noqa: ANN001, ANN202
    """exp(x) as ex2.approx(x log2 e): two instructions instead of the accurate expf's ~10
    (relative error ~1e-7 for the |x| < 20 that carry weight in a softmax; 0 for -1e30)."""
    return libdevice.fast_expf(x)


@cuda.jit(device=True, inline=True)
def _split(x: float, y: float) -> tuple[int, int]:
    """Two floats as two fp16 pairs: (fp16(x), fp16(y)) and the remainders (fp16(x - that),
    fp16(y - that)), each pair a word (x, the lower index, in the low half)."""
    hi = pack_f16x2(x, y)
    xh, yh = h2f2(hi)  # exact
    return hi, pack_f16x2(x - xh, y - yh)


@functools.cache
def attention_kernel(
    head_dim: int,
    group: int,
    kv_dtype: str,
    threads: int = THREADS,
    stages: int = STAGES,
    max_splits: int = TARGET_BLOCKS,
) -> object:
    """The kernel specialised for a head_dim, group size (query heads a kv head), KV dtype, block
    and ring, so the fragments and accumulators are fixed-size local arrays indexed by unrolled
    loops, which the compiler keeps in registers."""
    check_head(head_dim, group, kv_dtype)
    FP8 = kv_dtype == "fp8"
    D = head_dim
    KSTEPS = D // 16  # k-steps of K Q^T; also 16-dim tiles of V^T P^T
    FRAGS = 4 * KSTEPS  # Q^T fragment words (and O^T accumulators) a lane
    ROW = D // 2 + 4  # int32 words of a row as fp16 in shared memory, padded by 16 bytes (ldmatrix
    # reads 8 rows at once: they fall in 8 distinct groups of 4 banks)
    RAW = D // 4 if FP8 else ROW  # words of a row in the ring: e5m2 bytes, or the fp16 row
    PIECES = D // (16 if FP8 else 8)  # 16-byte copies a row as stored
    COPIES = 2 * KEYS * PIECES  # copies a warp tile (K rows, then V rows)
    COPY_STEPS = -(-COPIES // 32)
    STAGE = 2 * KEYS * RAW  # words a stage: the warp tile's K rows, then its V rows
    CONV = 2 * KEYS * ROW if FP8 else 0  # fp8: the warp tile as fp16 rows, K then V
    WARP_WORDS = stages * STAGE + CONV  # a warp's ring (and conversion tile)
    N_WARPS = threads // 32
    MAX_SPLITS = max_splits  # split_len keeps the live splits of a kv head within this
    # shared words: the warps' rings while streaming; then their accumulators; then the merge's weights
    SMEM = max(N_WARPS * WARP_WORDS, N_WARPS * group * D, group * MAX_SPLITS)
    OUTS = group * D  # a block's outputs: its heads' rows
    OPT = -(-OUTS // threads)  # outputs a thread
    SCALE = 1.0 / math.sqrt(head_dim)
    bounds = {} if SIM else {"launch_bounds": (threads, 65536 // (MAX_REGISTERS * threads))}
    wait_landed = cp_async_wait(stages - 1)  # all but the stages - 1 newest groups have landed

    @cuda.jit(device=True, inline=True)
    def issue(smem, k_cache, v_cache, base, t0, last, col0, lane):  # noqa: ANN001, ANN202
        """Start a warp's copies of the rows t0 .. t0 + KEYS - 1 (rows past `last` read row last:
        finite, and their p is 0) into the stage at word `base`."""
        for c in range(COPY_STEPS):
            i = lane + c * 32
            if i < COPIES:
                r = (i // PIECES) % KEYS
                piece = i % PIECES
                row = uint32(min(t0 + r, last))
                word = base + r * RAW + piece * 4
                if i < KEYS * PIECES:
                    cp_async16(smem, word, k_cache, row, col0 + piece * 8, 16)
                else:
                    cp_async16(smem, word + KEYS * RAW, v_cache, row, col0 + piece * 8, 16)

    @cuda.jit(device=True, inline=True)
    def widen(smem, src, dst, lane):  # noqa: ANN001, ANN202
        """fp8: the stage's 2 KEYS rows of e5m2 bytes at word src as fp16 rows at word dst, each
        byte the top byte of a half (exact)."""
        for i in range(lane, 2 * KEYS * (D // 4), 32):
            r = i // (D // 4)
            c = i % (D // 4)
            word = smem[src + r * RAW + c]
            smem[dst + r * ROW + 2 * c] = prmt(word, int32(0), int32(0x1404))  # bytes 0, 1
            smem[dst + r * ROW + 2 * c + 1] = prmt(word, int32(0), int32(0x3424))  # bytes 2, 3

    @cuda.jit(fastmath=False, cache=True, **bounds)
    def attention_kernel(q, k_cache, v_cache, state, part, count, out, window, split):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        # q (n_heads * head_dim,) f32; caches (seq_len, kv_dim * bytes / 2) viewed as fp16; part
        # (n_heads, max splits, >= head_dim + 2) f32; count (n_kv_heads,) i32; out (n_heads *
        # head_dim,) f32; split: positions a block
        kv_head = cuda.blockIdx.x
        split_id = cuda.blockIdx.y
        n_pos = int32(state[STATE_POS] + 1)
        start = int32(0)
        if window > 0 and n_pos > window:
            start = int32(n_pos - window)
        live = int32((n_pos - start + split - 1) // split)
        if split_id >= live:
            return  # the whole block leaves together: no barrier is left waiting
        first = int32(start + split_id * split)  # this split's first position
        n_here = min(int32(n_pos - first), int32(split))
        last = int32(first + n_here - 1)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2  # the lane's fragment row group
        t = lane & 3  # and its pair of columns
        n_tiles = int32((n_here + KEYS - 1) // KEYS)  # warp tiles of the split
        n_mine = int32((n_tiles - warp + N_WARPS - 1) // N_WARPS)  # this warp's: warp, warp + N_WARPS, ...
        col0 = kv_head * (D // (2 if FP8 else 1))  # the kv head's first column of the fp16 view
        ring = warp * WARP_WORDS  # this warp's ring of stages
        # (N_WARPS, stages, KEYS K rows then KEYS V rows, RAW) int32 rings (fp8: and a (2 KEYS,
        # ROW) fp16 tile); after the stream (N_WARPS, group, D) float32 bits, the warps'
        # accumulators; in the merge (group, MAX_SPLITS) float32 bits, the splits' weights
        smem = cuda.shared.array(SMEM, int32)
        pt = cuda.shared.array((N_WARPS, 8, KEYS), float32)  # a warp tile's p, (head, key)
        wm = cuda.shared.array((N_WARPS, 8), float32)  # each warp's score max, a head
        wl = cuda.shared.array((N_WARPS, 8), float32)  # each warp's sum of exp(score - max)
        is_last = cuda.shared.array(1, int32)  # merge: 1 in the last block of the kv head

        for i in range(stages - 1):  # the first warp tiles in flight, a group each
            if i < n_mine:
                issue(
                    smem,
                    k_cache,
                    v_cache,
                    ring + i * STAGE,
                    first + (warp + i * N_WARPS) * KEYS,
                    last,
                    col0,
                    lane,
                )
            cp_async_commit()
        # B fragments of Q^T (k = dims, n = heads): head g, dims 16 k + 2 t, +1 and + 8, + 9,
        # times 1/sqrt(head_dim), as fp16 hi and lo parts (zero for the heads past the group)
        qf = cuda.local.array(FRAGS, int32)  # per k-step: b0 hi, b1 hi, b0 lo, b1 lo
        for k in range(KSTEPS):
            for h in range(2):
                x = float32(0.0)
                y = float32(0.0)
                if g < group:
                    d = (kv_head * group + g) * D + 16 * k + 2 * t + 8 * h
                    x = q[d] * float32(SCALE)
                    y = q[d + 1] * float32(SCALE)
                qf[4 * k + h], qf[4 * k + 2 + h] = _split(x, y)
        o = cuda.local.array(FRAGS, float32)  # O^T accumulators: dims 16 k + g, + 8; heads 2 t, + 1
        for i in range(FRAGS):
            o[i] = float32(0.0)
        m0 = float32(NEG)  # running max of head 2 t's scores
        m1 = float32(NEG)  # and of head 2 t + 1's
        l0 = float32(0.0)  # this lane's part of head 2 t's sum of exp(score - m0)
        l1 = float32(0.0)
        mat = lane >> 3  # the ldmatrix matrix whose row address this lane gives
        # K as the A operand of K Q^T (rows keys, cols dims): matrices keys 0-7 | 8-15, dims 0-7,
        # then dims 8-15; V through .trans as the A operand of V^T P^T: keys 0-7, dims 0-7 | 8-15,
        # then keys 8-15
        k_row = ((lane & 7) + 8 * (mat & 1)) * ROW + 4 * (mat >> 1)
        v_row = ((lane & 7) + 8 * (mat >> 1)) * ROW + 4 * (mat & 1)

        for i in range(n_mine):
            ahead = i + stages - 1  # the warp tile that enters the ring now
            if ahead < n_mine:
                t_ahead = first + (warp + ahead * N_WARPS) * KEYS
                issue(smem, k_cache, v_cache, ring + (ahead % stages) * STAGE, t_ahead, last, col0, lane)
            cp_async_commit()  # (an empty group near the end)
            wait_landed()  # this lane's copies of warp tile i have landed ...
            cuda.syncwarp()  # ... and every lane's
            kb = ring + (i % stages) * STAGE  # the K rows as fp16, then the V rows
            if FP8:
                widen(smem, kb, ring + stages * STAGE, lane)
                kb = ring + stages * STAGE
                cuda.syncwarp()  # the fp16 tile is complete
            vb = kb + KEYS * ROW
            t0 = first + (warp + i * N_WARPS) * KEYS  # the warp tile's first position

            # S^T = K Q^T (keys x heads): lane holds keys g, g + 8 of heads 2 t, 2 t + 1
            s0 = float32(0.0)
            s1 = float32(0.0)
            s2 = float32(0.0)
            s3 = float32(0.0)
            for k in range(KSTEPS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, kb + k_row + 8 * k)
                s0, s1, s2, s3 = mma_16816(a0, a1, a2, a3, qf[4 * k], qf[4 * k + 1], s0, s1, s2, s3)
                s0, s1, s2, s3 = mma_16816(a0, a1, a2, a3, qf[4 * k + 2], qf[4 * k + 3], s0, s1, s2, s3)
            if t0 + g > last:  # a key past the end
                s0 = float32(NEG)
                s1 = float32(NEG)
            if t0 + g + 8 > last:
                s2 = float32(NEG)
                s3 = float32(NEG)

            # online softmax: each head's max over the tile's 16 keys (the lanes of one t)
            x0 = max(s0, s2)
            x1 = max(s1, s3)
            for off in (4, 8, 16):
                x0 = max(x0, cuda.shfl_xor_sync(FULL_MASK, x0, off))
                x1 = max(x1, cuda.shfl_xor_sync(FULL_MASK, x1, off))
            n0 = max(m0, x0)
            n1 = max(m1, x1)
            al0 = _exp(m0 - n0)
            al1 = _exp(m1 - n1)
            p0 = _exp(s0 - n0) if s0 > float32(NEG) else float32(0.0)
            p1 = _exp(s1 - n1) if s1 > float32(NEG) else float32(0.0)
            p2 = _exp(s2 - n0) if s2 > float32(NEG) else float32(0.0)
            p3 = _exp(s3 - n1) if s3 > float32(NEG) else float32(0.0)
            l0 = l0 * al0 + p0 + p2
            l1 = l1 * al1 + p1 + p3
            m0 = n0
            m1 = n1
            pt[warp, 2 * t, g] = p0
            pt[warp, 2 * t + 1, g] = p1
            pt[warp, 2 * t, g + 8] = p2
            pt[warp, 2 * t + 1, g + 8] = p3
            cuda.syncwarp()  # the tile's p is in pt

            # O^T = O^T alpha + V^T P^T: B fragments of P^T (k = keys, n = heads) from pt
            b0, b0l = _split(pt[warp, g, 2 * t], pt[warp, g, 2 * t + 1])
            b1, b1l = _split(pt[warp, g, 2 * t + 8], pt[warp, g, 2 * t + 9])
            for k in range(KSTEPS):
                a0, a1, a2, a3 = ldmatrix_x4_trans(smem, vb + v_row + 8 * k)
                c0 = o[4 * k] * al0
                c1 = o[4 * k + 1] * al1
                c2 = o[4 * k + 2] * al0
                c3 = o[4 * k + 3] * al1
                c0, c1, c2, c3 = mma_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
                c0, c1, c2, c3 = mma_16816(a0, a1, a2, a3, b0l, b1l, c0, c1, c2, c3)
                o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3] = c0, c1, c2, c3
            cuda.syncwarp()  # every lane is done with this stage and pt before they are refilled

        # the warps' (m, l, O) to shared memory
        for off in (4, 8, 16):  # each head's sum over the lanes of one t
            l0 += cuda.shfl_xor_sync(FULL_MASK, l0, off)
            l1 += cuda.shfl_xor_sync(FULL_MASK, l1, off)
        cuda.syncthreads()  # every warp is done with its ring: the accumulators go over the rings
        for k in range(KSTEPS):
            for c in range(4):
                h = 2 * t + (c & 1)  # the head of accumulator c
                if h < group:
                    d = 16 * k + g + 8 * (c >> 1)
                    smem[(warp * group + h) * D + d] = as_i32(o[4 * k + c])
        if g == 0:
            wm[warp, 2 * t] = m0
            wm[warp, 2 * t + 1] = m1
            wl[warp, 2 * t] = l0
            wl[warp, 2 * t + 1] = l1
        cuda.syncthreads()  # every warp's (m, l, O) is in shared memory
        for oo in range(OPT):
            i = tid + oo * threads
            if i < OUTS:
                h = i // D
                d = i % D
                bm = float32(NEG)
                for w in range(N_WARPS):
                    bm = max(bm, wm[w, h])
                a = float32(0.0)
                den = float32(0.0)
                for w in range(N_WARPS):
                    f = _exp(wm[w, h] - bm)
                    a += f * as_f32(smem[(w * group + h) * D + d])
                    den += f * wl[w, h]
                head = kv_head * group + h
                if live == 1:
                    out[head * D + d] = a / den
                else:
                    part[head, split_id, d] = a
                    if d == 0:
                        part[head, split_id, D] = bm
                        part[head, split_id, D + 1] = den
        if live == 1:
            return
        cuda.threadfence()  # this thread's part of the partial is visible device-wide ...
        cuda.syncthreads()  # ... for every thread, before the split is counted
        if tid == 0:
            done = cuda.atomic.add(count, kv_head, 1)
            is_last[0] = int32(1) if done == live - 1 else int32(0)
        cuda.syncthreads()  # is_last is set (and every read of the accumulators is done)
        if is_last[0] == 0:
            return

        # the merge: each split's weight exp(m_s - M) / sum_s exp(m_s - M) l_s, a warp a head
        cuda.threadfence()  # the other splits' partials are read after their count
        for h in range(warp, group, N_WARPS):
            head = kv_head * group + h
            hm = float32(NEG)
            for s in range(lane, live, 32):
                hm = max(hm, part[head, s, D])
            hm = warp_reduce_max(hm)
            den = float32(0.0)
            for s in range(lane, live, 32):
                den += _exp(part[head, s, D] - hm) * part[head, s, D + 1]
            den = warp_reduce_sum(den)
            for s in range(lane, live, 32):
                smem[h * MAX_SPLITS + s] = as_i32(_exp(part[head, s, D] - hm) / den)
        cuda.syncthreads()  # every split's weight is in smem
        outs = cuda.local.array(OPT, float32)
        for oo in range(OPT):
            outs[oo] = float32(0.0)
        for s0 in range(0, live, UNROLL):
            for u in range(UNROLL):  # independent loads; past-the-end ones read split live - 1
                s = min(s0 + u, live - 1)
                for oo in range(OPT):
                    i = min(tid + oo * threads, OUTS - 1)
                    h = i // D
                    x = as_f32(smem[h * MAX_SPLITS + s]) * part[kv_head * group + h, s, i % D]
                    outs[oo] += x if s0 + u < live else float32(0.0)
        for oo in range(OPT):
            i = tid + oo * threads
            if i < OUTS:
                out[(kv_head * group) * D + i] = outs[oo]
        if tid == 0:
            count[kv_head] = 0  # for the next launch (the next layer)

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
    attention_scratch(n_heads, n_kv_heads, head_dim, cache.dtype, >= seq_len). span: the grid
    covers positions 0..span-1 (split_len(span) positions a block; default the whole cache): the
    launch is right only while state[STATE_POS] < span. A graph captured at seq_len 32768 would
    otherwise launch splits of 512 positions where a short context wants 32 (attention_span: the
    spans an engine captures).
    """
    n_heads, n_kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if cache.dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {cache.dtype!r} (one of {', '.join(KV_DTYPES)})")
    check_head(head_dim, n_heads // n_kv_heads, cache.dtype)
    seq_len = cache.k.shape[0]
    span = seq_len if span is None else span
    if not 0 < span <= seq_len:
        raise PycalmError(f"attention span {span} is outside the cache's 1..{seq_len} positions")
    split = split_len(span, scratch.chunk, n_kv_heads)
    n_splits = -(-span // split)
    part = scratch.part
    if (
        part.shape[0] != n_heads
        or part.shape[1] < n_splits
        or part.shape[2] < head_dim + 2
        or scratch.count.shape[0] < n_kv_heads
    ):
        raise PycalmError(
            f"attention scratch {part.shape} does not fit {n_heads} heads of {seq_len} positions"
        )
    kernel = attention_kernel(head_dim, n_heads // n_kv_heads, cache.dtype)
    k16, v16 = cache.k.view(np.float16), cache.v.view(np.float16)
    window = int32(cfg.sliding_window)
    kernel[(n_kv_heads, n_splits), THREADS, stream](
        q, k16, v16, state, part, scratch.count, out, window, int32(split)
    )


def attention_span(pos: int, chunk: int, seq_len: int) -> int:
    """The span (see attention) of a step at pos: chunk times the smallest power of two that
    covers pos + 1, at most seq_len. An engine captures one step a span: at most
    log2(seq_len / chunk) + 1 of them, and a grid at most twice the live splits."""
    if not 0 <= pos < seq_len:
        raise PycalmError(f"position {pos} is outside the context of {seq_len} positions")
    span = chunk
    while span <= pos:
        span *= 2
    return min(span, seq_len)
