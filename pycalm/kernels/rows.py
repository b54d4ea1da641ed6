"""The kernels of a multi-token (prefill) layer between its matmuls, for T rows at once.

The tensor-core matmuls (pycalm.kernels.matmul) take fp16 (T, K) activations and write float32
(T, N) rows, with the residual add and the SiLU gate fused into their epilogues. Around them:

  embed_rows       x (T, dim) f32 = decode(tok_embeddings[tokens[t]])        embed_rows_ref
  rmsnorm_rows     xb (T, dim) f16 = rmsnorm(x[t]) * w, the matmuls' input    rmsnorm_rows_ref
  qkv_rows         the QKV epilogue: bias, RoPE at position pos0 + t, k and v into cache rows
                   pos0 + t (encoded as the decode path encodes them), q (T, q_dim) f32 for
                   pycalm.kernels.prefill_attention                          qkv_rows_ref
  qkv_pages        the same for rows of many sequences (batched serving): row t at its own
                   position positions[t], k and v into the pool row of a paged cache that
                   sequence seq_of_row[t]'s block table gives (rows with seq < 0: padding,
                   untouched)                                                 qkv_rows_ref
  take_rows        out (n, dim) f32 = x[rows[i]]: the rows to classify of a batched pass
  moe_route_rows   Mixtral: each row's top-k experts and their weights       moe_route_rows_ref
  moe_group        the rows grouped by expert (each expert's weights read once a pass)
                                                                             moe_group_ref
The references are in pycalm.cpu.reference. pos0 is state[STATE_POS] on the device (as in the decode
step), so a captured graph replays at any position; T is the arrays' row count.

Thread mappings: embed_rows and qkv_rows, grid (column blocks, T): a thread an element (gf4: a
word of 8), a pair of columns (qkv: one rotary pair). rmsnorm_rows, moe_route_rows: a block a
row, a block reduction. moe_group: a block an expert, walking the rows in order blockDim at a
time with a block-wide prefix sum, so an expert's rows come out in increasing order (the same
lists on every run).

Bytes moved: each reads its rows once and writes them once (a row-wise op costs nothing next to
the matmuls); the routing reads the router (4 n_experts dim) once a row, from L2 after the
first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32

from pycalm.errors import PycalmError
from pycalm.kernels.attention import KVCache, pool_row
from pycalm.kernels.common import (
    STATE_POS,
    STATE_TOKEN,
    WARP,
    block_reduce_sum,
    dependent_start,
    fp16_encode,
)
from pycalm.kernels.embed import DECODE_UNIT, table_arrays
from pycalm.kernels.moe import route_row
from pycalm.kernels.qkv import rope_store_pair
from pycalm.model.config import ModelConfig

SIM = _numba_config.ENABLE_CUDASIM
THREADS = 32 if SIM else 256  # threads a block (the simulator runs a Python thread per thread)
MAX_EXPERTS = 32  # moe_route_rows: a warp's worth of logits


# ---------------------------------------------------------------------------------------------
# embedding lookup of T tokens


@functools.cache
def make_embed_rows_kernel(dtype: str) -> object:
    """embed_rows_kernel for a table dtype (one compile each)."""
    decode_unit = DECODE_UNIT[dtype]  # the token step's embed decodes a row with it too

    @cuda.jit(cache=True)
    def embed_rows_kernel(table, scales, tokens, x):  # noqa: ANN001, ANN202
        """x (T, dim) float32: row t = decode(table[tokens[t]]); block (b, t), thread i of
        block b: unit b blockDim + i of the row (an element, or a gf4 / q4 word of 8)."""
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.y
        if i < table.shape[1]:
            decode_unit(table, scales, tokens[t], i, x[t])

    return embed_rows_kernel


def embed_rows(table: object, tokens: object, x: object, dtype: str, *, stream: object) -> None:
    """x (T, dim) float32 = decode(table[tokens[t]]) for the T ids of the device array tokens
    (T,) int32; table (vocab_size, dim) as stored by pycalm.model.formats (gf4: (vocab_size, dim / 8)
    uint32; q8 / q4: a Quantized pair). Reference: pycalm.cpu.reference.embed_rows_ref."""
    codes, scales = table_arrays(table, dtype)
    n_rows, n = x.shape[0], codes.shape[1]  # stored units a row: gf4 and q4 have a word per 8 weights
    if tokens.shape[0] != n_rows:
        raise PycalmError(f"embed_rows: {tokens.shape[0]} tokens for {n_rows} rows")
    make_embed_rows_kernel(dtype)[(-(-n // THREADS), n_rows), THREADS, stream](codes, scales, tokens, x)


# ---------------------------------------------------------------------------------------------
# RMSNorm of T rows, fp16 out


@cuda.jit(cache=True)
def rmsnorm_rows_kernel(x, w, eps, out, rms, write_rms):  # noqa: ANN001, ANN201
    """Block t: out[t] = fp16(x[t] * rsqrt(mean(x[t]^2) + eps) * w). x (T, dim) float32, w (dim,)
    float32, out (T, dim) float16; where write_rms, rms[t] = that rsqrt (rms (T,) float32)."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    scratch = cuda.shared.array(WARP, float32)  # block reduction
    t = cuda.blockIdx.x
    n = x.shape[1]
    ss = float32(0.0)
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        ss += x[t, i] * x[t, i]
    ss = block_reduce_sum(ss, scratch)  # every thread gets the total (the call has barriers)
    r = float32(1.0) / math.sqrt(ss / float32(n) + eps)
    if write_rms and cuda.threadIdx.x == 0:
        rms[t] = r
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        out[t, i] = fp16_encode(x[t, i] * r * w[i])


