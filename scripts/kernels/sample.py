"""Greedy and sampled picks on the GPU: each launch checked against the reference and timed.

Versions:
  argmax, two passes   pycalm.kernels.argmax with its scratch (what the engine launches)
  argmax, one block    the same without scratch: one block over every logit
  sample               pycalm.kernels.sample with four settings (temperature alone, top-k and
                       top-p, min-p and top-p, top-p alone: the CLI's default -t 0.7 -p 0.9), on
                       normal logits and on peaked ones (20 tokens far above the rest, a
                       language model's kind of distribution)
  multi-block          temperature alone (no top-k, top-p or min-p: bench_serve's requests) over
                       MB_BLOCKS blocks instead of one: a launch for the max and the mass (each
                       block its chunk's, the last block to finish adds them in block order), four
                       for the 8-bit radix passes of the walk (each block its chunk's histogram
                       of counts and masses, the last adds the blocks' in block order and finds
                       the crossing bin: the same sums whichever block finishes last), one for
                       the pick among equal logits (the j-th by id, the chunks being id ranges in
                       block order). The package's kernel runs its 3-4 passes on one SM (about
                       250 logits a thread, each an expf and a key): 0.38 ms on the H200
                       (2026-11-29). Not in the package until timed here

How to run (on the GPU machine, from the repository root):

    python3 scripts/kernels/sample.py
    NUMBA_ENABLE_CUDASIM=1 python3 scripts/kernels/sample.py --tiny   # the checks, small vocabulary

Over VOCAB logits, each version as a graph of REPS launches, replayed and timed with CUDA events
(median). Every version's picks are first compared with pycalm.cpu.reference.sample_ref for the
same coins, COINS (the tokens must be the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

import math  # noqa: E402

from numba import config as numba_config  # noqa: E402
from numba import cuda, float32, int32  # noqa: E402

from pycalm.cpu.reference import sample_ref  # noqa: E402
from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.kernels.argmax import argmax, argmax_scratch_shape  # noqa: E402
from pycalm.kernels.common import (  # noqa: E402
    STATE_POS,
    STATE_TOKEN,
    block_reduce_max,
    block_reduce_sum,
    last_to_arrive,
    warp_reduce_sum,
)
from pycalm.kernels.sample import _key_value, _ukey, _warp_prefix, sample  # noqa: E402

VOCAB = 128256
TINY_VOCAB = 301
REPS = 32
RUNS = 15
COINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99)  # the step at position p draws COINS[p]
SETTINGS = [
    SamplingParams(0.8, 40, 0.95, 0.0),
    SamplingParams(1.0, 0, 1.0, 0.0),
    SamplingParams(1.0, 0, 0.9, 0.05),
    SamplingParams(0.7, 0, 0.9, 0.0),
]


def logits_of(kind: str, vocab: int) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal(vocab) * 3
    if kind == "peaked":
        x[np.random.default_rng(3).choice(vocab, 20, replace=False)] += 25
    return x.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# multi-block: temperature alone over MB_BLOCKS blocks (see the module docstring)

MB_BLOCKS, MB_THREADS = (4, 64) if numba_config.ENABLE_CUDASIM else (128, 256)
MB_BINS = 256
MB_BATCH = 16  # the last block's loads in flight a thread
MB_PARTS = 2 * MB_BLOCKS  # (max, mass) a block


@cuda.jit(device=True, inline=True)
def _chunk(n):  # noqa: ANN001, ANN202
    """The block's logits of n: (chunk, lo, hi), ids lo .. hi - 1 of chunks of ceil(n / blocks),
    id ranges in block order."""
    chunk = (n + cuda.gridDim.x - 1) // cuda.gridDim.x
    lo = cuda.blockIdx.x * chunk
    return chunk, lo, min(n, lo + chunk)


@cuda.jit
def mb_stats(logits, coins, state, inv_t, part, fst, ist, count):  # noqa: ANN001, ANN201
    """Launch 1: part[2 b], part[2 b + 1] = block b's max m_b and sum of exp((x - m_b) / T);
    the last block: fst = (M, coin Z, 0), Z = sum_b part[2 b + 1] exp((m_b - M) / T) in block
    order; ist = (prefix 0, mask 0, ties 0)."""
    red = cuda.shared.array(32, float32)  # a word a warp (the block reductions)
    flag = cuda.shared.array(1, int32)  # last_to_arrive's answer
    parts = cuda.shared.array(MB_PARTS, float32)  # the last block's copy of part
    n = logits.shape[0]
    chunk, lo, hi = _chunk(n)
    m = float32(-math.inf)
    for i in range(lo + cuda.threadIdx.x, hi, cuda.blockDim.x):
        m = max(m, logits[i])
    m = block_reduce_max(m, red)
    z = float32(0.0)
    for i in range(lo + cuda.threadIdx.x, hi, cuda.blockDim.x):
        z += math.exp((logits[i] - m) * inv_t)
    z = block_reduce_sum(z, red)
    if cuda.threadIdx.x == 0:
        part[2 * cuda.blockIdx.x] = m
        part[2 * cuda.blockIdx.x + 1] = z
    if not last_to_arrive(count, 0, cuda.gridDim.x, flag, 0):
        return
    for b in range(cuda.threadIdx.x, cuda.gridDim.x, cuda.blockDim.x):  # the parts, loaded at once
        parts[2 * b], parts[2 * b + 1] = part[2 * b], part[2 * b + 1]
    cuda.syncthreads()  # every part is in shared memory
    if cuda.threadIdx.x == 0:
        big = float32(-math.inf)
        for b in range(cuda.gridDim.x):
            big = max(big, parts[2 * b])
        total = float32(0.0)
        for b in range(cuda.gridDim.x):  # block order: the same sum whichever block is last
            if parts[2 * b + 1] > float32(0.0):
                total += parts[2 * b + 1] * math.exp((parts[2 * b] - big) * inv_t)
        fst[0] = big
        fst[1] = coins[state[STATE_POS]] * total
        fst[2] = float32(0.0)
        ist[0], ist[1], ist[2] = 0, 0, 0
        count[0] = 0  # for the next launch


@cuda.jit
def mb_pass(logits, inv_t, shift, fst, ist, hist_n, hist_m, count):  # noqa: ANN001, ANN201
    """Launches 2-5: one 8-bit digit of the crossing key (bits shift .. shift + 7). Each block
    histograms its chunk's logits whose key has the prefix found so far: count and mass exp((x
    - M) / T) a digit, into its row of hist_n / hist_m; the last block adds the rows in block
    order, walks the digits from the highest (descending logits) and keeps the first bin where
    the mass before it plus its own passes coin Z (none: the last non-empty bin), adding the
    mass before it to fst[2]; ist = (prefix, mask, the bin's count)."""
    sn = cuda.shared.array(MB_BINS, int32)  # this block's histogram
    sm = cuda.shared.array(MB_BINS, float32)
    flag = cuda.shared.array(1, int32)
    tid = cuda.threadIdx.x
    for d in range(tid, MB_BINS, cuda.blockDim.x):
        sn[d] = 0
        sm[d] = float32(0.0)
    cuda.syncthreads()  # the histogram is clear
    n = logits.shape[0]
    chunk, lo, hi = _chunk(n)
    prefix, mask, big = ist[0], ist[1], fst[0]
    for i in range(lo + tid, hi, cuda.blockDim.x):
        x = logits[i]
        k = _ukey(x)
        if (k & mask) == prefix:
            d = (k >> shift) & 255
            cuda.atomic.add(sn, d, 1)
            cuda.atomic.add(sm, d, math.exp((x - big) * inv_t))
    cuda.syncthreads()  # the block's histogram is complete
    row = cuda.blockIdx.x * MB_BINS
    for d in range(tid, MB_BINS, cuda.blockDim.x):
        hist_n[row + d] = sn[d]
        hist_m[row + d] = sm[d]
    if not last_to_arrive(count, 0, cuda.gridDim.x, flag, 0):
        return
    bn = cuda.local.array(MB_BATCH, int32)  # a batch of blocks' counts and masses of bin d
    bm = cuda.local.array(MB_BATCH, float32)
    for d in range(tid, MB_BINS, cuda.blockDim.x):  # the blocks' rows in block order
        cn, cm = 0, float32(0.0)
        for b0 in range(0, cuda.gridDim.x, MB_BATCH):  # MB_BATCH loads in flight, then their sums
            for u in range(MB_BATCH):
                at = min(b0 + u, cuda.gridDim.x - 1) * MB_BINS + d
                bn[u], bm[u] = hist_n[at], hist_m[at]
            for u in range(MB_BATCH):
                if b0 + u < cuda.gridDim.x:
                    cn += bn[u]
                    cm += bm[u]
        sn[d] = cn
        sm[d] = cm
    cuda.syncthreads()  # the sums are in sn / sm
    if tid == 0:
        target, above = fst[1], fst[2]
        cross, last = -1, -1
        for e in range(MB_BINS):
            d = MB_BINS - 1 - e  # the highest digit first: descending logits
            if sn[d] > 0:
                last = d
                if above + sm[d] > target:
                    cross = d
                    break
                above += sm[d]
        if cross < 0:  # coin Z rounded up to the total: the walk's last bin
            cross = last
            above -= sm[last]
        fst[2] = above
        ist[0] = prefix | (cross << shift)
        ist[1] = mask | (255 << shift)
        ist[2] = sn[cross]
        count[0] = 0  # for the next launch


@cuda.jit
def mb_pick(logits, inv_t, fst, ist, state, ties_n, count):  # noqa: ANN001, ANN201
    """Launch 6: the crossing among the logits of the found key (equal logits, ordered by id):
    the j-th, j = floor((coin Z - mass before) / p), clamped to the ties. Each block counts its
    chunk's; the last finds the block of the j-th (chunks are id ranges in block order) and
    searches that chunk, blockDim ids a round (each warp's count and each lane's rank, then the
    warp and the lane of the j-th); state[STATE_TOKEN] = its id."""
    flag = cuda.shared.array(1, int32)
    counts = cuda.shared.array(MB_BLOCKS, int32)  # the last block's copy of ties_n
    wc = cuda.shared.array(32, int32)  # a round's hits a warp
    at = cuda.shared.array(3, int32)  # the block of the j-th, then j, then the warp that holds it
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    n = logits.shape[0]
    chunk, lo, hi = _chunk(n)
    key = ist[0]
    c = 0
    for i in range(lo + tid, hi, cuda.blockDim.x):
        if _ukey(logits[i]) == key:
            c += 1
    c = warp_reduce_sum(c)
    if lane == 0:
        cuda.atomic.add(ties_n, cuda.blockIdx.x, c)  # (integers: any order)
    if not last_to_arrive(count, 0, cuda.gridDim.x, flag, 0):
        return
    for b in range(tid, cuda.gridDim.x, cuda.blockDim.x):
        counts[b] = ties_n[b]
        ties_n[b] = 0  # for the next launch
    cuda.syncthreads()  # the counts are in shared memory
    if tid == 0:
        ties = ist[2]
        p = math.exp((_key_value(key) - fst[0]) * inv_t)
        j = ties - 1
        if p > float32(0.0):
            j = int32(math.floor((fst[1] - fst[2]) / p))
        j = max(0, min(j, ties - 1))
        b = 0
        while b < cuda.gridDim.x - 1 and counts[b] <= j:  # the block whose chunk holds the j-th
            j -= counts[b]
            b += 1
        at[0], at[1] = b, j
        count[0] = 0  # for the next launch
    cuda.syncthreads()  # at holds the block and j
    first = at[0] * chunk
    end = min(n, first + chunk)
    for r0 in range(first, end, cuda.blockDim.x):  # block-uniform rounds
        i = r0 + tid
        hit = i < end and _ukey(logits[min(i, n - 1)]) == key
        rank, _ = _warp_prefix(int32(1) if hit else int32(0))  # rank: inclusive
        if lane == 31:
            wc[warp] = rank  # the warp's count
        cuda.syncthreads()  # every warp's count is in
        if tid == 0:
            at[2] = -1
            j = at[1]
            for w in range(cuda.blockDim.x // 32):
                if j < wc[w]:
                    at[2] = w
                    break
                j -= wc[w]
            at[1] = j
        cuda.syncthreads()  # at[2]: the warp of the j-th, or -1 (at[1]: what is left of j)
        if at[2] == warp and hit and rank - 1 == at[1]:
            state[STATE_TOKEN] = i
        if at[2] >= 0:
            return  # block-uniform
        cuda.syncthreads()  # wc and at are read before the next round rewrites them


def mb_scratch() -> tuple:
    """The multi-block walk's device arrays: part, fst, ist, hist_n, hist_m, ties_n, count."""
    g = MB_BLOCKS
    return (
        cuda.device_array(2 * g, np.float32),
        cuda.device_array(4, np.float32),
        cuda.device_array(4, np.int32),
        cuda.device_array(g * MB_BINS, np.int32),
        cuda.device_array(g * MB_BINS, np.float32),
        cuda.to_device(np.zeros(g, np.int32)),
        cuda.to_device(np.zeros(1, np.int32)),
    )


def mb_sample(logits: object, state: object, coins: object, temperature: float, *, stream: object,
              scratch: tuple) -> None:  # fmt: skip
    """state[STATE_TOKEN] = the token sample_ref picks at temperature alone for coins[state[
    STATE_POS]]: six launches of MB_BLOCKS blocks."""
    part, fst, ist, hist_n, hist_m, ties_n, count = scratch
    inv_t = np.float32(1.0 / temperature)
    grid = (MB_BLOCKS, MB_THREADS, stream)
    mb_stats[grid](logits, coins, state, inv_t, part, fst, ist, count)
    for shift in (24, 16, 8, 0):
        mb_pass[grid](logits, inv_t, np.int32(shift), fst, ist, hist_n, hist_m, count)
    mb_pick[grid](logits, inv_t, fst, ist, state, ties_n, count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="check only, over a small vocabulary (simulator)")
    args = ap.parse_args()
    tiny = args.tiny or numba_config.ENABLE_CUDASIM
    vocab = TINY_VOCAB if tiny else VOCAB
    threads = {"threads": 64} if tiny else {}  # the simulator runs a Python thread per thread
    stream = cuda.stream()
    coins_host = np.array(COINS, np.float32)
    coins = cuda.to_device(coins_host)
    scratch = cuda.device_array((2, 2) if tiny else argmax_scratch_shape(), np.int32)
    versions = []  # (name, launch(state), the reference's tokens for COINS)
    mbs = mb_scratch()

    def mb_launch(d_logits: object, temperature: float) -> object:
        return lambda st: mb_sample(d_logits, st, coins, temperature, stream=stream, scratch=mbs)

    normal = logits_of("normal", vocab)
    greedy = [sample_ref(normal, 0.0)] * len(COINS)
    d_normal = cuda.to_device(normal)
    versions.append(
        (
            "argmax, two passes",
            lambda st: argmax(d_normal, st, stream=stream, scratch=scratch, **threads),
            greedy,
        )
    )
    versions.append(("argmax, one block", lambda st: argmax(d_normal, st, stream=stream, **threads), greedy))
    for kind in ("normal", "peaked"):
        host = logits_of(kind, vocab)
        d_logits = cuda.to_device(host)
        for s in SETTINGS:
            want = [sample_ref(host, s.temperature, s.top_k, s.top_p, s.min_p, float(c)) for c in coins_host]
            name = f"sample {kind} T={s.temperature} top_k={s.top_k} top_p={s.top_p} min_p={s.min_p}"
            launch = lambda st, d=d_logits, s=s: sample(d, st, coins, s, stream=stream, **threads)  # noqa: E731
            versions.append((name, launch, want))
            if s.top_k == 0 and s.top_p == 1.0 and s.min_p == 0.0:  # temperature alone
                versions.append(
                    (f"multi-block {kind} T={s.temperature}", mb_launch(d_logits, s.temperature), want)
                )
    ties = np.round(logits_of("normal", vocab)).astype(np.float32)  # many equal logits: the id walk
    d_ties = cuda.to_device(ties)
    want = [sample_ref(ties, 1.0, 0, 1.0, 0.0, float(c)) for c in coins_host]
    plain = SamplingParams(1.0, 0, 1.0, 0.0)
    versions.append(
        ("sample ties T=1.0", lambda st: sample(d_ties, st, coins, plain, stream=stream, **threads), want)
    )
    versions.append(("multi-block ties T=1.0", mb_launch(d_ties, 1.0), want))
    failed = []
    for name, launch, want in versions:
        got = []
        for pos in range(len(COINS)):
            state = cuda.to_device(np.array([0, pos, 0], np.int32))
            launch(state)
            stream.synchronize()
            got.append(int(state.copy_to_host()[0]))
        ok = got == want
        if not ok:
            failed.append(f"{name}: tokens {got}, the reference's {want}")
        if tiny:
            print(f"{name}: tokens {got} ({'ok' if ok else 'WRONG'})", flush=True)
            continue
        from gpubench import graph_seconds

        t = graph_seconds(stream, lambda f=launch, st=state: [f(st) for _ in range(REPS)], RUNS) / REPS
        print(f"{name} over {vocab} logits: {t * 1e6:.1f} us (picks {'ok' if ok else 'WRONG'})", flush=True)
    if failed:
        sys.exit("picks off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
