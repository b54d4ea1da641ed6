"""Matrix product of T rows Y = X W^T on the tensor cores: a warp a 16 x 8 tile of Y, one mma.

Reference: pycalm.cpu.reference.matmul_ref. X (T, K) float16 (the prompt's activations), W the
stored (N, K) weights (pycalm.kernels.simple.decode), Y (T, N) float32.

Thread mapping: block (i, j), one warp, computes Y[16 i .. 16 i + 15, 8 j .. 8 j + 7]. For each
16 columns k0 of K it calls mma_16816 (pycalm.kernels.tensorcore: mma.sync m16n8k16, D = A B +
C with A 16 x 16 and B 16 x 8 in fp16, C and D in float32): the warp's 32 lanes hand in the
pieces of A, B and C the instruction's fragment layout gives them and get their 4 elements of D
back. With g = lane / 4 and t = lane % 4 (tensorcore's docstring draws it):

    A: rows g and g + 8 of X's tile, columns 2t, 2t + 1 and 2t + 8, 2t + 9 of the k-slice
    B: row g of W's tile (column g of B = W^T), the same columns
    C, D: rows g and g + 8 of Y's tile, columns 2t and 2t + 1

Every element is read with a bounds check (zero outside), so T, N and K can be anything. Each
weight is decoded to float32 and rounded to fp16 (pack_f16x2), the tensor cores' input, as the
fast matmul does: exact for fp16, fp8 and gf4; a q4 weight d q + m is rounded once (2**-11
relative); a q8 weight enters as its code (exact) and Y's column n, a sum over W's row n, is
multiplied by that row's scale at the end (decode.MMA_OPERAND, ROW_SCALE).

Bytes moved: W once a 16-row tile of X (ceil(T / 16) times, mostly from L2), X once an 8-column
tile of W, Y written. The fast matmul (pycalm.kernels.matmul) stages 128 x 128 tiles in shared
memory and gives each warp 16 mma a k-slice, each fragment loaded once for four of them.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from pycalm.kernels.simple.decode import MMA_OPERAND, ROW_SCALE, arrays
from pycalm.kernels.tensorcore import mma_16816, pack_f16x2


@cuda.jit(device=True, inline=True)
def x_pair(x, r, k):  # noqa: ANN001, ANN201
    """X[r, k] and X[r, k + 1] as one word of two fp16 (zero outside X)."""
    a = float32(x[r, k]) if r < x.shape[0] and k < x.shape[1] else float32(0.0)
    b = float32(x[r, k + 1]) if r < x.shape[0] and k + 1 < x.shape[1] else float32(0.0)
    return pack_f16x2(a, b)


@cuda.jit(device=True, inline=True)
def y_pair(y, r, c, v0, v1):  # noqa: ANN001, ANN201
    """Y[r, c], Y[r, c + 1] = v0, v1 (where they are inside Y)."""
    if r < y.shape[0] and c < y.shape[1]:
        y[r, c] = v0
    if r < y.shape[0] and c + 1 < y.shape[1]:
        y[r, c + 1] = v1


@functools.cache
def matmul_kernel(dtype: str) -> object:
    """The kernel for one weight format."""
    decode, row_scale = MMA_OPERAND[dtype], ROW_SCALE[dtype]

    @cuda.jit(device=True, inline=True)
    def w_pair(w, scales, n, k, n_rows, K):  # noqa: ANN001, ANN202
        """W[n, k] and W[n, k + 1] (q8: their codes), as one word of two fp16 (zero outside W)."""
        a = decode(w, scales, n, k) if n < n_rows and k < K else float32(0.0)
        b = decode(w, scales, n, k + 1) if n < n_rows and k + 1 < K else float32(0.0)
        return pack_f16x2(a, b)

    @cuda.jit(cache=True)
    def matmul_kernel(x, w, scales, y):  # noqa: ANN001, ANN202
        g, t = cuda.threadIdx.x // 4, cuda.threadIdx.x % 4
        r, n = 16 * cuda.blockIdx.x + g, 8 * cuda.blockIdx.y + g  # this lane's row of X, of W
        K, N = x.shape[1], y.shape[1]
        c0 = c1 = c2 = c3 = float32(0.0)
        for k0 in range(0, K, 16):
            k = k0 + 2 * t
            a0, a1 = x_pair(x, r, k), x_pair(x, r + 8, k)
            a2, a3 = x_pair(x, r, k + 8), x_pair(x, r + 8, k + 8)
            b0, b1 = w_pair(w, scales, n, k, N, K), w_pair(w, scales, n, k + 8, N, K)
            c0, c1, c2, c3 = mma_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)  # the whole warp
        col = 8 * cuda.blockIdx.y + 2 * t  # this lane's columns of Y: col, col + 1
        s0, s1 = row_scale(scales, col), row_scale(scales, col + 1)  # q8: W's row scales
        y_pair(y, r, col, c0 * s0, c1 * s1)
        y_pair(y, r + 8, col, c2 * s0, c3 * s1)

    return matmul_kernel


def matmul(x: object, w: object, y: object, dtype: str, *, stream: object) -> None:
    """y (T, N) float32 = x (T, K) float16 times W^T, w stored (N, K) in `dtype` (q8 / q4: a
    formats.Quantized)."""
    codes, scales = arrays(w, dtype)
    grid = (-(-x.shape[0] // 16), -(-y.shape[1] // 8))
    matmul_kernel(dtype)[grid, 32, stream](x, codes, scales, y)
