"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w.

Reference: pycalm.cpu.reference.rmsnorm_ref. On the GPU the norm is fused into the matvec that
consumes it where possible. The standalone `rmsnorm_kernel` (final norm, tests, debugging) is
one block of 1024 threads: a grid-stride sum of squares, a block reduction, then each thread
scales its elements. Bytes: x and w read, y written (3 * dim * 4).
"""

from __future__ import annotations

import math

from numba import cuda, float32

from pycalm.kernels.common import block_reduce_sum, dependent_start

THREADS = 1024


@cuda.jit(cache=True)
def rmsnorm_kernel(x, w, eps, out):  # noqa: ANN001, ANN201
    """One block: out = x * rsqrt(mean(x^2) + eps) * w."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    scratch = cuda.shared.array(32, float32)
    n = x.shape[0]
    ss = float32(0.0)
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        ss += x[i] * x[i]
    ss = block_reduce_sum(ss, scratch)  # every thread gets the total (the call has barriers)
    r = float32(1.0) / math.sqrt(ss / float32(n) + eps)
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        out[i] = x[i] * r * w[i]


def rmsnorm(x: object, w: object, eps: float, out: object, *, stream: object, threads: int = THREADS) -> None:
    """out (dim,) = rmsnorm(x (dim,), w (dim,)); out may be x.

    threads: a multiple of 32 up to 1024 (tests use fewer: the simulator runs a thread per thread).
    """
    rmsnorm_kernel[1, threads, stream](x, w, float32(eps), out)
