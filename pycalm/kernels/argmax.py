"""Greedy decoding on the GPU: state[STATE_TOKEN] = argmax(logits), the lowest id on ties.

The reference is pycalm.cpu.reference.sample_ref at temperature 0 (numpy's argmax: the first
maximum). With scratch (what the engine launches): pass 1, ARGMAX_BLOCKS blocks each take a
grid-stride share of the logits and write their best (value, id) pair to scratch; pass 2, one
block picks the best pair (largest value, then lowest id). One block alone (the fallback
without scratch) issues a thread's loads BATCH at a time (load_batch: one L2 round trip a batch,
not one a logit), and is still bound by those round trips; the two passes spread the loads over
the SMs. block_argmax, the one-block pass as a device function, is also the greedy row of
pycalm.kernels.sample.sample_rows_kernel (a block a row), whose passes take load_batch too.

Bytes moved: vocab_size * 4 (the logits), the blocks' pairs written and read, the token.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32

from pycalm.kernels.common import STATE_TOKEN, as_f32, as_i32, dependent_start

THREADS = 1024  # the one-block argmax, and at most the final pass
ARGMAX_BLOCKS = 128  # pass-1 blocks: ~1 per SM, each ~1000 logits with 512 threads
ARGMAX_THREADS = 512
BATCH = 8  # logits a thread loads at once where one block walks a row (one L2 round trip a batch)


@cuda.jit(device=True, inline=True)
def load_batch(logits, i0, step, xs):  # noqa: ANN001, ANN202
    """xs[u] = logits[i0 + u * step] for u < BATCH (past the end: the last logit, which the
    caller skips): a thread's BATCH loads issued together, so a walk over the row costs one L2
    round trip per BATCH elements of a thread instead of one per element (the loops that use them
    compare or hold atomics, past which the compiler does not move the next element's load)."""
    last = logits.shape[0] - 1
    for u in range(BATCH):
        xs[u] = logits[min(i0 + u * step, last)]


@cuda.jit(device=True, inline=True)
def _warp_best(best_v, best_i):  # noqa: ANN001, ANN202
    """Warp butterfly on (value, id) pairs: every lane ends with the warp's largest value and,
    among equal values, the lowest id. All 32 lanes must call it."""
    off = 16
    while off > 0:
        other_v = cuda.shfl_xor_sync(0xFFFFFFFF, best_v, off)
        other_i = cuda.shfl_xor_sync(0xFFFFFFFF, best_i, off)
        if other_v > best_v or (other_v == best_v and other_i < best_i):
            best_v = other_v
            best_i = other_i
        off //= 2
    return best_v, best_i


@cuda.jit(device=True, inline=True)
def _block_best(best_v, best_i, warp_v, warp_i, n):  # noqa: ANN001, ANN202
    """The block's best (value, id) pair, valid in warp 0 (every thread must call: a barrier).
    warp_v / warp_i: float32 / int32 shared arrays of 32; n: the id that means "none"."""
    best_v, best_i = _warp_best(best_v, best_i)
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    if lane == 0:
        warp_v[warp] = best_v
        warp_i[warp] = best_i
    cuda.syncthreads()  # every warp's best is in warp_v / warp_i
    if warp == 0:
        n_warps = cuda.blockDim.x // 32
        best_v = warp_v[lane] if lane < n_warps else float32(-math.inf)
        best_i = warp_i[lane] if lane < n_warps else int32(n)
        best_v, best_i = _warp_best(best_v, best_i)
    return best_v, best_i


@cuda.jit(device=True, inline=True)
def block_argmax(logits, warp_v, warp_i):  # noqa: ANN001, ANN202
    """All threads of one block: argmax(logits (n,)), the lowest id among equal maxima (0 if
    nothing is above -inf, or all NaN), valid in warp 0. warp_v / warp_i: float32 / int32
    shared arrays of 32. Also the greedy rows of pycalm.kernels.sample.sample_rows_kernel."""
    n = logits.shape[0]
    step = cuda.blockDim.x
    xs = cuda.local.array(BATCH, float32)  # a batch of this thread's logits
    best_v = float32(-math.inf)
    best_i = int32(n)
    for i0 in range(cuda.threadIdx.x, n, step * BATCH):
        load_batch(logits, i0, step, xs)
        for u in range(BATCH):  # ascending ids: strict > keeps the first
            i = i0 + u * step
            if i < n and xs[u] > best_v:
                best_v = xs[u]
                best_i = int32(i)
    best_v, best_i = _block_best(best_v, best_i, warp_v, warp_i, n)
    return best_i if best_i < n else int32(0)  # all -inf / NaN: token 0


@cuda.jit(cache=True)
def argmax_kernel(logits, state):  # noqa: ANN001, ANN201
    """One block (the fallback without scratch). state[STATE_TOKEN] <- argmax(logits), the
    lowest id among equal maxima."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    warp_v = cuda.shared.array(32, float32)
    warp_i = cuda.shared.array(32, int32)
    token = block_argmax(logits, warp_v, warp_i)
    if cuda.threadIdx.x == 0:
        state[STATE_TOKEN] = token


@cuda.jit(cache=True)
def argmax_part_kernel(logits, scratch):  # noqa: ANN001, ANN201
    """Pass 1 of the many-block argmax: block b -> scratch[0, b] (its best value's bits) and
    scratch[1, b] (its id). Threads take elements grid-stride: ascending ids per thread."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    warp_v = cuda.shared.array(32, float32)
    warp_i = cuda.shared.array(32, int32)
    n = logits.shape[0]
    best_v = float32(-math.inf)
    best_i = int32(n)
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        v = logits[i]
        if v > best_v:
            best_v = v
            best_i = int32(i)
    best_v, best_i = _block_best(best_v, best_i, warp_v, warp_i, n)
    if cuda.threadIdx.x == 0:
        scratch[0, cuda.blockIdx.x] = as_i32(best_v)
        scratch[1, cuda.blockIdx.x] = best_i


@cuda.jit(cache=True)
def argmax_final_kernel(scratch, state, n):  # noqa: ANN001, ANN201
    """Pass 2: one block over the blocks' pairs -> state[STATE_TOKEN]."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    warp_v = cuda.shared.array(32, float32)
    warp_i = cuda.shared.array(32, int32)
    best_v = float32(-math.inf)
    best_i = int32(n)
    for b in range(cuda.threadIdx.x, scratch.shape[1], cuda.blockDim.x):
        v = as_f32(scratch[0, b])
        i = scratch[1, b]
        if v > best_v or (v == best_v and i < best_i):
            best_v = v
            best_i = i
    best_v, best_i = _block_best(best_v, best_i, warp_v, warp_i, n)
    if cuda.threadIdx.x == 0:
        state[STATE_TOKEN] = best_i if best_i < n else int32(0)  # all -inf / NaN: token 0


def argmax_scratch_shape() -> tuple[int, int]:
    """Shape of the int32 device scratch for the many-block argmax (no initial contents needed):
    (2, ARGMAX_BLOCKS), one (value bits, id) pair per pass-1 block."""
    return 2, ARGMAX_BLOCKS


def argmax(
    logits: object, state: object, *, stream: object, threads: int = THREADS, scratch: object = None
) -> None:
    """state[STATE_TOKEN] = argmax(logits (vocab_size,) float32), lowest id on ties.

    scratch: int32 device array of argmax_scratch_shape() (or (2, B) for B pass-1 blocks): two
    kernels, B blocks of ARGMAX_THREADS then one block. Without it, one block of `threads`
    threads does everything. threads: a multiple of 32 up to 1024 (tests use fewer under the
    simulator).
    """
    n = logits.shape[0]
    if scratch is None:
        argmax_kernel[1, threads, stream](logits, state)
        return
    blocks = scratch.shape[1]
    argmax_part_kernel[blocks, min(threads, ARGMAX_THREADS), stream](logits, scratch)
    argmax_final_kernel[1, min(1024, 32 * -(-blocks // 32)), stream](scratch, state, int32(n))
