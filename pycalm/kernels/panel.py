"""Matrix products for 17 to 64 rows on the tensor cores: skinny's weight stream, X staged in
shared memory, K split over blocks.

  PLAIN:     out = X W^T                       (qkv, the classifier)
  RESIDUAL:  out += X W^T                      (wo and w2: the residual add fused in)
  GATE:      out = silu(X W1^T) * (X W3^T)     (w1 and w3 in one kernel)

The arrays and the references are pycalm.kernels.matmul's: X (T, K) float16, W the stored (N, K)
weights in any format, out (T, N) float32 (GATE: float16); pycalm.cpu.reference.matmul_ref,
matmul_residual_ref, matmul_gate_ref.

Why. pycalm.kernels.skinny streams the weights into mma A fragments and has every warp load X
(the B fragments) from L1 / L2; past 16 to 32 rows a lane's X of a step no longer fits its
registers, and each 16 bytes of it becomes a wait on L2 in the middle of the step.
pycalm.kernels.matmul's split tile stages both X and W in shared memory, decoding W there, and
runs 16 mma a warp between barriers: at 64 rows its step loop issues 117 (fp16) to 204 (gf4)
instructions per 16 mma. Here the weights go from memory to registers to A fragments, as in
skinny, and X comes from shared memory, where a block stages it once for all its warps.

Mapping: skinny's (its module docstring). An A tile is 16 rows of W (GATE: 8 rows of W1 over
the same 8 of W3: 8 outputs); lane l = 4 g + t holds its rows g and g + 8, and of each a
16-byte unit a step, E weights (fp16 8, fp8 and q8 16, gf4 and q4 32): unit t of the quad's
step of STEP = 4 E columns. The lanes' k are permuted to suit the loads (k-tile j of a unit: its
weights 4j..4j+3), so lane (g, t)'s B words of k-tiles 2i and 2i + 1 for n-tile p are 16
contiguous bytes of X row 8 p + g, columns t E + 8 i ..: one 16-byte shared load (lds128).

Blocks. A block has `warps` warps, each with `row_tiles` A tiles of its own (a block 16 warps
row_tiles rows of W), and a slice of K's steps: grid (ceil(N / rows a block), splits), block
(b, z) taking steps z per .. (z + 1) per - 1, per = ceil(steps / splits). Each step, the block
copies the step's X (8 n_tiles rows of STEP columns, rows past T and columns past K as zeros)
into a ring of `stages` stages by cp.async, stages - 1 steps ahead, one barrier a step; each
warp loads the weights of the step `ahead` steps on into a ring of registers (ahead + 1 slots,
the main loop unrolled by as many so that a slot is a constant), then decodes this step's (once
for every n-tile) and runs row_tiles x E / 4 x n_tiles mma. A staged row is STEP / 8 chunks of 16 bytes,
chunk c of row r at c ^ (r & 1) (fp8, q8: 128-byte rows) ^ 2 ((c >> 3) & 1) (gf4, q4: 256-byte
rows; fp16's 64-byte rows need none): the eight lanes of a quarter warp (rows 2a, 2a + 1,
chunks t E / 8 + i) then read eight distinct groups of four banks.

Splits: split_count picks as many as fill a wave of blocks (one an SM), each of at least
MIN_SPLIT_STEPS steps. With several, each block writes its accumulators to its slot of a scratch
(panel_scratch), and the last block of a tile to finish (common.last_to_arrive) adds the slots in
split order and runs the epilogue: the q8 row scale, the residual add or the gate on whole sums.
A row's bits depend on the split count, the k order and T's n-tile count, not on the other rows:
the same bits for a row in any pass of one bucket (batch-invariant passes take skinny instead).

The RMSNorm folded in (skinny's FOLD and SCALED, the same arrays and references): a RESIDUAL
launch also writes the next norm's input xb = fp16(y w rho) and each row's sum of y^2 over each
16-column tile (a warp's A tile: a lane's two columns, then the xor butterfly over the lanes of
its g) into the slots; the block that finishes last (a counter over the tiles, past the splits'
merge) turns them into rms and scale (skinny.fold_scales). PLAIN and GATE (SCALED) multiply each
row's sums by its scale before the epilogue. A pass of 33 to 64 rows on the panel thus runs no
RMSNorm launch but its first (pycalm.gpu.prefill's Prefill.folds).

The same products on Hopper's wgmma (a warpgroup's 64 rows of W against X read once a
warpgroup): scripts/kernels/panel_wg.py, measured slower (its docstring).

Bytes: the weights once; X from L2 once a block a step (at 64 rows and 256 rows of W a block,
0.25x (fp16) to 0.9x (gf4, q4) the block's weight bytes); with splits, 4 T N bytes a split
written and read once (L2). FLOPs 2 T N K, done as 2 (8 n_tiles) N K.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, uint32

from pycalm.errors import PycalmError
from pycalm.kernels.common import FULL_MASK, dependent_start, last_to_arrive
from pycalm.kernels.matmul import GATE, MODES, check_mode, sm_count
from pycalm.kernels.skinny import (
    FOLD,
    NO_NORM,
    SCALED,
    UNIT,
    NormFold,
    fits,
    fold_scales,
    n_tiles_for,
    norm_part,
    output_stores,
    stored_args,
    unit_decoders,
)
from pycalm.kernels.tensorcore import cp_async16, cp_async_commit, cp_async_wait, lds128, mma_16816

SIM = _numba_config.ENABLE_CUDASIM
# the block: warps, A tiles a warp, X stages, blocks an SM its registers are capped for (launch
# bounds), steps whose weights are in flight while a step is multiplied. 16 warps of one tile (256
# rows of W a block), three stages (48 KiB at 64 rows of gf4 / q4's 128 columns), 128 registers a
# thread (q4 spills 24-36 bytes). A layer's four products at 64 / 32 rows on the 8B shape, us
# (`scripts/kernels/rows_matmul.py --panel "8,2,3,0,1;8,2,3,0,2;4,2,3,0,1;16,1,3,1,1;16,1,2,1,2"
# --rows 32,64`, H100, 2026-12-07; each output within 3e-4 of the split tile's):
#   q4  64 rows: split tile 278, skinny 448; 8 warps of two tiles 279 (254 registers: 8 warps an
#       SM), the same two steps ahead 334, 4 warps of two 337, 16 warps of one 238, with two X
#       stages and two steps ahead 238; 32 rows: split 281, skinny 135, the panels 164-260
#   q8  64 rows: split 243, skinny 430; the panels 237 / 215 / 246 / 201 / 201
# and since q4's (d, m) word is split where it is used (H100, 2026-12-07, `--panel
# "16,1,3,1,1;16,1,3,1,2" --rows 32,64`): q4 at 64 rows 186 (two steps ahead 184), at 32 rows
# 119 against skinny's 132; gf4 at 64 rows 167 (173), at 32 rows 107 against skinny's 121
# so the rows pass takes it at 33 to 64 rows, and q4 and gf4 from 17 (prefill.SKINNY_ROWS, PANEL_ROWS). The simulator
# runs a Python thread a thread: 2 warps of one tile.
WARPS, ROW_TILES, STAGES, MIN_BLOCKS = (2, 1, 3, 0) if SIM else (16, 1, 3, 1)
AHEAD = 1
BLOCK = (WARPS, ROW_TILES, STAGES, MIN_BLOCKS, AHEAD)
MIN_SPLIT_STEPS = 1 if SIM else 4  # steps of K a split takes at least
MAX_SPLITS = 16


class PanelScratch(NamedTuple):
    """Device scratch of the split launches (panel_scratch); launches on one stream share it."""

    part: object  # (wave * ACC words * threads,) float32: each block's partial sums
    tiles_done: object  # (wave,) int32: a tile's finished splits, zero between launches


def rows_a_block(mode: str, warps: int = WARPS, row_tiles: int = ROW_TILES) -> int:
    """Outputs (columns of out) a block makes: 16 a tile (GATE 8)."""
    return (8 if mode == "gate" else 16) * warps * row_tiles


def split_count(blocks: int, k_cols: int, dtype: str) -> int:
    """Splits of K for a launch of `blocks` blocks: as many as fill one block an SM, each of at
    least MIN_SPLIT_STEPS steps; 1 where the blocks fill the SMs alone."""
    steps = -(-k_cols // (4 * UNIT[dtype]))
    splits = max(1, min(sm_count() // blocks, steps // MIN_SPLIT_STEPS, MAX_SPLITS))
    per = -(-steps // splits)
    return -(-steps // per)  # no split left empty


def panel_scratch(stream: object = 0) -> PanelScratch:
    """The scratch of every split launch: a wave's accumulators (64 rows, the default block)."""
    acc = ROW_TILES * 4 * 8  # a thread's accumulators at 64 rows
    threads = 32 * WARPS
    part = cuda.device_array(sm_count() * acc * threads, np.float32, stream=stream)
    return PanelScratch(part, cuda.to_device(np.zeros(sm_count(), np.int32), stream=stream))


