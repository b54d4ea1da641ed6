"""Matrix products for T tokens on the tensor cores, with fp16 / fp8 e5m2 / gf4 / q8 / q4 weights.

  PLAIN:     out = X W^T                       (qkv, the classifier)
  RESIDUAL:  out += X W^T                      (wo and w2: the residual add fused in)
  GATE:      out = silu(X W1^T) * (X W3^T)     (w1 and w3 in one kernel)

X is (T, K) float16: the activations of T tokens, written in fp16 by the kernel before (the
RMSNorm of T rows, attention's output, or this kernel's GATE mode, whose h is w2's X), because
fp16 is what the tensor cores and ldmatrix take. W is the stored (N, K) weight matrix of
pycalm.model.formats (float16, uint8 e5m2, uint32 gf4 groups of 8 along K, or a Quantized q8 / q4
pair of codes and scales), the same arrays the decode path (pycalm.kernels.matvec) reads: no
second copy. out is (T, N) float32 for PLAIN and
RESIDUAL (the residual stream stays float32) and (T, N) float16 for GATE. K is a multiple of 8,
T and N anything. Reference: pycalm.cpu.reference.matmul_ref, matmul_residual_ref, matmul_gate_ref.

Tiling. A block computes a BM x BN tile of out (GATE: BM x BN/2, from BN/2 rows of W1 and the
same rows of W3), K in steps of BK = 32. Each step stages a BM x BK tile of X and a BN x BK tile
of W in shared memory as fp16; the warps (WARPS_M x WARPS_N) each own a WM x WN sub-tile
(WM = BM / WARPS_M, WN = BN / WARPS_N) and run WM/16 x WN/8 mma.sync m16n8k16 tiles for each
16 of K, accumulating in float32 registers. Default: BM = BN = 128, 8 warps as 2 x 4, so a warp
computes 64 x 32 (16 mma tiles, 64 accumulators a thread) and reads each A fragment for 4 mma
and each B fragment for 4. Passes of at most 16 rows take ROW_TILE, BM = 16 and BN = 32 with 2
warps of 16 x 16: a block per 32 rows of W, so a one-row pass spreads W over N/32 blocks. A
row's sums do not depend on the tile (each output element takes K's 16-wide slices in order, in
one accumulator), so a row's logits are the same bits in a pass of 1 row or of 2,048. On an
H100 / H200 the prompt pass (pycalm.gpu.prefill) sends passes of wgmma_matmul.WGMMA_MIN_ROWS rows
and more (512 or 1,024) to Hopper's wgmma instead (pycalm.kernels.wgmma_matmul: 2.3x this tile's
TFLOP/s in fp16), the same slices in the same order, each slice's sum in the hardware's order.

Shared memory: per stage, X tile (BM, BK) and W tile (BN, BK) fp16, row-major in int32 words
(two halves a word, 64 bytes a row), the four 16-byte chunks of row r stored in the order
c ^ ((r >> 1) & 3) (swizzled). That makes ldmatrix conflict-free: its 8 row addresses (rows
8q..8q+7, one chunk c each) land at word offsets 16 (r & 1) + 4 (c ^ ((r >> 1) & 3)) mod 32,
eight disjoint groups of four banks (unswizzled, rows r and r + 2 would share banks). Three
stages (48 KiB, the static limit, at 128 x 128): while the warps multiply stage s, the next two
steps' tiles are being fetched; one barrier a step (after cp.async.wait_group 1) makes a step's
tiles visible and separates the reads of a stage from its next writes.

Registers: capped (ptxas maxrregcount) so that Tile.blocks_per_sm blocks fit an SM: 128 for
the default's 256 threads and two blocks.

Fetching. X (and fp16 W) go global -> shared by cp.async, 16 bytes (8 halves) a copy, rows past
T or N and columns past K zero-filled. fp8 and gf4 W come through registers: the next step's
8-weight units (8 bytes of e5m2 / one gf4 word) of the step stages - 1 ahead are loaded at the start
of a step, and after this step's mma they are decoded to fp16 and stored (one 16-byte shared
store a unit). e5m2 is
the top byte of an fp16, so one prmt builds two halves; a gf4 weight is (q - 4) * (-s/4),
exact in fp16, two at a time in half precision (common.gf4_pair: a prmt, a LOP3, an HADD2 and
an HFMA2 a pair). The decode of a weight is paid once per block and serves the BM rows of X in
the tile.

q8 and q4 come through registers too, a thread taking w_units consecutive units of a W row, so
that its codes come in one load (default tile: q8 16 bytes, q4 8). q8: the tile holds the codes
(exact in fp16: common.q8_pairs, a prmt and an HADD2 a pair), and the row scale (W's row is
out's column) multiplies the float32 sums in the epilogue. q4: a step's 32 columns lie in one
group (G = 32 or 64), so a thread loads the step d and offset m once a step and stores
fp16(d q + m), d q + m rounded once (common.q4_pair, an HFMA2 on fp16 d and m: the reference's
float32 weight rounded to fp16, 2**-11 relative, but for a float32 double rounding once in a
great while). K: a multiple of 16 for q8, of the group size for q4.

Fragments (pycalm.kernels.tensorcore has the PTX layouts). A (16 x 16 of X) by one ldmatrix.x4:
lane l addresses row l & 15, columns 8 (l >> 4)..+7 of the m-tile, so matrices 0..3 are the
quarters (rows 0-7 | 8-15) x (cols 0-7 | 8-15) in a0..a3 order. B for two n-tiles by one
ldmatrix.x4 on W's rows (W's row-major (N, K) is the "col" B operand as it is): lane l
addresses row (l & 7) + 8 (l >> 4), columns 8 ((l >> 3) & 1)..+7, so the registers are b0, b1 of
n-tile 2p and b0, b1 of n-tile 2p + 1. Accumulator c of lane l holds out rows g, g + 8 and
columns 2t, 2t + 1 of its 16 x 8 tile (g = l >> 2, t = l & 3).

GATE interleaves W1 and W3 in the W tile by 8 rows (tile row r: matrix (r >> 3) & 1, output
column 8 (r >> 4) + (r & 7)), so n-tiles 2p and 2p + 1 of a warp hold the W1 and W3 sums of the
same outputs in the same lanes, and the gate needs no exchange.

Grid: blockIdx.x over the T tiles (fastest, so the blocks that share a strip of W run together
and read it from L2), blockIdx.y over the N tiles. Threads: 32 WARPS_M WARPS_N.

Split K. A pass of a few dozen rows has few tiles (wo at 64 rows: 64 blocks of MID_TILE for 132
SMs), and each walks all of K. With a scratch (matmul_split_scratch), a launch whose tiles fill
less than one wave of blocks (split_blocks: blocks_per_sm on every SM) cuts K into splits
(splits_for: up to that wave, each of at least MIN_SPLIT_STEPS steps) over gridDim.z. Each
block writes its float32 accumulators to its slot of the scratch; the last block of a tile to
finish (an atomic counter a tile, reset by it) adds the tile's slots in split order and runs the
epilogue on the sums (the residual add, the q8 scale and the gate see whole sums). The sums
then depend on the number of splits, so a split launch's bits differ from an unsplit one's;
batch-invariant passes use pycalm.kernels.skinny instead. Bytes: the weights once, each block's
accumulators written and read once (L2).

Grouped (Mixtral's experts, pycalm.kernels.moe_rows): W is a stack (n_experts, N, K) viewed as
(n_experts N, K), and blockIdx.x runs over (expert e, m-tile) pairs, e-major, ceil(T / BM)
m-tiles an expert whatever its count (the counts live on the device; a block past count[e]
returns before its first barrier). The block's rows are the m-tile's entries of expert e's
group (pycalm.kernels.rows.moe_group: rows[e, i], the token rows in increasing order), each
gathered by its own cp.async: row i's output goes to slot t k + j of the (T k, N) output, where
route_ids[t, j] == e. GATE gathers X by token row t (the normed rows), PLAIN by slot (h, written
by the grouped GATE). Each expert's weights are read once a pass.

Bytes and FLOPs: 2 T N K FLOPs (GATE: 4 T N K). The weights are read from memory once (later
T-tile blocks of a strip find them in L2), X is re-read from L2 per N tile, out written (read
and written for RESIDUAL).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32
from numba.types import float16

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    dependent_start,
    fp16_encode,
    gf4_factor,
    gf4_pair,
    last_to_arrive,
    prmt,
    q4_pair,
    q8_pairs,
)
from pycalm.kernels.tensorcore import (
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    ldg64,
    ldg128w,
    ldmatrix_x4,
    mma_16816,
    pack_f16x2,
    sts128,
)
from pycalm.model.formats import QUANTIZED, Quantized

PLAIN, RESIDUAL, GATE = 0, 1, 2  # epilogue modes
MODES = {"plain": PLAIN, "residual": RESIDUAL, "gate": GATE}
BK = 32  # K a step (two m16n8k16 k-slices)
ROW_WORDS = BK // 2  # int32 words a staged row (64 bytes)
UNIT = 8  # weights a fetch unit (16 bytes of fp16, 8 of e5m2, one gf4 word): a 16-byte chunk
CHUNKS = BK // UNIT  # 16-byte chunks a staged row


class Tile(NamedTuple):
    """A block's tile and its warps (compile-time shape of matmul_kernel)."""

    block_m: int = 128  # BM: rows of X (tokens) a block
    block_n: int = 128  # BN: rows of W a block (GATE: half of W1, half of W3)
    warps_m: int = 2  # warps along M; each covers block_m / warps_m rows
    warps_n: int = 4  # warps along N; each covers block_n / warps_n rows of W (a multiple of 16)
    stages: int = 3  # steps of K staged at once (2 to 4): stages - 1 in flight during the mma
    blocks_per_sm: int = 2  # resident blocks an SM the registers are capped for

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


