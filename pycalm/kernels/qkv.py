"""QKV projection fused with the RMSNorm, the bias, RoPE and the KV-cache write.

  xn = rmsnorm(x) * attn_norm
  qkv = Wqkv xn (+ bqkv)      rows: q (n_heads * head_dim), k, v (n_kv_heads * head_dim each)
  q, k rotated in interleaved pairs: for i < rotary_dim / 2, with a = pos * freqs[i],
      (x[2i], x[2i+1]) -> (x[2i] cos a - x[2i+1] sin a, x[2i] sin a + x[2i+1] cos a)
  k, v written to the caches at row pos; q goes to the attention step.
Reference: pycalm.cpu.reference.qkv_ref (with rmsnorm_ref and kv_round).

Thread mapping: the row groups of pycalm.kernels.matvec (one warp, ROWS consecutive rows of
Wqkv, the same device functions: row_group), x * attn_norm staged in shared memory once (dim <=
XCHUNK). head_dim is even, so the rows 2i, 2i + 1 of a group never straddle a head and are
exactly one rotary pair (i = (row % head_dim) / 2): the warp holds both values after its
reduction and rotates them with no barrier. Lane 0 writes q, or encodes k / v to the cache
dtype and writes them at row pos = state[STATE_POS]. The bias is a runtime flag (a missing bias
passes x as a dummy), so one kernel a weight format and KV dtype serves models with and without
q/k/v biases. Programmatic launches as in matvec: the first weight loads before
grid_dependency_wait, launch_dependents once a warp's last group's loads are issued.

Paged (pycalm.gpu.batched's one-row steps): the cache is a pool, and the row k and v go to is
that of position pos in the block table of the step's sequence (pycalm.kernels.attention.pool_row).

Bytes moved: Wqkv, x, attn_norm, the bias, q written (4 q_dim) and one cache row of k and v.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint8, uint64

from pycalm.errors import PycalmError
from pycalm.kernels.attention import pool_row
from pycalm.kernels.common import (
    STATE_POS,
    WARP,
    fp8_encode,
    fp16_encode,
    grid_dependency_wait,
    launch_dependents,
    sincos,
    warp_reduce_sum,
)
from pycalm.kernels.launch import row_group_launch
from pycalm.kernels.matvec import ROWS, UNROLL
from pycalm.kernels.rowgroup import (
    ROW_SCALE,
    XCHUNK,
    XPAIRS,
    codes_and_scales,
    load_bytes,
    row_group,
    staged_rms,
    word_view,
)

KV_STORAGE = {"fp16": "float16", "fp8": "uint8"}  # the caches' element types (numba names)


@functools.cache
def rope_store_pair(kv_dtype: str):  # noqa: ANN201
    """The device function that finishes one rotary pair of a qkv row for a KV-cache dtype
    ("fp16" or "fp8"), shared by qkv_rope_kernel (the token) and
    pycalm.kernels.rows.qkv_rows_kernel (T rows): store_pair(a, b, r0, bias, has_bias, freqs,
    pos, row, q, k_cache, v_cache, q_dim, kv_dim, head_dim) takes columns r0, r0 + 1 (values a,
    b; r0 even: one rotary pair) of the qkv row at position pos, adds the bias (when has_bias),
    rotates q and k pairs below the rotary dims, and writes q[r0], q[r0 + 1] (q: a (q_dim,)
    float32 row) or encodes k / v into the caches' row `row` (pos, or a paged pool's row)."""
    FP8_KV = kv_dtype == "fp8"

    @cuda.jit(device=True, inline=True)
    def store_pair(a, b, r0, bias, has_bias, freqs, pos, row, q, k_cache, v_cache, q_dim, kv_dim, head_dim):  # noqa: ANN001, ANN202
        """Rows r0, r0 + 1 (values a, b): bias, RoPE for q and k, then q or the caches."""
        if has_bias:
            a += bias[r0]
            b += bias[r0 + 1]
        i = (r0 % head_dim) // 2  # the rotary pair within the head
        if r0 < q_dim + kv_dim and i < freqs.shape[0]:
            sn, cs = sincos(float32(pos) * freqs[i])
            a, b = a * cs - b * sn, a * sn + b * cs
        if r0 < q_dim:
            q[r0] = a
            q[r0 + 1] = b
        else:
            if r0 < q_dim + kv_dim:
                c = r0 - q_dim
                cache = k_cache
            else:
                c = r0 - q_dim - kv_dim
                cache = v_cache
            if FP8_KV:
                cache[row, c] = uint8(fp8_encode(a))
                cache[row, c + 1] = uint8(fp8_encode(b))
            else:
                cache[row, c] = fp16_encode(a)
                cache[row, c + 1] = fp16_encode(b)

    return store_pair


@functools.cache
def qkv_rope_kernel(dtype: str, nbytes: int, kv_dtype: str, paged: bool = False):  # noqa: ANN201
    """The fused QKV kernel for a weight dtype, the bytes a load (16, or the narrow loads of
    pycalm.kernels.rowgroup.NARROW_BYTES) and the KV-cache dtype. Arguments: w (rows, units) word
    array, s its scales (q8 / q4, as pycalm.kernels.rowgroup.codes_and_scales makes them; other
    dtypes: any float32 array, never read), bias (rows,) float32 (read only when has_bias), x
    (dim,) float32 and x64 (x as uint64 pairs), norm_w (dim,) float32, eps float32, freqs
    (rotary_dim // 2,) float32, state int32, q (q_dim,) float32, k_cache, v_cache (seq_len,
    kv_dim), q_dim, kv_dim, head_dim, has_bias; seq_of_row (1,) int32, table (n_seqs, max_pages)
    int32 and page_log2: paged, k and v go to the pool row of position pos of sequence
    seq_of_row[0] (pycalm.kernels.attention.pool_row); else they are unread and the row is pos.
    Reference: pycalm.cpu.reference.qkv_ref."""
    unroll = UNROLL if nbytes == 16 else 1
    stage_x, load_first, group_dot, group_shift, XSUMS, SCALES, SCALE_T = row_group(
        dtype, nbytes, ROWS, unroll, 1
    )
    WORDS = max(1, nbytes // 8)
    STEP_WORDS = ROWS * unroll * WORDS
    SCALE = ROW_SCALE[dtype]
    store_pair = rope_store_pair(kv_dtype)

    @cuda.jit(device=True, inline=True)
    def group_rows(g, n_rows, row):  # noqa: ANN001, ANN202
        """row[r] = rows ROWS g + r of the group, clamped to the matrix (for the loads)."""
        for r in range(ROWS):
            row[r] = uint64(min(ROWS * g + r, n_rows - 1))

    @cuda.jit(cache=True)
    def qkv_rope_kernel(
        w, s, bias, x, x64, norm_w, eps, freqs, state, q, k_cache, v_cache, q_dim, kv_dim, head_dim, has_bias,
        seq_of_row, table, page_log2,
    ):  # noqa: ANN001, ANN202, E501  # fmt: skip
        xs = cuda.shared.array(XPAIRS, uint64)  # x (one chunk) as float pairs, transposed by load
        xsum = cuda.shared.array(XSUMS, float32)  # q4, q8: x's sums, one a load
        sc = cuda.local.array(SCALES, SCALE_T)  # q4: a step's group scales; q8: the rows' scales
        scratch = cuda.shared.array(WARP, float32)  # block reduction
        words = cuda.local.array(STEP_WORDS, uint64)  # a step's loads: registers
        acc = cuda.local.array(ROWS, float32)  # the rows' sums
        row = cuda.local.array(ROWS, uint64)  # the rows' indices in w
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        n_warps = cuda.blockDim.x // WARP
        n_rows = w.shape[0]
        cols = x.shape[0]
        nw = w.shape[1] // WORDS  # loads a row
        sh = group_shift(w, s)  # q4: log2(loads a group)
        n_groups = (n_rows + ROWS - 1) // ROWS
        stride = cuda.gridDim.x * n_warps
        g = cuda.blockIdx.x * n_warps + warp
        group_rows(min(g, n_groups - 1), n_rows, row)
        load_first(w, w, s, s, row, 0, nw, lane, words, sc, sh, sh)  # streams in while x is staged
        grid_dependency_wait()  # x and state come from earlier kernels: read them after they finish
        pos = state[STATE_POS]
        row_kv = pool_row(table, seq_of_row[0], pos, page_log2) if paged else pos  # k and v's cache row
        ss = stage_x(x64, norm_w, xs, xsum, 0, cols, 1)  # x * norm_w, and this thread's sum of x^2
        scale = float32(SCALE) * staged_rms(ss, cols, eps, scratch)  # its barrier publishes xs
        while g < n_groups:  # warp-uniform: the shuffles below see every lane
            group_dot(words, sc, w, w, s, s, row, xs, xsum, 0, nw, lane, sh, sh, acc)
            gn = g + stride
            if gn >= n_groups:  # this warp's last weights are in: the next kernel may launch
                launch_dependents()  # (and load its own while this one reduces and writes)
            group_rows(min(gn, n_groups - 1), n_rows, row)
            load_first(w, w, s, s, row, 0, nw, lane, words, sc, sh, sh)  # the next group's first step
            for r in range(ROWS):
                acc[r] = warp_reduce_sum(acc[r]) * scale  # xor shuffles: every lane gets the sum
            if lane == 0:
                for p in range(ROWS // 2):
                    if ROWS * g + 2 * p < n_rows:  # n_rows is even: the pair is whole
                        store_pair(acc[2 * p], acc[2 * p + 1], ROWS * g + 2 * p, bias, has_bias, freqs, pos, row_kv, q,
                                   k_cache, v_cache, q_dim, kv_dim, head_dim)  # fmt: skip
            g = gn

    return qkv_rope_kernel


def qkv_rope(
    layer: object,
    x: object,
    rope_freqs: object,
    state: object,
    q: object,
    cache: object,
    cfg: object,
    *,
    stream: object,
    pages: object = None,
) -> None:
    """q = rope(Wq xn + bq); cache.k[pos] = enc(rope(Wk xn + bk)); cache.v[pos] = enc(Wv xn + bv);
    xn = rmsnorm(x) * layer.attn_norm, pos = state[STATE_POS]. pages (pycalm.kernels.rows.Pages
    of one row): the cache is a paged pool, and k and v go to the pool row of position pos of
    sequence pages.seq_of_row[0] instead of row pos.

    layer: .wqkv stored (q_dim + 2 kv_dim, dim) (q8 / q4: a pycalm.model.formats.Quantized), its format
    .dtypes["wqkv"], .bqkv (q_dim + 2 kv_dim,) float32 or None,
    .attn_norm (dim,) float32; x (dim,) float32; rope_freqs (rotary_dim // 2,) float32; state
    int32; q (q_dim,) float32; cache: a pycalm.kernels.attention.KVCache (.k, .v (seq_len,
    kv_dim) float16 or uint8 e5m2, .dtype); cfg: the ModelConfig (n_heads, n_kv_heads,
    head_dim, norm_eps)."""
    if cache.dtype not in KV_STORAGE:
        raise PycalmError(f"unsupported KV-cache dtype {cache.dtype!r} (fp16 or fp8)")
    if x.shape[0] > XCHUNK:
        raise PycalmError(f"qkv_rope: dim {x.shape[0]} is above the {XCHUNK} columns one block stages")
    dtype = layer.dtypes["wqkv"]
    w, s = codes_and_scales(layer.wqkv, dtype, x)
    bias = layer.bqkv
    q_dim, kv_dim, head_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
    if w.shape[0] != q_dim + 2 * kv_dim or head_dim % 2:
        raise PycalmError(f"qkv_rope: {w.shape[0]} rows for q_dim {q_dim} and kv_dim {kv_dim}")
    nbytes = load_bytes(w, dtype)
    kernel = qkv_rope_kernel(dtype, nbytes, cache.dtype, paged=pages is not None)
    has_bias = bias is not None
    # unpaged, the pages' arguments are unread: state stands in for them
    seq_of_row, table, page_log2 = (
        (pages.seq_of_row, pages.table, pages.page_log2) if pages is not None
        else (state, state.reshape(1, state.shape[0]), 0)
    )  # fmt: skip
    args = (
        word_view(w, nbytes), s, bias if has_bias else x, x, x.view(np.uint64), layer.attn_norm,
        np.float32(cfg.norm_eps), rope_freqs, state, q, cache.k, cache.v, q_dim, kv_dim, head_dim,
        np.int32(has_bias), seq_of_row, table, np.int32(page_log2),
    )  # fmt: skip
    blocks, threads = row_group_launch(kernel, args, -(-w.shape[0] // ROWS), 1)
    kernel[blocks, threads, stream](*args)
