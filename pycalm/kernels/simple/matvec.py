"""Matrix-vector product y = W x: a warp a row.

Reference: pycalm.cpu.reference.matvec_ref on the decoded weights (formats.decode(w) @ x, what
the CPU engine computes; the fast q8 / q4 kernels multiply x rounded to 16-bit integers
instead, matvec_ref with their dtype).

Thread mapping: warp r of the grid computes row r. Lane l takes columns l, l + 32, l + 64, ...:
decode(W[r, c]) * x[c] summed in a register, so the 32 lanes read 32 neighbouring weights at a
time (coalesced). Then the 32 partial sums are added by xor shuffles (warp_reduce_sum) and lane
0 writes y[r]. A block holds WARPS warps (rows).

Bytes moved: the weights once (rows x cols x bytes a weight), x once a row (from L1 / L2 after
the first), y written. The fast matvec (pycalm.kernels.matvec) is the same sum with 16-byte
loads, x staged in shared memory, a whole word decoded at once and several rows a warp.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from pycalm.kernels.common import WARP, warp_reduce_sum
from pycalm.kernels.simple.decode import DECODE, arrays

WARPS = 4  # rows a block


@functools.cache
def matvec_kernel(dtype: str) -> object:
    """The kernel for one weight format (each format compiles its own)."""
    decode = DECODE[dtype]

    @cuda.jit(cache=True)
    def matvec_kernel(w, scales, x, y):  # noqa: ANN001, ANN202
        row = cuda.grid(1) // WARP
        lane = cuda.threadIdx.x % WARP
        if row >= y.shape[0]:
            return  # the whole warp leaves: no lane is left waiting in a shuffle
        acc = float32(0.0)
        for c in range(lane, x.shape[0], WARP):
            acc += decode(w, scales, row, c) * x[c]
        acc = warp_reduce_sum(acc)  # shuffles: every lane gets the row's sum
        if lane == 0:
            y[row] = acc

    return matvec_kernel


def matvec(w: object, x: object, y: object, dtype: str, *, stream: object) -> None:
    """y (rows,) float32 = W x; w stored (rows, cols) in `dtype` (q8 / q4: a formats.Quantized),
    x (cols,) float32."""
    codes, scales = arrays(w, dtype)
    blocks = -(-y.shape[0] // WARPS)
    matvec_kernel(dtype)[blocks, WARPS * WARP, stream](codes, scales, x, y)