TILE = Tile()
# passes of at most ROW_TILE.block_m rows (a sampled token's pass, a short chat turn): 16 rows
# (one m-tile) by 32 of W, 2 warps, so a one-row pass has a block per 32 output rows instead of
# one per 128 (its 128-row tile would be 127 rows of padding). The sums are the same bits as
# TILE's: every output element takes the same k-slices in the same order whatever the tile.
ROW_TILE = Tile(16, 32, 1, 2, 3, 8)
# passes of 17 to 64 rows (a rows pass of many drafts or sequences): 64 rows by 64 of W, 4 warps
# of 32 x 32, 4 stages (three steps of K in flight), 4 blocks an SM, K split over blocks where
# the N tiles are too few to fill the SMs: the fastest of five tiles scripts/kernels/rows_matmul.py
# --tiles timed at 32 and 64 rows, when the split kernels still spilled their accumulators (not
# swept again since; docs/BENCHMARKS.md has a layer's products on it)
MID_TILE = Tile(64, 64, 2, 2, 4, 4)
# under the simulator a Python thread runs each GPU thread: tests use small tiles
SIM_TILE = Tile(32, 32, 2, 2)
SIM = _numba_config.ENABLE_CUDASIM
MIN_SPLIT_STEPS = 1 if SIM else 8  # steps of K (BK columns each) a split takes at least
MAX_SPLITS = 16  # splits of K a tile at most
SIM_SMS = 2  # the simulator's "SMs": tests split K over a few blocks


