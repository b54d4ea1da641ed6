"""Sampling on the GPU, so that only a token id crosses to the host each step.

Two launchers, one walk (_sample_row, a device function both kernels call):
  * `sample` (temperature with top-k / min-p / top-p; at temperature 0 pycalm.kernels.argmax)
    writes the chosen token of one logits row (vocab_size,) into state[STATE_TOKEN]. The random
    number: it reads coin = coins[state[STATE_POS]] from a device array of uniform [0, 1)
    numbers the host draws once per generation (one per position, as the CPU Sampler draws
    them), so the captured graph needs no per-token host work. temperature / top_k / top_p /
    min_p are launch arguments, fixed for a run (a graph a setting).
  * `sample_rows` picks a token for each of M rows of logits (M, vocab_size) at once, each row
    with its own options, read from device memory (RowSampling: temperature, top_k, top_p,
    min_p, each (M,)), its own coin coins[r] (coins: (M,)), into tokens[r] (tokens: (M,) int32).
    Grid M, one block a row (sample_rows_kernel); M is the arrays' row count and nothing else
    goes into the launch, so one captured graph serves any mix of requests (batched serving,
    speculative verification). A row at temperature 0 takes its argmax in its own block
    (pycalm.kernels.argmax.block_argmax: lowest id among equal maxima), the others the walk below.
  * Both take `wide`, the scratch of pycalm.kernels.sample_wide: rows without a top-k or min-p
    cut (is_wide) then take its walk over many blocks a row, six launches (eleven with top-p)
    over the whole GPU, in place of this one block's (sample_rows_kernel returns for them).
The reference is pycalm.cpu.reference.sample_ref (float64), row by row for sample_rows; the
kernels make the same walk in float32.

The walk, how (one block of SAMPLE_THREADS threads over a row's whole vocabulary; the logits, up
to 600 KB a row, stay in L2 between passes; 1024 threads need more registers than an SM has for
one block):
  * The walk order is "descending logit, lower id first": for T > 0, p = exp((l - max) / T) is
    monotonic in the logit, so the order needs no probabilities. Each logit gets a 32-bit key
    whose unsigned order is the float order.
  * Every question the spec asks is "which element of the walk order is the first where a
    running count reaches n (top-k / min-p), or a running mass reaches a target (top-p), or
    exceeds one (the coin walk)?". A radix select answers it exactly in 4 passes of 8 bits:
    each pass histograms (count, mass) of the elements that share the key prefix found so far
    (shared-memory atomics), and one warp scans the 256 bins (shuffle prefix sums) for the
    crossing bin. Equal keys (equal logits) are then ordered by id: the j-th smallest id among
    them by an atomic min (j == 0, the usual case) or 3 more radix passes over the id bits.
  * A row: max and total mass (1 pass: each thread rescales its sum when its max grows), the
    min-p count (1 pass, only with min-p), the top-k / min-p cut (a count select, only when it
    cuts), the top-p cut (a mass select, only when top_p < 1), the walk (a mass select): up to
    17 passes over the logits, most often 3 to 8 (temperature alone: 3 or 4). The three
    selects share one call site in a loop over stages (the select is compiled once: half the
    PTX).
  * Once a cut leaves at most KEPT tokens (top-k, min-p or top-p keep a few dozen of a real
    model's vocabulary), one more pass gathers them into shared memory, each finds its rank by
    comparing with the others, and warp 0 finds the top-p cut (if not yet made) and the coin's
    crossing in walk order, with float32 sums in walk order as the spec's (_walk_kept): the
    remaining selects' radix passes are skipped. A top-p select with nothing cut before it
    (the CLI's default) stops as soon as a pass leaves at most KEPT candidates (the elements
    before its crossing bin and in it) and hands them to the same sorted walk, its top-p share
    taken of the whole vocabulary's mass. Every other select (the top-k / min-p count, the
    top-p cut, the coin walk) stops as soon as the bin it crosses in holds at most KEPT (after
    one or two passes on a 128k vocabulary: a bin of 16 key bits holds about a hundred logits),
    gathers that bin alone, sorts it and walks on from the tokens before it (_walk_bin): one
    pass in place of the last radix passes and the tie pass.
  * Every pass is latency-bound (16 warps on one SM, ~250 logits a thread over 128k): a thread
    loads its logits BATCH at a time (argmax.load_batch), so a pass waits for one L2 round trip per BATCH
    elements instead of one per element. The histogram passes' shared-memory atomics queue
    on the few bins most logits share: each warp adds into a histogram of its own, and the
    warps' histograms are summed after the pass (_merge). (Timings: docs/BENCHMARKS.md.)
Ties in floating point: the running sums are float32 sums in histogram order, not float64 sums
in walk order, so a coin within ~1e-6 of a boundary between two tokens may pick the neighbour.

Bytes moved: vocab_size * 4 per pass (from L2, counted as memory) plus a few words, a row
(sample_rows: M rows, each block its own passes, the rows' blocks on different SMs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, uint32

from pycalm.cpu.reference import check_sampling
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.kernels.argmax import BATCH, argmax, block_argmax, load_batch
from pycalm.kernels.common import (
    STATE_POS,
    STATE_TOKEN,
    as_f32,
    as_i32,
    block_reduce_max,
    block_reduce_sum,
    dependent_start,
    warp_reduce_max,
    warp_reduce_sum,
)

SAMPLE_THREADS = 512  # the sample kernels need about 96 registers a thread: 1024 would not launch
BINS = 256
HIST = SAMPLE_THREADS // 32 * BINS  # the histograms of a block: one a warp (summed into the first)
# the coin walk over at most KEPT kept tokens sorts them in shared memory instead of its radix
# passes (_walk_kept); fewer under the simulator, so that the tests cover both ways
KEPT = 32 if _numba_config.ENABLE_CUDASIM else 512
# every shared array of the sample kernels starts a 16-byte line of its own: ptxas merges the
# select's reads of cross[0..2] into one 16-byte load, which, where `best` shared cross's line,
# read best's word after a barrier that did not keep thread 0 from rewriting it (the value was
# not used; compute-sanitizer racecheck reported it as the kernels' only hazards)
SHARED_ALIGN = 16
MODE_COUNT = 0  # first element where the running count >= n
MODE_MASS_GE = 1  # first element where the running mass >= target (top-p)
MODE_MASS_GT = 2  # first element where the running mass > target (the coin walk)
SIGN = -2147483648  # 0x80000000 as int32


@cuda.jit(device=True, inline=True)
def _ukey(x):  # noqa: ANN001, ANN202
    """float32 -> int32 whose UNSIGNED order (bit pattern) is the float order (radix digits).
    Every result is wrapped in int32(): real numba computes int32 ^ int32 in int64, where a key
    with bit 31 set would come out sign-extended and never equal a prefix built from digits."""
    u = as_i32(x)
    if u < int32(0):
        u = int32(u ^ int32(0x7FFFFFFF))  # negative floats: larger magnitude, smaller key
    return int32(u ^ int32(SIGN))


@cuda.jit(device=True, inline=True)
def _key_value(k):  # noqa: ANN001, ANN202
    """Inverse of _ukey: the float32 with that key."""
    u = int32(k ^ int32(SIGN))
    if u < int32(0):
        u = int32(u ^ int32(0x7FFFFFFF))
    return as_f32(u)


@cuda.jit(device=True, inline=True)
def is_wide(temperature, top_k, min_p, n):  # noqa: ANN001, ANN201
    """Whether pycalm.kernels.sample_wide takes a row: T > 0 and no top-k (0, or the whole
    vocabulary of n) or min-p (0) cut; any top_p."""
    return temperature > float32(0.0) and (top_k <= int32(0) or top_k >= n) and min_p <= float32(0.0)


@cuda.jit(device=True, inline=True)
def tie_index(mode, left_n, left_mass, p, ties):  # noqa: ANN001, ANN202
    """The crossing among `ties` equal logits of p each, walked in id order, where left_n /
    left_mass of the target remain before them: the first to reach the count (MODE_COUNT) or to
    reach (MODE_MASS_GE) / exceed (MODE_MASS_GT) the mass -> its index j, clamped to the ties
    (the last where p underflows to 0)."""
    j = ties - int32(1)
    if mode == MODE_COUNT:
        j = left_n - int32(1)
    elif p > float32(0.0):
        q = left_mass / p
        j = int32(math.ceil(q)) - int32(1) if mode == MODE_MASS_GE else int32(math.floor(q))
    return max(int32(0), min(j, ties - int32(1)))


@cuda.jit(device=True, inline=True)
def _crossed(mode, cnt, mass, target_n, target_mass):  # noqa: ANN001, ANN202
    """Whether a running count / mass has crossed the target of `mode`."""
    if mode == MODE_COUNT:
        return cnt >= target_n
    if mode == MODE_MASS_GE:
        return mass >= target_mass
    return mass > target_mass


@cuda.jit(device=True, inline=True)
def _warp_prefix(v):  # noqa: ANN001, ANN202
    """Inclusive prefix sum of v over the lanes of this warp, and the exclusive one (the
    previous lane's inclusive, 0 in lane 0). Every lane of the warp must call it."""
    lane = cuda.threadIdx.x % 32
    off = 1
    while off < 32:
        u = cuda.shfl_up_sync(0xFFFFFFFF, v, off)
        if lane >= off:
            v += u
        off *= 2
    ex = cuda.shfl_up_sync(0xFFFFFFFF, v, 1)
    return v, ex if lane > 0 else ex - ex  # ex - ex: a zero of v's type


@cuda.jit(device=True, inline=True)
def _scan_bins(hist_n, hist_mass, mode, target_n, target_mass, base_c, base_s, ascending, cross, cross_mass):  # noqa: ANN001, ANN202
    """Warp 0 only: the crossing bin of a histogram walked from bin 255 down (bin 0 up when
    ascending), the running count / mass starting at base_c / base_s (what lies before the
    histogram in the walk). cross <- (bin, count before it, count in it); cross_mass <- (mass before
    it,), both relative to the histogram. If nothing crosses (float rounding at the very end of
    the walk), the last non-empty bin is taken, as the spec clamps to the last kept token."""
    lane = cuda.threadIdx.x
    lane_n = int32(0)
    lane_mass = float32(0.0)
    for i in range(8):  # lane L owns walk positions 8L .. 8L+7
        b = 8 * lane + i if ascending else 255 - 8 * lane - i
        lane_n += hist_n[b]
        lane_mass += hist_mass[b]
    own_c = lane_n
    lane_n, ex_c = _warp_prefix(lane_n)  # over the lanes (every lane of warp 0 takes part)
    lane_mass, ex_s = _warp_prefix(lane_mass)
    total_c = cuda.shfl_sync(0xFFFFFFFF, lane_n, 31)
    total_s = cuda.shfl_sync(0xFFFFFFFF, lane_mass, 31)
    mine = (not _crossed(mode, base_c + ex_c, base_s + ex_s, target_n, target_mass)) and _crossed(
        mode, base_c + lane_n, base_s + lane_mass, target_n, target_mass
    )
    fallback = (
        (not _crossed(mode, base_c + total_c, base_s + total_s, target_n, target_mass))
        and own_c > 0
        and total_c == lane_n
    )
    if mine or fallback:
        run_n = ex_c
        run_mass = ex_s
        for i in range(8):
            b = 8 * lane + i if ascending else 255 - 8 * lane - i
            next_n = run_n + hist_n[b]
            next_mass = run_mass + hist_mass[b]
            if mine:
                hit = _crossed(mode, base_c + next_n, base_s + next_mass, target_n, target_mass)
            else:
                hit = hist_n[b] > 0 and next_n == total_c
            if hit:
                cross[0] = b
                cross[1] = run_n
                cross[2] = hist_n[b]
                cross_mass[0] = run_mass
                break
            run_n = next_n
            run_mass = next_mass


@cuda.jit(device=True, inline=True)
def _clear(hist_n, hist_mass):  # noqa: ANN001, ANN202
    for b in range(cuda.threadIdx.x, (cuda.blockDim.x // 32) * BINS, cuda.blockDim.x):
        hist_n[b] = int32(0)
        hist_mass[b] = float32(0.0)


@cuda.jit(device=True, inline=True)
def _merge(hist_n, hist_mass):  # noqa: ANN001, ANN202
    """Add the warps' histograms into the first (bins 0..255 of hist_n / hist_mass), in warp order."""
    for b in range(cuda.threadIdx.x, BINS, cuda.blockDim.x):
        n = hist_n[b]
        mass = hist_mass[b]
        for w in range(1, cuda.blockDim.x // 32):
            n += hist_n[w * BINS + b]
            mass += hist_mass[w * BINS + b]
        hist_n[b] = n
        hist_mass[b] = mass


@cuda.jit(device=True, inline=True)
def _select(logits, m, inv_t, mode, target_n, target_mass, hist_n, hist_mass, cross, cross_mass, best, few):  # noqa: ANN001, ANN202, E501
    """All threads of the block. The element of the walk order where the running count reaches
    target_n (MODE_COUNT) or the running mass reaches / exceeds target_mass -> (its rank, its token id, the
    running mass through it, 0, 0). Or, as soon as a pass leaves at most `few` candidates (the
    elements before the crossing bin and in it: a prefix of the walk order, every key at least
    the bin's lowest), -> (their count, -1, 0, that lowest key, 0) for the caller to sort them.
    Or as soon as the crossing bin holds at most KEPT elements -> (the elements before it, -2,
    their mass, the bin's key bits, their mask) for the caller to sort the bin's elements and
    walk on from there (_walk_bin): the select's last radix passes and its tie pass become one
    gathering pass."""
    n = logits.shape[0]
    tid = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    row = (tid // 32) * BINS  # this warp's histogram
    xs = cuda.local.array(BATCH, float32)  # a batch of this thread's logits
    prefix = int32(0)  # key bits fixed so far
    prefix_mask = int32(0)  # their mask
    cnt_above = int32(0)  # elements before the prefix's ones in the walk
    mass_above = float32(0.0)
    ties = int32(0)
    for p in range(4):
        shift = int32(24 - 8 * p)
        _clear(hist_n, hist_mass)
        cuda.syncthreads()  # the histogram is clear before anyone adds to it
        # Run-length aggregation: a thread adds its run of equal digits in one pair of atomics.
        # Most logits share the top digits (same sign and exponent), so one shared-memory
        # atomic per element would queue the whole block on one or two bins; runs cut the
        # atomics to a few per thread. Each warp adds into its own histogram (row), so only the
        # lanes of one warp contend for a bin.
        run_digit = int32(-1)
        run_n = int32(0)
        run_mass = float32(0.0)
        for i0 in range(tid, n, n_threads * BATCH):
            load_batch(logits, i0, n_threads, xs)
            for u in range(BATCH):
                x = xs[u]
                k = _ukey(x)
                if i0 + u * n_threads < n and (k & prefix_mask) == prefix:
                    d = int32((k >> shift) & int32(255))
                    if d != run_digit:
                        if run_n > int32(0):
                            cuda.atomic.add(hist_n, row + run_digit, run_n)
                            cuda.atomic.add(hist_mass, row + run_digit, run_mass)
                        run_digit = d
                        run_n = int32(0)
                        run_mass = float32(0.0)
                    run_n += int32(1)
                    run_mass += math.exp((x - m) * inv_t)  # count mode too: its mass is used
        if run_n > int32(0):
            cuda.atomic.add(hist_n, row + run_digit, run_n)
            cuda.atomic.add(hist_mass, row + run_digit, run_mass)
        cuda.syncthreads()  # every warp's histogram is complete
        _merge(hist_n, hist_mass)
        cuda.syncthreads()  # their sum is in the first
        if tid < 32:
            _scan_bins(
                hist_n,
                hist_mass,
                mode,
                target_n,
                target_mass,
                cnt_above,
                mass_above,
                False,
                cross,
                cross_mass,
            )
        cuda.syncthreads()  # cross holds the crossing bin (read by all before the next clear)
        prefix = int32(prefix | (cross[0] << shift))
        prefix_mask = int32(prefix_mask | (int32(255) << shift))
        cnt_above += cross[1]
        mass_above += cross_mass[0]
        ties = cross[2]
        if cnt_above + ties <= few and prefix != int32(0):
            return cnt_above + ties, int32(-1), float32(0.0), prefix, int32(0)  # block-uniform (cross)
        if ties <= int32(KEPT):
            return cnt_above, int32(-2), mass_above, prefix, prefix_mask  # block-uniform (cross)
    # equal keys are equal logits: the crossing is at the j-th of them in id order
    p_tie = math.exp((_key_value(prefix) - m) * inv_t)
    j = tie_index(mode, target_n - cnt_above, target_mass - mass_above, p_tie, ties)
    if j == 0:  # the lowest id among the ties (the usual case: no ties at all)
        if tid == 0:
            best[0] = n
        cuda.syncthreads()  # best is reset before the atomic min
        for i0 in range(tid, n, n_threads * BATCH):
            load_batch(logits, i0, n_threads, xs)
            for u in range(BATCH):
                if i0 + u * n_threads < n and _ukey(xs[u]) == prefix:
                    cuda.atomic.min(best, 0, int32(i0 + u * n_threads))
        cuda.syncthreads()  # every candidate has gone into best
        idx = best[0]
    else:  # the j-th smallest id among the ties: radix select over the id bits, ascending
        idx = int32(0)
        id_mask = int32(0)
        below = int32(0)
        for p in range(3):
            shift = int32(16 - 8 * p)
            _clear(hist_n, hist_mass)
            cuda.syncthreads()  # the histogram is clear before anyone adds to it
            for i in range(tid, n, cuda.blockDim.x):
                if (int32(i) & id_mask) == idx and _ukey(logits[i]) == prefix:
                    cuda.atomic.add(hist_n, (int32(i) >> shift) & int32(255), int32(1))
            cuda.syncthreads()  # the histogram is complete
            if tid < 32:
                _scan_bins(
                    hist_n,
                    hist_mass,
                    MODE_COUNT,
                    j + int32(1),
                    float32(0.0),
                    below,
                    float32(0.0),
                    True,
                    cross,
                    cross_mass,
                )
            cuda.syncthreads()  # cross holds the bin
            idx = int32(idx | (cross[0] << shift))
            id_mask = int32(id_mask | (int32(255) << shift))
            below += cross[1]
    cuda.syncthreads()  # everyone has read cross / best before a later select rewrites them
    return cnt_above + j, idx, mass_above + float32(j + 1) * p_tie, int32(0), int32(0)


@cuda.jit(device=True, inline=True)
def _warp_first(p, k, target, mode):  # noqa: ANN001, ANN202
    """Warp 0 (all 32 lanes). The first rank r < k where the running sum of p[0..r] reaches
    target (MODE_MASS_GE) or exceeds it (MODE_MASS_GT); k - 1 if none does (float rounding at
    the very end). Lane l adds ranks [lo, hi) in order, a prefix sum over the lanes gives each
    its start, the lanes that may hold the crossing walk their ranks, the lowest rank wins."""
    lane = cuda.threadIdx.x
    per = (k + int32(31)) // int32(32)
    lo = min(lane * per, k)
    hi = min(lo + per, k)
    own = float32(0.0)
    for r in range(lo, hi):
        own += p[r]
    inc, ex = _warp_prefix(own)
    pick = k
    if not _crossed(mode, 0, ex, 0, target):
        if _crossed(mode, 0, inc, 0, target):
            pick = hi - int32(1)  # the prefix sum says so, whatever the lane's own rounding
        run = ex
        for r in range(lo, hi):
            run += p[r]
            if _crossed(mode, 0, run, 0, target):
                pick = int32(r)
                break
    pick = -warp_reduce_max(-pick)  # the lowest pick of the warp
    return min(pick, k - int32(1))


@cuda.jit(device=True, inline=True)
def _warp_total(p, k):  # noqa: ANN001, ANN202
    """Warp 0 (all 32 lanes): p[0] + .. + p[k - 1], in every lane."""
    s = float32(0.0)
    for r in range(cuda.threadIdx.x, k, 32):
        s += p[r]
    return warp_reduce_sum(s)


@cuda.jit(device=True, inline=True)
def _gather_sorted(logits, m, inv_t, edge_key, edge_id, mask, bits, hist_n, hist_mass, best):  # noqa: ANN001, ANN202
    """All threads of the block. Gathers at most KEPT tokens, those whose key (unsigned) is above
    edge_key, or equal to it with an id up to edge_id, and whose key bits under mask are `bits`
    (mask 0: any key), into hist_mass / hist_n [0, K) in one pass; each finds its rank in the walk
    order by comparing with all the others (K^2 shared loads, broadcast) and puts its p there in
    hist_mass / hist_n [KEPT, KEPT + K). -> K, the count gathered."""
    n = logits.shape[0]
    tid = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    if tid == 0:
        best[0] = int32(0)
    cuda.syncthreads()  # the slot counter is zero before anyone takes a slot
    xs = cuda.local.array(BATCH, float32)
    for i0 in range(tid, n, n_threads * BATCH):
        load_batch(logits, i0, n_threads, xs)
        for u in range(BATCH):
            i = i0 + u * n_threads
            key = _ukey(xs[u])
            k = uint32(key)
            if i < n and (key & mask) == bits and (k > edge_key or (k == edge_key and i <= edge_id)):
                slot = cuda.atomic.add(best, 0, int32(1))
                if slot < KEPT:
                    hist_mass[slot] = xs[u]
                    hist_n[slot] = int32(i)
    cuda.syncthreads()  # every gathered token is in its slot
    n_kept = min(best[0], int32(KEPT))
    cuda.syncthreads()  # everyone has read the count before best is reused
    for e in range(tid, n_kept, n_threads):
        xe = hist_mass[e]
        ke = uint32(_ukey(xe))
        ie = hist_n[e]
        r = int32(0)
        for f in range(n_kept):  # every thread reads the same f: shared-memory broadcast
            kf = uint32(_ukey(hist_mass[f]))
            if kf > ke or (kf == ke and hist_n[f] < ie):
                r += int32(1)
        hist_mass[KEPT + r] = math.exp((xe - m) * inv_t)
        hist_n[KEPT + r] = ie
    cuda.syncthreads()  # the gathered tokens are in walk order
    return n_kept


@cuda.jit(device=True, inline=True)
def _walk_kept(logits, m, inv_t, coin, top_p, denom, edge_key, edge_id, hist_n, hist_mass, best):  # noqa: ANN001, ANN202
    """All threads of the block. The top-p cut (top_p < 1) and the coin walk over a few
    candidates (at most KEPT): a prefix of the walk order, every token whose key (unsigned) is
    above edge_key, or equal to it with an id up to edge_id. Either the kept tokens themselves
    (edge_key: the last kept token's key, edge_id: its id; denom 0: the top-p share is of their
    own total) or a top-p select's candidates (edge_key: one below their lowest key, edge_id -1;
    denom: the total mass the share is of). _gather_sorted puts them in walk order; warp 0 finds
    the top-p cut and the coin's crossing in rank order. -> the token id."""
    n_kept = _gather_sorted(logits, m, inv_t, edge_key, edge_id, int32(0), int32(0), hist_n, hist_mass, best)
    if cuda.threadIdx.x < 32:
        p = hist_mass[KEPT:]
        keep = n_kept
        if top_p < float32(1.0):  # the first prefix whose share reaches top_p
            total = denom if denom > float32(0.0) else _warp_total(p, n_kept)
            keep = _warp_first(p, n_kept, top_p * total, MODE_MASS_GE) + int32(1)
        r = _warp_first(p, keep, coin * _warp_total(p, keep), MODE_MASS_GT)
        if cuda.threadIdx.x == 0:
            best[0] = r
    cuda.syncthreads()  # best holds the rank
    return hist_n[KEPT + best[0]]


@cuda.jit(device=True, inline=True)
def _walk_bin(
    logits,
    m,
    inv_t,
    bits,
    mask,
    mode,
    target_n,
    target_mass,
    above_n,
    above_mass,
    hist_n,
    hist_mass,
    cross_mass,
    best,
):  # noqa: ANN001, ANN202, E501
    """All threads of the block. A select's crossing inside the bin where it crosses (the tokens
    whose key bits under mask are `bits`, at most KEPT), after above_n tokens of mass above_mass
    before the bin: _gather_sorted puts the bin in walk order, and warp 0 finds the first rank
    where the running count reaches target_n (MODE_COUNT) or the running mass, from above_mass,
    reaches / exceeds target_mass (the bin's last if rounding leaves none), and the bin's mass
    through it. -> (that rank in the bin, its token id, that mass)."""
    n_kept = _gather_sorted(
        logits, m, inv_t, uint32(0), int32(logits.shape[0]), mask, bits, hist_n, hist_mass, best
    )
    if cuda.threadIdx.x < 32:
        p = hist_mass[KEPT:]
        if mode == MODE_COUNT:
            r = max(int32(0), min(target_n - above_n - int32(1), n_kept - int32(1)))
        else:
            r = _warp_first(p, n_kept, target_mass - above_mass, mode)
        through = _warp_total(p, r + int32(1))
        if cuda.threadIdx.x == 0:
            best[0] = r
            cross_mass[1] = through
    cuda.syncthreads()  # best holds the rank, cross_mass[1] the mass through it
    rank = best[0]
    idx = hist_n[KEPT + rank]
    through = cross_mass[1]
    cuda.syncthreads()  # everyone has read them before a later select rewrites them
    return rank, idx, through


@cuda.jit(device=True, inline=True)
def _sample_row(
    logits, inv_t, top_k, top_p, min_p, coin, scratch, hist_n, hist_mass, cross, cross_mass, best
):  # noqa: ANN001, ANN202
    """All threads of the block, every argument block-uniform. The token sample_ref picks from
    logits (n,) for temperature 1 / inv_t (> 0), top_k, top_p, min_p and the coin, in every
    thread. The shared arrays: scratch (32,) float32, hist_n / hist_mass (HIST,) int32 / float32,
    cross (4,) int32, cross_mass (2,) float32, best (1,) int32."""
    n = logits.shape[0]
    tid = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    xs = cuda.local.array(BATCH, float32)  # a batch of this thread's logits
    # the largest logit and the total mass (p relative to the largest, which is 1) in one pass:
    # each thread sums p relative to its own largest so far, rescaling its sum when that grows
    m_thread = float32(-math.inf)
    s_thread = float32(0.0)
    for i0 in range(tid, n, n_threads * BATCH):
        load_batch(logits, i0, n_threads, xs)
        for u in range(BATCH):
            x = xs[u]
            if i0 + u * n_threads < n and x > float32(-math.inf):
                if x > m_thread:
                    s_thread *= math.exp((m_thread - x) * inv_t)
                    m_thread = x
                s_thread += math.exp((x - m_thread) * inv_t)
    m = block_reduce_max(m_thread, scratch)
    if s_thread > float32(0.0):
        s_thread *= math.exp((m_thread - m) * inv_t)
    total = block_reduce_sum(s_thread, scratch)
    n_min_p = float32(n)
    if min_p > float32(0.0):  # the min-p count needs the largest first: a pass of its own
        n_min_p = float32(0.0)
        for i0 in range(tid, n, n_threads * BATCH):
            load_batch(logits, i0, n_threads, xs)
            for u in range(BATCH):
                if i0 + u * n_threads < n and math.exp((xs[u] - m) * inv_t) >= min_p:
                    n_min_p += float32(1.0)
        n_min_p = block_reduce_sum(n_min_p, scratch)  # exact: counts below 2^24
    n_keep = int32(n)
    if top_k > 0:
        n_keep = min(n_keep, top_k)
    if min_p > float32(0.0):
        n_keep = min(n_keep, int32(n_min_p))
    n_keep = max(n_keep, int32(1))
    cut = int32(n)  # tokens kept: the first `cut` of the walk order
    mass = total  # their mass
    last = int32(0)  # the id of the last kept token (when cut < n)
    token = int32(0)  # the pick (set by the walk, the last stage)
    # Three selects: the top-k / min-p cut (stage 0, only when it cuts), the top-p cut (stage 1,
    # only when top_p < 1), the coin walk (stage 2). One call site in a loop whose trip count
    # is known only at run time, so the (large) select is compiled once, not three times.
    # Every thread computes the same stage sequence, so the select's barriers stay uniform.
    # Once a cut leaves at most KEPT tokens, _walk_kept sorts them and does the rest.
    stage = int32(0) if n_keep < cut else int32(1)
    small_top_p = float32(1.0)  # the top-p cut, when the kept-token walk takes it
    while stage < int32(3):
        if stage == int32(1) and top_p >= float32(1.0):
            stage = int32(2)
        if stage == int32(1) and cut <= int32(KEPT) and cut < int32(n):
            stage = int32(2)  # few tokens after the top-k / min-p cut: the walk below cuts too
            small_top_p = top_p
        if stage == int32(0):
            mode = MODE_COUNT
            target_n = n_keep
            target_mass = float32(0.0)
        elif stage == int32(1):
            mode = MODE_MASS_GE
            target_n = int32(0)
            target_mass = top_p * mass
        else:
            mode = MODE_MASS_GT
            target_n = int32(0)
            target_mass = coin * mass
        if stage == int32(2) and cut <= int32(KEPT) and cut < int32(n):
            # a few kept tokens: sort them instead of four radix passes over the vocabulary
            edge_key = uint32(_ukey(logits[last]))
            idx = _walk_kept(
                logits, m, inv_t, coin, small_top_p, float32(0.0), edge_key, last, hist_n, hist_mass, best
            )
            r = int32(0)
            mass_through = mass
        else:
            # top-p with nothing cut before it: stop the select once a pass leaves few candidates;
            # any select: once the bin it crosses in holds at most KEPT tokens
            few = int32(KEPT) if stage == int32(1) and cut == int32(n) else int32(0)
            r, idx, mass_through, low, low_mask = _select(
                logits, m, inv_t, mode, target_n, target_mass, hist_n, hist_mass, cross, cross_mass, best, few
            )  # fmt: skip
            if idx == int32(-2):  # the crossing bin: sort it and walk on from the tokens before it
                rank, idx, through = _walk_bin(logits, m, inv_t, low, low_mask, mode, target_n, target_mass, r,
                                               mass_through, hist_n, hist_mass, cross_mass, best)  # fmt: skip
                r += rank
                mass_through += through
            elif idx < int32(0):  # they hold the top-p cut: sort them, cut and walk
                edge_key = uint32(low) - uint32(1)  # keys >= low (low is never 0)
                idx = _walk_kept(
                    logits, m, inv_t, coin, top_p, mass, edge_key, int32(-1), hist_n, hist_mass, best
                )
                r = int32(0)
                stage = int32(2)  # the walk is done too
        if stage == int32(0):
            cut = n_keep
            mass = mass_through
            last = idx
        elif stage == int32(1):
            if r + int32(1) < cut:
                cut = r + int32(1)
                mass = mass_through
                last = idx
        else:
            if r >= cut:  # coin * mass rounded past the kept tokens: the spec takes the last kept
                idx = last
            token = idx
        stage += int32(1)
    return token


@cuda.jit(cache=True)
def sample_kernel(logits, state, coins, inv_t, top_k, top_p, min_p):  # noqa: ANN001, ANN201
    """One block. state[STATE_TOKEN] <- the token sample_ref picks for coin coins[state[STATE_POS]]."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    scratch = cuda.shared.array(32, float32, alignment=SHARED_ALIGN)
    hist_n = cuda.shared.array(HIST, int32, alignment=SHARED_ALIGN)  # a histogram a warp (see _select)
    hist_mass = cuda.shared.array(HIST, float32, alignment=SHARED_ALIGN)
    cross = cuda.shared.array(4, int32, alignment=SHARED_ALIGN)
    cross_mass = cuda.shared.array(2, float32, alignment=SHARED_ALIGN)
    best = cuda.shared.array(1, int32, alignment=SHARED_ALIGN)
    coin = coins[state[STATE_POS]]
    token = _sample_row(
        logits, inv_t, top_k, top_p, min_p, coin, scratch, hist_n, hist_mass, cross, cross_mass, best
    )
    if cuda.threadIdx.x == 0:
        state[STATE_TOKEN] = token


@cuda.jit(cache=True)
def sample_rows_kernel(logits, temperature, top_k, top_p, min_p, coins, tokens, wide):  # noqa: ANN001, ANN201
    """Block r (grid M): tokens[r] <- sample_ref(logits[r], temperature[r], top_k[r], top_p[r],
    min_p[r], coins[r]); at temperature 0 the row's argmax (block_argmax, lowest id on ties).
    wide (1): a row is_wide takes is left to pycalm.kernels.sample_wide."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    r = cuda.blockIdx.x
    if wide and is_wide(temperature[r], top_k[r], min_p[r], logits.shape[1]):
        return  # block-uniform: sample_wide's launches pick this row's token
    # block reductions; the argmax's warp values
    scratch = cuda.shared.array(32, float32, alignment=SHARED_ALIGN)
    warp_i = cuda.shared.array(32, int32, alignment=SHARED_ALIGN)  # the argmax's warp ids
    hist_n = cuda.shared.array(HIST, int32, alignment=SHARED_ALIGN)  # a histogram a warp (see _select)
    hist_mass = cuda.shared.array(HIST, float32, alignment=SHARED_ALIGN)
    cross = cuda.shared.array(4, int32, alignment=SHARED_ALIGN)
    cross_mass = cuda.shared.array(2, float32, alignment=SHARED_ALIGN)
    best = cuda.shared.array(1, int32, alignment=SHARED_ALIGN)
    row = logits[r]  # (vocab_size,)
    t = temperature[r]
    if t == float32(0.0):  # block-uniform: the whole block takes one branch
        token = block_argmax(row, scratch, warp_i)
    else:
        inv_t = float32(1.0) / t  # (sample's launcher rounds 1 / T from float64: may differ in a bit)
        token = _sample_row(
            row,
            inv_t,
            top_k[r],
            top_p[r],
            min_p[r],
            coins[r],
            scratch,
            hist_n,
            hist_mass,
            cross,
            cross_mass,
            best,
        )
    if cuda.threadIdx.x == 0:
        tokens[r] = token


def _check_threads(threads: int) -> None:
    """One histogram a warp in shared memory: at most SAMPLE_THREADS threads, whole warps."""
    if not 32 <= threads <= SAMPLE_THREADS or threads % 32:
        raise PycalmError(f"sample takes 32 to {SAMPLE_THREADS} threads in whole warps, got {threads}")


def sample(
    logits: object,
    state: object,
    coins: object,
    sampling: SamplingParams,
    *,
    stream: object,
    threads: int = SAMPLE_THREADS,
    scratch: object = None,
    wide: object = None,
) -> None:
    """state[STATE_TOKEN] = sample_ref(logits, temperature, top_k, top_p, min_p, coin) for the
    settings of `sampling`, coin = coins[state[STATE_POS]] (coins: (seq_len,) float32 uniform
    [0, 1), drawn by the host once). Temperature 0 launches argmax (with `scratch`, see argmax);
    without top-k or min-p, with `wide` (a sample_wide.WideScratch), sample_wide's launches over many
    blocks; anything else sample_kernel's one block."""
    temperature, top_k, top_p, min_p = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise PycalmError(f"temperature must be a finite number >= 0, got {temperature}")
    if temperature == 0.0:
        argmax(logits, state, stream=stream, threads=threads, scratch=scratch)
        return
    if not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0 or top_k < 0:
        raise PycalmError(f"bad sampling options top_k={top_k} top_p={top_p} min_p={min_p}")
    _check_threads(threads)
    inv_t = float32(1.0 / temperature)
    if wide is not None and top_k == 0 and min_p == 0.0:
        wide.sample_state(
            logits, state, coins, inv_t, top_p, stream=stream
        )  # (sample_wide imports this module)
        return
    sample_kernel[1, threads, stream](
        logits, state, coins, inv_t, int32(top_k), float32(top_p), float32(min_p)
    )


class RowSampling(NamedTuple):
    """The sampling options of M rows in device memory, one entry a row, read by
    sample_rows_kernel at run time (so one captured graph serves any mix of requests)."""

    temperature: object  # (M,) float32: 0 greedy (the row's argmax)
    top_k: object  # (M,) int32: 0 off
    top_p: object  # (M,) float32: 1 off
    min_p: object  # (M,) float32: 0 off

    @classmethod
    def allocate(cls, rows: int, *, stream: object) -> RowSampling:
        """M = `rows` rows, each greedy until set_row / set_rows gives it options."""
        return cls.from_host(*host_rows([SamplingParams()] * rows), stream=stream)

    @classmethod
    def from_host(cls, *arrays: np.ndarray, stream: object) -> RowSampling:
        """From host arrays (temperature, top_k, top_p, min_p), each (M,) of the field's dtype."""
        return cls(*(cuda.to_device(a, stream=stream) for a in arrays))

    def set_rows(self, samplings: Sequence[SamplingParams], *, first: int = 0, stream: object) -> None:
        """Rows first .. first + len(samplings) - 1 take these options (checked as the CLI's):
        one host-to-device copy a field."""
        if not (0 <= first and first + len(samplings) <= self.rows):
            raise PycalmError(f"rows {first}..{first + len(samplings) - 1} of {self.rows}")
        for device, host in zip(self, host_rows(samplings), strict=True):
            device[first : first + len(host)].copy_to_device(host, stream=stream)

    def set_row(self, row: int, sampling: SamplingParams, *, stream: object) -> None:
        """Row `row` takes the options of `sampling`."""
        self.set_rows([sampling], first=row, stream=stream)

    @property
    def rows(self) -> int:
        return self.temperature.shape[0]


def host_rows(samplings: Sequence[SamplingParams]) -> tuple[np.ndarray, ...]:
    """(temperature, top_k, top_p, min_p) host arrays of RowSampling's dtypes, each option
    checked as sample_ref checks it. Rows sample the model's logits: no penalties or bias."""
    for s in samplings:
        check_sampling(s.temperature, s.top_k, s.top_p, s.min_p)
        if s.penalized:
            raise PycalmError("a rows pass samples without penalties or logit_bias (the token step has them)")
    return (
        np.array([s.temperature for s in samplings], np.float32),  # (M,)
        np.array([s.top_k for s in samplings], np.int32),  # (M,)
        np.array([s.top_p for s in samplings], np.float32),  # (M,)
        np.array([s.min_p for s in samplings], np.float32),  # (M,)
    )


class HostRows:
    """host_rows for a batch's steps: a running request passes the same SamplingParams object
    step after step, so each object is checked and encoded at the first step it comes in (by
    host_rows over that step's new objects: the same errors, for the same row) and its row kept.
    A step that brings new objects keeps only its own: those of ended requests go."""

    def __init__(self) -> None:
        # id -> (the object, its row: temperature, top_k, top_p, min_p as float32 / int32 bytes);
        # an object kept here is alive, so its id names no other object
        self.kept: dict[int, tuple[SamplingParams, bytes]] = {}

    def __call__(self, samplings: Sequence[SamplingParams]) -> tuple[np.ndarray, ...]:
        """host_rows(samplings): (temperature, top_k, top_p, min_p), each (M,)."""
        kept = self.kept
        if fresh := [s for s in samplings if id(s) not in kept]:
            t, k, p, m = host_rows(fresh)
            rows = np.stack([t.view(np.int32), k, p.view(np.int32), m.view(np.int32)], axis=1)  # (n, 4)
            kept.update({id(s): (s, r.tobytes()) for s, r in zip(fresh, rows, strict=True)})
            self.kept = kept = {id(s): kept[id(s)] for s in samplings}
        rows = b"".join([kept[id(s)][1] for s in samplings])  # (M * 16,)
        fields = np.frombuffer(rows, np.int32).reshape(len(samplings), 4).T.copy()  # (4, M)
        return fields[0].view(np.float32), fields[1], fields[2].view(np.float32), fields[3].view(np.float32)


def sample_rows(
    logits: object,
    params: RowSampling,
    coins: object,
    tokens: object,
    *,
    stream: object,
    threads: int = SAMPLE_THREADS,
    wide: object = None,
) -> None:
    """tokens[r] = sample_ref(logits[r], temperature[r], top_k[r], top_p[r], min_p[r], coins[r])
    for every row r of logits (M, vocab_size) float32, the options of `params`, coins (M,)
    float32 uniform [0, 1), tokens (M,) int32: one block a row, M blocks; with `wide` (a
    sample_wide.WideScratch) where it holds M rows, the rows is_wide takes over many
    blocks a row instead (six more launches, whose blocks of the other rows return at once;
    more rows than it holds take a block each, which fills the SMs). Nothing
    but the arrays goes into the launch, so a graph captured once serves any options and coins."""
    rows = logits.shape[0]
    arrays = (logits, *params, coins, tokens)
    dtypes = (np.float32, np.float32, np.int32, np.float32, np.float32, np.float32, np.int32)
    if (
        logits.ndim != 2
        or any(a.shape != (rows,) for a in arrays[1:])
        or any(a.dtype != d for a, d in zip(arrays, dtypes, strict=True))
    ):
        raise PycalmError(
            f"sample_rows: logits (M, vocab_size) float32, then the options, coins and tokens (M,) of "
            f"RowSampling's dtypes, float32 and int32, got {[(a.shape, str(a.dtype)) for a in arrays]}"
        )
    _check_threads(threads)
    if wide is not None and wide.rows < rows:
        wide = None  # more rows than the scratch holds: their blocks already spread over the SMs
    sample_rows_kernel[rows, threads, stream](logits, *params, coins, tokens, int32(wide is not None))
    if wide is not None:
        wide.sample_rows(logits, params, coins, tokens, stream=stream)
