"""Matrix-vector products with fp16 / fp8 e5m2 / gf4 weights, and their fusions.

  matvec:           y = W x
  matvec_residual:  r += W x         (wo and w2: the residual add fused into the product)
  ffn_gate:         h = silu(W1 x) * (W3 x)   (the SiLU gate fused into w1/w3)

W is the stored array of pycalm.formats (float16 / uint8 / uint32 groups of 8); x, y float32.
"""

from __future__ import annotations

import numpy as np

from pycalm import formats


def matvec_ref(w: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """w: stored (rows, cols) in `dtype`, x: (cols,) float32 -> (rows,) float32."""
    return (formats.decode(w, dtype) @ x.astype(np.float32)).astype(np.float32)


def matvec_residual_ref(w: np.ndarray, x: np.ndarray, dtype: str, residual: np.ndarray) -> np.ndarray:
    """residual + W x."""
    return (residual + matvec_ref(w, x, dtype)).astype(np.float32)


def silu_ref(x: np.ndarray) -> np.ndarray:
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def ffn_gate_ref(w1: np.ndarray, w3: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """silu(W1 x) * (W3 x): (hidden_dim,) float32."""
    return (silu_ref(matvec_ref(w1, x, dtype)) * matvec_ref(w3, x, dtype)).astype(np.float32)


# =============================================================================================
# GPU kernels
#
# Thread mapping. A warp computes the dot products of R weight rows with the same x (a "row
# group": rows R g .. R g + R - 1 of one matrix for matvec / matvec_residual, rows (R/2) g ..
# of W1 and the same rows of W3 for ffn_gate), so every x value read from shared memory serves R
# rows and the epilogue (SiLU gate, RoPE rotation) needs no barrier. Lane l reads the 16-byte
# units l, l + 32, l + 64, ... of each row (ldg128: 8 fp16, 16 fp8 or 32 gf4 weights; a warp
# reads 512 contiguous bytes a row per load), U units a row per step, all R * U loads issued
# before the first use. The first step's loads of a group are issued before x is staged (and,
# for the next group, before this group's warp reduction), so the weights stream in meanwhile.
# Warps loop over row groups (grid-stride) in a grid sized so that every block is resident and
# every warp gets the same number of groups. Split variants (fp8 w2: split_rows) give a group to
# S consecutive warps of a block, which take its steps in turn and add their sums through shared
# memory. In a graph with programmatic edges a warp lets the next kernel launch once its last
# group's loads are in (launch_dependents), so the next launch and its first loads overlap this
# kernel's reductions and writes. Rows that are not a multiple of 16 bytes (test
# shapes) take narrow kinds (8-byte fp8, 4-byte gf4 loads).
#
# x is staged once per block in shared memory (times the RMSNorm weight when the norm is fused;
# the scalar rsqrt(mean(x^2) + eps) factors out of the dot product and is applied at the end),
# as uint64 pairs of floats transposed by load: xs[p * CW + j] = (x[j E + 2p], x[j E + 2p + 1])
# (E weights a load, CW loads a chunk), so one 64-bit shared load gives two x values and the 32
# lanes, reading pair p of 32 consecutive loads, read 256 contiguous bytes (no bank conflicts).
# Rows longer than XCHUNK columns are done chunk by chunk: each block stages chunk c, its warps
# add their groups' partial sums for chunk c into the output (PLAIN: the first chunk writes),
# then the next chunk is staged; one warp owns each output row, so this is deterministic.
# ffn_gate and qkv_rope need whole rows (the gate, the rotation), so their x is one chunk.
#
# Expert slots (mixture of experts, pycalm.kernels.moe): the same kernel runs the chosen experts
# of a stacked (n_experts, rows, cols) weight, slot after slot. The expert of slot s is read from
# device memory (route_ids[s], written by the routing kernel: a captured graph follows the
# routing) and only moves the row base of the loads, so the inner loop is the dense one. GATE
# writes slot s's part of h times the routing weight route_w[s] (x, staged once, serves every
# slot); RESIDUAL stages slot s's part of h as x and adds W_e h_s into the residual, the warp that
# owns a row owning it for every slot (a fixed order of the adds). A dense launch is one slot at
# row 0: the slots cost a few scalar ops a block.
#
# Decoding (pycalm.kernels.common; SASS of the inner loop on sm_90, per weight): fp16 one
# cvt.f32.f16 (HADD2.F32) and one FFMA (3.2 instructions a weight with the x loads and
# addressing); fp8 half a PRMT (two e5m2 bytes into the top bytes of two fp16), one HADD2.F32,
# one FFMA (3.2); gf4 one LOP3 (code masked and given an exponent), one exact FADD (q - 4), one
# FFMA, the group scale once a group (4.1). The shift-and-mask decoders (value * 2**-112, no
# conversion) cost 2.5 / 2.75 integer ops a weight (fp8: 4.45 instructions a weight).
#
# Bytes moved: the weights (with slots: the chosen experts' matrices only), x once (it is re-read
# per block from L2, not counted), and the output (written, or read and written for the residual).
# =============================================================================================

import functools  # noqa: E402
import math  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import NamedTuple  # noqa: E402

from numba import config as _numba_config  # noqa: E402
from numba import cuda, float32, int32, uint32, uint64  # noqa: E402

from pycalm.errors import PycalmError  # noqa: E402
from pycalm.kernels.common import (  # noqa: E402
    FP_RAW_SCALE,
    GF4_RAW_SCALE,
    WARP,
    and_or,
    as_f32,
    as_i32,
    block_reduce_sum,
    grid_dependency_wait,
    h2f2,
    launch_dependents,
    ldg128,
    prmt,
    warp_reduce_sum,
)

XCHUNK = 8192  # floats of x staged in shared memory at a time (32 KiB, as 4096 uint64 pairs)
XPAIRS = XCHUNK // 2
RED_HALF = 32 * 4  # split sums of one group a block: up to 32 warps of up to 4 rows


class Kind(NamedTuple):
    """How a kernel reads a weight format: the bytes one load brings a lane, the weights in them."""

    dtype: str  # fp16, fp8, gf4
    load_bytes: int  # 16: ldg128 (two uint64), 8: one uint64, 4: one uint32
    weights: int  # weights a load


# "fp16" / "fp8" / "gf4": 16-byte loads, used whenever a row is a multiple of 16 bytes (every real
# model shape); "fp8n" / "gf4n": the narrow fallbacks for other rows (test shapes); "fp16n" and
# "gf4m": 8-byte loads, for the benchmark's comparison only
KINDS = {
    "fp16": Kind("fp16", 16, 8),
    "fp8": Kind("fp8", 16, 16),
    "gf4": Kind("gf4", 16, 32),
    "fp8n": Kind("fp8", 8, 8),
    "gf4n": Kind("gf4", 4, 8),
    "fp16n": Kind("fp16", 8, 4),
    "gf4m": Kind("gf4", 8, 16),
}
_NARROW = {"fp16": "fp16n", "fp8": "fp8n", "gf4": "gf4m"}
# weights in one int32 part of a load
_PART_WEIGHTS = {"fp16": 2, "fp8": 4, "gf4": 8}

# modes of the matvec kernel family (a runtime argument: one compiled kernel serves all three)
PLAIN, RESIDUAL, GATE = 0, 1, 2


class Variant(NamedTuple):
    """Compile-time shape of the inner loop (R, U, PF, wide) and the launch shape."""

    rows: int = 2  # R: rows a warp (1, 2 or 4; GATE takes 2 at least)
    unroll: int = 2  # U: loads a row a lane per step
    prefetch: bool = False  # PF: issue the next step's loads before this step's arithmetic
    n_warps: int = 8  # warps a block
    blocks_per_sm: int = 8  # grid cap: blocks an SM (also capped by the kernel's occupancy)
    wide: bool = True  # 16-byte loads where the rows allow them (False: 8 bytes, a comparison)
    cvt: bool = True  # fp16 / fp8: decode with cvt.f32.f16 (HADD2.F32) instead of shifts and masks
    early: bool = True  # issue a group's first loads before staging x / reducing the last group
    direct: bool = False  # x from global memory, no staging (launches without a fused norm only)
    split: int = 1  # S: warps that share a row group, each taking every S-th step of its loads
    max_regs: int = 0  # registers a thread at most (0: ptxas's choice), for more warps an SM


# per weight dtype; scripts/bench_kernels.py times the alternatives on the GPU. Measured on the
# H200 (CUDA graph of back-to-back launches, GB/s at 14336x4096 / 4096x14336 / 4096x4096):
#   fp16 R2 U2 w16: 3610 / 3580 / 2788   (8-byte loads: 3553 / 2764 / 2351; shift decode -2..5%)
#   fp8  R2 U2 w16: 2990 / 2648 / 1830   (R2 U4: 3026 / 2575 / 1601; loads after staging: 2525)
#   gf4  R2 U2 w16: 1574 / 1291 / 899    (R4 U1 prefetch: 1618 / 983 / 785; R4 U2: 1593 / 1015)
DEFAULT_VARIANT = {
    "fp16": Variant(2, 2, n_warps=16),
    "fp8": Variant(2, 2, n_warps=16),
    "gf4": Variant(2, 2, n_warps=16),
}
FALLBACK_VARIANT = Variant(2, 1, False)  # the narrow kinds (test shapes)
# under the CUDA simulator every thread is a Python thread: small blocks keep idle ones few, and
# few blocks (the warps loop over the row groups) keep the per-block start-up cost down
SIM_WARPS = 2
SIM_BLOCKS = 2


def row_scale(dtype: str, cvt: bool) -> float:
    """What a row's raw sum is multiplied by: the 2**112 of the shift decoders of fp16 / e5m2
    (1 with cvt, which gives the values), for gf4 -2**110 (2**112 / 4 and the minus of -s/4)."""
    if dtype == "gf4":
        return GF4_RAW_SCALE
    return 1.0 if cvt else FP_RAW_SCALE


# ---------------------------------------------------------------------------------------------
# device code, generated per (kind, R, U, PF): the R rows' accumulators and the R * U loaded
# words are plain local variables (registers), which numba cannot index by a loop variable, so
# the unrolled bodies are written out as source once and compiled.


_MASK_E5M2 = 0x8FE00000 - (1 << 32)  # int32: sign and the 5 + 2 e5m2 bits after the >> 3
_MASK_FP16 = 0x8FFFE000 - (1 << 32)  # int32: sign and the 5 + 10 fp16 bits after the >> 3
# gf4 codes 0..4 in place (bits 8 + 3k) and codes 5..7 after >> 12: (mask, exponent word, the
# float 2**(23-p) + 4 that the exact subtraction removes), see pycalm.kernels.common
_GF4_CODES = [
    (0x700, 142 << 23, 2.0**15 + 4.0),
    (0x3800, 139 << 23, 2.0**12 + 4.0),
    (0x1C000, 136 << 23, 2.0**9 + 4.0),
    (0xE0000, 133 << 23, 2.0**6 + 4.0),
    (0x700000, 130 << 23, 2.0**3 + 4.0),
    (0x3800, 139 << 23, 2.0**12 + 4.0),
    (0x1C000, 136 << 23, 2.0**9 + 4.0),
    (0xE0000, 133 << 23, 2.0**6 + 4.0),
]


def _sar_mask(expr: str, shl: int, mask: int) -> str:
    """as_f32(((expr << shl) >> 3) & mask) on int32, each step wrapped in int32() (real numba
    computes int32 op int32 in int64; the casts make it 32-bit, see pycalm.kernels.common)."""
    v = f"int32({expr} << int32({shl}))" if shl else expr
    return f"as_f32(int32(int32({v} >> int32(3)) & int32({mask})))"


def _part_lines(dtype: str, cvt: bool, acc: str, xk: list[str]) -> list[str]:
    """Lines adding the weights of the int32 `t` (2 fp16, 4 e5m2 or one gf4 group) times the x
    values xk to the raw sum acc. The decoders of pycalm.kernels.common, written out: the
    kernels are generated source, and inlining hundreds of device-function calls made numba's
    compile take minutes."""
    if dtype == "fp16" and cvt:
        return ["f0, f1 = h2f2(t)", f"{acc} += f0 * {xk[0]}", f"{acc} += f1 * {xk[1]}"]
    if dtype == "fp16":
        return [
            f"{acc} += {_sar_mask('t', 16, _MASK_FP16)} * {xk[0]}",
            f"{acc} += {_sar_mask('t', 0, _MASK_FP16)} * {xk[1]}",
        ]
    if dtype == "fp8" and cvt:
        return [
            "f0, f1 = h2f2(prmt(t, int32(0), int32(0x1404)))  # bytes 0, 1 -> top bytes of two fp16",
            "f2, f3 = h2f2(prmt(t, int32(0), int32(0x3424)))  # bytes 2, 3",
        ] + [f"{acc} += f{k} * {xk[k]}" for k in range(4)]
    if dtype == "fp8":
        return [f"{acc} += {_sar_mask('t', 24 - 8 * k, _MASK_E5M2)} * {xk[k]}" for k in range(4)]
    lines = ["u = int32(t >> int32(12))  # codes 5..7 moved down so that their mantissa fits"]
    for k, (mask, e, c) in enumerate(_GF4_CODES):
        src = "t" if k < 5 else "u"
        term = f"(as_f32(and_or({src}, int32({mask}), int32({e}))) - float32({c!r})) * {xk[k]}"
        lines.append(f"g {'=' if k == 0 else '+='} {term}")
    lines.append(f"{acc} += g * {_sar_mask('t', 24, _MASK_E5M2)}  # the group's raw e5m2 scale")
    return lines


def _word_lines(
    kind: str, n_rows: int, cvt: bool, j: str, words: list[str], ind: str, direct: bool = False
) -> list[str]:
    """Lines adding load j (chunk-local) of R rows (words[r]: what the load returned) times x to
    the raw sums a0.. Part by part (an int32 of every row at a time): the part's x values are
    loaded once (64-bit shared loads, or with `direct` 64-bit global loads of x itself, which L1
    serves after the first warp) for all R rows, and only they are live, which keeps the
    register count (and so the warps an SM holds) where it is with one row."""
    dtype, nbytes, e_w = KINDS[kind]
    cw = XCHUNK // e_w
    pw = _PART_WEIGHTS[dtype]
    src = []
    for r in range(n_rows):
        if nbytes == 16:
            src.append(f"lo{r}, hi{r} = {words[r]}")
    n_parts = {16: 4, 8: 2, 4: 1}[nbytes]
    for i in range(n_parts):
        for p in range(pw * i // 2, pw * (i + 1) // 2):
            if direct:  # xs is x64 itself: pair p of load j0 + j
                src.append(f"v = xs[(j0 + {j}) * uint64({e_w // 2}) + uint64({p})]")
            else:
                src.append(f"v = xs[{j} + uint64({p * cw})]")
            src.append(f"x{2 * p} = as_f32(v)")
            src.append(f"x{2 * p + 1} = as_f32(v >> uint64(32))")
        for r in range(n_rows):
            w = f"lo{r}" if nbytes == 16 and i < 2 else f"hi{r}" if nbytes == 16 else words[r]
            part = w if i % 2 == 0 else f"{w} >> uint64(32)"
            src.append(f"t = int32({part})")
            src += _part_lines(dtype, cvt, f"a{r}", [f"x{pw * i + k}" for k in range(pw)])
    return [ind + ln for ln in src]


def _load(kind: str, r: int, at: str) -> str:
    return f"ldg128(m{r}, r{r}, {at})" if KINDS[kind].load_bytes == 16 else f"m{r}[r{r}, {at}]"


def _preload_source(kind: str, n_rows: int, unroll: int) -> str:
    """preload(m0, r0, .., j0, n, lane) -> the first step's R * U loads (indices clamped to the
    row, so always valid; group_dot uses them only when the step is whole). Issued before x is
    staged or the previous group reduced, so the weights stream in meanwhile."""
    rr = range(n_rows)
    src = [f"def preload({', '.join(f'm{r}, r{r}' for r in rr)}, j0, n, lane):"]
    src += [f"    r{r} = uint64(r{r})" for r in rr]
    src += ["    j0 = uint64(j0)", "    last = uint64(n - 1)"]
    for u in range(unroll):
        src.append(f"    j = min(uint64(lane + {WARP * u}), last)")
        src += [f"    c{r}_{u} = {_load(kind, r, 'j0 + j')}" for r in rr]
    src.append("    return (" + ", ".join(f"c{r}_{u}" for u in range(unroll) for r in rr) + ",)")
    return "\n".join(src)


def _group_dot_source(
    kind: str,
    n_rows: int,
    unroll: int,
    prefetch: bool,
    cvt: bool,
    early: bool,
    direct: bool = False,
    split: int = 1,
) -> str:
    """group_dot(c.., m0, r0, .., xs, j0, n, lane) -> (a0, ..): this lane's raw partial sums of
    row r_r of matrix m_r over loads j0 .. j0 + n - 1, x staged in xs (chunk-local load index);
    c..: the first step's loads, from preload() (early), or none (loaded here). lane: the
    lane's first load; with split S, warp p of the S that share the group passes lane + p U 32
    and the S warps take the steps of U 32 loads in turn (a step of S U 32 loads a warp)."""
    rr = range(n_rows)
    accs = ", ".join(f"a{r}" for r in rr)
    cs = ", ".join(f"c{r}_{u}" for u in range(unroll) for r in rr)
    args = ", ".join(f"m{r}, r{r}" for r in rr)
    src = [f"def group_dot({cs + ', ' if early else ''}{args}, xs, j0, n, lane):"]
    src += [f"    a{r} = float32(0.0)" for r in rr]
    # unsigned indices: numba adds no negative-index wraparound code for them
    src += [f"    r{r} = uint64(r{r})" for r in rr]
    src += ["    j = uint64(lane)", "    j0 = uint64(j0)", "    n = uint64(n)"]
    span = f"uint64({WARP * (unroll - 1)})"
    step = f"uint64({WARP * unroll * split})"

    def loads(prefix: str, at: str, ind: str) -> list[str]:
        return [
            f"{ind}{prefix}{r}_{u} = {_load(kind, r, f'j0 + {at} + uint64({WARP * u})')}"
            for u in range(unroll)
            for r in rr
        ]

    def steps(prefix: str, ind: str) -> list[str]:
        out = []
        for u in range(unroll):
            out += _word_lines(
                kind, n_rows, cvt, f"(j + uint64({WARP * u}))", [f"{prefix}{r}_{u}" for r in rr], ind, direct
            )
        return out

    src.append(f"    if j + {span} < n:  # the first step: the preloaded words")
    if not early:
        src += loads("c", "j", "        ")
    if not prefetch:
        src += steps("c", "        ")
        src.append(f"        j += {step}")
        src.append(f"        while j + {span} < n:")
        src += loads("c", "j", "            ")  # all R * U loads before the first use
        src += steps("c", "            ")
        src.append(f"            j += {step}")
    else:
        src.append("        while True:")
        src.append(f"            jn = j + {step}")
        src.append(f"            more = jn + {span} < n")
        src.append("            jl = jn if more else j  # past the end: a harmless reload")
        src += loads("p", "jl", "            ")  # the next step's loads, issued first
        src += steps("c", "            ")
        src.append("            j = jn")
        src.append("            if not more:")
        src.append("                break")
        src += [f"            c{r}_{u} = p{r}_{u}" for u in range(unroll) for r in rr]
    src.append("    while j < n:  # the last loads, one a step")
    src += [f"        e{r} = {_load(kind, r, 'j0 + j')}" for r in rr]
    src += _word_lines(kind, n_rows, cvt, "j", [f"e{r}" for r in rr], "        ", direct)
    src.append(f"        j += uint64({WARP})")
    src.append(f"    return ({accs},)  # a tuple even for one row")
    return "\n".join(src)


def _compile_source(src: str, name: str, env: dict) -> object:
    """exec a generated function and wrap it as an inlined numba device function."""
    scope = dict(env)
    exec(compile(src, f"<pycalm.kernels.matvec generated {name}>", "exec"), scope)  # noqa: S102
    return cuda.jit(device=True, inline=True)(scope[name])


_ENV = {
    "uint64": uint64,
    "int32": int32,
    "float32": float32,
    "as_f32": as_f32,
    "ldg128": ldg128,
    "h2f2": h2f2,
    "prmt": prmt,
    "and_or": and_or,
}


@functools.cache
def make_group_dot(*shape: object):  # noqa: ANN201
    """-> device fn group_dot(m0, r0, .., m_{R-1}, r_{R-1}, xs, j0, n_loads, lane) -> R raw sums
    (times row_scale(dtype, cvt) for the values). shape: _group_dot_source's arguments (kind,
    n_rows, unroll, prefetch, cvt, early[, direct[, split]]), one compile for each."""
    return _compile_source(_group_dot_source(*shape), "group_dot", _ENV)


@functools.cache
def make_preload(kind: str, n_rows: int, unroll: int):  # noqa: ANN201
    """-> device fn preload(m0, r0, .., j0, n_loads, lane) -> the first step's loads (a tuple)."""
    return _compile_source(_preload_source(kind, n_rows, unroll), "preload", _ENV)


def _stage_source(kind: str) -> str:
    """stage_x(x64, norm_w, xs, c0, n, normed) -> this thread's sum of x^2 over what it staged
    (0 unless normed): every thread takes loads j = tid, tid + blockDim, .. of the chunk and
    copies their E/2 float pairs (E/2 consecutive uint64 of x64, all loads issued together) to
    the slots xs[p * CW + j]: consecutive threads store consecutive slots (no bank conflicts),
    and no division is needed. The sum of squares lets staged_rms() finish the RMSNorm factor
    with no second pass over x."""
    e_w = KINDS[kind].weights
    cw = XCHUNK // e_w
    src = [
        "def stage_x(x64, norm_w, xs, c0, n, normed):",
        "    ss = float32(0.0)",
        f"    for j in range(cuda.threadIdx.x, n // {e_w}, cuda.blockDim.x):",
        f"        b = c0 // 2 + j * {e_w // 2}  # x64 index of the load's first pair",
    ]
    src += [f"        v{p} = x64[b + {p}]" for p in range(e_w // 2)]
    src.append("        if normed:")
    src += [f"            ss += _pair_sq(v{p})" for p in range(e_w // 2)]
    src += [f"            v{p} = _pair_times(v{p}, norm_w, 2 * (b + {p}))" for p in range(e_w // 2)]
    src += [f"        xs[j + {p * cw}] = v{p}" for p in range(e_w // 2)]
    src.append("    return ss")
    return "\n".join(src)


@functools.cache
def make_stage_x(kind: str):  # noqa: ANN201
    """-> device fn stage_x(x64, norm_w, xs, c0, n, normed) that copies x[c0 : c0 + n] into xs as
    transposed float pairs (times norm_w when `normed`). x64 is x viewed as uint64 pairs: one
    8-byte load is one slot. All threads of the block call it; the caller puts the barriers
    around it. n is a multiple of the weights a load (rows of every kind are)."""
    return _compile_source(
        _stage_source(kind),
        "stage_x",
        {**_ENV, "cuda": cuda, "_pair_times": _pair_times, "_pair_sq": _pair_sq},
    )


@cuda.jit(device=True, inline=True)
def _pair_times(v: int, norm_w: cuda.devicearray, i: int) -> int:
    """A uint64 pair of floats (x[i], x[i + 1]) times (norm_w[i], norm_w[i + 1]), repacked."""
    lo = as_f32(v) * norm_w[i]
    hi = as_f32(v >> uint64(32)) * norm_w[i + 1]
    return uint64(uint32(as_i32(lo))) | (uint64(uint32(as_i32(hi))) << uint64(32))


@cuda.jit(device=True, inline=True)
def _pair_sq(v: int) -> float:
    """x[i]^2 + x[i + 1]^2 of a uint64 pair of floats."""
    lo = as_f32(v)
    hi = as_f32(v >> uint64(32))
    return lo * lo + hi * hi


@cuda.jit(device=True, inline=True)
def staged_rms(ss: float, n: int, eps: float, scratch: cuda.devicearray) -> float:
    """rsqrt(mean(x^2) + eps) from every thread's stage_x sum of squares over all n values of
    x. Its barrier also publishes what stage_x wrote to shared memory, so a kernel pays no
    extra pass over x and no extra barrier for a fused RMSNorm. All threads must call it."""
    ss = warp_reduce_sum(ss)
    if cuda.threadIdx.x % WARP == 0:
        scratch[cuda.threadIdx.x // WARP] = ss
    cuda.syncthreads()  # the warps' sums, and the staged x, are in shared memory
    t = float32(0.0)
    for w in range(cuda.blockDim.x // WARP):
        t += scratch[w]
    return float32(1.0) / math.sqrt(t / float32(n) + float32(eps))


@cuda.jit(device=True, inline=True)
def rms_factor(x: cuda.devicearray, eps: float, scratch: cuda.devicearray) -> float:
    """rsqrt(mean(x^2) + eps) over the whole of x, computed by the whole block (each block
    recomputes it: x is small and in L2). Contains barriers: all threads must call it."""
    s = float32(0.0)
    for i in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        v = x[i]
        s += v * v
    s = block_reduce_sum(s, scratch)
    return float32(1.0) / math.sqrt(s / float32(x.shape[0]) + float32(eps))


@cuda.jit(device=True, inline=True)
def silu_gate(a: float, b: float) -> float:
    """silu(a) * b in float32."""
    return a / (float32(1.0) + math.exp(-a)) * b


def _matvec_source(
    n_rows: int, unroll: int, early: bool, slots: bool, direct: bool = False, split: int = 1
) -> str:
    """The matvec family kernel for R rows a warp (mode and normed are runtime arguments).
    slots: the expert-slot kernel (pycalm.kernels.moe). The dense kernel is generated without
    the slot loop (slot and base the constant 0), so its code is what it was before slots: a
    runtime slot loop cost it 8 registers. direct: x read from global memory (L1) instead of
    staged in shared memory: no shared memory, no barrier, one whole row a group; for the
    launches without a fused norm (wo, w2), where a block's staging is pure latency. split S:
    S consecutive warps of a block share each row group (see group_dot), and add their sums
    through shared memory in a fixed order (one barrier a group; the loop is block-uniform)."""
    if direct and split > 1:
        raise PycalmError("a direct matvec variant has no shared memory to add split sums in")
    rr = range(n_rows)
    first = "first" if split > 1 else "lane"  # the lane's first load of a step
    who, teams = ("team", "n_teams") if split > 1 else ("warp", "n_warps")
    half = n_rows // 2
    accs = ", ".join(f"a{r}" for r in rr)
    cs = ", ".join(f"c{r}_{u}" for u in range(unroll) for r in rr)
    # PLAIN / RESIDUAL pass wb = wa, so the second half of the rows may always come from wb
    mats = ", ".join(f"{'wa' if i < half else 'wb'}, r{i}" for i in rr)

    def rows_of(g: str, ind: str) -> list[str]:
        # GATE: rows (R/2) g + i of W1 and of W3; otherwise rows R g + i; clamped to the matrix
        # for the loads; base: the matrix's first row in the stack (dense: 0). R1 has no GATE
        # (the launcher gives GATE two rows a warp at least)
        if n_rows == 1:
            return [f"{ind}r0 = base + min({g}, rows - 1)"]
        out = [f"{ind}if mode == GATE:"]
        out += [f"{ind}    r{i} = base + min({half} * {g} + {i % half}, rows - 1)" for i in rr]
        out.append(f"{ind}else:")
        out += [f"{ind}    r{i} = base + min({n_rows} * {g} + {i}, rows - 1)" for i in rr]
        return out

    src = [
        "def matvec_kernel(wa, wb, x, x64, norm_w, eps, out, mode, normed, route_ids, route_w, n_slots,",
        "                  expert_rows):",
    ]
    if direct:
        src += ["    xs = x64  # x itself, read through L1"]
    else:
        src += [
            "    xs = cuda.shared.array(XPAIRS, uint64)  # x chunk as float pairs, transposed by word",
            "    scratch = cuda.shared.array(32, float32)  # block reduction",
        ]
    src += [
        "    lane = cuda.threadIdx.x % WARP",
        "    warp = cuda.threadIdx.x // WARP",
        "    n_warps = cuda.blockDim.x // WARP",
    ]
    if split > 1:
        src += [
            f"    team = warp // {split}  # the warps of a row group: {split} consecutive ones",
            f"    part = warp - team * {split}",
            f"    first = lane + part * {WARP * unroll}",
            f"    n_teams = n_warps // {split}",
            f"    red = cuda.shared.array({2 * RED_HALF}, float32)  # the parts' sums, two groups' worth",
            "    rb = 0  # the half of red this group uses",
        ]
    if slots:
        src.append("    grid_dependency_wait()  # route_ids, x and out come from earlier kernels")
        src.append("    launch_dependents()  # now the next kernel may launch and load its weights")
    if slots:
        src += [
            "    rows = expert_rows  # rows of one expert's matrix",
            "    # GATE: x is shared by the slots; RESIDUAL: x holds one vector a slot (h of each expert)",
            "    cols = x.shape[0] // n_slots if mode == RESIDUAL else x.shape[0]",
        ]
    else:
        src += ["    rows = wa.shape[0]", "    cols = x.shape[0]"]
    src += [
        "    n_words = wa.shape[1] // UNIT  # loads a row",
        (
            f"    n_groups = (rows + {half - 1}) // {half} if mode == GATE else (rows + {n_rows - 1}) // {n_rows}"
            if n_rows > 1
            else "    n_groups = rows"
        ),
        f"    stride = cuda.gridDim.x * {teams}",
        "    scale = float32(ROW_SCALE)",
        "    n_chunks = 1" if direct else "    n_chunks = (cols + XCHUNK - 1) // XCHUNK",
    ]
    if slots:
        src += [
            "    for t in range(n_slots * n_chunks):  # (slot, chunk) pairs, slot by slot",
            "        slot = t // n_chunks",
            "        c = t - slot * n_chunks",
            "        base = route_ids[slot] * rows  # read on the device: a captured graph follows the routing",
            "        gw = route_w[slot] if mode == GATE else float32(1.0)  # the routing weight",
        ]
    else:
        src += [
            "    slot = 0",
            "    base = 0",
            "    gw = float32(1.0)",
            "    for c in range(n_chunks):",
        ]
    body = [
        "c0 = c * XCHUNK",
        "j0 = c * CW",
        "nw = n_words" if direct else "nw = min(CW, n_words - j0)",
        f"g = cuda.blockIdx.x * {teams} + {who}",
    ]
    body += rows_of("min(g, n_groups - 1)", "")
    if early:
        body.append(f"{cs}, = preload({mats}, j0, nw, {first})  # streams in while x is staged")
    if not slots:
        body += [
            "if c == 0:  # x and out come from earlier kernels: read them after they finish",
            "    grid_dependency_wait()  # (the weights' first loads above are already in flight)",
        ]
    if not direct:
        body += [
            "if slot == 0 or mode != GATE:  # GATE: x is one chunk, staged once for every slot",
            "    cuda.syncthreads()  # every warp is done with the previous chunk of xs",
            "    ss = stage_x(x64, norm_w, xs, slot * cols + c0, min(XCHUNK, cols - c0), normed)",
            "    if normed and n_chunks == 1:  # all of x staged: its sum of squares is complete",
            "        scale = float32(ROW_SCALE) * staged_rms(ss, cols, eps, scratch)  # its barrier publishes xs",
            "    else:",
            "        if normed and slot == 0 and c == 0:  # x longer than a chunk: a pass of its own",
            "            scale *= rms_factor(x, eps, scratch)  # contains barriers",
            "        cuda.syncthreads()  # xs holds this chunk for every warp",
        ]
    body += [
        "while g - team < n_groups:  # block-uniform: every warp reaches the barrier below"
        if split > 1
        else "while g < n_groups:  # warp-uniform: the shuffles below see every lane",
        f"    {accs}, = group_dot({cs + ', ' if early else ''}{mats}, xs, j0, nw, {first})",
        "    gn = g + stride",
    ]
    if not slots:  # (the slot kernel lets the next launch right after its wait)
        body.append("    if gn >= n_groups:  # this warp's last weights are in: the next kernel may launch")
        body.append("        launch_dependents()  # (and load its own while this one reduces and writes)")
    body += rows_of("min(gn, n_groups - 1)", "    ")
    if early:
        body.append(f"    {cs}, = preload({mats}, j0, nw, {first})  # the next group's first step")
    if split == 1:
        body += [f"    a{i} = warp_reduce_sum(a{i}) * scale  # every lane gets the row sum" for i in rr]
        body.append("    if lane == 0:")
    else:
        body += [f"    a{i} = warp_reduce_sum(a{i})  # every lane gets the part's sum" for i in rr]
        body.append("    if lane == 0:")
        body += [f"        red[rb + warp * {n_rows} + {i}] = a{i}" for i in rr]
        body.append("    cuda.syncthreads()  # every part's sums of the block's groups are in red")
        for i in rr:
            terms = " + ".join(f"red[rb + (team * {split} + {p}) * {n_rows} + {i}]" for p in range(split))
            body.append(f"    a{i} = ({terms}) * scale  # the parts in a fixed order")
        body.append(f"    rb = {RED_HALF} - rb  # the next group writes the other half (no second barrier)")
        body.append("    if lane == 0 and part == 0:")
    body.append("        if mode == GATE:  # slot s writes its part of out, times its routing weight")
    if n_rows == 1:
        body.append("            pass  # R1: no GATE launches")
    for i in range(half):
        body.append(f"            if {half} * g + {i} < rows:")
        body.append(
            f"                out[slot * rows + {half} * g + {i}] = silu_gate(a{i}, a{i + half}) * gw"
        )
    # one warp owns each output row through every chunk and slot: a fixed order of the adds
    body.append("        else:")
    for i in rr:
        body.append(f"            if {n_rows} * g + {i} < rows:")
        body.append("                if mode == RESIDUAL or slot > 0 or c > 0:")
        body.append(f"                    out[{n_rows} * g + {i}] += a{i}")
        body.append("                else:")
        body.append(f"                    out[{n_rows} * g + {i}] = a{i}")
    body.append("    g = gn")
    return "\n".join(src + ["        " + ln for ln in body])


@functools.cache
def matvec_kernel_for(  # noqa: ANN201
    kind: str,
    n_rows: int,
    unroll: int,
    prefetch: bool,
    cvt: bool,
    early: bool,
    slots: bool = False,
    direct: bool = False,
    split: int = 1,
    max_regs: int = 0,
):
    """The matvec family kernel (compiled by numba on first launch) for a weight kind and inner
    loop shape. Arguments: wa, wb (rows, units) word arrays (wb = wa except for GATE); x (cols,)
    float32; norm_w (cols,) float32 (read only when normed); eps float32; out float32;
    mode (PLAIN: out = W x, RESIDUAL: out += W x, GATE: out = silu(Wa x) * (Wb x)); normed;
    route_ids (int32), route_w (float32), n_slots, expert_rows: the expert slots, read only by
    the kernel compiled with `slots` (the dense one takes them and never reads them: any arrays
    of the right types will do).

    Slots (mixture of experts): wa, wb are stacks of experts viewed as (n_experts * expert_rows,
    units); slot s uses the expert_rows rows from route_ids[s] * expert_rows (read from device
    memory, so a captured graph follows the routing). GATE: out[s * expert_rows + r] =
    route_w[s] * silu(Wa_e x) * (Wb_e x), x shared by the slots; RESIDUAL: out += W_e x_s with
    x_s = x[s * cols : (s + 1) * cols], the slots one after another (one warp owns a row)."""
    k = KINDS[kind]
    env = {
        **_ENV,
        "cuda": cuda,
        "WARP": WARP,
        "XPAIRS": XPAIRS,
        "XCHUNK": XCHUNK,
        "CW": XCHUNK // k.weights,  # loads a chunk
        "UNIT": max(1, k.load_bytes // 8),  # array elements a load (n_units = shape[1] // UNIT)
        "GATE": GATE,
        "RESIDUAL": RESIDUAL,
        "ROW_SCALE": row_scale(k.dtype, cvt),
        "rms_factor": rms_factor,
        "silu_gate": silu_gate,
        "warp_reduce_sum": warp_reduce_sum,
        "stage_x": make_stage_x(kind),
        "staged_rms": staged_rms,
        "grid_dependency_wait": grid_dependency_wait,
        "launch_dependents": launch_dependents,
        "group_dot": make_group_dot(kind, n_rows, unroll, prefetch, cvt, early, direct, split),
        "preload": make_preload(kind, n_rows, unroll),
    }
    scope = dict(env)
    name = f"matvec_kernel_{kind}_r{n_rows}u{unroll}{'p' if prefetch else ''}{'c' if cvt else ''}{'e' if early else ''}"
    name += ("_slots" if slots else "") + ("_direct" if direct else "") + (f"_s{split}" if split > 1 else "")
    name += f"_m{max_regs}" if max_regs else ""
    exec(
        compile(
            _matvec_source(n_rows, unroll, early, slots, direct, split),
            f"<pycalm.kernels.matvec generated {name}>",
            "exec",
        ),
        scope,
    )  # noqa: S102
    fn = scope["matvec_kernel"]
    fn.__name__ = fn.__qualname__ = name
    return cuda.jit(max_registers=max_regs)(fn) if max_regs else cuda.jit(fn)


def kernel_for_variant(kind: str, v: Variant, slots: bool = False):  # noqa: ANN201
    """The matvec family kernel that runs variant v on weights of this kind (slots: the
    expert-slot kernel, see matvec_kernel_for)."""
    return matvec_kernel_for(
        kind,
        v.rows,
        v.unroll,
        v.prefetch,
        v.cvt and KINDS[kind].dtype != "gf4",
        v.early,
        slots,
        v.direct,
        v.split,
        v.max_regs,
    )


def weight_kind(w: object, dtype: str, wide: bool = True) -> tuple[object, str]:
    """A stored weight array (device) -> (its view for the kernels, the kind they read it as).
    16-byte loads need rows of a multiple of 16 bytes; other rows take the narrow kinds."""
    if dtype not in ("fp16", "fp8", "gf4"):
        raise PycalmError(f"unsupported weight dtype {dtype!r} (one of fp16, fp8, gf4)")
    row_bytes = w.shape[1] * w.dtype.itemsize
    if row_bytes % 16 == 0:
        kind = dtype if wide else _NARROW[dtype]
    else:
        kind = {"fp16": "fp16n", "fp8": "fp8n", "gf4": "gf4n"}[dtype]  # fp16 rows never get here
    return w.view(np.uint32 if KINDS[kind].load_bytes == 4 else np.uint64), kind


def variant_for(kind: str, variant: Variant | None) -> Variant:
    """The variant a kind runs: the narrow fallbacks keep one small shape (test sizes only)."""
    v = variant or DEFAULT_VARIANT[KINDS[kind].dtype]
    if kind in ("fp8n", "gf4n"):
        v = v._replace(rows=FALLBACK_VARIANT.rows, unroll=FALLBACK_VARIANT.unroll, prefetch=False)
    return v


@functools.cache
def n_sm() -> int:
    """Streaming multiprocessors of the current GPU (132 on an H200; the simulator has none)."""
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # noqa: BLE001  (simulator: no such attribute)
        return 132


def grid_for(n_groups: int, v: Variant, resident: int | None = None) -> int:
    """Blocks for n_groups row groups: at most min(blocks_per_sm, the kernel's occupancy) an
    SM, so that every block is resident at once, and sized so that every warp loops over the
    same number of groups (no warp does one more group than the others). Under the simulator at
    most SIM_BLOCKS (the warps loop over the groups)."""
    bps = min(v.blocks_per_sm, max(1, resident)) if resident is not None else v.blocks_per_sm
    teams = v.n_warps // v.split  # the row groups a block takes at once
    per_warp = max(1, -(-n_groups // (n_sm() * bps * teams)))
    blocks = max(1, -(-n_groups // (teams * per_warp)))
    return min(blocks, SIM_BLOCKS) if _numba_config.ENABLE_CUDASIM else blocks


def fill_sms(n_groups: int, cols: int, v: Variant) -> Variant:
    """The default variant with 8 warps a block instead of 16 where 16 would leave SMs without a
    block: a 2048-row matrix in blocks of 16 warps (two rows each) is 64 blocks for 132 SMs.
    Rows longer than one x chunk keep their blocks (each block restages x per chunk). Measured
    on the H200 (scripts/bench_kernels.py --sweep), fp8 / gf4 GB/s, 16 -> 8 warps: 2048x2048
    781 -> 894 / 346 -> 382, 2560x2048 911 -> 991 / 402 -> 424; going on to 4 warps is no
    better there and worse for TinyLlama's w2: 2048x5632 1416 -> 1312 / 671 -> 582."""
    if cols > XCHUNK:
        return v
    if v.n_warps > 8 and -(-n_groups // v.n_warps) < n_sm():
        v = v._replace(n_warps=8)
    return v


MIN_WARPS, MAX_WARPS = 4, 32  # the warps a block balance_warps chooses from


def balance_warps(n_groups: int, v: Variant, resident: Callable[[int], int | None]) -> tuple[Variant, int]:
    """(v with the warps a block, MIN_WARPS..MAX_WARPS, that put the fewest row groups on the
    busiest SM with every block resident at once, the row groups a warp then takes).
    resident(threads): blocks an SM holds. Ties: fewer groups a warp (shorter chains), then
    fewer blocks (fewer x stagings)."""
    best: tuple[tuple[int, int, int], int] | None = None
    sms = n_sm()
    for w in range(MIN_WARPS, MAX_WARPS + 1):
        bps = min(v.blocks_per_sm, resident(w * WARP) or 0)
        if bps < 1:
            continue  # a block of w warps does not fit an SM (registers)
        per_warp = -(-n_groups // (sms * bps * w))
        blocks = -(-n_groups // (w * per_warp))
        busiest = -(-blocks // sms) * w * per_warp  # row groups on the busiest SM
        key = (busiest, per_warp, blocks)
        if best is None or key < best[0]:
            best = (key, w)
    return (v, 0) if best is None else (v._replace(n_warps=best[1]), best[0][1])


def launch_warps(n_groups: int, cols: int, v: Variant, resident: Callable[[int], int | None]) -> Variant:
    """The default variant's warps a block for a launch: balance_warps's where that gives every
    warp one row group, else fill_sms's rule. Rows longer than one x chunk keep their variant.
    Measured on the H200 (graph of a layer's launches, us a token): TinyLlama's qkv (1280 groups:
    fill_sms's 8 warps make 160 blocks, so 28 SMs take two; 10 warps make 128 blocks) fp8 145 ->
    130, gf4 181 -> 154, fp16 162 -> 154. For launches of several groups a warp the balanced
    shape was worse: TinyLlama's ffn_gate (5632 groups) in 22-warp blocks fp8 254 -> 277, fp16
    347 -> 363. (MoE launches have several groups a warp or long rows: unchanged.)"""
    if cols > XCHUNK or resident(v.n_warps * WARP) is None:
        return v
    balanced, per_warp = balance_warps(n_groups, v, resident)
    return balanced if per_warp == 1 else fill_sms(n_groups, cols, v)


SPLIT_LOADS = 9  # loads a lane a row from which a residual launch shares each row group by 2 warps
SPLIT_DTYPES = ("fp8",)


def split_rows(v: Variant, kind: str, mode: int, cols: int, n_slots: int) -> Variant:
    """The default variant with each row group shared by 2 warps (16 a block) for the dense
    residual launches of long rows (w2): a warp's row is then a chain of half the steps.
    Measured on the H200 (scripts/bench_kernels.py --split, fp8, us a launch, default -> split):
    TinyLlama's w2 (2048x5632) 8.46 -> 7.91, Llama-3-8B's (4096x14336) 24.35 -> 22.77; slower
    for rows of 4 loads a lane (wo 2048x2048: 5.00 -> 5.39), for the gate and the classifier
    (the barrier a group), no faster in fp16 (10.04 -> 10.06, 33.70 -> 33.91) and slower in gf4
    (9.03 -> 9.83, 23.67 -> 24.14: its decode is issue-bound)."""
    k = KINDS[kind]
    loads_a_lane = cols // k.weights // WARP
    if mode != RESIDUAL or n_slots or k.dtype not in SPLIT_DTYPES or loads_a_lane < SPLIT_LOADS:
        return v
    return v._replace(split=2, n_warps=16)


def launch_shape(
    kernel: object, args: tuple, n_groups: int, cols: int, v: Variant, tuned: bool
) -> tuple[int, int]:
    """(blocks, threads) of a row-group launch of `kernel` on `args` (the matvec family's and
    qkv's): tuned (the default variant), the warps a block from launch_warps (a split variant
    keeps its own: its warps come in groups); under the simulator SIM_WARPS (whole groups); the blocks from grid_for, or one group a warp for a direct variant."""
    resident = functools.partial(resident_blocks, kernel, args)
    if tuned and v.split == 1:
        v = launch_warps(n_groups, cols, v, resident)
    if _numba_config.ENABLE_CUDASIM:  # the kernel reads blockDim: any warp count (of whole groups)
        v = v._replace(n_warps=max(1, SIM_WARPS // v.split) * v.split)
    if v.n_warps % v.split:
        raise PycalmError(f"{v.n_warps} warps a block do not make row groups of {v.split} warps")
    n_threads = v.n_warps * WARP
    if v.direct:  # no shared memory, no barrier: one group a warp, the hardware balances the blocks
        return -(-n_groups // v.n_warps), n_threads
    return grid_for(n_groups, v, resident(n_threads)), n_threads


_RESIDENT: dict = {}


def resident_blocks(kernel: object, args: tuple, n_threads: int) -> int | None:
    """Blocks of `kernel` an SM can hold at once (registers, shared memory), from the CUDA
    occupancy calculator; compiles the kernel for args on first use. None under the simulator."""
    if _numba_config.ENABLE_CUDASIM:
        return None
    key = (kernel, n_threads)
    if key not in _RESIDENT:
        compiled = kernel._compile_for_args(*args)  # numba's own launch path does the same
        _RESIDENT[key] = compiled.max_cooperative_grid_blocks(n_threads) // n_sm()  # 0: does not fit
    return _RESIDENT[key]


def launch_family(
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
    variant: Variant | None = None,
    route_ids: object = None,
    route_w: object = None,
    n_slots: int = 0,
    expert_rows: int = 0,
) -> None:
    """Launch the matvec family kernel (the launchers below, pycalm.kernels.moe's, and the
    benchmark's variants). wa, wb: stored weight arrays (wb is wa except for GATE); norm_w None:
    no fused RMSNorm. n_slots > 0: wa, wb are expert stacks viewed as (n_experts * expert_rows,
    cols), the slots' experts are route_ids (n_slots,) int32 and GATE's weights route_w
    (n_slots,) float32, both device arrays (see matvec_kernel_for)."""
    wide = variant.wide if variant is not None else True
    wav, kind = weight_kind(wa, dtype, wide)
    wbv = wav if wb is wa else weight_kind(wb, dtype, wide)[0]
    v = variant_for(kind, variant)
    if mode == GATE and v.rows < 2:
        v = v._replace(rows=2)  # a GATE group is a row of W1 and a row of W3
    cols = x.shape[0]
    if mode == GATE and cols > XCHUNK:
        raise PycalmError(f"ffn_gate: dim {cols} is above the {XCHUNK} columns one block stages")
    if n_slots and mode == PLAIN:
        raise PycalmError("expert slots run GATE (w1, w3) and RESIDUAL (w2) launches only")
    rows = expert_rows if n_slots else wa.shape[0]  # rows of one matrix (a slot's expert)
    n_groups = -(-rows // (v.rows // 2)) if mode == GATE else -(-rows // v.rows)
    normed = norm_w is not None
    if v.direct and (normed or mode == GATE or n_slots):
        v = v._replace(direct=False)  # the direct kernel has no staging to fuse a norm into
    if variant is None:
        v = split_rows(v, kind, mode, cols, n_slots)
    kernel = kernel_for_variant(kind, v, n_slots > 0)
    x64 = x.view(np.uint64)  # float pairs: one 8-byte load a shared-memory slot
    if not n_slots:  # dense: arrays of the right types that the dense kernel never reads
        route_ids, route_w = x.view(np.int32), x
    args = (
        wav, wbv, x, x64, norm_w if normed else x, np.float32(eps), out, np.int32(mode), np.int32(normed),
        route_ids, route_w, np.int32(n_slots), np.int32(expert_rows),
    )  # fmt: skip
    grid, n_threads = launch_shape(kernel, args, n_groups, cols, v, variant is None)
    kernel[grid, n_threads, stream](*args)


def matvec(
    w: object, x: object, y: object, dtype: str, *, stream: object, norm_w: object = None, eps: float = 0.0
) -> int:
    """y = W x, or y = W rmsnorm(x) * norm_w when norm_w is given (the final classifier).
    w: stored (rows, cols) device array, x (cols,) float32, y (rows,) float32. -> bytes moved."""
    launch_family(w, w, x, norm_w, eps, y, dtype, PLAIN, stream=stream)
    return int(w.nbytes) + int(x.nbytes) + 4 * w.shape[0] + (int(norm_w.nbytes) if norm_w is not None else 0)


def matvec_residual(w: object, x: object, r: object, dtype: str, *, stream: object) -> int:
    """r += W x (wo and w2: the residual add fused). -> bytes moved (r read and written)."""
    launch_family(w, w, x, None, 0.0, r, dtype, RESIDUAL, stream=stream)
    return int(w.nbytes) + int(x.nbytes) + 8 * w.shape[0]


def ffn_gate(
    w1: object, w3: object, x: object, h: object, dtype: str, *, stream: object, norm_w: object, eps: float
) -> int:
    """h = silu(W1 xn) * (W3 xn), xn = rmsnorm(x) * norm_w. w1, w3: stored (hidden_dim, dim),
    x (dim,), h (hidden_dim,) float32. -> bytes moved."""
    launch_family(w1, w3, x, norm_w, eps, h, dtype, GATE, stream=stream)
    return int(w1.nbytes) + int(w3.nbytes) + int(x.nbytes) + int(norm_w.nbytes) + 4 * w1.shape[0]


def kernel_sig(kind: str) -> str:
    """The numba signature of the matvec family kernel for a kind (COMPILE_CHECK)."""
    t = "uint32" if KINDS[kind].load_bytes == 4 else "uint64"
    return (
        f"void({t}[:, ::1], {t}[:, ::1], float32[::1], uint64[::1], float32[::1], float32, float32[::1], int32, "
        "int32, int32[::1], float32[::1], int32, int32)"
    )


# every kernel the launchers use (one per kind, its expert-slot twin for pycalm.kernels.moe, and
# the split one of long residual rows: mode and normed are runtime arguments)
COMPILE_CHECK = [
    (kernel_for_variant(kind, variant_for(kind, None), slots), kernel_sig(kind))
    for slots in (False, True)
    for kind in ("fp16", "fp8", "gf4", "fp8n", "gf4n")
] + [
    (kernel_for_variant(kind, variant_for(kind, None)._replace(split=2, n_warps=16)), kernel_sig(kind))
    for kind in SPLIT_DTYPES
]