@functools.cache
def make_panel_kernel(  # noqa: ANN201, C901
    dtype: str,
    mode: int,
    n_tiles: int,
    warps: int = WARPS,
    row_tiles: int = ROW_TILES,
    stages: int = STAGES,
    min_blocks: int = MIN_BLOCKS,
    ahead: int = AHEAD,
    norm: int = NO_NORM,
):
    """panel_kernel for a weight dtype, an epilogue mode, an n-tile count (passes of up to 8
    n_tiles rows), a block shape and an RMSNorm part (skinny's NO_NORM, SCALED or FOLD), one
    compile each; min_blocks > 0: compiled to fit that many blocks an SM (launch bounds: the
    registers a thread may take); ahead: the steps whose weights are in flight while a step is
    multiplied. Arguments (x, w1, s1, w3, s3, out, part, tiles_done), then SCALED's scale or
    FOLD's (nw, rho, x_next, slots, counter, rms, scale, eps): s1, s3 the q8 / q4 scales (else
    W1, W3 again, unread); part, tiles_done the scratch (read where gridDim.y > 1)."""
    a_pair, load_unit = unit_decoders(dtype)
    store_gate, store_sum = output_stores(dtype, mode, norm)
    E = UNIT[dtype]  # weights a unit
    STEP = 4 * E  # columns a step
    PAIRS = E // 8  # k-tile pairs a unit: a 16-byte load of X each, an n-tile
    CH = STEP // 8  # 16-byte chunks of a staged X row
    ROW_WORDS = STEP // 2  # int32 words of a staged X row
    T_MAX = 8 * n_tiles
    X_STAGE = T_MAX * ROW_WORDS  # words a stage
    SMEM_WORDS = stages * X_STAGE
    PIECES = T_MAX * CH  # 16-byte copies a stage
    threads = 32 * warps
    COPIES = -(-PIECES // threads)  # copies a thread a stage
    MT = row_tiles
    ACC1 = 4 * n_tiles  # accumulators a lane for one A tile
    ACC = ACC1 * MT
    A_WORDS = 8 * MT  # A fragments of two k-tiles, each A tile
    W_WORDS = 4 * MT  # a step's units of row g (and of row g + 8) a lane
    R = ahead + 1  # slots of the weights' register ring: a step's, and the `ahead` in flight
    RING = R * W_WORDS
    DM_WORDS = 2 * R * MT  # q4: a (d, m) word for each unit of the ring, rows g and g + 8
    SWZ_ROW = 0 if dtype == "fp16" else 1  # chunk ^= this for odd rows
    SWZ_HI = 2 if CH == 16 else 0  # ... and ^= this in a 256-byte row's upper half
    gate, fold = mode == GATE, norm == FOLD
    tile_rows = 8 if gate else 16  # outputs an A tile makes
    wait_landed = cp_async_wait(stages - 2)  # all but the stages - 2 newest groups have landed
    wait_all = cp_async_wait(0)
    if stages < 2 or SMEM_WORDS * 4 > 48 * 1024:
        raise PycalmError(f"panel: {stages} stages of {T_MAX} rows x {STEP} columns pass 48 KiB")

    @cuda.jit(device=True, inline=True)
    def chunk_at(r, c):  # noqa: ANN001, ANN202
        """The word of 16-byte chunk c of staged row r (swizzled, see the module docstring)."""
        return r * ROW_WORDS + 4 * (c ^ (SWZ_ROW * (r & 1)) ^ (SWZ_HI * ((c >> 3) & 1)))

    @cuda.jit(device=True, inline=True)
    def stage_x(x, smem, base, step, t_rows, k_cols, tid):  # noqa: ANN001, ANN202
        """Start the copies of step `step`'s X (T_MAX rows of STEP columns) into the stage at
        word `base`: rows past T and columns past K as zeros."""
        for i in range(COPIES):
            q = tid + i * threads
            if PIECES % threads == 0 or q < PIECES:
                r, c = q // CH, q % CH
                col = step * STEP + 8 * c
                ok = r < t_rows and col < k_cols
                cp_async16(
                    smem, base + chunk_at(r, c), x, min(r, t_rows - 1), col if ok else 0, 16 if ok else 0
                )

    @cuda.jit(device=True, inline=True)
    def load_step(w1, s1, w3, s3, step, slot, tile0, g, t, n_rows, k_cols, g_shift, wg, wh, dm):  # noqa: ANN001, ANN202
        """The lane's units of step `step` into slot `slot` of the ring: rows g (wg) and g + 8
        (wh; GATE: W3's row g) of each of its A tiles (a row past N reads the last row: its sums
        are never stored; a unit past K reads zeros)."""
        col = (step * 4 + t) * E
        for m in range(MT):
            row_g = (tile0 + m) * tile_rows + g
            row_h = row_g if gate else row_g + 8
            ok = col < k_cols
            u = slot * MT + m
            load_unit(w1, s1, min(row_g, n_rows - 1), col, ok, wg, u, dm, 2 * u, g_shift)
            load_unit(w3, s3, min(row_h, n_rows - 1), col, ok, wh, u, dm, 2 * u + 1, g_shift)

    @cuda.jit(device=True, inline=True)
    def step_product(smem, base, slot, xoff, wg, wh, dm, a, acc):  # noqa: ANN001, ANN202
        """acc += this step's products from ring slot `slot`: the lane's units decoded once a
        k-tile pair, then for each n-tile its X from the stage at word `base` (xoff[i]: the
        lane's word of pair i in row g; row 8 p + g is 8 p rows on, the same chunk) and
        row_tiles x 2 mma."""
        for i in range(PAIRS):  # k-tiles 2 i, 2 i + 1 of the unit
            for m in range(MT):
                u = slot * MT + m
                for jj in range(2):
                    j = 2 * i + jj
                    a[8 * m + 4 * jj], a[8 * m + 4 * jj + 2] = a_pair(wg, u, j, dm[2 * u])
                    a[8 * m + 4 * jj + 1], a[8 * m + 4 * jj + 3] = a_pair(wh, u, j, dm[2 * u + 1])
            for p in range(n_tiles):
                b0, b1, b2, b3 = lds128(smem, base + xoff[i] + 8 * p * ROW_WORDS)
                for m in range(MT):
                    c = (m * n_tiles + p) * 4
                    q = 8 * m
                    acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma_16816(
                        a[q], a[q + 1], a[q + 2], a[q + 3], b0, b1, acc[c], acc[c + 1], acc[c + 2], acc[c + 3]
                    )
                    acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma_16816(
                        a[q + 4],
                        a[q + 5],
                        a[q + 6],
                        a[q + 7],
                        b2,
                        b3,
                        acc[c],
                        acc[c + 1],
                        acc[c + 2],
                        acc[c + 3],
                    )

    @cuda.jit(device=True, inline=True)
    def block_product(  # noqa: ANN202, C901
        x, w1, s1, w3, s3, out, part, tiles_done, scale, nw, rho, x_next, slots, counter, rms, eps
    ):  # noqa: ANN001
        """The block's outputs of out (T, N) (=, +=, gate) X (T, K) fp16 times W (N, K)^T
        stored; see the module docstring. SCALED: scale (T,), each row's factor; FOLD: nw (N,)
        the next norm's weights, rho (T,), and x_next (T, N) fp16, slots (T, ceil(N / 16)), rms
        (T,) and scale written (counter (1,) int32: zero between launches), skinny.NormFold's."""
        smem = cuda.shared.array(SMEM_WORDS, int32)  # (stages, T_MAX, STEP) fp16 X as words, swizzled
        # (R, MT, 4): the ring of steps' units, step i in slot i % R (the main loop unrolled by R,
        # so a slot is a constant and the ring stays in registers)
        wg = cuda.local.array(RING, int32)  # of row g, an A tile each
        wh = cuda.local.array(RING, int32)  # of row g + 8 (GATE: W3's row g)
        dm = cuda.local.array(DM_WORDS, int32)  # q4: the (d, m) words of row g's and row g + 8's units
        a = cuda.local.array(A_WORDS, int32)  # A fragments of two k-tiles, each A tile
        xoff = cuda.local.array(PAIRS, int32)  # the lane's word of each k-tile pair's X in row g
        acc = cuda.local.array(ACC, float32)  # (row_tiles, n_tiles, 4) C fragments
        for e in range(ACC):
            acc[e] = float32(0.0)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3
        for i in range(PAIRS):
            xoff[i] = int32(chunk_at(g, t * PAIRS + i))
        n_rows = w1.shape[0]
        t_rows, k_cols = x.shape
        tile0 = (cuda.blockIdx.x * warps + warp) * MT  # the warp's first A tile
        live = tile0 * tile_rows < n_rows  # warp-uniform: a warp past N loads nothing
        n_steps = (k_cols + STEP - 1) // STEP
        per = (n_steps + cuda.gridDim.y - 1) // cuda.gridDim.y
        first = cuda.blockIdx.y * per  # the block's steps: first .. first + n - 1
        n = min(per, n_steps - first)
        # q4: a group's columns, 32 or 64, as a shift (skinny's g_shift)
        g_shift = 5 if s1.shape[s1.ndim - 1] * 32 == k_cols else 6
        if live:  # the weights are no earlier kernel's output: the first steps' before the wait
            for k in range(ahead):
                if k < n:
                    load_step(w1, s1, w3, s3, first + k, k, tile0, g, t, n_rows, k_cols, g_shift, wg, wh, dm)
        dependent_start()  # in a programmatic graph: wait for the kernel that wrote X (and out)
        for i in range(stages - 1):  # the first steps' X in flight, a group each
            if i < n:
                stage_x(x, smem, i * X_STAGE, first + i, t_rows, k_cols, tid)
            cp_async_commit()
        stage = 0
        i0 = 0
        while i0 < n:  # R steps a round, unrolled: step i0 + r multiplies ring slot r
            for r in range(R):
                i = i0 + r
                if i < n:  # block-uniform
                    wait_landed()  # this thread's copies of step i have landed ...
                    cuda.syncthreads()  # ... and every thread's; every warp is done with step i - 1's stage
                    fill = i + stages - 1  # the step whose X enters the ring now, where step i - 1's was
                    if fill < n:
                        prev = stage - 1 if stage > 0 else stages - 1  # (fill % stages, without a division)
                        stage_x(x, smem, prev * X_STAGE, first + fill, t_rows, k_cols, tid)
                    cp_async_commit()  # (an empty group near the end)
                    if live:
                        if i + ahead < n:  # into the slot step i - 1 used
                            load_step(w1, s1, w3, s3, first + i + ahead, (r + ahead) % R, tile0, g, t, n_rows,
                                      k_cols, g_shift, wg, wh, dm)  # fmt: skip
                        step_product(smem, stage * X_STAGE, r, xoff, wg, wh, dm, a, acc)
                    stage = stage + 1 if stage < stages - 1 else 0
            i0 += R

        if cuda.gridDim.y > 1:  # the tile's splits meet: the last to finish adds them up in split order
            n_splits = cuda.gridDim.y
            tile = cuda.blockIdx.x
            # (tiles, splits, ACC, threads); unsigned, so that the loads take no wraparound test
            home = uint32(tile * n_splits * ACC * threads + tid)
            for e in range(ACC):
                part[home + uint32((cuda.blockIdx.y * ACC + e) * threads)] = acc[e]
            wait_all()  # (no copy is in flight: smem[0] carries the answer)
            if not last_to_arrive(tiles_done, tile, n_splits, smem, 0):
                return  # block-uniform, after the last barrier
            for e in range(ACC):
                acc[e] = float32(0.0)
            for z in range(n_splits):  # in split order: the same sums whichever block is last
                at = home + uint32(z * ACC * threads)
                for e in range(ACC):
                    acc[e] += part[at + uint32(e * threads)]
            if tid == 0:
                tiles_done[tile] = 0  # for the next launch
        # epilogue: accumulator 4 (m n_tiles + p) + r of lane (g, t) is A row g + 8 (r >> 1) of
        # tile m, token 8 p + 2 t + (r & 1)
        n_cols = out.shape[1]
        if live:
            for m in range(MT):
                for p in range(n_tiles):
                    c = (m * n_tiles + p) * 4
                    for r in range(2):
                        token = 8 * p + 2 * t + r
                        if gate:  # r: W1's sum, r + 2: W3's, of output (tile) * 8 + g
                            col = (tile0 + m) * 8 + g
                            if token < t_rows and col < n_cols:
                                store_gate(acc[c + r], acc[c + 2 + r], token, col, out, s1, s3, scale)
                        else:
                            squares = float32(0.0)  # FOLD: y^2 of the lane's two columns
                            for hh in range(2):  # A rows g and g + 8
                                col = (tile0 + m) * 16 + g + 8 * hh
                                if token < t_rows and col < n_cols:
                                    y = store_sum(
                                        acc[c + 2 * hh + r], token, col, out, s1, scale, nw, rho, x_next
                                    )
                                    if fold:
                                        squares += y * y
                            if fold:  # the token's sum over the tile's 16 columns: the lanes of its g
                                for lanes in (4, 8, 16):
                                    squares += cuda.shfl_xor_sync(FULL_MASK, squares, lanes)
                                if g == 0 and token < t_rows and tile0 + m < slots.shape[1]:
                                    slots[token, tile0 + m] = squares
        if fold:  # every tile's slots published, the other blocks' acquired; the last adds them up
            wait_all()  # (no copy is in flight: smem[0] carries the answer)
            if last_to_arrive(counter, 0, cuda.gridDim.x, smem, 0):
                fold_scales(slots, t_rows, n_cols, rho, rms, scale, eps, counter)

    bounds = {"launch_bounds": (threads, min_blocks)} if min_blocks else {}
    jit = cuda.jit if SIM else cuda.jit(cache=True, **bounds)
    # the norm's arrays of a kernel that takes none are never read (their branches are pruned at
    # compile time): out stands in for them
    zero = float32(0.0)
    if fold:

        @jit
        def panel_kernel(
            x, w1, s1, w3, s3, out, part, tiles_done, nw, rho, x_next, slots, counter, rms, scale, eps
        ):  # noqa: ANN001, ANN202
            """RESIDUAL with the next RMSNorm folded in: out += X W^T; x_next = fp16(out nw rho);
            rms, scale = rms / rho (pycalm.cpu.reference.matmul_residual_fold_ref)."""
            block_product(
                x, w1, s1, w3, s3, out, part, tiles_done, scale, nw, rho, x_next, slots, counter, rms, eps
            )

    elif norm == SCALED:

        @jit
        def panel_kernel(x, w1, s1, w3, s3, out, part, tiles_done, scale):  # noqa: ANN001, ANN202
            """PLAIN or GATE with each row's sums times scale[row] (matmul_ref's and
            matmul_gate_ref's scale)."""
            block_product(x, w1, s1, w3, s3, out, part, tiles_done, scale, out, out, out, out, out, out, zero)

    else:

        @jit
        def panel_kernel(x, w1, s1, w3, s3, out, part, tiles_done):  # noqa: ANN001, ANN202
            """out (T, N) (=, +=, gate) X (T, K) fp16 times W (N, K)^T stored. Must match
            pycalm.cpu.reference.matmul_ref / matmul_residual_ref / matmul_gate_ref."""
            block_product(x, w1, s1, w3, s3, out, part, tiles_done, out, out, out, out, out, out, out, zero)

    return panel_kernel


def panel_matmul(
    x: object,
    w: object,
    out: object,
    dtype: str,
    *,
    stream: object,
    scratch: PanelScratch,
    mode: str = "plain",
    w3: object = None,
    scale: object = None,
    fold: NormFold | None = None,
    block: tuple = BLOCK,
) -> None:
    """out = X W^T ("plain"), out += X W^T ("residual"), or out = silu(X W^T) * (X W3^T)
    ("gate"), as pycalm.kernels.matmul.matmul, for X (T, K) float16 with T <= 64 and K a
    multiple of UNIT[dtype] (fits); scratch from panel_scratch (K split over blocks where the
    blocks leave SMs idle). scale (T,) float32 ("plain", "gate"): each row's sums times it;
    fold ("residual"): the next RMSNorm folded in (skinny.NormFold), as skinny_matmul's. block:
    (warps, row_tiles, stages, min_blocks, ahead), the module's BLOCK unless given."""
    check_mode(mode, w3)
    t_rows, k_cols = x.shape
    if not fits(dtype, k_cols):
        raise PycalmError(
            f"the panel matmul needs K a multiple of {UNIT.get(dtype, 8)} for {dtype}, got {k_cols}"
        )
    norm, norm_args = norm_part("panel", mode, scale, fold)
    n_tiles = n_tiles_for(t_rows)
    warps, row_tiles, stages, min_blocks, ahead = block
    kernel = make_panel_kernel(dtype, MODES[mode], n_tiles, warps, row_tiles, stages, min_blocks, ahead, norm)
    args = stored_args(w, w3, dtype, k_cols)
    if len(args) == 2:  # fp16, fp8, gf4: W1, W3 stand in for the scales (unread)
        args = (args[0], args[0], args[1], args[1])
    blocks = -(-out.shape[1] // rows_a_block(mode, warps, row_tiles))
    splits = split_count(blocks, k_cols, dtype)
    acc = row_tiles * 4 * n_tiles
    if splits > 1 and (
        scratch.part.size < blocks * splits * acc * 32 * warps or scratch.tiles_done.size < blocks
    ):
        raise PycalmError(f"panel scratch too small for {blocks} blocks of {splits} splits")
    kernel[(blocks, splits), 32 * warps, stream](x, *args, out, scratch.part, scratch.tiles_done, *norm_args)
