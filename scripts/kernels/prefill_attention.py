"""Block-causal (prefill) attention: the shipped kernel (pycalm.kernels.prefill_attention, tensor
cores) and its variants, each checked against pycalm.cpu.reference.prefill_attention_ref, then timed
on the GPU (llm.c dev/cuda style).

    python scripts/kernels/prefill_attention.py                   # shipped, wg, wg2, tc16, simt: checked, timed
    python scripts/kernels/prefill_attention.py --variants all    # every version and block shape
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/prefill_attention.py --variants all --tiny
        # every variant checked at a tiny shape under the simulator (no timing)

Versions:
  shipped   the package's kernel: flash-attention 2 on mma.sync, q and p as two fp16 parts each
            (hi + lo), K and V staged key-major (V read by ldmatrix .trans), 4 warps (64 rows) a
            block, tiles of 64 keys, with a scratch: where the blocks are fewer than a wave, each
            block's keys split over blocks, merged by the last (a rows pass's 16-32 blocks);
            unsplit: the same without a scratch, a block a kv head's whole key range; s1, s2:
            splits of 1 or 2 tiles at least (shipped: 4); the variants below are unsplit. w2 / k32: 2 warps, or tiles of 32 keys; w1, w1k32, w1k16,
            w2k32: a warp (16 rows) or two a block, tiles of 64, 32 or 16 keys (a rows pass of
            32 or 64 rows has 16-32 blocks of 4 warps on the 8B shape's 8 kv heads)
  simt      the kernel it replaced, kept here for comparison: fp32 SIMT, a block of ROWS (position,
            head) rows in row groups of LANES threads, a thread 4 rows x 2 keys of a tile of 2 LANES
            keys for the scores and 4 rows x head_dim / LANES dims for P V, q, K and V tiles and p
            in shared memory as float32; block shapes simt (ROWS 4096 / head_dim, at most 64, LANES
            16), simt-r16, simt-r32, simt-l8, simt-l32r16, simt-l32r32
  tc16      the shipped kernel with q and p rounded once to fp16, as most flash-attention kernels
            take them (tc_kernel below, split=False: half the mma work, 2^-11 relative in each
            score and weight)
  copy      tc_kernel with split=True: the shipped kernel's steps, with K and V staged as before
            cp.async (a thread's 16-byte units loaded and stored in turn: a wait on memory a
            unit), unsplit: `--variants unsplit,copy` times what the staging buys
  wg        the shipped kernel's steps on Hopper's wgmma (wg_kernel below): q, K, V (transposed)
            and p (two fp16 parts) in 128-byte-swizzled shared memory, S and P V each a group of
            wgmma of one warpgroup a block; the same sums to float32 precision; wg2: two buffers of
            K and V, the next tile staged while this one's S wgmma run

Timing: one launch over T tokens at positions pos0 .. pos0 + T - 1 (--pos0, 0: a whole prompt;
a rows pass of drafts or a chat turn: 128, 4000, ...; the K/V rows already in the cache),
captured in a CUDA graph and replayed (median); the cache holds random finite
fp16 / e5m2 bit patterns made on the GPU. TFLOP/s counts 4 head_dim per (query head, attended
key) pair (prefill_attention_flops; the shipped kernel's mma work is twice that). The check runs
each variant at T = 200 after pos0 = 60 (a later chunk of a prompt) against the reference on the
host-decoded cache: the worst |error| / (2^-11 |ref| + 2e-5), the tests' tolerance (fp16
output), must be at most 1; tc16's bound is 2^-9 |ref| + 2^-9 max |ref| (fp16 q and p carry
about 2^-11 each into the output).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

from numba import config as numba_config  # noqa: E402
from numba import cuda, float32, int32, uint64  # noqa: E402
from numba.cuda import libdevice  # noqa: E402

from pycalm.cpu.reference import prefill_attention_ref  # noqa: E402
from pycalm.errors import PycalmError  # noqa: E402
from pycalm.kernels.attention import KVCache  # noqa: E402
from pycalm.kernels.common import (  # noqa: E402
    STATE_POS,
    dependent_start,
    fp8x4_cvt,
    fp16_encode,
    h2f2,
    ldg128,
    prmt,
)
from pycalm.kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_bytes,
    prefill_attention_flops,
    prefill_attention_scratch,
)
from pycalm.kernels.tensorcore import ldmatrix_x4, ldmatrix_x4_trans, mma_16816, pack_f16x2, sts128  # noqa: E402
from pycalm.kernels.warpgroup import (  # noqa: E402
    SWIZZLE_128B,
    WGMMA_N,
    fence_proxy_async,
    launch_dynamic,
    shared_byte_address,
    smem_desc,
    wgmma_commit,
    wgmma_f16,
    wgmma_fence,
    wgmma_wait,
)
from pycalm.model import formats  # noqa: E402
from pycalm.model.config import ModelConfig  # noqa: E402

SIM = numba_config.ENABLE_CUDASIM
SHAPES = {"Llama-3-8B": (32, 8, 128), "TinyLlama": (32, 4, 64)}  # n_heads, n_kv_heads, head_dim
TINY_SHAPES = {"tiny": (4, 2, 32)}
N_ROWS = (512, 2048, 4000)
SEQ_LEN = 4096
CHECK_ROWS, CHECK_POS0 = 200, 60
TINY_CHECK_ROWS, TINY_CHECK_POS0 = 21, 9
REPLAYS = 7
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF}  # clear an exponent bit: finite values only
SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a block
KV_DTYPES = ("fp16", "fp8")


def check_launch(q: object, cache: KVCache, out: object, cfg: ModelConfig) -> None:
    """What pycalm.kernels.prefill_attention.prefill_attention checks of a launch, for the
    versions here: a KV dtype they read, head_dim a multiple of 16 (16-byte loads of the
    cache, the tensor cores' k-step), q and out (T, n_heads * head_dim)."""
    if cache.dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {cache.dtype!r} (one of {', '.join(KV_DTYPES)})")
    if cfg.head_dim % 16:
        raise PycalmError(f"head_dim {cfg.head_dim} is not a multiple of 16")
    width = cfg.n_heads * cfg.head_dim
    if q.shape[1] != width or out.shape[0] != q.shape[0] or out.shape[1] != width:
        raise PycalmError(f"prefill_attention: q {q.shape} and out {out.shape} are not (T, {width})")


# ---------------------------------------------------------------------------------------------
# tc16: the shipped tensor-core kernel (pycalm.kernels.prefill_attention: flash-attention 2 on
# mma.sync, its module docstring has the steps), with q and p split into two fp16 parts or not

PAD = 4  # words of padding after each shared row (16 bytes)
FULL = 0xFFFFFFFF
TC_WARPS = 1 if SIM else 4  # the package's WARPS and KEYS
TC_KEYS = 16 if SIM else 64


def min_blocks(head_dim: int) -> int:
    """Blocks an SM must hold at least (the launch bounds): 3 at head_dim 64 and below, 2 above."""
    return 3 if head_dim <= 64 else 2


def _tc_bounds(threads: int, head_dim: int) -> dict:
    """cuda.jit's launch bounds for blocks of `threads`, min_blocks(head_dim) of them an SM."""
    return {} if SIM else {"launch_bounds": (threads, min_blocks(head_dim))}


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
def online_softmax(s_tiles: int, o_tiles: int) -> object:
    """The shipped kernel's step 4 for a lane's two rows r0, r1 (positions pos_r0, pos_r1; ok0,
    ok1: rows that hold a query) over a tile of 8 s_tiles keys from j0: the masking, the tile's
    max over the row's 4 lanes, the running max m and sum l, the O accumulators (o_tiles 8-dim
    tiles) rescaled; the S fragments in s become p -> (m0, m1, l0, l1)."""

    @cuda.jit(device=True, inline=True)
    def step(s, o, j0, quad, ok0, ok1, pos_r0, pos_r1, window, m0, m1, l0, l1):  # noqa: ANN001, ANN202
        mx0, mx1 = float32(NEG), float32(NEG)
        for n in range(s_tiles):
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
        l0 *= alpha0
        l1 *= alpha1
        for n in range(o_tiles):
            o[4 * n] *= alpha0
            o[4 * n + 1] *= alpha0
            o[4 * n + 2] *= alpha1
            o[4 * n + 3] *= alpha1
        for n in range(s_tiles):
            for c in range(2):
                e0, e1 = s[4 * n + c], s[4 * n + 2 + c]
                p0 = float32(0.0) if e0 <= float32(NEG) else libdevice.fast_expf(e0 - new0)  # masked: 0
                p1 = float32(0.0) if e1 <= float32(NEG) else libdevice.fast_expf(e1 - new1)
                s[4 * n + c], s[4 * n + 2 + c] = p0, p1
                l0 += p0
                l1 += p1
        return new0, new1, l0, l1

    return step


@functools.cache
def finish_rows(o_tiles: int, group: int, head_dim: int) -> object:
    """The shipped kernel's step 6 for a lane's two rows r0, r1: each row's sum l over its 4
    lanes, then out = O / l as fp16 (rows that hold a query: ok0, ok1)."""

    @cuda.jit(device=True, inline=True)
    def finish(o, out, l0, l1, ok0, ok1, r0, r1, t0, g, quad):  # noqa: ANN001, ANN202
        l0 += cuda.shfl_xor_sync(FULL, l0, 1)
        l0 += cuda.shfl_xor_sync(FULL, l0, 2)
        l1 += cuda.shfl_xor_sync(FULL, l1, 1)
        l1 += cuda.shfl_xor_sync(FULL, l1, 2)
        for half in range(2):
            ok = ok0 if half == 0 else ok1
            if ok:
                r = r0 if half == 0 else r1
                inv = float32(1.0) / (l0 if half == 0 else l1)
                t = t0 + r // group
                col = (g * group + r % group) * head_dim + 2 * quad
                for n in range(o_tiles):
                    out[t, col + 8 * n] = fp16_encode(o[4 * n + 2 * half] * inv)
                    out[t, col + 8 * n + 1] = fp16_encode(o[4 * n + 2 * half + 1] * inv)

    return finish


@functools.cache
def tc_kernel(
    head_dim: int,
    group: int,
    kv_dtype: str,
    warps: int,
    keys: int,
    split: bool,
) -> object:
    """pycalm.kernels.prefill_attention's kernel (the same steps, for a head_dim, group size, KV
    dtype, warps a block and keys a tile; K and V staged through registers a unit at a time, as
    the package's did before its cp.async staging) with a choice: split, q and p as two fp16 parts each
    (the shipped kernel), or not (tc16: rounded once, half the mma work)."""
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
    softmax = online_softmax(S_TILES, O_TILES)  # step 4
    finish = finish_rows(O_TILES, group, D)  # step 6
    OW = 4 * O_TILES  # O accumulators a lane
    ROW = D // 2 + PAD  # words a Q / K / V row in shared memory
    QK_WORDS = max(ROWS, keys) * ROW
    V_WORDS = max(ROWS, keys) * ROW  # (it holds q_lo first)
    QITER = ROWS * (D // 2) // THREADS  # q pairs a thread stages (D / 4)
    FP8 = kv_dtype == "fp8"
    E = 16 if FP8 else 8  # cache elements a 16-byte load
    UNITS = D // E  # 16-byte loads a head's K (or V) row
    SCALE = 1.0 / math.sqrt(head_dim)
    SPLIT = split

    @cuda.jit(device=True, inline=True)
    def load_words(cache, row, u, w):  # noqa: ANN001, ANN202
        """16-byte unit u of cache row `row` (uint64 pairs) into w[0 .. E/2) as fp16 words: 8
        fp16, or 16 e5m2 bytes each made the top byte of a half (prmt; selector nibble 4 takes a
        zero byte of the second operand)."""
        a, b = ldg128(cache, row, u)
        if FP8:
            for i in range(4):
                word = _lo(a) if i == 0 else _hi(a) if i == 1 else _lo(b) if i == 2 else _hi(b)
                w[2 * i] = prmt(word, int32(0), int32(0x1404))  # bytes 0, 1
                w[2 * i + 1] = prmt(word, int32(0), int32(0x3424))  # bytes 2, 3
        else:
            w[0], w[1], w[2], w[3] = _lo(a), _hi(a), _lo(b), _hi(b)

    @cuda.jit(device=True, inline=True)
    def store_words(smem, word, w, u):  # noqa: ANN001, ANN202
        """A unit's E / 2 words w into smem[word ..] by 16-byte stores. fp8 (two stores a unit):
        units u with (u >> 2) & 1 store their second half first, so that the 8 lanes of a
        quarter-warp (units 32 bytes apart) fill 8 distinct groups of 4 banks."""
        if not FP8:
            sts128(smem, word, w[0], w[1], w[2], w[3])
        elif (u >> 2) & 1:
            sts128(smem, word + 4, w[4], w[5], w[6], w[7])
            sts128(smem, word, w[0], w[1], w[2], w[3])
        else:
            sts128(smem, word, w[0], w[1], w[2], w[3])
            sts128(smem, word + 4, w[4], w[5], w[6], w[7])

    @cuda.jit(device=True, inline=True)
    def stage_kv(k_cache, v_cache, qk, vs, w, w2, j0, last_pos, g, tid):  # noqa: ANN001, ANN202
        """Step 2: the K and V rows of keys j0 .. j0 + keys - 1 (zeros past last_pos), a thread's
        unit of a K row and of a V row at a time, each by 16-byte stores."""
        for i in range(tid, keys * UNITS, THREADS):
            kr, u = i // UNITS, i % UNITS  # key j0 + kr, dims u E .. u E + E - 1
            for e in range(E // 2):
                w[e] = int32(0)
                w2[e] = int32(0)
            if j0 + kr <= last_pos:
                load_words(k_cache, j0 + kr, g * UNITS + u, w)
                load_words(v_cache, j0 + kr, g * UNITS + u, w2)
            store_words(qk, kr * ROW + u * (E // 2), w, u)
            store_words(vs, kr * ROW + u * (E // 2), w2, u)

    @cuda.jit(device=True, inline=True)
    def stage_q(q, q_hi, q_lo, t0, g, n_rows, tid, xs, ys):  # noqa: ANN001, ANN202
        """The block's q rows times 1/sqrt(D) as fp16 pairs: the high halves into q_hi, the low
        into q_lo (padding rows and rows past T: zeros); every load before the first split."""
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

    @cuda.jit(fastmath=False, **_tc_bounds(THREADS, head_dim))
    def tc_kernel(q, k_cache, v_cache, state, out, window):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        # q (T, n_heads*D) f32; caches (seq_len, kv_dim bytes / 8) uint64 holding fp16 or e5m2
        # elements; state i32; out (T, n_heads*D) f16
        qk = cuda.shared.array(QK_WORDS, int32)  # (ROWS, D) q_hi halves, then (keys, D) K halves
        vs = cuda.shared.array(V_WORDS, int32)  # (ROWS, D) q_lo halves, then (keys, D) V halves
        q_hi = cuda.local.array(QF, int32)  # this warp's A fragments of q_hi and q_lo
        q_lo = cuda.local.array(QF, int32)
        s = cuda.local.array(SW, float32)  # S accumulators, then p
        o = cuda.local.array(OW, float32)  # O accumulators
        w = cuda.local.array(8, int32)  # a unit's fp16 words
        w2 = cuda.local.array(8, int32)  # and a V unit's
        xs = cuda.local.array(QITER, float32)  # a thread's q pairs, staged at once
        ys = cuda.local.array(QITER, float32)
        n_rows = q.shape[0]
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

        # 1. the A fragments of q_hi and q_lo. ldmatrix rows: lane & 15 of the warp's 16,
        # 16-byte chunk lane >> 4 of each k-step's two
        a_row = (warp * 16 + (lane & 15)) * ROW + 4 * (lane >> 4)
        stage_q(q, qk, vs, t0, g, n_rows, tid, xs, ys)
        cuda.syncthreads()  # q_hi and q_lo are staged
        for kk in range(KSTEPS):
            q_hi[4 * kk], q_hi[4 * kk + 1], q_hi[4 * kk + 2], q_hi[4 * kk + 3] = ldmatrix_x4(
                qk, a_row + 8 * kk
            )
            if SPLIT:
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
        cuda.syncthreads()  # every warp holds its q fragments: qk takes K tiles

        j0 = (first_key // keys) * keys
        while j0 <= last_pos:
            # 2. the K and V tiles, key-major; keys past last_pos: zeros
            stage_kv(k_cache, v_cache, qk, vs, w, w2, j0, last_pos, g, tid)
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
                        if SPLIT:
                            _mma_acc(
                                s,
                                n,
                                q_lo[4 * kk],
                                q_lo[4 * kk + 1],
                                q_lo[4 * kk + 2],
                                q_lo[4 * kk + 3],
                                c0,
                                c1,
                            )

            # 4. masking and the online softmax of the lane's two rows
            m0, m1, l0, l1 = softmax(s, o, j0, quad, ok0, ok1, pos_r0, pos_r1, window, m0, m1, l0, l1)

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
                        if SPLIT:
                            _mma_acc(o, n, z0, z1, z2, z3, c0, c1)
            cuda.syncthreads()  # every warp is done with K and V before the next tile's stores
            j0 += keys

        # 6. the rows' sums over their 4 lanes, out = O / l (a row with a query has its own key)
        finish(o, out, l0, l1, ok0, ok1, r0, r1, t0, g, quad)

    return tc_kernel


def tc_attention(q: object, cache: KVCache, state: object, out: object, cfg: ModelConfig, *,
                 stream: object, split: bool) -> None:  # fmt: skip
    """prefill_attention's launch (the default block shape) of tc_kernel."""
    check_launch(q, cache, out, cfg)
    group = cfg.n_heads // cfg.n_kv_heads
    warps = max(TC_WARPS, -(-group // 16))
    kernel = tc_kernel(cfg.head_dim, group, cache.dtype, warps, TC_KEYS, split)
    grid = (cfg.n_kv_heads, -(-q.shape[0] // ((16 * warps) // group)))
    k64, v64 = cache.k.view(np.uint64), cache.v.view(np.uint64)
    kernel[grid, 32 * warps, stream](q, k64, v64, state, out, int32(cfg.sliding_window))


# ---------------------------------------------------------------------------------------------
# wg: the shipped kernel's steps on Hopper's warpgroup instructions (pycalm.kernels.warpgroup)
#
# A block is one warpgroup (4 warps: the shipped kernel's 64 (position, head) rows), keys in
# tiles of WG_KEYS. Every operand sits in dynamic shared memory in the 128-byte-swizzled K-major
# layout the descriptors read (64 fp16 of K a 128-byte row, 8 rows a 1 KiB atom, a K past 64 in
# column blocks of 64, each a run of atoms; `at` below is a word's place):
#   q_hi, q_lo  (64 rows, K = head_dim): the block's q times 1/sqrt(head_dim), two fp16 parts
#   k           (WG_KEYS keys, K = head_dim): the tile's K rows (e5m2 made fp16, exact)
#   vt          (head_dim rows, K = WG_KEYS keys): the tile's V, transposed as it is staged (a
#               word holds one dim of two keys: two V rows' units joined by prmt)
#   p_hi, p_lo  (64 rows, K = WG_KEYS keys): the softmax's p, two fp16 parts
# S (64 x WG_KEYS) = q_hi K^T + q_lo K^T: 2 head_dim / 16 wgmma m64n{WG_KEYS}k16. Their
# accumulators are the shipped kernel's S fragments (warp w: rows 16 w + (lane >> 2) and + 8,
# keys 8 j + 2 (lane & 3) + c), so the masking and online softmax are its code. p goes to
# p_hi / p_lo (fence.proxy.async, barrier), then O (64 x head_dim) += p_hi V + p_lo V: 2 WG_KEYS
# / 16 wgmma m64n{head_dim}k16, O's accumulators again the shipped kernel's. A block waits for
# each group of wgmma before its operands change (the SM's other blocks fill the gaps).
# Shared memory at head_dim 128: 80 KiB (two blocks an SM), at 64: 48 KiB (three). wg2 doubles
# the K and V tiles (112 and 64 KiB) and stages the next tile's while this tile's S wgmma run.

WG_KEYS = 16 if SIM else 64


def wg_shared_words(head_dim: int, keys: int, double: bool = False) -> int:
    """Words of the wg kernel's shared operands (q_hi, q_lo, k, vt, p_hi, p_lo; double: a
    second k and vt), and 1 KiB to align them."""
    cb_d, cb_k = -(-head_dim // 64), -(-keys // 64)  # column blocks of a K of head_dim, of keys
    kv = keys * 32 * cb_d + head_dim * 32 * cb_k
    return 2 * 2048 * cb_d + (2 if double else 1) * kv + 2 * 2048 * cb_k + 256


@cuda.jit(device=True, inline=True)
def _at(base: int, rows: int, r: int, cw: int) -> int:
    """The word of (row r, K words 2 cw, 2 cw + 1) of an operand of `rows` rows at base, in the
    128-byte-swizzled K-major layout (column block cw >> 5, atom r >> 3, 16-byte chunk
    ((cw & 31) >> 2) ^ (r & 7))."""
    return (
        base
        + (cw >> 5) * (rows * 32)
        + (r >> 3) * 256
        + (r & 7) * 32
        + ((((cw & 31) >> 2) ^ (r & 7)) << 2)
        + (cw & 3)
    )


@cuda.jit(device=True, inline=True)
def _desc(smem, base, rows, kk):  # noqa: ANN001, ANN202
    """The descriptor of the kk-th 16 of K of an operand of `rows` rows at base."""
    return smem_desc(smem, base + (kk >> 2) * (rows * 32) + (kk & 3) * 8, 16, 1024, SWIZZLE_128B)


@functools.cache
def wg_kernel(head_dim: int, group: int, kv_dtype: str, keys: int, double: bool = False) -> object:  # noqa: C901
    """The wg kernel for a head_dim (a multiple of 16 whose wgmma n exists), group size (at most
    64 / 1 positions a block), KV dtype and keys a tile (16, 32 or 64); arguments as the
    shipped kernel's, 4 * wg_shared_words bytes of dynamic shared memory a launch. double (wg2):
    two k / vt buffers, the next tile staged while this tile's S wgmma run."""
    D = head_dim
    ROWS, THREADS = 64, 128
    POSITIONS = ROWS // group
    USED = POSITIONS * group
    KSTEPS, PSTEPS = D // 16, keys // 16  # k-steps of S, of O
    S_TILES, O_TILES = keys // 8, D // 8
    softmax = online_softmax(S_TILES, O_TILES)  # the shipped kernel's step 4
    finish = finish_rows(O_TILES, group, D)  # and step 6
    SW, OW = 4 * S_TILES, 4 * O_TILES  # S and O accumulators a thread
    CB_D, CB_K = -(-D // 64), -(-keys // 64)
    Q_HI = 0  # the operands' words, from the 1 KiB-aligned pad
    Q_LO = 2048 * CB_D
    KT = 2 * 2048 * CB_D
    VT = KT + keys * 32 * CB_D
    P_HI = VT + D * 32 * CB_K
    P_LO = P_HI + 2048 * CB_K
    KT2 = P_LO + 2048 * CB_K  # (double) the second k and vt
    VT2 = KT2 + keys * 32 * CB_D
    FP8 = kv_dtype == "fp8"
    E = 16 if FP8 else 8  # cache elements a 16-byte load
    UNITS = D // E
    SCALE = 1.0 / math.sqrt(head_dim)
    wgmma_s, wgmma_o, wait_all = wgmma_f16(keys), wgmma_f16(D), wgmma_wait(0)

    @cuda.jit(device=True, inline=True)
    def load_words(cache, row, u, w):  # noqa: ANN001, ANN202
        """16-byte unit u of cache row `row` into w[0 .. E / 2) as fp16 words (e5m2 bytes the
        top bytes of halves)."""
        a, b = ldg128(cache, row, u)
        if FP8:
            for i in range(4):
                word = _lo(a) if i == 0 else _hi(a) if i == 1 else _lo(b) if i == 2 else _hi(b)
                w[2 * i] = prmt(word, int32(0), int32(0x1404))
                w[2 * i + 1] = prmt(word, int32(0), int32(0x3424))
        else:
            w[0], w[1], w[2], w[3] = _lo(a), _hi(a), _lo(b), _hi(b)

    @cuda.jit(device=True, inline=True)
    def stage_kv(smem, pad, kt, vt, k_cache, v_cache, w, w2, j0, last_pos, g, tid):  # noqa: ANN001, ANN202
        """The tile's K rows into k (at word kt) and its V, transposed, into vt (keys past
        last_pos: zeros)."""
        for i in range(tid, keys * UNITS, THREADS):  # a unit of a key's K row: whole chunks
            kr, u = i // UNITS, i % UNITS
            for e in range(E // 2):
                w[e] = int32(0)
            if j0 + kr <= last_pos:
                load_words(k_cache, j0 + kr, g * UNITS + u, w)
            for c in range(E // 8):
                sts128(smem, _at(pad + kt, keys, kr, u * (E // 2) + 4 * c), w[4 * c], w[4 * c + 1],
                       w[4 * c + 2], w[4 * c + 3])  # fmt: skip
        for i in range(tid, (keys // 2) * UNITS, THREADS):  # a unit of keys 2 kp and 2 kp + 1
            kp, u = i // UNITS, i % UNITS
            for e in range(E // 2):
                w[e] = int32(0)
                w2[e] = int32(0)
            if j0 + 2 * kp <= last_pos:
                load_words(v_cache, j0 + 2 * kp, g * UNITS + u, w)
            if j0 + 2 * kp + 1 <= last_pos:
                load_words(v_cache, j0 + 2 * kp + 1, g * UNITS + u, w2)
            for e in range(E // 2):  # dims u E + 2 e and + 1, each over the two keys
                d = u * E + 2 * e
                smem[_at(pad + vt, D, d, kp)] = prmt(w[e], w2[e], int32(0x5410))
                smem[_at(pad + vt, D, d + 1, kp)] = prmt(w[e], w2[e], int32(0x7632))

    @cuda.jit(device=True, inline=True)
    def attend(q, k_cache, v_cache, state, out, window):  # noqa: ANN001, ANN202
        smem = cuda.shared.array(0, int32)  # the operands, from the first 1 KiB boundary
        s = cuda.local.array(SW, float32)  # S accumulators, then p
        o = cuda.local.array(OW, float32)  # O accumulators
        w = cuda.local.array(8, int32)  # a unit's fp16 words
        w2 = cuda.local.array(8, int32)  # and the next key's V unit
        n_rows = q.shape[0]
        pos0 = int32(state[STATE_POS])
        g = int32(cuda.blockIdx.x)  # kv head
        t0 = int32((cuda.gridDim.y - 1 - cuda.blockIdx.y) * POSITIONS)  # the longest blocks first
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        quad = lane & 3
        pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2  # words to a 1 KiB boundary
        last_pos = pos0 + min(t0 + POSITIONS, n_rows) - 1
        first_key = int32(0)
        if window > 0:
            first_key = max(int32(0), pos0 + t0 + 1 - window)
        for i in range(tid, ROWS * (D // 2), THREADS):  # q_hi, q_lo (padding rows, rows past T: 0)
            r, c = i // (D // 2), i % (D // 2)
            t = t0 + r // group
            hi, lo = int32(0), int32(0)
            if r < USED and t < n_rows:
                col = (g * group + r % group) * D + 2 * c
                hi, lo = _split(q[t, col] * float32(SCALE), q[t, col + 1] * float32(SCALE))
            smem[_at(pad + Q_HI, ROWS, r, c)] = hi
            smem[_at(pad + Q_LO, ROWS, r, c)] = lo
        r0 = warp * 16 + (lane >> 2)  # the lane's two rows
        r1 = r0 + 8
        pos_r0 = pos0 + t0 + r0 // group
        pos_r1 = pos0 + t0 + r1 // group
        ok0 = r0 < USED and t0 + r0 // group < n_rows
        ok1 = r1 < USED and t0 + r1 // group < n_rows
        m0, m1 = float32(NEG), float32(NEG)
        l0, l1 = float32(0.0), float32(0.0)
        for i in range(OW):
            o[i] = float32(0.0)
        j0 = (first_key // keys) * keys
        buf = 0  # (double) the buffer of this tile's k and vt
        if double:
            stage_kv(smem, pad, KT, VT, k_cache, v_cache, w, w2, j0, last_pos, g, tid)
        while j0 <= last_pos:
            kt, vt = (KT, VT) if buf == 0 else (KT2, VT2)
            if not double:
                stage_kv(smem, pad, kt, vt, k_cache, v_cache, w, w2, j0, last_pos, g, tid)
            fence_proxy_async()  # this thread's stores (the tile, and q before the first) visible to wgmma
            cuda.syncthreads()  # every thread's stores in place
            wgmma_fence()
            for kk in range(KSTEPS):  # S = q_hi K^T + q_lo K^T
                wgmma_s(s, smem, _desc(smem, pad + Q_HI, ROWS, kk), _desc(smem, pad + kt, keys, kk),
                        1 if kk > 0 else 0)  # fmt: skip
                wgmma_s(s, smem, _desc(smem, pad + Q_LO, ROWS, kk), _desc(smem, pad + kt, keys, kk), 1)
            wgmma_commit()
            if double and j0 + keys <= last_pos:  # the next tile into the other buffer, while S runs
                nkt, nvt = (KT2, VT2) if buf == 0 else (KT, VT)  # (read by the last tile's wgmma, retired)
                stage_kv(smem, pad, nkt, nvt, k_cache, v_cache, w, w2, j0 + keys, last_pos, g, tid)
            wait_all()  # S in s
            # masking and the online softmax of the lane's two rows (the shipped kernel's)
            m0, m1, l0, l1 = softmax(s, o, j0, quad, ok0, ok1, pos_r0, pos_r1, window, m0, m1, l0, l1)
            for n in range(S_TILES):  # p of keys 8 n + 2 quad, + 1: K word 4 n + quad of rows r0, r1
                hi, lo = _split(s[4 * n], s[4 * n + 1])
                smem[_at(pad + P_HI, ROWS, r0, 4 * n + quad)] = hi
                smem[_at(pad + P_LO, ROWS, r0, 4 * n + quad)] = lo
                hi, lo = _split(s[4 * n + 2], s[4 * n + 3])
                smem[_at(pad + P_HI, ROWS, r1, 4 * n + quad)] = hi
                smem[_at(pad + P_LO, ROWS, r1, 4 * n + quad)] = lo
            fence_proxy_async()  # this thread's p visible to wgmma
            cuda.syncthreads()  # every warp's p in place
            wgmma_fence()  # (o was rescaled by the threads)
            for kk in range(PSTEPS):  # O += p_hi V + p_lo V
                wgmma_o(o, smem, _desc(smem, pad + P_HI, ROWS, kk), _desc(smem, pad + vt, D, kk), 1)
                wgmma_o(o, smem, _desc(smem, pad + P_LO, ROWS, kk), _desc(smem, pad + vt, D, kk), 1)
            wgmma_commit()
            wait_all()  # O in o; k, vt and p free once every warp is here
            cuda.syncthreads()  # every warp's wgmma done before the next tile's stores
            j0 += keys
            if double:
                buf ^= 1
        finish(
            o, out, l0, l1, ok0, ok1, r0, r1, t0, g, quad
        )  # the rows' sums over their 4 lanes, out = O / l

    @cuda.jit(fastmath=False, **_tc_bounds(THREADS, head_dim))
    def wg_attention_kernel(q, k_cache, v_cache, state, out, window):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        attend(q, k_cache, v_cache, state, out, window)

    return wg_attention_kernel


def wg_attention(q: object, cache: KVCache, state: object, out: object, cfg: ModelConfig, *,
                 stream: object, double: bool = False) -> None:  # fmt: skip
    """prefill_attention's launch of wg_kernel: a block a kv head and 64 / group positions."""
    check_launch(q, cache, out, cfg)
    group = cfg.n_heads // cfg.n_kv_heads
    if group > 64 or cfg.head_dim not in WGMMA_N:
        raise PycalmError(f"the wg kernel takes a group of at most 64 and head_dim in {WGMMA_N}")
    kernel = wg_kernel(cfg.head_dim, group, cache.dtype, WG_KEYS, double)
    grid = (cfg.n_kv_heads, -(-q.shape[0] // (64 // group)))
    k64, v64 = cache.k.view(np.uint64), cache.v.view(np.uint64)
    args = (q, k64, v64, state, out, int32(cfg.sliding_window))
    nbytes = 4 * wg_shared_words(cfg.head_dim, WG_KEYS, double)
    launch_dynamic(kernel, grid, 128, stream, nbytes, args)


# ---------------------------------------------------------------------------------------------
# simt: the fp32 SIMT kernel (block shapes ROWS x LANES)

ROWS_A_THREAD = 4  # query rows a thread accumulates (scores and outputs)
KEYS_A_LANE = 2  # keys of a tile a thread scores: the tile is KEYS_A_LANE * LANES keys
MIN_BLOCKS = 2  # blocks an SM must hold at least (the launch bounds)
NEG = -1.0e30  # "no score yet": finite, so exp(NEG - m) is 0 and NEG - NEG is 0, not NaN


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
def simt_kernel(head_dim: int, group: int, kv_dtype: str, rows: int, lanes: int) -> object:
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

    @cuda.jit(fastmath=False, **_launch_bounds(THREADS))
    def simt_attention_kernel(q, k_cache, v_cache, state, out, window):  # noqa: ANN001, ANN202
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

    return simt_attention_kernel


def simt_attention(
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
    lanes: the block shape (default_rows, default_lanes). Reference:
    pycalm.cpu.reference.prefill_attention_ref."""
    check_launch(q, cache, out, cfg)
    n_kv_heads, head_dim = cfg.n_kv_heads, cfg.head_dim
    group = cfg.n_heads // n_kv_heads
    rows = default_rows(head_dim) if rows is None else rows
    lanes = default_lanes() if lanes is None else lanes
    if head_dim % lanes or lanes > 32 or lanes & (lanes - 1):
        raise PycalmError(f"head_dim {head_dim} is not a multiple of {lanes} lanes (a power of two up to 32)")
    if rows % ROWS_A_THREAD or rows < group:
        raise PycalmError(
            f"{rows} query rows a block: a multiple of {ROWS_A_THREAD}, at least the group {group}"
        )
    threads = (rows // ROWS_A_THREAD) * lanes
    if threads % 32 or threads > 1024:
        raise PycalmError(f"{rows} rows of {lanes} lanes make {threads} threads, not whole warps up to 1024")
    kernel = simt_kernel(head_dim, group, cache.dtype, rows, lanes)
    grid = (n_kv_heads, -(-q.shape[0] // (rows // group)))
    k64, v64 = cache.k.view(np.uint64), cache.v.view(np.uint64)  # 16-byte aligned rows: ldg128
    kernel[grid, threads, stream](q, k64, v64, state, out, int32(cfg.sliding_window))


# ---------------------------------------------------------------------------------------------
# the versions: name -> (launch with the version's shape, or None where the shape does not fit)

VARIANTS = {
    "shipped": lambda hd: {"scratch": True},
    "unsplit": lambda hd: {},
    "s1": lambda hd: {"scratch": True, "split_tiles": 1},  # splits of a tile at least
    "s2": lambda hd: {"scratch": True, "split_tiles": 2},
    "w2": lambda hd: {"warps": 2},
    "k32": lambda hd: {"keys": 32},
    "w1": lambda hd: {"warps": 1},  # a block per 16 (position, head) rows: a rows pass's 8-32 blocks x 4
    "w1k32": lambda hd: {"warps": 1, "keys": 32},
    "w1k16": lambda hd: {"warps": 1, "keys": 16},
    "w2k32": lambda hd: {"warps": 2, "keys": 32},
    "tc16": lambda hd: {"tc": False},
    "copy": lambda hd: {"tc": True},
    "wg": lambda hd: {"wg": True},
    "wg2": lambda hd: {"wg": 2},
    "simt": lambda hd: {"simt": (default_rows(hd), 16)},
    "simt-r16": lambda hd: {"simt": (16, 16)},
    "simt-r32": lambda hd: {"simt": (32, 16)},
    "simt-l8": lambda hd: {"simt": (default_rows(hd), 8)},
    "simt-l32r16": lambda hd: {"simt": (16, 32)},
    "simt-l32r32": lambda hd: {"simt": (32, 32)},
}
DEFAULT_VARIANTS = "shipped,wg,wg2,tc16,simt"
TINY_VARIANTS = {
    "shipped": {"scratch": True},
    "unsplit": {},
    "s2": {"scratch": True, "split_tiles": 2},
    "w2": {"warps": 2, "keys": 32},
    "tc16": {"tc": False},
    "copy": {"tc": True},
    "wg": {"wg": True},
    "wg2": {"wg": 2},
    "simt": {"simt": (16, 8)},
    "simt-r32l4": {"simt": (32, 4)},
    "simt-r8l16": {"simt": (8, 16)},
}


def simt_shared_bytes(rows: int, lanes: int, head_dim: int) -> int:
    """Static shared memory of a simt block: q rows, the K/V tile, the p tile (padded rows)."""
    tile = KEYS_A_LANE * lanes
    return 4 * (rows * (head_dim + 1) + tile * (head_dim + 1) + rows * (tile + 1))


def launcher(
    q: object, cache: KVCache, state: object, out: object, cfg: ModelConfig, shape: dict, stream: object
):  # noqa: ANN201
    """A call of the version with this shape."""
    if "simt" in shape:
        rows, lanes = shape["simt"]
        return functools.partial(
            simt_attention, q, cache, state, out, cfg, stream=stream, rows=rows, lanes=lanes
        )
    if "wg" in shape:
        return functools.partial(
            wg_attention, q, cache, state, out, cfg, stream=stream, double=shape["wg"] == 2
        )
    if "tc" in shape:
        return functools.partial(tc_attention, q, cache, state, out, cfg, stream=stream, split=shape["tc"])
    if shape.get("scratch"):
        shape = {**shape, "scratch": prefill_attention_scratch(cfg, stream)}
    return functools.partial(prefill_attention, q, cache, state, out, cfg, stream=stream, **shape)


def config(n_heads: int, n_kv_heads: int, head_dim: int) -> ModelConfig:
    """A config with these attention sizes (the kernel reads no other field)."""
    return ModelConfig(
        arch="llama", dim=n_heads * head_dim, hidden_dim=8, head_dim=head_dim, n_layers=1, n_heads=n_heads,
        n_kv_heads=n_kv_heads, vocab_size=8, max_seq_len=SEQ_LEN, rope_theta=1e4, rotary_dim=head_dim,
        norm_eps=1e-5, bos_id=1, eos_ids=(),
    )  # fmt: skip


def random_cache(seq_len: int, kv_dim: int, kv_dtype: str, seed: int) -> KVCache:
    """A cache of random finite values (on the GPU: gpubench.fill; simulator: NumPy)."""
    pair = []
    for which in range(2):
        if numba_config.ENABLE_CUDASIM:
            rng = np.random.default_rng(seed + which)
            rows = formats.encode(rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32), kv_dtype)
            pair.append(cuda.to_device(rows))
        else:
            from gpubench import fill

            words = cuda.device_array(seq_len * kv_dim * (2 if kv_dtype == "fp16" else 1) // 4, np.uint32)
            fill(words, seed + which + 1, MASK[kv_dtype])
            pair.append(words.view(np.float16 if kv_dtype == "fp16" else np.uint8).reshape(seq_len, kv_dim))
    return KVCache(pair[0], pair[1], kv_dtype)


def state_at(pos0: int) -> object:
    state = np.zeros(3, np.int32)
    state[STATE_POS] = pos0
    return cuda.to_device(state)


def check(cache: KVCache, cfg: ModelConfig, shape: dict, n_rows: int, pos0: int) -> float:
    """Worst |kernel - reference| / bound for T = n_rows rows after pos0: the tests' bound
    2^-11 |ref| + 2e-5, or 2^-9 |ref| + 2^-9 max |ref| for q and p rounded once (tc16)."""
    q = (np.random.default_rng(1).standard_normal((n_rows, cfg.q_dim)) * 0.3).astype(np.float32)
    out = cuda.to_device(np.full((n_rows, cfg.q_dim), np.nan, np.float16))
    launcher(cuda.to_device(q), cache, state_at(pos0), out, cfg, shape, stream=0)()
    cuda.synchronize()
    k, v = (formats.decode(a.copy_to_host(), cache.dtype).astype(np.float32) for a in (cache.k, cache.v))
    want = prefill_attention_ref(q, k, v, pos0, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    if shape.get("tc", True):
        bound = 2.0**-11 * np.abs(want) + 2e-5
    else:
        bound = 2.0**-9 * np.abs(want) + 2.0**-9 * np.abs(want).max()
    err = np.abs(out.copy_to_host().astype(np.float32) - want) / bound
    return float(np.nanmax(np.where(np.isnan(err), np.inf, err)))


def fp32_peak() -> float:
    """TFLOP/s of fp32 FMAs: SMs x 128 lanes x 2 FLOPs x the clock."""
    dev = cuda.get_current_device()
    return dev.MULTIPROCESSOR_COUNT * 128 * 2 * dev.CLOCK_RATE * 1e3 / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="'all' or names: " + ",".join(VARIANTS))
    ap.add_argument("--tiny", action="store_true", help="check only, at a tiny shape (simulator)")
    ap.add_argument("--rows", default=",".join(map(str, N_ROWS)), help="prompt lengths T to time")
    ap.add_argument(
        "--pos0", type=int, default=0, help="the timed rows' first position (a rows pass: 128, 4000, ...)"
    )
    args = ap.parse_args()
    tiny = args.tiny or numba_config.ENABLE_CUDASIM
    table = TINY_VARIANTS if tiny else VARIANTS
    names = list(table) if args.variants == "all" else args.variants.split(",")
    shapes = TINY_SHAPES if tiny else SHAPES
    seq_len = 64 if tiny else SEQ_LEN
    check_rows, check_pos0 = (TINY_CHECK_ROWS, TINY_CHECK_POS0) if tiny else (CHECK_ROWS, CHECK_POS0)
    stream = cuda.stream()
    peak = float("nan")
    if not tiny:
        peak = fp32_peak()
        print(f"device: {cuda.get_current_device().name}; fp32 FMA peak {peak:.1f} TFLOP/s", flush=True)
    results, failed = [], []
    for shape, (n_heads, n_kv_heads, head_dim) in shapes.items():
        cfg = config(n_heads, n_kv_heads, head_dim)
        for kv_dtype in ("fp16", "fp8"):
            cache = random_cache(seq_len, cfg.kv_dim, kv_dtype, seed=7)
            seen = set()
            for name in names:
                spec = table[name] if tiny else table[name](head_dim)
                if repr(spec) in seen:
                    continue  # the same shape as an earlier variant (simt-r32 at head_dim 128)
                seen.add(repr(spec))
                if "simt" in spec and simt_shared_bytes(*spec["simt"], head_dim) > SHARED_LIMIT:
                    print(
                        f"{shape:11s} {kv_dtype:5s} {name:11s} n/a: {simt_shared_bytes(*spec['simt'], head_dim)} B shared"
                    )
                    continue
                err = check(cache, cfg, spec, check_rows, check_pos0)
                status = "ok" if err <= 1 else "FAILED"
                print(f"{shape:11s} {kv_dtype:5s} {name:11s} {spec}: check {err:.2f} {status}")
                if err > 1:
                    failed.append(f"{shape} {kv_dtype} {name}: {err:.2f}")
                if tiny:
                    continue
                from gpubench import graph_seconds

                for n_rows in map(int, args.rows.split(",")):
                    q = cuda.device_array((n_rows, cfg.q_dim), np.float32)
                    q.copy_to_device(
                        (np.random.default_rng(2).standard_normal((n_rows, cfg.q_dim)) * 0.3).astype(
                            np.float32
                        )
                    )
                    out = cuda.device_array((n_rows, cfg.q_dim), np.float16)
                    state = state_at(args.pos0)
                    launch = launcher(q, cache, state, out, cfg, spec, stream)
                    seconds = graph_seconds(stream, launch, REPLAYS)
                    tflops = prefill_attention_flops(n_rows, args.pos0, cfg) / seconds / 1e12
                    gbs = prefill_attention_bytes(n_rows, args.pos0, cfg, kv_dtype) / seconds / 1e9
                    results.append((shape, kv_dtype, name, n_rows, seconds * 1e3, tflops, gbs))
                    print(f"{shape:11s} {kv_dtype:5s} {name:11s} T {n_rows:5d}: {seconds * 1e3:8.3f} ms "
                          f"{tflops:6.2f} TFLOP/s ({100 * tflops / peak:4.1f}% of fp32) {gbs:7.1f} GB/s",
                          flush=True)  # fmt: skip
    if results:
        print(f"\n=== summary: one layer's prefill attention over T tokens at positions {args.pos0}.."
              f"(fp32 FMA peak {peak:.1f} TFLOP/s) ===")  # fmt: skip
        print(f"{'model':11s} {'kv':5s} {'variant':11s} {'T':>5s} {'ms':>8s} "
              f"{'TFLOP/s':>8s} {'% fp32':>7s} {'GB/s':>7s}")  # fmt: skip
        for r in results:
            print(f"{r[0]:11s} {r[1]:5s} {r[2]:11s} {r[3]:5d} {r[4]:8.3f} {r[5]:8.2f} "
                  f"{100 * r[5] / peak:6.1f}% {r[6]:7.1f}")  # fmt: skip
    if failed:
        sys.exit("prefill attention variants off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