class SplitScratch(NamedTuple):
    """Device scratch of the split-K launches (matmul_split_scratch); the launches on one stream
    share it, one after another."""

    part: object  # (blocks * acc words * threads,) float32: each block's partial sums
    tiles_done: object  # (blocks,) int32: a tile's finished splits, zero between launches


@functools.cache
def sm_count() -> int:
    """The current device's SMs (SIM_SMS under the simulator)."""
    return SIM_SMS if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT


def split_blocks(tile: Tile) -> int:
    """Blocks a split launch fills: the tile's resident blocks an SM on every SM (one wave)."""
    return tile.blocks_per_sm * sm_count()


def _acc_words(tile: Tile) -> int:
    return (tile.block_m // tile.warps_m // 16) * (tile.block_n // tile.warps_n // 8) * 4


def matmul_split_scratch(stream: object = 0) -> SplitScratch:
    """The scratch of split launches of every tile tile_for picks: a wave of blocks' partial
    sums, and their counters."""
    tiles = (ROW_TILE, SIM_TILE) if SIM else (ROW_TILE, MID_TILE, TILE)
    words = max(split_blocks(t) * _acc_words(t) * t.threads for t in tiles)
    blocks = max(split_blocks(t) for t in tiles)
    part = cuda.device_array(words, np.float32, stream=stream)
    return SplitScratch(part, cuda.to_device(np.zeros(blocks, np.int32), stream=stream))


def splits_for(tile: Tile, tiles: int, k_cols: int) -> int:
    """Splits of K for a launch of `tiles` tiles: as many as fill one wave of blocks
    (split_blocks), each of at least MIN_SPLIT_STEPS steps; 1 where the tiles fill it alone."""
    steps = -(-k_cols // BK)
    return max(1, min(split_blocks(tile) // tiles, steps // MIN_SPLIT_STEPS, MAX_SPLITS))


def _jit_capped(max_registers: int):  # noqa: ANN202
    """cuda.jit with a register cap (the simulator's jit takes none)."""
    if _numba_config.ENABLE_CUDASIM:
        return cuda.jit
    return cuda.jit(max_registers=max_registers, cache=True)


@cuda.jit(device=True, inline=True)
def swizzled(r: int, c: int) -> int:
    """Word of 16-byte chunk c (0..3) of staged row r: the chunk index XOR (r >> 1) & 3, so
    that the 8 rows an ldmatrix reads (r = 8q..8q+7, one chunk each) fall in 8 distinct groups
    of 4 banks (the 64-byte rows alone would put rows r and r + 2 in the same banks)."""
    return r * ROW_WORDS + 4 * (c ^ ((r >> 1) & 3))


# ---------------------------------------------------------------------------------------------
# weight fetch: units of 8 weights of one row of W into 4 words (8 halves) of the staged tile


@cuda.jit(device=True, inline=True)
def _fp8_words(lo: int, hi: int) -> tuple[int, int, int, int]:
    """8 e5m2 bytes (two little-endian words) -> 4 f16x2 words: each byte becomes the top
    byte of a half (prmt: selector nibble 4 takes a zero byte of the second operand)."""
    return (
        prmt(lo, int32(0), int32(0x1404)),
        prmt(lo, int32(0), int32(0x3424)),
        prmt(hi, int32(0), int32(0x1404)),
        prmt(hi, int32(0), int32(0x3424)),
    )


@cuda.jit(device=True, inline=True)
def _gf4_words(w: int) -> tuple[int, int, int, int]:
    """One gf4 word -> its 8 weights as 4 f16x2 words, exact: (q_k - 4) * (-s/4) (common.gf4_pair:
    2 instructions a weight)."""
    f = gf4_factor(w)
    return gf4_pair(w, 0, f), gf4_pair(w, 1, f), gf4_pair(w, 2, f), gf4_pair(w, 3, f)


@cuda.jit(device=True, inline=True)
def _q8_words(lo: int, hi: int) -> tuple[int, int, int, int]:
    """8 q8 codes (two little-endian words of int8) -> 4 f16x2 words of the codes, exact
    (common.q8_pairs: 1.25 instructions a weight)."""
    h0, h1 = q8_pairs(lo)
    h2, h3 = q8_pairs(hi)
    return h0, h1, h2, h3


@cuda.jit(device=True, inline=True)
def _q4_words(w: int, d: float, m: float) -> tuple[int, int, int, int]:
    """One q4 word and its group's step d and offset m (fp16, as loaded) -> its 8 weights
    d q_k + m, each rounded once to fp16, as 4 f16x2 words (common.q4_pair: 2 instructions a
    weight, and two conversions a word for (d, d) and (m, m))."""
    dd, mm = pack_f16x2(float32(d), float32(d)), pack_f16x2(float32(m), float32(m))
    return q4_pair(w, 0, dd, mm), q4_pair(w, 1, dd, mm), q4_pair(w, 2, dd, mm), q4_pair(w, 3, dd, mm)


@functools.cache
def make_matmul_kernel(dtype: str, mode: int, tile: Tile = TILE, grouped: bool = False, split: bool = False):  # noqa: ANN201, C901
    """matmul_kernel for a weight dtype, an epilogue mode and a tile (one compile each); grouped:
    the expert-grouped form (see the module docstring), arguments (x, w1, w3, out, count, rows,
    route_ids); split: K split over gridDim.z blocks a tile (see "Split K"), two more arguments
    (part, tiles_done)."""
    if split and grouped:
        raise PycalmError("the grouped matmul does not split K")
    block_m, block_n, warps_m, warps_n, stages, blocks_per_sm = tile
    max_registers = min(255, 65536 // (blocks_per_sm * tile.threads) // 8 * 8)  # an SM has 64k
    threads = tile.threads
    warp_m = block_m // warps_m  # WM: rows of out a warp
    warp_n = block_n // warps_n  # WN: rows of the W tile a warp
    m_tiles = warp_m // 16  # mma tiles along M a warp
    n_tiles = warp_n // 8  # mma tiles along N a warp (even: ldmatrix.x4 loads two)
    x_units = block_m * CHUNKS // threads  # X copies a thread a step
    w_units = block_n * CHUNKS // threads  # W units a thread a step
    x_stage = block_m * ROW_WORDS  # words a stage of the X tile
    w_stage = block_n * ROW_WORDS
    out_n = block_n // 2 if mode == GATE else block_n  # out columns a block
    gate = mode == GATE
    residual = mode == RESIDUAL
    fp16 = dtype == "fp16"
    fp8 = dtype == "fp8"
    q8, q4 = dtype == "q8", dtype == "q4"
    quantized = q8 or q4  # a thread's units are consecutive in a row (see the module docstring)
    # q8 / q4: the thread's codes of a step, loaded `pieces` loads of load_words words each
    load_words = max(1, min(4, 2 * w_units if q8 else w_units))
    pieces = (2 * w_units if q8 else w_units) // load_words
    piece_cols = 4 * load_words if q8 else 8 * load_words  # W columns a load covers
    strided_units = 0 if quantized else w_units  # W units a thread takes threads apart in fetch
    # the shared and local arrays' sizes, as compile-time constants
    x_words, w_words = stages * x_stage, stages * w_stage
    wreg_words = 2 * w_units
    acc_words, a_words, b_words = m_tiles * n_tiles * 4, m_tiles * 4, n_tiles * 2
    if (
        warp_m % 16
        or warp_n % 16
        or x_units * threads != block_m * CHUNKS
        or w_units * threads != block_n * CHUNKS
        or stages not in (2, 3, 4)
        or (quantized and w_units not in (1, 2, 4))  # a thread's units within one row-step
    ):
        raise PycalmError(f"tile {tuple(tile)} does not divide into m16n8k16 warp tiles and fetch units")

    @cuda.jit(device=True, inline=True)
    def w_source_row(r: int, n0: int) -> tuple[int, int]:
        """Tile row r -> (matrix: 0 W1 / 1 W3, row of that matrix)."""
        if gate:
            return (r >> 3) & 1, n0 + 8 * (r >> 4) + (r & 7)
        return 0, n0 + r

    @cuda.jit(device=True, inline=True)
    def group_slot(e, i, count, rows, route_ids):  # noqa: ANN001, ANN202
        """Grouped: the slot t k + j of entry i of expert e's group (t = rows[e, i], route_ids[t, j]
        == e), or -1 past count[e]."""
        slot = -1
        if i < count[e]:
            t = rows[e, i]
            k = route_ids.shape[1]
            for j in range(k):
                if route_ids[t, j] == e:
                    slot = t * k + j
        return slot

    @cuda.jit(device=True, inline=True)
    def fetch(x, w1, w3, smem_x, smem_w, wregs, x_rows, stage, k0, n0, w_row0, w_rows):  # noqa: ANN001, ANN202
        """Start the step at column k0: X rows x_rows (this thread's, -1: zeros; and fp16 W) by
        cp.async into `stage`, fp8 / gf4 W units into wregs (stored by put_w after this step's
        mma). W's tile rows are rows w_row0 + n0.. of w1 / w3, w_rows of them in the matrix. One
        cp.async group."""
        tid = cuda.threadIdx.x
        k_cols = x.shape[1]
        for i in range(x_units):
            u = tid + i * threads
            r, c = u // CHUNKS, u % CHUNKS
            row, col = x_rows[i], k0 + c * UNIT
            word = stage * x_stage + swizzled(r, c)
            if row >= 0 and col < k_cols:
                cp_async16(smem_x, word, x, row, col, 16)
            else:  # zero-filled: no byte read from the (in-bounds) address
                cp_async16(smem_x, word, x, 0, 0, 0)
        for i in range(strided_units):
            u = tid + i * threads
            r, c = u // CHUNKS, u % CHUNKS
            which, row = w_source_row(r, n0)
            col = k0 + c * UNIT
            ok = row < w_rows and col < k_cols
            row += w_row0  # grouped: expert e's matrix in the stack
            src = w3 if which else w1
            if fp16:
                word = stage * w_stage + swizzled(r, c)
                if ok:
                    cp_async16(smem_w, word, src, row, col, 16)
                else:  # zero-filled
                    cp_async16(smem_w, word, src, 0, 0, 0)
            elif fp8:
                lo, hi = int32(0), int32(0)
                if ok:
                    lo, hi = ldg64(src, row, col)
                wregs[2 * i] = lo
                wregs[2 * i + 1] = hi
            else:
                lo = int32(0)
                if ok:
                    lo = int32(src[row, col >> 3])  # col // UNIT: col >= 0, a shift
                wregs[2 * i] = lo
        cp_async_commit()

    @cuda.jit(device=True, inline=True)
    def fetch_codes(w1, s1, w3, s3, wregs, wscale, k0, n0, w_row0, w_rows, k_cols, g_shift1, g_shift3):  # noqa: ANN001, ANN202
        """q8 / q4 (else a no-op): this thread's w_units consecutive units of a W tile row at
        column k0 into wregs, by 16-byte loads (8 / 4 where it has fewer bytes), and q4's group
        step and offset into wscale (group col >> g_shift1 / g_shift3: G = 32 or 64 columns, W1's
        and W3's apart); zeros past N and K (K a multiple of a load's columns)."""
        if quantized:
            u = cuda.threadIdx.x * w_units
            which, row = w_source_row(u // CHUNKS, n0)
            col = k0 + (u % CHUNKS) * UNIT
            src = w3 if which else w1
            for i in range(wreg_words):
                wregs[i] = int32(0)
            for p in range(pieces):
                c = col + p * piece_cols
                if row < w_rows and c < k_cols:
                    e = c if q8 else c >> 3  # the piece's first element: a code / a word of 8
                    if load_words == 4:
                        j = 4 * p
                        wregs[j], wregs[j + 1], wregs[j + 2], wregs[j + 3] = ldg128w(src, w_row0 + row, e)
                    elif load_words == 2:
                        wregs[2 * p], wregs[2 * p + 1] = ldg64(src, w_row0 + row, e)
                    else:
                        wregs[p] = int32(src[w_row0 + row, e])
            if q4:  # the group's step d and offset m (one group: G is a multiple of BK)
                scales = s3 if which else s1
                group, ok = col >> (g_shift3 if which else g_shift1), row < w_rows and col < k_cols
                # kept as loaded, converted in put_w: a conversion here would wait for the loads
                wscale[0] = scales[w_row0 + row, group, 0] if ok else float16(0)
                wscale[1] = scales[w_row0 + row, group, 1] if ok else float16(0)

    @cuda.jit(device=True, inline=True)
    def put_w(smem_w, wregs, wscale, stage):  # noqa: ANN001, ANN202
        """fp8 / gf4 / q8 / q4: decode the fetched units to fp16 and store them into `stage`."""
        if quantized:
            u = cuda.threadIdx.x * w_units
            for i in range(w_units):
                r, c = (u + i) // CHUNKS, (u + i) % CHUNKS
                if q8:
                    h0, h1, h2, h3 = _q8_words(wregs[2 * i], wregs[2 * i + 1])
                else:
                    h0, h1, h2, h3 = _q4_words(wregs[i], wscale[0], wscale[1])
                sts128(smem_w, stage * w_stage + swizzled(r, c), h0, h1, h2, h3)
        elif not fp16:
            tid = cuda.threadIdx.x
            for i in range(w_units):
                u = tid + i * threads
                r, c = u // CHUNKS, u % CHUNKS
                if fp8:
                    h0, h1, h2, h3 = _fp8_words(wregs[2 * i], wregs[2 * i + 1])
                else:
                    h0, h1, h2, h3 = _gf4_words(wregs[2 * i])
                sts128(smem_w, stage * w_stage + swizzled(r, c), h0, h1, h2, h3)

    wait_stage = cp_async_wait(stages - 2)  # cp.async.wait_group stages - 2

    @cuda.jit(device=True, inline=True)
    def wait_oldest() -> None:
        """This thread's copies of the oldest step in flight have landed (stages - 1 in flight)."""
        wait_stage()

    @cuda.jit(device=True, inline=True)
    def block_product(x, w1, s1, w3, s3, out, count, rows, route_ids, part, tiles_done):  # noqa: ANN001, ANN202, C901
        """The block's tile of out (=, +=, gate) X fp16 times W^T stored (s1, s3: q8 / q4 W1's
        and W3's scales, unread otherwise); grouped: of expert e's m-tile, rows gathered and
        scattered by group_slot (count, rows, route_ids unread otherwise); split: its split of K,
        the partial sums meeting in part (tiles_done counting a tile's finished splits)."""
        smem_x = cuda.shared.array(x_words, int32)  # (stages, BM, BK) fp16 as words, swizzled
        smem_w = cuda.shared.array(w_words, int32)  # (stages, BN, BK) fp16 as words, swizzled
        wregs = cuda.local.array(wreg_words, int32)  # fp8 / gf4 / q8 / q4: a step's fetched W units
        wscale = cuda.local.array(2, float16)  # q4: the fetched units' group step d and offset m
        acc = cuda.local.array(acc_words, float32)  # (m_tiles, n_tiles, 4) C fragments
        a = cuda.local.array(a_words, int32)  # (m_tiles, 4) A fragments of one k-slice
        b = cuda.local.array(b_words, int32)  # (n_tiles, 2) B fragments of one k-slice
        x_rows = cuda.local.array(x_units, int32)  # the X row of each of this thread's copies, -1: none
        for i in range(acc_words):
            acc[i] = float32(0.0)

        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        wm, wn = warp // warps_n, warp % warps_n
        n0 = cuda.blockIdx.y * out_n
        steps = (x.shape[1] + BK - 1) // BK
        # q4: log2 of W1's and W3's group columns (32 or 64: formats.Q4_GROUPS, each its own), so
        # that a step's group is a shift, not a division (scales (N, groups, 2); read for q4 alone)
        g_shift1 = 5 if x.shape[1] == 16 * (s1.size // s1.shape[0]) else 6
        g_shift3 = 5 if x.shape[1] == 16 * (s3.size // s3.shape[0]) else 6
        s0 = 0  # the block's first step
        if split:  # split z of gridDim.z takes the z-th run of ceil(steps / splits) steps
            per = (steps + cuda.gridDim.z - 1) // cuda.gridDim.z
            s0 = cuda.blockIdx.z * per
            steps = max(0, min(steps - s0, per))
        # ldmatrix row addresses of this lane (words in a stage, for m-tile / n-tile pair 0):
        # A row (lane & 15), 16-byte chunk 2 ks + (lane >> 4); B row (lane & 7) + 8 (lane >> 4),
        # chunk 2 ks + ((lane >> 3) & 1). The rows' swizzle (row >> 1) & 3 is (lane >> 1) & 3
        # for both, since the tiles start at multiples of 8 rows.
        flip = (lane >> 1) & 3
        a_row = (wm * warp_m + (lane & 15)) * ROW_WORDS
        b_row = (wn * warp_n + (lane & 7) + 8 * (lane >> 4)) * ROW_WORDS
        a_chunk0 = 4 * ((lane >> 4) ^ flip)
        a_chunk1 = 4 * ((2 + (lane >> 4)) ^ flip)
        b_chunk0 = 4 * (((lane >> 3) & 1) ^ flip)
        b_chunk1 = 4 * ((2 + ((lane >> 3) & 1)) ^ flip)

        dependent_start()  # in a programmatic graph: wait for the kernel that wrote X (and out)
        if grouped:  # blockIdx.x: m-tile of expert e, e-major
            m_tiles_max = (route_ids.shape[0] + block_m - 1) // block_m
            expert = cuda.blockIdx.x // m_tiles_max
            m0 = (cuda.blockIdx.x % m_tiles_max) * block_m
            if m0 >= count[expert]:
                return  # block-uniform, before any barrier: the expert has fewer rows
            w_row0, w_rows = expert * out.shape[1], out.shape[1]
        else:
            expert = 0
            m0 = cuda.blockIdx.x * block_m
            w_row0, w_rows = 0, w1.shape[0]
        for i in range(x_units):  # the rows this thread copies at every step
            r = (tid + i * threads) // CHUNKS
            if grouped:
                slot = group_slot(expert, m0 + r, count, rows, route_ids)
                if gate and slot >= 0:  # GATE reads the token row t of slot t k + j
                    slot = slot // route_ids.shape[1]
                x_rows[i] = slot
            else:
                x_rows[i] = m0 + r if m0 + r < x.shape[0] else -1
        for s in range(stages - 1):  # the first stages - 1 steps in flight
            if s < steps:
                fetch(x, w1, w3, smem_x, smem_w, wregs, x_rows, s, (s0 + s) * BK, n0, w_row0, w_rows)
                fetch_codes(
                    w1,
                    s1,
                    w3,
                    s3,
                    wregs,
                    wscale,
                    (s0 + s) * BK,
                    n0,
                    w_row0,
                    w_rows,
                    x.shape[1],
                    g_shift1,
                    g_shift3,
                )
                put_w(smem_w, wregs, wscale, s)
            else:
                cp_async_commit()  # an empty group keeps the count of groups in flight

        stage = 0  # step % stages, counted (a modulo of the 64-bit step costs a dozen instructions a step)
        for step in range(steps):
            ahead_stage = stage - 1 if stage > 0 else stages - 1  # (step + stages - 1) % stages
            wait_oldest()  # this thread's copies of this step have landed
            cuda.syncthreads()  # everyone's copies and stores of this step are visible, and
            # every warp is done reading the stage that the fetch below overwrites
            ahead = step + stages - 1
            if ahead < steps:  # its copies and loads fly during this step's mma
                k0 = (s0 + ahead) * BK
                fetch(x, w1, w3, smem_x, smem_w, wregs, x_rows, ahead_stage, k0, n0, w_row0, w_rows)
                fetch_codes(
                    w1, s1, w3, s3, wregs, wscale, k0, n0, w_row0, w_rows, x.shape[1], g_shift1, g_shift3
                )
            else:
                cp_async_commit()  # an empty group
            xs = stage * x_stage + a_row
            ws = stage * w_stage + b_row
            for ks in range(BK // 16):
                a_chunk = a_chunk0 if ks == 0 else a_chunk1
                b_chunk = b_chunk0 if ks == 0 else b_chunk1
                for i in range(m_tiles):
                    a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3] = ldmatrix_x4(
                        smem_x, xs + i * 16 * ROW_WORDS + a_chunk
                    )
                for p in range(n_tiles // 2):
                    b[4 * p], b[4 * p + 1], b[4 * p + 2], b[4 * p + 3] = ldmatrix_x4(
                        smem_w, ws + p * 16 * ROW_WORDS + b_chunk
                    )
                for i in range(m_tiles):
                    for j in range(n_tiles):
                        c = 4 * (i * n_tiles + j)
                        acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma_16816(
                            a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3], b[2 * j], b[2 * j + 1],
                            acc[c], acc[c + 1], acc[c + 2], acc[c + 3],
                        )  # fmt: skip
            if ahead < steps:
                put_w(smem_w, wregs, wscale, ahead_stage)  # read at step `ahead`, after its barrier
            stage = stage + 1 if stage < stages - 1 else 0

        if split:  # the tile's splits meet: the last to finish adds them up in split order
            n_splits = cuda.gridDim.z
            tile_id = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
            base = tile_id * n_splits * acc_words * threads + tid  # (tiles, splits, acc_words, threads)
            mine = base + cuda.blockIdx.z * acc_words * threads
            for i in range(acc_words):
                part[mine + i * threads] = acc[i]
            # the block's partials published, the other splits' acquired; smem_x[0] carries it
            # (the stages are unused now)
            if not last_to_arrive(tiles_done, tile_id, n_splits, smem_x, 0):
                return  # block-uniform, after the last barrier
            for i in range(acc_words):
                acc[i] = float32(0.0)
            for z in range(n_splits):  # in split order: the same sums whichever block is last
                for i in range(acc_words):  # (unrolled: acc stays in registers)
                    acc[i] += part[base + (z * acc_words + i) * threads]
            if tid == 0:
                tiles_done[tile_id] = 0  # for the next launch
        if grouped:  # each block row's output slot, into the X stages (no copy is in flight)
            cuda.syncthreads()  # every warp is done reading the last step's X tile
            for r in range(tid, block_m, threads):
                smem_x[r] = group_slot(expert, m0 + r, count, rows, route_ids)
            cuda.syncthreads()  # the slots are visible to every warp
        # epilogue: lane holds rows g, g + 8 and columns 2t, 2t + 1 of each 16 x 8 tile
        t_rows, n_cols = out.shape[0], out.shape[1]
        g, t = lane >> 2, lane & 3
        for i in range(m_tiles):
            for half in range(2):
                r = wm * warp_m + 16 * i + 8 * half + g
                if grouped:
                    row = smem_x[r]  # the slot, -1 past the expert's count
                else:
                    row = m0 + r if m0 + r < t_rows else -1
                if row >= 0:
                    for j in range(n_tiles):
                        c = 4 * (i * n_tiles + j) + 2 * half
                        if gate:
                            if j % 2 == 0:  # n-tile j: W1, n-tile j + 1: W3, same outputs
                                col = n0 + 8 * ((wn * warp_n + 8 * j) >> 4) + 2 * t
                                for e in range(2):
                                    if col + e < n_cols:
                                        h1 = acc[c + e]
                                        h3 = acc[c + 4 + e]
                                        if q8:  # W1's and W3's row scales: the output column's
                                            h1 *= s1[w_row0 + col + e]
                                            h3 *= s3[w_row0 + col + e]
                                        out[row, col + e] = fp16_encode(
                                            h1 / (float32(1.0) + math.exp(-h1)) * h3
                                        )
                        else:
                            col = n0 + wn * warp_n + 8 * j + 2 * t
                            for e in range(2):
                                if col + e < n_cols:
                                    v = acc[c + e]
                                    if q8:  # W's row scale: the output column's
                                        v *= s1[w_row0 + col + e]
                                    if residual:
                                        out[row, col + e] += v
                                    else:
                                        out[row, col + e] = v

    if grouped and quantized:

        @_jit_capped(max_registers)
        def matmul_kernel(x, w1, s1, w3, s3, out, count, rows, route_ids):  # noqa: ANN001, ANN202
            """The grouped kernel below for q8 / q4: codes w and scales s of the stacks apart."""
            block_product(x, w1, s1, w3, s3, out, count, rows, route_ids, x, x)

    elif grouped:

        @_jit_capped(max_registers)
        def matmul_kernel(x, w1, w3, out, count, rows, route_ids):  # noqa: ANN001, ANN202
            """Grouped: out (T k, N) slots (=, gate) X fp16 times expert W (n_experts N, K)^T
            stored; see the module docstring. Must match pycalm.cpu.reference.expert_matmul_ref /
            expert_gate_ref."""
            block_product(x, w1, w1, w3, w3, out, count, rows, route_ids, x, x)  # no scales, no split

    elif quantized and split:

        @_jit_capped(max_registers)
        def matmul_kernel(x, w1, s1, w3, s3, out, part, tiles_done):  # noqa: ANN001, ANN202
            """The split kernel below for q8 / q4."""
            block_product(x, w1, s1, w3, s3, out, x, x, x, part, tiles_done)

    elif split:

        @_jit_capped(max_registers)
        def matmul_kernel(x, w1, w3, out, part, tiles_done):  # noqa: ANN001, ANN202
            """The kernel below with K split over gridDim.z blocks a tile: part (>= tiles x
            splits x acc words x threads,) float32 and tiles_done (>= tiles,) int32, zeroed."""
            block_product(x, w1, w1, w3, w3, out, x, x, x, part, tiles_done)

    elif quantized:

        @_jit_capped(max_registers)
        def matmul_kernel(x, w1, s1, w3, s3, out):  # noqa: ANN001, ANN202
            """The kernel below for q8 / q4: codes w and scales s (q8 (N,), q4 (N, groups, 2))."""
            block_product(x, w1, s1, w3, s3, out, x, x, x, x, x)  # no groups, no split: unread

    else:

        @_jit_capped(max_registers)
        def matmul_kernel(x, w1, w3, out):  # noqa: ANN001, ANN202
            """out (T, N) (=, +=, gate) X (T, K) fp16 times W (N, K)^T stored; see the module
            docstring. Must match pycalm.cpu.reference.matmul_ref / matmul_residual_ref /
            matmul_gate_ref."""
            block_product(x, w1, w1, w3, w3, out, x, x, x, x, x)  # no scales, groups or split: unread

    return matmul_kernel


def matmul(
    x: object,
    w: object,
    out: object,
    dtype: str,
    *,
    stream: object,
    mode: str = "plain",
    w3: object = None,
    tile: Tile | None = None,
    scratch: SplitScratch | None = None,
) -> None:
    """out = X W^T ("plain"), out += X W^T ("residual"), or out = silu(X W^T) * (X W3^T)
    ("gate"); X (T, K) float16, W (and W3) the stored (N, K) weights in `dtype` (q8 / q4: a
    formats.Quantized of device arrays), out (T, N) float32 (gate: float16). Device arrays.
    scratch (matmul_split_scratch of the tile): K is split over blocks where the tiles alone
    leave SMs idle (splits_for); without it, never."""
    check_mode(mode, w3)
    t_rows, k_cols = x.shape
    if tile is None:
        tile = tile_for(t_rows)
    if k_cols % UNIT:
        raise PycalmError(f"matmul needs K a multiple of {UNIT}, got {k_cols}")
    out_n = tile.block_n // 2 if mode == "gate" else tile.block_n
    grid = ((t_rows + tile.block_m - 1) // tile.block_m, (out.shape[1] + out_n - 1) // out_n)
    splits = 1 if scratch is None else splits_for(tile, grid[0] * grid[1], k_cols)
    args = (x, *weight_args(w, w3, dtype, k_cols), out)
    if splits == 1:
        make_matmul_kernel(dtype, MODES[mode], tile)[grid, tile.threads, stream](*args)
        return
    blocks = grid[0] * grid[1] * splits
    if (
        scratch.tiles_done.shape[0] < blocks
        or scratch.part.shape[0] < blocks * _acc_words(tile) * tile.threads
    ):
        raise PycalmError(f"matmul split scratch holds fewer than {blocks} blocks of tile {tuple(tile)}")
    kernel = make_matmul_kernel(dtype, MODES[mode], tile, split=True)
    kernel[(*grid, splits), tile.threads, stream](*args, scratch.part, scratch.tiles_done)


def check_mode(mode: str, w3: object) -> None:
    """A product's mode is one of MODES, and W3 comes with the gate alone."""
    if mode not in MODES:
        raise PycalmError(f"unknown matmul mode {mode!r} (one of {', '.join(MODES)})")
    if (mode == "gate") != (w3 is not None):
        raise PycalmError("the gate takes w3, and only the gate")


def tile_for(t_rows: int) -> Tile:
    """The tile of a launch of t_rows rows: ROW_TILE up to 16, MID_TILE up to 64, else TILE
    (under the simulator SIM_TILE above 16)."""
    if t_rows <= ROW_TILE.block_m:
        return ROW_TILE
    if SIM:
        return SIM_TILE
    return MID_TILE if t_rows <= MID_TILE.block_m else TILE


def weight_args(w: object, w3: object, dtype: str, k_cols: int) -> tuple:
    """The kernel's weight arguments for W and W3 (None: W again, unread): (w, w3), or for q8 /
    q4 (w codes, w scales, w3 codes, w3 scales), each pair checked by check_quantized."""
    w3 = w if w3 is None else w3
    if dtype not in QUANTIZED:
        return w, w3
    check_quantized(w, dtype, k_cols)
    check_quantized(w3, dtype, k_cols)
    return w.codes, w.scales, w3.codes, w3.scales


def check_quantized(w: object, dtype: str, k_cols: int) -> None:
    """A q8 / q4 matrix the kernel takes: a Quantized pair, K a multiple of 16 (q8: 16-byte rows
    of codes) or of q4's group size, itself a multiple of BK (a step's columns in one group)."""
    if not isinstance(w, Quantized):
        raise PycalmError(f"a {dtype} matrix is a formats.Quantized(codes, scales), got {type(w).__name__}")
    if k_cols % (16 if dtype == "q8" else BK * w.scales.shape[1]):  # q4 scales: (N, groups, 2)
        raise PycalmError(f"{dtype} matmul: K = {k_cols} does not fit its loads (q8: 16 columns, q4: groups)")
