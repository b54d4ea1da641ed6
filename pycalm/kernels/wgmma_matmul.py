"""Matrix products for T tokens on Hopper's warpgroup tensor cores (wgmma), fed by TMA for fp16
weights and through registers for fp8 / gf4 / q8 / q4: prompt passes of WGMMA_MIN_ROWS[format] rows
and more on an sm_90 GPU (pycalm.gpu.prefill's products send them here).

  PLAIN:     out = X W^T                       (qkv, the classifier)
  RESIDUAL:  out += X W^T                      (wo and w2: the residual add fused in)
  GATE:      out = silu(X W1^T) * (X W3^T)     (w1 and w3 in one kernel)

The same arguments, formats and references as pycalm.kernels.matmul (pycalm.cpu.reference's
matmul_ref, matmul_residual_ref, matmul_gate_ref): X (T, K) fp16, W the stored (N, K) weights,
out (T, N) float32 (the gate: fp16). Each output element takes K's 16-wide slices in order, in
one float32 accumulator, as the mma.sync tile does; the order inside a 16-wide slice is the
hardware's.

Both kernels compute a 128 x BN tile of out (BN = 256: 128 x 256 x 64 a step of K, 4 stages,
192 KiB of dynamic shared memory, one block an SM). Two "consumer" warpgroups take the tile's
rows 0-63 and 64-127, each with one `wgmma m64nBNk16` a 16 of K: a thread's BN / 2 float32
accumulators (128) live in registers. The shared tiles are fp16, 128 bytes a row, in the
128-byte swizzle the wgmma descriptors read (pycalm.kernels.warpgroup).

fp16 W (`tma_kernel`, warp-specialized): a third warpgroup is the producer. One of its threads
has TMA (pycalm.kernels.tma) copy each step's X box (128 x 64) and W box (BN x 64) into a free
stage of the ring and count the bytes on the stage's "full" mbarrier; the consumers wait on it,
issue their wgmma, and arrive on the stage's "empty" mbarrier once the wgmma that read it has
retired. No thread copies a byte and no block-wide barrier stops the pipeline.

fp8 / gf4 / q8 / q4 W (`wgmma_kernel`): X comes by cp.async into the ring; W comes through
registers, two steps ahead, and is decoded to fp16 into one of three W tiles once a block (exact
for fp8, gf4 and q8's codes, whose row scale multiplies the sums in the epilogue; fp16(d q + m)
for q4, as the mma.sync tile does), while the current step's wgmma run.

Bytes: a block reads its 128-row strip of X and its BN-row strip of W once for each tile (the
grid walks T fastest, so the tiles of one W strip run together and L2 serves X); the weights
once a 128 rows of T. Measured (H200, docs/BENCHMARKS.md): fp16 588-662 TFLOP/s at T = 2,048 on
the Llama-3-8B matrices (the mma.sync tile: 242-286; cuBLAS 733-767), fp8 298-395 (209-254).

Under the CUDA simulator the same kernels run at BN = 64 and 3 stages (SIM_BLOCK_N): the
intrinsics' twins (pycalm.kernels.warpgroup, pycalm.kernels.tma) read the same swizzled tiles.
"""

from __future__ import annotations

import functools
import math

from numba import config as numba_config
from numba import cuda, float32, int32
from numba.types import float16

from pycalm.errors import PycalmError
from pycalm.kernels.common import dependent_start, fp16_encode, last_to_arrive
from pycalm.kernels.matmul import _fp8_words, _gf4_words, _q4_words, _q8_words, check_mode, weight_args
from pycalm.kernels.tensorcore import cp_async16, cp_async_commit, cp_async_wait, ldg128w, sts128
from pycalm.kernels.tma import SWIZZLE_128B as TMA_SWIZZLE_128B
from pycalm.kernels.tma import (
    fence_mbarrier_init,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_try_wait,
    tensor_map_2d,
    tensormap_acquire,
    tma_load_2d,
)
from pycalm.kernels.warpgroup import (
    SWIZZLE_128B,
    fence_proxy_async,
    launch_dynamic,
    setmaxnreg_dec,
    setmaxnreg_inc,
    shared_byte_address,
    smem_desc,
    wgmma_commit,
    wgmma_f16,
    wgmma_fence,
    wgmma_wait,
)

SIM = numba_config.ENABLE_CUDASIM
# the fewest rows a pass of each weight format takes these kernels for. Measured, the 8B prefill
# (H200, scripts/bench.py --prefill, the same run with --no-wgmma): fp16 ahead of the mma.sync tile
# from 512 rows (20,333 against 15,600 tok/s at T = 512; 28,648 against 16,778 at 2,048), fp8
# too; q8 and q4 behind it at 512 (13,021 against 13,437; 8,794 against 9,325), ahead at 2,048
# (17,699 against 14,629; 12,388 against 10,210), where a 128 x 256 tile leaves most of the 8B's
# qkv / wo / w2 grids under a wave of the 132 SMs. 1,024 lies between the two measured points.
WGMMA_MIN_ROWS = {"fp16": 512, "fp8": 512, "gf4": 1024, "q8": 1024, "q4": 1024}
BLOCK_N, STAGES = 256, 4  # the tile's W rows and the ring's stages
SIM_BLOCK_N, SIM_STAGES = 64, 3  # the simulator's (its threads are Python threads)

