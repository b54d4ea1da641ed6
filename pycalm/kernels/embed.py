"""Embedding lookup: x = decode(tok_embeddings[token]); the reference is pycalm.reference.embed_ref.

GPU: `embed_kernel_<dtype>` reads the token id from state[STATE_TOKEN] on the device (so the
captured graph stays valid), and each thread decodes one stored element of the row: an fp16,
an e5m2 byte, or a gf4 word of 8 weights. One row is read (dim * bytes per weight) and dim fp32
written: negligible next to the matrices, so the kernel is kept plain.
"""

from __future__ import annotations

from numba import cuda, float32, int32

from pycalm.errors import PycalmError
from pycalm.kernels.common import STATE_TOKEN, dependent_start, fp8_decode, gf4_decode

THREADS = 256


@cuda.jit(cache=True)
def embed_kernel_fp16(table, state, x):  # noqa: ANN001, ANN201
    """table (vocab, dim) float16 -> x (dim,) float32; thread i: element i."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = float32(table[state[STATE_TOKEN], i])


@cuda.jit(cache=True)
def embed_kernel_fp8(table, state, x):  # noqa: ANN001, ANN201
    """table (vocab, dim) uint8 e5m2 -> x (dim,) float32; thread i: element i."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = fp8_decode(int32(table[state[STATE_TOKEN], i]))


@cuda.jit(cache=True)
def embed_kernel_gf4(table, state, x):  # noqa: ANN001, ANN201
    """table (vocab, dim/8) uint32 gf4 -> x (dim,) float32; thread i: group i (8 elements)."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    i = cuda.grid(1)
    if i < table.shape[1]:
        w = int32(table[state[STATE_TOKEN], i])  # the same bits, read as int32 for common's decoders
        for k in range(8):
            x[i * 8 + k] = gf4_decode(w, k)


_KERNELS = {"fp16": embed_kernel_fp16, "fp8": embed_kernel_fp8, "gf4": embed_kernel_gf4}


def embed(table: object, state: object, x: object, dtype: str, *, stream: object) -> None:
    """x (dim,) float32 = decode(table[state[STATE_TOKEN]]); table (vocab_size, dim) as stored
    by pycalm.formats (gf4: (vocab_size, dim / 8) uint32)."""
    if dtype not in _KERNELS:
        raise PycalmError(f"unsupported embedding dtype {dtype!r} (one of {', '.join(_KERNELS)})")
    n = table.shape[1]  # stored elements a row: gf4 has one word per 8 weights
    _KERNELS[dtype][(n + THREADS - 1) // THREADS, THREADS, stream](table, state, x)


COMPILE_CHECK = [
    (embed_kernel_fp16, "void(float16[:, ::1], int32[::1], float32[::1])"),
    (embed_kernel_fp8, "void(uint8[:, ::1], int32[::1], float32[::1])"),
    (embed_kernel_gf4, "void(uint32[:, ::1], int32[::1], float32[::1])"),
]
