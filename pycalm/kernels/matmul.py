"""Matrix products for T tokens on the tensor cores, with fp16 / fp8 e5m2 / gf4 weights.

  PLAIN:     out = X W^T                       (qkv, the classifier)
  RESIDUAL:  out += X W^T                      (wo and w2: the residual add fused in)
  GATE:      out = silu(X W1^T) * (X W3^T)     (w1 and w3 in one kernel)

X is (T, K) float16: the activations of T tokens, written in fp16 by the kernel before (the
RMSNorm of T rows, attention's output, or this kernel's GATE mode, whose h is w2's X), because
fp16 is what the tensor cores and ldmatrix take. W is the stored (N, K) weight matrix of
pycalm.formats (float16, uint8 e5m2, or uint32 gf4 groups of 8 along K), the same array the
decode path (pycalm.kernels.matvec) reads: no second copy. out is (T, N) float32 for PLAIN and
RESIDUAL (the residual stream stays float32) and (T, N) float16 for GATE. K is a multiple of 8,
T and N anything. Reference: pycalm.reference.matmul_ref, matmul_residual_ref, matmul_gate_ref.

Tiling. A block computes a BM x BN tile of out (GATE: BM x BN/2, from BN/2 rows of W1 and the
same rows of W3), K in steps of BK = 32. Each step stages a BM x BK tile of X and a BN x BK tile
of W in shared memory as fp16; the warps (WARPS_M x WARPS_N) each own a WM x WN sub-tile
(WM = BM / WARPS_M, WN = BN / WARPS_N) and run WM/16 x WN/8 mma.sync m16n8k16 tiles for each
16 of K, accumulating in float32 registers. Default: BM = BN = 128, 8 warps as 2 x 4, so a warp
computes 64 x 32 (16 mma tiles, 64 accumulators a thread) and reads each A fragment for 4 mma
and each B fragment for 4.

Shared memory: per stage, X tile (BM, BK) and W tile (BN, BK) fp16, row-major in int32 words
(two halves a word), each row padded to PITCH = BK/2 + 4 words (80 bytes). The padding makes
ldmatrix conflict-free: its 8 row addresses (16 bytes each) land at word offsets 20 r mod 32 =
0, 20, 8, 28, 16, 4, 24, 12, eight disjoint groups of four banks. Two stages: while the warps
multiply stage s, the next step's tiles are being fetched into stage s ^ 1, so one barrier a
step separates the reads of a stage from its next writes.

Fetching. X (and fp16 W) go global -> shared by cp.async, 16 bytes (8 halves) a copy, rows past
T or N and columns past K zero-filled. fp8 and gf4 W come through registers: the next step's
8-weight units (8 bytes of e5m2 / one gf4 word) are loaded at the start of a step, and after
this step's mma they are decoded to fp16 and stored (one 16-byte shared store a unit). e5m2 is
the top byte of an fp16, so one prmt builds two halves; a gf4 weight is (q - 4) * (-s/4),
exact in fp16, from common's exact code and scale decoders and one cvt.rn.f16x2.f32 a pair. The
decode of a weight is paid once per block and serves the BM rows of X in the tile.

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

Bytes and FLOPs: 2 T N K FLOPs (GATE: 4 T N K). The weights are read from memory once (later
T-tile blocks of a strip find them in L2), X is re-read from L2 per N tile, out written (read
and written for RESIDUAL).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from numba import config as _numba_config
from numba import cuda, float32, int32

from pycalm.errors import PycalmError
from pycalm.kernels.common import dependent_start, fp16_encode, gf4_code, gf4_scale, prmt
from pycalm.kernels.tensorcore import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    ldg64,
    ldmatrix_x4,
    mma_16816,
    pack_f16x2,
    sts128,
)

PLAIN, RESIDUAL, GATE = 0, 1, 2  # epilogue modes
MODES = {"plain": PLAIN, "residual": RESIDUAL, "gate": GATE}
BK = 32  # K a step (two m16n8k16 k-slices)
PITCH = BK // 2 + 4  # int32 words a staged row: BK halves and 8 halves of padding (80 bytes)
UNIT = 8  # weights a fetch unit: 16 bytes of fp16, 8 of e5m2, one gf4 word


class Tile(NamedTuple):
    """A block's tile and its warps (compile-time shape of matmul_kernel)."""

    block_m: int = 128  # BM: rows of X (tokens) a block
    block_n: int = 128  # BN: rows of W a block (GATE: half of W1, half of W3)
    warps_m: int = 2  # warps along M; each covers block_m / warps_m rows
    warps_n: int = 4  # warps along N; each covers block_n / warps_n rows of W (a multiple of 16)

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