# threads of an RMSNorm block: a row's loads are a chain of dim / threads dependent round trips
# to L2 (x was just written), so a pass of up to NORM_WIDE_ROWS rows takes wide blocks (H200, 8B,
# 8 rows: 12 us a launch with 256 threads). A prompt pass has blocks enough to hide that chain,
# and wide blocks pay for their barriers: the 8B fp16 prefill's 64 RMSNorms of 2,048 rows took
# 2.6 ms in blocks of 256 threads (2026-12-02) and 6.4 in blocks of 1,024 (2026-12-06, H200,
# bench.py's per-role split). A row's bits follow the block's width: passes of up to 64 rows
# (every batch-invariant pass) all take NORM_THREADS.
NORM_THREADS = 32 if SIM else 1024
NORM_WIDE_ROWS = 64


def rmsnorm_rows(
    x: object, w: object, eps: float, out: object, *, stream: object, rms: object = None
) -> None:
    """out (T, dim) float16 = rmsnorm of each row of x (T, dim) float32, times w (dim,) float32;
    rms (T,) float32, where given: each row's rsqrt(mean(x^2) + eps) (the scale a folded norm
    after it takes: pycalm.kernels.skinny.NormFold). Reference: pycalm.cpu.reference.rmsnorm_rows_ref."""
    if out.shape != x.shape:
        raise PycalmError(f"rmsnorm_rows: out {out.shape} is not x's {x.shape}")
    threads = NORM_THREADS if x.shape[0] <= NORM_WIDE_ROWS else THREADS
    write_rms = rms is not None
    rmsnorm_rows_kernel[x.shape[0], threads, stream](
        x, w, float32(eps), out, rms if write_rms else w, write_rms
    )


# ---------------------------------------------------------------------------------------------
# the QKV epilogue of T rows: bias, RoPE, the KV-cache write


@functools.cache
def qkv_rows_kernel(kv_dtype: str) -> object:
    """The epilogue for a KV-cache dtype ("fp16": float16 caches, "fp8": uint8 e5m2)."""
    store_pair = rope_store_pair(kv_dtype)  # bias, RoPE, q or the KV-cache write: the decode path's

    @cuda.jit(cache=True)
    def qkv_rows_kernel(  # noqa: ANN202
        qkv,
        bias,
        has_bias,
        freqs,
        state,
        q,
        k_cache,
        v_cache,
        q_dim,
        kv_dim,
        head_dim,  # noqa: ANN001
    ):
        """Thread (pair p, row t): columns 2p, 2p + 1 of qkv (T, q_dim + 2 kv_dim) float32 at
        position pos0 + t; bias (columns,) float32 read when has_bias; q (T, q_dim) float32."""
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        p = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.y
        c0 = 2 * p  # head_dim is even: a pair never straddles a head, and is one rotary pair
        if c0 >= qkv.shape[1]:
            return
        pos = state[STATE_POS] + t
        store_pair(qkv[t, c0], qkv[t, c0 + 1], c0, bias, has_bias, freqs, pos, pos, q[t], k_cache, v_cache,
                   q_dim, kv_dim, head_dim)  # fmt: skip

    return qkv_rows_kernel


