"""Block-causal attention: T query rows at positions pos0 .. pos0 + T - 1 over the KV cache.

Reference: pycalm.reference.prefill_attention_ref. For query row t (position p = pos0 + t) and
query head h (kv head g = h // (n_heads // n_kv_heads)) the math is the decode attention's
(pycalm.reference.attention_ref at n_pos = p + 1), row by row:
  keys j in [start, p], start = max(0, p + 1 - window) with a sliding window, else 0
  score_j = q_t,h . k_j,g / sqrt(head_dim);  P = softmax(score);  out_t,h = sum_j P_j v_j,g
The caches hold (seq_len, n_kv_heads * head_dim), fp16 or fp8 e5m2, with the block's own K/V rows
already written (pycalm.kernels.rows.qkv_rows); q is (T, n_heads * head_dim) float32 and out
(T, n_heads * head_dim) float16, the wo matmul's input.

GPU: flash-attention style, SIMT fp32 (attention is a few % of a prefill's FLOPs at 2k tokens).
Grid (n_kv_heads, ceil(T / POSITIONS)). Block (g, b) takes POSITIONS query rows t0 .. t0 +
POSITIONS - 1 and every query head of kv head g: ROWS = POSITIONS x group (position, head) rows,
all of which read the same K and V rows, so a K/V tile staged once serves them all. Row r of the
block is position t0 + r // group, head g group + r % group. The blocks of the last rows (the
most keys) start first, t0 = (ceil(T / POSITIONS) - 1 - b) POSITIONS, so that the short ones
fill the end of the launch instead of a long one running alone. The block walks the keys from
the first one any of its rows sees to the last, in tiles of KEY_TILE positions:

1. once: the block's q rows, times 1/sqrt(head_dim), into shared memory qs (ROWS, head_dim).
2. a tile's K rows, decoded to float32, into kvs (KEY_TILE, head_dim): 16-byte loads (8 fp16
   or 16 e5m2 elements), a thread's few loads all issued before any is decoded and stored, so
   a tile costs one memory latency. Barrier.
3. scores: the threads form row groups of LANES threads; a thread holds ROWS_A_THREAD rows x
   KEYS_A_LANE keys (keys lane, lane + LANES, ...) of the tile in registers and accumulates them
   over head_dim from shared memory (ROWS_A_THREAD q and KEYS_A_LANE k loads feed that many
   products). Masked keys (after the row's position, before its window, past the block's last
   position) get p = 0.
4. online softmax, per row: the tile's max by xor shuffles inside the row group (its LANES
   lanes are consecutive lanes of one warp), m_new = max(m, tile max), alpha = exp(m - m_new),
   p = exp(score - m_new) into shared memory ps (ROWS, KEY_TILE), the sum of exp l = l alpha +
   sum p (shuffles again), the output accumulators times alpha. m, l in fp32 registers,
   replicated over the row group. Barrier.
5. the tile's V rows into kvs (the buffer K used: it keeps the block's shared memory under the
   48 KB of a static allocation). Barrier.
6. out += P V: the same thread holds ROWS_A_THREAD rows x head_dim / LANES dims (dims lane,
   lane + LANES, ...), reading p (broadcast in the row group) and v from shared memory. The
   next tile's first barrier protects kvs and ps.
7. out / l, as fp16.

Shapes (the defaults): head_dim 128: ROWS 32, LANES 16, KEY_TILE 32, 128 threads, shared
memory 16.5 + 16.5 + 4.2 KB, 153-167 registers (three blocks an SM); head_dim 64: ROWS 64, 256
threads, 16.6 + 8.3 + 8.4 KB, 107-118 registers (two blocks an SM; the launch bounds hold it
under 128, which 256 threads need for two). The shared rows are padded by one float, so the 16
lanes that read 16 different K rows at one dimension hit 16 different banks. Under the
simulator (a Python thread per CUDA thread) the blocks are smaller: ROWS 16, LANES 8 (one
warp), so the tests' short blocks still cover several tiles.

Decode of the caches: fp16 pairs widened by common.h2f2 (cvt.f32.f16), e5m2 bytes moved into
fp16 halves and widened by common.fp8x4_cvt: exact, once per element and block (the tile serves
ROWS rows).

FLOPs: 4 head_dim per (query head, attended key) pair (prefill_attention_flops). Bytes from
DRAM: q (4 T q_dim), the attended K/V rows of each kv head (once; the blocks of later rows read
them again from L2), out (2 T q_dim).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, uint64
from numba.cuda import libdevice

from pycalm.config import ModelConfig
from pycalm.errors import PycalmError
from pycalm.kernels.attention import KVCache
from pycalm.kernels.common import STATE_POS, dependent_start, fp8x4_cvt, fp16_encode, h2f2, ldg128

KV_DTYPES = ("fp16", "fp8")
ROWS_A_THREAD = 4  # query rows a thread accumulates (scores and outputs)
KEYS_A_LANE = 2  # keys of a tile a thread scores: the tile is KEYS_A_LANE * LANES keys
MIN_BLOCKS = 2  # blocks an SM must hold at least (the launch bounds)
NEG = -1.0e30  # "no score yet": finite, so exp(NEG - m) is 0 and NEG - NEG is 0, not NaN
SIM = _numba_config.ENABLE_CUDASIM


def default_rows(head_dim: int) -> int:
    """Query rows (position, head) a block: 4096 floats of q in shared memory (16 KB), at most
    64; 16 under the simulator (with 8 lanes: one warp)."""
    if SIM:
        return 16
    return max(ROWS_A_THREAD, min(64, 4096 // head_dim))


def default_lanes() -> int:
    """Threads a row group: 16 (a key tile of 32); 8 under the simulator."""
    return 8 if SIM else 16


def _launch_bounds(threads: int) -> dict:
    """cuda.jit's launch bounds: blocks of `threads`, MIN_BLOCKS of them an SM, so ptxas keeps a
    thread's registers under 65536 / (MIN_BLOCKS threads) (tests/test_ptx.py compiles with them
    and checks that limit). The simulator takes no bounds."""
    return {} if SIM else {"launch_bounds": (threads, MIN_BLOCKS)}


@cuda.jit(device=True, inline=True)
def _exp(x):  # noqa: ANN001, ANN202
    """exp(x) as ex2.approx(x log2 e), as the decode attention takes it."""
    return libdevice.fast_expf(x)


@functools.cache
def prefill_attention_kernel(head_dim: int, group: int, kv_dtype: str, rows: int, lanes: int) -> object:
    """The kernel for a head_dim, group size (query heads a kv head), KV dtype, ROWS query rows
    a block and LANES threads a row group (see the module docstring). The sizes are
    compile-time constants: the per-thread scores and accumulators are fixed-size local arrays
    indexed by unrolled loops, so they live in registers."""
    FP8 = kv_dtype == "fp8"
    HEAD_DIM = head_dim
    GROUP = group
    POSITIONS = rows // group  # query positions a block
    USED_ROWS = POSITIONS * group  # rows that hold a query (the rest of ROWS are padding)
    ROWS = rows
    LANES = lanes
    KEY_TILE = KEYS_A_LANE * lanes  # keys a tile
    DIMS_A_LANE = head_dim // lanes  # output dims a thread
    THREADS = (rows // ROWS_A_THREAD) * lanes
    QK_ROW = head_dim + 1  # floats a row of qs and kvs (+1: the K rows' lanes hit distinct banks)
    P_ROW = KEY_TILE + 1  # floats a row of ps
    ACCS = ROWS_A_THREAD * DIMS_A_LANE  # output accumulators a thread
    SCORES = ROWS_A_THREAD * KEYS_A_LANE  # scores a thread holds of a tile
    SCALE = 1.0 / math.sqrt(head_dim)
    UNIT_ELEMS = 16 if FP8 else 8  # cache elements in a 16-byte load
    ROW_UNITS = head_dim // UNIT_ELEMS  # 16-byte units of a head's K (or V) row
    TILE_UNITS = KEY_TILE * ROW_UNITS
    TILE_LOADS = -(-TILE_UNITS // THREADS)  # 16-byte loads a thread makes a tile

    @cuda.jit(device=True, inline=True)
    def stage_tile(cache, kvs, kt, k_end, g, tid):  # noqa: ANN001, ANN202
        """kvs = the rows kt .. kt + KEY_TILE - 1 of kv head g, decoded to float32 (past k_end:
        row k_end - 1 again, masked later). cache: (seq_len, kv_dim bytes / 8) uint64. Every
        16-byte load of the tile is issued before any is decoded, so a thread's TILE_LOADS loads
        are in flight together: one memory latency a tile."""
        lo = cuda.local.array(TILE_LOADS, uint64)  # constant indices after unrolling: registers
        hi = cuda.local.array(TILE_LOADS, uint64)
        for u in range(TILE_LOADS):
            i = min(tid + u * THREADS, TILE_UNITS - 1)  # past the tile: a repeat, not stored
            key = min(kt + i // ROW_UNITS, k_end - 1)
            lo[u], hi[u] = ldg128(cache, key, g * ROW_UNITS + i % ROW_UNITS)
        for u in range(TILE_LOADS):
            i = tid + u * THREADS
            if i < TILE_UNITS:
                row = i // ROW_UNITS
                d = (i % ROW_UNITS) * UNIT_ELEMS
                for w in range(4):  # the unit's four 32-bit words, lowest address first
                    word = lo[u] if w < 2 else hi[u]
                    if w % 2 == 1:
                        word = word >> uint64(32)
                    if FP8:  # (the decoders take the low 32 bits)
                        f0, f1, f2, f3 = fp8x4_cvt(word)  # e5m2 bytes, lowest address first
                        kvs[row, d + 4 * w] = f0
                        kvs[row, d + 4 * w + 1] = f1
                        kvs[row, d + 4 * w + 2] = f2
                        kvs[row, d + 4 * w + 3] = f3
                    else:
                        f0, f1 = h2f2(word)  # the fp16 at the lower address is the low half
                        kvs[row, d + 2 * w] = f0
                        kvs[row, d + 2 * w + 1] = f1

    @cuda.jit(fastmath=False, cache=True, **_launch_bounds(THREADS))
    def prefill_attention_kernel(q, k_cache, v_cache, state, out, window):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        # q (T, n_heads*HEAD_DIM) f32; caches (seq_len, kv_dim bytes / 8) uint64 holding fp16
        # or e5m2 elements; state i32; out (T, n_heads*HEAD_DIM) f16
        n_rows = q.shape[0]
        pos0 = int32(state[STATE_POS])
        g = int32(cuda.blockIdx.x)  # kv head
        # the block's first query row: the last rows (the most keys) first, the short ones fill
        # the tail of the launch
        t0 = int32((cuda.gridDim.y - 1 - cuda.blockIdx.y) * POSITIONS)
        tid = cuda.threadIdx.x
        group_row = int32(tid // LANES) * ROWS_A_THREAD  # the thread's first row
        lane = int32(tid % LANES)
        qs = cuda.shared.array((ROWS, QK_ROW), float32)  # q rows times 1/sqrt(HEAD_DIM)
        kvs = cuda.shared.array((KEY_TILE, QK_ROW), float32)  # the tile's K rows, then its V rows
        ps = cuda.shared.array((ROWS, P_ROW), float32)  # the tile's p = exp(score - m)

        # 1. the block's q rows (padding rows: zeros)
        for i in range(tid, ROWS * HEAD_DIM, THREADS):
            r = i // HEAD_DIM
            d = i % HEAD_DIM
            t = t0 + r // GROUP
            val = float32(0.0)
            if r < USED_ROWS and t < n_rows:
                val = q[t, (g * GROUP + r % GROUP) * HEAD_DIM + d] * float32(SCALE)
            qs[r, d] = val

        last = min(t0 + POSITIONS, n_rows) - 1  # the block's last query row
        k_end = pos0 + last + 1  # keys past the last row's position are never read
        k_begin = int32(0)
        if window > 0:
            k_begin = max(int32(0), pos0 + t0 + 1 - window)
        qpos = cuda.local.array(ROWS_A_THREAD, int32)  # the position of each of the thread's rows
        m = cuda.local.array(ROWS_A_THREAD, float32)  # running max of the row's scores
        lsum = cuda.local.array(ROWS_A_THREAD, float32)  # running sum of exp(score - m)
        acc = cuda.local.array(ACCS, float32)  # unnormalised output, dims lane + LANES j
        for i in range(ROWS_A_THREAD):
            qpos[i] = pos0 + t0 + (group_row + i) // GROUP
            m[i] = float32(NEG)
            lsum[i] = float32(0.0)
            for j in range(DIMS_A_LANE):
                acc[i * DIMS_A_LANE + j] = float32(0.0)
        scores = cuda.local.array(SCORES, float32)  # the tile's, of the thread's rows and keys
        k_vals = cuda.local.array(KEYS_A_LANE, float32)  # k at one dim of the thread's keys
        v_vals = cuda.local.array(DIMS_A_LANE, float32)  # a V row's elements at the thread's dims

        for kt in range(k_begin, k_end, KEY_TILE):
            cuda.syncthreads()  # qs is written; the last tile's P V is done with kvs and ps
            # 2. the tile's K rows (past k_end: the last row again, masked below)
            stage_tile(k_cache, kvs, kt, k_end, g, tid)
            cuda.syncthreads()  # the K tile is in kvs

            # 3. scores of the thread's rows x keys
            for i in range(SCORES):
                scores[i] = float32(0.0)
            for d in range(HEAD_DIM):
                for j in range(KEYS_A_LANE):
                    k_vals[j] = kvs[lane + LANES * j, d]
                for i in range(ROWS_A_THREAD):
                    q_val = qs[group_row + i, d]
                    for j in range(KEYS_A_LANE):
                        scores[i * KEYS_A_LANE + j] += q_val * k_vals[j]

            # 4. online softmax of each row
            for i in range(ROWS_A_THREAD):
                mx = float32(NEG)
                for j in range(KEYS_A_LANE):
                    key = kt + lane + LANES * j
                    ok = key < k_end and key <= qpos[i] and (window <= 0 or key > qpos[i] - window)
                    if not ok:
                        scores[i * KEYS_A_LANE + j] = float32(NEG)
                    mx = max(mx, scores[i * KEYS_A_LANE + j])
                off = LANES // 2
                while off > 0:  # xor tree inside the row group: every lane gets the tile max
                    mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, off))
                    off //= 2
                m_new = max(m[i], mx)
                alpha = _exp(m[i] - m_new)
                psum = float32(0.0)
                for j in range(KEYS_A_LANE):
                    p = _exp(scores[i * KEYS_A_LANE + j] - m_new)
                    p = p if scores[i * KEYS_A_LANE + j] > float32(NEG) else float32(0.0)  # masked: 0
                    ps[group_row + i, lane + LANES * j] = p
                    psum += p
                off = LANES // 2
                while off > 0:  # xor tree inside the row group: every lane gets the tile's sum
                    psum += cuda.shfl_xor_sync(0xFFFFFFFF, psum, off)
                    off //= 2
                lsum[i] = lsum[i] * alpha + psum
                m[i] = m_new
                for j in range(DIMS_A_LANE):
                    acc[i * DIMS_A_LANE + j] *= alpha
            cuda.syncthreads()  # every p of the tile is in ps; every thread is done with K

            # 5. the tile's V rows
            stage_tile(v_cache, kvs, kt, k_end, g, tid)
            cuda.syncthreads()  # the V tile is in kvs

            # 6. out += P V
            for kk in range(min(KEY_TILE, k_end - kt)):  # keys past k_end have p = 0
                for j in range(DIMS_A_LANE):
                    v_vals[j] = kvs[kk, lane + LANES * j]
                for i in range(ROWS_A_THREAD):
                    p = ps[group_row + i, kk]
                    for j in range(DIMS_A_LANE):
                        acc[i * DIMS_A_LANE + j] += p * v_vals[j]

        # 7. the rows' outputs (every row with a query has at least its own key: lsum > 0)
        for i in range(ROWS_A_THREAD):
            r = group_row + i
            t = t0 + r // GROUP
            if r < USED_ROWS and t < n_rows:
                col = (g * GROUP + r % GROUP) * HEAD_DIM + lane
                inv = float32(1.0) / lsum[i]
                for j in range(DIMS_A_LANE):
                    out[t, col + LANES * j] = fp16_encode(acc[i * DIMS_A_LANE + j] * inv)

    return prefill_attention_kernel


def prefill_attention(
    q: object,
    cache: KVCache,
    state: object,
    out: object,
    cfg: ModelConfig,
    *,
    stream: object,
    rows: int | None = None,
    lanes: int | None = None,
) -> None:
    """out (T, n_heads * head_dim) f16 = attention of the T rows of q (T, n_heads * head_dim)
    f32 at positions pos0 = state[STATE_POS] .. pos0 + T - 1 over one layer's cache, whose rows
    0 .. pos0 + T - 1 are written (pycalm.kernels.rows.qkv_rows writes the block's own).

    cache: a pycalm.kernels.attention.KVCache (.k, .v (seq_len, kv_dim) float16 or uint8 e5m2,
    .dtype); cfg: n_heads, n_kv_heads, head_dim and sliding_window are read from it. rows,
    lanes: the block shape (default_rows, default_lanes; scripts/kernels/prefill_attention.py
    times others). Reference: pycalm.reference.prefill_attention_ref."""
    n_heads, n_kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if cache.dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {cache.dtype!r} (one of {', '.join(KV_DTYPES)})")
    group = n_heads // n_kv_heads
    rows = default_rows(head_dim) if rows is None else rows
    lanes = default_lanes() if lanes is None else lanes
    if head_dim % 16:
        raise PycalmError(f"head_dim {head_dim} is not a multiple of 16 (16-byte loads of the cache)")
    if head_dim % lanes or lanes > 32 or lanes & (lanes - 1):
        raise PycalmError(f"head_dim {head_dim} is not a multiple of {lanes} lanes (a power of two up to 32)")
    if rows % ROWS_A_THREAD or rows < group:
        raise PycalmError(
            f"{rows} query rows a block: a multiple of {ROWS_A_THREAD}, at least the group {group}"
        )
    threads = (rows // ROWS_A_THREAD) * lanes
    if threads % 32 or threads > 1024:
        raise PycalmError(f"{rows} rows of {lanes} lanes make {threads} threads, not whole warps up to 1024")
    n_rows = q.shape[0]
    if q.shape[1] != n_heads * head_dim or out.shape[0] != n_rows or out.shape[1] != q.shape[1]:
        raise PycalmError(
            f"prefill_attention: q {q.shape} and out {out.shape} are not (T, {n_heads * head_dim})"
        )
    kernel = prefill_attention_kernel(head_dim, group, cache.dtype, rows, lanes)
    grid = (n_kv_heads, -(-n_rows // (rows // group)))
    k64, v64 = cache.k.view(np.uint64), cache.v.view(np.uint64)  # 16-byte aligned rows: ldg128
    kernel[grid, threads, stream](q, k64, v64, state, out, int32(cfg.sliding_window))


def prefill_attention_bytes(n_rows: int, pos0: int, cfg: ModelConfig, kv_dtype: str) -> int:
    """Bytes from DRAM: q (f32) and out (f16), and each attended K / V row once (the blocks of
    later rows read them again from L2)."""
    first = 0 if cfg.sliding_window <= 0 else max(0, pos0 + 1 - cfg.sliding_window)
    kv_rows = pos0 + n_rows - first
    return n_rows * cfg.q_dim * (4 + 2) + 2 * kv_rows * cfg.kv_dim * (1 if kv_dtype == "fp8" else 2)


def prefill_attention_flops(n_rows: int, pos0: int, cfg: ModelConfig) -> int:
    """Multiply-adds x 2 of the scores and of P V: 4 head_dim per (query head, attended key)."""
    pos = np.arange(pos0, pos0 + n_rows)
    window = cfg.sliding_window
    keys = pos + 1 if window <= 0 else np.minimum(pos + 1, window)
    return int(4 * cfg.head_dim * cfg.n_heads * keys.sum())


_SIG = "void(float32[:, ::1], uint64[:, ::1], uint64[:, ::1], int32[::1], float16[:, ::1], int32)"


def _compile_check() -> list[tuple[object, str, int]]:
    """(kernel, signature, register limit) for the shapes of the models in use: head_dim 64
    (groups 3, 7, 8) and 128 (groups 1, 4), both KV dtypes, the default blocks of a real GPU
    (not the simulator's)."""
    checks = []
    for kv_dtype in KV_DTYPES:
        for head_dim, group in ((64, 3), (64, 7), (64, 8), (128, 1), (128, 4)):
            rows = max(ROWS_A_THREAD, min(64, 4096 // head_dim))
            kernel = prefill_attention_kernel(head_dim, group, kv_dtype, rows, 16)
            threads = (rows // ROWS_A_THREAD) * 16
            registers = min(255, 65536 // (MIN_BLOCKS * threads))  # what the launch bounds allow
            checks.append((kernel, _SIG, registers))
    return checks


COMPILE_CHECK = _compile_check()
