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
# Thread mapping. Every warp computes the dot products of TWO weight rows with the same x (a
# "row pair": rows 2p, 2p+1 of one matrix for matvec / matvec_residual / QKV, row p of W1 and of
# W3 for ffn_gate), so each x value read from shared memory serves two rows and the pair's
# epilogue (SiLU gate, RoPE rotation) needs no barrier. Lane l reads the uint64 words
# l, l + 32, l + 64, ... of both rows (coalesced: a warp reads 256 contiguous bytes a row per
# step), two words a row per step, so four independent 8-byte loads are in flight per lane
# before the first use. A word holds 4 fp16, 8 fp8 or 16 gf4 weights (two groups).
#
# x is staged once per block in shared memory (times the RMSNorm weight when the norm is fused;
# the scalar rsqrt(mean(x^2) + eps) factors out of the dot product and is applied at the end).
# It is stored transposed by word, xs[e * CW + j] = x[j * E + e] (E weights a word, CW words a
# chunk), so that when the 32 lanes read element e of 32 consecutive words they hit 32
# consecutive banks: no bank conflicts. Rows longer than XCHUNK columns are done in chunks
# (a barrier before and after each restage); then each warp does exactly one pair.
#
# Decoding (see pycalm.kernels.common): fp16 / fp8 need 2-3 integer ops a weight and no
# conversion; their raw products carry a factor 2**-112 that is multiplied back once per row.
# gf4 is one logic op and one float add a weight (exact q - 4), the group scale once a group.
#
# Bytes moved: the weights, x once (it is re-read per block from L2, not counted), and y
# (written, or read and written for the residual).
# =============================================================================================

import math  # noqa: E402

from numba import cuda, float32, int32, uint64  # noqa: E402

from pycalm.kernels.common import (  # noqa: E402
    FP_RAW_SCALE,
    GF4_RAW_SCALE,
    WARP,
    block_reduce_sum,
    fp8x4_raw,
    fp16_hi_raw,
    fp16_lo_raw,
    gf4_dot8_raw,
    warp_reduce_sum,
)

XCHUNK = 8192  # floats of x staged in shared memory at a time (32 KiB)
N_WARPS = 8  # warps a block (256 threads)
BLOCKS_PER_SM = 8  # grid cap for single-chunk rows: blocks loop over pairs beyond it
N_SM = 132  # H200; only sizes the grid cap

