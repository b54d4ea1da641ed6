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
context (split_len: the grid stays within TARGET_BLOCKS blocks, the four an SM holds), so a
short context has many short splits and a long one a few hundred long ones; a captured grid
cannot depend on pos, so it covers a span of positions (attention_span: the engine captures a
step for each power-of-two span) and the blocks past the live splits exit at once. The warps of
a block work apart until the end: warp w takes the warp tiles (TILE positions each) w, w +
N_WARPS, ... of the split, and for each:

1. streams it through its own ring of STAGES stages in shared memory, the K and V rows of the kv
   head as stored (cp.async, 16 bytes a copy, no registers): STAGES - 1 tiles in flight while one
   is used. No block barrier: a lane waits for its copies (cp.async.wait_group), the warp for
   every lane's (__syncwarp).
2. scores: a team of T lanes holds a row (lane i of the team: int32 words i, i + T, ... of it,
   conflict-free shared loads), 32 / T rows a warp at a time. Each lane dots its words with its
   slice of every query head of the group (q in registers, times 1/sqrt(head_dim)), then a
   transposing butterfly over the team sums the tile's (row, head) partial dots: each xor step
   hands half of the values to the partner and adds the other half, so n sums over T lanes cost
   about n shuffles, not n log2 T. After it a lane holds the scores of ONE head (`mine`).
