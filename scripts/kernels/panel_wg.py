"""pycalm.kernels.panel with its products on Hopper's wgmma instead of mma.sync: measured, and
slower (llm.c's dev/cuda pattern: the package runs the mma.sync panel).

The idea. The panel's warps each hold 16 rows of W as mma.sync A fragments, and each reads the
whole staged X from shared memory as B fragments: 256 bytes of shared loads a m16n8k16. Here four
warps are a warpgroup (64 rows of W) and the warpgroup runs one `wgmma m64n{8 n_tiles}k16` a k16
tile with A from those same registers (pycalm.kernels.warpgroup.wgmma_f16_ra: a warp's 16 rows in
the mma.sync A fragment's layout) and B, X, from shared memory, read once a warpgroup.

Mapping. As the panel (its module docstring), one A tile a warp. A step of STEP = 4 E columns is
KT = E / 4 k16 tiles, run in two halves of KT / 2, a wgmma group each: a half's fragments are
read until its group retires, so a thread waits (wait_group 1) for the other half's group before
decoding into its buffer. wgmma reads B in k order, but a_pair's lane t holds its own unit's
weights (k-tile j: weights 4 j .. 4 j + 3 of unit t), so X is staged in that order: logical chunk
4 i + w of a row (k-tile 2 i + (w >> 1), its k 8 (w & 1) ..) holds word w of each of the four
16-byte chunks at columns t E + 8 i (t = 0..3), copied by 4-byte cp.async (tensorcore.cp_async4)
into 8-row x 16-byte core matrices (no swizzle: K's chunks 128 bytes apart, 8 rows CH 128 bytes
apart). Three stages: X one step ahead, as the stage after the newest is still read by the last
step's second group. The accumulators are mma.sync's layout (the panel's epilogue; K split over
blocks as the panel's, its scratch and counters).

Measured (H100, 2026-12-07; `rows_matmul.py --panel "16,1,3,1,1;16,1,3,1,1,1" --rows 64,32
--dtypes q4,gf4`, a Llama-3-8B layer's four products, us, the panel / this):

  q4  64 rows 188 / 222 (the gate launch 70.6 / 94.3), 32 rows 119 / 151
  gf4 64 rows 167 / 213, 32 rows 109 / 127

and the 8B rows pass with it (`bench.py --rows 32,64`, its products patched in): q4 6.20 / 9.31
ms against 5.79 / 8.34, gf4 5.59 / 8.91 against 5.46 / 7.81. Both step loops issue about the same
(machine code, q4's gate at 16 warps: 837 instructions per two steps a warp, 16 HGMMA, against
826 with 128 HMMA and 70 LDS), so the panel's shared loads are not its bound; the decode is. An
earlier form, X through registers and a step's fragments for two ring slots (q4: 64 registers,
8 warps a block), took 250 us for q4's layer at 64 rows.

    python scripts/kernels/panel_wg.py --check          # every format and mode against the reference
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
from numba import config as numba_config
from numba import cuda, float32, int32, uint32

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (pycalm)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/kernels (matmul.py)

from matmul import judge, on_device, reference_cases  # noqa: E402

from pycalm.kernels.common import dependent_start, last_to_arrive  # noqa: E402
from pycalm.kernels.matmul import GATE, MODES, check_mode  # noqa: E402
from pycalm.kernels.panel import PanelScratch, panel_scratch, rows_a_block, split_count  # noqa: E402
from pycalm.kernels.skinny import NO_NORM, UNIT, n_tiles_for, output_stores, stored_args, unit_decoders  # noqa: E402
from pycalm.kernels.tensorcore import cp_async4, cp_async_commit, cp_async_wait  # noqa: E402
from pycalm.kernels.warpgroup import (  # noqa: E402
    SWIZZLE_NONE,
    fence_proxy_async,
    smem_desc,
    wgmma_commit,
    wgmma_f16_ra,
    wgmma_fence,
    wgmma_wait,
)

SIM = numba_config.ENABLE_CUDASIM
# (warps, stages, min_blocks, ahead): four warpgroups a block, 128 registers a thread (the
# simulator: one warpgroup)
BLOCK = (4, 3, 0, 1) if SIM else (16, 3, 1, 1)


@functools.cache
def make_kernel(dtype: str, mode: int, n_tiles: int, warps: int, stages: int, min_blocks: int, ahead: int):  # noqa: ANN201, C901
    """The kernel for a weight dtype, an epilogue mode and n_tiles (T <= 8 n_tiles), a block of
    `warps` warps (a multiple of 4) and `stages` X stages (3 or more); arguments (x, w1, s1, w3,
    s3, out, part, tiles_done) as pycalm.kernels.panel's NO_NORM kernel."""
    a_pair, load_unit = unit_decoders(dtype)
    store_gate, store_sum = output_stores(dtype, mode, NO_NORM)
    E = UNIT[dtype]  # weights a unit
    STEP = 4 * E  # columns a step
    PAIRS = E // 8  # k-tile pairs a unit
    CH = STEP // 8  # 16-byte chunks of a staged X row
    T_MAX = 8 * n_tiles
    X_STAGE = T_MAX * STEP // 2  # words a stage
    SMEM_WORDS = stages * X_STAGE
    threads = 32 * warps
    ACC = 4 * n_tiles  # accumulators a lane
    R = ahead + 1  # slots of the weights' register ring
    RING = R * 4
    DM_WORDS = 2 * R  # q4: a (d, m) word for each unit of the ring, rows g and g + 8
    KT = E // 4  # k16 tiles a step
    HALF = KT // 2
    A_WORDS = 4 * KT  # the two halves' fragments
    PIECES = T_MAX * PAIRS * 4  # (row, pair, t) pieces of a step's X: four 4-byte copies each
    X_PIECES = -(-PIECES // threads)  # pieces a thread
    SBO = CH * 128  # bytes from 8 rows of a stage to the next 8
    gate = mode == GATE
    tile_rows = 8 if gate else 16  # outputs an A tile makes
    wg_mma = wgmma_f16_ra(T_MAX)
    wait_landed = cp_async_wait(stages - 3)  # all but the stages - 3 newest groups have landed
    wait_all = cp_async_wait(0)
    wait_one = wgmma_wait(1)  # all but the newest group retired: the other half's buffer is free
    wait_mma = wgmma_wait(0)
    if warps % 4 or stages < 3 or SMEM_WORDS * 4 > 48 * 1024:
        raise ValueError(f"warpgroups ({warps} warps) and 3 or more stages within 48 KiB ({stages})")

    @cuda.jit(device=True, inline=True)
    def core_at(r, kc):  # noqa: ANN001, ANN202
        """The word of 16-byte chunk kc of staged row r, in 8-row x 16-byte core matrices."""
        return (r >> 3) * (SBO // 4) + kc * 32 + (r & 7) * 4

    @cuda.jit(device=True, inline=True)
    def stage_x(x, smem, base, step, t_rows, k_cols, tid):  # noqa: ANN001, ANN202
        """Start the copies of step `step`'s X into the stage at word `base`, in the lanes' k
        order (the module docstring): a piece (row r, pair i, t) a thread, its chunk's four
        words each to word t of logical chunk 4 i + w (columns past K as zeros, rows past T the
        last row's: their sums are never stored). Lane 4 (r & 7) + t: a copy of the warp
        writes 32 consecutive words."""
        for c in range(X_PIECES):
            p = int32(tid + c * threads)
            if X_PIECES * threads == PIECES or p < PIECES:
                t_ = p & 3
                r = ((p >> 2) & 7) + 8 * ((p >> 5) // PAIRS)
                i = (p >> 5) % PAIRS
                col = step * STEP + t_ * E + 8 * i
                nbytes = 4 if col < k_cols else 0
                at = base + core_at(r, 4 * i) + t_
                for w in range(4):  # logical chunk 4 i + w (32 words on a chunk)
                    cp_async4(smem, at + 32 * w, x, min(r, t_rows - 1), col + 2 * w if nbytes else 0, nbytes)

    @cuda.jit(device=True, inline=True)
    def step_product(smem, base, slot, wg, wh, dm, a, acc):  # noqa: ANN001, ANN202
        """acc += this step's products from ring slot `slot`, in two halves of KT / 2 k16
        tiles: a half's A fragments decoded into its buffer, one wgmma a k16 tile of the
        warpgroup's 64 rows against the stage at word `base`, one group a half, then a wait
        until the other half's group has retired."""
        for h in range(2):
            for jj in range(HALF):
                j = h * HALF + jj
                a[4 * j], a[4 * j + 2] = a_pair(wg, slot, j, dm[2 * slot])
                a[4 * j + 1], a[4 * j + 3] = a_pair(wh, slot, j, dm[2 * slot + 1])
            wgmma_fence()  # the fragments written above, before the wgmma that read them
            for jj in range(HALF):
                j = h * HALF + jj
                desc = smem_desc(smem, base + 64 * j, 128, SBO, SWIZZLE_NONE)
                wg_mma(acc, a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3], smem, desc, 1)
            wgmma_commit()
            wait_one()

    bounds = {"launch_bounds": (threads, min_blocks)} if min_blocks else {}

    @(cuda.jit if SIM else cuda.jit(**bounds))
    def kernel(x, w1, s1, w3, s3, out, part, tiles_done):  # noqa: ANN001, ANN202, C901
        smem = cuda.shared.array(SMEM_WORDS, int32)  # (stages, T_MAX, STEP) fp16 X, core matrices
        wg = cuda.local.array(RING, int32)  # (R, 4) the ring of steps' units of row g
        wh = cuda.local.array(RING, int32)  # ... of row g + 8 (GATE: W3's row g)
        dm = cuda.local.array(DM_WORDS, int32)  # q4: the (d, m) words of the ring's units
        a = cuda.local.array(A_WORDS, int32)  # (2, KT / 2, 4) the halves' A fragments
        acc = cuda.local.array(ACC, float32)  # (n_tiles, 4) C fragments
        for e in range(ACC):
            acc[e] = float32(0.0)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3
        n_rows = w1.shape[0]
        t_rows, k_cols = x.shape
        tile0 = cuda.blockIdx.x * warps + warp  # the warp's A tile
        live = (tile0 - (warp & 3)) * tile_rows < n_rows  # warpgroup-uniform: its wgmma take all four warps
        n_steps = (k_cols + STEP - 1) // STEP
        per = (n_steps + cuda.gridDim.y - 1) // cuda.gridDim.y
        first = cuda.blockIdx.y * per  # the block's steps: first .. first + n - 1
        n = min(per, n_steps - first)
        g_shift = 5 if s1.shape[s1.ndim - 1] * 32 == k_cols else 6  # q4: a group's columns
        row_g = tile0 * tile_rows + g
        row_h = row_g if gate else row_g + 8
        if live:  # the weights are no earlier kernel's output: the first steps' before the wait
            for k in range(ahead):
                if k < n:
                    col = ((first + k) * 4 + t) * E
                    load_unit(w1, s1, min(row_g, n_rows - 1), col, col < k_cols, wg, k, dm, 2 * k, g_shift)
                    load_unit(
                        w3, s3, min(row_h, n_rows - 1), col, col < k_cols, wh, k, dm, 2 * k + 1, g_shift
                    )
        dependent_start()  # in a programmatic graph: wait for the kernel that wrote X (and out)
        for i in range(stages - 2):  # the first steps' X in flight, a group each
            if i < n:
                stage_x(x, smem, i * X_STAGE, first + i, t_rows, k_cols, tid)
            cp_async_commit()
        stage = 0
        i0 = 0
        while i0 < n:  # R steps a round, unrolled: step i0 + r multiplies ring slot r
            for r in range(R):
                i = i0 + r
                if i < n:  # block-uniform
                    wait_landed()  # this thread's copies of step i have landed, ...
                    fence_proxy_async()  # ... visible to wgmma, ...
                    # ... and every thread's; every warpgroup's wgmma of steps up to i - 2 retired
                    cuda.syncthreads()
                    fill = i + stages - 2  # the step whose X enters the ring now, where step i - 2's was
                    if fill < n:
                        at = stage + stages - 2
                        at = at - stages if at >= stages else at  # (fill % stages, without a division)
                        stage_x(x, smem, at * X_STAGE, first + fill, t_rows, k_cols, tid)
                    cp_async_commit()  # (an empty group near the end)
                    if live:
                        if i + ahead < n:  # into the slot step i - 1 used
                            slot = (r + ahead) % R
                            col = ((first + i + ahead) * 4 + t) * E
                            ok = col < k_cols
                            load_unit(
                                w1, s1, min(row_g, n_rows - 1), col, ok, wg, slot, dm, 2 * slot, g_shift
                            )
                            load_unit(
                                w3, s3, min(row_h, n_rows - 1), col, ok, wh, slot, dm, 2 * slot + 1, g_shift
                            )
                        step_product(smem, stage * X_STAGE, r, wg, wh, dm, a, acc)
                    stage = stage + 1 if stage < stages - 1 else 0
            i0 += R
        wait_mma()  # every group retired: acc is this thread's again
        if cuda.gridDim.y > 1:  # the tile's splits meet: the last to finish adds them up in split order
            n_splits, tile = cuda.gridDim.y, cuda.blockIdx.x
            home = uint32(tile * n_splits * ACC * threads + tid)  # (tiles, splits, ACC, threads)
            for e in range(ACC):
                part[home + uint32((cuda.blockIdx.y * ACC + e) * threads)] = acc[e]
            wait_all()  # (no copy is in flight: smem[0] carries the answer)
            if not last_to_arrive(tiles_done, tile, n_splits, smem, 0):
                return  # block-uniform, after the last barrier
            for e in range(ACC):
                acc[e] = float32(0.0)
            for z in range(n_splits):  # in split order
                for e in range(ACC):
                    acc[e] += part[home + uint32((z * ACC + e) * threads)]
            if tid == 0:
                tiles_done[tile] = 0  # for the next launch
        n_cols = out.shape[1]
        if live:  # accumulator 4 p + r: A row g + 8 (r >> 1), token 8 p + 2 t + (r & 1)
            for p in range(n_tiles):
                for r in range(2):
                    token = 8 * p + 2 * t + r
                    if gate:  # r: W1's sum, r + 2: W3's, of output tile0 * 8 + g
                        if token < t_rows and row_g < n_cols:
                            store_gate(acc[4 * p + r], acc[4 * p + 2 + r], token, row_g, out, s1, s3, out)
                    else:
                        for hh in range(2):  # A rows g and g + 8
                            col = row_g + 8 * hh
                            if token < t_rows and col < n_cols:
                                store_sum(acc[4 * p + 2 * hh + r], token, col, out, s1, out, out, out, out)

    return kernel


def panel_wg_matmul(
    x: object, w: object, out: object, dtype: str, *, stream: object, scratch: PanelScratch, mode: str = "plain",
    w3: object = None, block: tuple = BLOCK,
) -> None:  # fmt: skip
    """pycalm.kernels.panel.panel_matmul's product (no norm folded) on wgmma; block (warps,
    stages, min_blocks, ahead)."""
    check_mode(mode, w3)
    warps, stages, min_blocks, ahead = block
    k_cols = x.shape[1]
    kernel = make_kernel(dtype, MODES[mode], n_tiles_for(x.shape[0]), warps, stages, min_blocks, ahead)
    args = stored_args(w, w3, dtype, k_cols)
    if len(args) == 2:  # fp16, fp8, gf4: W1, W3 stand in for the scales (unread)
        args = (args[0], args[0], args[1], args[1])
    blocks = -(-out.shape[1] // rows_a_block(mode, warps, 1))
    splits = split_count(blocks, k_cols, dtype)
    kernel[(blocks, splits), 32 * warps, stream](x, *args, out, scratch.part, scratch.tiles_done)


def check(shapes: list[tuple[int, int, int]]) -> bool:
    """Every format and mode at each (T, N, units of K) against the reference (q4 with the fp16
    rounding of d q + m the tensor cores take), as scripts/kernels/matmul.py's checks."""
    rng = np.random.default_rng(7)
    scratch = panel_scratch()
    stream = cuda.default_stream()
    ok = True
    for t_rows, n, units in shapes:
        for dtype in ("fp16", "fp8", "gf4", "q8", "q4"):
            k = units * UNIT[dtype]
            for mode, x, w, w3, out, want, scale in reference_cases(rng, t_rows, n, k, dtype):
                d_out = cuda.to_device(out)
                panel_wg_matmul(cuda.to_device(x), on_device(w), d_out, dtype, stream=stream, scratch=scratch,
                                mode=mode, w3=on_device(w3) if mode == "gate" else None)  # fmt: skip
                stream.synchronize()
                ok &= judge(d_out, want, scale, mode, f"wg {dtype} {mode:8s} T={t_rows} N={n} K={k}")
    return ok


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="every format and mode against the reference")
    args = ap.parse_args()
    # the simulator: one block of one warpgroup with K split in two (a step and a quarter); the
    # GPU: also a partial block, and the 8B's qkv and w2 widths (K split over blocks)
    shapes = [(19, 40, 5)] if SIM else [(19, 40, 5), (64, 1000, 129), (50, 6144, 128), (64, 4096, 448)]
    if args.check:
        sys.exit(0 if check(shapes) else 1)
    ap.print_help()
