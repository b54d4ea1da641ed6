"""Matrix-vector products with fp16 / fp8 e5m2 / gf4 / q8 / q4 weights, and their fusions.

  matvec:           y = W x, or y = W (rmsnorm(x) * norm_w)
  matvec_residual:  r += W x   (wo and w2: the residual add fused)
  ffn_gate:         h = silu(W1 xn) * (W3 xn), xn = rmsnorm(x) * norm_w

References: pycalm.cpu.reference.matvec_ref, matvec_residual_ref, ffn_gate_ref (rmsnorm_ref for the
fused norm).

W is the stored array of pycalm.model.formats (float16 / uint8 / uint32 groups of 8); x, y float32.
One kernel, matvec_kernel, runs all three (the mode is a runtime argument) and, in its slot
form, the chosen experts of pycalm.kernels.moe; pycalm.kernels.qkv builds its fused kernel from
the same device functions (row_group).

Thread mapping. A warp computes the dot products of ROWS weight rows with the same x (a "row
group": rows ROWS g .. ROWS g + ROWS - 1 of one matrix for PLAIN / RESIDUAL, rows (ROWS/2) g ..
of W1 and the same rows of W3 for GATE), so every x value read from shared memory serves ROWS
rows and the epilogue (SiLU gate, RoPE rotation) needs no barrier. Lane l reads the 16-byte
units l, l + 32, l + 64, ... of each row (ldg128: 8 fp16, 16 fp8 or 32 gf4 weights; a warp
reads 512 contiguous bytes a row per load), UNROLL units a row per step, all ROWS * UNROLL
loads issued before the first use. The first step's loads of a group are issued before x is
staged (and, for the next group, before this group's warp reduction), so the weights stream in
meanwhile. Warps loop over row groups (grid-stride) in a grid from
pycalm.kernels.launch.row_group_launch. The dense residual launches of long fp8 rows (w2: at
least SPLIT_LOADS loads a lane a row) give a group to 2 consecutive warps of a block, which take
its steps in turn and add their sums through shared memory: a warp's chain is half as long.

Programmatic launches (a graph with programmatic edges, pycalm.gpu.graph): the first weight loads
are issued before grid_dependency_wait (weights are never written), x and out are read after
it; a warp calls launch_dependents once its last group's loads are issued, so the next kernel's
launch and first loads overlap this kernel's reductions and writes.

Memory layout of x. x is staged once per block in shared memory (times norm_w when the RMSNorm
is fused; the scalar rsqrt(mean(x^2) + eps) factors out of the dot product, comes from the
staging pass's sum of squares, and is applied to the row sums), as uint64 pairs of floats
transposed by load: xs[p * CW + j] = (x[j E + 2p], x[j E + 2p + 1]) (E weights a load, CW loads
a chunk), so one 64-bit shared load gives two x values and the 32 lanes, reading pair p of 32
consecutive loads, read 256 contiguous bytes (no bank conflicts). q8 and q4 stage x instead as
16-bit integers in two byte limbs, a scale a group of 32 columns (pycalm.kernels.qdecode): one
uint64 a 32-bit word of codes (q8: 4 columns, both limbs) or two (q4: 8 columns, a limb each),
transposed by load in the same way, and each load's scale and sum of X in xsum; a thread stages
one word's columns and the lanes of a group share its max |x| by shuffles. Rows longer than XCHUNK
columns are done chunk by chunk: each block stages chunk c, its warps add their groups' partial
sums for chunk c into the output (PLAIN: the first chunk writes), then the next chunk is
staged; one warp owns each output row, so the order of the adds is fixed. ffn_gate and qkv_rope
need whole rows (the gate, the rotation), so their x is one chunk.

Expert slots (pycalm.kernels.moe): the slot form runs the chosen experts of a stacked
(n_experts, rows, cols) weight viewed as (n_experts * rows, cols), slot after slot. The expert of
slot s is read from device memory (route_ids[s], written by the routing kernel: a captured graph
follows the routing) and only moves the row base of the loads, so the inner loop is the dense
one. GATE writes slot s's part of out times the routing weight route_w[s] (x, staged once, serves
every slot); RESIDUAL stages slot s's part of x and adds W_e x_s into out, the warp that owns a
row owning it for every slot.

Decoding in registers (the device decoders of pycalm.kernels.common, SASS per weight on sm_90):
fp16 one cvt.f32.f16 (HADD2.F32) and one FFMA; fp8 half a PRMT (two e5m2 bytes into the top
bytes of two fp16), one HADD2.F32, one FFMA; gf4 one LOP3 (the code masked and given an
exponent), one exact FADD (q - 4), one FFMA, and the group scale once a group (the row's sum is
then times GF4_RAW_SCALE); q8 no decode, two dp4a (IDP.4A) for 4 weights, the codes times x's
two limbs; q4 two LOP3 and a shift for 8 codes (nibbles masked into bytes) and four dp4a; both
sum in int32 and convert once a load (pycalm.kernels.qdecode). Rows that are not a multiple of
16 bytes (test shapes only) take narrow loads (fp16, fp8 and q8 8 bytes, gf4 4 bytes) and one
load a row a step.

Bytes moved: the weights (with slots: the chosen experts' matrices only), x once (it is re-read
per block from L2, not counted), norm_w when fused, and the output (written, or read and
written for the residual).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint64

from pycalm.errors import PycalmError
from pycalm.kernels.common import WARP, grid_dependency_wait, launch_dependents, warp_reduce_sum
from pycalm.kernels.launch import row_group_launch
from pycalm.kernels.rowgroup import (
    PART_WEIGHTS,
    ROW_SCALE,
    XCHUNK,
    XPAIRS,
    codes_and_scales,
    load_bytes,
    rms_factor,
    row_group,
    staged_rms,
    word_view,
)
from pycalm.model.formats import Quantized

# ---------------------------------------------------------------------------------------------
# the row-group kernel

ROWS = 2  # rows a warp (a row group; GATE: a row of W1 and the same row of W3)
UNROLL = 2  # 16-byte loads a row a lane a step (narrow loads: 1)
SPLIT_LOADS = 9  # fp8 loads a lane a row from which a dense residual launch splits its groups
RED = 2 * 32 * 4  # split sums: two groups' worth of up to 32 warps of up to 4 rows
# registers a thread at most: launches of x in several chunks and split launches take blocks of
# 16 warps (pycalm.kernels.launch), which fit an SM's 65,536 registers only at 128 a thread (above
# it they fail with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); tests/test_ptx.py holds every kernel to it
MAX_REGISTERS = 128

# modes of matvec_kernel (a runtime argument: one compiled kernel serves all three)
PLAIN, RESIDUAL, GATE = 0, 1, 2


@cuda.jit(device=True, inline=True)
def silu_gate(a: float, b: float) -> float:
    """silu(a) * b in float32."""
    return a / (float32(1.0) + math.exp(-a)) * b


@functools.cache
def matvec_kernel(  # noqa: ANN201
    dtype: str,
    load_bytes: int = 16,
    rows: int = ROWS,
    unroll: int = UNROLL,
    split: int = 1,
    slots: bool = False,
):
    """The matvec kernel for a weight dtype, the bytes a load, rows a warp, loads a row a lane a
    step, the warps sharing a group (split) and the expert-slot form (slots). References:
    matvec_ref (PLAIN, with rmsnorm_ref for a fused norm), matvec_residual_ref (RESIDUAL),
    ffn_gate_ref (GATE); with slots moe_ffn_gate_ref / moe_matvec_residual_ref.

    Arguments: wa, wb (rows, units) word arrays (wb = wa except for GATE); sa, sb their scales
    (q8: (rows,) float32; q4: (rows, groups) uint32, the (d, m) halves; other dtypes: any array,
    never read); x (cols,) float32 and
    x64, x viewed as uint64 pairs; norm_w (cols,) float32 (read only when normed); eps float32;
    out float32; mode (PLAIN: out = W x, RESIDUAL: out += W x, GATE: out = silu(Wa x) * (Wb x));
    normed; route_ids (int32), route_w (float32), n_slots, expert_rows: the expert slots, read
    only by the slot form (the dense one takes them and never reads them: any arrays of the
    right types will do).

    Slots: wa, wb are stacks of experts viewed as (n_experts * expert_rows, units); slot s
    uses the expert_rows rows from route_ids[s] * expert_rows. GATE: out[s * expert_rows + r]
    = route_w[s] * silu(Wa_e x) * (Wb_e x), x shared by the slots; RESIDUAL: out += W_e x_s
    with x_s = x[s * cols : (s + 1) * cols], the slots one after another."""
    stage_x, load_first, group_dot, group_shift, XSUMS, SCALES, SCALE_T = row_group(
        dtype, load_bytes, rows, unroll, split
    )
    WORDS = max(1, load_bytes // 8)
    CW = XCHUNK // (load_bytes // 4 * PART_WEIGHTS[dtype])  # loads a chunk
    SCALE = ROW_SCALE[dtype]
    HALF = max(1, rows // 2)
    SPLIT, SLOTS = split, slots
    RED_SIZE = RED if split > 1 else 1
    STEP_WORDS = rows * unroll * WORDS  # the words a step's loads bring a lane

    @cuda.jit(device=True, inline=True)
    def group_rows(g, mode, n_rows, base, row):  # noqa: ANN001, ANN202
        """row[r] = the rows of group g, clamped to the matrix (for the loads): GATE rows HALF g
        + r % HALF of W1 (r < HALF) and of W3, else rows rows g + r; base: the matrix's first
        row in an expert stack (dense: 0)."""
        if mode == GATE:
            for r in range(rows):
                row[r] = uint64(base + min(HALF * g + r % HALF, n_rows - 1))
        else:
            for r in range(rows):
                row[r] = uint64(base + min(rows * g + r, n_rows - 1))

    @cuda.jit(cache=True)
    def matvec_kernel(
        wa, wb, sa, sb, x, x64, norm_w, eps, out, mode, normed, route_ids, route_w, n_slots, expert_rows
    ):  # noqa: ANN001, ANN202
        xs = cuda.shared.array(XPAIRS, uint64)  # x chunk as float pairs, transposed by load
        xsum = cuda.shared.array(XSUMS, float32)  # q4, q8: the chunk's x sums, one a load
        sc = cuda.local.array(SCALES, SCALE_T)  # q4: a step's group scales; q8: the rows' scales
        scratch = cuda.shared.array(WARP, float32)  # block reduction
        red = cuda.shared.array(RED_SIZE, float32)  # split: the parts' sums
        words = cuda.local.array(STEP_WORDS, uint64)  # a step's loads: registers
        acc = cuda.local.array(rows, float32)  # the rows' sums
        row = cuda.local.array(rows, uint64)  # the rows' indices in wa / wb
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        team = warp // SPLIT  # the warps of a row group: SPLIT consecutive ones
        part = warp - team * SPLIT
        first = lane + part * (WARP * unroll)  # the lane's first load
        n_teams = cuda.blockDim.x // WARP // SPLIT
        rb = 0  # split: the half of red this group uses
        if SLOTS:
            grid_dependency_wait()  # route_ids, x and out come from earlier kernels
            launch_dependents()  # now the next kernel may launch and load its weights
            n_rows = expert_rows  # rows of one expert's matrix
            # GATE: x is shared by the slots; RESIDUAL: x holds one vector a slot
            cols = x.shape[0] // n_slots if mode == RESIDUAL else x.shape[0]
        else:
            n_rows = wa.shape[0]
            cols = x.shape[0]
        n_words = wa.shape[1] // WORDS  # loads a row
        sha, shb = group_shift(wa, sa), group_shift(wb, sb)  # q4: log2(loads a group)
        n_groups = (n_rows + HALF - 1) // HALF if mode == GATE else (n_rows + rows - 1) // rows
        stride = cuda.gridDim.x * n_teams
        scale = float32(SCALE)
        n_chunks = (cols + XCHUNK - 1) // XCHUNK
        for t in range(n_slots * n_chunks if SLOTS else n_chunks):  # (slot, chunk) pairs
            slot = t // n_chunks if SLOTS else 0
            c = t - slot * n_chunks
            base = route_ids[slot] * n_rows if SLOTS else 0  # the expert's first row
            gw = route_w[slot] if SLOTS and mode == GATE else float32(1.0)  # its routing weight
            c0 = c * XCHUNK
            j0 = c * CW
            nw = min(CW, n_words - j0)
            g = cuda.blockIdx.x * n_teams + team
            group_rows(min(g, n_groups - 1), mode, n_rows, base, row)
            load_first(
                wa, wb, sa, sb, row, j0, nw, first, words, sc, sha, shb
            )  # streams in while x is staged
            if not SLOTS and c == 0:  # x and out come from earlier kernels: read them after
                grid_dependency_wait()  # (the weights' first loads above are in flight)
            if slot == 0 or mode != GATE:  # GATE: x is one chunk, staged once for every slot
                cuda.syncthreads()  # every warp is done with the previous chunk of xs
                ss = stage_x(x64, norm_w, xs, xsum, slot * cols + c0, min(XCHUNK, cols - c0), normed)
                if normed and n_chunks == 1:  # all of x staged: its sum of squares is complete
                    scale = float32(SCALE) * staged_rms(ss, cols, eps, scratch)  # publishes xs
                else:
                    if normed and slot == 0 and c == 0:  # x longer than a chunk: its own pass
                        scale *= rms_factor(x, eps, scratch)  # contains barriers
                    cuda.syncthreads()  # xs holds this chunk for every warp
            # split: block-uniform (every warp reaches the barrier below); else warp-uniform
            while (g - team if SPLIT > 1 else g) < n_groups:
                group_dot(words, sc, wa, wb, sa, sb, row, xs, xsum, j0, nw, first, sha, shb, acc)
                gn = g + stride
                if not SLOTS and gn >= n_groups:  # this warp's last weights are in:
                    launch_dependents()  # the next kernel may launch and load its own
                group_rows(min(gn, n_groups - 1), mode, n_rows, base, row)
                load_first(
                    wa, wb, sa, sb, row, j0, nw, first, words, sc, sha, shb
                )  # the next group's first step
                for r in range(rows):
                    acc[r] = warp_reduce_sum(acc[r])  # xor shuffles: every lane gets the sum
                if SPLIT > 1:
                    if lane == 0:
                        for r in range(rows):
                            red[rb + warp * rows + r] = acc[r]
                    cuda.syncthreads()  # every part's sums of the block's groups are in red
                    for r in range(rows):
                        s = red[rb + team * SPLIT * rows + r]
                        for p in range(1, SPLIT):  # the parts in a fixed order
                            s += red[rb + (team * SPLIT + p) * rows + r]
                        acc[r] = s * scale
                    rb = RED // 2 - rb  # the next group writes the other half: no second barrier
                else:
                    for r in range(rows):
                        acc[r] *= scale
                if lane == 0 and part == 0:
                    if mode == GATE:  # slot s writes its part of out, times its routing weight
                        for i in range(HALF):
                            if HALF * g + i < n_rows:
                                out[slot * n_rows + HALF * g + i] = silu_gate(acc[i], acc[i + HALF]) * gw
                    else:  # one warp owns each output row through every chunk and slot
                        for r in range(rows):
                            if rows * g + r < n_rows:
                                if mode == RESIDUAL or slot > 0 or c > 0:
                                    out[rows * g + r] += acc[r]
                                else:
                                    out[rows * g + r] = acc[r]
                g = gn

    return matvec_kernel


def split_for(dtype: str, mode: int, loads_a_lane: int, slots: bool) -> int:
    """Warps that share a row group: 2 for the dense one-byte (fp8, q8) residual launches of long
    rows (w2: at least SPLIT_LOADS loads a lane a row), else 1. A warp's row is then a chain of
    half the steps, which pays for the barrier a group only there: rows of a few loads a lane
    (wo), the gate and the classifier, fp16 (no faster) and gf4 (its decode, not the chain, is
    the bound) keep one warp a group (timed in docs/BENCHMARKS.md at b282afd)."""
    one_byte = dtype in ("fp8", "q8")
    long_rows = one_byte and mode == RESIDUAL and not slots and loads_a_lane >= SPLIT_LOADS
    return 2 if long_rows else 1


def launch_matvec(
    wa: object,
    wb: object,
    x: object,
    norm_w: object,
    eps: float,
    out: object,
    dtype: str,
    mode: int,
    *,
    stream: object,
    route_ids: object = None,
    route_w: object = None,
    n_slots: int = 0,
    expert_rows: int = 0,
) -> None:
    """Launch matvec_kernel (for the launchers below and pycalm.kernels.moe's). wa, wb: stored
    weights (a pycalm.model.formats.Quantized for q8 / q4; wb is wa except for GATE); norm_w None: no
    fused RMSNorm. n_slots > 0: wa, wb are expert stacks viewed as (n_experts * expert_rows,
    cols), the slots' experts route_ids (n_slots,) int32 and GATE's weights route_w (n_slots,)
    float32, device arrays."""
    if isinstance(wa, Quantized) != (dtype in ("q8", "q4")) or isinstance(wb, Quantized) != isinstance(
        wa, Quantized
    ):
        raise PycalmError(
            f"matvec: {dtype} weights come as {'codes and scales' if dtype[0] == 'q' else 'one array'}"
        )
    wa, sa = codes_and_scales(wa, dtype, x)
    wb, sb = codes_and_scales(wb, dtype, x)
    nbytes = load_bytes(wa, dtype)
    cols = x.shape[0] // (n_slots if n_slots and mode == RESIDUAL else 1)
    if mode == GATE and cols > XCHUNK:
        raise PycalmError(f"ffn_gate: dim {cols} is above the {XCHUNK} columns one block stages")
    if n_slots and mode == PLAIN:
        raise PycalmError("expert slots run GATE (w1, w3) and RESIDUAL (w2) launches only")
    unroll = UNROLL if nbytes == 16 else 1
    split = split_for(dtype, mode, cols // (nbytes // 4 * PART_WEIGHTS[dtype]) // WARP, n_slots > 0)
    kernel = matvec_kernel(dtype, nbytes, ROWS, unroll, split, n_slots > 0)
    rows = expert_rows if n_slots else wa.shape[0]  # rows of one matrix (a slot's expert)
    n_groups = -(-rows // (ROWS // 2)) if mode == GATE else -(-rows // ROWS)
    if not n_slots:  # dense: arrays of the right types that the dense kernel never reads
        route_ids, route_w = x.view(np.int32), x
    normed = norm_w is not None
    args = (
        word_view(wa, nbytes), word_view(wb, nbytes), sa, sb, x, x.view(np.uint64), norm_w if normed else x,
        np.float32(eps), out, np.int32(mode), np.int32(normed), route_ids, route_w, np.int32(n_slots),
        np.int32(expert_rows),
    )  # fmt: skip
    blocks, threads = row_group_launch(kernel, args, n_groups, -(-cols // XCHUNK), split)
    kernel[blocks, threads, stream](*args)


def matvec(
    w: object, x: object, y: object, dtype: str, *, stream: object, norm_w: object = None, eps: float = 0.0
) -> None:
    """y = W x, or y = W (rmsnorm(x) * norm_w) when norm_w is given (the final classifier).
    w: stored (rows, cols) device array (q8 / q4: a Quantized of them), x (cols,) float32, y
    (rows,) float32."""
    launch_matvec(w, w, x, norm_w, eps, y, dtype, PLAIN, stream=stream)


def matvec_residual(w: object, x: object, r: object, dtype: str, *, stream: object) -> None:
    """r += W x (wo and w2: the residual add fused). w: stored (rows, cols) (q8 / q4: a
    Quantized), x (cols,), r (rows,)."""
    launch_matvec(w, w, x, None, 0.0, r, dtype, RESIDUAL, stream=stream)


def ffn_gate(
    w1: object, w3: object, x: object, h: object, dtype: str, *, stream: object, norm_w: object, eps: float
) -> None:
    """h = silu(W1 xn) * (W3 xn), xn = rmsnorm(x) * norm_w. w1, w3: stored (hidden_dim, dim),
    both in `dtype` (q8 / q4: Quantized), x, norm_w (dim,), h (hidden_dim,) float32."""
    launch_matvec(w1, w3, x, norm_w, eps, h, dtype, GATE, stream=stream)