3. online softmax, a head's lanes together: the tile's max (xor shuffles over the lanes that
   hold the head's other rows), m = max(m, it), alpha = exp(m_old - m), p = exp(score - m) once
   a score, l (the lane's part) = l alpha + p. p and alpha go to the warp's rows of shared
   memory (__syncwarp).
4. p V: each lane rescales its accumulators by alpha and adds p times its slice of the V rows
   of its team's rows, for every head.
5. after its last tile the warp lets the next kernel launch (launch_dependents: earlier, its
   blocks would take the SMs' slots from the stream); the teams of a warp are added (xor
   shuffles), the warps' (m, l, acc) meet in shared memory (barriers) and the block's (head,
   dim) outputs are merged by rescaling. One live split (every context up to `split`): out =
   acc / l. Several: the block writes its (unnormalised acc, m, l) to its slot of `part`, and
   the LAST block of the kv head to finish (a per-kv-head atomic counter) merges the splits'
   partials (each split's weight exp(m_s - M) / sum exp(m_s - M) l_s, then MERGE_LOADS
   independent loads a round) and resets the counter. Each (head, split) slot of `part` is padded to whole
   128-byte lines, so no line the merging block reads was ever cached in its SM's L1 before
   it was written.

Several query rows (q (rows, q_dim): consecutive positions of one sequence, row r at
state[STATE_POS] + r, causal) multiply the grid's first dimension: block (g rows + r, s) is row
r's, with its own live splits, partial slots and counter. The rows of one (kv head, split) are
neighbouring blocks, so they run together and the K and V rows they share come from L2 after
the first. The rows pass (pycalm.gpu.prefill) launches it for its few-row passes.

Paged (pages given: the batched pass of serve --parallel, pycalm.gpu.batched): the cache is a
pool of pages of page_size rows, and query row r is position positions[r] of sequence s =
seq_of_row[r] (device arrays, so a captured graph replays with new ones), its key t in pool row
table[s, t >> log2(page_size)] * page_size + (t & (page_size - 1)) (pool_row: one table load a
copy, from L1, ahead of the cp.async). Every row has its own live splits, partial slots and
counter, as above; since the rows' blocks fill the GPU themselves, a launch of R rows takes
splits R times longer (split_len over n_kv_heads * R blocks), and its partials are a view of
a flat scratch. A row of sequence -1 is padding: its split 0 writes zeros, and nothing else runs.

Rows that are no whole number of 16-byte pieces, or too short for a team (the tiny heads of test
models: head_dim 8 in fp8 is 8 bytes), are copied word by word into rows of shared memory padded
with zeros to a power of two of at least 8 words (_shared_row).

Why this shape: at long context attention is bound by bytes, and a grid of one block per query
head and chunk (the earlier design, scripts/kernels/attention.py times it) read each K/V row
once per query head (from L2 after the first) and decoded it as often, and ran short blocks in
many waves. Here a row is read and decoded once, and each warp keeps three tiles in flight.
Measured (docs/BENCHMARKS.md) it moves about 1.6 TB/s of cache at 32k positions, 40% of the copy
ceiling: the warps are bound by their own latency (the butterfly, the softmax and shared-memory
round trips between dependent steps) more than by DRAM, and a version on the tensor cores (mma
for K Q^T and V^T P^T, a third of the instructions) was no faster (commit ce51c9c).

Decode of the caches in registers: cvt.f32.f16 widens a half of a word exactly, one
instruction an fp16 element; an e5m2 byte is the top byte of an fp16, so a byte permute puts two
of a word's bytes there first (1.5 instructions an element). The stream loop's shared-memory
words are addressed from an unsigned per-lane base (no wraparound test, constant offsets in the
loads) and each copy step knows whether it copies K or V rows. Per warp tile (Llama-3-8B: head_dim
128, a group of 4) that is 393 instructions a lane in fp16 and 369 in fp8
(scripts/kernels/sass_loops.py counts them in the machine code).

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
    fp16_encode,
    grid_dependency_wait,
    h2f2,
    last_to_arrive,
    launch_dependents,
    prmt,
    warp_reduce_max,
    warp_reduce_sum,
)
from pycalm.kernels.tensorcore import cp_async16, cp_async_commit, cp_async_wait
from pycalm.model.config import KV_DTYPES, ModelConfig

# ---------------------------------------------------------------------------------------------
# GPU kernel


# the kernel's sizes (scripts/kernels/attention.py times other values). Under the CUDA simulator (a
# Python thread per CUDA thread) smaller blocks, tiles and grids of the same kernel, so that the
# tests' short contexts still stream several tiles and merge several splits.
SIM = _numba_config.ENABLE_CUDASIM
THREADS = 64 if SIM else 128  # threads a block
TILE = 4  # positions a warp tile: a stage of a warp's stream, 4 KB of K and V rows at head_dim 128, fp16
STAGES = 4  # a warp's ring: three warp tiles in flight while one is used
# blocks a launch at most, where the splits can grow (split_len): the four blocks an SM holds, on all
# 132 SMs. Fewer, longer splits pay less for the merge alone (scripts/kernels/attention.py: 256 is
# 1.3x faster than 512 at 4k positions), but in a token step the kernel launches early behind the
# qkv kernel (programmatic edges) and the block scheduler packs a small grid onto the few SMs free
# at that moment: Llama-3-8B fp16 at D = 32,000 ran 118 tok/s with 256, 143 with 512
TARGET_BLOCKS = 16 if SIM else 512
CHUNK = 2 * TILE * THREADS // 32  # the shortest split: two warp tiles a warp
MERGE_LOADS = 4  # splits a merge round loads at once for each of a thread's outputs (split_terms)
# registers a thread at most, so that three blocks of 128 threads fit an SM's 64k (tests/test_ptx.py
# checks it with ptxas); the launch bounds ask for four (16 warps, 48 warp tiles in flight an SM)
# where a lane's query slices and accumulators are 16 floats or fewer (GQA groups up to 4 at
# head_dim 128, fp16), three for larger groups
MAX_REGISTERS = 65536 // (3 * 128)
NEG = -1.0e30  # "no score": finite, so exp(NEG - m) is 0, not NaN
_LINE = 32  # floats in a 128-byte cache line


def _row_words(head_dim: int, kv_dtype: str) -> int:
    """int32 words of one head's K (or V) row."""
    return head_dim * (1 if kv_dtype == "fp8" else 2) // 4


def _team(row_words: int) -> int:
    """Lanes that hold a row: the largest power of two up to 32 that divides its words."""
    lanes = 1
    while lanes < 32 and row_words % (2 * lanes) == 0:
        lanes *= 2
    return lanes


def _shared_row(head_dim: int, group: int, kv_dtype: str, tile: int = TILE) -> int:
    """int32 words of a row in shared memory: the row itself where cp.async copies it (whole
    16-byte pieces) and a team of at least max(32 / tile, the padded group) lanes divides it;
    else (the tiny heads of test models) a power of two of at least 8 words and the group, the
    words past the row zero."""
    row = _row_words(head_dim, kv_dtype)
    group_p2 = 1 << (group - 1).bit_length()
    if row % 4 == 0 and _team(row) >= max(32 // tile, group_p2):
        return row
    return max(8, group_p2, 1 << (row - 1).bit_length())


def check_head(head_dim: int, group: int, kv_dtype: str) -> None:
    """Raise PycalmError unless the kernel takes these sizes: a row of whole int32 words (head_dim
    even with fp16 KV, a multiple of 4 with fp8) and at most 32 query heads a kv head."""
    if (head_dim * (1 if kv_dtype == "fp8" else 2)) % 4 or not 0 < group <= 32:
        raise PycalmError(
            f"head_dim {head_dim} with {group} query heads a kv head ({kv_dtype} KV): attention takes rows"
            " of whole 4-byte words and at most 32 query heads a kv head"
        )


def attention_chunk_len(head_dim: int, kv_dtype: str) -> int:
    """The shortest split (the default chunk of attention_scratch): CHUNK positions."""
    check_head(head_dim, 1, kv_dtype)
    return CHUNK


def split_len(span: int, chunk: int, n_kv_heads: int, target: int = 0) -> int:
    """Positions a block takes in a launch over `span` positions: chunk times the smallest power
    of two that keeps the grid (n_kv_heads x splits) within `target` blocks (0: TARGET_BLOCKS,
    read at the call), or the whole span."""
    target = target or TARGET_BLOCKS
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

    part: (rows * n_heads, max splits, padded head_dim + 2) float32, per row, head and split the
      unnormalised sum of p*V, then the split's score max and its sum of exp(score - max);
      padded to 128-byte lines. Written before it is read: no initial contents needed.
    count: (rows * n_kv_heads,) int32, splits of the (row, kv head) finished in the launch; zero
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
    rows: int = 1,
    paged: bool = False,
    stream: object = 0,
) -> AttentionScratch:
    """Allocate the scratch for contexts of up to seq_len positions and launches of up to `rows`
    query rows (see AttentionScratch); paged: for the paged launches (their splits shrink with
    the rows). chunk: the shortest split, a power of two (default attention_chunk_len); the tests
    take short ones to cover the merge at short contexts."""
    chunk = attention_chunk_len(head_dim, kv_dtype) if chunk is None else chunk
    part = cuda.device_array(
        part_shape(n_heads, n_kv_heads, head_dim, seq_len, chunk, rows, paged), np.float32, stream=stream
    )
    count = cuda.to_device(np.zeros(rows * n_kv_heads, np.int32), stream=stream)
    return AttentionScratch(part, count, chunk)


def part_shape(
    n_heads: int, n_kv_heads: int, head_dim: int, seq_len: int, chunk: int, rows: int, paged: bool = False
) -> tuple:
    """The shape of AttentionScratch.part (4 bytes an element) for these sizes. Paged launches of
    r rows take a view (r * n_heads, their splits, padded) of it, flat."""
    if chunk < 1 or chunk & (chunk - 1):
        raise PycalmError(f"attention chunk {chunk} is not a power of two")
    padded = -(-(head_dim + 2) // _LINE) * _LINE
    if paged:  # the most (row, split) slots any launch of 1..rows rows takes
        slots = max(
            r * -(-span // split_len(span, chunk, n_kv_heads * r))
            for r in range(1, rows + 1)
            for span in _spans(chunk, seq_len)
        )
        return slots * n_heads, 1, padded
    n_splits = max(-(-span // split_len(span, chunk, n_kv_heads)) for span in _spans(chunk, seq_len))
    return rows * n_heads, n_splits, padded


def _spans(chunk: int, seq_len: int) -> list[int]:
    """Every span a launch may cover: the splits of a span of s positions are as many as those
    of the power of two at or above s (split_len), so these bound them all."""
    spans, span = [], chunk
    while span < seq_len:
        spans.append(span)
        span *= 2
    return [*spans, span]


@cuda.jit(device=True, inline=True)
def pool_row(table, seq, t, page_log2):  # noqa: ANN001, ANN201
    """The pool row of sequence seq's position t in a paged cache: its page table[seq, t >>
    page_log2], the row t mod the page size within it (the module docstring's last part)."""
    return (table[seq, t >> page_log2] << page_log2) | (t & ((1 << page_log2) - 1))


@cuda.jit(device=True, inline=True)
def _exp(x):  # noqa: ANN001, ANN202
    """exp(x) as ex2.approx(x log2 e): two instructions instead of the accurate expf's ~10
    (relative error ~1e-7 for the |x| < 20 that carry weight in a softmax; 0 for -1e30)."""
    return libdevice.fast_expf(x)


@cuda.jit(device=True, inline=True)
def _decode(x, e, fp8):  # noqa: ANN001, ANN202
    """Element e (a constant after unrolling) of an int32 word of the cache, 2 fp16 or 4 e5m2
    from the lowest address up, as its exact float32: cvt.f32.f16 of a half; an e5m2 byte is
    the top byte of an fp16, so a byte permute first puts bytes 0, 1 (or 2, 3) there. The
    elements of a word share the permute and the cvt pair (one instruction an fp16, 1.5 an
    e5m2)."""
    if fp8:
        lo, hi = h2f2(prmt(x, int32(0), int32(0x1404 if e < 2 else 0x3424)))
    else:
        lo, hi = h2f2(x)
    return lo if e % 2 == 0 else hi


@functools.cache
def attention_kernel(
    head_dim: int,
    group: int,
    kv_dtype: str,
    threads: int = THREADS,
    tile: int = TILE,
    stages: int = STAGES,
    max_splits: int = TARGET_BLOCKS,
    out_fp16: bool = False,
    paged: bool = False,
    merge_loads: int = MERGE_LOADS,
) -> object:
    """The kernel specialised for a head_dim, group size (query heads a kv head), KV dtype, block,
    warp tile and stages, so the per-lane query slices, partial dots and accumulators are
    fixed-size local arrays that the compiler keeps in registers (all loops over them unroll).
    paged: rows of many sequences over a paged pool (the module docstring's last part);
    merge_loads: the merge's splits a round, 4 or 8 (scripts/kernels/attention.py times 8)."""
    check_head(head_dim, group, kv_dtype)
    if merge_loads not in (4, 8):
        raise PycalmError(f"the merge loads 4 or 8 splits a round, not {merge_loads}")
    PAGED = paged
    IS_FP8 = kv_dtype == "fp8"
    EPW = 4 if IS_FP8 else 2  # cache elements an int32 word holds
    ROW_G = _row_words(head_dim, kv_dtype)  # int32 words of a head's row in the cache
    ROW = _shared_row(head_dim, group, kv_dtype, tile)  # and in shared memory
    ASYNC = ROW == ROW_G  # cp.async copies (else word by word, into rows padded with zeros)
    T = _team(ROW)  # lanes a row: lane i of a team takes words i, i + T, ...
    LW = ROW // T  # words of a row a lane takes
    LE = LW * EPW  # elements of a row a lane takes
    GLE = group * LE  # query and accumulator elements a lane holds
    PPW = 32 // T  # rows a warp takes at a time (a team each)
    LOG_PPW = PPW.bit_length() - 1
    N_WARPS = threads // 32
    WT = tile  # positions a warp tile
    SUBS = WT // PPW  # rows a team takes in a warp tile
    GP = 1 << (group - 1).bit_length()  # the group padded to a power of two
    NV = SUBS * GP  # partial dots a lane holds for a warp tile: (row, head) pairs
    NB = min(NV, T)  # values a butterfly sums over the team
    LOG_NB = NB.bit_length() - 1
    LOG_T = T.bit_length() - 1
    LOG_ROWS = (T // (GP * (T // NB))).bit_length() - 1  # lane bits that pick a row in a butterfly's output
    N_BATCH = NV // NB
    SPREAD = T // NB  # lanes that end with the same sum
    PIECES = ROW // 4 if ASYNC else ROW_G  # copies a row: 16-byte cp.async, or words
    COPIES = 2 * WT * PIECES  # copies a warp tile (K rows, then V rows)
    K_COPIES = WT * PIECES  # the K rows' copies
    COPY_STEPS = -(-COPIES // 32)
    STAGE = 2 * WT * ROW  # int32 words a stage: the warp tile's K rows, then its V rows
    WARP_WORDS = stages * STAGE  # a warp's ring of stages
    MAX_SPLITS = max_splits  # split_len keeps the live splits of a kv head within this
    # shared words: the warps' rings while streaming; then their accumulators; then the merge's weights
    SMEM = max(N_WARPS * WARP_WORDS, N_WARPS * group * head_dim, group * MAX_SPLITS)
    OUTS = group * head_dim  # a block's outputs: its heads' rows
    OPT = -(-OUTS // threads)  # outputs a thread
    Q_SCALE = 1.0 / math.sqrt(head_dim)
    OUT16 = out_fp16
    wait_landed = cp_async_wait(stages - 1)  # all but the stages - 1 newest groups have landed

    @cuda.jit(device=True, inline=True)
    def cache_row(t, table, seq, page_log2):  # noqa: ANN001, ANN202
        """The cache row of position t: t itself, or paged, its pool row in sequence seq's pages."""
        if PAGED:
            return uint32(pool_row(table, seq, t, page_log2))
        return uint32(t)

    @cuda.jit(device=True, inline=True)
    def issue_async(smem, k_cache, v_cache, base, t0, last, col0, lane, table, seq, page_log2):  # noqa: ANN001, ANN202
        """Start a warp's copies of the rows t0 .. t0 + WT - 1 (rows past `last` read row last:
        finite, and their p is 0) into the stage at word `base`; the caches are fp16 views."""
        for c in range(COPY_STEPS):
            i = int32(lane + 32 * c)
            if COPIES % 32 == 0 or i < COPIES:
                r = int32((i // PIECES) % WT)
                piece = i % PIECES
                row = cache_row(min(int32(t0 + r), last), table, seq, page_log2)
                word = base + r * ROW + piece * 4
                # K rows or V rows: known per step once the loop unrolls, but where a step holds both
                if (c + 1) * 32 <= K_COPIES or (c * 32 < K_COPIES and i < K_COPIES):
                    cp_async16(smem, word, k_cache, row, col0 + piece * 8, 16)
                else:
                    cp_async16(smem, word + WT * ROW, v_cache, row, col0 + piece * 8, 16)

    @cuda.jit(device=True, inline=True)
    def issue_words(smem, k_cache, v_cache, base, t0, last, col0, lane, table, seq, page_log2):  # noqa: ANN001, ANN202
        """issue_async for rows that are no whole number of 16-byte pieces: the same rows word by
        word (int32 views of the caches), at once; the padding words stay zero."""
        for c in range(COPY_STEPS):
            i = lane + c * 32
            if i < COPIES:
                r = (i // PIECES) % WT
                w = i % PIECES
                row = cache_row(min(t0 + r, last), table, seq, page_log2)
                if i < WT * PIECES:
                    smem[base + r * ROW + w] = k_cache[row, col0 + w]
                else:
                    smem[base + WT * ROW + r * ROW + w] = v_cache[row, col0 + w]

    issue = issue_async if ASYNC else issue_words

    @cuda.jit(device=True, inline=True)
    def store(out, row, i, x):  # noqa: ANN001, ANN202
        """out[row, i] = x: float32, or fp16 for the rows pass's wo input."""
        if OUT16:
            out[row, i] = fp16_encode(x)
        else:
            out[row, i] = x

    # four blocks an SM where a lane's slices fit 16 floats; three for larger groups, and paged
    # (the block table's lookups in the copy loop spilled at four: 36 bytes at head_dim 128, fp16)
    @cuda.jit(device=True, inline=True)
    def split_terms(part, smem, head, w0, s0, live, d):  # noqa: ANN001, ANN202
        """sum over splits s0 .. s0 + 3 of weight_s part[head, s, d] (the weights at smem[w0 +
        s]; splits past `live` count zero and read split live - 1): four loads written out, so
        that all are in flight at once (a loop over them, which the compiler keeps rolled,
        waits on L2 once a split)."""
        h, e, end = uint32(head), uint32(d), uint32(live - 1)  # (unsigned: no wraparound test)
        s_, s1 = min(uint32(s0), end), min(uint32(s0 + 1), end)
        s2, s3 = min(uint32(s0 + 2), end), min(uint32(s0 + 3), end)
        x0, x1, x2, x3 = part[h, s_, e], part[h, s1, e], part[h, s2, e], part[h, s3, e]
        zero = float32(0.0)
        total = as_f32(smem[w0 + s_]) * x0 if s0 < live else zero
        total += as_f32(smem[w0 + s1]) * x1 if s0 + 1 < live else zero
        total += as_f32(smem[w0 + s2]) * x2 if s0 + 2 < live else zero
        total += as_f32(smem[w0 + s3]) * x3 if s0 + 3 < live else zero
        return total

    bounds = {} if SIM else {"launch_bounds": (threads, 4 if GLE <= 16 and not PAGED else 3)}

    @cuda.jit(fastmath=False, cache=True, **bounds)
    def attention_kernel(
        q, k_cache, v_cache, state, part, count, out, window, split, positions, seq_of_row, table, page_log2
    ):  # noqa: ANN001, ANN202, E501
        grid_dependency_wait()  # in a programmatic graph: q and the cache row come from earlier kernels
        # q (rows, n_heads * head_dim) f32; caches (seq_len, kv_dim * bytes / 2) viewed as fp16
        # (int32 for padded rows); part (>= rows * n_heads, max splits, >= head_dim + 2) f32; count
        # (>= rows * n_kv_heads,) i32; out (rows, n_heads * head_dim) f32 (fp16 with out_fp16);
        # split: positions a block. Paged: positions, seq_of_row (rows,) i32, table (n_seqs,
        # max_pages) i32, page_log2 (else unread)
        rows = q.shape[0]
        kv_head = cuda.blockIdx.x // rows
        row = cuda.blockIdx.x % rows  # the query row: position state[STATE_POS] + row
        split_id = cuda.blockIdx.y
        n_kv = cuda.gridDim.x // rows
        head0 = row * n_kv * group + kv_head * group  # the group's first head among the rows' (part)
        ck = row * n_kv + kv_head  # the (row, kv head)'s counter
        seq = int32(0)  # paged: the row's sequence
        if PAGED:
            seq = seq_of_row[row]
            n_pos = int32(positions[row] + 1) if seq >= 0 else int32(0)  # padding: no position
            if seq < 0 and split_id == 0:  # padding rows come out zero
                for i in range(cuda.threadIdx.x, group * head_dim, cuda.blockDim.x):
                    store(out, row, kv_head * group * head_dim + i, float32(0.0))
        else:
            n_pos = int32(state[STATE_POS] + 1 + row)
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
        lane = int32(tid % 32)
        lt = lane % T  # lane in its team
        team = lane // T  # the team's row among the warp's PPW at a time
        n_tiles = int32((n_here + WT - 1) // WT)  # warp tiles of the split
        n_mine = int32((n_tiles - warp + N_WARPS - 1) // N_WARPS)  # this warp's: warp, warp + N_WARPS, ...
        col0 = kv_head * (2 * ROW_G if ASYNC else ROW_G)  # the kv head's first column of the view
        ring = warp * WARP_WORDS  # this warp's ring of stages
        # (N_WARPS, stages, WT K rows then WT V rows, ROW) int32 rings; after the stream
        # (N_WARPS, group, head_dim) float32 bits, the warps' accumulators; in the merge (group,
        # MAX_SPLITS) float32 bits, the splits' weights
        smem = cuda.shared.array(SMEM, int32)
        pr = cuda.shared.array((N_WARPS, WT, group), float32)  # the warp tile's p, a row's heads together
        ar = cuda.shared.array((N_WARPS, group), float32)  # the warp tile's rescale of each head
        wm = cuda.shared.array((N_WARPS, group), float32)  # each warp's score max
        wl = cuda.shared.array((N_WARPS, group), float32)  # each warp's sum of exp(score - max)
        is_last = cuda.shared.array(1, int32)  # merge: 1 in the last block of the kv head

        if not ASYNC:  # padded rows: the words past each row stay zero
            for i in range(lane, WARP_WORDS, 32):
                smem[ring + i] = int32(0)
            cuda.syncwarp()  # the ring is zero before the copies land in it
        for i in range(stages - 1):  # the first warp tiles in flight, a group each
            if i < n_mine:
                issue(
                    smem,
                    k_cache,
                    v_cache,
                    ring + i * STAGE,
                    first + (warp + i * N_WARPS) * WT,
                    last,
                    col0,
                    lane,
                    table,
                    seq,
                    page_log2,
                )
            cp_async_commit()
        qr = cuda.local.array(GLE, float32)  # the lane's slice of each head's q, scaled
        acc = cuda.local.array(GLE, float32)  # the lane's slice of each head's sum of p v
        # after a butterfly the lane holds the scores of one head, `mine`, of rows `pair` // GP
        # (+ NB / GP per batch); `writer`: the first of the SPREAD lanes that hold the same ones
        pair = lt // SPREAD
        mine = pair % GP
        writer = lt % SPREAD == 0
        m = float32(NEG)  # the running max of head mine over the warp's rows so far
        ls = float32(0.0)  # this lane's part of head mine's sum of exp(score - m)
        for g in range(group):
            for j in range(LW):
                for e in range(EPW):
                    d = (lt + T * j) * EPW + e
                    x = q[row, (kv_head * group + g) * head_dim + min(d, head_dim - 1)] * float32(Q_SCALE)
                    qr[g * LE + j * EPW + e] = x if d < head_dim else float32(0.0)  # (padding: 0)
                    acc[g * LE + j * EPW + e] = float32(0.0)
        vals = cuda.local.array(NV, float32)  # partial dots, (row, padded head) pairs
        pg = cuda.local.array(group, float32)  # p of a row, each head

        for i in range(n_mine):
            ahead = i + stages - 1  # the warp tile that enters the ring now
            if ahead < n_mine:
                t_ahead = int32(first + (warp + ahead * N_WARPS) * WT)
                issue(smem, k_cache, v_cache, ring + (ahead & (stages - 1)) * STAGE, t_ahead, last, col0, lane,
                      table, seq, page_log2)  # fmt: skip
            cp_async_commit()  # (an empty group near the end)
            wait_landed()  # this lane's copies of warp tile i have landed ...
            cuda.syncwarp()  # ... and every lane's
            # the lane's first word of the stage, unsigned: its words below take no wraparound test
            # and their offsets fold into the loads (stages: a power of two)
            mine_w = uint32(ring + (i & (stages - 1)) * STAGE + team * ROW + lt)
            t0 = first + (warp + i * N_WARPS) * WT  # the warp tile's first position

            # 2. partial dots of the warp tile's rows with every head's q slice
            for x in range(NV):
                vals[x] = float32(0.0)
            for u in range(SUBS):
                for j in range(LW):
                    w = smem[mine_w + u * PPW * ROW + T * j]
                    for e in range(EPW):
                        x = _decode(w, e, IS_FP8)
                        for g in range(group):
                            vals[u * GP + g] += qr[g * LE + j * EPW + e] * x
            for b in range(N_BATCH):  # transposing butterflies over the team, NB values each
                for k in range(LOG_NB):
                    half = NB >> (k + 1)
                    off = T >> (k + 1)
                    up = (lt & off) != 0  # this lane keeps the upper half
                    for x in range(NB // 2):
                        if x < half:
                            lo = vals[b * NB + x]
                            hi = vals[b * NB + x + half]
                            keep = hi if up else lo
                            send = lo if up else hi
                            vals[b * NB + x] = keep + cuda.shfl_xor_sync(FULL_MASK, send, off)
                for k in range(LOG_NB, LOG_T):  # the lanes left hold parts of one sum
                    vals[b * NB] += cuda.shfl_xor_sync(FULL_MASK, vals[b * NB], T >> (k + 1))
                # the lane now holds the score of (row (b NB + pair) // GP of its team, head mine)
                r = ((b * NB + pair) // GP) * PPW + team
                if not (mine < group and t0 + r <= last):
                    vals[b * NB] = float32(NEG)  # a padding head or a row past the end

            # 3. online softmax: the tile's max of the lane's head over the lanes of the same head
            tmax = float32(NEG)
            for b in range(N_BATCH):
                tmax = max(tmax, vals[b * NB])
            for k in range(LOG_ROWS):
                tmax = max(tmax, cuda.shfl_xor_sync(FULL_MASK, tmax, (GP * SPREAD) << k))
            for k in range(LOG_PPW):
                tmax = max(tmax, cuda.shfl_xor_sync(FULL_MASK, tmax, T << k))
            m_new = max(m, tmax)
            alpha = _exp(m - m_new)
            total = ls * alpha
            for b in range(N_BATCH):
                v = vals[b * NB]
                pb = _exp(v - m_new) if v > float32(NEG) else float32(0.0)
                total += pb
                r = ((b * NB + pair) // GP) * PPW + team
                if writer and mine < group:
                    pr[warp, r, mine] = pb
            ls = total
            m = m_new
            if writer and pair == mine and team == 0 and mine < group:
                ar[warp, mine] = alpha
            cuda.syncwarp()  # the tile's p and each head's alpha are in pr and ar

            # 4. the accumulators rescaled, then p v over the team's rows
            for g in range(group):
                a = ar[warp, g]
                for x in range(LE):
                    acc[g * LE + x] *= a
            for u in range(SUBS):
                r = u * PPW + team
                for g in range(group):
                    pg[g] = pr[warp, r, g]
                for j in range(LW):
                    w = smem[mine_w + WT * ROW + u * PPW * ROW + T * j]
                    for e in range(EPW):
                        x = _decode(w, e, IS_FP8)
                        for g in range(group):
                            acc[g * LE + j * EPW + e] += pg[g] * x
            cuda.syncwarp()  # every lane is done with this stage, pr and ar before they are refilled

        # 5. the next kernel may launch now, not before: its blocks (wo's, which start loading
        # weights at once) would take the SMs' slots and bandwidth from this kernel's stream
        launch_dependents()
        # the teams of a warp added (they share m and l); the warps' (m, l, acc) to shared memory
        for k in range(LOG_PPW):
            for x in range(GLE):
                acc[x] += cuda.shfl_xor_sync(FULL_MASK, acc[x], T << k)
        cuda.syncthreads()  # every warp is done with its ring: the accumulators go over the rings
        if team == 0:
            for g in range(group):
                for j in range(LW):
                    for e in range(EPW):
                        d = (lt + T * j) * EPW + e
                        if d < head_dim:
                            smem[(warp * group + g) * head_dim + d] = as_i32(acc[g * LE + j * EPW + e])
        for k in range(LOG_ROWS):  # the head's sum over the lanes that held its rows
            ls += cuda.shfl_xor_sync(FULL_MASK, ls, (GP * SPREAD) << k)
        for k in range(LOG_PPW):
            ls += cuda.shfl_xor_sync(FULL_MASK, ls, T << k)
        if writer and pair == mine and team == 0 and mine < group:
            wm[warp, mine] = m
            wl[warp, mine] = ls
        cuda.syncthreads()  # every warp's (m, l, acc) is in shared memory
        for o in range(OPT):
            i = tid + o * threads
            if i < OUTS:
                g = i // head_dim
                d = i % head_dim
                bm = float32(NEG)
                for w in range(N_WARPS):
                    bm = max(bm, wm[w, g])
                a = float32(0.0)
                den = float32(0.0)
                for w in range(N_WARPS):
                    f = _exp(wm[w, g] - bm)
                    a += f * as_f32(smem[(w * group + g) * head_dim + d])
                    den += f * wl[w, g]
                head = kv_head * group + g
                if live == 1:
                    store(out, row, head * head_dim + d, a / den)
                else:
                    part[head0 + g, split_id, d] = a
                    if d == 0:
                        part[head0 + g, split_id, head_dim] = bm
                        part[head0 + g, split_id, head_dim + 1] = den
        if live == 1:
            return
        # the split's partial published, the other splits' acquired (its barriers also end every
        # read of the accumulators in smem)
        if not last_to_arrive(count, ck, live, is_last, 0):
            return

        # the merge: each split's weight exp(m_s - M) / sum_s exp(m_s - M) l_s, a warp a head
        for g in range(warp, group, N_WARPS):
            head = head0 + g
            hm = float32(NEG)
            for s in range(lane, live, 32):
                hm = max(hm, part[head, s, head_dim])
            hm = warp_reduce_max(hm)
            den = float32(0.0)
            for s in range(lane, live, 32):
                den += _exp(part[head, s, head_dim] - hm) * part[head, s, head_dim + 1]
            den = warp_reduce_sum(den)
            for s in range(lane, live, 32):
                smem[g * MAX_SPLITS + s] = as_i32(_exp(part[head, s, head_dim] - hm) / den)
        cuda.syncthreads()  # every split's weight is in smem
        outs = cuda.local.array(OPT, float32)
        for o in range(OPT):
            outs[o] = float32(0.0)
        for s0 in range(0, live, merge_loads):  # a round: merge_loads splits of every output
            for o in range(OPT):
                i = min(tid + o * threads, OUTS - 1)
                g = i // head_dim
                outs[o] += split_terms(part, smem, head0 + g, g * MAX_SPLITS, s0, live, i % head_dim)
                if merge_loads == 8:
                    outs[o] += split_terms(part, smem, head0 + g, g * MAX_SPLITS, s0 + 4, live, i % head_dim)
        for o in range(OPT):
            i = tid + o * threads
            if i < OUTS:
                store(out, row, (kv_head * group) * head_dim + i, outs[o])
        if tid == 0:
            count[ck] = 0  # for the next launch (the next layer)

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
    pages: object = None,
    split: int | None = None,
) -> None:
    """out = attention of q over the positions [start, pos] of one layer's cache (see the module
    docstring): q (n_heads * head_dim,) f32 at pos = state[STATE_POS] (the token step), out the
    same shape, f32; or q (rows, n_heads * head_dim) f32, row r at pos = state[STATE_POS] + r,
    causal (a few consecutive positions of one sequence, whose K and V rows are cached), out
    (rows, n_heads * head_dim) f32 or fp16.

    cfg: n_heads, n_kv_heads, head_dim and sliding_window are read from it. scratch: from
    attention_scratch(n_heads, n_kv_heads, head_dim, cache.dtype, >= seq_len, rows >= rows).
    span: the grid covers positions 0..span-1 (split_len(span) positions a block; default the
    whole cache): the launch is right only while the last row's position is below span. A graph
    captured at seq_len 32768 would otherwise launch splits of 512 positions where a short
    context wants 32 (attention_span: the spans an engine captures). split: the positions a
    block takes (default split_len(span)); a split fixed for the cache (split_len(seq_len): the
    batch-invariant passes) gives a row the same bits at every span, the grid covering the
    span's splits of it.

    pages (pycalm.kernels.rows.Pages): the rows of many sequences over a paged pool (the cache):
    row r at position pages.positions[r] of sequence pages.seq_of_row[r] (< 0: padding, out
    zero), its keys in the pool rows its row of pages.table names; the span covers every row's
    position; the scratch from attention_scratch(..., paged=True).
    """
    n_heads, n_kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if cache.dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {cache.dtype!r} (one of {', '.join(KV_DTYPES)})")
    group = n_heads // n_kv_heads
    check_head(head_dim, group, cache.dtype)
    seq_len = cache.k.shape[0]
    span = seq_len if span is None else span
    if not 0 < span <= seq_len:
        raise PycalmError(f"attention span {span} is outside the cache's 1..{seq_len} positions")
    if q.ndim == 1:  # the token step: one row
        q, out = q.reshape(1, q.shape[0]), out.reshape(1, out.shape[0])
    rows = q.shape[0]
    if split is None:  # paged: the rows' blocks fill the GPU, so each row takes fewer, longer splits
        split = split_len(span, scratch.chunk, n_kv_heads * (1 if pages is None else rows))
    n_splits = -(-span // split)
    part = scratch.part
    if pages is not None and part.size >= rows * n_heads * n_splits * part.shape[2]:
        # (rows * n_heads, n_splits, padded): a view of the flat scratch
        flat = part.reshape(part.size)[: rows * n_heads * n_splits * part.shape[2]]
        part = flat.reshape(rows * n_heads, n_splits, part.shape[2])
    if (
        part.shape[0] < rows * n_heads
        or part.shape[1] < n_splits
        or part.shape[2] < head_dim + 2
        or scratch.count.shape[0] < rows * n_kv_heads
    ):
        raise PycalmError(
            f"attention scratch {part.shape} does not fit {rows} rows of {n_heads} heads over {seq_len} positions"
        )
    paged = pages is not None
    if paged:
        size = pages.page_size
        if size < 1 or size & (size - 1) or size > seq_len:
            raise PycalmError(f"page size {size} is not a power of two up to the pool's {seq_len} rows")
        if pages.positions.shape != (rows,) or pages.seq_of_row.shape != (rows,):
            raise PycalmError(f"pages: positions and seq_of_row must be ({rows},), one a query row")
    kernel = attention_kernel(
        head_dim, group, cache.dtype, out_fp16=bool(out.dtype == np.float16), paged=paged
    )
    view = (
        np.float16
        if _shared_row(head_dim, group, cache.dtype) == _row_words(head_dim, cache.dtype)
        else np.int32
    )
    k16, v16 = cache.k.view(view), cache.v.view(view)
    window = int32(cfg.sliding_window)
    # unpaged, the pages' arguments are unread: state and the count stand in for them
    positions, seq_of_row, table, page_log2 = (
        (pages.positions, pages.seq_of_row, pages.table, pages.page_log2) if paged
        else (state, state, scratch.count.reshape(1, scratch.count.shape[0]), 0)
    )  # fmt: skip
    kernel[(n_kv_heads * rows, n_splits), THREADS, stream](
        q, k16, v16, state, part, scratch.count, out, window, int32(split),
        positions, seq_of_row, table, int32(page_log2),
    )  # fmt: skip


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
