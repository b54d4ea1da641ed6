"""Sampling without top-k or min-p over many blocks a row: the walk of pycalm.kernels.sample
spread over the GPU instead of one SM.

A row at temperature T > 0 with no top-k or min-p cut (an OpenAI request's defaults, or the
CLI's -t 0.7 -p 0.9) takes the token sample_ref picks for coin c: over the logits x in walk order
(descending, lower id first), with p = exp((x - M) / T) and M the largest logit, top-p keeps
the shortest prefix whose mass reaches top_p * sum(p) (all of them at top_p = 1), and the pick
is the first kept token whose running mass exceeds Z = c * the kept mass. pycalm.kernels.sample answers it with one block a row: 3-4 passes of ~250
logits a thread, each logit a key, an expf and a shared-memory float atomic (a compare-and-swap
loop, which the lanes of a warp that share a bin take in turn), 0.38 ms over 128,256 logits on
the H200. Here each row's logits are cut into G chunks (id ranges in block order; G =
wide_blocks(n): a block per 4,096 logits, 16 a thread, at most WIDE_BLOCKS: 32 over 128,256), a
block a chunk, and the walk is six launches of grid (G, M), eleven with top-p:

  1. stats: block b's max m_b and mass z_b = sum exp((x - m_b) / T) of its chunk; the last block
     of the row to finish (common.last_to_arrive) adds them in block order, M = max_b m_b,
     sum(p) = sum_b z_b exp((m_b - M) / T), and sets the first stage: its target (top_p * sum(p)
     with top-p, else Z) and an empty key prefix.
  2-5. pass (the key's bits 24..31, then 16..23, 8..15, 0..7): each block histograms its chunk's
     logits whose key (sample._ukey: unsigned order is float order) has the prefix found so far,
     count and mass a digit, into its row of hist_n / hist_m; the last block adds the blocks'
     rows in block order (the same float32 sums whichever block finishes last), and its warp 0
     finds the first bin from the highest digit down where the mass before it (fst[r, 2],
     carried over the passes) plus its own exceeds Z (sample._scan_bins, the one-block walk's
     scan); after four passes the prefix is the crossing logit's key.
  6. pick: the crossing among the logits of that key (equal logits, walked in id order) is the
     j-th, j = floor((Z - mass before) / p), clamped to their count; each block counts its
     chunk's, the last finds the chunk that holds the j-th and searches it a block-wide round at
     a time (warp prefix sums of the hits) -> tokens[r].
  With top-p, launches 2-6 first find the cut (STAGE_CUT): the same passes for the first token
  whose running mass reaches top_p * sum(p), and a pick that keeps its key and id, j = ceil((top_p
  sum(p) - mass before) / p) - 1, and sets the walk's target, Z = c * (the mass through it); then
  the walk's launches (STAGE_WALK). A pick past the cut in walk order (the walk's float sums rounding
  beyond the kept mass) takes the cut's token, the last kept one, as the spec clamps.

Every launch is short: a block's chunk is 16 logits a thread, and a pass's last block adds G x
256 x 8 bytes (64 KB at G = 32) with LOADS loads in flight a thread. Float rounding
is the single-block walk's: the sums are float32 (in block order here), so a coin within ~1e-6
of the mass of a boundary between two tokens may pick the neighbour; equal logits and the end of
the walk (Z rounded up to the total: the last non-empty bin) follow the spec exactly.

Measured (H100, 2026-12-07, scripts/kernels/sample.py): a row of 128,256 logits in 84-98 us (32
blocks; 84 at 64, 93 at 128, 128 at 16, 204 at 8) against the one-block walk's 336-376, with
top-p 0.9 176-179 us against 330; sample_rows over 8 rows 116 us against 378, over 64 rows 428
against 381 (WIDE_ROWS).

Rows that are greedy, or with a top-k or min-p cut, are left to the single-block kernels: the
first launch marks them (ist[r, 3] = 0) and every later launch's blocks of such a row return at
once, and sample_rows_kernel, told `wide`, returns for the rows taken here. The
options come from device memory (sample.RowSampling), so one captured graph serves any mix.

Bytes moved: a row's logits (vocab_size * 4) read 6 times, 11 with top-p (from L2 after the
first), plus G * 256 * 8 bytes of histograms written and read per pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, uint32

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    STATE_POS,
    STATE_TOKEN,
    block_reduce_max,
    block_reduce_sum,
    dependent_start,
    last_to_arrive,
    warp_reduce_sum,
)
from pycalm.kernels.sample import (
    MODE_MASS_GE,
    MODE_MASS_GT,
    _key_value,
    _scan_bins,
    _ukey,
    _warp_prefix,
    is_wide,
    tie_index,
)

# blocks a row: one per WIDE_LOGITS logits (16 a thread), at most WIDE_BLOCKS; threads a block
# (fewer under the simulator, a Python thread a GPU thread)
WIDE_BLOCKS, WIDE_LOGITS, WIDE_THREADS = (3, 128, 32) if _numba_config.ENABLE_CUDASIM else (128, 4096, 256)
# the most rows a scratch takes where sample_rows has a choice: on an H100 (2026-12-07) the walk
# over 128,256 logits takes 98 / 116 / 150 / 259 us at 1 / 8 / 16 / 32 rows against one block a
# row's 341 / 378 / 346 / 374, and 428 against 381 at 64 rows, where the rows' blocks fill the SMs
WIDE_ROWS = 32
BINS = 256
PARTS = 2 * WIDE_BLOCKS  # (max, mass) a block
LOADS = 16  # the last block's histogram loads in flight a thread
SHIFTS = (24, 16, 8, 0)  # the key's digits, highest first
STAGE_CUT, STAGE_WALK = 1, 2  # the top-p cut's launches, then the coin walk's


class WideScratch(NamedTuple):
    """The walk's device arrays for up to `rows` rows (M). count and ties_n start at zero, and
    the last block of a launch leaves them at zero for the next."""

    part: object  # (M, 2 WIDE_BLOCKS) float32: block b's (max, mass) at 2 b, 2 b + 1
    # (M, 8) float32: the largest logit M, the stage's target, the mass before the prefix, 1 / T,
    # the coin
    fst: object
    # (M, 8) int32: the key prefix, its mask, the logits with the crossing key, the row's first stage
    # (0: not taken here), the cut's key and id, whether there is a cut
    ist: object
    hist_n: object  # (M, WIDE_BLOCKS * BINS) int32: each block's counts a digit
    hist_m: object  # (M, WIDE_BLOCKS * BINS) float32: each block's masses a digit
    ties_n: object  # (M, WIDE_BLOCKS) int32: each block's logits with the crossing key
    count: object  # (M,) int32: the blocks of the row that have arrived (last_to_arrive)

    @classmethod
    def allocate(cls, rows: int) -> WideScratch:
        g = WIDE_BLOCKS
        return cls(
            cuda.device_array((rows, 2 * g), np.float32),
            cuda.device_array((rows, 8), np.float32),
            cuda.device_array((rows, 8), np.int32),
            cuda.device_array((rows, g * BINS), np.int32),
            cuda.device_array((rows, g * BINS), np.float32),
            cuda.to_device(np.zeros((rows, g), np.int32)),
            cuda.to_device(np.zeros(rows, np.int32)),
        )

    @property
    def rows(self) -> int:
        return self.count.shape[0]

    def sample_rows(self, logits: object, params: tuple, coins: object, tokens: object, *, stream: object,
                    blocks: int | None = None) -> None:  # fmt: skip
        """sample_wide_rows with this scratch (what sample.sample_rows launches, given it)."""
        sample_wide_rows(logits, params, coins, tokens, self, stream=stream, blocks=blocks)

    def sample_state(self, logits: object, state: object, coins: object, inv_t: float, top_p: float, *,
                     stream: object, blocks: int | None = None) -> None:  # fmt: skip
        """sample_wide_state with this scratch (what sample.sample launches, given it)."""
        sample_wide_state(logits, state, coins, inv_t, top_p, self, stream=stream, blocks=blocks)


@cuda.jit(device=True, inline=True)
def _chunk(n):  # noqa: ANN001, ANN202
    """This block's part of a row of n logits: (chunk, lo, hi), ids lo .. hi - 1, the chunks of
    ceil(n / blocks) logits being id ranges in block order."""
    chunk = (n + cuda.gridDim.x - 1) // cuda.gridDim.x
    lo = cuda.blockIdx.x * chunk
    return chunk, lo, min(n, lo + chunk)


@cuda.jit(device=True, inline=True)
def _stats(row, r, inv_t, top_p, coin, part, fst, ist, count):  # noqa: ANN001, ANN202
    """Launch 1 for row r (logits `row`, (n,)): see the module docstring."""
    red = cuda.shared.array(32, float32)  # a word a warp (the block reductions)
    flag = cuda.shared.array(1, int32)  # last_to_arrive's answer
    parts = cuda.shared.array(PARTS, float32)  # the last block's copy of part[r]
    chunk, lo, hi = _chunk(row.shape[0])
    m = float32(-math.inf)
    for i in range(lo + cuda.threadIdx.x, hi, cuda.blockDim.x):
        m = max(m, row[i])
    m = block_reduce_max(m, red)
    z = float32(0.0)
    if m > float32(-math.inf):  # (a chunk of -inf alone has no mass)
        for i in range(lo + cuda.threadIdx.x, hi, cuda.blockDim.x):
            z += math.exp((row[i] - m) * inv_t)
    z = block_reduce_sum(z, red)
    if cuda.threadIdx.x == 0:
        part[r, 2 * cuda.blockIdx.x] = m
        part[r, 2 * cuda.blockIdx.x + 1] = z
    if not last_to_arrive(count, r, cuda.gridDim.x, flag, 0):
        return
    for b in range(cuda.threadIdx.x, 2 * cuda.gridDim.x, cuda.blockDim.x):  # loaded at once
        parts[b] = part[r, b]
    cuda.syncthreads()  # every block's part is in shared memory
    if cuda.threadIdx.x == 0:
        big = float32(-math.inf)
        for b in range(cuda.gridDim.x):
            big = max(big, parts[2 * b])
        total = float32(0.0)
        for b in range(cuda.gridDim.x):  # block order: the same sum whichever block is last
            if parts[2 * b + 1] > float32(0.0):
                total += parts[2 * b + 1] * math.exp((parts[2 * b] - big) * inv_t)
        cut = top_p < float32(1.0)
        fst[r, 0] = big
        fst[r, 1] = top_p * total if cut else coin * total  # the first stage's target
        fst[r, 2] = float32(0.0)
        fst[r, 3] = inv_t
        fst[r, 4] = coin
        ist[r, 0] = int32(0)
        ist[r, 1] = int32(0)
        ist[r, 2] = int32(0)
        ist[r, 3] = int32(STAGE_CUT) if cut else int32(STAGE_WALK)
        ist[r, 6] = int32(0)  # no cut yet
        count[r] = int32(0)  # for the next launch


@cuda.jit(cache=True)
def wide_stats_rows(logits, temperature, top_k, top_p, min_p, coins, part, fst, ist, count):  # noqa: ANN001, ANN201
    """Launch 1, grid (G, M): row r = blockIdx.y with RowSampling's options and coin
    coins[r]; a row that is_wide does not take is marked (ist[r, 3] = 0) and left alone."""
    dependent_start()  # in a programmatic graph: wait for the logits
    r = cuda.blockIdx.y
    row = logits[r]  # (vocab_size,)
    t = temperature[r]
    if not is_wide(t, top_k[r], min_p[r], row.shape[0]):  # block-uniform
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            ist[r, 3] = int32(0)
        return
    inv_t = float32(1.0) / t  # (as sample_rows_kernel rounds it)
    _stats(row, r, inv_t, top_p[r], coins[r], part, fst, ist, count)


@cuda.jit(cache=True)
def wide_stats_state(logits, inv_t, top_p, coins, state, part, fst, ist, count):  # noqa: ANN001, ANN201
    """Launch 1, grid (G, 1), for the token step: temperature 1 / inv_t, top_p, the coin
    coins[state[STATE_POS]] (sample.sample's)."""
    dependent_start()  # in a programmatic graph: wait for the logits
    _stats(logits[0], 0, inv_t, top_p, coins[state[STATE_POS]], part, fst, ist, count)


@cuda.jit(device=True, inline=True)
def _live(ist, r, stage):  # noqa: ANN001, ANN202
    """Whether row r takes part in a launch of `stage`: taken here, and from this stage on."""
    first = ist[r, 3]
    return first != int32(0) and first <= stage


@cuda.jit(cache=True)
def wide_pass(logits, shift, stage, fst, ist, hist_n, hist_m, count):  # noqa: ANN001, ANN201
    """Grid (G, M): the key's digit at bits shift .. shift + 7 of a stage's crossing (see the
    module docstring): ist[r] <- (prefix with the digit, mask, the crossing bin's count),
    fst[r, 2] += the mass of the bins before it."""
    dependent_start()  # in a programmatic graph: wait for the last launch's fst / ist
    sn = cuda.shared.array(BINS, int32)  # this block's counts a digit, then the row's
    sm = cuda.shared.array(BINS, float32)  # this block's masses a digit, then the row's
    flag = cuda.shared.array(1, int32)  # last_to_arrive's answer
    cross = cuda.shared.array(4, int32)  # _scan_bins' answer: the bin, the count before it, its count
    cross_mass = cuda.shared.array(2, float32)  # and the mass before it
    r = cuda.blockIdx.y
    if not _live(ist, r, stage):  # block-uniform: the one-block kernel's row, or no top-p cut
        return
    tid = cuda.threadIdx.x
    row = logits[r]  # (vocab_size,)
    for d in range(tid, BINS, cuda.blockDim.x):
        sn[d] = int32(0)
        sm[d] = float32(0.0)
    cuda.syncthreads()  # the histogram is clear before anyone adds to it
    chunk, lo, hi = _chunk(row.shape[0])
    prefix, mask, big, inv_t = ist[r, 0], ist[r, 1], fst[r, 0], fst[r, 3]
    for i in range(lo + tid, hi, cuda.blockDim.x):
        x = row[i]
        k = _ukey(x)
        if (k & mask) == prefix:
            d = (k >> shift) & int32(255)
            cuda.atomic.add(sn, d, int32(1))
            cuda.atomic.add(sm, d, math.exp((x - big) * inv_t))
    cuda.syncthreads()  # the block's histogram is complete
    at = cuda.blockIdx.x * BINS
    for d in range(tid, BINS, cuda.blockDim.x):
        hist_n[r, at + d] = sn[d]
        hist_m[r, at + d] = sm[d]
    if not last_to_arrive(count, r, cuda.gridDim.x, flag, 0):
        return
    bn = cuda.local.array(LOADS, int32)  # a batch of blocks' counts and masses of digit d
    bm = cuda.local.array(LOADS, float32)  # (LOADS,)
    blocks = cuda.gridDim.x
    for d in range(tid, BINS, cuda.blockDim.x):  # the blocks' rows, added in block order
        cn, cm = int32(0), float32(0.0)
        for b0 in range(0, blocks, LOADS):  # LOADS loads in flight, then their sums
            for u in range(LOADS):
                at = min(b0 + u, blocks - 1) * BINS + d
                bn[u], bm[u] = hist_n[r, at], hist_m[r, at]
            for u in range(LOADS):
                if b0 + u < blocks:
                    cn += bn[u]
                    cm += bm[u]
        sn[d] = cn
        sm[d] = cm
    cuda.syncthreads()  # the row's sums are in sn / sm
    if tid < 32:  # warp 0: the first bin from the highest digit down whose mass passes the target
        mode = MODE_MASS_GE if stage == STAGE_CUT else MODE_MASS_GT
        _scan_bins(sn, sm, mode, int32(0), fst[r, 1], int32(0), fst[r, 2], False, cross, cross_mass)
    cuda.syncthreads()  # cross holds the bin, its count; cross_mass the mass before it
    if tid == 0:
        fst[r, 2] += cross_mass[0]
        ist[r, 0] = int32(prefix | (cross[0] << shift))
        ist[r, 1] = int32(mask | (int32(255) << shift))
        ist[r, 2] = cross[2]
        count[r] = int32(0)  # for the next launch


@cuda.jit(cache=True)
def wide_pick(logits, stage, fst, ist, tokens, ties_n, count):  # noqa: ANN001, ANN201
    """Grid (G, M): the j-th (by id) of the logits with a stage's crossing key (see the module
    docstring): the cut (ist[r, 4:7] <- its key and id, and the walk's target set), or the walk's
    pick -> tokens[r], the cut's token where float rounding walked past it."""
    dependent_start()  # in a programmatic graph: wait for the last pass's fst / ist
    flag = cuda.shared.array(1, int32)  # last_to_arrive's answer
    counts = cuda.shared.array(WIDE_BLOCKS, int32)  # the last block's copy of ties_n[r]
    wc = cuda.shared.array(32, int32)  # a round's hits a warp
    at = cuda.shared.array(3, int32)  # the block of the j-th, then j, then the warp that holds it
    r = cuda.blockIdx.y
    if not _live(ist, r, stage):  # block-uniform: the one-block kernel's row, or no top-p cut
        return
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    row = logits[r]  # (vocab_size,)
    n = row.shape[0]
    chunk, lo, hi = _chunk(n)
    key = ist[r, 0]
    c = int32(0)
    for i in range(lo + tid, hi, cuda.blockDim.x):
        if _ukey(row[i]) == key:
            c += int32(1)
    c = warp_reduce_sum(c)
    if lane == 0:
        cuda.atomic.add(ties_n, (r, cuda.blockIdx.x), c)  # (integers: any order)
    if not last_to_arrive(count, r, cuda.gridDim.x, flag, 0):
        return
    for b in range(tid, cuda.gridDim.x, cuda.blockDim.x):
        counts[b] = ties_n[r, b]
        ties_n[r, b] = int32(0)  # for the next launch
    cuda.syncthreads()  # the counts are in shared memory
    if tid == 0:
        ties = ist[r, 2]
        inv_t = fst[r, 3]
        p = math.exp((_key_value(key) - fst[r, 0]) * inv_t)
        mode = MODE_MASS_GE if stage == STAGE_CUT else MODE_MASS_GT  # the cut reaches, the walk exceeds
        j = tie_index(mode, int32(0), fst[r, 1] - fst[r, 2], p, ties)
        if stage == STAGE_CUT:  # the walk's target: the coin's share of the kept tokens' mass
            fst[r, 1] = fst[r, 4] * (fst[r, 2] + float32(j + 1) * p)
            fst[r, 2] = float32(0.0)
            ist[r, 0], ist[r, 1], ist[r, 2] = int32(0), int32(0), int32(0)
            ist[r, 4], ist[r, 6] = key, int32(1)  # (the id: its finder's, below)
        b = int32(0)
        while b < cuda.gridDim.x - 1 and counts[b] <= j:  # the block whose chunk holds the j-th
            j -= counts[b]
            b += int32(1)
        at[0], at[1] = b, j
        count[r] = int32(0)  # for the next launch
    cuda.syncthreads()  # at holds the block and j
    first = at[0] * chunk
    end = min(n, first + chunk)
    for r0 in range(first, end, cuda.blockDim.x):  # block-uniform rounds
        i = r0 + tid
        hit = i < end and _ukey(row[min(i, n - 1)]) == key
        rank, _ = _warp_prefix(int32(1) if hit else int32(0))  # rank: inclusive
        if lane == 31:
            wc[warp] = rank  # the warp's count
        cuda.syncthreads()  # every warp's count is in
        if tid == 0:
            at[2] = int32(-1)
            j = at[1]
            for w in range(cuda.blockDim.x // 32):
                if j < wc[w]:
                    at[2] = w
                    break
                j -= wc[w]
            at[1] = j
        cuda.syncthreads()  # at[2]: the warp of the j-th, or -1 (at[1]: what is left of j)
        if at[2] == warp and hit and rank - 1 == at[1]:
            if stage == STAGE_CUT:
                ist[r, 5] = i
            elif ist[r, 6] != int32(0) and (
                uint32(key) < uint32(ist[r, 4]) or (key == ist[r, 4] and i > ist[r, 5])
            ):
                tokens[r] = ist[r, 5]  # past the cut in walk order (rounding): the last kept token
            else:
                tokens[r] = i
        if at[2] >= 0:
            return  # block-uniform
        cuda.syncthreads()  # wc and at are read before the next round rewrites them


def wide_blocks(n: int) -> int:
    """Blocks a row of n logits: one per WIDE_LOGITS of them, at most WIDE_BLOCKS (128,256 logits:
    32 blocks). Fewer blocks each take more logits; more make each pass's last block add more
    histograms (WIDE_BLOCKS x 256 x 8 bytes at most)."""
    return max(1, min(WIDE_BLOCKS, -(-n // WIDE_LOGITS)))


def _launches(
    logits: object, tokens: object, scratch: WideScratch, stats: object, stats_args: tuple, stages: tuple,
    blocks: int | None, stream: object,
) -> None:  # fmt: skip
    """The launches over the rows of logits (M, vocab_size): stats(logits, *stats_args, part,
    fst, ist, count), then for each of `stages` the four passes and the pick (the walk's into
    tokens (M,))."""
    rows, n = logits.shape
    if blocks is None:
        blocks = wide_blocks(n)
    if not (1 <= blocks <= WIDE_BLOCKS and rows <= scratch.rows):
        raise PycalmError(
            f"sample_wide: {blocks} blocks a row (1 to {WIDE_BLOCKS}), {rows} rows of {scratch.rows}"
        )
    grid = ((blocks, rows), WIDE_THREADS, stream)  # (the scratch's rows past M are not touched)
    stats[grid](logits, *stats_args, scratch.part, scratch.fst, scratch.ist, scratch.count)
    for stage in stages:
        for shift in SHIFTS:
            wide_pass[grid](
                logits,
                int32(shift),
                int32(stage),
                scratch.fst,
                scratch.ist,
                scratch.hist_n,
                scratch.hist_m,
                scratch.count,
            )
        wide_pick[grid](logits, int32(stage), scratch.fst, scratch.ist, tokens, scratch.ties_n, scratch.count)


def sample_wide_rows(
    logits: object, params: tuple, coins: object, tokens: object, scratch: WideScratch, *, stream: object,
    blocks: int | None = None,
) -> None:  # fmt: skip
    """tokens[r] = sample_ref(logits[r], temperature[r], top_p[r], coin coins[r]) for every row r of logits
    (M, vocab_size) whose options (params: sample.RowSampling) is_wide takes; the other
    rows' tokens are not written (sample_rows_kernel's, launched with wide=1). blocks: a row's
    (default: wide_blocks)."""
    stages = (STAGE_CUT, STAGE_WALK)  # (a row without top-p skips the cut's launches)
    _launches(logits, tokens, scratch, wide_stats_rows, (*params, coins), stages, blocks, stream)


def sample_wide_state(
    logits: object, state: object, coins: object, inv_t: float, top_p: float, scratch: WideScratch, *,
    stream: object, blocks: int | None = None,
) -> None:  # fmt: skip
    """state[STATE_TOKEN] = sample_ref(logits (vocab_size,), temperature 1 / inv_t, top_p, coin
    coins[state[STATE_POS]]): the token step's sample without top-k or min-p."""
    row = logits.reshape(1, logits.shape[0])  # (1, vocab_size)
    token = state[STATE_TOKEN : STATE_TOKEN + 1]  # (1,)
    stages = (STAGE_CUT, STAGE_WALK) if top_p < 1.0 else (STAGE_WALK,)
    args = (np.float32(inv_t), np.float32(top_p), coins, state)
    _launches(row, token, scratch, wide_stats_state, args, stages, blocks, stream)