WGMMA_BM, WGMMA_BK, WGMMA_THREADS = 128, 64, 256  # a tile's rows, K a step, threads (wgmma_kernel)
ROWS_BM = 64  # the rows of a `rows` tile (scripts/kernels/matmul.py's rows versions): one wgmma's M
UNROLLED = 64  # the longest loop over acc that the compiler unrolls (a loop of 128 stays a loop,
# and acc then lives in local memory)
GATE_UNROLLED = 32  # the same for the gate's epilogue (pairs of accumulators), whose body is longer
STORE_UNROLLED = 32  # and for the plain and residual epilogues (q8: a scale a column)


def wgmma_shared_bytes(block_n: int, stages: int, dtype: str, rows: bool = False) -> int:
    """Dynamic shared memory of a version: the X stages, the W stages (fp16) or three decoded W
    tiles (W through registers), and 1 KiB to align them."""
    x_tile, w_tile = (ROWS_BM if rows else WGMMA_BM) * WGMMA_BK * 2, block_n * WGMMA_BK * 2
    return stages * x_tile + (stages if dtype == "fp16" else 3) * w_tile + 1024


@functools.cache
def plain_epilogue(acc_n: int, residual: bool, q8: bool) -> object:
    """The plain / residual epilogue of a warpgroup's acc_n accumulators a thread: store_all(acc,
    out, row0, col0, s) writes out[row, col] = (residual: +=) acc[i] (q8: times its row scale
    s[col]), acc[i] being D[row0 + 8 h, col0 + 8 j + e] for i = 4 j + 2 h + e, in calls of
    STORE_UNROLLED accumulators: each a loop of constant bounds the compiler unrolls, so acc
    stays in registers."""

    @cuda.jit(device=True, inline=True)
    def store_out(acc, lo, out, row0, col0, s):  # noqa: ANN001, ANN202
        for i in range(lo, min(lo + STORE_UNROLLED, acc_n)):
            row = row0 + 8 * ((i >> 1) & 1)
            col = col0 + 8 * (i >> 2) + (i & 1)
            if row < out.shape[0] and col < out.shape[1]:
                v = acc[i]
                if q8:
                    v *= s[col]
                if residual:
                    out[row, col] += v
                else:
                    out[row, col] = v

    @cuda.jit(device=True, inline=True)
    def store_all(acc, out, row0, col0, s):  # noqa: ANN001, ANN202
        store_out(acc, 0, out, row0, col0, s)
        if acc_n > STORE_UNROLLED:
            store_out(acc, STORE_UNROLLED, out, row0, col0, s)
        if acc_n > 2 * STORE_UNROLLED:
            store_out(acc, 2 * STORE_UNROLLED, out, row0, col0, s)
        if acc_n > 3 * STORE_UNROLLED:
            store_out(acc, 3 * STORE_UNROLLED, out, row0, col0, s)

    return store_all


