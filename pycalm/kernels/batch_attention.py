"""Decode attention of M query rows, each of its own sequence, over a paged KV cache: the
attention of batched serving (many sequences advanced one token each in one pass).

Reference: pycalm.cpu.reference.batch_attention_ref. Row r belongs to sequence s = seq_of_row[r]
and sits at position p = positions[r]; its own key and value are already written at p. For query
head h (kv head g = h // group, group = n_heads // n_kv_heads) the math is the decode attention's
(pycalm.cpu.reference.attention_ref at n_pos = p + 1) over s's keys:
  keys t in [start, p], start = max(0, p + 1 - window) with a sliding window, else 0
  score_t = q_r,h . k_t,g / sqrt(head_dim);  P = softmax(score);  out_r,h = sum_t P_t v_t,g
A row with s < 0 is padding: its output is zeros and it reads no cache row.

Memory layout (pages): the layer's cache (a KVCache) holds a POOL of n_pages pages of page_size
rows (a power of two), k and v (n_pages * page_size, n_kv_heads * head_dim), fp16 or fp8 e5m2
bytes. Key t of sequence s lives in pool row
  block_table[s, t >> log2(page_size)] * page_size + (t & (page_size - 1)),
so a sequence's pages may lie anywhere in the pool, in any order; the block table (n_seqs,
max_pages) int32 is what a page allocator hands out. seq_of_row, positions and block_table are
device arrays the kernel reads, never launch scalars, so a captured graph replays with new ones;
the grid depends only on M (q's rows) and the model's heads. q is (M, n_heads * head_dim)
float32 (RoPE applied), out (M, n_heads * head_dim) float16, the wo matmul's input.

GPU: one kernel, grid (M, n_kv_heads), `threads` threads a block (THREADS: 4 warps). Block (r, g)
takes row r and kv head g with ALL its group query heads, so it reads the kv head's K and V rows
once for the whole group. It walks the row's keys in tiles of `keys` keys (flash attention's
online softmax, every sum in float32):

0. once: the group's q rows times 1/sqrt(head_dim) into shared memory; running max m = -inf and
   sum l = 0 a head.
1. a tile's pool rows: thread j < keys looks up key first + j in the block table (one read a key,
   not one a loaded word). Barrier.
2. the tile's K and V rows of kv head g, decoded to float32 into shared memory: thread i takes
   the i-th 8-byte word of the tile (4 fp16 or 8 e5m2 values; consecutive threads, consecutive
   words of a row: coalesced loads). fp16 widens by cvt, e5m2 by a byte permute into fp16 and
   cvt (exact). Barrier.
3. scores: thread i takes (head i // keys, key i % keys), a dot of head_dim terms from shared
   memory. K rows are padded by one float, so the 32 keys of a warp's dots fall in 32 distinct
   banks; the warp's q row is one broadcast address. Barrier.
4. online softmax, a warp a head (heads round-robin over the warps): the tile's max (warp
   shuffles), m_new = max(m, tile max), p_t = exp(score_t - m_new) written over the scores,
   alpha = exp(m - m_new), l = alpha l + sum p. Barrier.
5. p V: thread i takes outputs (head, dim) = i, i + threads, ... (group * head_dim of them in
   registers): acc = alpha acc + sum_t p_t v_t,dim (consecutive threads, consecutive dims of a
   V row: no bank conflict; p_t is a broadcast). Barrier (the next tile overwrites K, V, p).
6. out = acc / l, as fp16.

Shared memory: keys x (head_dim + 1) + keys x head_dim floats for K and V, group x head_dim for
q and group x keys for p: 35 KB at head_dim 128, 32 keys, group 4 (batch_attention_keys halves
the tile where the static 48 KB would not hold it). Under the simulator (a Python thread per
CUDA thread) a block is 2 warps and a tile 16 keys, so the tests' short contexts still cover
several tiles and heads round-robin over warps.

Bytes moved (batch_attention_bytes): a live row reads its attended K and V rows of every kv head
once (attended keys x kv_dim x 2 x bytes a cache element; the group's query heads share them),
its q row (4 q_dim) and its block table entries, and writes out (2 q_dim). The plain form here
takes a (row, kv head) in one block: at small M and long context few blocks share the GPU
(splitting a row's keys over several blocks, with a combine, is what would fill it).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32
from numba.cuda import libdevice

from pycalm.errors import PycalmError
from pycalm.kernels.attention import KVCache, pool_row
from pycalm.kernels.common import (
    dependent_start,
    fp8x4_cvt,
    fp16_encode,
    h2f2,
    warp_reduce_max,
    warp_reduce_sum,
)
from pycalm.model.config import KV_DTYPES, ModelConfig

SIM = _numba_config.ENABLE_CUDASIM
THREADS = 64 if SIM else 128  # threads a block
KEYS = 16 if SIM else 32  # keys a tile (at most; batch_attention_keys)
SHARED_BYTES = 48 * 1024  # static shared memory a block may have
NEG = -1.0e30  # "no score yet": finite, so exp(NEG - m) is 0, not NaN


def _elems_per_word(kv_dtype: str) -> int:
    """Cache elements an int64 word holds: 4 fp16 or 8 e5m2."""
    return 8 if kv_dtype == "fp8" else 4


def batch_attention_keys(head_dim: int, group: int, keys: int = KEYS) -> int:
    """Keys a tile: `keys` halved until the block's shared arrays (K padded, V, q, p, the rows
    and per-head running values) fit SHARED_BYTES."""
    while keys > 1:
        words = keys * (head_dim + 1) + keys * head_dim + group * head_dim + group * keys + keys + 3 * group
        if 4 * words <= SHARED_BYTES:
            break
        keys //= 2
    return keys


@functools.cache
def batch_attention_kernel(head_dim: int, group: int, kv_dtype: str, threads: int, keys: int) -> object:
    """The kernel for a head_dim (a multiple of 8), group size (query heads a kv head), KV
    dtype, block size (a multiple of 32) and keys a tile; see the module docstring. The sizes
    are compile-time constants, so a thread's accumulators are a fixed-size local array indexed
    by unrolled loops: registers."""
    D = head_dim
    FP8 = kv_dtype == "fp8"
    E = _elems_per_word(kv_dtype)  # cache elements an int64 word
    ROW_WORDS = D // E  # words of one kv head's K (or V) row
    KROW = D + 1  # floats a staged K row: the padding puts key j's dim d in bank (j + d) % 32
    N_WARPS = threads // 32
    HD = group * D  # the block's outputs: (head, dim) of its group
    OUTS = -(-HD // threads)  # outputs a thread
    SCALE = 1.0 / math.sqrt(head_dim)

    @cuda.jit(fastmath=False, cache=True)
    def batch_attention_kernel(q, k_cache, v_cache, table, seq_of_row, positions, out, page_log2, window):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        # q (M, n_heads*D) f32; caches (n_pages*page_size, kv_dim bytes / 8) int64 holding fp16
        # or e5m2 elements; table: the block table (n_seqs, max_pages) i32; seq_of_row, positions
        # (M,) i32; out (M, n_heads*D) f16
        q_s = cuda.shared.array((group, D), float32)  # the group's q rows times 1/sqrt(D)
        k_s = cuda.shared.array((keys, KROW), float32)  # the tile's K rows (kv head g), decoded
        v_s = cuda.shared.array((keys, D), float32)  # the tile's V rows, decoded
        p_s = cuda.shared.array((group, keys), float32)  # the tile's scores, then p
        rows_s = cuda.shared.array(keys, int32)  # the tile's pool rows
        m_s = cuda.shared.array(group, float32)  # running max of each head's scores
        l_s = cuda.shared.array(group, float32)  # running sum of each head's exp(score - m)
        alpha_s = cuda.shared.array(group, float32)  # this tile's rescale of each head's sums
        acc = cuda.local.array(OUTS, float32)  # this thread's outputs' sums of p v
        row = cuda.blockIdx.x
        g = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        col0 = g * HD  # the group's first column of q and out
        seq = seq_of_row[row]
        if seq < 0:  # padding: zeros, no cache read (the whole block leaves: no barrier waits)
            for i in range(tid, HD, threads):
                out[row, col0 + i] = fp16_encode(float32(0.0))
            return
        n_pos = positions[row] + 1
        start = 0
        if window > 0 and n_pos > window:
            start = n_pos - window

        # 0. q, and each head's running max and sum (the first tile's barrier publishes them)
        for i in range(tid, HD, threads):
            q_s[i // D, i % D] = q[row, col0 + i] * float32(SCALE)
        if tid < group:
            m_s[tid] = float32(NEG)
            l_s[tid] = float32(0.0)
        for o in range(OUTS):
            acc[o] = float32(0.0)

        for first in range(start, n_pos, keys):
            n_here = min(keys, n_pos - first)  # keys of this tile
            # 1. the tile's pool rows
            if tid < n_here:
                t = first + tid
                rows_s[tid] = pool_row(table, seq, t, page_log2)
            cuda.syncthreads()  # rows_s holds the tile's rows (q_s, m_s, l_s on the first tile)

            # 2. K and V of kv head g, decoded, a word (E elements) a thread at a time
            for i in range(tid, n_here * ROW_WORDS, threads):
                j, w = i // ROW_WORDS, i % ROW_WORDS  # key first + j, dims w E .. w E + E - 1
                r = rows_s[j]
                kw = k_cache[r, g * ROW_WORDS + w]
                vw = v_cache[r, g * ROW_WORDS + w]
                for half in range(2):
                    kh = int32(kw >> 32) if half else int32(kw)  # low 4 bytes first
                    vh = int32(vw >> 32) if half else int32(vw)
                    d = w * E + half * (E // 2)
                    if FP8:
                        k_s[j, d], k_s[j, d + 1], k_s[j, d + 2], k_s[j, d + 3] = fp8x4_cvt(kh)
                        v_s[j, d], v_s[j, d + 1], v_s[j, d + 2], v_s[j, d + 3] = fp8x4_cvt(vh)
                    else:
                        k_s[j, d], k_s[j, d + 1] = h2f2(kh)
                        v_s[j, d], v_s[j, d + 1] = h2f2(vh)
            cuda.syncthreads()  # the tile's K and V are staged

            # 3. scores: thread i takes (head i // keys, key i % keys)
            for i in range(tid, group * keys, threads):
                h, j = i // keys, i % keys
                if j < n_here:
                    s = float32(0.0)
                    for d in range(D):
                        s += q_s[h, d] * k_s[j, d]
                    p_s[h, j] = s
            cuda.syncthreads()  # every score of the tile is in p_s

            # 4. online softmax, a warp a head (every lane of a warp takes the same heads)
            for h in range(warp, group, N_WARPS):
                tile_max = float32(NEG)
                for j in range(lane, n_here, 32):
                    tile_max = max(tile_max, p_s[h, j])
                tile_max = warp_reduce_max(tile_max)
                m_old = m_s[h]
                m_new = max(m_old, tile_max)
                total = float32(0.0)
                for j in range(lane, n_here, 32):
                    p = libdevice.fast_expf(p_s[h, j] - m_new)
                    p_s[h, j] = p
                    total += p
                # the shuffles also order every lane's read of m_s[h] before lane 0's write
                total = warp_reduce_sum(total)
                if lane == 0:
                    alpha = libdevice.fast_expf(m_old - m_new)  # 0 on the first tile
                    alpha_s[h] = alpha
                    l_s[h] = l_s[h] * alpha + total
                    m_s[h] = m_new
            cuda.syncthreads()  # p_s holds p, alpha_s and l_s this tile's values

            # 5. acc = alpha acc + sum_t p_t v_t for each of the thread's (head, dim) outputs
            for o in range(OUTS):
                i = tid + o * threads
                if i < HD:
                    h, d = i // D, i % D
                    a = acc[o] * alpha_s[h]
                    for j in range(n_here):
                        a += p_s[h, j] * v_s[j, d]
                    acc[o] = a
            cuda.syncthreads()  # K, V, p and alpha are used: the next tile may overwrite them

        # 6. out = acc / l (l >= 1: the row's largest score contributes exp(0))
        for o in range(OUTS):
            i = tid + o * threads
            if i < HD:
                out[row, col0 + i] = fp16_encode(acc[o] / l_s[i // D])

    return batch_attention_kernel


def batch_attention(
    q: object,
    cache: KVCache,
    block_table: object,
    seq_of_row: object,
    positions: object,
    out: object,
    cfg: ModelConfig,
    *,
    stream: object,
    page_size: int,
    threads: int | None = None,
    keys: int | None = None,
) -> None:
    """out (M, n_heads * head_dim) f16 = the decode attention of each row of q (M, n_heads *
    head_dim) f32 over its own sequence's keys in a paged cache (see the module docstring).

    cache: a pycalm.kernels.attention.KVCache whose .k, .v are the page pool (n_pages *
    page_size, kv_dim) float16 or uint8 e5m2; block_table (n_seqs, max_pages) int32: sequence
    s's logical page i is pool page block_table[s, i]; seq_of_row (M,) int32 (< 0: padding, zeros
    out); positions (M,) int32: row r attends keys 0..positions[r] (or the sliding window) of
    its sequence, all of them written. The kernel does not check that a position's page lies in
    the table or the pool: the caller's page allocator does. cfg: n_heads, n_kv_heads, head_dim
    and sliding_window are read from it. page_size: rows a page, a power of two. threads, keys:
    the block shape (default THREADS, batch_attention_keys()).
    Reference: pycalm.cpu.reference.batch_attention_ref."""
    n_kv_heads, head_dim = cfg.n_kv_heads, cfg.head_dim
    group = cfg.n_heads // n_kv_heads
    threads = THREADS if threads is None else threads
    keys = batch_attention_keys(head_dim, group) if keys is None else keys
    if cache.dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {cache.dtype!r} (one of {', '.join(KV_DTYPES)})")
    if head_dim % 8:
        raise PycalmError(f"head_dim {head_dim} is not a multiple of 8 (8-byte cache loads)")
    if page_size < 1 or page_size & (page_size - 1) or cache.k.shape[0] % page_size:
        raise PycalmError(
            f"page size {page_size} is not a power of two dividing the pool's {cache.k.shape[0]} rows"
        )
    if threads % 32 or not 0 < threads <= 1024 or keys < 1:
        raise PycalmError(f"block of {threads} threads (a multiple of 32) and {keys} keys a tile")
    width = cfg.n_heads * head_dim
    n_rows = q.shape[0]
    if q.shape[1] != width or out.shape != (n_rows, width):
        raise PycalmError(f"batch_attention: q {q.shape} and out {out.shape} are not (M, {width})")
    if seq_of_row.shape != (n_rows,) or positions.shape != (n_rows,) or block_table.ndim != 2:
        raise PycalmError(
            f"batch_attention: seq_of_row {seq_of_row.shape} and positions {positions.shape} are not "
            f"({n_rows},), or block_table {block_table.shape} is not (n_seqs, max_pages)"
        )
    if n_rows == 0:
        return
    kernel = batch_attention_kernel(head_dim, group, cache.dtype, threads, keys)
    k64, v64 = cache.k.view(np.int64), cache.v.view(np.int64)
    page_log2 = int32(page_size.bit_length() - 1)
    kernel[(n_rows, n_kv_heads), threads, stream](
        q, k64, v64, block_table, seq_of_row, positions, out, page_log2, int32(cfg.sliding_window)
    )


def batch_attention_bytes(
    seq_of_row: np.ndarray, positions: np.ndarray, cfg: ModelConfig, kv_dtype: str
) -> int:
    """Bytes from DRAM of a launch (host copies of seq_of_row and positions): each live row's q
    (f32) and out (f16) and its attended K / V rows of every kv head once; a padding row writes
    its zeros out. Block table reads (4 bytes a page) are left out."""
    live = np.asarray(seq_of_row) >= 0
    n_pos = np.asarray(positions, np.int64)[live] + 1
    window = cfg.sliding_window
    keys = n_pos if window <= 0 else np.minimum(n_pos, window)
    element = 1 if kv_dtype == "fp8" else 2
    q_out = int(live.sum()) * cfg.q_dim * (4 + 2) + int((~live).sum()) * cfg.q_dim * 2
    return q_out + 2 * int(keys.sum()) * cfg.kv_dim * element
