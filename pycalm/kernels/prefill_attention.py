"""Block-causal attention: T query rows at positions pos0 .. pos0 + T - 1 over the KV cache, on
the tensor cores.

Reference: pycalm.cpu.reference.prefill_attention_ref. For query row t (position p = pos0 + t) and
query head h (kv head g = h // (n_heads // n_kv_heads)) the math is the decode attention's
(pycalm.cpu.reference.attention_ref at n_pos = p + 1), row by row:
  keys j in [start, p], start = max(0, p + 1 - window) with a sliding window, else 0
  score_j = q_t,h . k_j,g / sqrt(head_dim);  P = softmax(score);  out_t,h = sum_j P_j v_j,g
The caches hold (seq_len, n_kv_heads * head_dim), fp16 or fp8 e5m2, with the block's own K/V rows
already written (pycalm.kernels.rows.qkv_rows); q is (T, n_heads * head_dim) float32 and out
(T, n_heads * head_dim) float16, the wo matmul's input.

GPU: flash-attention 2 on mma.sync m16n8k16 (pycalm.kernels.tensorcore: fp16 operands, float32
accumulators). Grid (n_kv_heads, ceil(T / POSITIONS), splits), WARPS warps a block. A block takes
ROWS = 16 WARPS (position, query head) rows of one kv head: row r is position t0 + r // group,
head g group + r % group (POSITIONS = ROWS // group positions; the rows past POSITIONS group
are padding), so every K/V tile staged serves all the heads of the group. Warp w owns rows
16 w .. 16 w + 15; in a 16 x 8 accumulator tile a lane holds rows lane >> 2 and (lane >> 2) + 8,
columns 2 (lane & 3) and 2 (lane & 3) + 1. The blocks of the last rows (the most keys) start
first, t0 = (ceil(T / POSITIONS) - 1 - b) POSITIONS, so the short ones fill the launch's tail.

1. once: the block's q rows times 1/sqrt(head_dim) into shared memory as fp16 pairs, the high
   part q_hi = fp16(q) in the K buffer and the low part q_lo = fp16(q - q_hi) in the V buffer,
   a thread's loads all issued before the first is split (a few-row pass's blocks run a tile
   or two, so this wait on memory is a large part of their time); each warp takes the A
   fragments of its 16 rows of both into registers (ldmatrix). Barrier; the buffers then hold
   the K and V tiles.
2. a tile of KEYS keys: the K and V rows as stored (key-major; e5m2 bytes become the top bytes
   of fp16 halves, exact), THREADS / KEYS threads a key row (two at 4 warps), each a row's
   16-byte units h, h + 2, ..., every unit of a thread's in flight at once: fp16 by cp.async
   straight into shared memory, e5m2 by 16-byte loads into registers, all issued before the
   first is widened and stored. (Loaded and stored a unit at a time, the staging waited on
   memory eight times in turn a tile at 64 keys and head_dim 128: a Llama-3-8B layer's prompt
   of 2,048 rows took 0.523 ms fp16 / 0.444 fp8 against 0.419 / 0.400 now, H100, 2026-12-07;
   32 and 64 rows over 160 keys 29-32 us either way.) K is then the "col" B
   operand of Q K^T that ldmatrix reads as it is; V, the "row" operand of P V, is read by
   ldmatrix's .trans form. Keys past the block's last position are stored as zeros: their p
   is 0, and 0 times a stale row could be NaN. Barrier.
3. S = Q_hi K^T + Q_lo K^T: KEYS / 8 tiles of 8 keys, head_dim / 16 k-steps, two mma each.
4. masking (a key after the row's position or before its window, or a padding row: p = 0) and
   the online softmax per row: the tile's max over a lane's 2 KEYS / 8 scores and the row's 4
   lanes (xor shuffles 1, 2), m_new = max(m, tile max), alpha = exp(m - m_new), p = exp(s -
   m_new); l (the lane's part of the row's sum) and the output accumulators times alpha.
5. O += P_hi V + P_lo V: the S accumulators of key tiles 2k and 2k + 1, split into fp16 high and
   low parts, are exactly the A fragments of k-step k (registers to registers, no shared
   memory); the B fragments of V come by ldmatrix .trans. Barrier (the next tile overwrites K,
   V).
6. l summed over the row's 4 lanes; out = O / l, as fp16.
7. splits (a launch of fewer blocks than a wave, with a scratch: split_count): the block's key
   tiles fall in `splits` runs of at least SPLIT_TILES tiles, one a block (blockIdx.z; at most
   gridDim.z runs, the blocks past them return at once; a last run past the last tile is
   empty, and its block stages no q). Before step 6 each block writes its lanes' O
   accumulators, m and partial l to its slot of the scratch, a thread's words THREADS apart;
   the last block of the splits to finish (common.last_to_arrive) reads every split's, in split
   order (its lanes hold the same rows and columns in each), scales each by exp(m_split - max
   m) and goes on to step 6 with the sums. Its loads are written out without branches, every
   split's m at once and then MERGE_GROUP splits' partials at a time (136 loads before the
   group's first FMA in the machine code), where a loop of a split a turn waited on L2 twice a
   split. Why: a block runs its tiles one after another, each
   a chain of ~1,700 instructions at one warp a scheduler (~4 us on an H100), so a launch of
   16-32 blocks over 4,000 keys took 411-419 us a layer unsplit, 74-92 split.

Numerics: K and V are fp16 (or e5m2, exact in fp16). q and p are not: each is carried as the
sum of two fp16 halves, hi + lo, which holds it to about 2^-22 relative (below fp16's smallest
normal the low part keeps 2^-24 absolute), so the products the tensor cores sum in float32 are
those of the float32 operands to float32 precision, as a float32 kernel's would be, at twice
the mma work. (A single fp16 rounding of q and p, as most flash-attention kernels do, is about
twice as fast and off by up to 2^-11 relative in each score and weight:
scripts/kernels/prefill_attention.py times both, docs/BENCHMARKS.md has the kernel's figure.)

Shapes (the defaults): WARPS 4 (ROWS 64), KEYS 64, 128 threads; shared memory (ROWS or KEYS) x
(head_dim + 8) halves for Q_hi / K and as many for Q_lo / V (rows padded by 16 bytes, so
the 8 rows of an ldmatrix fall in 8 distinct groups of 4 banks): 35 KB at head_dim 128. The
launch bounds ask for 3 blocks an SM at head_dim 64 and 2 at 128 (`min_blocks`: ptxas keeps
the registers under 170 / 255 a thread without spilling). A lane
keeps head_dim / 2 words of Q fragments, KEYS / 2 scores and head_dim / 2 accumulators in
registers. Under the simulator (a Python thread per CUDA thread) a block is one warp and a tile
16 keys, so the tests' short contexts still cover several tiles.

FLOPs: 4 head_dim per (query head, attended key) pair (prefill_attention_flops; the mma work is
twice that). Bytes from DRAM: q (4 T q_dim), the attended K/V rows of each kv head (once; the
blocks of later rows read them again from L2), out (2 T q_dim).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, uint64
from numba.cuda import libdevice

from pycalm.errors import PycalmError
from pycalm.kernels.attention import KVCache
from pycalm.kernels.common import (
    STATE_POS,
    STATE_ROWS,
    dependent_start,
    fp16_encode,
    h2f2,
    last_to_arrive,
    ldg128,
    prmt,
)
from pycalm.kernels.matmul import sm_count
from pycalm.kernels.tensorcore import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_16816,
    pack_f16x2,
    sts128,
)
from pycalm.model.config import ModelConfig

KV_DTYPES = ("fp16", "fp8")
SIM = _numba_config.ENABLE_CUDASIM
WARPS = 1 if SIM else 4  # warps a block: 16 query rows each
MAX_SPLITS = 16  # splits of a block's keys at most (split_count)
# key tiles a split takes at least: a merge costs about as much as a few tiles. A layer of the 8B
# (`scripts/kernels/prefill_attention.py --variants shipped,unsplit,s1,s2 --rows 17,32,64`, H100,
# 2026-12-07, one call), us at 17 / 32 / 64 rows: at 160 keys (3 tiles) unsplit 29 / 30 / 31, a
# tile a split 29 / 32 / 33, two or four (unsplit there) 29 / 29-30 / 30; at 4,000 positions
# unsplit 412 / 415 / 404, a tile 62 / 65 / 90, two tiles 68 / 66 / 90, four 70 / 79 / 90
SPLIT_TILES = 1 if SIM else 2
MERGE_GROUP = 2  # splits whose partials the merge loads at a time
KEYS = 16 if SIM else 64  # keys a tile (a multiple of 16)
NEG = -1.0e30  # "no score yet": finite, so NEG - NEG is 0, not NaN
PAD = 4  # words of padding after each shared row (16 bytes)
FULL = 0xFFFFFFFF


def min_blocks(head_dim: int) -> int:
    """Blocks an SM must hold at least (the launch bounds): 3 at head_dim 64 and below, 2 above
    (a lane's fragments and accumulators grow with head_dim)."""
    return 3 if head_dim <= 64 else 2


def _launch_bounds(threads: int, blocks: int) -> dict:
    """cuda.jit's launch bounds: blocks of `threads`, `blocks` of them an SM, so ptxas keeps a
    thread's registers under 65536 / (blocks threads) (tests/test_ptx.py compiles with them
    and checks that limit). The simulator takes no bounds."""
    return {} if SIM else {"launch_bounds": (threads, blocks)}


@cuda.jit(device=True, inline=True)
def _lo(u: int) -> int:
    """The low 32 bits of a uint64 as int32."""
    return int32(u & uint64(0xFFFFFFFF))


@cuda.jit(device=True, inline=True)
def _hi(u: int) -> int:
    """The high 32 bits of a uint64 as int32."""
    return int32(u >> uint64(32))


@cuda.jit(device=True, inline=True)
def _split(x: float, y: float) -> tuple[int, int]:
    """Two floats as two fp16 pairs: (fp16(x), fp16(y)) and the remainders (fp16(x - that),
    fp16(y - that)), each pair a word (x, the lower index, in the low half)."""
    hi = pack_f16x2(x, y)
    xh, yh = h2f2(hi)  # exact
    return hi, pack_f16x2(x - xh, y - yh)


@cuda.jit(device=True, inline=True)
def _mma_acc(acc, n, a0, a1, a2, a3, b0, b1):  # noqa: ANN001, ANN202
    """acc[n .. n + 3] += the 16 x 8 product of the A fragment (a0..a3) and the B fragment
    (b0, b1): one mma.sync m16n8k16 on the accumulators of one tile (acc: a local array,
    indices constant after unrolling, so it stays in registers)."""
    acc[n], acc[n + 1], acc[n + 2], acc[n + 3] = mma_16816(
        a0, a1, a2, a3, b0, b1, acc[n], acc[n + 1], acc[n + 2], acc[n + 3]
    )


@functools.cache
def prefill_attention_kernel(
    head_dim: int,
    group: int,
    kv_dtype: str,
    warps: int,
    keys: int,
    paged: bool = False,
    split_tiles: int = SPLIT_TILES,
) -> object:
    """The kernel for a head_dim (a multiple of 16), group size (query heads a kv head, at most
    16 warps), KV dtype, warps a block and keys a tile (a multiple of 16); see the module
    docstring. The sizes are compile-time constants: the fragments are fixed-size local arrays
    indexed by unrolled loops, so they live in registers. paged: the cache is a paged pool read
    through one sequence's block table (two more arguments, table and page_log2), and the live
    rows are state[STATE_ROWS] (a batched pass's padding rows past them attend to nothing, and
    come out zero). split_tiles: the key tiles a split takes at least (step 7)."""
    D = head_dim
    ROWS = 16 * warps  # (position, head) rows a block
    THREADS = 32 * warps
    POSITIONS = ROWS // group  # query positions a block
    USED = POSITIONS * group  # rows that hold a query
    KSTEPS = D // 16  # k-steps of Q K^T
    QF = 4 * KSTEPS  # words of a warp's Q fragments (hi, and again lo)
    S_TILES = keys // 8  # 8-key tiles of S
    SW = 4 * S_TILES  # S accumulators a lane
    PSTEPS = keys // 16  # k-steps of P V
    O_TILES = D // 8  # 8-dim tiles of O
    OW = 4 * O_TILES  # O accumulators a lane
    ROW = D // 2 + PAD  # words a Q / K / V row in shared memory
    QK_WORDS = max(ROWS, keys) * ROW
    V_WORDS = max(ROWS, keys) * ROW  # (it holds q_lo first)
    QITER = ROWS * (D // 2) // THREADS  # q pairs a thread stages (D / 4)
    FW = 2 * MERGE_GROUP  # the merge's factors a group of splits
    FP8 = kv_dtype == "fp8"
    E = 16 if FP8 else 8  # cache elements a 16-byte load
    UNITS = D // E  # 16-byte loads a head's K (or V) row
    KV_UNITS = keys * UNITS  # 16-byte units of a tile's K (and of its V)
    KV_ITER = -(-KV_UNITS // THREADS)  # units a thread stages
    # a thread's units of a tile: TPR threads a key row, thread h of a row its units h, h + TPR,
    # ... (a row and its address found once a tile, the units at constant offsets from it);
    # where the block's threads do not divide so, unit i = tid + it THREADS
    ROWWISE = THREADS % keys == 0 and UNITS % (THREADS // keys) == 0
    TPR = THREADS // keys if ROWWISE else 1
    KA = 2 * KV_ITER if FP8 else 1  # uint64 words of a thread's K (and V) units in registers (e5m2)
    SCALE = 1.0 / math.sqrt(head_dim)

    @cuda.jit(device=True, inline=True)
    def cache_row(j, table, page_log2):  # noqa: ANN001, ANN202
        """The cache row of key j: j itself, or paged, pool row table[j >> page_log2] <<
        page_log2 | (j & (page - 1))."""
        if paged:
            return (table[j >> page_log2] << page_log2) | (j & ((1 << page_log2) - 1))
        return j

    @cuda.jit(device=True, inline=True)
    def store_e5m2(smem, word, a, b, u):  # noqa: ANN001, ANN202
        """A 16-byte unit of e5m2 bytes (a, b) into smem[word .. word + 8) as 16 fp16 halves,
        each byte the top byte of a half (prmt; selector nibble 4 takes a zero byte of the
        second operand), by two 16-byte stores, units u with (u >> 2) & 1 their second half
        first. That order gave the 8 lanes of a quarter-warp 8 distinct groups of 4 banks when
        they held 8 consecutive units of a row; two threads a row (ROWWISE) give them 4 rows of
        two units each, where it leaves 2-way conflicts (not yet timed)."""
        w0, w1, w2, w3 = _lo(a), _hi(a), _lo(b), _hi(b)
        lo = (
            prmt(w0, int32(0), int32(0x1404)),  # bytes 0, 1
            prmt(w0, int32(0), int32(0x3424)),  # bytes 2, 3
            prmt(w1, int32(0), int32(0x1404)),
            prmt(w1, int32(0), int32(0x3424)),
        )
        hi = (
            prmt(w2, int32(0), int32(0x1404)),
            prmt(w2, int32(0), int32(0x3424)),
            prmt(w3, int32(0), int32(0x1404)),
            prmt(w3, int32(0), int32(0x3424)),
        )
        if (u >> 2) & 1:
            sts128(smem, word + 4, hi[0], hi[1], hi[2], hi[3])
            sts128(smem, word, lo[0], lo[1], lo[2], lo[3])
        else:
            sts128(smem, word, lo[0], lo[1], lo[2], lo[3])
            sts128(smem, word + 4, hi[0], hi[1], hi[2], hi[3])

    @cuda.jit(device=True, inline=True)
    def unit_at(tid, it):  # noqa: ANN001, ANN202
        """The thread's it-th unit of a tile: (kr, u), key j0 + kr, dims u E .. u E + E - 1."""
        if ROWWISE:
            return tid // TPR, it * TPR + tid % TPR
        i = tid + it * THREADS
        return i // UNITS, i % UNITS

    @cuda.jit(device=True, inline=True)
    def stage_unit(k_cache, v_cache, qk, vs, ka, va, it, kr, u, ok, row, g):  # noqa: ANN001, ANN202
        """A thread's it-th unit of the tile: key j0 + kr (ok: at most last_pos; row: its cache
        row, in bounds either way), dims u E .. u E + E - 1. fp16: its K and V copies started
        (zero-filled where not ok); e5m2: loaded into ka, va (zeros where not ok)."""
        col = g * UNITS + u  # (16-byte units of the row)
        if not FP8:
            nbytes = 16 if ok else 0
            cp_async16(qk, kr * ROW + u * 4, k_cache, row, 8 * col, nbytes)
            cp_async16(vs, kr * ROW + u * 4, v_cache, row, 8 * col, nbytes)
        elif ok:
            ka[2 * it], ka[2 * it + 1] = ldg128(k_cache, row, col)
            va[2 * it], va[2 * it + 1] = ldg128(v_cache, row, col)
        else:
            ka[2 * it], ka[2 * it + 1] = uint64(0), uint64(0)
            va[2 * it], va[2 * it + 1] = uint64(0), uint64(0)

    @cuda.jit(device=True, inline=True)
    def stage_kv(k_cache, v_cache, qk, vs, ka, va, j0, last_pos, g, tid, table, page_log2):  # noqa: ANN001, ANN202
        """Step 2: the K and V rows of keys j0 .. j0 + keys - 1 (zeros past last_pos), a thread's
        units of K rows and of V rows. fp16: every copy started at once by cp.async (no
        registers; a key past last_pos zero-filled), then one wait. e5m2: every unit loaded into
        registers (ka, va) before the first is widened to fp16 halves (prmt) and stored, so the
        loads are in flight together: one wait on memory a tile, not one a unit."""
        # ROWWISE: the thread's key row and its cache row found once (paged: one read of the
        # block table; the copies' memory clobbers would keep the compiler from sharing them)
        row = cache_row(min(j0 + tid // TPR, last_pos), table, page_log2) if ROWWISE else 0
        for it in range(KV_ITER):
            if KV_UNITS % THREADS == 0 or tid + it * THREADS < KV_UNITS:
                kr, u = unit_at(tid, it)
                if not ROWWISE:
                    row = cache_row(min(j0 + kr, last_pos), table, page_log2)
                stage_unit(k_cache, v_cache, qk, vs, ka, va, it, kr, u, j0 + kr <= last_pos, row, g)
        if not FP8:
            cp_async_commit()
            cp_async_wait_all()  # this thread's copies have landed (the barrier after: everyone's)
            return
        for it in range(KV_ITER):
            if KV_UNITS % THREADS == 0 or tid + it * THREADS < KV_UNITS:
                kr, u = unit_at(tid, it)
                store_e5m2(qk, kr * ROW + u * (E // 2), ka[2 * it], ka[2 * it + 1], u)
                store_e5m2(vs, kr * ROW + u * (E // 2), va[2 * it], va[2 * it + 1], u)

    @cuda.jit(device=True, inline=True)
    def stage_q(q, q_hi, q_lo, t0, g, n_rows, tid, xs, ys):  # noqa: ANN001, ANN202
        """The block's q rows times 1/sqrt(D) as fp16 pairs: the high halves into q_hi, the low
        into q_lo (padding rows and rows past T: zeros). A thread's QITER pairs are all loaded
        before the first is split, so their loads are in flight together (one wait on memory,
        not one a pair)."""
        for it in range(QITER):
            i = tid + it * THREADS
            r, c = i // (D // 2), i % (D // 2)
            t = t0 + r // group
            xs[it], ys[it] = float32(0.0), float32(0.0)
            if r < USED and t < n_rows:
                col = (g * group + r % group) * D + 2 * c
                xs[it], ys[it] = q[t, col], q[t, col + 1]
        for it in range(QITER):
            i = tid + it * THREADS
            r, c = i // (D // 2), i % (D // 2)
            hi, lo = _split(xs[it] * float32(SCALE), ys[it] * float32(SCALE))
            q_hi[r * ROW + c] = hi
            q_lo[r * ROW + c] = lo

    @cuda.jit(device=True, inline=True)
    def attend(q, k_cache, v_cache, state, out, window, part, count, table, page_log2):  # noqa: ANN001, ANN202
        """The kernel's work (see the module docstring); part, count: the split launch's scratch
        (unread with one split); table, page_log2: paged's (unread else)."""
        # q (T, n_heads*D) f32; caches (seq_len, kv_dim) fp16, or e5m2 as (seq_len, kv_dim / 8)
        # uint64; state i32; out (T, n_heads*D) f16
        qk = cuda.shared.array(QK_WORDS, int32)  # (ROWS, D) q_hi halves, then (keys, D) K halves
        vs = cuda.shared.array(V_WORDS, int32)  # (ROWS, D) q_lo halves, then (keys, D) V halves
        q_hi = cuda.local.array(QF, int32)  # this warp's A fragments of q_hi and q_lo
        q_lo = cuda.local.array(QF, int32)
        s = cuda.local.array(SW, float32)  # S accumulators, then p
        o = cuda.local.array(OW, float32)  # O accumulators
        # e5m2: a thread's units of a K tile and of a V tile as loaded, (KV_ITER, 2) uint64 each
        ka = cuda.local.array(KA, uint64)
        va = cuda.local.array(KA, uint64)
        xs = cuda.local.array(QITER, float32)  # a thread's q pairs, staged at once
        ys = cuda.local.array(QITER, float32)
        # "this block merges" (last_to_arrive), then the splits and this block's split: kept here
        # across the tile loop, not in registers (the loop holds 250 of a thread's 255)
        meta = cuda.shared.array(3, int32)
        fs = cuda.local.array(FW, float32)  # the merge's factors (rows r0, r1) of a group of splits
        n_rows = q.shape[0]
        if paged:  # a batched pass's live rows (the bucket's padding rows attend to nothing)
            n_rows = min(n_rows, int32(state[STATE_ROWS]))
        pos0 = int32(state[STATE_POS])
        g = int32(cuda.blockIdx.x)  # kv head
        t0 = int32((cuda.gridDim.y - 1 - cuda.blockIdx.y) * POSITIONS)  # the longest blocks first
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        quad = lane & 3
        last_pos = pos0 + min(t0 + POSITIONS, n_rows) - 1  # the block's last query position
        first_key = int32(0)
        if window > 0:
            first_key = max(int32(0), pos0 + t0 + 1 - window)

        # this split's key tiles: the block's tiles (first_key's to last_pos's) in `splits` runs
        # of `per` (the last shorter or empty: then the block stages no q), as many as give
        # each split_tiles tiles at least, at most gridDim.z (the blocks past them return at
        # once); one run: the unsplit kernel
        first_tile = first_key // keys
        n_tiles = last_pos // keys - first_tile + 1
        splits, z = max(int32(1), min(int32(cuda.gridDim.z), n_tiles // split_tiles)), int32(cuda.blockIdx.z)
        if z >= splits:
            return
        per = -(-n_tiles // splits)
        j0 = (first_tile + z * per) * keys
        j_end = min(last_pos, (first_tile + (z + 1) * per) * keys - 1)

        # 1. the A fragments of q_hi and q_lo. ldmatrix rows: lane & 15 of the warp's 16,
        # 16-byte chunk lane >> 4 of each k-step's two
        a_row = (warp * 16 + (lane & 15)) * ROW + 4 * (lane >> 4)
        if j0 <= j_end:
            stage_q(q, qk, vs, t0, g, n_rows, tid, xs, ys)
        cuda.syncthreads()  # q_hi and q_lo are staged
        for kk in range(KSTEPS):
            q_hi[4 * kk], q_hi[4 * kk + 1], q_hi[4 * kk + 2], q_hi[4 * kk + 3] = ldmatrix_x4(
                qk, a_row + 8 * kk
            )
            q_lo[4 * kk], q_lo[4 * kk + 1], q_lo[4 * kk + 2], q_lo[4 * kk + 3] = ldmatrix_x4(
                vs, a_row + 8 * kk
            )

        # the lane's two rows: r0 = 16 warp + (lane >> 2) and r0 + 8
        r0 = warp * 16 + (lane >> 2)
        r1 = r0 + 8
        pos_r0 = pos0 + t0 + r0 // group
        pos_r1 = pos0 + t0 + r1 // group
        ok0 = r0 < USED and t0 + r0 // group < n_rows
        ok1 = r1 < USED and t0 + r1 // group < n_rows
        m0, m1 = float32(NEG), float32(NEG)  # running max of each row's scores
        l0, l1 = float32(0.0), float32(0.0)  # this lane's part of each row's sum of p
        for i in range(OW):
            o[i] = float32(0.0)
        # ldmatrix rows of a B operand (two 8-row tiles, two 16-byte chunks): row (lane & 7) +
        # 8 (lane >> 4), chunk (lane >> 3) & 1
        b_row = ((lane & 7) + 8 * (lane >> 4)) * ROW + 4 * ((lane >> 3) & 1)
        # V through .trans (matrices: keys 0-7 | 8-15 of dims 0-7, then of dims 8-15): row
        # (lane & 7) + 8 ((lane >> 3) & 1), chunk lane >> 4
        v_row = ((lane & 7) + 8 * ((lane >> 3) & 1)) * ROW + 4 * (lane >> 4)
        if tid == 0:
            meta[1], meta[2] = splits, z
        cuda.syncthreads()  # every warp holds its q fragments: qk takes K tiles; meta is set

        while j0 <= j_end:
            # 2. the K and V tiles, key-major; keys past last_pos: zeros
            stage_kv(k_cache, v_cache, qk, vs, ka, va, j0, last_pos, g, tid, table, page_log2)
            cuda.syncthreads()  # the tile is staged

            # 3. S = q_hi K^T + q_lo K^T
            for i in range(SW):
                s[i] = float32(0.0)
            for kk in range(KSTEPS):
                for p in range(S_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(qk, b_row + p * 16 * ROW + 8 * kk)  # keys 16p ..
                    for half in range(2):
                        n = 4 * (2 * p + half)
                        c0, c1 = (b0, b1) if half == 0 else (b2, b3)
                        _mma_acc(
                            s, n, q_hi[4 * kk], q_hi[4 * kk + 1], q_hi[4 * kk + 2], q_hi[4 * kk + 3], c0, c1
                        )
                        _mma_acc(
                            s, n, q_lo[4 * kk], q_lo[4 * kk + 1], q_lo[4 * kk + 2], q_lo[4 * kk + 3], c0, c1
                        )

            # 4. masking and the online softmax of the lane's two rows
            mx0, mx1 = float32(NEG), float32(NEG)
            for n in range(S_TILES):
                for c in range(2):
                    key = j0 + 8 * n + 2 * quad + c
                    if not (ok0 and key <= pos_r0 and (window <= 0 or key > pos_r0 - window)):
                        s[4 * n + c] = float32(NEG)
                    if not (ok1 and key <= pos_r1 and (window <= 0 or key > pos_r1 - window)):
                        s[4 * n + 2 + c] = float32(NEG)
                    mx0 = max(mx0, s[4 * n + c])
                    mx1 = max(mx1, s[4 * n + 2 + c])
            mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 1))  # the row's 4 lanes
            mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 2))
            mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 1))
            mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 2))
            new0, new1 = max(m0, mx0), max(m1, mx1)
            alpha0, alpha1 = libdevice.fast_expf(m0 - new0), libdevice.fast_expf(m1 - new1)
            m0, m1 = new0, new1
            l0 *= alpha0
            l1 *= alpha1
            for n in range(O_TILES):
                o[4 * n] *= alpha0
                o[4 * n + 1] *= alpha0
                o[4 * n + 2] *= alpha1
                o[4 * n + 3] *= alpha1
            for n in range(S_TILES):
                for c in range(2):
                    e0, e1 = s[4 * n + c], s[4 * n + 2 + c]
                    p0 = float32(0.0) if e0 <= float32(NEG) else libdevice.fast_expf(e0 - m0)  # masked: 0
                    p1 = float32(0.0) if e1 <= float32(NEG) else libdevice.fast_expf(e1 - m1)
                    s[4 * n + c], s[4 * n + 2 + c] = p0, p1
                    l0 += p0
                    l1 += p1

            # 5. O += p_hi V + p_lo V: the p of key tiles 2 kk, 2 kk + 1 are k-step kk's A fragments
            for kk in range(PSTEPS):
                a0, z0 = _split(s[8 * kk], s[8 * kk + 1])  # row r0, keys 16 kk + 2 quad, + 1
                a1, z1 = _split(s[8 * kk + 2], s[8 * kk + 3])  # row r1
                a2, z2 = _split(s[8 * kk + 4], s[8 * kk + 5])  # row r0, keys 16 kk + 8 + 2 quad, + 1
                a3, z3 = _split(s[8 * kk + 6], s[8 * kk + 7])  # row r1
                for p in range(O_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(vs, v_row + kk * 16 * ROW + 8 * p)  # dims 16p ..
                    for half in range(2):
                        n = 4 * (2 * p + half)
                        c0, c1 = (b0, b1) if half == 0 else (b2, b3)
                        _mma_acc(o, n, a0, a1, a2, a3, c0, c1)
                        _mma_acc(o, n, z0, z1, z2, z3, c0, c1)
            cuda.syncthreads()  # every warp is done with K and V before the next tile's stores
            j0 += keys

        splits, z = meta[1], meta[2]
        if splits > 1:
            # 7. the splits' merge: each writes its lanes' (o, m, l) to its slot, thread by
            # thread; the last to finish reads every split's in split order (its lanes hold the
            # same rows and columns in each) and takes over the block's rows
            blk = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
            slot = (blk * cuda.gridDim.z + z) * (OW + 4) * THREADS + tid
            for i in range(OW):
                part[slot + i * THREADS] = o[i]
            part[slot + OW * THREADS] = m0
            part[slot + (OW + 1) * THREADS] = m1
            part[slot + (OW + 2) * THREADS] = l0
            part[slot + (OW + 3) * THREADS] = l1
            if not last_to_arrive(count, blk, splits, meta, 0):
                return
            if tid == 0:
                count[blk] = 0  # for the next launch
            first = blk * cuda.gridDim.z * (OW + 4) * THREADS + tid  # split 0's slot of this thread
            # the rows' max over the splits: every split's m loaded at once (MAX_SPLITS written
            # out; those past `splits` read the last split's again, without a branch, so the
            # loads issue together): one wait on L2, not one a split
            m0, m1 = float32(NEG), float32(NEG)
            for k in range(MAX_SPLITS):
                at = first + min(k, splits - 1) * (OW + 4) * THREADS
                m0 = max(m0, part[at + OW * THREADS])
                m1 = max(m1, part[at + (OW + 1) * THREADS])
            l0, l1 = float32(0.0), float32(0.0)
            for i in range(OW):
                o[i] = float32(0.0)
            # the sums over the splits in split order, MERGE_GROUP splits' loads at a time (a
            # group's splits past `splits` read the last split's again, with a factor of 0)
            for k0 in range(0, splits, MERGE_GROUP):
                for j in range(MERGE_GROUP):
                    at = first + min(k0 + j, splits - 1) * (OW + 4) * THREADS
                    live = k0 + j < splits
                    # a split with no key of a row has m NEG: its factor is 0 (the row has a key)
                    f0 = libdevice.fast_expf(part[at + OW * THREADS] - m0)
                    f1 = libdevice.fast_expf(part[at + (OW + 1) * THREADS] - m1)
                    fs[2 * j] = f0 if live else float32(0.0)
                    fs[2 * j + 1] = f1 if live else float32(0.0)
                    l0 += part[at + (OW + 2) * THREADS] * fs[2 * j]
                    l1 += part[at + (OW + 3) * THREADS] * fs[2 * j + 1]
                for n in range(O_TILES):
                    for j in range(MERGE_GROUP):
                        at = first + min(k0 + j, splits - 1) * (OW + 4) * THREADS
                        o[4 * n] += part[at + (4 * n) * THREADS] * fs[2 * j]
                        o[4 * n + 1] += part[at + (4 * n + 1) * THREADS] * fs[2 * j]
                        o[4 * n + 2] += part[at + (4 * n + 2) * THREADS] * fs[2 * j + 1]
                        o[4 * n + 3] += part[at + (4 * n + 3) * THREADS] * fs[2 * j + 1]

        # 6. the rows' sums over their 4 lanes, out = O / l (a row with a query has its own key)
        l0 += cuda.shfl_xor_sync(FULL, l0, 1)
        l0 += cuda.shfl_xor_sync(FULL, l0, 2)
        l1 += cuda.shfl_xor_sync(FULL, l1, 1)
        l1 += cuda.shfl_xor_sync(FULL, l1, 2)
        for half in range(2):
            ok = ok0 if half == 0 else ok1
            r = r0 if half == 0 else r1
            t = t0 + r // group
            # paged: a padding row of the bucket comes out zero, so the products after it read
            # finite values (no row reads another's)
            pad = paged and r < USED and n_rows <= t < q.shape[0]
            if ok or pad:
                inv = float32(1.0) / (l0 if half == 0 else l1) if ok else float32(0.0)
                col = (g * group + r % group) * D + 2 * quad
                for n in range(O_TILES):
                    lo = o[4 * n + 2 * half] * inv if ok else float32(0.0)
                    hi = o[4 * n + 2 * half + 1] * inv if ok else float32(0.0)
                    out[t, col + 8 * n] = fp16_encode(lo)
                    out[t, col + 8 * n + 1] = fp16_encode(hi)

    bounds = _launch_bounds(THREADS, min_blocks(head_dim))
    if paged:

        @cuda.jit(fastmath=False, cache=True, **bounds)
        def prefill_attention_paged_kernel(
            q, k_cache, v_cache, state, out, window, part, count, table, page_log2
        ):  # noqa: ANN001, ANN202, E501
            dependent_start()  # in a programmatic graph: wait for the earlier kernels
            attend(q, k_cache, v_cache, state, out, window, part, count, table, page_log2)

        return prefill_attention_paged_kernel

    @cuda.jit(fastmath=False, cache=True, **bounds)
    def prefill_attention_kernel(q, k_cache, v_cache, state, out, window, part, count):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        attend(q, k_cache, v_cache, state, out, window, part, count, state, 0)

    return prefill_attention_kernel


class PrefillScratch(NamedTuple):
    """The split launches' scratch (prefill_attention_scratch); the launches on one stream share
    it. part: float32, a slot of THREADS x (head_dim / 2 + 4) words a (block, split): each
    thread's O accumulators, then the m and l of its two rows; count: int32, the splits of a
    block finished, zero between launches (the merging block resets it)."""

    part: object
    count: object


def block_warps(cfg: ModelConfig) -> int:
    """Warps a block by default: WARPS, more where the group needs them (16 rows a warp)."""
    return max(WARPS, -(-(cfg.n_heads // cfg.n_kv_heads) // 16))


def wave(head_dim: int) -> int:
    """Blocks one wave holds: min_blocks an SM on every SM."""
    return min_blocks(head_dim) * sm_count()


def slot_words(warps: int, head_dim: int) -> int:
    """Words of a (block, split) slot of the scratch: a thread's O accumulators, m and l."""
    return 32 * warps * (head_dim // 2 + 4)


def split_count(blocks: int, head_dim: int) -> int:
    """Splits of the keys for a launch of `blocks` blocks: as many as make one full wave, at
    most MAX_SPLITS; 1 where the blocks fill a wave."""
    return max(1, min(MAX_SPLITS, wave(head_dim) // blocks))


def prefill_attention_scratch(cfg: ModelConfig, stream: object = 0) -> PrefillScratch:
    """The scratch of the split launches of cfg's shape at the default block: a wave's slots
    (split_count keeps a split launch's blocks times splits within one wave)."""
    slots = wave(cfg.head_dim)
    part = cuda.device_array(slots * slot_words(block_warps(cfg), cfg.head_dim), np.float32, stream=stream)
    return PrefillScratch(part, cuda.to_device(np.zeros(slots, np.int32), stream=stream))


def prefill_attention(
    q: object,
    cache: KVCache,
    state: object,
    out: object,
    cfg: ModelConfig,
    *,
    stream: object,
    warps: int | None = None,
    keys: int | None = None,
    table: object = None,
    page_size: int = 0,
    scratch: PrefillScratch | None = None,
    split_tiles: int = SPLIT_TILES,
) -> None:
    """out (T, n_heads * head_dim) f16 = attention of the T rows of q (T, n_heads * head_dim)
    f32 at positions pos0 = state[STATE_POS] .. pos0 + T - 1 over one layer's cache, whose rows
    0 .. pos0 + T - 1 are written (pycalm.kernels.rows.qkv_rows writes the block's own).

    With table (one sequence's (max_pages,) int32 block table, a device array) and page_size (a
    power of two), the cache is a paged pool (pycalm.batch.blocks' layout: position j at pool
    row table[j // page_size] * page_size + j % page_size; pycalm.kernels.rows.qkv_pages writes
    the block's own), and only the first state[STATE_ROWS] rows are live (a batched pass of one
    sequence's prompt chunk, padded to its bucket: pycalm.gpu.batched); the others' out is zero,
    so that the products after it read finite values there. Same sums as the contiguous cache's,
    in the same order.

    With scratch (prefill_attention_scratch), a launch of fewer blocks than a wave splits each
    block's keys over split_count blocks, whose partial sums the last of them merges (a pass of
    a few rows: 16-32 blocks on the 8B shape, each else a chain of tiles over the whole context).

    cache: a pycalm.kernels.attention.KVCache (.k, .v (seq_len, kv_dim) float16 or uint8 e5m2,
    .dtype); cfg: n_heads, n_kv_heads, head_dim and sliding_window are read from it. warps, keys:
    the block shape (default WARPS, KEYS; more warps where the group needs them); split_tiles:
    the key tiles a split takes at least (scripts/kernels/prefill_attention.py's s1 and s2).
    Reference: pycalm.cpu.reference.prefill_attention_ref."""
    n_kv_heads, head_dim = cfg.n_kv_heads, cfg.head_dim
    group = cfg.n_heads // n_kv_heads
    warps = block_warps(cfg) if warps is None else warps
    keys = KEYS if keys is None else keys
    if group > 16 * warps:
        raise PycalmError(f"{16 * warps} query rows a block ({warps} warps): fewer than the group {group}")
    if keys % 16 or keys <= 0:
        raise PycalmError(f"{keys} keys a tile: not a multiple of 16")
    if cache.dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {cache.dtype!r} (one of {', '.join(KV_DTYPES)})")
    if head_dim % 16:
        raise PycalmError(
            f"head_dim {head_dim} is not a multiple of 16 (16-byte loads, the tensor cores' k-step)"
        )
    width = cfg.n_heads * head_dim
    if q.shape[1] != width or out.shape[0] != q.shape[0] or out.shape[1] != width:
        raise PycalmError(f"prefill_attention: q {q.shape} and out {out.shape} are not (T, {width})")
    paged = table is not None
    if paged and (page_size < 1 or page_size & (page_size - 1)):
        raise PycalmError(f"prefill_attention: page size {page_size} is not a power of two")
    kernel = prefill_attention_kernel(head_dim, group, cache.dtype, warps, keys, paged, split_tiles)
    blocks = n_kv_heads * -(-q.shape[0] // ((16 * warps) // group))
    splits = 1 if scratch is None else split_count(blocks, head_dim)
    part, count = (q.reshape(-1), state) if splits == 1 else scratch  # (one split: unread)
    if splits > 1 and (part.size < blocks * splits * slot_words(warps, head_dim) or count.size < blocks):
        raise PycalmError(f"prefill_attention: the scratch holds fewer than {blocks} x {splits} slots")
    grid = (n_kv_heads, blocks // n_kv_heads, splits)
    # fp16: the caches as they are (cp.async); e5m2: 16-byte aligned rows of uint64 pairs (ldg128)
    k, v = (cache.k, cache.v) if cache.dtype == "fp16" else (cache.k.view(np.uint64), cache.v.view(np.uint64))
    args = (q, k, v, state, out, int32(cfg.sliding_window), part, count)
    if paged:
        args += (table, int32(page_size.bit_length() - 1))
    kernel[grid, 32 * warps, stream](*args)


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
