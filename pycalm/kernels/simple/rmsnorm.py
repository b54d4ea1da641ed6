"""RMSNorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, a block a row.

Reference: pycalm.cpu.reference.rmsnorm_ref (one row), rmsnorm_rows_ref (T rows, fp16 out).

Thread mapping: block t takes row t. Each thread sums the squares of its columns (i, i +
threads, ...), the block adds the threads' sums (block_reduce_sum: warp shuffles, then the warps
through shared memory; every thread gets the total), and each thread scales its columns.
`out` is float32 (the token step) or float16 (the prompt's rows, which a tensor-core matmul
reads): the store converts.

Bytes moved: x read twice (the second time from L1), w read, out written.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from pycalm.kernels.common import WARP, block_reduce_sum


@cuda.jit(cache=True)
def rmsnorm_kernel(x, w, eps, out):  # noqa: ANN001, ANN201
    t = cuda.blockIdx.x
    scratch = cuda.shared.array(WARP, float32)  # block_reduce_sum's: a sum a warp
    dim = x.shape[1]
    ss = float32(0.0)
    for i in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
        ss += x[t, i] * x[t, i]
    ss = block_reduce_sum(ss, scratch)  # (barriers inside)
    r = float32(1.0) / math.sqrt(ss / float32(dim) + eps)
    for i in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
        out[t, i] = x[t, i] * r * w[i]


def rmsnorm(x: object, w: object, eps: float, out: object, *, stream: object) -> None:
    """out (T, dim) float32 or float16 = rmsnorm of each row of x (T, dim) float32, times w
    (dim,) float32. Threads: the row's length rounded up to a warp, at most 256."""
    threads = min(256, WARP * -(-x.shape[1] // WARP))
    rmsnorm_kernel[x.shape[0], threads, stream](x, w, float32(eps), out)
