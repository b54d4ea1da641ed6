"""Greedy decoding: state[STATE_TOKEN] = argmax(logits), the lowest id among equal maxima.

Reference: pycalm.cpu.reference.sample_ref at temperature 0 (np.argmax: the first maximum).

Thread mapping: one block. Thread i scans logits i, i + threads, ... in increasing order and
keeps the first largest (a strict >); the threads' bests go to shared memory, and thread 0 picks
the best of them (largest value, then lowest id) and writes it into the state, where the next
token step's embedding reads it.

Bytes moved: vocab_size x 4 read, one id written. One block on one SM is latency-bound; the
fast argmax (pycalm.kernels.argmax) spreads the logits over 128 blocks and reduces by shuffles.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32

from pycalm.kernels.common import STATE_TOKEN

MAX_THREADS = 1024


@cuda.jit(cache=True)
def argmax_kernel(logits, state):  # noqa: ANN001, ANN201
    best_v = cuda.shared.array(MAX_THREADS, float32)  # each thread's best value ...
    best_i = cuda.shared.array(MAX_THREADS, int32)  # ... and its id
    tid, n = cuda.threadIdx.x, logits.shape[0]
    v, i = float32(-math.inf), int32(n)  # n: none yet
    for j in range(tid, n, cuda.blockDim.x):
        if logits[j] > v:
            v, i = logits[j], int32(j)
    best_v[tid], best_i[tid] = v, i
    cuda.syncthreads()  # every thread's best is in shared memory
    if tid == 0:
        for k in range(1, cuda.blockDim.x):
            if best_v[k] > v or (best_v[k] == v and best_i[k] < i):
                v, i = best_v[k], best_i[k]
        state[STATE_TOKEN] = i if i < n else 0  # all -inf or NaN: token 0


def argmax(logits: object, state: object, *, stream: object) -> None:
    """state[STATE_TOKEN] = argmax of logits (vocab_size,) float32. Threads: the vocabulary
    rounded up to a warp, at most MAX_THREADS."""
    threads = min(MAX_THREADS, 32 * -(-logits.shape[0] // 32))
    argmax_kernel[1, threads, stream](logits, state)
