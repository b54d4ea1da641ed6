"""Embedding lookup: x = decode(tok_embeddings[token]); the reference is pycalm.cpu.reference.embed_ref.

decode_unit_<dtype> decodes one stored unit of a table row: an fp16, an e5m2 byte or a q8 code
(one weight; q8 times its row's scale), or a gf4 / q4 word (8 weights; q4: d q + m with its
group's step and offset). The token step's embed_kernel (here) and the prefill's
embed_rows_kernel (pycalm.kernels.rows) are both a thread a unit around the same function, so a
format is decoded in one place, exactly as pycalm.model.formats does it.

GPU: the token step's kernel reads the token id from state[STATE_TOKEN] on the device (so the
captured graph stays valid). Every kernel takes (table, scales, ...): q8 / q4 tables are the
Quantized pair's two arrays, the other formats pass the table twice (the second unread). One row
is read (dim * bytes per weight) and dim fp32 written: negligible next to the matrices, so the
kernel is kept plain.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int32

from pycalm.errors import PycalmError
from pycalm.kernels.common import STATE_TOKEN, dependent_start, fp8_decode, gf4_decode, q4_code
from pycalm.model.formats import QUANTIZED

THREADS = 256


@cuda.jit(device=True, inline=True)
def decode_unit_fp16(table, scales, r, i, out):  # noqa: ANN001, ANN201
    """out[i] = table[r, i], float16 (scales unread)."""
    out[i] = float32(table[r, i])


@cuda.jit(device=True, inline=True)
def decode_unit_fp8(table, scales, r, i, out):  # noqa: ANN001, ANN201
    """out[i] = the e5m2 byte table[r, i] (scales unread)."""
    out[i] = fp8_decode(int32(table[r, i]))


@cuda.jit(device=True, inline=True)
def decode_unit_gf4(table, scales, r, i, out):  # noqa: ANN001, ANN201
    """out[8i .. 8i + 7] = the gf4 word table[r, i] (scales unread)."""
    w = int32(table[r, i])  # the same bits, read as int32 for common's decoders
    for k in range(8):
        out[i * 8 + k] = gf4_decode(w, k)


@cuda.jit(device=True, inline=True)
def decode_unit_q8(table, scales, r, i, out):  # noqa: ANN001, ANN201
    """out[i] = scales[r] * the int8 code table[r, i] (a float32 product, as formats.q8_decode)."""
    out[i] = scales[r] * float32(table[r, i])


@cuda.jit(device=True, inline=True)
def decode_unit_q4(table, scales, r, i, out):  # noqa: ANN001, ANN201
    """out[8i .. 8i + 7] = d q_k + m of the q4 word table[r, i], (d, m) = scales[r, g] of its
    group g = 8i // G, G = 8 table.shape[1] // scales.shape[1] (as formats.q4_decode)."""
    w = int32(table[r, i])
    g = i // (table.shape[1] // scales.shape[1])  # words a group: G / 8
    d, m = float32(scales[r, g, 0]), float32(scales[r, g, 1])
    for k in range(8):
        out[i * 8 + k] = d * q4_code(w, k) + m


DECODE_UNIT = {
    "fp16": decode_unit_fp16,
    "fp8": decode_unit_fp8,
    "gf4": decode_unit_gf4,
    "q8": decode_unit_q8,
    "q4": decode_unit_q4,
}


def table_arrays(table: object, dtype: str) -> tuple[object, object]:
    """(codes, scales) of a stored table for the kernels' (table, scales) arguments: a q8 / q4
    table's two arrays, any other table twice (its scales unread)."""
    if dtype not in DECODE_UNIT:
        raise PycalmError(f"unsupported embedding dtype {dtype!r} (one of {', '.join(DECODE_UNIT)})")
    if dtype in QUANTIZED:
        return table.codes, table.scales
    return table, table


@functools.cache
def make_embed_kernel(dtype: str) -> object:
    """embed_kernel for a table dtype (one compile each)."""
    decode_unit = DECODE_UNIT[dtype]

    @cuda.jit(cache=True)
    def embed_kernel(table, scales, state, x):  # noqa: ANN001, ANN202
        """x (dim,) float32 = decode(table[state[STATE_TOKEN]]); thread i: unit i of the row."""
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        i = cuda.grid(1)
        if i < table.shape[1]:
            decode_unit(table, scales, state[STATE_TOKEN], i, x)

    return embed_kernel


def embed(table: object, state: object, x: object, dtype: str, *, stream: object) -> None:
    """x (dim,) float32 = decode(table[state[STATE_TOKEN]]); table (vocab_size, dim) as stored
    by pycalm.model.formats (gf4: (vocab_size, dim / 8) uint32; q8 / q4: a Quantized pair)."""
    codes, scales = table_arrays(table, dtype)
    n = codes.shape[1]  # stored units a row: gf4 and q4 have one word per 8 weights
    make_embed_kernel(dtype)[(n + THREADS - 1) // THREADS, THREADS, stream](codes, scales, state, x)
