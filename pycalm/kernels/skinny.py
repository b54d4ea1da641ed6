"""Matrix products for a few rows (T up to 64) on the tensor cores, each weight read once a pass.

  PLAIN:     out = X W^T                       (qkv, the classifier)
  RESIDUAL:  out += X W^T                      (wo and w2: the residual add fused in)
  GATE:      out = silu(X W1^T) * (X W3^T)     (w1 and w3 in one kernel)

The arrays and the references are pycalm.kernels.matmul's: X (T, K) float16, W the stored (N, K)
weights in any format (fp16, fp8 e5m2, gf4, q8, q4), out (T, N) float32 (GATE: float16);
pycalm.cpu.reference.matmul_ref, matmul_residual_ref, matmul_gate_ref. What differs is the
shape of the work. matmul stages 16 x 32 tiles of X and W in shared memory and walks K serially
in a block per 32 rows of W: at a few rows it reads the weights at a fraction of the memory's
speed. Here the weights stream straight from memory into the tensor cores' registers, like the
token step's matvec (pycalm.kernels.matvec), and the few rows of X ride along.

Mapping ("swap A and B"). An mma m16n8k16 multiplies A (16 x 16) by B (16 x 8). A is a tile of
16 rows of W and B holds 8 rows of X (tokens), so one mma serves 16 weight rows and 8 tokens,
and a pass of up to 8 rows costs the mma work of one. Lane l = 4 g + t holds A rows g and g + 8
(pycalm.kernels.tensorcore has the fragment layouts). A dot product's k may be taken in any
order if A and B agree, so the lanes' k are permuted to suit the loads: lane t of a quad loads
one 16-byte unit of each of its two rows, E consecutive weights (fp16 8, fp8 and q8 16, gf4
and q4 32), and the quad's 4 units are a step of 4 E columns. Of a unit's E weights, k-tile j
(E / 4 of them a unit) takes weights 4j..4j+3: a0 = row g's 4j, 4j+1 and a2 = its 4j+2, 4j+3
(a1, a3 the same of row g + 8), and b0, b1 = the same columns of X row 8p + g for n-tile p.
A lane thus reads X row 8p + g over its unit's columns (E halves, 16 to 64 bytes) for each
n-tile p, from L1 / L2 (X is a few KB, read by every warp). GATE: A rows g are W1's rows and rows
g + 8 the same rows of W3, so a lane holds both sums of its outputs and the gate needs no
exchange; a tile then makes 8 outputs.

Decoding into A fragments (f16x2 words, the same values as matmul's fetch): fp16 as loaded; fp8
one prmt a pair (an e5m2 byte is the top byte of an fp16); q8 a prmt and an HADD2 a pair (the
biased byte under the fp16 exponent of 1024, minus 1152: the code, exact), the row scale applied
to the sums; gf4 a prmt, a LOP3, an HADD2 and an HFMA2 a pair (each code's bits under an
exponent that makes its lowest bit worth 1, minus that power and 4, times -s/4), exact; q4 a
prmt, a LOP3, an HADD2 and an HFMA2 a pair (the nibbles under exponents whose mantissa unit is
1, minus those powers, then d q + m rounded once to fp16, d and m being fp16), with the group's
d and m (a unit lies in one group: 32 columns, G = 32 or 64). The pair decoders are
pycalm.kernels.common's (q8_pairs, gf4_pair, q4_pair), which matmul's and wgmma_matmul's W
tiles take too.
A unit's weights are decoded once for all the n-tiles.

Blocks and warps. A block takes row_tiles 16-row tiles of W (GATE: 8 outputs each; ROW_TILES: two in
passes of 17 to 64 rows (gf4 to 32; q4 and gf4 from 9), one below) and its warps (WARPS, or
LONG_WARPS for rows longer than LONG_K) split K. Each warp holds the A fragments of all the block's
tiles, so one load of X serves them all: X is read from L2 once a block, and at 64 rows that read is
4 (fp16) to 16 (4-bit) times a tile's weight bytes. Warp w takes the chunks of UNROLL consecutive
steps w, w + warps, ... (a chunk's weight loads, and its X loads where they fit X_WORDS_AHEAD
registers, or X_AHEAD's for the format and rows, are issued together, then decoded and multiplied).
The chunks whose columns all lie in K load without checks (a row past N reads the last row, a token
past T the last token's X: their sums are never stored); only the last chunk, past K in part, checks
its loads (zeros past K). The warps' partial sums meet in shared memory, a tile at a time (in parts
of whole n-tiles where 16 warps' sums would pass the 48 KiB of static shared memory), and are added
in warp order, one thread an output, which then applies the epilogue (the q8 row scale, the residual
add or the gate). Grid: ceil(N / (16 row_tiles)) blocks (GATE: ceil(N / (8 row_tiles))). n_tiles =
ceil(T / 8) mma tiles along the tokens, a compile-time size: the kernel is compiled for 1, 2, 4 and
8 (passes of 8, 16, 32 and 64 rows); the tokens past T are columns of B and C whose sums are never
stored (load_x).

The RMSNorm folded in (a rows pass of up to 64 rows: pycalm.gpu.prefill's Prefill.folds). The
norm before qkv and before the gate, xb = fp16(x rsqrt(mean(x^2) + eps) w), needs each row's
whole x, which the residual product before it (wo, w2) writes a 16-column tile a block. FOLD
(RESIDUAL): besides out = y = x + X W^T, the epilogue writes xb = fp16(y w rho), the next norm's
input at the scale rho (T,) of the norm before it (y's rms moves little from one norm to the
next, so the values stay as far from fp16's limits as rmsnorm's), and each row's sum of y^2 over
each of its 16-column tiles, in column order, into slots (T, ceil(N / 16)). The block that
finishes last (common.last_to_arrive: an acq_rel atomic counter, reset by it, orders the
slots before the count) adds each row's slots, a warp a row (lane l slots l, l + 32, ... in order, then the xor
butterfly), into rms = rsqrt(sum / N + eps) and scale = rms / rho. SCALED (PLAIN, GATE): each
row's sums times scale[row] before the epilogue, so the next product gives (xb W^T) scale, the
unfolded pass's rmsnorm(y) w W^T up to xb's fp16 rounding. A pass thus runs no RMSNorm launch
but its first; the slots cost T N / 4 bytes written and read, the last block's adds T N / 16.
References: pycalm.cpu.reference.matmul_residual_fold_ref, and matmul_ref's and
matmul_gate_ref's scale.

The QKV epilogue (skinny_qkv, PLAIN into q and the KV cache): in place of storing qkv, the
epilogue runs pycalm.kernels.rows.qkv_rows's (the bias, RoPE of a rotary pair, q or the cache
rows at position pos0 + t). A rotary pair, columns 2c and 2c + 1, is A rows g and g + 1 of one
accumulator index, lanes l and l + 4: the thread of the even row adds both sums and finishes the
pair, the odd row's thread none, so the bits are those of the product and qkv_rows apart.

Batch invariance: a row's sums depend only on its own X row, the fixed split of K (warps_for,
UNROLL) and the fixed order of the adds, not on T, n_tiles, row_tiles or the row's place in the
pass, so a row's outputs are the same bits in every pass of up to 64 rows. They are not matmul's
bits (the k order differs).

Bytes: the weights once (the decode of a weight is paid once a pass), X from L1 / L2 once a
block (T K 2 bytes, about 0.5 (fp16) to 2 (4-bit) times a unit's weight bytes per n-tile), out
written (read and written for RESIDUAL). FLOPs 2 T N K, done as 2 ceil(T / 8) 8 N K.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, uint32

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    STATE_POS,
    dependent_start,
    fp16_encode,
    gf4_factor,
    gf4_pair,
    last_to_arrive,
    prmt,
    q4_pair,
    q8_pairs,
    warp_reduce_sum,
)
from pycalm.kernels.matmul import GATE, MODES, RESIDUAL, check_mode, weight_args
from pycalm.kernels.qkv import rope_store_pair
from pycalm.kernels.rows import check_qkv
from pycalm.kernels.tensorcore import ldg128w, mma_16816

MAX_ROWS = 64  # rows of X a launch takes: 8 n-tiles of 8
NO_NORM, SCALED, FOLD = 0, 1, 2  # a kernel's RMSNorm part: none, its rows' scale, the next norm folded in
UNIT = {"fp16": 8, "fp8": 16, "q8": 16, "gf4": 32, "q4": 32}  # E: weights in a lane's 16-byte load
# elements of the stored array a unit's start moves by a column: fp16 is read as uint32 words
# (two halves), gf4 and q4 are uint32 words of 8 weights
COLS_AN_ELEMENT = {"fp16": 2, "fp8": 1, "q8": 1, "gf4": 8, "q4": 8}
SIM = _numba_config.ENABLE_CUDASIM
# warps a block, splitting K: 8, and 16 for rows longer than LONG_K (w2), where a warp's chain
# of steps would otherwise be long (H200, fp16, 8 rows: w2 44.8 -> 34.1 us; 16 elsewhere is
# slower: the gate 61.4 -> 67.7), except q4 (its steps are 4 times fp16's columns: w2 at 8 rows
# 23.6 us with 16 warps, 15.7 with 8). The simulator runs a Python thread a thread: 2.
WARPS, LONG_WARPS, LONG_K = (2, 2, 0) if SIM else (8, 16, 8192)
# steps a warp loads at once: one (32 bytes a lane in flight; more warps resident do better
# than more loads a warp: fp16 gate at 8 rows, 4 steps 92.0 us at 60 registers, 1 step 61.4 at
# 44), and each extra step multiplies the registers the decode and mma loops unroll into
UNROLL = 1
# words of X a lane may load with a chunk's weights (all its n-tiles, before the decode and the
# mma); past that each 16 bytes of an n-tile's X is loaded where it is used, a wait on L2 each
X_WORDS_AHEAD = 32
# A tiles a warp, by format and n-tile count (else one): a warp's X loads serve them all, so the
# reads of X (from L2, once a block) fall by this factor against the weights'. A layer's four
# products on the 8B shape, us, one A tile -> two (`scripts/kernels/rows_matmul.py --row-tiles`,
# H200): 32 rows fp16 289 -> 206, fp8 136 -> 106, q8 135 -> 111, q4 174 -> 137; 64 rows fp16
# 450 -> 297, fp8 327 -> 221, q8 343 -> 235, q4 360 -> 260; gf4 (H100, its fp16 decode) 195 -> 167
# at 32 rows (w2, in blocks of 16 warps, spills 20 bytes outside its step loop: 59.1 -> 32.8 us),
# 675 -> 430 at 64 (but w2 spills 144 bytes there, and its step loop grows from 49 to 80
# instructions per 8 mma: one tile). Four tiles spill or lose occupancy (fp8 at 64 rows: 1,060). (The
# 64-row figures of two tiles ran a load_x that spilled q4 and, in blocks of LONG_WARPS, fp8 and
# q8; ptxas now gives q4 233 registers, one block of 8 warps an SM, and those 124, no spill.
# Those run slower: on an H100 fp8's qkv takes 56.3 us at 64 rows against 12.3 at 32, and the
# rows pass takes matmul's split tile at 64 rows, prefill.SKINNY_ROWS.) At 16 rows the 4-bit
# formats take two as well (H100, 2026-12-06, `--rows 8,16 --row-tiles "0,0,1;0,0,2;0,0,4"`): q4
# 97 -> 86, gf4 91 -> 71 (their X is about twice their weight bytes a tile); q8 94 -> 97 does not;
# at 8 rows one is best or even (q4 65 against 71, gf4 59 against 57, q8 82 against 83).
ROW_TILES: dict[str, dict[int, int]] = {
    "fp16": {4: 2, 8: 2},
    "fp8": {4: 2, 8: 2},
    "gf4": {2: 2, 4: 2},
    "q8": {4: 2, 8: 2},
    "q4": {2: 2, 4: 2, 8: 2},
}
# words of X a lane loads with a chunk's weights, by format and n-tile count, where X_WORDS_AHEAD
# is too few: q4 and gf4 at 32 rows (4 n-tiles of 16 words a step), whose steps otherwise wait on
# L2 for each n-tile's X in the middle of the decode and the mma. A layer's four products on the 8B
# shape, two A tiles, us (`scripts/kernels/rows_matmul.py --dtypes q4,gf4 --rows 32 --row-tiles
# "0,0,2;0,0,2,64"`, H100, 2026-12-06): q4 194 -> 135, gf4 166 -> 120. ptxas (scripts/kernels/sass_loops.py
# skinny --x-words 64): q4 142-146 registers, gf4 138-140, one block of 8 warps an SM as before;
# gf4's w2, in blocks of 16 warps, spills 52 bytes against 20, and its step loop issues 56
# instructions per 8 mma against 66
X_AHEAD: dict[str, dict[int, int]] = {"gf4": {4: 64}, "q4": {4: 64}}


def warps_for(k_cols: int, dtype: str = "fp16") -> int:
    """Warps a block for rows of k_cols columns of a dtype (a function of the matrix only: batch
    invariance)."""
    return LONG_WARPS if k_cols > LONG_K and dtype != "q4" else WARPS


def n_tiles_for(t_rows: int) -> int:
    """The compiled n-tile count that covers t_rows rows: 1, 2, 4 or 8."""
    if not 1 <= t_rows <= MAX_ROWS:
        raise PycalmError(f"the skinny matmul takes 1 to {MAX_ROWS} rows, got {t_rows}")
    n = 1
    while 8 * n < t_rows:
        n *= 2
    return n


def row_tiles_for(dtype: str, n_tiles: int) -> int:
    """A tiles (16 rows of W, GATE 8 outputs) a warp takes for a pass of n_tiles n-tiles (a
    row's sums are the same bits for any count: batch invariance holds across the buckets)."""
    return ROW_TILES.get(dtype, {}).get(n_tiles, 1)


def x_words_for(dtype: str, n_tiles: int) -> int:
    """Words of X a lane loads with a chunk's weights for a pass of n_tiles n-tiles (0:
    X_WORDS_AHEAD); when X is loaded changes no sum's bits."""
    return X_AHEAD.get(dtype, {}).get(n_tiles, 0)


def blocks_for(n_cols: int, mode: str, row_tiles: int) -> int:
    """The grid: blocks of row_tiles A tiles over out's n_cols columns."""
    outputs = (8 if mode == "gate" else 16) * row_tiles
    return (n_cols + outputs - 1) // outputs


def fits(dtype: str, k_cols: int) -> bool:
    """Whether the kernel takes K (a whole number of 16-byte units a row; q4: groups of 32 or
    more, so a unit lies in one group)."""
    return dtype in UNIT and k_cols % UNIT[dtype] == 0


@functools.cache
def unit_decoders(dtype: str) -> tuple[object, object]:
    """A lane's weight helpers for a dtype (skinny's, and pycalm.kernels.panel's): load_unit, a
    16-byte unit of a W row into four words (q4: with its group's d and m), and a_pair, a unit's
    k-tile as two A words (see the module docstring's mapping and decoding)."""
    EL = COLS_AN_ELEMENT[dtype]
    fp16, fp8, gf4 = dtype == "fp16", dtype == "fp8", dtype == "gf4"
    q8, q4 = dtype == "q8", dtype == "q4"

    @cuda.jit(device=True, inline=True)
    def a_pair(w, i, j, dm):  # noqa: ANN001, ANN202
        """The two f16x2 words of k-tile j of the unit in w[4 i : 4 i + 4]: weights 4j, 4j + 1
        and 4j + 2, 4j + 3 of the unit, decoded (q4: with the group's d and m, the halves of its
        stored word dm, split here at the use rather than where the word is loaded)."""
        if fp16:
            return w[4 * i + 2 * j], w[4 * i + 2 * j + 1]
        if fp8:
            v = w[4 * i + j]  # bytes 4j..4j+3: each the top byte of an fp16
            return prmt(v, int32(0), int32(0x1404)), prmt(v, int32(0), int32(0x3424))
        if q8:  # codes 4j..4j+3
            return q8_pairs(w[4 * i + j])
        v = w[4 * i + j // 2]  # a word of 8: k-tile j takes codes 4 (j % 2) .. (bytes 2 (j % 2), + 1)
        if gf4:  # codes 4h .. 4h + 3 (h = j % 2) as pairs 2h and 2h + 1, each q - 4 times -s/4
            f = gf4_factor(v)
            return gf4_pair(v, 2 * (j % 2), f), gf4_pair(v, 2 * (j % 2) + 1, f)
        # q4: bytes 2h and 2h + 1 (codes 4h .. 4h + 3), d q + m, d = (d, d) and m = (m, m)
        d, m = prmt(dm, int32(0), int32(0x1010)), prmt(dm, int32(0), int32(0x3232))
        return q4_pair(v, 2 * (j % 2), d, m), q4_pair(v, 2 * (j % 2) + 1, d, m)

    @cuda.jit(device=True, inline=True)
    def load_unit(w, s, row, col, ok, words, i, dm, r, g_shift):  # noqa: ANN001, ANN202
        """words[4 i : 4 i + 4] = the 16-byte unit of W row `row` from column col (zeros where
        not ok); q4: dm[r] = its group's word of (d, m) as stored (s: the (rows, groups) words;
        g_shift: log2 of the group's columns). Nothing here waits for the loads: a use of dm
        beside them would stall the warp for the memory's latency before its next product."""
        if ok:
            words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3] = ldg128w(w, row, col // EL)
        else:
            for e in range(4):
                words[4 * i + e] = int32(0)
        if q4:
            dm[r] = (
                int32(s[uint32(row), uint32(col >> g_shift)]) if ok else int32(0)
            )  # (unsigned: no wraparound)

    return a_pair, load_unit


@cuda.jit(device=True, inline=True)
def fold_scales(slots, t_rows, n_cols, rho, rms, scale, eps, counter):  # noqa: ANN001, ANN201
    """The end of a FOLD launch, in the block that finishes last (every block's slots written):
    each row's slots added, a warp a row (lane l its slots l, l + 32, ... in order, then the xor
    butterfly), into rms = rsqrt(sum / n_cols + eps) and scale = rms / rho; the counter reset for
    the next launch. pycalm.kernels.panel's FOLD ends here too."""
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    for token in range(warp, t_rows, cuda.blockDim.x // 32):  # a warp a row
        total = float32(0.0)
        for i in range(lane, slots.shape[1], 32):
            total += slots[token, i]
        total = warp_reduce_sum(total)
        if lane == 0:
            r = float32(1.0) / math.sqrt(total / float32(n_cols) + eps)
            rms[token] = r
            scale[token] = r / rho[token]
    if tid == 0:
        counter[0] = 0  # for the next launch


@functools.cache
def output_stores(dtype: str, mode: int, norm: int) -> tuple[object, object]:
    """The epilogue's stores of one output, skinny's and pycalm.kernels.panel's: store_gate(s, h3,
    token, col, out, s1, s3, scale) writes fp16 silu(s) h3 of W1's sum s and W3's h3, and
    store_sum(s, token, col, out, s1, scale, nw, rho, x_next) writes out = s (RESIDUAL: out +=
    s; FOLD also x_next = fp16(y nw rho) of that y) and gives the value stored; each sum first
    times the q8 row scale s1[col] (s3[col]) and, SCALED, the row's scale[token]."""
    q8, residual = dtype == "q8", mode == RESIDUAL
    scaled, fold = norm == SCALED, norm == FOLD

    @cuda.jit(device=True, inline=True)
    def store_gate(s, h3, token, col, out, s1, s3, scale):  # noqa: ANN001, ANN202
        if q8:
            s *= s1[col]
            h3 *= s3[col]
        if scaled:
            s *= scale[token]
            h3 *= scale[token]
        out[token, col] = fp16_encode(s / (float32(1.0) + math.exp(-s)) * h3)

    @cuda.jit(device=True, inline=True)
    def store_sum(s, token, col, out, s1, scale, nw, rho, x_next):  # noqa: ANN001, ANN202
        if q8:
            s *= s1[col]
        if scaled:
            s *= scale[token]
        if residual:
            s += out[token, col]
            if fold:  # the next norm's input at the last one's scale
                x_next[token, col] = fp16_encode(s * nw[col] * rho[token])
        out[token, col] = s
        return s

    return store_gate, store_sum


@functools.cache
def make_skinny_kernel(  # noqa: ANN201, C901
    dtype: str,
    mode: int,
    n_tiles: int,
    warps: int = WARPS,
    unroll: int = UNROLL,
    min_blocks: int = 0,
    row_tiles: int = 1,
    x_words: int = 0,
    norm: int = NO_NORM,
    rope: str = "",
):
    """skinny_kernel for a weight dtype, an epilogue mode, an n-tile count and a block shape (warps
    a block, steps a load, 16-row tiles of W a warp), one compile each; min_blocks > 0: compiled
    to fit that many blocks an SM (launch bounds: the registers a thread may take); x_words > 0:
    the most words of X a lane loads with a chunk's weights (0: X_WORDS_AHEAD); norm: NO_NORM,
    SCALED (PLAIN, GATE: the sums times a row's scale) or FOLD (RESIDUAL: the next RMSNorm's
    input, sums of squares and scale, see the module docstring); rope (PLAIN): the KV-cache
    dtype of the QKV epilogue in place of out (qkv_rows's, pycalm.kernels.qkv.rope_store_pair)."""
    E = UNIT[dtype]  # weights a unit
    STEP = 4 * E  # columns a step (the 4 lanes of a quad)
    XW = E // 2  # words of X a lane reads an n-tile a step (two a k-tile: E / 4 k-tiles a unit)
    MT = row_tiles  # A tiles a warp (16 rows of W each; GATE: 8 outputs)
    ACC1 = 4 * n_tiles  # accumulators a lane for one A tile
    ACC = ACC1 * MT
    # the warps' sums of an A tile meet in shared memory in RED_PARTS parts of RED_ACC accumulators
    # (whole n-tiles: a gate's W1 and W3 sums stay together), within the 48 KiB a kernel's static
    # shared memory may take (16 warps at 8 n-tiles: 64 KiB whole, two parts)
    scaled, fold = norm == SCALED, norm == FOLD
    qkv_out = rope != ""  # (a bool: numba types the truth of a str through a compiled overload)
    store_pair = rope_store_pair(rope or "fp16")  # (called only where qkv_out)
    T_MAX = 8 * n_tiles  # tokens a pass of n_tiles holds
    SQ_WORDS = MT * T_MAX * 16 if fold else 1  # FOLD: the squares of the block's outputs
    RED_PARTS = 1
    while warps * (ACC1 // RED_PARTS) * 32 * 4 + 4 * SQ_WORDS > 48 * 1024:
        RED_PARTS *= 2
    RED_ACC = ACC1 // RED_PARTS
    UNITS = unroll * MT  # units of row g (and of g + 8) a chunk brings a lane
    W_WORDS = 4 * UNITS  # their words (local arrays take a constant size, not an expression)
    DM_WORDS = 2 * UNITS  # q4: a (d, m) word a unit of row g and of row g + 8
    A_WORDS = 8 * MT  # A fragments of two k-tiles, each A tile
    # X of a whole chunk in registers, loaded with its weights, where it takes at most
    # X_WORDS_AHEAD words (passes of up to 16 rows); else 16 bytes of an n-tile's X, loaded where
    # they are used
    PREFETCH_X = n_tiles * unroll * XW <= (x_words or X_WORDS_AHEAD)
    X_WORDS = n_tiles * unroll * XW if PREFETCH_X else 4
    threads = 32 * warps
    # the chunks wholly in K take unchecked loads (about a third fewer instructions a step), but
    # in blocks of 16 warps (128 registers a thread) at 8 n-tiles of two A tiles the unchecked
    # step spills (ptxas: fp8 84 bytes, q8 68): there every chunk checks its loads, as the last one does
    PEEL = threads <= 256 or n_tiles * row_tiles < 16
    q8, q4 = dtype == "q8", dtype == "q4"
    gate = mode == GATE
    tile_rows = 8 if gate else 16  # outputs an A tile makes
    a_pair, load_unit = unit_decoders(dtype)
    store_gate, store_sum = output_stores(dtype, mode, norm)

    @cuda.jit(device=True, inline=True)
    def load_x(x, token, col, t_rows, k_cols, xb, at, i, tail):  # noqa: ANN001, ANN202
        """xb[at : at + 4] = words 4 i .. 4 i + 3 of X row `token` over the unit's E columns from
        col: the B words of k-tiles 2 i, 2 i + 1 (zeros past K, checked in the tail chunk). A
        token past T is a column of B and of C of its own, whose sums are never stored: where X
        of the whole chunk is prefetched it takes the last row's words, else the words it held
        (only finite zeros under the K tail's zero weights matter; keeping the words, the loads
        of the n-tiles need no select, and with one q4's two tiles at 64 rows spill: 255
        registers and 80 bytes)."""
        if PREFETCH_X:
            if not tail or col < k_cols:
                xb[at], xb[at + 1], xb[at + 2], xb[at + 3] = ldg128w(
                    x, min(token, t_rows - 1), col // 2 + 4 * i
                )
            else:
                for e in range(4):
                    xb[at + e] = int32(0)
        elif not tail or col < k_cols:
            if token < t_rows:
                xb[at], xb[at + 1], xb[at + 2], xb[at + 3] = ldg128w(x, token, col // 2 + 4 * i)
        else:
            for e in range(4):
                xb[at + e] = int32(0)

    @cuda.jit(device=True, inline=True)
    def chunk_product(
        x, w1, s1, w3, s3, chunk, tail, tile0, g, t, n_rows, t_rows, k_cols, g_shift, wg, wh, dm, a, xb, acc
    ):  # noqa: ANN001, ANN202, E501
        """acc += the products of chunk `chunk` (UNROLL steps) of the lane's A tiles and n-tiles.
        tail: the chunk reaches past K, and loads past it give zeros; else no load is checked."""
        for u in range(unroll):  # the chunk's weight loads, all in flight before the first use
            col = ((chunk * unroll + u) * 4 + t) * E  # the lane's first column
            for m in range(MT):
                # A rows g: W1's row (tile) * 16 + g, rows g + 8 the next 8 (GATE: row g of
                # W1 and of W3, output (tile) * 8 + g)
                row_g = (tile0 + m) * tile_rows + g
                row_h = row_g if gate else row_g + 8
                # unchecked, a row past N takes the last row's weights (its outputs are never stored)
                ok_g = not tail or (row_g < n_rows and col < k_cols)
                ok_h = not tail or (row_h < n_rows and col < k_cols)
                v = u * MT + m
                load_unit(w1, s1, min(row_g, n_rows - 1), col, ok_g, wg, v, dm, 2 * v, g_shift)
                load_unit(w3, s3, min(row_h, n_rows - 1), col, ok_h, wh, v, dm, 2 * v + 1, g_shift)
        if PREFETCH_X:  # ... and its X, all n-tiles, beside them
            for u in range(unroll):
                col = ((chunk * unroll + u) * 4 + t) * E
                for p in range(n_tiles):
                    for i in range(XW // 4):
                        load_x(x, 8 * p + g, col, t_rows, k_cols, xb, (u * n_tiles + p) * XW + 4 * i, i, tail)
        for u in range(unroll):
            col = ((chunk * unroll + u) * 4 + t) * E
            for i in range(XW // 4):  # k-tiles 2 i, 2 i + 1 of the unit (16 bytes of X a row)
                for m in range(MT):  # their A fragments, decoded once for every n-tile
                    v = u * MT + m
                    for jj in range(2):
                        j = 2 * i + jj
                        a[8 * m + 4 * jj], a[8 * m + 4 * jj + 2] = a_pair(wg, v, j, dm[2 * v])
                        a[8 * m + 4 * jj + 1], a[8 * m + 4 * jj + 3] = a_pair(wh, v, j, dm[2 * v + 1])
                for p in range(n_tiles):
                    base = (u * n_tiles + p) * XW + 4 * i if PREFETCH_X else 0
                    if not PREFETCH_X:  # X row 8 p + g over the k-tiles' columns, now
                        load_x(x, 8 * p + g, col, t_rows, k_cols, xb, 0, i, tail)
                    for m in range(MT):
                        c = (m * n_tiles + p) * 4
                        for jj in range(2):
                            q = 8 * m + 4 * jj
                            acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma_16816(
                                a[q], a[q + 1], a[q + 2], a[q + 3], xb[base + 2 * jj],
                                xb[base + 2 * jj + 1], acc[c], acc[c + 1], acc[c + 2], acc[c + 3],
                            )  # fmt: skip

    @cuda.jit(device=True, inline=True)
    def fold_norm(sq, last, tile0, t_rows, n_cols, rho, slots, counter, rms, scale, eps):  # noqa: ANN001, ANN202
        """FOLD's end: each row's sum of squares over each of the block's 16-column tiles, in
        column order, into its slot; the block that finishes last turns the slots into rms and
        scale (fold_scales)."""
        tid = cuda.threadIdx.x
        cuda.syncthreads()  # every output's square is in sq
        for e in range(tid, MT * T_MAX, 32 * warps):  # (A tile, row)
            tile, token = tile0 + e // T_MAX, e % T_MAX
            if token < t_rows and tile < slots.shape[1]:
                total = float32(0.0)
                for c in range(16):
                    total += sq[e * 16 + c]
                slots[token, tile] = total
        # the block's slots published, the other blocks' acquired
        if last_to_arrive(counter, 0, cuda.gridDim.x, last, 0):
            fold_scales(slots, t_rows, n_cols, rho, rms, scale, eps, counter)

    @cuda.jit(device=True, inline=True)
    def block_product(  # noqa: ANN202, C901
        x, w1, s1, w3, s3, out, scale, nw, rho, x_next, slots, counter, rms, eps,
        bias, has_bias, freqs, state, k_cache, v_cache, q_dim, kv_dim, head_dim,
    ):  # noqa: ANN001  # fmt: skip
        """The block's tiles of out (=, +=, gate) X fp16 times W^T stored; s1, s3: q8 / q4
        scales of W1 and W3 (unread otherwise). SCALED: scale (T,), each row's factor; FOLD: nw
        (N,) the next norm's weights, rho (T,), and x_next (T, N) fp16, slots (T, ceil(N / 16)),
        rms (T,) and scale written (counter (1,) int32: zero between launches). rope: out is q
        (T, q_dim), and the rest of the QKV epilogue's arguments are qkv_rows's."""
        # (warps, RED_ACC, 32) each warp's sums of a part of an A tile, lane-major
        red = cuda.shared.array((warps, RED_ACC, 32), float32)
        sq = cuda.shared.array(SQ_WORDS, float32)  # FOLD: (MT, T_MAX, 16) the outputs' squares
        last = cuda.shared.array(1, int32)  # FOLD: 1 in the block that counts itself last
        wg = cuda.local.array(W_WORDS, int32)  # the chunk's units of row g, (step, A tile)
        wh = cuda.local.array(W_WORDS, int32)  # ... of row g + 8 (GATE: W3's row g)
        dm = cuda.local.array(DM_WORDS, int32)  # q4: the (d, m) words of row g's and row g + 8's units
        a = cuda.local.array(A_WORDS, int32)  # A fragments of two k-tiles, a0..a3 a k-tile, each A tile
        xb = cuda.local.array(X_WORDS, int32)  # B words: a chunk's (PREFETCH_X), or 16 bytes of an n-tile's
        acc = cuda.local.array(ACC, float32)  # (row_tiles, n_tiles, 4) C fragments
        for i in range(ACC):
            acc[i] = float32(0.0)
        for i in range(X_WORDS):  # (finite words for the tokens past T: load_x)
            xb[i] = int32(0)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        if fold:
            for i in range(tid, SQ_WORDS, 32 * warps):  # (a square past N or T stays zero)
                sq[i] = float32(0.0)
        g, t = lane >> 2, lane & 3
        n_rows = w1.shape[0]
        t_rows, k_cols = x.shape[0], x.shape[1] * 2  # x: (T, K / 2) words
        tile0 = cuda.blockIdx.x * MT  # the block's first A tile
        n_steps = (k_cols + STEP - 1) // STEP
        # q4: a group's columns G = K / groups, 32 or 64 (pycalm.model.formats.Q4_GROUPS), as a
        # shift: the group of a column is then a shift, not a 64-bit division in the loop
        g_shift = 5 if s1.shape[s1.ndim - 1] * 32 == k_cols else 6  # (read by q4 only)
        dependent_start()  # in a programmatic graph: wait for the kernel that wrote X (and out)

        chunk = warp
        if PEEL:
            full = k_cols // (unroll * STEP)  # the chunks whose columns all lie in K
            while chunk < full:  # warp-uniform
                chunk_product(x, w1, s1, w3, s3, chunk, False, tile0, g, t, n_rows, t_rows, k_cols, g_shift,
                              wg, wh, dm, a, xb, acc)  # fmt: skip
                chunk += warps
        while chunk * unroll < n_steps:  # the rest (PEEL: the last chunk, past K in part), loads checked
            chunk_product(x, w1, s1, w3, s3, chunk, True, tile0, g, t, n_rows, t_rows, k_cols, g_shift,
                          wg, wh, dm, a, xb, acc)  # fmt: skip
            chunk += warps

        n_cols = n_rows if qkv_out else out.shape[1]  # (qkv_out: out is q, a part of the outputs)
        for part in range(MT * RED_PARTS):  # each A tile's sums, a part at a time: the warps' meet in red
            m, first = part // RED_PARTS, (part % RED_PARTS) * RED_ACC  # the tile, its first accumulator here
            if part > 0:
                cuda.syncthreads()  # the last part's sums are read: red is free again
            for i in range(RED_ACC):
                red[warp, i, lane] = acc[m * ACC1 + first + i]
            cuda.syncthreads()  # every warp's partial sums of this part are in red
            for e in range(tid, RED_ACC * 32, threads):  # (accumulator i, lane l) of the part, in order
                j, ln = e // 32, e % 32
                s = red[0, j, ln]
                for v in range(1, warps):  # the warps' parts in a fixed order
                    s += red[v, j, ln]
                i = first + j  # the accumulator in the tile
                # accumulator i = 4 p + r of lane ln: A row (ln >> 2) + 8 (r >> 1), token 8 p + 2 (ln & 3) + (r & 1)
                p, r = i // 4, i % 4
                token = 8 * p + 2 * (ln & 3) + (r & 1)
                if gate:
                    if r < 2:  # r: W1's sum, r + 2: W3's, of output (tile) * 8 + (ln >> 2)
                        col = (tile0 + m) * 8 + (ln >> 2)
                        h3 = red[0, j + 2, ln]
                        for v in range(1, warps):
                            h3 += red[v, j + 2, ln]
                        if token < t_rows and col < n_cols:
                            store_gate(s, h3, token, col, out, s1, s3, scale)
                elif qkv_out:
                    # a rotary pair: columns 2c, 2c + 1 are lanes ln and ln + 4 (A rows g, g + 1),
                    # the same accumulator; the lane of the even row finishes both
                    col = (tile0 + m) * 16 + (ln >> 2) + 8 * (r >> 1)
                    if (ln >> 2) % 2 == 0 and token < t_rows and col < n_cols:
                        b = red[0, j, ln + 4]
                        for v in range(1, warps):
                            b += red[v, j, ln + 4]
                        if q8:
                            s *= s1[col]
                            b *= s1[col + 1]
                        if scaled:
                            s *= scale[token]
                            b *= scale[token]
                        pos = state[STATE_POS] + token
                        store_pair(s, b, col, bias, has_bias, freqs, pos, pos, out[token], k_cache, v_cache,
                                   q_dim, kv_dim, head_dim)  # fmt: skip
                else:
                    c16 = (ln >> 2) + 8 * (r >> 1)  # the column in the tile
                    col = (tile0 + m) * 16 + c16
                    if token < t_rows and col < n_cols:
                        y = store_sum(s, token, col, out, s1, scale, nw, rho, x_next)
                        if fold:  # y^2, for the next norm
                            sq[(m * T_MAX + token) * 16 + c16] = y * y
        if fold:
            fold_norm(sq, last, tile0, t_rows, n_cols, rho, slots, counter, rms, scale, eps)

    # blocks of 16 warps take launch bounds: the compiler then keeps a thread within the 128
    # registers such a block may have of an SM's 65,536 (q4 at 32 rows: 105, against 134 unbounded,
    # which fails to launch); at 64 rows (batch-invariant passes only) 4-bit weights spill 20-72
    # bytes there. 8 warps need none (at most 140 of 255), and a bound there spilled fp8's gate.
    if min_blocks:
        bounds = {"launch_bounds": (threads, min_blocks)}
    else:
        bounds = {"launch_bounds": (threads,)} if threads > 256 else {}
    jit = cuda.jit if SIM else cuda.jit(cache=True, **bounds)

    # the norm's arrays of a kernel that takes none are never read (its branches are pruned at
    # compile time): out stands in for them
    zero, i0 = float32(0.0), int32(0)  # (the arguments a kernel does not read)
    if rope:

        @jit
        def skinny_kernel(  # noqa: ANN202
            x, w1, s1, q, scale, bias, has_bias, freqs, state, k_cache, v_cache, q_dim, kv_dim, head_dim
        ):  # noqa: ANN001
            """PLAIN into the QKV epilogue: q (T, q_dim) = rope(X Wqkv^T + bq), the cache rows
            pos0 + t = rope(k + bk), v + bv (pycalm.kernels.rows.qkv_rows's bits); scale as
            SCALED's where scaled. s1: q8 / q4 scales (else W1 again: unread)."""
            block_product(x, w1, s1, w1, s1, q, scale, q, q, q, q, q, q, zero,
                          bias, has_bias, freqs, state, k_cache, v_cache, q_dim, kv_dim, head_dim)  # fmt: skip

    elif fold:

        @jit
        def skinny_kernel(x, w1, s1, w3, s3, out, nw, rho, x_next, slots, counter, rms, scale, eps):  # noqa: ANN001, ANN202
            """RESIDUAL with the next RMSNorm folded in: out += X W^T; x_next = fp16(out nw rho);
            rms, scale = rms / rho (pycalm.cpu.reference.matmul_residual_fold_ref). s1, s3: q8 /
            q4 scales (else W1, W3 again: unread)."""
            block_product(x, w1, s1, w3, s3, out, scale, nw, rho, x_next, slots, counter, rms, eps,
                          out, i0, out, out, out, out, i0, i0, i0)  # fmt: skip

    elif scaled:

        @jit
        def skinny_kernel(x, w1, s1, w3, s3, out, scale):  # noqa: ANN001, ANN202
            """PLAIN or GATE with each row's sums times scale[row] (matmul_ref's and
            matmul_gate_ref's scale). s1, s3 as above."""
            block_product(x, w1, s1, w3, s3, out, scale, out, out, out, out, out, out, zero,
                          out, i0, out, out, out, out, i0, i0, i0)  # fmt: skip

    elif q8 or q4:

        @jit
        def skinny_kernel(x, w1, s1, w3, s3, out):  # noqa: ANN001, ANN202
            """The kernel below for q8 / q4: codes w and scales s (q8 (N,), q4 (N, groups, 2))."""
            block_product(x, w1, s1, w3, s3, out, out, out, out, out, out, out, out, zero,
                          out, i0, out, out, out, out, i0, i0, i0)  # fmt: skip

    else:

        @jit
        def skinny_kernel(x, w1, w3, out):  # noqa: ANN001, ANN202
            """out (T, N) (=, +=, gate) X (T, K) fp16 (as (T, K / 2) words) times W (N, K)^T
            stored; see the module docstring. Must match pycalm.cpu.reference.matmul_ref /
            matmul_residual_ref / matmul_gate_ref."""
            block_product(x, w1, w1, w3, w3, out, out, out, out, out, out, out, out, zero,
                          out, i0, out, out, out, out, i0, i0, i0)  # no scales  # fmt: skip

    return skinny_kernel


def stored_args(w: object, w3: object, dtype: str, k_cols: int) -> tuple:
    """The kernel's weight arguments as it reads them: fp16 as (N, K / 2) words of two halves, q4's
    scales as (N, groups) words of (d, m); the rest as matmul's weight_args."""
    args = weight_args(w, w3, dtype, k_cols)
    if dtype == "fp16":
        return tuple(a.view(np.uint32) for a in args)
    if dtype == "q4":
        c1, s1, c3, s3 = args
        return c1, s1.view(np.uint32).reshape(s1.shape[:2]), c3, s3.view(np.uint32).reshape(s3.shape[:2])
    return args


def block_shape(dtype: str, t_rows: int, k_cols: int) -> tuple[int, int, int, int]:
    """(warps, n_tiles, row_tiles, x_words) of a launch over T rows and K columns of a dtype, or
    a PycalmError where K does not fit (fits)."""
    if not fits(dtype, k_cols):
        raise PycalmError(
            f"the skinny matmul needs K a multiple of {UNIT.get(dtype, 8)} for {dtype}, got {k_cols}"
        )
    n_tiles = n_tiles_for(t_rows)
    return warps_for(k_cols, dtype), n_tiles, row_tiles_for(dtype, n_tiles), x_words_for(dtype, n_tiles)


def skinny_qkv(
    x: object,
    w: object,
    dtype: str,
    layer: object,
    rope_freqs: object,
    state: object,
    q: object,
    cache: object,
    cfg: object,
    *,
    stream: object,
    scale: object = None,
) -> None:
    """The QKV product of T <= MAX_ROWS rows with qkv_rows's epilogue in its own: q (T, q_dim) =
    rope(X Wqkv^T + bq), cache rows pos0 + t (pos0 = state[STATE_POS]) = rope(k + bk), v + bv,
    the bits of skinny_matmul then pycalm.kernels.rows.qkv_rows (whose arguments these are: layer
    .bqkv, cache a KVCache, cfg the sizes); scale as skinny_matmul's."""
    t_rows, k_cols = x.shape
    args = stored_args(w, None, dtype, k_cols)  # (the first: W's stored rows, one a qkv column)
    check_qkv("skinny_qkv", (t_rows, args[0].shape[0]), q, cache, cfg)
    warps, n_tiles, row_tiles, x_words = block_shape(dtype, t_rows, k_cols)
    norm = NO_NORM if scale is None else SCALED
    kernel = make_skinny_kernel(
        dtype, MODES["plain"], n_tiles, warps, UNROLL, 0, row_tiles, x_words, norm, cache.dtype
    )
    w1, s1 = (args[0], args[1]) if len(args) == 4 else (args[0], args[0])  # (W1 again: unread)
    bias = layer.bqkv
    kernel[blocks_for(cfg.qkv_dim, "plain", row_tiles), 32 * warps, stream](
        x.view(np.uint32), w1, s1, q, rope_freqs if scale is None else scale, rope_freqs if bias is None else bias,
        np.int32(bias is not None), rope_freqs, state, cache.k, cache.v, cfg.q_dim, cfg.kv_dim, cfg.head_dim,
    )  # fmt: skip


@dataclass(frozen=True)
class NormFold:
    """The next RMSNorm folded into a RESIDUAL launch (FOLD): its weights, and the arrays the
    launch reads and writes (pycalm.gpu.prefill.RowBuffers holds them)."""

    w: object  # (N,) float32, the next norm's weights
    rho: object  # (T,) float32, read: the scale xb is written at (the last norm's rms)
    xb: object  # (T, N) float16, written: fp16(out * w * rho), the next product's X
    slots: object  # (T, ceil(N / 16)) float32 scratch: each 16-column tile's sum of squares
    counter: object  # (1,) int32, zero between launches
    rms: object  # (T,) float32, written: rsqrt(mean(out^2) + eps)
    scale: object  # (T,) float32, written: rms / rho, the next product's factor (skinny_matmul's scale)
    eps: float


def slot_count(n_cols: int) -> int:
    """NormFold.slots' columns for a residual stream of n_cols columns: a 16-column tile each."""
    return (n_cols + 15) // 16


def norm_part(kind: str, mode: str, scale: object, fold: NormFold | None) -> tuple[int, tuple]:
    """A launch's RMSNorm part (NO_NORM, SCALED or FOLD) and the kernel arguments it adds after
    out, for `kind`'s products (skinny's, pycalm.kernels.panel's): scale (T,) for plain and gate
    launches, fold (NormFold) for residual ones."""
    if (scale is not None and mode == "residual") or (fold is not None and mode != "residual"):
        raise PycalmError(
            f"the {kind} matmul scales plain and gate sums and folds a norm into residual ones, not {mode}"
        )
    if fold is not None:
        f = fold
        return FOLD, (f.w, f.rho, f.xb, f.slots, f.counter, f.rms, f.scale, np.float32(f.eps))
    if scale is not None:
        return SCALED, (scale,)
    return NO_NORM, ()


def skinny_matmul(
    x: object,
    w: object,
    out: object,
    dtype: str,
    *,
    stream: object,
    mode: str = "plain",
    w3: object = None,
    scale: object = None,
    fold: NormFold | None = None,
) -> None:
    """out = X W^T ("plain"), out += X W^T ("residual"), or out = silu(X W^T) * (X W3^T)
    ("gate"), as pycalm.kernels.matmul.matmul, for X (T, K) float16 with T <= MAX_ROWS and K a
    multiple of UNIT[dtype] (fits). scale (T,) float32 ("plain", "gate"): each row's sums times
    it; fold ("residual"): the next RMSNorm folded in (NormFold)."""
    check_mode(mode, w3)
    t_rows, k_cols = x.shape
    warps, n_tiles, row_tiles, x_words = block_shape(dtype, t_rows, k_cols)
    norm, norm_args = norm_part("skinny", mode, scale, fold)
    kernel = make_skinny_kernel(dtype, MODES[mode], n_tiles, warps, UNROLL, 0, row_tiles, x_words, norm)
    args = stored_args(w, w3, dtype, k_cols)
    if norm != NO_NORM and len(args) == 2:  # the norm kernels take scales' places in every format
        args = (args[0], args[0], args[1], args[1])
    grid = blocks_for(out.shape[1], mode, row_tiles)
    kernel[grid, 32 * warps, stream](x.view(np.uint32), *args, out, *norm_args)
