"""Tensor-core matmul for T tokens (pycalm.kernels.matmul): tile variants, a check of each against
pycalm.cpu.reference, and TFLOP/s on the GPU (llm.c dev/cuda style).

    python scripts/kernels/matmul.py                  # check, variants, the table (GPU)
    python scripts/kernels/matmul.py --check          # only the checks against the reference
    python scripts/kernels/matmul.py --table --quick  # only the table, T = 2048
    python scripts/kernels/matmul.py --wgmma w1,w2,w3,t1,t2 --torch  # the wgmma and TMA versions: check, time
    python scripts/kernels/matmul.py --wgmma w1,d1,d2 --dtypes fp8,gf4,q8,q4  # the decode versions
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/matmul.py --wgmma ws   # the same, simulator
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/matmul.py --check --tiny   # simulator, seconds

Versions (pycalm.kernels.matmul.Tile: block_m x block_n, warps_m x warps_n, stages, blocks an SM
the registers are capped for). All use mma.sync m16n8k16 (fp16 in, fp32 accumulate), ldmatrix.x4
from swizzled 64-byte shared rows, K in steps of 32, X and fp16 W by cp.async, fp8 / gf4 W through
registers decoded to fp16 tiles:
  1. 128 x 128, 2 x 4 warps (64 x 32 each), 3 stages, 2 blocks an SM     (the default, TILE)
  2. same as 1 with 2 stages (one step of K in flight during the mma)
  3. same as 1 with 4 x 2 warps (32 x 64 each: A fragments reused by 8 mma, B by 2)
  4. 128 x 256, 2 x 4 warps (64 x 64 each), 2 stages, 1 block an SM (255 registers)
  5. 256 x 128, 4 x 2 warps (64 x 64 each), 2 stages, 1 block an SM
  6. 64 x 128, 2 x 4 warps (32 x 32 each), 3 stages, 2 blocks an SM (more blocks for small T)
  7. 32 x 32, 2 x 2 warps (16 x 16 each), 3 stages: the simulator's tile (SIM_TILE below)

Timing: each cell is the mean of back-to-back launches between two CUDA events (after one launch
that compiles and warms), at least 20 ms of them. X (T, K) fp16 and the weights are random
finite bit patterns made on the GPU. TFLOP/s counts 2 T N K (the gate: 4 T N K, w1 and w3). The
peak: dense fp16 with fp32 accumulation on the H200 is ~990 TFLOP/s by the datasheet, reached
only by wgmma (Hopper's warpgroup instructions); mma.sync, the instruction these kernels use (the
one numba can reach through inline PTX without warpgroup-wide register allocation), issues at a
fraction of it. With torch present, cuBLAS's fp16 F.linear at the same shape is timed alongside
(--torch) as what the machine gives a library that uses wgmma.

Shapes: Llama-3-8B (qkv 6144x4096, wo 4096x4096, w1/w3 14336x4096, w2 4096x14336, classifier
128256x4096) and TinyLlama-1.1B (qkv 2560x2048, wo 2048x2048, w1/w3 5632x2048, w2 2048x5632,
classifier 32000x2048), each in the mode the layer uses (qkv and classifier plain, wo and w2
residual, w1/w3 gate), at T = 128, 512, 2048, in fp16 / fp8 / gf4. The last lines add a layer's
four matmuls up: the tok/s the matmuls alone allow for a prefill of T tokens (the classifier is
needed for the last token only).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
from numba import config as numba_config
from numba import cuda, float32, int32, uint32

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from pycalm.cpu.reference import matmul_gate_ref, matmul_ref, matmul_residual_ref  # noqa: E402
from pycalm.kernels.matmul import TILE, Tile, matmul, weight_args  # noqa: E402
from pycalm.kernels.tma import (  # noqa: E402
    SWIZZLE_NONE,
    fence_mbarrier_init,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_try_wait,
    tensor_map_2d,
    tensormap_acquire,
    tma_load_2d,
)
from pycalm.kernels.warpgroup import (  # noqa: E402
    fence_proxy_async,
    launch_dynamic,
    shared_byte_address,
)
from pycalm.kernels.wgmma_matmul import (  # noqa: E402
    ROWS_BM,
    TMA_THREADS,
    WGMMA_BK,
    WGMMA_BM,
    WGMMA_THREADS,
    interleaved_gate,
    plain_epilogue,
    ring,
    tma_map,
    tma_shared_bytes,
    weight_units,
    wgmma_kernel,
    wgmma_shared_bytes,
)
from pycalm.kernels.wgmma_matmul import (
    tma_matmul as wgmma_tma_matmul,
)
from pycalm.model import formats  # noqa: E402

SIM_TILE = Tile(32, 32, 2, 2)  # the tile pycalm.kernels.matmul takes under the simulator
VERSIONS = {
    1: TILE,
    2: Tile(stages=2),
    3: Tile(128, 128, 4, 2),
    4: Tile(128, 256, 2, 4, stages=2, blocks_per_sm=1),
    5: Tile(256, 128, 4, 2, stages=2, blocks_per_sm=1),
    6: Tile(64, 128, 2, 4),
    7: SIM_TILE,
}
PEAK_TFLOPS = 990.0  # dense fp16 / bf16 with fp32 accumulation, H200 datasheet (wgmma)
DTYPES = ["fp16", "fp8", "gf4"]
# (name, N, K, mode) per model, and its layer count
MODELS = {
    "Llama-3-8B": (
        32,
        [
            ("qkv", 6144, 4096, "plain"),
            ("wo", 4096, 4096, "residual"),
            ("w1/w3", 14336, 4096, "gate"),
            ("w2", 4096, 14336, "residual"),
            ("cls", 128256, 4096, "plain"),
        ],
    ),
    "TinyLlama-1.1B": (
        22,
        [
            ("qkv", 2560, 2048, "plain"),
            ("wo", 2048, 2048, "residual"),
            ("w1/w3", 5632, 2048, "gate"),
            ("w2", 2048, 5632, "residual"),
            ("cls", 32000, 2048, "plain"),
        ],
    ),
}
TOKENS = [128, 512, 2048]
# finite-value masks on random words: one exponent bit of each fp16 / e5m2 / gf4 scale cleared
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF, "gf4": 0xFFFFFFBF, "q8": 0x7F7F7F7F, "q4": 0xFFFFFFFF}


@cuda.jit
def fill_kernel(words, seed, mask):  # noqa: ANN001, ANN201
    """words[i] = hash(i, seed) & mask (lowbias32)."""
    i = cuda.grid(1)
    while i < words.shape[0]:
        h = uint32(i) * uint32(0x9E3779B9) + uint32(seed)
        h ^= h >> uint32(16)
        h *= uint32(0x7FEB352D)
        h ^= h >> uint32(15)
        h *= uint32(0x846CA68B)
        h ^= h >> uint32(16)
        words[i] = h & uint32(mask)
        i += cuda.gridsize(1)


def random_device(shape: tuple[int, int], dtype: str, seed: int) -> object:
    """A device array of the stored shape of `dtype` with random finite values (q8 / q4: a
    formats.Quantized of random codes and small scales, as scripts/kernels/rows_matmul.py's)."""
    rows, cols = formats.storage_shape(*shape, dtype)
    storage = formats.STORAGE_DTYPE[dtype]
    words = cuda.device_array(rows * cols * storage.itemsize // 4, np.uint32)
    fill_kernel[1024, 256](words, uint32(seed), uint32(MASK[dtype]))
    codes = words.view(storage).reshape(rows, cols)
    if dtype == "q8":
        return formats.Quantized(codes, cuda.to_device(np.full(shape[0], 0.01, np.float32)))
    if dtype == "q4":
        scales = np.zeros((shape[0], shape[1] // 32, 2), np.float16)  # (N, groups of 32, (d, m))
        scales[..., 0], scales[..., 1] = 0.01, -0.08
        return formats.Quantized(codes, cuda.to_device(scales))
    return codes


# ---------------------------------------------------------------------------------------------
# wgmma versions: Hopper's warpgroup instructions (pycalm.kernels.warpgroup)
#
# A block of two warpgroups (256 threads) computes a 128 x BN tile of out (T, N): warpgroup w
# the rows 64 w .. 64 w + 63, with one wgmma m64nBNk16 a 16 of K, its accumulators BN / 2
# float32 a thread. K in steps of 64: each step stages the X tile (128, 64) and the W tile
# (BN, 64) in shared memory, fp16, 128 bytes a row, 8 rows a 1 KiB atom, 16-byte chunk c of
# row r at chunk c ^ (r & 7) (the descriptor's 128-byte swizzle). X (and fp16 W) come by
# cp.async (rows past T or N and columns past K zero-filled) into STAGES stages, a ring of
# dynamic shared memory: at step i the copies of step i + STAGES - 2 are issued into the stage
# that step i - 2 read, whose wgmma every warpgroup has retired (wgmma_wait(1) at the end of
# step i - 1, then the barrier at the top of step i), while step i's wgmma run asynchronously
# and step i - 1's may still run.
#
# fp8, gf4, q8 and q4 W come through registers, as in the shipped kernel: a thread loads its
# units of step i + 2's W tile (fp8 / q8: 16 bytes of 16 weights; gf4 / q4: 4 words of 32
# weights, and q4's group step d and offset m) during step i, and during step i + 1, once step
# i + 1's wgmma are issued, decodes them to fp16 (exact for fp8, gf4 and q8's codes, whose row
# scale multiplies the sums in the epilogue; fp16(d q + m) for q4) into the W tile of step
# i + 2, one of three: the one that step i - 1's wgmma read (retired at the top of step i + 1).
#
#   w1: 128 x 256, 4 stages (192 KiB), one block an SM: a thread's 128 accumulators (156
#       registers, ptxas)
#   w2: 128 x 128, 4 stages (128 KiB), one block an SM (147 registers: two blocks an SM, capped
#       at 128, spill 64 bytes)
#   w3: same as w2 with 6 stages (192 KiB)
#   ws: 128 x 64, 3 stages: the simulator's (--tiny)
#
# Rows versions, for the rows pass (T up to 64: issue 29's 32- and 64-row passes): a 64 x BN
# tile, the two warpgroups sharing the X tile (64, 64) and splitting the W tile's rows, warpgroup
# w taking W rows BN / 2 w .. (one wgmma m64n{BN/2}k16 a 16 of K). So each block reads X once for
# BN rows of W, and a weight is decoded once a pass. A few tiles cover N (qkv at BN = 256: 24), so
# K is split over gridDim.z (the same steps, from step z ceil(steps / splits)); each block writes
# its partial sums to a scratch, (tiles, splits, BN / 4, 256) float32, and the tile's last block
# to finish (an atomic count a tile, reset by it) adds them up in split order, then runs the
# epilogue: the sums do not depend on which block finishes last.
#
#   r1: 64 x 256, 4 stages, one block an SM
#   r2: 64 x 128, 4 stages, two blocks an SM (registers capped at 128)
#   r3: 64 x 128, 6 stages, one block an SM
#   rs: 64 x 64, 3 stages: the simulator's
#
# Bytes: each block reads its X strip and W strip once a tile (L2 serves the neighbours: the
# grid walks T fastest, so the blocks of one W strip run together); a rows version's partial sums
# are 4 T N bytes a split, written and read once (from L2). Modes: plain, residual, gate.

# name: (BN, stages, blocks an SM the registers are capped for, rows: a 64-row tile, K split)
WGMMA_VERSIONS = {
    "w1": (256, 4, 1, False),
    "w2": (128, 4, 1, False),
    "w3": (128, 6, 1, False),
    "ws": (64, 3, 1, False),
    "r1": (256, 4, 1, True),
    "r2": (128, 4, 2, True),
    "r3": (128, 6, 1, True),
    "rs": (64, 3, 1, True),
}
SIM_VERSIONS = ("ws", "rs", "ts", "ds", "dt")  # the simulator's small tiles
WGMMA_DTYPES = ("fp16", "fp8", "gf4", "q8", "q4")
_SCRATCH: dict = {}  # (part, tiles_done) of the rows versions' splits, by size
H200_SMS = 132
MAX_ROW_SPLITS = 16  # splits of K a rows tile at most
MIN_ROW_SPLIT_STEPS = 1 if numba_config.ENABLE_CUDASIM else 4  # steps of K a split takes at least


_SCRATCH: dict = {}  # (part, tiles_done) of the rows versions' splits, by size


def row_splits(version: str, tiles: int, k_cols: int) -> int:
    """Splits of K for a rows version's launch of `tiles` tiles: as many as fill two waves of
    the blocks an SM takes, each of at least MIN_ROW_SPLIT_STEPS steps (and no split empty)."""
    blocks_per_sm = WGMMA_VERSIONS[version][2]
    steps = -(-k_cols // WGMMA_BK)
    splits = max(1, min(2 * H200_SMS * blocks_per_sm // tiles, steps // MIN_ROW_SPLIT_STEPS, MAX_ROW_SPLITS))
    per = -(-steps // splits)
    return -(-steps // per)


def split_scratch(words: int, tiles: int) -> tuple:
    """The rows versions' scratch of at least `words` partial sums and `tiles` counts (zeros)."""
    key = max((k for k in _SCRATCH if k[0] >= words and k[1] >= tiles), default=None)
    if key is None:
        key = (words, tiles)
        _SCRATCH.clear()
        _SCRATCH[key] = (cuda.device_array(words, np.float32), cuda.to_device(np.zeros(tiles, np.int32)))
    return _SCRATCH[key]


def wgmma_matmul(
    x: object,
    w: object,
    out: object,
    version: str,
    mode: str = "plain",
    w3: object = None,
    dtype: str = "fp16",
    stream: object = 0,
    splits: int = 0,
) -> None:
    """out = X W^T, += X W^T or silu(X W^T) * (X W3^T) (mode) by the wgmma version `version`;
    device arrays (q8 / q4: formats.Quantized of device arrays). Rows versions: K in `splits`
    splits (0: row_splits'). TMA versions: tma_matmul (fp16 W); decode versions: decode_matmul
    (fp8 / gf4 / q8 / q4 W)."""
    if version in DECODE_VERSIONS:
        if dtype == "fp16":
            raise ValueError("the decode versions take fp8 / gf4 / q8 / q4 weights, not fp16")
        decode_matmul(x, w, out, version, mode, w3 if mode == "gate" else None, dtype, stream)
        return
    if version in TMA_VERSIONS:
        if dtype != "fp16":
            raise ValueError(f"the TMA versions take fp16 weights, not {dtype}")
        tma_matmul(x, w, out, version, mode, w3 if mode == "gate" else None, stream)
        return
    block_n, stages, blocks_per_sm, rows = WGMMA_VERSIONS[version]
    kernel = wgmma_kernel(block_n, stages, blocks_per_sm, rows, mode, dtype)
    nbytes = wgmma_shared_bytes(block_n, stages, dtype, rows)
    w3 = w if w3 is None else w3
    args = (x, w.codes, w.scales, w3.codes, w3.scales, out) if dtype in ("q8", "q4") else (x, w, w3, out)
    out_n = block_n // 2 if mode == "gate" else block_n
    bm = ROWS_BM if rows else WGMMA_BM
    grid = ((x.shape[0] + bm - 1) // bm, (out.shape[1] + out_n - 1) // out_n)
    if rows:
        tiles = grid[0] * grid[1]
        splits = splits or row_splits(version, tiles, x.shape[1])
        steps = -(-x.shape[1] // WGMMA_BK)
        if -(-steps // splits) * (splits - 1) >= steps:
            raise ValueError(f"{splits} splits of {steps} steps leave one empty")
        args = (*args, *split_scratch(tiles * splits * (block_n // 4) * WGMMA_THREADS, tiles))
        grid = (*grid, splits)
    launch_dynamic(kernel, grid, WGMMA_THREADS, stream, nbytes, args)


# ---------------------------------------------------------------------------------------------
# TMA versions (fp16 W): Hopper's tensor memory accelerator (pycalm.kernels.tma) feeds the ring,
# and the warps specialize
#
# A block of three warpgroups computes a 128 x BN tile of out, as the wgmma versions do. Warpgroup
# 0 is the producer: one of its threads waits for a stage to be free (its "empty" mbarrier: both
# consumers have retired the wgmma that read it), then has TMA fetch step i's X box (128 x 64) and
# W box (BN x 64; the gate: BN / 2 rows of W and the same rows of W3) into it, counting the bytes
# on the stage's "full" mbarrier. Warpgroups 1 and 2 are the consumers, rows 64 (w - 1) .. of
# the tile: each waits for a stage's full barrier, issues its 4 wgmma m64nBNk16, and once the
# step before has retired (wgmma_wait(1)) each of its threads arrives on that step's empty
# barrier (256 arrivals free a stage: a thread's wait covers its own part of the wgmma). No thread copies a byte and no barrier stops the block: the producer runs up to STAGES
# steps ahead. TMA lands each box in the 128-byte-swizzled layout the descriptors read (rows
# past T or N and columns past K as zeros). Phases: step i uses stage i % STAGES in round
# i // STAGES; the consumers wait for the full barrier's phase of that round's parity, the
# producer for the empty barrier's phase before it (parity 1 on a fresh barrier passes at once).
#
#   t1: 128 x 256, 4 stages (192 KiB)    t2: 128 x 128, 6 stages (144 KiB)    ts: 128 x 64, 3 stages (simulator)
#   t3: t1 with setmaxnreg: the producer warpgroup down to 40 registers a thread, the consumers up to 232

# name: (BN, stages, registers a consumer thread after setmaxnreg: 0 none)
TMA_VERSIONS = {"t1": (256, 4, 0), "t2": (128, 6, 0), "t3": (256, 4, 232), "ts": (64, 3, 0)}


def tma_matmul(x: object, w: object, out: object, version: str, mode: str = "plain", w3: object = None,
               stream: object = 0) -> None:  # fmt: skip
    """out = X W^T, += X W^T or silu(X W^T) * (X W3^T) (mode) by the TMA version `version`
    (pycalm.kernels.wgmma_matmul.tma_matmul); fp16 device arrays."""
    block_n, stages, registers = TMA_VERSIONS[version]
    wgmma_tma_matmul(x, w, out, block_n, stages, stream=stream, mode=mode, w3=w3, registers=registers)


# ---------------------------------------------------------------------------------------------
# Decode versions (fp8 / gf4 / q8 / q4 W): the TMA versions' pipeline with a producer warpgroup
# that decodes
#
# As the TMA versions: a block of three warpgroups, a 128 x BN tile, consumers 1 and 2 on wgmma
# over a ring of STAGES stages with "full" and "empty" mbarriers, TMA bringing X's box. The
# producer warpgroup's 128 threads now all work: each step, they decode their units of W (16
# bytes of codes each, pycalm.kernels.wgmma_matmul.weight_units for 128 threads) to fp16 into the
# stage's W tile, make their stores visible to the tensor cores (fence.proxy.async) and arrive on
# the stage's full barrier (129 arrivals: the 128 threads and thread 0's expect_tx of X's bytes).
# So the consumers only issue wgmma, as in t1, where the w versions' warps decode between their
# wgmma and wait at a block-wide barrier each step.
#
#   d1: the units come by 16-byte loads from global memory in the step that decodes them (their
#       latency in each of the producer's steps). Loading them a step ahead made ptxas spill
#       32-256 bytes a thread in fp8, q8 and the q4 gate, at the 168 registers 384 threads leave.
#   d2: TMA brings W's codes as they are stored (BN rows of 64 bytes, or of 8 words; the gate's
#       W rows, then W3's) into a third part of each stage, counted on a "landed" mbarrier;
#       thread 0 keeps STAGES - 2 steps of them in flight, and the producer decodes from shared
#       memory (q4's d and m come by loads a step ahead). 3 stages (64 KiB each with fp8 codes).
#   ds, dt: d1, d2 at 128 x 64: the simulator's
# (setmaxnreg, the producer down to 96 registers and the consumers up to 208, made ptxas spill
# 300-800 bytes in the producer: the consumers need no more than 168)

# name: (BN, stages, where the producer's units come from: "loads" (d1) or "tma" (d2))
DECODE_VERSIONS = {
    "d1": (256, 4, "loads"),
    "d2": (256, 3, "tma"),
    "ds": (64, 3, "loads"),
    "dt": (64, 3, "tma"),
}


@functools.cache
def decode_kernel(block_n: int, stages: int, source: str, mode: str, dtype: str) -> object:  # noqa: C901
    """The kernel of a decode version: out (T, N) float32 (=, +=) X W^T, or fp16 silu(X W^T) *
    (X W3^T) (the W tile's rows: W and W3 by turns of 8), fp8 / gf4 / q8 / q4 W, the producer's
    units from `source` (DECODE_VERSIONS). Arguments: (tmap of X, w, w3, k_cols, out); q8 / q4:
    (tmap of X, w codes, w scales, w3 codes, w3 scales, k_cols, out); source "tma": the maps of
    W's and W3's codes in place of w and w3."""
    raw = source == "tma"
    bm, bk, threads = WGMMA_BM, WGMMA_BK, TMA_THREADS
    residual, gate, q8 = mode == "residual", mode == "gate", dtype == "q8"
    acc_n = block_n // 2
    store_all = plain_epilogue(acc_n, residual, q8)
    gate_all = interleaved_gate(acc_n, q8)
    _, fetch_units, put_units, unit_words = weight_units(block_n, dtype, gate, 128)
    out_n = block_n // 2 if gate else block_n
    x_words, w_words = bm * bk // 2, block_n * bk // 2  # a stage's X box and W tile, int32 words
    row_words = 16 if dtype in ("fp8", "q8") else 8  # (raw) a W row's 64 codes, int32 words
    raw_words = block_n * row_words if raw else 0  # (raw) a stage's codes as TMA lands them
    stage_words = x_words + w_words + raw_words
    # full[s] at bars + 2 s, empty[s] at bars + 2 (stages + s), (raw) landed[s] at bars + 2 (2 stages + s)
    bars = stages * stage_words
    ahead = max(1, stages - 2)  # (raw) the steps whose codes are on their way while one decodes
    unit_cols = 16 if dtype in ("fp8", "q8") else 32  # (raw) weights a unit
    units = block_n * bk // unit_cols // 128  # (raw) a producer thread's units a step
    q4 = dtype == "q4"
    init_ring, consume = ring(block_n, stages, stage_words, x_words, 129)

    @cuda.jit(device=True, inline=True)
    def issue(smem, tx, tw, tw3, pad, m0, n0, i, full, empty, landed):  # noqa: ANN001, ANN202
        """(raw, thread 0) Once stage i % STAGES is free: TMA brings step i's X box (counted on
        its full barrier) and W's codes (on its landed barrier; the gate: W's BN / 2 rows, then
        W3's)."""
        st, phase = i % stages, (i // stages) & 1
        while mbarrier_try_wait(smem, empty + 2 * st, phase ^ 1) == 0:  # the stage is free
            pass
        base = pad + st * stage_words
        mbarrier_expect_tx(smem, full + 2 * st, 4 * x_words)
        tma_load_2d(smem, base, tx, i * bk, m0, full + 2 * st)
        mbarrier_expect_tx(smem, landed + 2 * st, 4 * raw_words)
        col = i * (bk if row_words == 16 else bk // 8)  # the step's first byte, or word of 8 codes
        tma_load_2d(smem, base + x_words + w_words, tw, col, n0, landed + 2 * st)
        if gate:
            tma_load_2d(smem, base + x_words + w_words + raw_words // 2, tw3, col, n0, landed + 2 * st)

    @cuda.jit(device=True, inline=True)
    def unit_row(tid, i):  # noqa: ANN001, ANN202
        """(raw) A producer thread's unit i: its W tile row, its part of the row, and the row of the
        landed codes (the gate's: W's rows first, then W3's)."""
        u = tid + 128 * i
        rr, part = u // (bk // unit_cols), u % (bk // unit_cols)
        if gate:
            return rr, part, ((rr >> 3) & 1) * (block_n // 2) + 8 * (rr >> 4) + (rr & 7)
        return rr, part, rr

    @cuda.jit(device=True, inline=True)
    def q4_scales(s, s3, scale, tid, n0, k_cols, i):  # noqa: ANN001, ANN202
        """(raw, q4) The d, m of this thread's units of step i into scale (zeros past N)."""
        for j in range(units):
            rr, part, lr = unit_row(tid, j)
            which = lr >= block_n // 2 if gate else False
            row = n0 + (lr - block_n // 2 if which else lr)
            sc = s3 if which else s
            scale[2 * j] = float32(0.0)
            scale[2 * j + 1] = float32(0.0)
            if row < sc.shape[0]:
                group = (i * bk + part * unit_cols) // (k_cols // sc.shape[1])
                scale[2 * j] = float32(sc[row, min(group, sc.shape[1] - 1), 0])
                scale[2 * j + 1] = float32(sc[row, min(group, sc.shape[1] - 1), 1])

    @cuda.jit(device=True, inline=True)
    def raw_producer(smem, tx, tw, s, tw3, s3, k_cols, tid, pad, m0, n0, steps, full, empty, landed):  # noqa: ANN001, ANN202
        """(d2) The producer warpgroup: thread 0 keeps `ahead` steps of TMA in flight; every
        thread decodes its units of each landed step into the stage's W tile."""
        if tid == 0:
            tensormap_acquire(tx)
            tensormap_acquire(tw)
            tensormap_acquire(tw3)
            for i in range(min(ahead, steps)):
                issue(smem, tx, tw, tw3, pad, m0, n0, i, full, empty, landed)
        regs = cuda.local.array(unit_words, int32)  # (units) a step's codes, from shared memory
        scale = cuda.local.array(unit_words, float32)  # (q4) this step's d, m
        scale2 = cuda.local.array(unit_words, float32)  # (q4) the next step's, in flight
        if q4:
            q4_scales(s, s3, scale, tid, n0, k_cols, 0)
        for i in range(steps):
            st, phase = i % stages, (i // stages) & 1
            if tid == 0 and i + ahead < steps:
                issue(smem, tx, tw, tw3, pad, m0, n0, i + ahead, full, empty, landed)
            if q4 and i + 1 < steps:
                q4_scales(s, s3, scale2, tid, n0, k_cols, i + 1)
            while mbarrier_try_wait(smem, landed + 2 * st, phase) == 0:  # step i's codes have landed
                pass
            base = pad + st * stage_words
            for j in range(units):
                _, part, lr = unit_row(tid, j)
                at = base + x_words + w_words + lr * row_words + 4 * part
                for e in range(4):
                    regs[4 * j + e] = smem[at + e]
            put_units(smem, regs, scale, tid, base + x_words)
            fence_proxy_async()  # this thread's stores of the W tile: visible to wgmma's async proxy
            mbarrier_arrive(smem, full + 2 * st)
            if q4:
                for j in range(unit_words):  # (registers: a loop the compiler unrolls)
                    scale[j] = scale2[j]

    @cuda.jit(device=True, inline=True)
    def register_producer(smem, tx, w, s, w3, s3, k_cols, tid, pad, m0, n0, steps, full, empty):  # noqa: ANN001, ANN202
        """(d1) The producer warpgroup: every thread loads its units of W from global memory and
        decodes them into the stage's W tile; thread 0 has TMA bring X."""
        if tid == 0:
            tensormap_acquire(tx)
        regs = cuda.local.array(unit_words, int32)  # (units) step i's W units
        scale = cuda.local.array(unit_words, float32)  # (q4) their d, m
        for i in range(steps):
            st, phase = i % stages, (i // stages) & 1
            fetch_units(w, s, w3, s3, regs, scale, tid, n0, k_cols, i)  # (issued before the wait)
            while mbarrier_try_wait(smem, empty + 2 * st, phase ^ 1) == 0:  # the stage is free
                pass
            base = pad + st * stage_words
            if tid == 0:
                mbarrier_expect_tx(smem, full + 2 * st, 4 * x_words)
                tma_load_2d(smem, base, tx, i * bk, m0, full + 2 * st)
            put_units(smem, regs, scale, tid, base + x_words)
            fence_proxy_async()  # this thread's stores of the W tile: visible to wgmma's async proxy
            mbarrier_arrive(smem, full + 2 * st)

    @cuda.jit(device=True, inline=True)
    def block_tile(tx, w, s, w3, s3, k_cols, out):  # noqa: ANN001, ANN202
        smem = cuda.shared.array(0, int32)  # STAGES stages of (X box, W tile), then the barriers
        tid = cuda.threadIdx.x
        group = tid >> 7  # 0: the producer; 1, 2: the consumers of tile rows 64 (group - 1) ..
        pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2  # words to a 1 KiB boundary
        m0 = cuda.blockIdx.x * bm
        n0 = cuda.blockIdx.y * out_n
        steps = (k_cols + bk - 1) // bk
        full, empty, landed = pad + bars, pad + bars + 2 * stages, pad + bars + 4 * stages
        if tid == 0:
            init_ring(smem, full, empty)  # full: the producer's threads, and thread 0's bytes
            for st in range(stages if raw else 0):
                mbarrier_init(smem, landed + 2 * st, 1)  # thread 0's bytes of W's codes
            fence_mbarrier_init()
        cuda.syncthreads()  # the barriers are set up before anyone waits on them
        if group == 0:  # (raw: a constant, so numba keeps one of the two calls)
            if raw:
                raw_producer(smem, tx, w, s, w3, s3, k_cols, tid, pad, m0, n0, steps, full, empty, landed)
            else:
                register_producer(smem, tx, w, s, w3, s3, k_cols, tid, pad, m0, n0, steps, full, empty)
            return
        acc = cuda.local.array(acc_n, float32)  # (BN / 8, 4) this thread's D elements
        consume(smem, acc, pad, group, steps, full, empty)  # every sum in acc
        q, lane = (tid >> 5) & 3, tid & 31
        g, t = lane >> 2, lane & 3
        row0 = m0 + 64 * (group - 1) + 16 * q + g
        if gate:  # acc[8 p + u] (u < 4): W's sums of outputs 8 p + ..; acc[8 p + u + 4]: W3's
            gate_all(acc, out, row0, n0 + 2 * t, s, s3)
        else:
            store_all(acc, out, row0, n0 + 2 * t, s)

    bounds = {} if numba_config.ENABLE_CUDASIM else {"launch_bounds": (threads, 1)}
    if dtype in ("q8", "q4"):

        @cuda.jit(**bounds)
        def decode_matmul_kernel(tx, w, s, w3, s3, k_cols, out):  # noqa: ANN001, ANN202
            block_tile(tx, w, s, w3, s3, k_cols, out)

    else:

        @cuda.jit(**bounds)
        def decode_matmul_kernel(tx, w, w3, k_cols, out):  # noqa: ANN001, ANN202
            block_tile(tx, w, w, w3, w3, k_cols, out)  # no scales: unread

    return decode_matmul_kernel


def decode_matmul(x: object, w: object, out: object, version: str, mode: str = "plain", w3: object = None,
                  dtype: str = "q4", stream: object = 0) -> None:  # fmt: skip
    """out = X W^T, += X W^T or silu(X W^T) * (X W3^T) (mode) by the decode version `version`; X
    fp16, W in `dtype` (q8 / q4: formats.Quantized of device arrays), K as the w versions take it."""
    block_n, stages, source = DECODE_VERSIONS[version]
    kernel = decode_kernel(block_n, stages, source, mode, dtype)
    k_cols = x.shape[1]
    weights = weight_args(w, w3, dtype, k_cols)  # (w, w3) or (w codes, w scales, w3 codes, w3 scales)
    raw_bytes = 0
    if source == "tma":  # the maps of W's and W3's codes in place of the arrays
        rows = block_n // 2 if mode == "gate" else block_n
        codes = [code_map(weights[i], rows) for i in ((0, 2) if len(weights) == 4 else (0, 1))]
        weights = (codes[0], weights[1], codes[1], weights[3]) if len(weights) == 4 else tuple(codes)
        raw_bytes = (
            stages * block_n * (WGMMA_BK if dtype in ("fp8", "q8") else WGMMA_BK // 2)
        )  # 1 or 1/2 byte a weight
    args = (tma_map(x, WGMMA_BM), *weights, int32(k_cols), out)
    nbytes = tma_shared_bytes(block_n, stages) + raw_bytes + 8 * stages  # (raw: a third mbarrier a stage)
    out_n = block_n // 2 if mode == "gate" else block_n
    grid = ((x.shape[0] + WGMMA_BM - 1) // WGMMA_BM, (out.shape[1] + out_n - 1) // out_n)
    launch_dynamic(kernel, grid, TMA_THREADS, stream, nbytes, args)


def code_map(codes: object, box_rows: int) -> object:
    """A map of W's codes as stored, in (box_rows, 64 weights) boxes, unswizzled: 64 bytes a row
    (fp8, q8) or 8 words (gf4, q4); built once an array (the simulator: each call)."""
    cols = 64 if np.dtype(codes.dtype).itemsize == 1 else 8
    if numba_config.ENABLE_CUDASIM:
        return tensor_map_2d(codes, box_rows, cols, SWIZZLE_NONE)
    key = (codes.device_ctypes_pointer.value, codes.shape, box_rows)
    if key not in _CODE_MAPS:
        _CODE_MAPS[key] = tensor_map_2d(codes, box_rows, cols, SWIZZLE_NONE)
    return _CODE_MAPS[key]


_CODE_MAPS: dict = {}


def is_rows(version: str) -> bool:
    """A rows version (64-row tiles, K split)."""
    return version in WGMMA_VERSIONS and WGMMA_VERSIONS[version][3]


def block_n_of(version: str) -> int:
    """A wgmma, TMA or decode version's BN."""
    return {**WGMMA_VERSIONS, **TMA_VERSIONS, **DECODE_VERSIONS}[version][0]


def check_wgmma(version: str, shape: tuple[int, int, int], dtypes: tuple[str, ...] = WGMMA_DTYPES) -> bool:
    """A wgmma version in each mode and weight dtype against the reference, as check(); a rows
    version with K in several splits."""
    t_rows, n, k = shape
    rng = np.random.default_rng(11)
    ok = True
    if version in TMA_VERSIONS:
        dtypes = ("fp16",)
    elif version in DECODE_VERSIONS:
        dtypes = tuple(d for d in dtypes if d != "fp16")
    for dtype in dtypes:
        for mode, x, w, w3, out, want, scale in reference_cases(rng, t_rows, n, k, dtype):
            d_w, d_w3 = (on_device(m) for m in (w, w3))
            # rows versions: K whole (on the GPU), in two splits, and in row_splits' (0)
            row_cases = (2, 0) if numba_config.ENABLE_CUDASIM else (1, 2, 0)
            for splits in row_cases if is_rows(version) else (0,):
                d_out = cuda.to_device(out)
                wgmma_matmul(cuda.to_device(x), d_w, d_out, version, mode, d_w3, dtype, splits=splits)
                label = f"{version} {dtype} {mode:8s} T={t_rows} N={n} K={k}" + (
                    f" splits={splits}" if splits else ""
                )
                ok &= judge(d_out, want, scale, mode, label)
    return ok


def reference_cases(rng: np.random.Generator, t_rows: int, n: int, k: int, dtype: str) -> Iterator[tuple]:
    """Random X (t_rows, k), W and W3 (n, k) of a dtype and, for each mode, (mode, x, w, w3, out,
    want, scale): out the launch's starting output (residual: a random r0), want the reference
    on the weights as the tensor cores take them (q4: d q + m rounded to fp16), scale the |X|
    |W|^T sums that judge() bounds the error by."""
    x = formats.fp16_encode(rng.standard_normal((t_rows, k)) * 0.5)
    w = formats.encode(rng.standard_normal((n, k)).astype(np.float32), dtype)
    w3 = formats.encode(rng.standard_normal((n, k)).astype(np.float32), dtype)
    scale = np.abs(x.astype(np.float64)) @ np.abs(formats.decode(w, dtype).astype(np.float64)).T
    rw, rw3, rdtype = (
        (w, w3, dtype) if dtype != "q4" else (*(formats.fp16_encode(formats.decode(m, "q4")) for m in (w, w3)), "fp16")
    )  # fmt: skip
    for mode in ("plain", "residual", "gate"):
        r0 = rng.standard_normal((t_rows, n)).astype(np.float32)
        if mode == "plain":
            want, out = matmul_ref(x, rw, rdtype), np.zeros((t_rows, n), np.float32)
        elif mode == "residual":
            want, out = matmul_residual_ref(x, rw, rdtype, r0), r0
        else:
            want, out = matmul_gate_ref(x, rw, rw3, rdtype), np.zeros((t_rows, n), np.float16)
        yield mode, x, w, w3, out, want, scale


def on_device(w: object) -> object:
    """A stored matrix (a formats.Quantized of two arrays for q8 / q4) on the device."""
    if isinstance(w, formats.Quantized):
        return formats.Quantized(cuda.to_device(w.codes), cuda.to_device(w.scales))
    return cuda.to_device(w)


# ---------------------------------------------------------------------------------------------
# check


def check(
    version: int, tile: Tile, shape: tuple[int, int, int], modes: list[str], dtypes: list[str] = DTYPES
) -> bool:
    """Each dtype x mode at `shape` (T, N, K) against the reference (judge)."""
    t_rows, n, k = shape
    rng = np.random.default_rng(version)
    ok = True
    stream = cuda.default_stream()
    for dtype in dtypes:
        x = formats.fp16_encode(rng.standard_normal((t_rows, k)) * 0.5)
        w = formats.encode(rng.standard_normal((n, k)).astype(np.float32), dtype)
        w3 = formats.encode(rng.standard_normal((n, k)).astype(np.float32), dtype)
        wf = formats.decode(w, dtype).astype(np.float64)
        scale = np.abs(x.astype(np.float64)) @ np.abs(wf).T
        for mode in modes:
            if mode == "plain":
                want, out = matmul_ref(x, w, dtype), np.zeros((t_rows, n), np.float32)
            elif mode == "residual":
                r0 = rng.standard_normal((t_rows, n)).astype(np.float32)
                want, out = matmul_residual_ref(x, w, dtype, r0), r0.copy()
            else:
                want, out = matmul_gate_ref(x, w, w3, dtype), np.zeros((t_rows, n), np.float16)
            d_out = cuda.to_device(out)
            d_w3 = cuda.to_device(w3) if mode == "gate" else None
            matmul(
                cuda.to_device(x),
                cuda.to_device(w),
                d_out,
                dtype,
                stream=stream,
                mode=mode,
                w3=d_w3,
                tile=tile,
            )
            ok &= judge(d_out, want, scale, mode, f"v{version} {dtype} {mode:8s} T={t_rows} N={n} K={k}")
    return ok


def judge(d_out: object, want: np.ndarray, scale: np.ndarray, mode: str, label: str) -> bool:
    """A launch's out against the reference: the worst error relative to the |X| |W|^T sums (the
    tests' tolerance is 1e-5), printed after `label`; False where it is above or not finite."""
    got = d_out.copy_to_host().astype(np.float64)
    err = np.abs(got - want.astype(np.float64))
    # the gate's fp16 output: one fp16 rounding relative to the value besides the sums' error
    bound = 1e-5 * scale + (2.0**-10 * np.abs(want) + 1e-5 * scale * 4 if mode == "gate" else 0)
    worst = float(np.max(err / bound))
    good = bool(np.all(np.isfinite(got)) and worst <= 1.0)
    print(f"  {label}: err/bound {worst:.3f} {'ok' if good else 'FAIL'}")
    return good


# ---------------------------------------------------------------------------------------------
# timing


def time_launches(launch: object, min_seconds: float = 0.02) -> float:
    """Mean seconds of one launch: one warm-up (compile), one timed, then enough back-to-back
    launches between two events for min_seconds."""
    launch()
    cuda.synchronize()
    a, b = cuda.event(), cuda.event()
    a.record()
    launch()
    b.record()
    b.synchronize()
    one = cuda.event_elapsed_time(a, b) / 1e3
    reps = int(min(200, max(3, min_seconds / max(one, 1e-6))))
    a.record()
    for _ in range(reps):
        launch()
    b.record()
    b.synchronize()
    return cuda.event_elapsed_time(a, b) / 1e3 / reps


class Bench:
    """Device buffers for one weight shape (X rotated per T), reused across variants."""

    def __init__(self, n: int, k: int, dtype: str, mode: str, t_max: int) -> None:
        self.dtype, self.mode = dtype, mode
        self.w = random_device((n, k), dtype, 1)
        self.w3 = random_device((n, k), dtype, 2) if mode == "gate" else None
        self.x = random_device((t_max, k), "fp16", 3)
        # not initialised: the residual mode adds to whatever is there, which times the same
        self.out = cuda.device_array((t_max, n), np.float16 if mode == "gate" else np.float32)

    def seconds(self, t_rows: int, tile: Tile) -> float:
        x, out = self.x[:t_rows], self.out[:t_rows]
        return time_launches(
            lambda: matmul(x, self.w, out, self.dtype, stream=0, mode=self.mode, w3=self.w3, tile=tile)
        )


def torch_seconds(t_rows: int, n: int, k: int, mode: str) -> float | None:
    """cuBLAS fp16 F.linear (X W^T; the gate: both products) at the same shape, or None."""
    try:
        import torch
        import torch.nn.functional as F  # noqa: N812
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.randn(t_rows, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    calls = 2 if mode == "gate" else 1
    for _ in range(2):
        F.linear(x, w)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    a.record()
    for _ in range(reps * calls):
        F.linear(x, w)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def flops(t_rows: int, n: int, k: int, mode: str) -> float:
    return (4.0 if mode == "gate" else 2.0) * t_rows * n * k


def variants(versions: dict[int, Tile], deadline: float) -> None:
    """Every version on the Llama-3-8B wo and w1/w3 shapes at T = 2048 (and 128), fp16 (each
    version costs a compile a mode and dtype)."""
    print("\nvariants (TFLOP/s)")
    print("| version | tile | dtype | wo T=2048 | w1/w3 T=2048 | wo T=128 |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    benches = {}
    for dtype in ("fp16",):
        benches[dtype, "wo"] = Bench(4096, 4096, dtype, "residual", 2048)
        benches[dtype, "w1"] = Bench(14336, 4096, dtype, "gate", 2048)
    for version, tile in versions.items():
        if version == 7:
            continue
        for dtype in ("fp16",):
            if time.time() > deadline:
                print("(out of time)")
                return
            cells = []
            for key, n, t_rows, mode in (
                ("wo", 4096, 2048, "residual"),
                ("w1", 14336, 2048, "gate"),
                ("wo", 4096, 128, "residual"),
            ):
                s = benches[dtype, key].seconds(t_rows, tile)
                cells.append(f"{flops(t_rows, n, 4096, mode) / s / 1e12:.0f}")
            shape = f"{tile.block_m}x{tile.block_n} {tile.warps_m}x{tile.warps_n} s{tile.stages}"
            print(f"| {version} | {shape} | {dtype} | " + " | ".join(cells) + " |", flush=True)


def wgmma_variants(
    versions: list[str], use_torch: bool, deadline: float, dtypes: tuple[str, ...] = WGMMA_DTYPES
) -> None:
    """Each wgmma version beside the shipped tile (and cuBLAS fp16 with --torch) on the Llama-3-8B
    matrices in the modes the layer uses, T = 512 and 2048, in every format; and each one's
    tok/s of a layer's four products alone at T = 2048."""
    cells_of = [("qkv", 6144, 4096, "plain"), ("wo", 4096, 4096, "residual"), ("w1/w3", 14336, 4096, "gate"),
                ("w2", 4096, 14336, "residual")]  # fmt: skip
    heads = [f"{name} T={t}" for name, *_ in cells_of for t in (512, 2048)]
    for dtype in dtypes:
        print(f"\nwgmma versions (TFLOP/s), {dtype} W, Llama-3-8B matrices")
        print("| version | " + " | ".join(heads) + " | tok/s, 32 layers' products at T=2048 |")
        print("| --- | " + " | ".join("---:" for _ in heads) + " | ---: |")
        names = ["shipped", *versions] + (["cuBLAS fp16"] if use_torch and dtype == "fp16" else [])
        rows: dict[str, list[str]] = {v: [] for v in names}
        layer = dict.fromkeys(names, 0.0)  # seconds of a layer's four products at T = 2048
        for _name, n, k, mode in cells_of:
            if time.time() > deadline:
                print("(out of time)")
                return
            bench = Bench(n, k, dtype, mode, 2048)
            for t_rows in (512, 2048):
                x, out = bench.x[:t_rows], bench.out[:t_rows]
                f = flops(t_rows, n, k, mode)
                timed = {"shipped": bench.seconds(t_rows, TILE)}
                for v in versions:
                    if (v in TMA_VERSIONS and dtype != "fp16") or (v in DECODE_VERSIONS and dtype == "fp16"):
                        continue  # (TMA versions: fp16 W only; decode versions: the others)
                    timed[v] = time_launches(
                        lambda v=v, x=x, b=bench, out=out: wgmma_matmul(x, b.w, out, v, b.mode, b.w3, b.dtype)
                    )
                if "cuBLAS fp16" in names:
                    timed["cuBLAS fp16"] = torch_seconds(t_rows, n, k, mode)
                for v, sec in timed.items():
                    rows[v].append("-" if sec is None else f"{f / sec / 1e12:.0f}")
                    if t_rows == 2048 and sec is not None:
                        layer[v] += sec
            del bench
        for v, cells in rows.items():
            versions_of = {**WGMMA_VERSIONS, **TMA_VERSIONS, **DECODE_VERSIONS}
            shape = (
                f" ({WGMMA_BM}x{versions_of[v][0]}, {versions_of[v][1]} stages)" if v in versions_of else ""
            )
            if not cells:
                continue  # (a TMA version in a quantized format, a decode version in fp16)
            print(f"| {v}{shape} | " + " | ".join(cells) + f" | {2048 / (32 * layer[v]):,.0f} |", flush=True)


def table(tokens: list[int], use_torch: bool, deadline: float, tile: Tile) -> None:
    print(
        f"\nTFLOP/s (% of {PEAK_TFLOPS:.0f}) with tile {tuple(tile)}; cuBLAS fp16 alongside where torch is present"
    )
    for model, (n_layers, shapes) in MODELS.items():
        print(f"\n{model}")
        print("| matrix | N x K | mode | dtype | " + " | ".join(f"T={t}" for t in tokens) + " |")
        print("| --- | --- | --- | --- | " + " | ".join("---:" for _ in tokens) + " |")
        layer = {(d, t): 0.0 for d in DTYPES for t in tokens}  # seconds of a layer's 4 matmuls
        for name, n, k, mode in shapes:
            for dtype in DTYPES:
                if time.time() > deadline:
                    print("(out of time)")
                    return
                bench = Bench(n, k, dtype, mode, max(tokens))
                cells = []
                for t_rows in tokens:
                    s = bench.seconds(t_rows, tile)
                    if name != "cls":
                        layer[dtype, t_rows] += s
                    tf = flops(t_rows, n, k, mode) / s / 1e12
                    cells.append(f"{tf:.0f} ({100 * tf / PEAK_TFLOPS:.0f}%)")
                print(f"| {name} | {n}x{k} | {mode} | {dtype} | " + " | ".join(cells) + " |", flush=True)
                del bench
            if use_torch:
                cells = []
                for t_rows in tokens:
                    s = torch_seconds(t_rows, n, k, mode)
                    cells.append("-" if s is None else f"{flops(t_rows, n, k, mode) / s / 1e12:.0f}")
                print(f"| {name} | {n}x{k} | {mode} | cuBLAS fp16 | " + " | ".join(cells) + " |", flush=True)
        for dtype in DTYPES:
            rates = [f"{t / (n_layers * layer[dtype, t]):,.0f}" for t in tokens]
            print(f"  {dtype}: tok/s of the {n_layers} layers' matmuls alone, T = {tokens}: {rates}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only the checks against the reference")
    p.add_argument("--table", action="store_true", help="only the timing table")
    p.add_argument("--variants", action="store_true", help="only the variant comparison")
    p.add_argument(
        "--tiny", action="store_true", help="check at a tiny shape with the small tiles (simulator)"
    )
    p.add_argument("--quick", action="store_true", help="the table at T = 2048 only")
    p.add_argument("--torch", action="store_true", help="time cuBLAS fp16 alongside (needs torch)")
    p.add_argument("--budget", type=float, default=1e9, help="seconds; later parts are skipped past it")
    p.add_argument(
        "--versions", default=",".join(map(str, VERSIONS)), help="versions to check and compare, e.g. 1,2"
    )
    p.add_argument("--wgmma", default="", help="wgmma versions to check and time instead, e.g. w1,w2,w3")
    p.add_argument("--dtypes", default=",".join(WGMMA_DTYPES), help="with --wgmma: the weight formats")
    args = p.parse_args()
    deadline = time.time() + args.budget
    if args.wgmma:
        wanted = args.wgmma.split(",")
        known = {**WGMMA_VERSIONS, **TMA_VERSIONS, **DECODE_VERSIONS}
        if unknown := [v for v in wanted if v not in known]:
            sys.exit(f"unknown wgmma version {unknown[0]} (one of {', '.join(known)})")
        print("check against pycalm.cpu.reference")
        if args.tiny or numba_config.ENABLE_CUDASIM:
            ok = all(check_wgmma(v, (70, 2 * block_n_of(v) - 8, 224)) for v in wanted)  # K: 3.5 steps
        else:
            # (K: q4's groups of 32, a step's half; the rows versions at a rows pass's T)
            dtypes = tuple(args.dtypes.split(","))
            ok = all([check_wgmma(v, (61 if is_rows(v) else 300, 520, 1056), dtypes) for v in wanted])
        if not ok:
            sys.exit("check failed")
        prompt_versions = [v for v in wanted if not is_rows(v)]  # (rows_matmul.py times the rows ones)
        if prompt_versions and not (numba_config.ENABLE_CUDASIM or args.check):
            wgmma_variants(prompt_versions, args.torch, deadline, tuple(args.dtypes.split(",")))
        return
    versions = {v: VERSIONS[v] for v in map(int, args.versions.split(","))}
    everything = not (args.check or args.table or args.variants)
    if args.check or everything:
        print("check against pycalm.cpu.reference")
        ok = True
        if args.tiny or numba_config.ENABLE_CUDASIM:
            ok &= check(7, SIM_TILE, (19, 40, 40), ["plain", "residual", "gate"])
        else:
            for version, tile in versions.items():
                if version == 7:
                    continue  # the simulator's tile: its check is --tiny
                if version == 1:
                    ok &= check(version, tile, (300, 520, 1032), ["plain", "residual", "gate"])
                else:  # what variants() times
                    ok &= check(version, tile, (300, 520, 1032), ["residual", "gate"], ["fp16"])
        if not ok:
            sys.exit("check failed")
    if numba_config.ENABLE_CUDASIM:
        return
    if args.table or everything:
        table([2048] if args.quick else TOKENS, args.torch, deadline, TILE)
    if args.variants or everything:
        variants(versions, deadline)


if __name__ == "__main__":
    main()
