"""Decode attention: the shipped split kernel's tunings and the earlier per-head kernel's, each
checked against the reference and timed.

The shipped kernel (pycalm.kernels.attention: a block per kv head and split of the keys, warps
streaming warp tiles through cp.async rings; `SplitTuning` sizes it):
  default   through the package's launcher: 128 threads, warp tiles of 4 positions, rings of 4
            stages, splits sized for 512 blocks at most, the shortest split 32 positions
  s_t256    256 threads a block
  s_tile8   warp tiles of 8 positions, 3 stages (head_dim 128 fp16: too much shared memory)
  s_t8st2   warp tiles of 8 positions, 2 stages (about 17% fewer instructions a position than the
            default in the machine code, scripts/kernels/sass_loops.py, but one tile in flight)
  s_st3     rings of 3 stages; s_st6: 6
  s_c16, s_c64, s_c128, s_c256  the shortest split 16 / 64 / 128 / 256 positions (a short context
            of few kv heads in fewer splits: less to merge, more tiles a warp)
  s_tg256, s_tg1024  splits sized for 256 / 1024 blocks
  s_pad2, s_tg256_pad2  the default / s_tg256 with 48 KiB of dynamic shared memory a block
            reserved, so an SM holds two blocks (the token step launches the kernel behind qkv's,
            and the scheduler may crowd a small grid onto the few SMs free then)
  s_m8      the merge loading 8 splits a round (the package's 4; 8 spills 28-32 bytes for
            groups of 6 and 8, none at the 8B's 4)
  s_nomerge, s_tg256_nomerge  probes, not versions: the default / s_tg256 with every kv head's
            counter started at -2**30, so no block merges the splits (outputs unchecked); against
            their version they time the merge
The earlier kernel (a block per QUERY head and chunk of positions, every K and V load of the
chunk issued at once into registers, the last block of a head combining the chunks;
`tuned_kernel` below, its sizes a Tuning):
  copy      its shipped sizes: 256 threads, chunks of up to 256 positions, 16 K and 16 V words a
            thread, 4 K / 2 V words of a row a lane, 8 partial loads in flight in the combine
  t128      same as copy but 128 threads a block
  t512      same as copy but 512 threads a block
  c128      same as copy but chunks of up to 128 positions
  c64       same as copy but chunks of up to 64 positions
  c64t128   same as c64 but 128 threads a block
  c512      same as copy but chunks of up to 512 positions (32 words a thread: more registers)
  kw2, kw8  same as copy but 2 / 8 words of a K row a lane (more / fewer lanes a position)
  vw1, vw4  same as copy but 1 / 4 words of a V row a lane
  w32kw2    one warp, chunks of up to 16, 2 K / 1 V words a lane (more lanes a row), 2 loads in
            flight in the combine
  kw8vw4    64 threads, chunks of up to 8, 8 K / 4 V words a lane (one lane a row), 1 load in
            flight in the combine

How to run (on the GPU machine, from the repository root):

    python3 scripts/kernels/attention.py                      # the default, timed
    python3 scripts/kernels/attention.py --variants all --check
    python3 scripts/kernels/attention.py --shapes Llama-3-8B --n-pos 256,4000,8000,16000,32000 \
        --variants default,copy,s_tg256 --check                 # long contexts
    python3 scripts/kernels/attention.py --shapes Qwen2.5-0.5B,Qwen2.5-1.5B --n-pos 1,64,160,300 \
        --variants default,s_c64,s_c128,s_c256,s_nomerge --check  # the speculative pair's
    NUMBA_ENABLE_CUDASIM=1 python3 scripts/kernels/attention.py --variants all --tiny
        # every variant checked at a tiny shape under the simulator (no timing)

For each model shape x KV dtype x n_pos: one CUDA graph of LAYERS attention launches, each over
its own layer's cache (so the 50 MB L2 does not hold the cache between launches, as in a real
token step), replayed RUNS times and timed with CUDA events (median); each n_pos is timed with
the engine's grid (attention_span) and with a grid over the whole cache. GB/s counts the K and V
rows read at n_pos; the ceiling is a uint64 grid-stride copy measured in the same run (bytes read
+ written). Caches hold random finite fp16 / e5m2 bit patterns made on the GPU. N_POS includes
64 (a short chat) and the chunk + 1 (the shortest context that goes through the combine).
--check compares every variant's output for layer 0 with pycalm.cpu.reference.attention_ref on the
host-decoded cache: max |error| / max |ref| (float32 summation order only), against 1e-5.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

from numba import config as numba_config  # noqa: E402
from numba import cuda, float32, int32, int64, uint32  # noqa: E402
from numba.cuda import libdevice  # noqa: E402

from pycalm.cpu.reference import attention_ref  # noqa: E402
from pycalm.kernels.attention import (  # noqa: E402
    KVCache,
    attention,
    attention_kernel,
    attention_scratch,
    attention_span,
    split_len,
)
from pycalm.kernels.common import (  # noqa: E402
    FP_RAW_SCALE,
    MASK_E5M2,
    MASK_FP16,
    STATE_POS,
    as_f32,
    dependent_start,
    warp_reduce_max,
    warp_reduce_sum,
)
from pycalm.kernels.warpgroup import launch_dynamic  # noqa: E402
from pycalm.model import formats  # noqa: E402
from pycalm.model.config import ModelConfig  # noqa: E402

# n_heads, n_kv_heads, head_dim; the Qwen2.5 shapes are the speculative pair's (the draft's
# attention at 64-300 positions: 8.7-11 us a layer on an H100, 3.6-5.9 of it the merge,
# docs/BENCHMARKS.md)
SHAPES = {
    "Llama-3-8B": (32, 8, 128),
    "TinyLlama": (32, 4, 64),
    "Qwen2.5-0.5B": (14, 2, 64),
    "Qwen2.5-1.5B": (12, 2, 128),
}
TINY_SHAPES = {"tiny": (3, 1, 32)}
N_POS = (64, 256, 4000)
TINY_N_POS = (5, 37)
SEQ_LEN = 4096
LAYERS = 16
RUNS = 15
TOLERANCE = 1e-5  # max |error| / max |ref|
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF}  # clear an exponent bit: finite values only
NEG = -1.0e30  # "no score yet": finite, so exp(NEG - m) is 0, not NaN
_LINE = 32  # floats in a 128-byte cache line


# ---------------------------------------------------------------------------------------------
# the kernel with its sizes as arguments


@dataclass(frozen=True)
class Tuning:
    """The sizes of tuned_kernel; the defaults are the shipped kernel's (pycalm.kernels.attention
    THREADS, MAX_CHUNK, REG_WORDS, K_WORDS, V_WORDS, UNROLL)."""

    threads: int = 256  # threads a block
    max_chunk: int = 256  # most positions a block takes
    reg_words: int = 16  # int64 words of K (and as many of V) a thread holds in flight: 64 registers
    k_words: int = 4  # words of a K row a lane takes (fewer lanes a position: fewer shuffles)
    v_words: int = 2  # words of a V row a lane takes (more lanes a position: fewer team merges)
    unroll: int = 8  # independent partial loads in flight per thread of the combine


def _elems_per_word(kv_dtype: str) -> int:
    return 8 if kv_dtype == "fp8" else 4


def chunk_len(head_dim: int, kv_dtype: str, tuning: Tuning) -> int:
    """Positions a block takes (pycalm.kernels.attention.attention_chunk_len for a tuning)."""
    row_words = head_dim // _elems_per_word(kv_dtype)
    chunk = tuning.max_chunk
    while chunk > 1 and chunk * row_words > tuning.reg_words * tuning.threads:
        chunk //= 2
    return chunk


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
def tuned_kernel(
    head_dim: int,
    group: int,
    kv_dtype: str,
    chunk: int,
    threads: int,
    k_words: int,
    v_words: int,
    unroll: int,
) -> object:
    """pycalm.kernels.attention's kernel with the sizes of a Tuning as arguments: the same code
    as attention_kernel, threads, k_words, v_words and unroll taking the place of its THREADS,
    K_WORDS, V_WORDS and UNROLL."""
    IS_FP8 = kv_dtype == "fp8"
    ELEMS_PER_WORD = _elems_per_word(kv_dtype)  # cache elements an int64 word holds
    ROW_WORDS = head_dim // ELEMS_PER_WORD  # words of one head's K (or V) row
    N_WARPS = threads // 32
    CHUNK_LOG2 = chunk.bit_length() - 1
    # K loads: a team of K_TEAM lanes takes one position, each lane K_LANE_WORDS words of its
    # row (interleaved: lane l of the team takes words l, l + K_TEAM, ...); one load step of the
    # block covers K_STEP_POSITIONS positions, K_STEPS steps cover the chunk, and a lane holds
    # K_REG_WORDS words in all
    K_TEAM = _team(ROW_WORDS, k_words)
    K_LANE_WORDS = ROW_WORDS // K_TEAM
    K_LANE_ELEMS = K_LANE_WORDS * ELEMS_PER_WORD
    K_STEP_POSITIONS = N_WARPS * (32 // K_TEAM)
    K_STEPS = -(-chunk // K_STEP_POSITIONS)
    K_REG_WORDS = K_STEPS * K_LANE_WORDS
    # V loads: the same, with V's team
    V_TEAM = _team(ROW_WORDS, v_words)
    V_LANE_WORDS = ROW_WORDS // V_TEAM
    V_LANE_ELEMS = V_LANE_WORDS * ELEMS_PER_WORD
    V_STEP_POSITIONS = N_WARPS * (32 // V_TEAM)
    V_STEPS = -(-chunk // V_STEP_POSITIONS)
    V_REG_WORDS = V_STEPS * V_LANE_WORDS
    Q_SCALE = FP_RAW_SCALE / math.sqrt(head_dim)  # 1/sqrt(head_dim) and the decode's 2^112
    SLICES = max(1, threads // head_dim)  # combine: thread (slice, d) sums every SLICES-th chunk

    @cuda.jit(fastmath=False)
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
        for d in range(tid, head_dim, threads):
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
        for i in range(tid, SLICES * head_dim, threads):
            sl = i // head_dim  # this thread's slice of the chunks
            d = i % head_dim
            acc = float32(0.0)
            for c0 in range(sl * unroll, live_chunks, SLICES * unroll):
                for u in range(unroll):  # independent loads; past-the-end ones read chunk live_chunks - 1
                    c = min(c0 + u, live_chunks - 1)
                    x = _exp(part[head, c, head_dim] - head_max) * part[head, c, d]
                    acc += x if c0 + u < live_chunks else float32(0.0)
            slice_sums[sl, d] = acc
        cuda.syncthreads()  # every slice's sum is in slice_sums
        for d in range(tid, head_dim, threads):
            acc = float32(0.0)
            for sl in range(SLICES):
                acc += slice_sums[sl, d]
            out[head * head_dim + d] = acc / denom
        if tid == 0:
            count[head] = 0  # for the next launch (the next layer)

    return attention_kernel


@dataclass(frozen=True)
class TunedScratch:
    """pycalm.kernels.attention.AttentionScratch for a tuning: part (n_heads, n_chunks, padded
    head_dim + 2) float32, count (n_heads,) int32 zeros, chunk."""

    part: object
    count: object
    chunk: int
    tuning: Tuning


def tuned_scratch(n_heads: int, head_dim: int, kv_dtype: str, seq_len: int, tuning: Tuning,
                  stream: object) -> TunedScratch:  # fmt: skip
    chunk = chunk_len(head_dim, kv_dtype, tuning)
    padded = -(-(head_dim + 2) // _LINE) * _LINE
    part = cuda.device_array((n_heads, -(-seq_len // chunk), padded), np.float32, stream=stream)
    count = cuda.to_device(np.zeros(n_heads, np.int32), stream=stream)
    return TunedScratch(part, count, chunk, tuning)


def tuned_attention(q: object, cache: KVCache, state: object, out: object, cfg: ModelConfig,
                    scratch: TunedScratch, *, stream: object, span: int | None = None) -> None:  # fmt: skip
    """pycalm.kernels.attention.attention through tuned_kernel (the same grid: span positions)."""
    t = scratch.tuning
    group = cfg.n_heads // cfg.n_kv_heads
    kernel = tuned_kernel(cfg.head_dim, group, cache.dtype, scratch.chunk, t.threads, t.k_words, t.v_words,
                          t.unroll)  # fmt: skip
    span = cache.k.shape[0] if span is None else span
    grid = (cfg.n_heads, -(-span // scratch.chunk))
    k64, v64 = cache.k.view(np.int64), cache.v.view(np.int64)
    kernel[grid, t.threads, stream](q, k64, v64, state, scratch.part, scratch.count, out,
                                    int32(cfg.sliding_window))  # fmt: skip


@dataclass(frozen=True)
class SplitTuning:
    """Sizes of the shipped split kernel (pycalm.kernels.attention THREADS, TILE, STAGES,
    TARGET_BLOCKS, CHUNK)."""

    threads: int = 128
    tile: int = 4
    stages: int = 4
    target: int = 512
    chunk: int = 32
    pad: int = 0  # dynamic shared bytes a launch reserves beyond the kernel's own (fewer blocks an SM)
    merge: bool = True  # False: the counters start at -2**30, so no block is a kv head's last (a probe)
    merge_loads: int = 4  # the merge's splits a round (pycalm.kernels.attention.MERGE_LOADS)


@dataclass(frozen=True)
class SplitScratch:
    """pycalm.kernels.attention.AttentionScratch for a SplitTuning."""

    part: object
    count: object
    chunk: int
    tuning: SplitTuning


def split_scratch(n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int, tuning: SplitTuning,
                  stream: object) -> SplitScratch:  # fmt: skip
    padded = -(-(head_dim + 2) // _LINE) * _LINE
    part = cuda.device_array((n_heads, tuning.target, padded), np.float32, stream=stream)
    count = cuda.to_device(np.full(n_kv_heads, 0 if tuning.merge else -(1 << 30), np.int32), stream=stream)
    return SplitScratch(part, count, tuning.chunk, tuning)


# ---------------------------------------------------------------------------------------------
# the versions: name -> its Tuning (None: the package's launcher)

DEFAULT = Tuning()
VARIANTS = {
    "default": None,
    "copy": DEFAULT,
    "t128": dataclasses.replace(DEFAULT, threads=128),
    "t512": dataclasses.replace(DEFAULT, threads=512),
    "c128": dataclasses.replace(DEFAULT, max_chunk=128),
    "c64": dataclasses.replace(DEFAULT, max_chunk=64),
    "c64t128": dataclasses.replace(DEFAULT, max_chunk=64, threads=128),
    "c512": dataclasses.replace(DEFAULT, max_chunk=512, reg_words=32),
    "kw2": dataclasses.replace(DEFAULT, k_words=2),
    "kw8": dataclasses.replace(DEFAULT, k_words=8),
    "vw1": dataclasses.replace(DEFAULT, v_words=1),
    "vw4": dataclasses.replace(DEFAULT, v_words=4),
    "w32kw2": Tuning(threads=32, max_chunk=16, k_words=2, v_words=1, unroll=2),
    "kw8vw4": Tuning(threads=64, max_chunk=8, k_words=8, v_words=4, unroll=1),
    "s_t256": SplitTuning(threads=256),
    "s_tile8": SplitTuning(tile=8, stages=3),
    "s_t8st2": SplitTuning(tile=8, stages=2),
    "s_st3": SplitTuning(stages=3),
    "s_st6": SplitTuning(stages=6),
    "s_c16": SplitTuning(chunk=16),
    "s_c64": SplitTuning(chunk=64),
    "s_c128": SplitTuning(chunk=128),
    "s_c256": SplitTuning(chunk=256),
    "s_tg256": SplitTuning(target=256),
    "s_tg1024": SplitTuning(target=1024),
    "s_pad2": SplitTuning(pad=48 * 1024),
    "s_tg256_pad2": SplitTuning(target=256, pad=48 * 1024),
    "s_m8": SplitTuning(merge_loads=8),
    "s_nomerge": SplitTuning(merge=False),
    "s_tg256_nomerge": SplitTuning(target=256, merge=False),
}


def for_simulator(tuning: Tuning | None) -> Tuning | None:
    """The same tuning with at most 64 threads and chunks of 16 (a Python thread per thread);
    the package's kernel has its own simulator sizes."""
    if tuning is None:
        return None
    if isinstance(tuning, SplitTuning):
        return dataclasses.replace(tuning, threads=64, chunk=8, target=min(tuning.target, 16), pad=0)
    return dataclasses.replace(tuning, threads=min(tuning.threads, 64), max_chunk=min(tuning.max_chunk, 16))


