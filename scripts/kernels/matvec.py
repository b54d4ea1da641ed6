"""The matvec kernel family: the shipped kernel and its variants, each checked against the NumPy
reference, then timed on the GPU (llm.c's dev/cuda pattern).

Versions (a Version below names one; every one is checked before it is timed):
  1 shipped   pycalm.kernels.matvec through the package's launchers: 2 rows a warp, 2 16-byte
              loads a row a lane a step, early loads, cvt decoders, split fp8 w2 rows, the
              launch shape of pycalm.kernels.launch.row_group_launch
  2 shape     version_kernel below (the shipped kernel's dense code, copied here with its
              choices as arguments) at other compile-time sizes or launch shapes: rows a warp R,
              loads a step U, 8-byte loads (fp16 "8B", gf4 "8B"), warps a block, blocks an SM
              at most, row groups split over S warps; "copy" at the shipped sizes and launch
              shape (its time is shipped's)
  3 late      same as 1 but a group's first loads issued after x is staged (early=False)
  4 shift     same as 1 but fp16 / fp8 decoded by shifts and masks (value * 2**-112, the row's
              sum times 2**112), no cvt
  5 prefetch  same as 1 but the next step's loads issued before this step's arithmetic
  6 direct    same as 1 but x read from global memory (through L1), no staging, one row group a
              warp (launches without a fused norm, not GATE)
  7 capped    same as 1 compiled with a register cap (max_registers)
q8 and q4 (codes and scales, pycalm.kernels.qdecode) take version 1 only: version_kernel is the
dense (fp16, fp8, gf4) code, without the integer staging of x.

    python scripts/kernels/matvec.py                # check every version, then the timing table
    python scripts/kernels/matvec.py --check        # the checks only (one big shape a dtype)
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/matvec.py --check --tiny   # simulator, tiny shapes
    python scripts/kernels/matvec.py --quick        # the table for the shipped version only
    python scripts/kernels/matvec.py --sweep fp8,gf4 [--tiny-shapes]   # R x U x warps, staged / direct
    python scripts/kernels/matvec.py --split fp8 [--launches wo,w2] [--n-versions N]

Timing: each measurement is a CUDA graph of back-to-back launches of one kernel, rotating over
enough weight copies (at least 4x the 50 MB L2) that no launch finds its weights in L2, replayed
REPLAYS times between two events; the median replay divided by the launches is the time of one
kernel as the token step's graph runs it. GB/s counts the bytes the kernel must move (weights, x,
norm_w, the output read and / or written); the ceiling is a uint64 grid-stride copy timed the
same way (bytes read + written). Weights are random finite bit patterns made on the GPU. Shapes:
the Llama-3-8B layer matrices (wq/wo 4096x4096, w1/w3 14336x4096, w2 4096x14336, qkv 6144x4096)
and TinyLlama-1.1B's (2048x2048, 5632x2048, 2560x2048 qkv, 2048x5632). The H200 figures are in
docs/BENCHMARKS.md at b282afd (docs/BENCHMARKS.md keeps the sweep's summary).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from numba import config as numba_config
from numba import cuda, float32, int32, uint32, uint64
from numba.cuda.cudadrv.driver import CudaAPIError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (pycalm)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ (gpubench)

from pycalm.cpu.reference import matvec_ref, rmsnorm_ref, silu_ref  # noqa: E402
from pycalm.kernels.attention import KVCache  # noqa: E402
from pycalm.kernels.common import (  # noqa: E402
    FP_RAW_SCALE,
    GF4_RAW_SCALE,
    MASK_FP16,
    WARP,
    as_f32,
    as_i32,
    block_reduce_sum,
    fp8_byte_raw,
    fp8x4_cvt,
    gf4_dot8_raw,
    grid_dependency_wait,
    h2f2,
    launch_dependents,
    ldg128,
    sar32,
    shl32,
    warp_reduce_sum,
)
from pycalm.kernels.matvec import ffn_gate, matvec, matvec_residual  # noqa: E402
from pycalm.kernels.qkv import qkv_rope  # noqa: E402
from pycalm.model import formats  # noqa: E402

SIM = numba_config.ENABLE_CUDASIM
LLAMA = [(14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096)]
TINY = [(2048, 2048), (5632, 2048), (2560, 2048), (2048, 5632)]
DTYPES = ["fp16", "fp8", "gf4", "q8", "q4"]
ROTATE_BYTES = 200e6  # weight copies a graph cycles through: 4x the L2
REPLAYS = 7
# finite-value masks on random uint32 words: clear one exponent bit of each fp16 / e5m2 / scale
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF, "gf4": 0xFFFFFFBF, "q8": 0xFFFFFFFF, "q4": 0xFFFFFFFF}
# q8 / q4 scales: mask and bits of a float32 near 2**-7 / two fp16 d, m near 2**-7
SCALE_BITS = {"q8": (0x807FFFFF, 0x3C000000), "q4": (0x83FF83FF, 0x20002000)}

# the shipped kernel's sizes and modes (pycalm.kernels.matvec, rowgroup and launch: the same values)
PLAIN, RESIDUAL, GATE = 0, 1, 2  # modes (a runtime argument)
ROWS = 2  # rows a warp
UNROLL = 2  # 16-byte loads a row a lane a step
SPLIT_LOADS = 9  # fp8 loads a lane a row from which a dense residual launch splits its groups
RED = 2 * 32 * 4  # split sums: two groups' worth of up to 32 warps of up to 4 rows
XCHUNK = 8192  # floats of x staged in shared memory at a time
XPAIRS = XCHUNK // 2
PART_WEIGHTS = {"fp16": 2, "fp8": 4, "gf4": 8}  # weights in one 32-bit part of a load
NARROW_BYTES = {"fp16": 8, "fp8": 8, "gf4": 4}  # loads of rows not a multiple of 16 bytes
ROW_SCALE = {"fp16": 1.0, "fp8": 1.0, "gf4": GF4_RAW_SCALE}  # a row's raw sum times this
WARPS, MIN_WARPS, MAX_WARPS = 16, 4, 32  # warps a block: by default, and balance_warps' range
BLOCKS_PER_SM = 8
SIM_WARPS, SIM_BLOCKS = 2, 2


@dataclass(frozen=True)
class Version:
    """One kernel version and launch shape. Defaults: the shipped kernel (version 1)."""

    rows: int = ROWS  # rows a warp
    unroll: int = UNROLL  # loads a row a lane a step
    wide: bool = True  # 16-byte loads (False: 8 bytes)
    warps: int = 0  # warps a block (0: the package's launch rule)
    blocks_per_sm: int = 8  # blocks an SM at most (also capped by the kernel's occupancy)
    split: int = 0  # warps sharing a row group (0: the package's rule)
    early: bool = True
    cvt: bool = True
    prefetch: bool = False
    direct: bool = False
    max_regs: int = 0
    copy: bool = False  # through version_kernel even at the shipped sizes (not the package's launcher)

    @property
    def shipped(self) -> bool:
        return self == Version()

    @property
    def label(self) -> str:
        if self.shipped:
            return "shipped"
        out = f"R{self.rows}U{self.unroll}" + ("" if self.wide else " 8B")
        out += f" w{self.warps}" if self.warps else ""
        out += f" bps{self.blocks_per_sm}" if self.blocks_per_sm != 8 else ""
        out += f" s{self.split}" if self.split else ""
        out += "" if self.early else " late"
        out += "" if self.cvt else " shift"
        out += " prefetch" if self.prefetch else ""
        out += " direct" if self.direct else ""
        out += f" m{self.max_regs}" if self.max_regs else ""
        return out + (" copy" if self.copy else "")


V = Version
# the versions every check runs, and the table times on VARIANT_SHAPES
VERSIONS = {
    "fp16": [V(), V(copy=True), V(early=False), V(wide=False), V(cvt=False)],
    "fp8": [V(), V(copy=True), V(early=False), V(unroll=4), V(cvt=False), V(prefetch=True)],
    "gf4": [V(), V(copy=True), V(rows=4, unroll=1, prefetch=True), V(warps=8), V(unroll=4), V(wide=False)],
    "q8": [V()],
    "q4": [V()],
}
VARIANT_SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (2048, 2048)]
LAUNCH_KNOBS = [(8, 8), (8, 2), (16, 1), (16, 8)]  # (warps a block, blocks an SM at most)
# the R x U x warps sweep: staged x, and direct x (launches without a fused norm)
SWEEP = [V(r, u, warps=w) for r, u in ((2, 2), (2, 4), (4, 2)) for w in (4, 8, 16)] + [
    V(r, u, warps=w, direct=True) for r, u in ((2, 2), (4, 1)) for w in (2, 4, 8)
]
# TinyLlama's launches as the token step makes them, and Llama-3-8B's w2 / ffn_gate
SPLIT_LAUNCHES = [
    ("wo", 2048, 2048, RESIDUAL),
    ("w2", 2048, 5632, RESIDUAL),
    ("ffn_gate", 5632, 2048, GATE),
    ("classifier", 32000, 2048, PLAIN),
    ("llama3 w2", 4096, 14336, RESIDUAL),
    ("llama3 ffn_gate", 14336, 4096, GATE),
]
SPLIT_VERSIONS = [
    V(),
    V(split=1, warps=16),
    V(split=2, warps=16),
    V(unroll=4, warps=16, split=1),
    V(unroll=4, warps=8, split=1),
    V(rows=4, warps=16, split=1),
    V(warps=8, split=1, max_regs=64),
    V(warps=16, split=1, max_regs=64),
    V(unroll=1, warps=16, split=1),
    V(warps=16, split=2, max_regs=64),
    V(unroll=4, warps=16, split=2),
]


# ---------------------------------------------------------------------------------------------
# the shipped kernel's dense device functions (pycalm.kernels.rowgroup), and versions 3-7's


@cuda.jit(device=True, inline=True)
def fp16_part_dot(t, xv, acc):  # noqa: ANN001, ANN201
    """acc + the two fp16 weights of the int32 t (low half first) times xv[0], xv[1]."""
    f0, f1 = h2f2(t)
    acc += f0 * xv[0]
    acc += f1 * xv[1]
    return acc


@cuda.jit(device=True, inline=True)
def fp8_part_dot(t, xv, acc):  # noqa: ANN001, ANN201
    """acc + the four e5m2 weights of the int32 t (byte 0 first) times xv[0..3]."""
    f0, f1, f2, f3 = fp8x4_cvt(t)
    acc += f0 * xv[0]
    acc += f1 * xv[1]
    acc += f2 * xv[2]
    acc += f3 * xv[3]
    return acc


@cuda.jit(device=True, inline=True)
def gf4_part_dot(t, xv, acc):  # noqa: ANN001, ANN201
    """acc + the gf4 group t times xv[0..7], raw: times GF4_RAW_SCALE for the value."""
    return acc + gf4_dot8_raw(t, xv[0], xv[1], xv[2], xv[3], xv[4], xv[5], xv[6], xv[7])


PART_DOT = {"fp16": fp16_part_dot, "fp8": fp8_part_dot, "gf4": gf4_part_dot}


@cuda.jit(device=True, inline=True)
def pair_times(v, norm_w, i):  # noqa: ANN001, ANN201
    """A uint64 pair of floats (x[i], x[i + 1]) times (norm_w[i], norm_w[i + 1]), repacked."""
    lo = as_f32(v) * norm_w[i]
    hi = as_f32(v >> uint64(32)) * norm_w[i + uint64(1)]
    return uint64(uint32(as_i32(lo))) | (uint64(uint32(as_i32(hi))) << uint64(32))


@cuda.jit(device=True, inline=True)
def pair_sq(v):  # noqa: ANN001, ANN201
    """x[i]^2 + x[i + 1]^2 of a uint64 pair of floats."""
    lo = as_f32(v)
    hi = as_f32(v >> uint64(32))
    return lo * lo + hi * hi


@cuda.jit(device=True, inline=True)
def staged_rms(ss, n, eps, scratch):  # noqa: ANN001, ANN201
    """rsqrt(mean(x^2) + eps) from every thread's stage_x sum of squares; its barrier also
    publishes the staged x. All threads must call it."""
    ss = warp_reduce_sum(ss)
    if cuda.threadIdx.x % WARP == 0:
        scratch[cuda.threadIdx.x // WARP] = ss
    cuda.syncthreads()  # the warps' sums, and the staged x, are in shared memory
    t = float32(0.0)
    for w in range(cuda.blockDim.x // WARP):
        t += scratch[w]
    return float32(1.0) / math.sqrt(t / float32(n) + float32(eps))


@cuda.jit(device=True, inline=True)
def rms_factor(x, eps, scratch):  # noqa: ANN001, ANN201
    """rsqrt(mean(x^2) + eps) over the whole of x, by the whole block (contains barriers)."""
    s = float32(0.0)
    for i in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        v = x[i]
        s += v * v
    s = block_reduce_sum(s, scratch)
    return float32(1.0) / math.sqrt(s / float32(x.shape[0]) + float32(eps))


@cuda.jit(device=True, inline=True)
def silu_gate(a, b):  # noqa: ANN001, ANN201
    """silu(a) * b in float32."""
    return a / (float32(1.0) + math.exp(-a)) * b


@functools.cache
def stage_x_for(E: int):  # noqa: ANN201
    """stage_x for loads of E weights: x[c0 : c0 + n] into xs as transposed float pairs (xs[p CW
    + j] = pair p of load j; times norm_w when normed) -> this thread's sum of x^2."""
    HALF_E = E // 2
    CW = XCHUNK // E

    @cuda.jit(device=True, inline=True)
    def stage_x(x64, norm_w, xs, c0, n, normed):  # noqa: ANN001, ANN202
        ss = float32(0.0)
        v = cuda.local.array(HALF_E, uint64)  # one load's pairs
        for j in range(cuda.threadIdx.x, n // E, cuda.blockDim.x):
            b = c0 // 2 + j * HALF_E  # x64 index of the load's first pair
            for p in range(HALF_E):
                v[p] = x64[b + p]
            if normed:
                for p in range(HALF_E):
                    ss += pair_sq(v[p])
                for p in range(HALF_E):
                    v[p] = pair_times(v[p], norm_w, uint64(2 * (b + p)))
            for p in range(HALF_E):
                xs[uint64(j + p * CW)] = v[p]
        return ss

    return stage_x


@cuda.jit(device=True, inline=True)
def fp16_part_dot_shift(t, xv, acc):  # noqa: ANN001, ANN201
    """Version 4's fp16 decoder: each half moved to the top of an int32, >> 3 and masked: an fp32
    of value * 2**-112 (the shipped one: h2f2, cvt.f32.f16)."""
    acc += as_f32(int32(sar32(shl32(t, 16), 3) & int32(MASK_FP16))) * xv[0]
    acc += as_f32(int32(sar32(t, 3) & int32(MASK_FP16))) * xv[1]
    return acc


@cuda.jit(device=True, inline=True)
def fp8_part_dot_shift(t, xv, acc):  # noqa: ANN001, ANN201
    """Version 4's e5m2 decoder: fp8_byte_raw, a shift and a mask a byte (value * 2**-112)."""
    acc += fp8_byte_raw(t, 0) * xv[0]
    acc += fp8_byte_raw(t, 1) * xv[1]
    acc += fp8_byte_raw(t, 2) * xv[2]
    acc += fp8_byte_raw(t, 3) * xv[3]
    return acc


SHIFT_PART_DOT = {"fp16": fp16_part_dot_shift, "fp8": fp8_part_dot_shift, "gf4": PART_DOT["gf4"]}


@functools.cache
def version_kernel(dtype: str, nbytes: int, rows: int, unroll: int, split: int, early: bool, cvt: bool,
                   prefetch: bool, direct: bool, max_regs: int):  # noqa: ANN201  # fmt: skip
    """The dense matvec kernel (pycalm.kernels.matvec.matvec_kernel's code and arguments, the
    slot arguments unread) with the choices of versions 2-7 as arguments: at rows, unroll and
    split of the shipped kernel, early, cvt, no prefetch, not direct and no register cap, it is
    the shipped kernel's dense code."""
    if dtype in formats.QUANTIZED:
        raise ValueError(f"the versions here take fp16, fp8 and gf4 weights, not {dtype}")
    WORDS = max(1, nbytes // 8)
    PARTS = nbytes // 4
    PW = PART_WEIGHTS[dtype]
    E = PARTS * PW
    stage_x = stage_x_for(E)
    CW = XCHUNK // E
    STEP = uint64(WARP * unroll * split)
    SPAN = uint64(WARP * (unroll - 1))
    HALF = max(1, rows // 2)
    STEP_WORDS = rows * unroll * WORDS
    RED_SIZE = RED if split > 1 else 1
    XS_PAIRS = XPAIRS if not direct else 1  # compile-time sizes: numba types a conditional as int64
    LATER_WORDS = STEP_WORDS if prefetch else 1
    SCALE = ROW_SCALE[dtype] if cvt or dtype == "gf4" else FP_RAW_SCALE
    part_dot = PART_DOT[dtype] if cvt else SHIFT_PART_DOT[dtype]
    wide = nbytes == 16

    @cuda.jit(device=True, inline=True)
    def load_rows(wa, wb, row, j, words, u):  # noqa: ANN001, ANN202
        for r in range(rows):
            m = wa if r < HALF else wb
            k = (u * rows + r) * WORDS
            if wide:
                words[k], words[k + 1] = ldg128(m, row[r], j)
            else:
                words[k] = uint64(m[row[r], j])

    @cuda.jit(device=True, inline=True)
    def load_step(wa, wb, row, j, words):  # noqa: ANN001, ANN202
        for u in range(unroll):
            load_rows(wa, wb, row, j + uint64(WARP * u), words, u)

    @cuda.jit(device=True, inline=True)
    def load_first(wa, wb, row, j0, n, first, words):  # noqa: ANN001, ANN202
        last = uint64(n - 1)
        for u in range(unroll):
            load_rows(wa, wb, row, uint64(j0) + min(uint64(first + WARP * u), last), words, u)

    @cuda.jit(device=True, inline=True)
    def dot_load(words, u, xs, j0, j, acc):  # noqa: ANN001, ANN202
        xv = cuda.local.array(PW, float32)
        for i in range(PARTS):
            for p in range(PW // 2):
                if direct:  # xs is x64 itself: pair i PW/2 + p of load j0 + j
                    v = xs[(j0 + j) * uint64(E // 2) + uint64(i * (PW // 2) + p)]
                else:
                    v = xs[j + uint64((i * (PW // 2) + p) * CW)]
                xv[2 * p] = as_f32(v)
                xv[2 * p + 1] = as_f32(v >> uint64(32))
            for r in range(rows):
                w = words[(u * rows + r) * WORDS + i // 2]
                acc[r] = part_dot(int32(w >> uint64(32 * (i % 2))), xv, acc[r])

    @cuda.jit(device=True, inline=True)
    def dot_step(words, xs, j0, j, acc):  # noqa: ANN001, ANN202
        for u in range(unroll):
            dot_load(words, u, xs, j0, j + uint64(WARP * u), acc)

    @cuda.jit(device=True, inline=True)
    def group_dot(words, later, wa, wb, row, xs, j0, n, first, acc):  # noqa: ANN001, ANN202
        for r in range(rows):
            acc[r] = float32(0.0)
        j = uint64(first)
        j0 = uint64(j0)
        n = uint64(n)
        if j + SPAN < n:
            if not early:
                load_step(wa, wb, row, j0 + j, words)
            if prefetch:
                while True:
                    jn = j + STEP
                    more = jn + SPAN < n
                    load_step(wa, wb, row, j0 + (jn if more else j), later)  # the next step first
                    dot_step(words, xs, j0, j, acc)
                    j = jn
                    if not more:
                        break
                    for k in range(STEP_WORDS):
                        words[k] = later[k]
            else:
                dot_step(words, xs, j0, j, acc)
                j += STEP
                while j + SPAN < n:
                    load_step(wa, wb, row, j0 + j, words)
                    dot_step(words, xs, j0, j, acc)
                    j += STEP
        while j < n:
            load_rows(wa, wb, row, j0 + j, words, 0)
            dot_load(words, 0, xs, j0, j, acc)
            j += uint64(WARP)

    @cuda.jit(device=True, inline=True)
    def group_rows(g, mode, n_rows, row):  # noqa: ANN001, ANN202
        if mode == GATE:
            for r in range(rows):
                row[r] = uint64(min(HALF * g + r % HALF, n_rows - 1))
        else:
            for r in range(rows):
                row[r] = uint64(min(rows * g + r, n_rows - 1))

    def version_kernel(
        wa, wb, sa, sb, x, x64, norm_w, eps, out, mode, normed, route_ids, route_w, n_slots, expert_rows
    ):  # noqa: ANN001, ANN202, E501
        xs = cuda.shared.array(XS_PAIRS, uint64)
        scratch = cuda.shared.array(WARP, float32)
        red = cuda.shared.array(RED_SIZE, float32)
        words = cuda.local.array(STEP_WORDS, uint64)
        later = cuda.local.array(LATER_WORDS, uint64)
        acc = cuda.local.array(rows, float32)
        row = cuda.local.array(rows, uint64)
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        team = warp // split
        part = warp - team * split
        first = lane + part * (WARP * unroll)
        n_teams = cuda.blockDim.x // WARP // split
        rb = 0
        n_rows = wa.shape[0]
        cols = x.shape[0]
        n_words = wa.shape[1] // WORDS
        n_groups = (n_rows + HALF - 1) // HALF if mode == GATE else (n_rows + rows - 1) // rows
        stride = cuda.gridDim.x * n_teams
        scale = float32(SCALE)
        n_chunks = 1 if direct else (cols + XCHUNK - 1) // XCHUNK
        for c in range(n_chunks):
            j0 = c * CW
            nw = n_words if direct else min(CW, n_words - j0)
            g = cuda.blockIdx.x * n_teams + team
            group_rows(min(g, n_groups - 1), mode, n_rows, row)
            if early:
                load_first(wa, wb, row, j0, nw, first, words)
            if c == 0:
                grid_dependency_wait()
            if not direct:
                cuda.syncthreads()  # every warp is done with the previous chunk of xs
                c0 = c * XCHUNK
                ss = stage_x(x64, norm_w, xs, c0, min(XCHUNK, cols - c0), normed)
                if normed and n_chunks == 1:
                    scale = float32(SCALE) * staged_rms(ss, cols, eps, scratch)  # publishes xs
                else:
                    if normed and c == 0:
                        scale *= rms_factor(x, eps, scratch)  # contains barriers
                    cuda.syncthreads()  # xs holds this chunk for every warp
            while (g - team if split > 1 else g) < n_groups:
                group_dot(words, later, wa, wb, row, x64 if direct else xs, j0, nw, first, acc)
                gn = g + stride
                if gn >= n_groups:
                    launch_dependents()
                group_rows(min(gn, n_groups - 1), mode, n_rows, row)
                if early:
                    load_first(wa, wb, row, j0, nw, first, words)
                for r in range(rows):
                    acc[r] = warp_reduce_sum(acc[r])  # xor shuffles: every lane gets the sum
                if split > 1:
                    if lane == 0:
                        for r in range(rows):
                            red[rb + warp * rows + r] = acc[r]
                    cuda.syncthreads()  # every part's sums of the block's groups are in red
                    for r in range(rows):
                        s = red[rb + team * split * rows + r]
                        for p in range(1, split):
                            s += red[rb + (team * split + p) * rows + r]
                        acc[r] = s * scale
                    rb = RED // 2 - rb
                else:
                    for r in range(rows):
                        acc[r] *= scale
                if lane == 0 and part == 0:
                    if mode == GATE:
                        for i in range(HALF):
                            if HALF * g + i < n_rows:
                                out[HALF * g + i] = silu_gate(acc[i], acc[i + HALF])
                    else:
                        for r in range(rows):
                            if rows * g + r < n_rows:
                                if mode == RESIDUAL or c > 0:
                                    out[rows * g + r] += acc[r]
                                else:
                                    out[rows * g + r] = acc[r]
                g = gn

    if max_regs and not SIM:  # (the simulator has no register cap)
        return cuda.jit(max_registers=max_regs)(version_kernel)
    return cuda.jit(version_kernel)


def load_bytes(w: object, dtype: str) -> int:
    """The bytes a load takes (pycalm.kernels.rowgroup.load_bytes): 16 where a row is a multiple
    of 16 bytes, else NARROW_BYTES."""
    row_bytes = w.shape[1] * w.dtype.itemsize
    return 16 if row_bytes % 16 == 0 else NARROW_BYTES[dtype]


def split_for(dtype: str, mode: int, loads_a_lane: int) -> int:
    """Warps that share a row group in the shipped launch (pycalm.kernels.matvec.split_for,
    dense): 2 for fp8 residual rows of at least SPLIT_LOADS loads a lane, else 1."""
    return 2 if dtype == "fp8" and mode == RESIDUAL and loads_a_lane >= SPLIT_LOADS else 1


@functools.cache
def n_sm() -> int:
    return 132 if SIM else int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


_RESIDENT: dict = {}


def resident_blocks(kernel: object, args: tuple, threads: int) -> int | None:
    """Blocks of `kernel` an SM holds at `threads` threads a block (the occupancy calculator,
    as pycalm.kernels.launch.resident_blocks); None under the simulator."""
    if SIM:
        return None
    key = (kernel, threads)
    if key not in _RESIDENT:
        compiled = kernel._compile_for_args(*args)  # numba's own launch path does the same
        _RESIDENT[key] = compiled.max_cooperative_grid_blocks(threads) // n_sm()
    return _RESIDENT[key]


def blocks_for(n_groups: int, warps: int, split: int, resident: int | None, cap: int = BLOCKS_PER_SM) -> int:
    """pycalm.kernels.launch.blocks_for with `cap` blocks an SM at most (BLOCKS_PER_SM there)."""
    per_sm = min(cap, max(1, resident)) if resident is not None else cap
    teams = warps // split
    per_team = max(1, -(-n_groups // (n_sm() * per_sm * teams)))
    return max(1, -(-n_groups // (teams * per_team)))


def shipped_launch(kernel: object, args: tuple, n_groups: int, n_chunks: int, split: int) -> tuple[int, int]:
    """(blocks, threads) by the shipped launch rule (pycalm.kernels.launch.row_group_launch, whose
    docstring has the reasons): 16 warps, or the balanced block size where every warp can take
    one group, or 8 warps where 16 would leave SMs idle."""
    resident = functools.partial(resident_blocks, kernel, args)
    warps = WARPS if split == 1 else 8 * split
    if SIM:
        warps = max(1, SIM_WARPS // split) * split
        return min(blocks_for(n_groups, warps, split, None), SIM_BLOCKS), warps * WARP
    if split == 1 and n_chunks == 1:
        best = None
        for w in range(MIN_WARPS, MAX_WARPS + 1):  # balance_warps
            per_sm = min(BLOCKS_PER_SM, resident(w * WARP) or 0)
            if per_sm < 1:
                continue
            per_warp = -(-n_groups // (n_sm() * per_sm * w))
            blocks = -(-n_groups // (w * per_warp))
            key = (-(-blocks // n_sm()) * w * per_warp, per_warp, blocks)
            if best is None or key < best[0]:
                best = (key, w)
        if best is not None and best[0][1] == 1:
            warps = best[1]
        elif -(-n_groups // warps) < n_sm():
            warps = 8
    return blocks_for(n_groups, warps, split, resident(warps * WARP)), warps * WARP


def launch_version(v: Version, wa: object, wb: object, x: object, norm_w: object, out: object, dtype: str,
                   mode: int, stream: object) -> None:  # fmt: skip
    """Launch version v (mode PLAIN / RESIDUAL / GATE; norm_w None: no fused norm, eps 1e-5)."""
    if v.shipped:  # the package's launchers
        if mode == PLAIN:
            matvec(wa, x, out, dtype, stream=stream, norm_w=norm_w, eps=1e-5)
        elif mode == RESIDUAL:
            matvec_residual(wa, x, out, dtype, stream=stream)
        else:
            ffn_gate(wa, wb, x, out, dtype, stream=stream, norm_w=norm_w, eps=1e-5)
        return
    if v.direct and (norm_w is not None or mode == GATE):
        raise ValueError("the direct version has no staging to fuse a norm into, nor a gate")
    nbytes = load_bytes(wa, dtype)
    if not v.wide:  # 8-byte loads where the rows allow them
        nbytes = 8 if (wa.shape[1] * wa.dtype.itemsize) % 8 == 0 else NARROW_BYTES[dtype]
    unroll = v.unroll if nbytes == 16 else 1
    cols = x.shape[0]
    split = v.split or split_for(dtype, mode, cols // (nbytes // 4 * PART_WEIGHTS[dtype]) // WARP)
    kernel = version_kernel(
        dtype, nbytes, v.rows, unroll, split, v.early, v.cvt, v.prefetch, v.direct, v.max_regs
    )
    n_groups = -(-wa.shape[0] // (v.rows // 2 if mode == GATE else v.rows))
    words = np.uint32 if nbytes == 4 else np.uint64
    args = (
        wa.view(words), wb.view(words), x, x, x, x.view(np.uint64), x if norm_w is None else norm_w,
        np.float32(1e-5), out, np.int32(mode), np.int32(norm_w is not None), x.view(np.int32), x, np.int32(0),
        np.int32(0),
    )  # fmt: skip
    if not v.warps:
        blocks, threads = shipped_launch(kernel, args, n_groups, -(-cols // XCHUNK), split)
    else:
        warps = max(1, 2 // split) * split if SIM else v.warps
        threads = warps * WARP
        if v.direct:  # no shared memory, no barrier: one group a warp
            blocks = -(-n_groups // warps)
        else:
            blocks = blocks_for(
                n_groups, warps, split, resident_blocks(kernel, args, threads), cap=v.blocks_per_sm
            )
        blocks = min(blocks, SIM_BLOCKS) if SIM else blocks
    kernel[blocks, threads, stream](*args)


def bytes_moved(mode: int, w: object, x: object, normed: bool) -> int:
    """What a launch must move: the weights (two matrices for GATE; q8 / q4: codes and scales),
    x, norm_w, and the output written (read and written for RESIDUAL)."""
    quantized = isinstance(w, formats.Quantized)
    rows = (w.codes if quantized else w).shape[0]
    w_bytes = int(w.codes.nbytes) + int(w.scales.nbytes) if quantized else int(w.nbytes)
    out = {PLAIN: 4, RESIDUAL: 8, GATE: 4}[mode] * rows
    return (2 if mode == GATE else 1) * w_bytes + int(x.nbytes) * (2 if normed else 1) + out


# ---------------------------------------------------------------------------------------------
# checks against the references


def _rel_err(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> float:
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - want) / scale))


def check(
    stream: object, tiny: bool, dtypes: list[str] = DTYPES, versions: list[Version] | None = None
) -> bool:
    """Every version of VERSIONS (and split, direct and capped ones) against pycalm.cpu.reference at
    one shape a dtype: tiny (the simulator: 37x1536, 16-byte loads for every dtype) or big
    (4096x14336: x in two chunks; and 2051x4096: the gate, a partial last group). versions:
    these instead (tests/test_matvec.py checks a few under the simulator). Tolerance: 1e-5 of |W| |x| (float32
    accumulation in another order than the reference's)."""
    rng = np.random.default_rng(0)
    ok_all = True
    extra = [V(split=2, warps=16), V(split=2, warps=16, unroll=1), V(direct=True, warps=8), V(max_regs=64)]
    shapes = [(37, 1536)] if tiny else [(4096, 14336), (2051, 4096)]
    for (rows, cols), dtype in [(shape, dtype) for shape in shapes for dtype in dtypes]:
        w = formats.encode(rng.standard_normal((rows, cols)).astype(np.float32), dtype)
        w3 = formats.encode(rng.standard_normal((rows, cols)).astype(np.float32), dtype)
        wd, w3d = to_device(w), to_device(w3)
        x = rng.standard_normal(cols).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        xd, nwd = cuda.to_device(x), cuda.to_device(nw)
        xn = rmsnorm_ref(x, nw, 1e-5)
        wh = formats.decode(w, dtype).astype(np.float64)
        w3h = formats.decode(w3, dtype).astype(np.float64)
        own = extra if dtype not in formats.QUANTIZED else []  # q8 / q4: the package's kernel only
        for v in VERSIONS[dtype] + own if versions is None else versions:
            errs = {}
            y = cuda.to_device(np.full(rows, np.nan, np.float32))
            launch_version(v, wd, wd, xd, None, y, dtype, PLAIN, stream)
            stream.synchronize()
            errs["plain"] = _rel_err(y.copy_to_host(), matvec_ref(w, x, dtype), np.abs(wh) @ np.abs(x))
            r0 = rng.standard_normal(rows).astype(np.float32)
            r = cuda.to_device(r0)
            launch_version(v, wd, wd, xd, None, r, dtype, RESIDUAL, stream)
            stream.synchronize()
            errs["residual"] = _rel_err(r.copy_to_host(), r0 + wh @ x, np.abs(wh) @ np.abs(x) + np.abs(r0))
            if not v.direct:
                launch_version(v, wd, wd, xd, nwd, y, dtype, PLAIN, stream)
                stream.synchronize()
                errs["normed"] = _rel_err(y.copy_to_host(), wh @ xn, np.abs(wh) @ np.abs(xn))
                if cols <= XCHUNK and v.rows == 2:
                    h = cuda.to_device(np.full(rows, np.nan, np.float32))
                    launch_version(v, wd, w3d, xd, nwd, h, dtype, GATE, stream)
                    stream.synchronize()
                    a, b = wh @ xn, w3h @ xn
                    scale = (np.abs(wh) @ np.abs(xn)) * (np.abs(b) + 1) + (np.abs(a) + 1) * (
                        np.abs(w3h) @ np.abs(xn)
                    )
                    errs["gate"] = _rel_err(h.copy_to_host(), silu_ref(a) * b, scale)
            ok = all(e < 1e-5 for e in errs.values())
            ok_all &= ok
            print(f"check {dtype} {rows}x{cols} {v.label:28s} " + " ".join(f"{k} {e:.1e}" for k, e in errs.items()),
                  "OK" if ok else "FAIL", flush=True)  # fmt: skip
    return ok_all


# ---------------------------------------------------------------------------------------------
# timings (GPU)


def to_device(w: object) -> object:
    """A stored array, or both arrays of a q8 / q4 Quantized, on the device."""
    if isinstance(w, formats.Quantized):
        return formats.Quantized(cuda.to_device(w.codes), cuda.to_device(w.scales))
    return cuda.to_device(w)


def random_weights(rows: int, cols: int, dtype: str, seed: int) -> object:
    """Random finite stored weights made on the GPU (q8 / q4: codes, and scales near 2**-7)."""
    from gpubench import fill

    w = cuda.device_array(formats.storage_shape(rows, cols, dtype), formats.STORAGE_DTYPE[dtype])
    fill(w.reshape(-1).view(np.uint32), seed, MASK[dtype])
    if dtype not in formats.QUANTIZED:
        return w
    sc = cuda.device_array(formats.scales_shape(rows, cols, dtype), formats.SCALES_DTYPE[dtype])
    fill(sc.reshape(-1).view(np.uint32), seed + 1, *SCALE_BITS[dtype])
    return formats.Quantized(w, sc)


def n_copies(rows: int, cols: int, dtype: str) -> int:
    one = rows * cols * formats.bits_per_weight(dtype, cols) / 8
    return int(min(48, max(2, -(-ROTATE_BYTES // one))))


def timed(stream: object, launch: object, n_launches: int) -> float:
    """Seconds per launch: a graph of n_launches calls launch(i), replayed; the median replay."""
    from gpubench import graph_seconds

    return graph_seconds(stream, lambda: [launch(i) for i in range(n_launches)], REPLAYS) / n_launches


def time_version(
    s: object, v: Version, ws: list, x: object, y: object, nw: object, dtype: str, mode: int
) -> float:
    def run(i: int) -> None:
        w = ws[i % len(ws)]
        w3 = ws[(i + 1) % len(ws)] if mode == GATE else w
        launch_version(v, w, w3, x, nw, y, dtype, mode, s)

    return timed(s, run, max(len(ws), 16))


def setup(rows: int, cols: int, dtype: str, rng: object) -> tuple:
    ws = [random_weights(rows, cols, dtype, i) for i in range(n_copies(rows, cols, dtype))]
    x = cuda.to_device(rng.standard_normal(cols).astype(np.float32))
    return ws, x, cuda.device_array(rows, np.float32)


def sweep(s: object, dtypes: list[str], shapes: list[tuple[int, int]]) -> None:
    """Plain matvec for every SWEEP version on every shape, best first, dense formats only (a
    version whose launch the GPU refuses, e.g. too many registers for its block, is listed as
    refused)."""
    rng = np.random.default_rng(1)
    for dtype in dtypes:
        if dtype in formats.QUANTIZED:
            sys.exit(f"the sweep takes the dense formats (fp16, fp8, gf4), not {dtype}")
        versions = SWEEP
        for rows, cols in shapes:
            ws, x, y = setup(rows, cols, dtype, rng)
            nb = bytes_moved(PLAIN, ws[0], x, False)
            res, refused = [], []
            for v in versions:
                try:  # one plain launch first: a refused one must not happen inside a capture
                    launch_version(v, ws[0], ws[0], x, None, y, dtype, PLAIN, s)
                    s.synchronize()
                except CudaAPIError as e:  # CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES and the like
                    refused.append(f"{v.label} ({e.code})")
                    continue
                res.append((nb / time_version(s, v, ws, x, y, None, dtype, PLAIN) / 1e9, v.label))
            line = " ".join(f"{n}:{g:.0f}" for g, n in sorted(res, reverse=True))
            print(f"sweep {dtype} {rows}x{cols}: {line}" + (f" | refused: {', '.join(refused)}" if refused else ""),
                  flush=True)  # fmt: skip
            del ws


def split_sweep(s: object, dtypes: list[str], only: str, n_versions: int) -> None:
    """SPLIT_LAUNCHES (with their norms) for SPLIT_VERSIONS: us a launch and GB/s (dense formats)."""
    rng = np.random.default_rng(1)
    for dtype in dtypes:
        if dtype in formats.QUANTIZED:
            sys.exit(f"the split sweep takes the dense formats (fp16, fp8, gf4), not {dtype}")
        for name, rows, cols, mode in SPLIT_LAUNCHES:
            if only and name not in only.split(","):
                continue
            ws, x, y = setup(rows, cols, dtype, rng)
            nw = cuda.to_device(np.ones(cols, np.float32)) if mode != RESIDUAL else None
            nb = bytes_moved(mode, ws[0], x, nw is not None)
            res = []
            for v in SPLIT_VERSIONS[: n_versions or None]:
                t = time_version(s, v, ws, x, y, nw, dtype, mode)
                res.append(f"{v.label} {t * 1e6:.2f}us/{nb / t / 1e9:.0f}")
            print(f"split {dtype} {name} {rows}x{cols}: " + "  ".join(res), flush=True)
            del ws


def table(s: object, quick: bool) -> None:
    """The timing table: every shape x dtype (shipped), the versions and launch knobs on
    VARIANT_SHAPES, the residual, gate and fused QKV launches."""
    from gpubench import copy_ceiling

    t0 = time.time()
    ceiling = copy_ceiling(s)
    print(f"uint64 copy ceiling: {ceiling:,.0f} GB/s (read + write)", flush=True)
    rows_out = []

    def report(name: str, dtype: str, shape: tuple, nbytes: int, t: float) -> None:
        gbs = nbytes / t / 1e9
        rows_out.append((name, dtype, f"{shape[0]}x{shape[1]}", t * 1e6, gbs))
        print(f"{name:34s} {dtype:5s} {shape[0]:>6}x{shape[1]:<6} {t * 1e6:8.2f} us {gbs:7.0f} GB/s "
              f"{100 * gbs / ceiling:5.1f}%   [{time.time() - t0:.0f} s]", flush=True)  # fmt: skip

    rng = np.random.default_rng(1)
    for dtype in DTYPES:
        for rows, cols in LLAMA + TINY:
            ws, x, y = setup(rows, cols, dtype, rng)
            shape = (rows, cols)
            nb = bytes_moved(PLAIN, ws[0], x, False)
            report("matvec", dtype, shape, nb, time_version(s, V(), ws, x, y, None, dtype, PLAIN))
            if not quick and shape in VARIANT_SHAPES:
                for v in VERSIONS[dtype][1:]:
                    report(f"  {v.label}", dtype, shape, nb, time_version(s, v, ws, x, y, None, dtype, PLAIN))
                if shape in (VARIANT_SHAPES[0], (4096, 4096)):
                    for warps, bps in LAUNCH_KNOBS:
                        v = V(warps=warps, blocks_per_sm=bps)
                        report(
                            f"  {v.label}",
                            dtype,
                            shape,
                            nb,
                            time_version(s, v, ws, x, y, None, dtype, PLAIN),
                        )
            if shape in ((4096, 14336), (4096, 4096)):
                nb = bytes_moved(RESIDUAL, ws[0], x, False)
                report(
                    "matvec_residual",
                    dtype,
                    shape,
                    nb,
                    time_version(s, V(), ws, x, y, None, dtype, RESIDUAL),
                )
            if shape == (14336, 4096):
                nw = cuda.to_device(np.ones(cols, np.float32))
                nb = bytes_moved(GATE, ws[0], x, True)
                t = time_version(s, V(), ws, x, y, nw, dtype, GATE)
                report("ffn_gate (w1+w3, norm)", dtype, shape, nb, t)
            if shape == (6144, 4096):  # Llama-3-8B: 32 heads, 8 KV heads, head_dim 128
                cfg = SimpleNamespace(n_heads=32, n_kv_heads=8, head_dim=128, norm_eps=1e-5)
                freqs = cuda.to_device((1.0 / 500000.0 ** (np.arange(64) / 64)).astype(np.float32))
                state = cuda.to_device(np.array([1, 100, 0], np.int32))
                q = cuda.device_array(4096, np.float32)
                cache = KVCache(cuda.device_array((4096, 1024), np.float16), cuda.device_array((4096, 1024), np.float16),
                                "fp16")  # fmt: skip
                nw = cuda.to_device(np.ones(cols, np.float32))

                def qkv(i: int, ws: list = ws, x: object = x, nw: object = nw, freqs: object = freqs,
                        state: object = state, q: object = q, cache: object = cache, cfg: object = cfg,
                        dtype: str = dtype) -> None:  # fmt: skip
                    layer = SimpleNamespace(
                        wqkv=ws[i % len(ws)], bqkv=None, attn_norm=nw, dtypes={"wqkv": dtype}
                    )
                    qkv_rope(layer, x, freqs, state, q, cache, cfg, stream=s)

                nb = bytes_moved(PLAIN, ws[0], x, True) - 4 * 6144 + 4 * 4096 + 2 * 1024 * 2
                report("qkv_rope (norm, rope, kv fp16)", dtype, shape, nb, timed(s, qkv, max(len(ws), 16)))
            del ws
    print(f"\n== summary (copy ceiling {ceiling:,.0f} GB/s, total {time.time() - t0:.0f} s) ==")
    print(f"{'kernel':34s} {'dtype':5s} {'shape':>12s} {'us':>8s} {'GB/s':>7s} {'%ceil':>6s}")
    for name, dtype, shape, us, gbs in rows_out:
        print(f"{name:34s} {dtype:5s} {shape:>12s} {us:8.2f} {gbs:7.0f} {100 * gbs / ceiling:6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="check every version against the references, then stop"
    )
    ap.add_argument("--tiny", action="store_true", help="with --check: tiny shapes (the simulator)")
    ap.add_argument("--quick", action="store_true", help="the table for the shipped version only")
    ap.add_argument("--sweep", default="", help="only sweep R x U x warps for these dtypes (fp8,gf4)")
    ap.add_argument("--tiny-shapes", action="store_true", help="with --sweep: the TinyLlama shapes only")
    ap.add_argument("--split", default="", help="only time SPLIT_LAUNCHES with SPLIT_VERSIONS, these dtypes")
    ap.add_argument("--launches", default="", help="with --split: these launches only (wo,w2,..)")
    ap.add_argument("--n-versions", type=int, default=0, help="with --split: the first N versions only")
    args = ap.parse_args()
    s = cuda.stream()
    if args.check or SIM:
        ok = check(s, args.tiny or SIM)
        print(f"check {'OK' if ok else 'FAILED'}", flush=True)
        sys.exit(0 if ok else 1)
    print(f"device: {cuda.get_current_device().name}", flush=True)
    if args.split:
        split_sweep(s, args.split.split(","), args.launches, args.n_versions)
    elif args.sweep:
        sweep(s, args.sweep.split(","), TINY if args.tiny_shapes else LLAMA + TINY)
    else:
        if not check(s, False):
            sys.exit(1)
        table(s, args.quick)


if __name__ == "__main__":
    main()