@functools.cache
def weight_units(block_n: int, dtype: str, gate: bool, threads: int) -> tuple:
    """How `threads` threads bring a (BN, 64) W tile of fp8 / gf4 / q8 / q4 weights through their
    registers into shared memory as fp16: (w_source, fetch_units, put_units, unit_words).
    A unit is one 16-byte load of a W row (fp8 / q8: 16 weights; gf4 / q4: 4 words of 8, and
    q4's group step d and offset m); thread tid takes units tid, tid + threads, ... of the tile.
    fetch_units loads a step's units into registers (unit_words of them), put_units decodes them
    (exact for fp8, gf4 and q8's codes; fp16(d q + m) for q4) and stores them in the
    128-byte-swizzled layout. The gate's tile holds W and W3 rows by turns of 8 (w_source)."""
    q8, q4, fp8 = dtype == "q8", dtype == "q4", dtype == "fp8"
    bk = WGMMA_BK
    unit_cols = 16 if q8 or fp8 else 32  # the columns of a unit: a 16-byte load
    all_units = block_n * (bk // unit_cols)  # units a W tile
    units = -(-all_units // threads)  # units a thread a step (the last: some threads none)
    unit_words = 4 * max(units, 1)  # the registers of a thread's units
    chunks_a_unit = unit_cols // 8  # 16-byte fp16 chunks a unit decodes to

    @cuda.jit(device=True, inline=True)
    def w_source(rr, n0):  # noqa: ANN001, ANN202
        """A W tile row's source: (from W3, the row of W or W3)."""
        if gate:  # tile row rr: W (rr >> 3 even) or W3 (odd), output n0 + 8 (rr >> 4) + (rr & 7)
            return (rr >> 3) & 1, n0 + 8 * (rr >> 4) + (rr & 7)
        return 0, n0 + rr

    @cuda.jit(device=True, inline=True)
    def fetch_units(w, s, w3, s3, regs, scale, tid, n0, k_cols, step):  # noqa: ANN001, ANN202
        """(W through registers) This thread's units of step `step`'s W tile into regs (and q4's d, m into
        scale); zeros past N and K."""
        for i in range(units):
            u = tid + threads * i
            rr, part = u // (bk // unit_cols), u % (bk // unit_cols)  # tile row, unit of the row
            which, row = w_source(rr, n0)
            col = step * bk + part * unit_cols
            src = w3 if which else w
            for j in range(4):
                regs[4 * i + j] = int32(0)
            if u < all_units and row < src.shape[0] and col < k_cols:
                e = col if q8 or fp8 else col // 8  # the unit's first element: a byte, or a word of 8
                regs[4 * i], regs[4 * i + 1], regs[4 * i + 2], regs[4 * i + 3] = ldg128w(src, row, e)
                if q4:
                    sc = s3 if which else s
                    group = col // (k_cols // sc.shape[1])
                    # kept as loaded, converted in put_units: a conversion here would wait for the loads
                    scale[2 * i] = sc[row, group, 0]
                    scale[2 * i + 1] = sc[row, group, 1]
            elif q4:
                scale[2 * i] = float16(0)  # (an integer: a float literal is a double)
                scale[2 * i + 1] = float16(0)

    @cuda.jit(device=True, inline=True)
    def put_units(smem, regs, scale, tid, tile):  # noqa: ANN001, ANN202
        """(W through registers) This thread's fetched units, decoded to fp16, into decoded W tile `tile`."""
        for i in range(units):
            u = tid + threads * i
            if u >= all_units:
                break
            rr, part = u // (bk // unit_cols), u % (bk // unit_cols)
            row_word = tile + (rr >> 3) * 256 + (rr & 7) * 32
            for j in range(chunks_a_unit):
                c = part * chunks_a_unit + j
                if q8:  # 8 codes, exact in fp16
                    h0, h1, h2, h3 = _q8_words(regs[4 * i + 2 * j], regs[4 * i + 2 * j + 1])
                elif fp8:  # 8 e5m2 bytes, the top bytes of 8 halves
                    h0, h1, h2, h3 = _fp8_words(regs[4 * i + 2 * j], regs[4 * i + 2 * j + 1])
                elif q4:  # 8 weights d q + m of one word
                    h0, h1, h2, h3 = _q4_words(regs[4 * i + j], scale[2 * i], scale[2 * i + 1])
                else:  # gf4: 8 weights of one word and its scale, exact
                    h0, h1, h2, h3 = _gf4_words(regs[4 * i + j])
                sts128(smem, row_word + ((c ^ (rr & 7)) << 2), h0, h1, h2, h3)

    return w_source, fetch_units, put_units, unit_words


@functools.cache
def interleaved_gate(acc_n: int, q8: bool) -> object:
    """The gate's epilogue over a tile whose W rows alternate by 8 between W and W3 (weight_units'
    w_source): gate_all(acc, out, row0, col0, s, s3) writes out = fp16(silu(h1) h3), in calls of
    GATE_UNROLLED pairs (each a loop of constant bounds the compiler unrolls)."""

    @cuda.jit(device=True, inline=True)
    def gate_out(acc, lo, out, row0, col0, s, s3):  # noqa: ANN001, ANN202
        """out = fp16(silu(h1) h3) of the pairs lo .. lo + GATE_UNROLLED - 1 of a thread's gate
        accumulators (pair v: acc[i], acc[i + 4], i = 8 (v >> 2) + (v & 3); q8: each times its
        row scale)."""
        for v in range(lo, min(lo + GATE_UNROLLED, acc_n // 2)):
            i = 8 * (v >> 2) + (v & 3)
            row = row0 + 8 * ((i >> 1) & 1)
            col = col0 + 8 * (i >> 3) + (i & 1)
            if row < out.shape[0] and col < out.shape[1]:
                h1, h3 = acc[i], acc[i + 4]
                if q8:
                    h1 *= s[col]
                    h3 *= s3[col]
                out[row, col] = fp16_encode(h1 / (float32(1.0) + math.exp(-h1)) * h3)

    @cuda.jit(device=True, inline=True)
    def gate_all(acc, out, row0, col0, s, s3):  # noqa: ANN001, ANN202
        gate_out(acc, 0, out, row0, col0, s, s3)
        if acc_n > 2 * GATE_UNROLLED:
            gate_out(acc, GATE_UNROLLED, out, row0, col0, s, s3)

    return gate_all


@functools.cache
def wgmma_kernel(  # noqa: C901
    block_n: int, stages: int, blocks_per_sm: int, rows: bool, mode: str, dtype: str = "fp16"
) -> object:
    """The kernel of a wgmma version: out (T, N) float32 = X (T, K) fp16 W (N, K)^T ("plain"),
    out += X W^T ("residual"), or out (T, N) fp16 = silu(X W^T) * (X W3^T) ("gate": the W tile
    holds W and W3 rows by turns of 8, so a thread's accumulators of 8 columns j (W) and j + 1
    (W3) are the same outputs' two sums, and the tile's outputs are BN / 2 columns). Arguments
    (x, w, w3, out); q8 / q4: (x, w codes, w scales, w3 codes, w3 scales, out); rows versions
    two more, the split's scratch: part (>= tiles x splits x BN / 4 x 256,) float32 and
    tiles_done (>= tiles,) int32, zeros."""
    bm, bk, threads = ROWS_BM if rows else WGMMA_BM, WGMMA_BK, WGMMA_THREADS
    residual, gate = mode == "residual", mode == "gate"
    q8, scaled = dtype == "q8", dtype in ("q8", "q4")  # (scaled: codes and scales, two arguments)
    quantized = dtype != "fp16"  # (and below: W through registers, decoded to fp16)
    fp16_w = not quantized
    out_n = block_n // 2 if gate else block_n  # output columns a tile
    wn = block_n // 2 if rows else block_n  # a warpgroup's columns of the tile (its wgmma's n)
    wgmma = wgmma_f16(wn)
    wait_loads = cp_async_wait(stages - 3)  # all but the stages - 3 newest groups: this step's landed
    wait_one, wait_all = wgmma_wait(1), wgmma_wait(0)
    acc_n = wn // 2
    store_all = plain_epilogue(acc_n, residual, q8)
    x_words = bm * bk // 2  # a stage's X tile (BM, 64) fp16, in int32 words
    w_words = block_n * bk // 2  # a W tile (BN, 64) fp16
    stage_words = x_words if quantized else x_words + w_words  # a stage of the cp.async ring
    w_base = stages * stage_words  # (W through registers) the three decoded W tiles, after the ring
    copies = (bm + (0 if quantized else block_n)) * bk // 8 // threads  # 16-byte copies a thread a stage
    w_source, fetch_units, put_units, unit_words = weight_units(block_n, dtype, gate, threads)
    gate_all = interleaved_gate(acc_n, q8)

    @cuda.jit(device=True, inline=True)
    def load_stage(smem, x, w, w3, pad, tid, m0, n0, step):  # noqa: ANN001, ANN202
        """Issue this thread's copies of step `step`'s X tile (and fp16 W tile) into its stage."""
        base = pad + (step % stages) * stage_words
        t_rows, k_cols = x.shape
        col0 = step * bk
        for i in range(copies):
            idx = tid + threads * i
            r, c = idx >> 3, idx & 7  # tile row, 16-byte chunk
            col = col0 + 8 * c
            if r < bm:
                row = m0 + r
                ok = row < t_rows and col < k_cols
                word = base + (r >> 3) * 256 + (r & 7) * 32 + ((c ^ (r & 7)) << 2)
                cp_async16(smem, word, x, row if ok else 0, col if ok else 0, 16 if ok else 0)
            elif fp16_w:  # (a constant: q8 / q4 W tiles come through registers, not here)
                rr = r - bm
                word = base + x_words + (rr >> 3) * 256 + (rr & 7) * 32 + ((c ^ (rr & 7)) << 2)
                which, row = w_source(rr, n0)
                ok = row < w.shape[0] and col < k_cols
                if which:
                    cp_async16(smem, word, w3, row if ok else 0, col if ok else 0, 16 if ok else 0)
                else:
                    cp_async16(smem, word, w, row if ok else 0, col if ok else 0, 16 if ok else 0)

    @cuda.jit(device=True, inline=True)
    def split_sums(acc, part, at, how):  # noqa: ANN001, ANN202
        """A thread's acc and its partial sums in part[at + i threads], i < acc_n: how 0 writes
        acc there, 1 adds them to acc, 2 loads them into acc (a loop the compiler unrolls:
        acc_n <= UNROLLED)."""
        for i in range(acc_n):
            if how == 0:
                part[at + i * threads] = acc[i]
            elif how == 1:
                acc[i] += part[at + i * threads]
            else:
                acc[i] = part[at + i * threads]

    @cuda.jit(device=True, inline=True)
    def block_tile(x, w, s, w3, s3, out, part, tiles_done):  # noqa: ANN001, ANN202, C901
        """The block's tile of out (see wgmma_kernel); s, s3: q8 / q4 scales (unread for fp16);
        part, tiles_done: the split's scratch (rows versions)."""
        dependent_start()  # in a graph with programmatic edges: X comes from the kernel before
        smem = cuda.shared.array(
            0, int32
        )  # the X (and W) stages, (W through registers) 3 W tiles: from 1 KiB
        tid = cuda.threadIdx.x
        m0 = cuda.blockIdx.x * bm
        n0 = cuda.blockIdx.y * out_n
        k_cols = x.shape[1]
        steps = (k_cols + bk - 1) // bk
        first = 0  # the block's steps: first .. steps - 1 (rows versions: its split's)
        if rows:
            per = (steps + cuda.gridDim.z - 1) // cuda.gridDim.z
            first = cuda.blockIdx.z * per
            steps = min(steps, first + per)
        pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2  # words to a 1 KiB boundary
        group = tid >> 7  # the warpgroup: tile rows 64 group .. (rows versions: W tile rows wn group ..)
        acc = cuda.local.array(acc_n, float32)  # (BN / 8, 4) this thread's D elements
        regs = cuda.local.array(unit_words, int32)  # (W through registers) the units of a step ahead
        scale = cuda.local.array(unit_words, float16)  # (q4) their d, m as loaded
        for lo in range(0, acc_n, UNROLLED):
            for i in range(lo, min(lo + UNROLLED, acc_n)):
                acc[i] = 0.0
        for st in range(first, first + stages - 2):  # the first stages - 2 steps in flight
            if st < steps:
                load_stage(smem, x, w, w3, pad, tid, m0, n0, st)
            cp_async_commit()
        if quantized:  # the first step's W tile decoded, the second's units fetched
            fetch_units(w, s, w3, s3, regs, scale, tid, n0, k_cols, first)
            put_units(smem, regs, scale, tid, pad + w_base + (first % 3) * w_words)
            if first + 1 < steps:
                fetch_units(w, s, w3, s3, regs, scale, tid, n0, k_cols, first + 1)
        for step in range(first, steps):
            wait_loads()  # this thread's copies of this step landed
            fence_proxy_async()  # ... and its stores of this step's W tile: visible to wgmma's async proxy
            cuda.syncthreads()  # every thread's copies and stores of this step in place; every
            # warpgroup's wgmma of step - 2 retired (each waited at the end of step - 1): its
            # stage (and, q8 / q4, its W tile) is free
            nxt = step + stages - 2
            if nxt < steps:
                load_stage(smem, x, w, w3, pad, tid, m0, n0, nxt)
            cp_async_commit()  # (an empty group past the end keeps wait_loads' count)
            base = pad + (step % stages) * stage_words
            w_tile = pad + w_base + (step % 3) * w_words if quantized else base + x_words
            wgmma_fence()
            for kk in range(bk // 16):  # the kk-th 16 of K: 32 bytes on in the swizzled rows
                a_rows = 0 if rows else group * 2048  # the warpgroup's 64 X rows (8 atoms)
                b_rows = group * (wn // 8) * 256 if rows else 0  # its wn W rows
                da = smem_desc(smem, base + a_rows + 8 * kk, 16, 1024, SWIZZLE_128B)
                db = smem_desc(smem, w_tile + b_rows + 8 * kk, 16, 1024, SWIZZLE_128B)
                wgmma(acc, smem, da, db, 1)
            wgmma_commit()
            if quantized:  # while the wgmma run: step + 1's W tile decoded, step + 2's units fetched
                if step + 1 < steps:
                    put_units(smem, regs, scale, tid, pad + w_base + ((step + 1) % 3) * w_words)
                if step + 2 < steps:
                    fetch_units(w, s, w3, s3, regs, scale, tid, n0, k_cols, step + 2)
            wait_one()  # step - 1's wgmma retired
        wait_all()  # every sum in acc
        if rows:  # the tile's splits meet: the last block to finish adds them up in split order
            n_splits = cuda.gridDim.z
            tile_id = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
            home = tile_id * n_splits * acc_n * threads + tid  # (tiles, splits, acc_n, threads)
            split_sums(acc, part, home + cuda.blockIdx.z * acc_n * threads, 0)
            # the block's partials published (every wgmma retired), the other splits' acquired;
            # smem[pad] carries it (no copy is in flight)
            if not last_to_arrive(tiles_done, tile_id, n_splits, smem, pad):
                return  # block-uniform, after the last barrier
            for z in range(n_splits):  # in split order: the same sums whichever block is last
                split_sums(acc, part, home + z * acc_n * threads, 1 if z > 0 else 2)
            if tid == 0:
                tiles_done[tile_id] = 0  # for the next launch
        q, lane = (tid >> 5) & 3, tid & 31
        g, t = lane >> 2, lane & 3
        row0 = m0 + (0 if rows else 64 * group) + 16 * q + g
        n0 += group * (out_n // 2) if rows else 0  # the warpgroup's first output column
        # acc[i] is D[row0 + 8 h, 8 j + 2 t + e] of the tile for i = 4 j + 2 h + e, read in loops
        # the compiler unrolls, so that acc stays in registers
        if gate:  # acc[8 p + u] (u < 4): W's sums of outputs 8 p + ..; acc[8 p + u + 4]: W3's
            gate_all(acc, out, row0, n0 + 2 * t, s, s3)
        else:
            store_all(acc, out, row0, n0 + 2 * t, s)

    bounds = {"cache": not SIM} | (
        {"launch_bounds": (threads, blocks_per_sm)} if blocks_per_sm > 1 and not SIM else {}
    )
    if scaled and rows:

        @cuda.jit(**bounds)
        def wgmma_matmul_kernel(x, w, s, w3, s3, out, part, tiles_done):  # noqa: ANN001, ANN202
            block_tile(x, w, s, w3, s3, out, part, tiles_done)

    elif rows:

        @cuda.jit(**bounds)
        def wgmma_matmul_kernel(x, w, w3, out, part, tiles_done):  # noqa: ANN001, ANN202
            block_tile(x, w, w, w3, w3, out, part, tiles_done)

    elif scaled:

        @cuda.jit(**bounds)
        def wgmma_matmul_kernel(x, w, s, w3, s3, out):  # noqa: ANN001, ANN202
            block_tile(x, w, s, w3, s3, out, out, out)  # no split: part, tiles_done unread

    else:

        @cuda.jit(**bounds)
        def wgmma_matmul_kernel(x, w, w3, out):  # noqa: ANN001, ANN202
            block_tile(x, w, w, w3, w3, out, out, out)  # no scales, no split: unread

    return wgmma_matmul_kernel


PRODUCER_REGISTERS = 40  # the producer warpgroup's, with setmaxnreg (40 x 128 + 232 x 256 <= 65,536)
TMA_THREADS = 384
_TMAPS: dict = {}  # (device pointer, shape, box) -> the map (a tensor map is built once an array)


@functools.cache
def ring(block_n: int, stages: int, stage_words: int, x_words: int, full_arrivals: int) -> tuple:
    """The consumers' side of a warp-specialized ring of `stages` stages of stage_words words, a
    stage holding X's 128-row box, then the (BN, 64) W tile x_words on, both 128-byte-swizzled,
    with a "full" and an "empty" mbarrier a stage: (init_ring, consume).
    init_ring(smem, full, empty) (one thread) sets full[s] (words full + 2 s) to full_arrivals
    arrivals a phase and empty[s] to one a consumer thread (256).
    consume(smem, acc, pad, group, steps, full, empty) runs consumer warpgroup group (1 or 2: tile
    rows 64 (group - 1) ..) over the steps: it waits for step i's stage to be full, issues its 4
    wgmma m64nBNk16, and once step i - 1's have retired (its own part of them) arrives on that
    stage's empty barrier; it leaves every sum in acc (BN / 2 float32, zeroed first)."""
    wgmma = wgmma_f16(block_n)
    wait_one, wait_all = wgmma_wait(1), wgmma_wait(0)
    acc_n, bk = block_n // 2, WGMMA_BK

    @cuda.jit(device=True, inline=True)
    def init_ring(smem, full, empty):  # noqa: ANN001, ANN202
        for st in range(stages):
            mbarrier_init(smem, full + 2 * st, full_arrivals)
            mbarrier_init(smem, empty + 2 * st, 256)  # one arrival a consumer thread

    @cuda.jit(device=True, inline=True)
    def consume(smem, acc, pad, group, steps, full, empty):  # noqa: ANN001, ANN202
        for lo in range(0, acc_n, UNROLLED):
            for i in range(lo, min(lo + UNROLLED, acc_n)):
                acc[i] = 0.0
        for i in range(steps):
            st, phase = i % stages, (i // stages) & 1
            while mbarrier_try_wait(smem, full + 2 * st, phase) == 0:  # step i's stage is full
                pass
            base = pad + st * stage_words
            wgmma_fence()
            for kk in range(bk // 16):  # the kk-th 16 of K: 32 bytes on in the swizzled rows
                da = smem_desc(smem, base + (group - 1) * 2048 + 8 * kk, 16, 1024, SWIZZLE_128B)
                db = smem_desc(smem, base + x_words + 8 * kk, 16, 1024, SWIZZLE_128B)
                wgmma(acc, smem, da, db, 1)
            wgmma_commit()
            wait_one()  # this thread's part of step i - 1's wgmma retired: its reads of that stage are done
            if i > 0:
                mbarrier_arrive(smem, empty + 2 * ((i - 1) % stages))
        wait_all()  # every sum in acc

    return init_ring, consume


@functools.cache
def tma_kernel(block_n: int, stages: int, registers: int, mode: str) -> object:  # noqa: C901
    """The kernel of a TMA version: out (T, N) float32 (=, +=) X W^T, or fp16 silu(X W^T) * (X
    W3^T) (the W tile's rows: W's BN / 2, then W3's), fp16 W. Arguments: (tmap of X, tmap of W,
    tmap of W3 (the gate's; else W's again), k_cols, out)."""
    bm, bk, threads = WGMMA_BM, WGMMA_BK, TMA_THREADS
    residual, gate = mode == "residual", mode == "gate"
    out_n = block_n // 2 if gate else block_n
    acc_n = block_n // 2
    store_all = plain_epilogue(acc_n, residual, False)
    x_words, w_words = bm * bk // 2, block_n * bk // 2
    stage_words = x_words + w_words
    init_ring, consume = ring(block_n, stages, stage_words, x_words, 1)
    stage_bytes = 4 * stage_words
    bars = stages * stage_words  # full[s] at bars + 2 s, empty[s] at bars + 2 (stages + s)
    shrink, grow = setmaxnreg_dec(PRODUCER_REGISTERS), setmaxnreg_inc(registers or 232)

    @cuda.jit(device=True, inline=True)
    def gate_out(acc, lo, out, row0, col0):  # noqa: ANN001, ANN202
        """out = fp16(silu(h1) h3) for the pairs lo .. lo + GATE_UNROLLED - 1 of a thread's gate
        accumulators: acc[i] (W's columns, i < acc_n / 2) and acc[i + acc_n / 2] (W3's)."""
        for i in range(lo, min(lo + GATE_UNROLLED, acc_n // 2)):
            row = row0 + 8 * ((i >> 1) & 1)
            col = col0 + 8 * (i >> 2) + (i & 1)
            if row < out.shape[0] and col < out.shape[1]:
                h1, h3 = acc[i], acc[i + acc_n // 2]
                out[row, col] = fp16_encode(h1 / (float32(1.0) + math.exp(-h1)) * h3)

    @cuda.jit(**({} if SIM else {"launch_bounds": (threads, 1), "cache": True}))
    def tma_matmul_kernel(tx, tw, tw3, k_cols, out):  # noqa: ANN001, ANN202
        dependent_start()  # in a graph with programmatic edges: X comes from the kernel before
        smem = cuda.shared.array(0, int32)  # STAGES stages of (X box, W box), then the barriers
        tid = cuda.threadIdx.x
        group = tid >> 7  # 0: the producer; 1, 2: the consumers of tile rows 64 (group - 1) ..
        pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2  # words to a 1 KiB boundary
        m0 = cuda.blockIdx.x * bm
        n0 = cuda.blockIdx.y * out_n
        steps = (k_cols + bk - 1) // bk
        full, empty = pad + bars, pad + bars + 2 * stages
        if tid == 0:
            init_ring(smem, full, empty)  # full: the producer's arrival (and the boxes' bytes)
            fence_mbarrier_init()
        cuda.syncthreads()  # the barriers are set up before anyone waits on them
        if group == 0:
            if registers:
                shrink()  # (the whole warpgroup) its registers to the consumers
            if tid == 0:
                tensormap_acquire(tx)
                tensormap_acquire(tw)
                tensormap_acquire(tw3)
                for i in range(steps):
                    st, phase = i % stages, (i // stages) & 1
                    while mbarrier_try_wait(smem, empty + 2 * st, phase ^ 1) == 0:  # the stage is free
                        pass
                    mbarrier_expect_tx(smem, full + 2 * st, stage_bytes)
                    base = pad + st * stage_words
                    tma_load_2d(smem, base, tx, i * bk, m0, full + 2 * st)
                    if gate:
                        tma_load_2d(smem, base + x_words, tw, i * bk, n0, full + 2 * st)
                        tma_load_2d(smem, base + x_words + w_words // 2, tw3, i * bk, n0, full + 2 * st)
                    else:
                        tma_load_2d(smem, base + x_words, tw, i * bk, n0, full + 2 * st)
            return  # the producer warpgroup's other threads have nothing to do
        if registers:
            grow()  # the producer's registers
        acc = cuda.local.array(acc_n, float32)  # (BN / 8, 4) this thread's D elements
        consume(smem, acc, pad, group, steps, full, empty)  # every sum in acc
        q, lane = (tid >> 5) & 3, tid & 31
        g, t = lane >> 2, lane & 3
        row0 = m0 + 64 * (group - 1) + 16 * q + g
        if gate:  # (calls of constant bounds, each a loop the compiler unrolls)
            gate_out(acc, 0, out, row0, n0 + 2 * t)
            if acc_n // 2 > GATE_UNROLLED:
                gate_out(acc, GATE_UNROLLED, out, row0, n0 + 2 * t)
        else:
            store_all(acc, out, row0, n0 + 2 * t, out)  # (no row scales: out unread there)

    return tma_matmul_kernel


def tma_map(array: object, box_rows: int, stream: object = 0) -> object:
    """A 128-byte-swizzled map of (box_rows, 64) fp16 boxes of a 2-D device array, built once
    (the simulator: each call). A map is a device array written from the host, which a CUDA
    graph capture on `stream` cannot hold: a pass captured into a graph runs once uncaptured
    first (pycalm.gpu.graph.GraphStep's callers), else this raises."""
    if SIM:
        return tensor_map_2d(array, box_rows, WGMMA_BK, TMA_SWIZZLE_128B)
    key = (array.device_ctypes_pointer.value, array.shape, box_rows)
    if key not in _TMAPS:
        if _capturing(stream):
            raise PycalmError(
                f"wgmma_matmul needs a TMA map of a new {array.shape} array during a CUDA graph capture:"
                " launch the pass once before capturing it"
            )
        _TMAPS[key] = tensor_map_2d(array, box_rows, WGMMA_BK, TMA_SWIZZLE_128B)
    return _TMAPS[key]


def tma_shared_bytes(block_n: int, stages: int) -> int:
    """Dynamic shared memory of tma_kernel: the stages' X and W boxes, two mbarriers a stage, and
    1 KiB to align them."""
    return stages * (WGMMA_BM + block_n) * WGMMA_BK * 2 + 16 * stages + 1024


def tma_matmul(x: object, w: object, out: object, block_n: int, stages: int, *, stream: object,
               mode: str = "plain", w3: object = None, registers: int = 0) -> None:  # fmt: skip
    """out = X W^T, += X W^T or silu(X W^T) * (X W3^T) (mode) by tma_kernel(block_n, stages,
    registers, mode); fp16 device arrays, K a multiple of 8 (the maps' 16-byte rows)."""
    out_n = block_n // 2 if mode == "gate" else block_n  # output columns a tile (the gate's box: out_n rows)
    tw = tma_map(w, out_n, stream)
    tw3 = tw if w3 is None else tma_map(w3, out_n, stream)
    args = (tma_map(x, WGMMA_BM, stream), tw, tw3, int32(x.shape[1]), out)
    grid = ((x.shape[0] + WGMMA_BM - 1) // WGMMA_BM, (out.shape[1] + out_n - 1) // out_n)
    kernel = tma_kernel(block_n, stages, registers, mode)
    launch_dynamic(kernel, grid, TMA_THREADS, stream, tma_shared_bytes(block_n, stages), args)


def _capturing(stream: object) -> bool:
    """`stream` (a numba stream; 0: the default stream, never captured here) is being captured."""
    handle = getattr(stream, "handle", None)
    if handle is None:
        return False
    from cuda.bindings import driver as cu

    err, status = cu.cuStreamIsCapturing(handle)
    return err != cu.CUresult.CUDA_SUCCESS or status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


@functools.cache
def _hopper() -> bool:
    """The current device takes sm_90a's instructions (wgmma, TMA, setmaxnreg): an H100 / H200."""
    return tuple(cuda.get_current_device().compute_capability) == (9, 0)


def takes(t_rows: int, k_cols: int, dtype: str) -> bool:
    """A product of t_rows rows, K = k_cols and `dtype` weights goes to wgmma_matmul: on an sm_90
    GPU, from WGMMA_MIN_ROWS[dtype] rows, K whole steps of 64 (the units the weight loads take
    never cross a row)."""
    return not SIM and t_rows >= WGMMA_MIN_ROWS[dtype] and k_cols % WGMMA_BK == 0 and _hopper()


def wgmma_matmul(
    x: object, w: object, out: object, dtype: str, *, stream: object, mode: str = "plain", w3: object = None
) -> None:
    """out = X W^T ("plain"), out += X W^T ("residual"), or out = silu(X W^T) * (X W3^T)
    ("gate"), as pycalm.kernels.matmul.matmul: fp16 W by tma_kernel, the other formats by
    wgmma_kernel, a 128 x BLOCK_N tile a block (the simulator: SIM_BLOCK_N). Device arrays."""
    check_mode(mode, w3)
    t_rows, k_cols = x.shape
    if k_cols % WGMMA_BK:
        raise PycalmError(f"wgmma_matmul needs K a multiple of {WGMMA_BK}, got {k_cols}")
    block_n, stages = (SIM_BLOCK_N, SIM_STAGES) if SIM else (BLOCK_N, STAGES)
    if dtype == "fp16":
        tma_matmul(x, w, out, block_n, stages, stream=stream, mode=mode, w3=w3)
        return
    out_n = block_n // 2 if mode == "gate" else block_n  # output columns a tile
    grid = ((t_rows + WGMMA_BM - 1) // WGMMA_BM, (out.shape[1] + out_n - 1) // out_n)
    kernel = wgmma_kernel(block_n, stages, 1, False, mode, dtype)
    args = (x, *weight_args(w, w3, dtype, k_cols), out)
    launch_dynamic(kernel, grid, WGMMA_THREADS, stream, wgmma_shared_bytes(block_n, stages, dtype), args)