# weights per stored word: fp16 / fp8 / gf4 read as uint64, "gf4w" = gf4 read one uint32 group
# at a time (rows whose gf4 word count is odd cannot be read as aligned uint64)
WORD_WEIGHTS = {"fp16": 4, "fp8": 8, "gf4": 16, "gf4w": 8}
CW16, CW8, CWG, CWGW = (XCHUNK // WORD_WEIGHTS[k] for k in ("fp16", "fp8", "gf4", "gf4w"))


@cuda.jit(device=True, inline=True)
def _word2_fp16(acc_a: float, acc_b: float, ua: int, ub: int, xs: cuda.devicearray, j: int) -> tuple:
    """Add word j of two fp16 rows (uint64 ua, ub: 4 weights each) times x to two raw sums."""
    x0 = xs[j]
    x1 = xs[j + uint64(CW16)]
    x2 = xs[j + uint64(2 * CW16)]
    x3 = xs[j + uint64(3 * CW16)]
    lo, hi = int32(ua), int32(ua >> uint64(32))
    acc_a += fp16_lo_raw(lo) * x0
    acc_a += fp16_hi_raw(lo) * x1
    acc_a += fp16_lo_raw(hi) * x2
    acc_a += fp16_hi_raw(hi) * x3
    lo, hi = int32(ub), int32(ub >> uint64(32))
    acc_b += fp16_lo_raw(lo) * x0
    acc_b += fp16_hi_raw(lo) * x1
    acc_b += fp16_lo_raw(hi) * x2
    acc_b += fp16_hi_raw(hi) * x3
    return acc_a, acc_b


@cuda.jit(device=True, inline=True)
def _word2_fp8(acc_a: float, acc_b: float, ua: int, ub: int, xs: cuda.devicearray, j: int) -> tuple:
    """Add word j of two fp8 rows (uint64 ua, ub: 8 weights each) times x to two raw sums."""
    x0 = xs[j]
    x1 = xs[j + uint64(CW8)]
    x2 = xs[j + uint64(2 * CW8)]
    x3 = xs[j + uint64(3 * CW8)]
    x4 = xs[j + uint64(4 * CW8)]
    x5 = xs[j + uint64(5 * CW8)]
    x6 = xs[j + uint64(6 * CW8)]
    x7 = xs[j + uint64(7 * CW8)]
    f0, f1, f2, f3 = fp8x4_raw(int32(ua))
    f4, f5, f6, f7 = fp8x4_raw(int32(ua >> uint64(32)))
    acc_a += f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3 + f4 * x4 + f5 * x5 + f6 * x6 + f7 * x7
    f0, f1, f2, f3 = fp8x4_raw(int32(ub))
    f4, f5, f6, f7 = fp8x4_raw(int32(ub >> uint64(32)))
    acc_b += f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3 + f4 * x4 + f5 * x5 + f6 * x6 + f7 * x7
    return acc_a, acc_b


@cuda.jit(device=True, inline=True)
def _word2_gf4(acc_a: float, acc_b: float, ua: int, ub: int, xs: cuda.devicearray, j: int) -> tuple:
    """Add word j of two gf4 rows (uint64 ua, ub: two groups of 8 each) times x to two sums."""
    x0 = xs[j]
    x1 = xs[j + uint64(CWG)]
    x2 = xs[j + uint64(2 * CWG)]
    x3 = xs[j + uint64(3 * CWG)]
    x4 = xs[j + uint64(4 * CWG)]
    x5 = xs[j + uint64(5 * CWG)]
    x6 = xs[j + uint64(6 * CWG)]
    x7 = xs[j + uint64(7 * CWG)]
    acc_a += gf4_dot8_raw(int32(ua), x0, x1, x2, x3, x4, x5, x6, x7)
    acc_b += gf4_dot8_raw(int32(ub), x0, x1, x2, x3, x4, x5, x6, x7)
    x0 = xs[j + uint64(8 * CWG)]
    x1 = xs[j + uint64(9 * CWG)]
    x2 = xs[j + uint64(10 * CWG)]
    x3 = xs[j + uint64(11 * CWG)]
    x4 = xs[j + uint64(12 * CWG)]
    x5 = xs[j + uint64(13 * CWG)]
    x6 = xs[j + uint64(14 * CWG)]
    x7 = xs[j + uint64(15 * CWG)]
    acc_a += gf4_dot8_raw(int32(ua >> uint64(32)), x0, x1, x2, x3, x4, x5, x6, x7)
    acc_b += gf4_dot8_raw(int32(ub >> uint64(32)), x0, x1, x2, x3, x4, x5, x6, x7)
    return acc_a, acc_b


@cuda.jit(device=True, inline=True)
def _word2_gf4w(acc_a: float, acc_b: float, ua: int, ub: int, xs: cuda.devicearray, j: int) -> tuple:
    """Add group j of two gf4 rows read as uint32 (ua, ub) times x to two sums."""
    x0 = xs[j]
    x1 = xs[j + uint64(CWGW)]
    x2 = xs[j + uint64(2 * CWGW)]
    x3 = xs[j + uint64(3 * CWGW)]
    x4 = xs[j + uint64(4 * CWGW)]
    x5 = xs[j + uint64(5 * CWGW)]
    x6 = xs[j + uint64(6 * CWGW)]
    x7 = xs[j + uint64(7 * CWGW)]
    acc_a += gf4_dot8_raw(int32(ua), x0, x1, x2, x3, x4, x5, x6, x7)
    acc_b += gf4_dot8_raw(int32(ub), x0, x1, x2, x3, x4, x5, x6, x7)
    return acc_a, acc_b


_WORD2 = {"fp16": _word2_fp16, "fp8": _word2_fp8, "gf4": _word2_gf4, "gf4w": _word2_gf4w}
# what a row's raw sum is multiplied by: the 2**112 of the raw fp16 / e5m2 decode (gf4: / -4)
ROW_SCALE = {"fp16": FP_RAW_SCALE, "fp8": FP_RAW_SCALE, "gf4": GF4_RAW_SCALE, "gf4w": GF4_RAW_SCALE}


def make_pair_dot(word_dtype: str):  # noqa: ANN201
    """-> device fn pair_dot(wa, ra, wb, rb, xs, j0, n_words, lane) -> (lane sum a, lane sum b):
    this lane's part of row ra of wa and row rb of wb (word arrays) over words
    j0 .. j0 + n_words - 1, x staged in xs (chunk-local word index). Raw: times ROW_SCALE."""
    word2 = _WORD2[word_dtype]

    @cuda.jit(device=True, inline=True)
    def pair_dot(wa, ra, wb, rb, xs, j0, n_words, lane):  # noqa: ANN001, ANN202
        acc_a = float32(0.0)
        acc_b = float32(0.0)
        # unsigned indices: numba adds no negative-index wraparound code for them
        rau = uint64(ra)
        rbu = uint64(rb)
        j = uint64(lane)
        j0 = uint64(j0)
        n_words = uint64(n_words)
        w32 = uint64(WARP)
        # two words a row per step: four independent loads in flight before the first use
        while j + w32 < n_words:
            ua0 = wa[rau, j0 + j]
            ub0 = wb[rbu, j0 + j]
            ua1 = wa[rau, j0 + j + w32]
            ub1 = wb[rbu, j0 + j + w32]
            acc_a, acc_b = word2(acc_a, acc_b, ua0, ub0, xs, j)
            acc_a, acc_b = word2(acc_a, acc_b, ua1, ub1, xs, j + w32)
            j += uint64(2 * WARP)
        if j < n_words:
            acc_a, acc_b = word2(acc_a, acc_b, wa[rau, j0 + j], wb[rbu, j0 + j], xs, j)
        return acc_a, acc_b

    return pair_dot


def make_stage_x(word_dtype: str, normed: bool):  # noqa: ANN201
    """-> device fn stage_x(x, norm_w, xs, c0, n) that copies x[c0 : c0 + n] into xs in the
    transposed word layout (times norm_w when `normed`). All threads of the block call it;
    the caller puts the barriers around it."""
    e_w = WORD_WEIGHTS[word_dtype]
    cw = XCHUNK // e_w

    @cuda.jit(device=True, inline=True)
    def stage_x(x, norm_w, xs, c0, n):  # noqa: ANN001, ANN202
        # walk the destination slots in order (conflict-free shared stores)
        for d in range(cuda.threadIdx.x, XCHUNK, cuda.blockDim.x):
            e = d // cw
            j = d - e * cw
            i = j * e_w + e
            if i < n:
                if normed:
                    xs[d] = x[c0 + i] * norm_w[c0 + i]
                else:
                    xs[d] = x[c0 + i]

    return stage_x


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


# modes of the matvec kernel family
PLAIN, RESIDUAL, GATE = 0, 1, 2


def _make_matvec_kernel(word_dtype: str, mode: int, normed: bool):  # noqa: ANN202
    """One kernel of the family for a weight word type, a mode and whether RMSNorm is fused.

    wa, wb: (rows, words) word arrays (wb is wa except for GATE); x (cols,) float32;
    norm_w (cols,) float32 (ignored unless normed); out (rows_out,) float32.
    PLAIN: out = W x; RESIDUAL: out += W x; GATE: out = silu(Wa x) * (Wb x).
    """
    pair_dot = make_pair_dot(word_dtype)
    stage_x = make_stage_x(word_dtype, normed)
    e_w = WORD_WEIGHTS[word_dtype]
    row_scale = ROW_SCALE[word_dtype]

    @cuda.jit
    def matvec_kernel(wa, wb, x, norm_w, eps, out):  # noqa: ANN001, ANN202
        xs = cuda.shared.array(XCHUNK, float32)  # x chunk, transposed by word
        scratch = cuda.shared.array(32, float32)  # block reduction
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        n_warps = cuda.blockDim.x // WARP
        rows = wa.shape[0]
        cols = x.shape[0]
        n_pairs = rows if mode == GATE else (rows + 1) // 2
        n_chunks = (cols + XCHUNK - 1) // XCHUNK
        scale = float32(row_scale)
        if normed:
            scale *= rms_factor(x, eps, scratch)
        per_round = cuda.gridDim.x * n_warps
        n_rounds = (n_pairs + per_round - 1) // per_round  # the same for every warp: barriers
        for rnd in range(n_rounds):
            p = rnd * per_round + cuda.blockIdx.x * n_warps + warp
            if mode == GATE:
                ra = p
                rb = p
            else:
                ra = 2 * p
                rb = min(2 * p + 1, rows - 1)  # odd row count: the last warp repeats a row
            acc_a = float32(0.0)
            acc_b = float32(0.0)
            for c in range(n_chunks):
                if rnd == 0 or n_chunks > 1:
                    c0 = c * XCHUNK
                    cuda.syncthreads()  # every warp is done with the previous chunk of xs
                    stage_x(x, norm_w, xs, c0, min(XCHUNK, cols - c0))
                    cuda.syncthreads()  # xs holds this chunk for every warp
                if p < n_pairs:
                    j0 = c * (XCHUNK // e_w)
                    n_words = min(XCHUNK // e_w, wa.shape[1] - j0)
                    da, db = pair_dot(wa, ra, wb, rb, xs, j0, n_words, lane)
                    acc_a += da
                    acc_b += db
            if p < n_pairs:
                # every lane gets both row sums (the butterfly), lane 0 writes
                acc_a = warp_reduce_sum(acc_a) * scale
                acc_b = warp_reduce_sum(acc_b) * scale
                if lane == 0:
                    if mode == GATE:
                        out[p] = acc_a / (float32(1.0) + math.exp(-acc_a)) * acc_b
                    elif mode == RESIDUAL:
                        out[ra] += acc_a
                        if 2 * p + 1 < rows:
                            out[rb] += acc_b
                    else:
                        out[ra] = acc_a
                        if 2 * p + 1 < rows:
                            out[rb] = acc_b

    return matvec_kernel


# kernels by (word dtype, mode, normed), compiled lazily by numba on first launch
MATVEC_KERNELS = {
    (wd, mode, normed): _make_matvec_kernel(wd, mode, normed)
    for wd in WORD_WEIGHTS
    for mode, normed in ((PLAIN, False), (PLAIN, True), (RESIDUAL, False), (GATE, True))
}

_NP_WORD = {"fp16": np.uint64, "fp8": np.uint64, "gf4": np.uint64, "gf4w": np.uint32}


def word_view(w: object, dtype: str) -> tuple[object, str]:
    """A stored weight array (device) -> (its word view, the word dtype the kernels use).
    gf4 rows with an odd number of groups are read one uint32 at a time ("gf4w")."""
    if dtype not in ("fp16", "fp8", "gf4"):
        raise ValueError(f"unknown weight dtype {dtype!r}")
    wd = "gf4w" if dtype == "gf4" and w.shape[1] % 2 else dtype
    return w.view(_NP_WORD[wd]), wd


def grid_for(n_pairs: int, cols: int, n_warps: int = N_WARPS, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """Blocks for n_pairs row pairs: one pair a warp when x needs chunks (each block restages
    x per pair); otherwise capped so that blocks loop over pairs and stage x only once."""
    blocks = (n_pairs + n_warps - 1) // n_warps
    if cols > XCHUNK:
        return blocks
    return max(1, min(blocks, N_SM * blocks_per_sm))


def _bytes(w: object, x: object, out_bytes: int) -> int:
    return int(w.nbytes) + int(x.nbytes) + out_bytes


def matvec(
    w: object, x: object, y: object, dtype: str, *, stream: object, norm_w: object = None, eps: float = 0.0
) -> int:
    """y = W x, or y = W rmsnorm(x) * norm_w when norm_w is given (the final classifier).
    w: stored (rows, cols) device array, x (cols,) float32, y (rows,) float32. -> bytes moved."""
    wv, wd = word_view(w, dtype)
    rows = w.shape[0]
    normed = norm_w is not None
    kernel = MATVEC_KERNELS[(wd, PLAIN, normed)]
    blocks = grid_for((rows + 1) // 2, x.shape[0])
    kernel[blocks, N_WARPS * WARP, stream](wv, wv, x, norm_w if normed else x, np.float32(eps), y)
    return _bytes(w, x, 4 * rows) + (int(norm_w.nbytes) if normed else 0)


def matvec_residual(w: object, x: object, r: object, dtype: str, *, stream: object) -> int:
    """r += W x (wo and w2: the residual add fused). -> bytes moved (r read and written)."""
    wv, wd = word_view(w, dtype)
    rows = w.shape[0]
    kernel = MATVEC_KERNELS[(wd, RESIDUAL, False)]
    blocks = grid_for((rows + 1) // 2, x.shape[0])
    kernel[blocks, N_WARPS * WARP, stream](wv, wv, x, x, np.float32(0.0), r)
    return _bytes(w, x, 8 * rows)


def ffn_gate(
    w1: object, w3: object, x: object, h: object, dtype: str, *, stream: object, norm_w: object, eps: float
) -> int:
    """h = silu(W1 xn) * (W3 xn), xn = rmsnorm(x) * norm_w. w1, w3: stored (hidden_dim, dim),
    x (dim,), h (hidden_dim,) float32. -> bytes moved."""
    w1v, wd = word_view(w1, dtype)
    w3v, _ = word_view(w3, dtype)
    rows = w1.shape[0]
    kernel = MATVEC_KERNELS[(wd, GATE, True)]
    blocks = grid_for(rows, x.shape[0])
    kernel[blocks, N_WARPS * WARP, stream](w1v, w3v, x, norm_w, np.float32(eps), h)
    return _bytes(w1, x, 4 * rows) + int(w3.nbytes) + int(norm_w.nbytes)


_SIG_WORD = {"fp16": "uint64", "fp8": "uint64", "gf4": "uint64", "gf4w": "uint32"}
COMPILE_CHECK = [
    (
        k,
        f"void({_SIG_WORD[wd]}[:, ::1], {_SIG_WORD[wd]}[:, ::1], float32[::1], float32[::1], float32, float32[::1])",
    )
    for (wd, _mode, _normed), k in MATVEC_KERNELS.items()
]
