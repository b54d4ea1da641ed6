"""Elementwise ops between the matrix products: the residual add and the SiLU gate.

    residual_add  x += y                       reference: matvec_residual_ref (residual + W x)
    silu_gate     out = silu(a) * b            reference: ffn_gate_ref (silu(W1 x) * (W3 x)),
                  silu(a) = a / (1 + exp(-a))  silu_ref; matmul_gate_ref for the prompt's rows

Thread mapping: grid (ceil(n / THREADS), T), thread i of row t takes element (t, i). `out` of
the gate is float32 (the token step) or float16 (the prompt's rows: w2's matmul reads it).

Bytes moved: residual 3 x T x dim x 4 (x and y read, x written); gate 2 x T x hidden_dim x 4
read, T x hidden_dim written. The fast kernels fuse both into the matrix products around them
(pycalm.kernels.matvec: RESIDUAL, GATE), which saves these bytes and two launches a layer.
"""

from __future__ import annotations

import math

from numba import cuda, float32

THREADS = 256


@cuda.jit(cache=True)
def residual_add_kernel(x, y):  # noqa: ANN001, ANN201
    i = cuda.grid(1)
    t = cuda.blockIdx.y
    if i < x.shape[1]:
        x[t, i] += y[t, i]


@cuda.jit(cache=True)
def silu_gate_kernel(a, b, out):  # noqa: ANN001, ANN201
    i = cuda.grid(1)
    t = cuda.blockIdx.y
    if i < a.shape[1]:
        v = a[t, i]
        out[t, i] = v / (float32(1.0) + math.exp(-v)) * b[t, i]


def _grid(rows: object) -> tuple[tuple[int, int], int]:
    """(blocks, threads) for (T, n) rows: a thread an element, THREADS at most a block."""
    threads = min(THREADS, 32 * -(-rows.shape[1] // 32))
    return (-(-rows.shape[1] // threads), rows.shape[0]), threads


def residual_add(x: object, y: object, *, stream: object) -> None:
    """x (T, dim) float32 += y (T, dim) float32."""
    blocks, threads = _grid(x)
    residual_add_kernel[blocks, threads, stream](x, y)


def silu_gate(a: object, b: object, out: object, *, stream: object) -> None:
    """out (T, n) float32 or float16 = silu(a) * b; a, b (T, n) float32."""
    blocks, threads = _grid(a)
    silu_gate_kernel[blocks, threads, stream](a, b, out)