@functools.cache
def qkv_pages_kernel(kv_dtype: str) -> object:
    """qkv_rows_kernel for rows of many sequences over a paged cache (see qkv_pages)."""
    store_pair = rope_store_pair(kv_dtype)

    @cuda.jit(cache=True)
    def qkv_pages_kernel(  # noqa: ANN202
        qkv, bias, has_bias, freqs, positions, seq_of_row, table, page_log2, q, k_pool, v_pool, q_dim, kv_dim,
        head_dim,
    ):  # noqa: ANN001  # fmt: skip
        """Thread (pair p, row t): as qkv_rows_kernel, at position positions[t], into its pool
        row in sequence s = seq_of_row[t]'s pages (attention.pool_row)."""
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        p = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        t = cuda.blockIdx.y
        c0 = 2 * p
        s = seq_of_row[t]
        if c0 >= qkv.shape[1] or s < 0:
            return
        pos = positions[t]
        row = pool_row(table, s, pos, page_log2)
        store_pair(qkv[t, c0], qkv[t, c0 + 1], c0, bias, has_bias, freqs, pos, row, q[t], k_pool, v_pool,
                   q_dim, kv_dim, head_dim)  # fmt: skip

    return qkv_pages_kernel


def qkv_pages(
    qkv: object,
    layer: object,
    rope_freqs: object,
    pages: Pages,
    q: object,
    pool: KVCache,
    cfg: ModelConfig,
    *,
    stream: object,
) -> None:
    """qkv_rows for rows of many sequences: row t of qkv (T, q_dim + 2 kv_dim) float32 at
    position pages.positions[t] of sequence pages.seq_of_row[t] (< 0: padding, nothing
    written), its k and v encoded into the pool row its block table gives (pool: a KVCache of
    (n_pages * page_size, kv_dim) rows). Reference: pycalm.cpu.reference.qkv_rows_ref a
    sequence's run of rows, kv_round into the pool rows."""
    n_rows, cols = check_qkv("qkv_pages", qkv.shape, q, pool, cfg)
    if pages.positions.shape[0] < n_rows or pages.seq_of_row.shape[0] < n_rows:
        raise PycalmError(f"qkv_pages: {n_rows} rows, positions for {pages.positions.shape[0]}")
    bias = layer.bqkv
    has_bias = bias is not None
    kernel = qkv_pages_kernel(pool.dtype)
    kernel[(-(-(cols // 2) // THREADS), n_rows), THREADS, stream](
        qkv, bias if has_bias else rope_freqs, np.int32(has_bias), rope_freqs, pages.positions, pages.seq_of_row,
        pages.table, np.int32(pages.page_log2), q, pool.k, pool.v, cfg.q_dim, cfg.kv_dim, cfg.head_dim,
    )  # fmt: skip


@dataclass(frozen=True)
class Pages:
    """Where the rows of a batched pass sit: device arrays the kernels read (a captured graph
    replays with new contents), and the page size."""

    positions: object  # (rows,) int32: each row's position in its sequence
    seq_of_row: object  # (rows,) int32: each row's sequence (its row of table), < 0: padding
    table: object  # (n_seqs, max_pages) int32: sequence s's i-th page of positions is pool page table[s, i]
    page_size: int  # pool rows a page, a power of two
    # the attention's: every row's position lies below span (pycalm.kernels.attention's span),
    # and its AttentionScratch (attention_scratch(..., paged=True)); qkv_pages reads neither
    span: int = 0
    scratch: object = None
    # a pass of one sequence's consecutive positions (table row 0): a state whose STATE_POS is
    # its first row's position and STATE_ROWS its live rows, for the prefill attention's tiles
    # over the pages; None: rows of many sequences
    state: object = None

    @property
    def page_log2(self) -> int:
        return self.page_size.bit_length() - 1


@cuda.jit(cache=True)
def take_rows_kernel(x, rows, out):  # noqa: ANN001, ANN201
    """Block (b, i): out[i, j] = x[rows[i], j] for the j of block b's threads."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    i = cuda.blockIdx.y
    if j < out.shape[1]:
        out[i, j] = x[rows[i], j]


def take_rows(x: object, rows: object, out: object, *, stream: object) -> None:
    """out (n, dim) = x[rows[i]] for the n row indices of the device array rows (n,) int32 (each
    below x's rows: not checked on the device)."""
    n = out.shape[0]
    if rows.shape[0] < n or out.shape[1] != x.shape[1]:
        raise PycalmError(f"take_rows: {n} rows of {x.shape[1]} from {rows.shape[0]} indices")
    take_rows_kernel[(-(-out.shape[1] // THREADS), n), THREADS, stream](x, rows, out)


@cuda.jit(cache=True)
def feed_tokens_kernel(tokens, prev, chosen, state):  # noqa: ANN001, ANN201
    """Thread r: tokens[r] = chosen[prev[r]] where prev[r] >= 0; row 0's also into
    state[STATE_TOKEN] (the one-row step's token)."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    r = cuda.grid(1)
    if r < tokens.shape[0]:
        p = prev[r]
        if p >= 0:
            tokens[r] = chosen[p]
            if r == 0:
                state[STATE_TOKEN] = chosen[p]


def feed_tokens(tokens: object, prev: object, chosen: object, state: object, *, stream: object) -> None:
    """tokens (n,) int32 = feed_tokens_ref(tokens, prev, chosen), in place on the device: each
    row whose prev (n,) is >= 0 feeds chosen[prev] (a token the last pass sampled, not yet read
    by the host); and state[STATE_TOKEN] = the new tokens[0] where row 0 took one."""
    n = tokens.shape[0]
    if prev.shape[0] < n:
        raise PycalmError(f"feed_tokens: {n} rows, {prev.shape[0]} prev")
    feed_tokens_kernel[-(-n // THREADS), THREADS, stream](tokens, prev, chosen, state)


def check_qkv(
    name: str, shape: tuple[int, int], q: object, cache: KVCache, cfg: ModelConfig
) -> tuple[int, int]:
    """qkv's (rows, columns) `shape`, or a PycalmError where it, q or the cache do not fit cfg."""
    if cache.dtype not in ("fp16", "fp8"):
        raise PycalmError(f"unsupported KV-cache dtype {cache.dtype!r} (fp16 or fp8)")
    n_rows, cols = shape
    if cols != cfg.qkv_dim or cfg.head_dim % 2 or q.shape != (n_rows, cfg.q_dim):
        raise PycalmError(
            f"{name}: qkv {tuple(shape)} and q {q.shape} do not fit {cfg.n_heads} / {cfg.n_kv_heads}"
            f" heads of {cfg.head_dim}"
        )
    return n_rows, cols


def qkv_rows(
    qkv: object,
    layer: object,
    rope_freqs: object,
    state: object,
    q: object,
    cache: KVCache,
    cfg: ModelConfig,
    *,
    stream: object,
) -> None:
    """q (T, q_dim) = rope(qkv[:, :q_dim] + bq); cache.k[pos0 + t] = enc(rope(k + bk));
    cache.v[pos0 + t] = enc(v + bv), pos0 = state[STATE_POS], row t at position pos0 + t.

    qkv: (T, q_dim + 2 kv_dim) float32, the matmul of the normed rows; layer: .bqkv
    (q_dim + 2 kv_dim,) float32 or None (Qwen2 has one); rope_freqs (rotary_dim // 2,) float32;
    cache: a pycalm.kernels.attention.KVCache (.k, .v (seq_len, kv_dim) float16 or uint8 e5m2,
    .dtype); cfg: n_heads, n_kv_heads, head_dim. Reference: pycalm.cpu.reference.qkv_rows_ref, then
    kv_round for the cache rows."""
    n_rows, cols = check_qkv("qkv_rows", qkv.shape, q, cache, cfg)
    bias = layer.bqkv
    has_bias = bias is not None
    pairs = cols // 2
    kernel = qkv_rows_kernel(cache.dtype)
    kernel[(-(-pairs // THREADS), n_rows), THREADS, stream](
        qkv, bias if has_bias else rope_freqs, np.int32(has_bias), rope_freqs, state, q, cache.k, cache.v,
        cfg.q_dim, cfg.kv_dim, cfg.head_dim,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Mixtral routing of T rows, and the rows grouped by expert


@functools.cache
def moe_route_rows_kernel(n_experts: int) -> object:
    """The routing kernel for n_experts: pycalm.kernels.moe's decode routing of one row
    (route_row), a block a row."""
    route = route_row(n_experts)

    @cuda.jit(cache=True)
    def moe_route_rows_kernel(gate, x, norm_w, eps, route_ids, route_w):  # noqa: ANN001, ANN202
        """Block t: the top k = route_ids.shape[1] experts of G (rmsnorm(x[t]) * norm_w), ties to
        the lower index, and the softmax over their logits. gate (n_experts, dim) float32; x
        (T, dim) float32; route_ids (T, k) int32, route_w (T, k) float32."""
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        row = cuda.blockIdx.x
        route(gate, x[row], norm_w, eps, route_ids.shape[1], route_ids[row], route_w[row])

    return moe_route_rows_kernel


@dataclass(frozen=True)
class RowRoutes:
    """The experts chosen for each of T rows, in device memory (written by moe_route_rows)."""

    ids: object  # (T, n_experts_active) int32, each row's in descending logit order
    weights: object  # (T, n_experts_active) float32, the softmax over the row's chosen logits


@dataclass(frozen=True)
class ExpertRows:
    """The rows grouped by expert (written by moe_group): a pass over expert e reads its
    weights once for the count[e] rows rows[e, :count[e]]."""

    count: object  # (n_experts,) int32
    rows: object  # (n_experts, T) int32, increasing; -1 past count[e]
    weights: object  # (n_experts, T) float32, the rows' routing weights; 0 past count[e]


def moe_route_rows(layer: object, x: object, routes: RowRoutes, cfg: ModelConfig, *, stream: object) -> None:
    """routes.ids, routes.weights (T, k) = for each row of x (T, dim) float32, the top k =
    cfg.n_experts_active experts of G (rmsnorm(x[t]) * ffn_norm) and the softmax over their
    logits. layer: .moe_gate (n_experts, dim) float32, .ffn_norm (dim,) float32.
    Reference: pycalm.cpu.reference.moe_route_rows_ref."""
    gate = layer.moe_gate
    n_experts, dim = gate.shape
    n_rows, k = routes.ids.shape
    if not 0 < n_experts <= MAX_EXPERTS or k != cfg.n_experts_active or not 0 < k <= n_experts:
        raise PycalmError(f"moe_route_rows: top {k} of {n_experts} experts (1..{MAX_EXPERTS})")
    if x.shape != (n_rows, dim) or routes.weights.shape != (n_rows, k):
        raise PycalmError(f"moe_route_rows: x {x.shape}, routes {routes.ids.shape} / {routes.weights.shape}")
    moe_route_rows_kernel(n_experts)[n_rows, THREADS, stream](
        gate, x, layer.ffn_norm, float32(cfg.norm_eps), routes.ids, routes.weights
    )


@cuda.jit(cache=True)
def moe_group_kernel(route_ids, route_w, count, rows, row_w):  # noqa: ANN001, ANN201
    """Block e: expert e's rows in increasing order. route_ids, route_w (T, k); count
    (n_experts,) int32; rows (n_experts, T) int32 (-1 past count[e]); row_w (n_experts, T) float32
    (0 past count[e]). A step takes as many rows as the block has threads: a flag a thread, a
    prefix sum over the block (a shuffle scan in each warp, then the warps' totals), the rows
    written at their offsets."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    warp_total = cuda.shared.array(WARP, int32)  # this step's count of each warp
    e = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    n_warps = cuda.blockDim.x // WARP
    n_rows, k = route_ids.shape
    found = int32(0)  # rows of expert e before this step
    for base in range(0, n_rows, cuda.blockDim.x):  # block-uniform: every thread takes each step
        t = base + tid
        flag = int32(0)
        w = float32(0.0)
        if t < n_rows:
            for j in range(k):
                if route_ids[t, j] == e:
                    flag = int32(1)
                    w = route_w[t, j]
        incl = flag  # inclusive prefix sum of the flags within the warp
        off = 1
        while off < WARP:  # Hillis-Steele: lane gets the sum of lanes lane - off .. lane
            up = cuda.shfl_up_sync(0xFFFFFFFF, incl, off)
            if lane >= off:
                incl += up
            off *= 2
        if lane == WARP - 1:
            warp_total[warp] = incl
        cuda.syncthreads()  # every warp's total of this step is in warp_total
        before = found  # rows before this thread's: earlier steps, earlier warps, earlier lanes
        step = int32(0)
        for i in range(n_warps):
            if i < warp:
                before += warp_total[i]
            step += warp_total[i]
        if flag:
            rows[e, before + incl - 1] = t
            row_w[e, before + incl - 1] = w
        found += step
        cuda.syncthreads()  # every thread has read warp_total before the next step writes it
    for i in range(found + tid, n_rows, cuda.blockDim.x):
        rows[e, i] = -1
        row_w[e, i] = float32(0.0)
    if tid == 0:
        count[e] = found


def moe_group(routes: RowRoutes, experts: ExpertRows, *, stream: object, threads: int = THREADS) -> None:
    """experts.count, .rows, .weights = the rows that chose each expert, in increasing order,
    and their routing weights (see moe_group_kernel). threads: a multiple of 32 up to 1024 (the
    tests take several warps under the simulator). Reference: pycalm.cpu.reference.moe_group_ref."""
    n_experts, n_rows = experts.rows.shape
    if (
        routes.ids.shape[0] != n_rows
        or experts.weights.shape != experts.rows.shape
        or experts.count.shape[0] != n_experts
    ):
        raise PycalmError(
            f"moe_group: routes {routes.ids.shape}, rows {experts.rows.shape}, count {experts.count.shape}"
        )
    moe_group_kernel[n_experts, threads, stream](
        routes.ids, routes.weights, experts.count, experts.rows, experts.weights
    )