def split_attention(q: object, cache: KVCache, state: object, out: object, cfg: ModelConfig,
                    scratch: SplitScratch, *, stream: object, span: int | None = None) -> None:  # fmt: skip
    """pycalm.kernels.attention.attention with a SplitTuning's sizes."""
    t = scratch.tuning
    kernel = attention_kernel(
        cfg.head_dim,
        cfg.n_heads // cfg.n_kv_heads,
        cache.dtype,
        t.threads,
        t.tile,
        t.stages,
        t.target,
        merge_loads=t.merge_loads,
    )
    span = cache.k.shape[0] if span is None else span
    split = split_len(span, scratch.chunk, cfg.n_kv_heads, t.target)
    k16, v16 = cache.k.view(np.float16), cache.v.view(np.float16)
    count = scratch.count
    if q.ndim == 1:  # the token step's one row, as the kernel takes rows
        q, out = q.reshape(1, q.shape[0]), out.reshape(1, out.shape[0])
    grid = (cfg.n_kv_heads, -(-span // split))
    args = (
        q, k16, v16, state, scratch.part, count, out, int32(cfg.sliding_window), int32(split),
        state, state, count.reshape(1, count.shape[0]), int32(0),  # unpaged: the pages' arguments, unread
    )  # fmt: skip
    if t.pad:
        launch_dynamic(kernel, grid, t.threads, stream, t.pad, args)
    else:
        kernel[grid, t.threads, stream](*args)


def launcher(scratch: object):  # noqa: ANN201
    """The launch of the version whose scratch this is."""
    if isinstance(scratch, SplitScratch):
        return split_attention
    return tuned_attention if isinstance(scratch, TunedScratch) else attention


def config(n_heads: int, n_kv_heads: int, head_dim: int) -> ModelConfig:
    """A config with these attention sizes (attention reads no other field)."""
    return ModelConfig(
        arch="llama",
        dim=n_heads * head_dim,
        hidden_dim=8,
        head_dim=head_dim,
        n_layers=1,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=8,
        max_seq_len=SEQ_LEN,
        rope_theta=1e4,
        rotary_dim=head_dim,
        norm_eps=1e-5,
        bos_id=1,
        eos_ids=(),
    )


def random_caches(n_layers: int, seq_len: int, kv_dim: int, kv_dtype: str, seed: int) -> list[KVCache]:
    """n_layers caches of random finite values (on the GPU: gpubench.fill; simulator: NumPy)."""
    rng = np.random.default_rng(seed)
    caches = []
    for layer in range(n_layers):
        pair = []
        for which in range(2):
            if numba_config.ENABLE_CUDASIM:
                rows = formats.encode(rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32), kv_dtype)
                pair.append(cuda.to_device(rows))
            else:
                from gpubench import fill

                words = cuda.device_array(seq_len * kv_dim * (2 if kv_dtype == "fp16" else 1) // 4, np.uint32)
                fill(words, 2 * layer + which + 1 + seed, MASK[kv_dtype])
                dt = np.float16 if kv_dtype == "fp16" else np.uint8
                pair.append(words.view(dt).reshape(seq_len, kv_dim))
        caches.append(KVCache(pair[0], pair[1], kv_dtype))
    return caches


def check(q: np.ndarray, cache: KVCache, cfg: ModelConfig, scratch: object, n_pos: int, span: int) -> float:
    """Max |kernel - attention_ref| / max |ref| at n_pos, the grid over span positions."""
    state = cuda.to_device(np.array([0, n_pos - 1, 0], np.int32))
    out = cuda.to_device(np.full(q.shape[0], np.nan, np.float32))
    launcher(scratch)(cuda.to_device(q), cache, state, out, cfg, scratch, stream=0, span=span)
    cuda.synchronize()
    k, v = (formats.decode(a.copy_to_host(), cache.dtype).astype(np.float32) for a in (cache.k, cache.v))
    want = attention_ref(q, k, v, n_pos, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    return float(np.max(np.abs(out.copy_to_host() - want)) / np.max(np.abs(want)))


def attention_layers(caches: list[KVCache], q: object, state: object, out: object, cfg: ModelConfig,
                     scratch: object, stream: object, span: int | None) -> None:  # fmt: skip
    """The launches of one timed graph: attention over every layer's cache."""
    launch = launcher(scratch)
    for cache in caches:
        launch(q, cache, state, out, cfg, scratch, stream=stream, span=span)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default", help="'all' or names: " + ",".join(VARIANTS))
    ap.add_argument("--check", action="store_true", help="compare each variant with attention_ref")
    ap.add_argument("--tiny", action="store_true", help="check only, at a tiny shape (simulator)")
    ap.add_argument("--n-pos", default=",".join(map(str, N_POS)), help="context lengths to time")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="model shapes: " + ",".join(SHAPES))
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    tiny = args.tiny or numba_config.ENABLE_CUDASIM
    if tiny:
        shapes, positions = TINY_SHAPES, TINY_N_POS
    else:
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
        positions = tuple(int(n) for n in args.n_pos.split(","))
    seq_len = 64 if tiny else max(SEQ_LEN, *positions)
    stream = cuda.stream()
    ceiling = float("nan")
    if not tiny:
        from gpubench import copy_ceiling

        ceiling = copy_ceiling(stream)
        print(f"device: {cuda.get_current_device().name}")
        print(f"copy ceiling (uint64 grid-stride, read + write): {ceiling:,.0f} GB/s", flush=True)
    rows, failed = [], []
    for shape, (n_heads, n_kv_heads, head_dim) in shapes.items():
        cfg = config(n_heads, n_kv_heads, head_dim)
        kv_dim = n_kv_heads * head_dim
        q_host = (np.random.default_rng(0).standard_normal(n_heads * head_dim) * 0.3).astype(np.float32)
        q = cuda.to_device(q_host)
        out = cuda.device_array(n_heads * head_dim, np.float32)
        for kv_dtype in ("fp16", "fp8"):
            caches = random_caches(1 if tiny else LAYERS, seq_len, kv_dim, kv_dtype, seed=0)
            for name in names:
                tuning = for_simulator(VARIANTS[name]) if tiny else VARIANTS[name]
                if tuning is None:
                    scratch = attention_scratch(
                        n_heads, n_kv_heads, head_dim, kv_dtype, seq_len, stream=stream
                    )
                elif isinstance(tuning, SplitTuning):
                    scratch = split_scratch(n_heads, n_kv_heads, head_dim, seq_len, tuning, stream)
                else:
                    scratch = tuned_scratch(n_heads, head_dim, kv_dtype, seq_len, tuning, stream)
                for n_pos in (*positions, min(scratch.chunk + 1, seq_len)):  # past one chunk where it fits
                    span = attention_span(n_pos - 1, scratch.chunk, seq_len)  # the engine's grid
                    probe = isinstance(tuning, SplitTuning) and not tuning.merge  # its outputs are partial
                    err = (
                        check(q_host, caches[0], cfg, scratch, n_pos, span)
                        if (args.check or tiny) and not probe
                        else float("nan")
                    )
                    if err > TOLERANCE:
                        failed.append(f"{shape} {kv_dtype} {name} n_pos {n_pos}: error {err:.1e}")
                    if tiny:
                        print(f"{shape} {kv_dtype} {name:8s} n_pos {n_pos:3d}: error {err:.1e}", flush=True)
                        continue
                    from gpubench import graph_seconds

                    state = cuda.to_device(np.array([0, n_pos - 1, 0], np.int32))
                    launch = functools.partial(attention_layers, caches, q, state, out, cfg, scratch, stream)
                    t = graph_seconds(stream, functools.partial(launch, span), RUNS) / LAYERS
                    t_whole = graph_seconds(stream, functools.partial(launch, None), RUNS) / LAYERS
                    gbs = n_pos * kv_dim * 2 * (2 if kv_dtype == "fp16" else 1) / t / 1e9
                    rows.append((shape, kv_dtype, name, n_pos, t * 1e6, gbs, 100 * gbs / ceiling, err,
                                 scratch.chunk, t_whole * 1e6))  # fmt: skip
                    print(f"{shape:11s} {kv_dtype:5s} {name:9s} {n_pos:6d} {t * 1e6:8.2f} us {gbs:8,.0f} GB/s "
                          f"err {err:.1e} chunk {scratch.chunk}; whole-cache grid {t_whole * 1e6:.2f} us",
                          flush=True)  # fmt: skip
            del caches
    if rows:
        print(
            "\n=== summary (us a layer; KV GB/s; % of the copy ceiling; max rel. error vs attention_ref) ==="
        )
        print(f"copy ceiling {ceiling:,.0f} GB/s")
        print(f"{'model':11s} {'kv':5s} {'variant':9s} {'n_pos':>6s} {'us/layer':>9s} {'KV GB/s':>8s} "
              f"{'% ceil':>7s} {'err':>8s} {'chunk':>6s} {'whole-cache grid us':>20s}")  # fmt: skip
        for r in rows:
            print(f"{r[0]:11s} {r[1]:5s} {r[2]:9s} {r[3]:6d} {r[4]:9.2f} {r[5]:8,.0f} {r[6]:6.1f}% "
                  f"{r[7]:8.1e} {r[8]:6d} {r[9]:20.2f}")  # fmt: skip
    if failed:
        sys.exit("attention variants off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