TILE = Tile()
# under the simulator a Python thread runs each GPU thread: tests use small tiles
SIM_TILE = Tile(32, 32, 2, 2)


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
    """One gf4 word -> its 8 weights as 4 f16x2 words, exact: (q_k - 4) * (-s/4)."""
    s = gf4_scale(w)
    return (
        pack_f16x2(gf4_code(w, 0) * s, gf4_code(w, 1) * s),
        pack_f16x2(gf4_code(w, 2) * s, gf4_code(w, 3) * s),
        pack_f16x2(gf4_code(w, 4) * s, gf4_code(w, 5) * s),
        pack_f16x2(gf4_code(w, 6) * s, gf4_code(w, 7) * s),
    )


@functools.cache
def make_matmul_kernel(dtype: str, mode: int, tile: Tile = TILE):  # noqa: ANN201, C901
    """matmul_kernel for a weight dtype, an epilogue mode and a tile (one compile each)."""
    block_m, block_n, warps_m, warps_n = tile
    threads = tile.threads
    warp_m = block_m // warps_m  # WM: rows of out a warp
    warp_n = block_n // warps_n  # WN: rows of the W tile a warp
    m_tiles = warp_m // 16  # mma tiles along M a warp
    n_tiles = warp_n // 8  # mma tiles along N a warp (even: ldmatrix.x4 loads two)
    units_row = BK // UNIT  # fetch units a staged row
    x_units = block_m * units_row // threads  # X copies a thread a step
    w_units = block_n * units_row // threads  # W units a thread a step
    x_stage = block_m * PITCH  # words a stage of the X tile
    w_stage = block_n * PITCH
    out_n = block_n // 2 if mode == GATE else block_n  # out columns a block
    x_words = 2 * x_stage  # the shared and local arrays' sizes, as compile-time constants
    w_words = 2 * w_stage
    wreg_words = 2 * w_units
    acc_words = m_tiles * n_tiles * 4
    a_words = m_tiles * 4
    b_words = n_tiles * 2
    gate = mode == GATE
    residual = mode == RESIDUAL
    fp16 = dtype == "fp16"
    fp8 = dtype == "fp8"
    if (
        warp_m % 16
        or warp_n % 16
        or x_units * threads != block_m * units_row
        or w_units * threads != block_n * units_row
    ):
        raise PycalmError(f"tile {tuple(tile)} does not divide into m16n8k16 warp tiles and fetch units")

    @cuda.jit(device=True, inline=True)
    def w_source_row(r: int, n0: int) -> tuple[int, int]:
        """Tile row r -> (matrix: 0 W1 / 1 W3, row of that matrix)."""
        if gate:
            return (r >> 3) & 1, n0 + 8 * (r >> 4) + (r & 7)
        return 0, n0 + r

    @cuda.jit(device=True, inline=True)
    def fetch(x, w1, w3, smem_x, smem_w, wregs, stage, k0, m0, n0):  # noqa: ANN001, ANN202
        """Start the step at column k0: X (and fp16 W) by cp.async into `stage`, fp8 / gf4 W
        units into wregs (stored by put_w after this step's mma)."""
        tid = cuda.threadIdx.x
        t_rows, n_rows, k_cols = x.shape[0], w1.shape[0], x.shape[1]
        for i in range(x_units):
            u = tid + i * threads
            r, c = u // units_row, u % units_row
            row, col = m0 + r, k0 + c * UNIT
            if row < t_rows and col < k_cols:
                cp_async16(smem_x, stage * x_stage + r * PITCH + c * 4, x, row, col, 16)
            else:  # zero-filled: no byte read from the (in-bounds) address
                cp_async16(smem_x, stage * x_stage + r * PITCH + c * 4, x, 0, 0, 0)
        for i in range(w_units):
            u = tid + i * threads
            r, c = u // units_row, u % units_row
            which, row = w_source_row(r, n0)
            col = k0 + c * UNIT
            ok = row < n_rows and col < k_cols
            src = w3 if which else w1
            if fp16:
                if ok:
                    cp_async16(smem_w, stage * w_stage + r * PITCH + c * 4, src, row, col, 16)
                else:  # zero-filled
                    cp_async16(smem_w, stage * w_stage + r * PITCH + c * 4, src, 0, 0, 0)
            elif fp8:
                lo, hi = int32(0), int32(0)
                if ok:
                    lo, hi = ldg64(src, row, col)
                wregs[2 * i] = lo
                wregs[2 * i + 1] = hi
            else:
                word = int32(0)
                if ok:
                    word = int32(src[row, col // UNIT])
                wregs[i] = word
        cp_async_commit()

    @cuda.jit(device=True, inline=True)
    def put_w(smem_w, wregs, stage):  # noqa: ANN001, ANN202
        """fp8 / gf4: decode the fetched units to fp16 and store them into `stage`."""
        if not fp16:
            tid = cuda.threadIdx.x
            for i in range(w_units):
                u = tid + i * threads
                r, c = u // units_row, u % units_row
                if fp8:
                    h0, h1, h2, h3 = _fp8_words(wregs[2 * i], wregs[2 * i + 1])
                else:
                    h0, h1, h2, h3 = _gf4_words(wregs[i])
                sts128(smem_w, stage * w_stage + r * PITCH + c * 4, h0, h1, h2, h3)

    @cuda.jit
    def matmul_kernel(x, w1, w3, out):  # noqa: ANN001, ANN202
        """out (T, N) (=, +=, gate) X (T, K) fp16 times W (N, K)^T stored; see the module
        docstring. Must match pycalm.reference.matmul_ref / matmul_residual_ref /
        matmul_gate_ref."""
        smem_x = cuda.shared.array(x_words, int32)  # (2 stages, BM, PITCH) f16x2
        smem_w = cuda.shared.array(w_words, int32)  # (2 stages, BN, PITCH) f16x2
        wregs = cuda.local.array(wreg_words, int32)  # fp8 / gf4: the next step's W units
        acc = cuda.local.array(acc_words, float32)  # (m_tiles, n_tiles, 4) C fragments
        a = cuda.local.array(a_words, int32)  # (m_tiles, 4) A fragments of one k-slice
        b = cuda.local.array(b_words, int32)  # (n_tiles, 2) B fragments of one k-slice
        for i in range(acc_words):
            acc[i] = float32(0.0)

        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        wm, wn = warp // warps_n, warp % warps_n
        m0 = cuda.blockIdx.x * block_m
        n0 = cuda.blockIdx.y * out_n
        steps = (x.shape[1] + BK - 1) // BK
        # ldmatrix row addresses (words) of this lane inside a stage
        a_word = (wm * warp_m + (lane & 15)) * PITCH + (lane >> 4) * 4
        b_word = (wn * warp_n + (lane & 7) + 8 * (lane >> 4)) * PITCH + ((lane >> 3) & 1) * 4

        dependent_start()  # in a programmatic graph: wait for the kernel that wrote X (and out)
        fetch(x, w1, w3, smem_x, smem_w, wregs, 0, 0, m0, n0)
        put_w(smem_w, wregs, 0)
        cp_async_wait_all()
        cuda.syncthreads()  # step 0's tiles are in stage 0 for every warp

        for step in range(steps):
            stage = step & 1
            more = step + 1 < steps
            if more:  # the next step's copies and loads fly during this step's mma
                fetch(x, w1, w3, smem_x, smem_w, wregs, stage ^ 1, (step + 1) * BK, m0, n0)
            xs = stage * x_stage
            ws = stage * w_stage
            for ks in range(BK // 16):
                for i in range(m_tiles):
                    a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3] = ldmatrix_x4(
                        smem_x, xs + a_word + i * 16 * PITCH + ks * 8
                    )
                for p in range(n_tiles // 2):
                    b[4 * p], b[4 * p + 1], b[4 * p + 2], b[4 * p + 3] = ldmatrix_x4(
                        smem_w, ws + b_word + p * 16 * PITCH + ks * 8
                    )
                for i in range(m_tiles):
                    for j in range(n_tiles):
                        c = 4 * (i * n_tiles + j)
                        acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma_16816(
                            a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3], b[2 * j], b[2 * j + 1],
                            acc[c], acc[c + 1], acc[c + 2], acc[c + 3],
                        )  # fmt: skip
            if more:
                put_w(smem_w, wregs, stage ^ 1)
                cp_async_wait_all()
            cuda.syncthreads()  # stage ^ 1 is complete, and every warp is done reading stage

        # epilogue: lane holds rows g, g + 8 and columns 2t, 2t + 1 of each 16 x 8 tile
        t_rows, n_cols = out.shape[0], out.shape[1]
        g, t = lane >> 2, lane & 3
        for i in range(m_tiles):
            for half in range(2):
                row = m0 + wm * warp_m + 16 * i + 8 * half + g
                if row < t_rows:
                    for j in range(n_tiles):
                        c = 4 * (i * n_tiles + j) + 2 * half
                        if gate:
                            if j % 2 == 0:  # n-tile j: W1, n-tile j + 1: W3, same outputs
                                col = n0 + 8 * ((wn * warp_n + 8 * j) >> 4) + 2 * t
                                for e in range(2):
                                    h1 = acc[c + e]
                                    h3 = acc[c + 4 + e]
                                    if col + e < n_cols:
                                        out[row, col + e] = fp16_encode(
                                            h1 / (float32(1.0) + math.exp(-h1)) * h3
                                        )
                        else:
                            col = n0 + wn * warp_n + 8 * j + 2 * t
                            for e in range(2):
                                if col + e < n_cols:
                                    if residual:
                                        out[row, col + e] += acc[c + e]
                                    else:
                                        out[row, col + e] = acc[c + e]

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
) -> None:
    """out = X W^T ("plain"), out += X W^T ("residual"), or out = silu(X W^T) * (X W3^T)
    ("gate"); X (T, K) float16, W (and W3) the stored (N, K) weights in `dtype`, out (T, N)
    float32 (gate: float16). Device arrays."""
    if mode not in MODES:
        raise PycalmError(f"unknown matmul mode {mode!r} (one of {', '.join(MODES)})")
    if (mode == "gate") != (w3 is not None):
        raise PycalmError("the gate takes w3, and only the gate")
    tile = tile or (SIM_TILE if _numba_config.ENABLE_CUDASIM else TILE)
    t_rows, k_cols = x.shape
    if k_cols % UNIT:
        raise PycalmError(f"matmul needs K a multiple of {UNIT}, got {k_cols}")
    kernel = make_matmul_kernel(dtype, MODES[mode], tile)
    out_n = tile.block_n // 2 if mode == "gate" else tile.block_n
    grid = ((t_rows + tile.block_m - 1) // tile.block_m, (out.shape[1] + out_n - 1) // out_n)
    kernel[grid, tile.threads, stream](x, w, w if w3 is None else w3, out)


_SIG_W = {"fp16": "float16[:, ::1]", "fp8": "uint8[:, ::1]", "gf4": "uint32[:, ::1]"}
COMPILE_CHECK = [
    (
        make_matmul_kernel(dtype, mode, TILE),
        f"void(float16[:, ::1], {_SIG_W[dtype]}, {_SIG_W[dtype]}, {'float16' if mode == GATE else 'float32'}[:, ::1])",
    )
    for dtype in ("fp16", "fp8", "gf4")
    for mode in (PLAIN, RESIDUAL, GATE)
]
