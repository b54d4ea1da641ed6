"""Embedding lookup: x[t] = decode(tok_embeddings[tokens[t]]), a thread a column.

Reference: pycalm.cpu.reference.embed_ref (one token), embed_rows_ref (T tokens).

Thread mapping: grid (ceil(dim / threads), T); thread c of row t decodes weight (tokens[t], c)
of the table (pycalm.kernels.simple.decode) into x[t, c]. The token step passes its one token
as a view of the device state (state[STATE_TOKEN:STATE_TOKEN + 1]), so a captured step reads
whatever token the state holds when it is replayed.

Bytes moved: T table rows read (dim x bytes a weight each), T x dim float32 written.
"""

from __future__ import annotations

import functools

from numba import cuda

from pycalm.kernels.simple.decode import DECODE, arrays

THREADS = 128


@functools.cache
def embed_kernel(dtype: str) -> object:
    """The kernel for one table format."""
    decode = DECODE[dtype]

    @cuda.jit(cache=True)
    def embed_kernel(table, scales, tokens, x):  # noqa: ANN001, ANN202
        c = cuda.grid(1)
        t = cuda.blockIdx.y
        if c < x.shape[1]:
            x[t, c] = decode(table, scales, tokens[t], c)

    return embed_kernel


def embed(table: object, tokens: object, x: object, dtype: str, *, stream: object) -> None:
    """x (T, dim) float32 = the rows tokens (T,) int32 of table, stored (vocab_size, dim) in
    `dtype` (q8 / q4: a formats.Quantized)."""
    codes, scales = arrays(table, dtype)
    threads = min(THREADS, 32 * -(-x.shape[1] // 32))
    embed_kernel(dtype)[(-(-x.shape[1] // threads), x.shape[0]), threads, stream](codes, scales, tokens, x)
