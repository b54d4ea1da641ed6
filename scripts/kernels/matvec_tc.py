"""q4 matrix-vector products on the tensor cores: an experiment against the shipped row-group
kernel (llm.c's dev/cuda pattern; pycalm.kernels.matvec is what the package runs).

The question it answers: does the q4 decode get faster when the multiply-adds go to the tensor
cores? The shipped kernels take about the same time a launch in every format (H200, 14336 x 4096:
fp8 19.8 us, gf4 18.4, q4 19.5 for half the bytes) at about 3.2 instructions a weight, so the
instructions looked like the bound. Here one mma.sync m16n8k16 does 256 multiply-adds of
(16 + q) x. Answer (docs/BENCHMARKS.md at b282afd, sixth 2026-12-02 session): no. The kernel is correct
(within 1.2e-7 of sum |w| |x|), but its SASS still spends 3.0 instructions a weight (decode one,
then 64-bit addresses, scale loads and the fold) and its best launch shape takes 20.2 us, the
shipped kernel's time; only a decode of about one instruction a weight in total would change
that (int8 mma on nibbles masked into bytes, x in int8 limbs: not written).

Mapping. A warp takes a tile of 16 rows (A's rows: lane (g, t) holds rows g and g + 8) and
steps along K by 128 columns: lane t of a quad loads 16 bytes (32 codes, columns 128 s + 32 t ..
+31) of rows g and g + 8, one ldg128 each. Its four words give eight mma A fragments (word j,
half h: nibble pairs (2h, 2h+4) and (2h+1, 2h+5) of rows g and g + 8). The quad's four lanes
hold four different column regions, so one mma's k-sum would mix four groups' scales; B keeps
them apart: B's column n = t' (n < 4) holds x's fp16 high part at region t''s columns and zero
elsewhere, column 4 + t' its low part (x - fp16(x)), so C[row, n] is region n & 3's sum of
(16 + q) x_hi (n < 4) or x_lo. A step's eight mma accumulate the four regions apart; then each
lane folds its two C columns of rows g and g + 8 with their groups' (d, m): d S + (m - 16 d) X
(X the region's x sum, float32, added once: by the high-part lanes). The products are exact
(11-bit by 11-bit) and summed in float32; x is carried to 22 bits by the two parts.

x is staged once per block in shared memory as the B fragments (uint64: b0 low, b1 high) in
mma order, region by region (9 uint64 a region: one of padding, so the eight lanes that load
real B values hit distinct banks), the high parts, then the low parts, then 8 zeros that the 24
other lanes read. A block is TILES x KSPLIT warps: TILES row tiles at once, each split over
KSPLIT warps along K (steps s = ks, ks + KSPLIT, ..., or a contiguous range of steps), their
sums added in shared memory in a fixed order; blocks loop over the tiles (grid-stride). U steps'
loads are issued together, the next U steps' before this U's arithmetic (two buffers), and the
first tile's before x is staged.

    python scripts/kernels/matvec_tc.py               # check, then time against the shipped kernel
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/matvec_tc.py --check --tiny
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
from numba import config as numba_config
from numba import cuda, float32, int32, uint32, uint64

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (pycalm)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ (gpubench)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/kernels (matvec.py)

from pycalm.cpu.reference import matvec_ref  # noqa: E402
from pycalm.kernels.common import WARP, and_or, h2f2, sar32, shl32  # noqa: E402
from pycalm.kernels.tensorcore import ldg128w, mma_16816, pack_f16x2  # noqa: E402
from pycalm.model import formats  # noqa: E402

SIM = numba_config.ENABLE_CUDASIM
Q4_NIBBLE_MASK = 0x03C003C0  # bits 6..9 of each half: a nibble there has the mantissa unit 1 ...
Q4_HALVES = 0x4C004C00  # ... under the fp16 exponent of 16: the half reads as 16 + q
Q4_OFFSET = 16.0  # what q4_pairs adds to every code
KMAX = 8192  # columns of x staged at once (the experiment takes rows of up to KMAX)
REGIONS = KMAX // 32
RSTRIDE = 9  # uint64 a staged region: 8 B fragments and one of padding
PSTRIDE = REGIONS * RSTRIDE + 4  # uint64 from the high parts to the low parts (bank offset 8 words)
ZERO = 2 * PSTRIDE  # 8 zero uint64: the B of lanes whose column n is not theirs
XS_LEN = ZERO + 8
XSUM_LEN = 2 * REGIONS


@cuda.jit(device=True, inline=True)
def q4_pairs(w: int) -> tuple[int, int, int, int]:
    """The eight codes of the int32 w as four fp16x2 words of 16 + q: nibbles (0, 4), (1, 5),
    (2, 6), (3, 7): a shift moves nibbles k and k + 4 to bits 6..9 of the two halves, one LOP3 masks
    them under the exponent of 16."""
    m, e = int32(Q4_NIBBLE_MASK), int32(Q4_HALVES)
    return (
        and_or(shl32(w, 6), m, e),
        and_or(shl32(w, 2), m, e),
        and_or(sar32(w, 2), m, e),
        and_or(sar32(w, 6), m, e),
    )


@functools.cache
def make_kernel(tiles: int, ksplit: int, unroll: int, contig: bool = False):  # noqa: ANN201, C901
    """The q4 tensor-core matvec out = W x for compile-time TILES, KSPLIT and U (contig: a warp
    takes a contiguous K range of steps instead of every KSPLIT-th step)."""
    WORDS = 8 * unroll  # a step: 4 words of row g, 4 of row g + 8
    RED = tiles * ksplit * 16
    SW = 4 * unroll  # a step: the scale words of rows g, g + 8 for two groups

    @cuda.jit(device=True, inline=True)
    def load(codes, scales, row_g, row_g8, s0, s_last, KS, ut, r0, ugsh, w, sw):  # noqa: ANN001, ANN202
        """Codes and scale words of steps s0, s0 + KS, ... (U of them, clamped to the row's last step)."""
        for u in range(unroll):
            s = min(s0 + uint64(u) * KS, s_last)
            col = uint64(16) * s + uint64(4) * ut
            w[8 * u], w[8 * u + 1], w[8 * u + 2], w[8 * u + 3] = ldg128w(codes, row_g, col)
            w[8 * u + 4], w[8 * u + 5], w[8 * u + 6], w[8 * u + 7] = ldg128w(codes, row_g8, col)
            for c in range(2):  # the (d, m) words of this lane's two C columns' groups
                grp = (uint64(4) * s + r0 + uint64(c)) >> ugsh
                sw[4 * u + c] = scales[row_g, grp]
                sw[4 * u + 2 + c] = scales[row_g8, grp]

    @cuda.jit(device=True, inline=True)
    def compute(xs, xsum, s0, n_st, KS, b_base, b_step, jm, x_base, r0, w, sw, acc_g, acc_g8):  # noqa: ANN001, ANN202
        """acc += the U steps' sums (w, sw from load)."""
        for u in range(unroll):
            s = s0 + uint64(u) * KS
            if s < n_st:
                bb = b_base + s * b_step
                c0 = c1 = c2 = c3 = float32(0.0)
                for j in range(4):
                    p0, p1, p2, p3 = q4_pairs(w[8 * u + j])
                    q0, q1, q2, q3 = q4_pairs(w[8 * u + 4 + j])
                    b = xs[bb + uint64(2 * j) * jm]
                    c0, c1, c2, c3 = mma_16816(
                        p0, q0, p1, q1, int32(b & uint64(0xFFFFFFFF)), int32(b >> uint64(32)), c0, c1, c2, c3
                    )
                    b = xs[bb + uint64(2 * j + 1) * jm]
                    c0, c1, c2, c3 = mma_16816(
                        p2, q2, p3, q3, int32(b & uint64(0xFFFFFFFF)), int32(b >> uint64(32)), c0, c1, c2, c3
                    )
                # fold: C columns 2t, 2t + 1 are regions r0, r0 + 1 of rows g, g + 8
                xi = x_base + uint64(4) * s + r0
                x0, x1 = xsum[xi], xsum[xi + uint64(1)]
                d0, m0 = h2f2(int32(sw[4 * u]))
                d1, m1 = h2f2(int32(sw[4 * u + 1]))
                acc_g += d0 * c0 + (m0 - float32(Q4_OFFSET) * d0) * x0
                acc_g += d1 * c1 + (m1 - float32(Q4_OFFSET) * d1) * x1
                d0, m0 = h2f2(int32(sw[4 * u + 2]))
                d1, m1 = h2f2(int32(sw[4 * u + 3]))
                acc_g8 += d0 * c2 + (m0 - float32(Q4_OFFSET) * d0) * x0
                acc_g8 += d1 * c3 + (m1 - float32(Q4_OFFSET) * d1) * x1
        return acc_g, acc_g8

    @cuda.jit(fastmath=False)
    def kernel(codes, scales, x, out):  # noqa: ANN001, ANN202
        xs = cuda.shared.array(XS_LEN, uint64)  # B fragments of x: (part, region, 8) + padding, zeros
        xsum = cuda.shared.array(XSUM_LEN, float32)  # region x sums, then zeros (low-part lanes)
        red = cuda.shared.array(RED, float32)  # the K-split warps' row sums
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        ti, ks = warp // ksplit, warp % ksplit
        g, t = lane >> 2, lane & 3
        n_rows = codes.shape[0]
        k_cols = x.shape[0]
        n_regions = k_cols // 32
        n_steps = k_cols // 128
        gsh = 1 if k_cols // scales.shape[1] == 64 else 0  # log2(regions a group)
        U1, U0 = uint64(1), uint64(0)
        ug, ut = uint64(g), uint64(t)
        real = g == t or g == t + 4  # lanes holding B values (the others read zeros)
        jm = U1 if real else U0  # their B index moves with the step and the mma
        b_base = (U0 if g == t else uint64(PSTRIDE)) + ut * uint64(RSTRIDE) if real else uint64(ZERO)
        b_step = uint64(4 * RSTRIDE) * jm  # a step moves 4 regions
        x_base = U0 if t < 2 else uint64(REGIONS)  # low-part lanes read zero x sums
        r0 = uint64(2) * (ut & U1)  # this lane's first C column's region
        n_tiles = uint64((n_rows + 15) // 16)
        last_row = uint64(n_rows - 1)
        n_st = uint64((ks + 1) * n_steps // ksplit) if contig else uint64(n_steps)  # this warp's step end
        ugsh = uint64(gsh)
        s_last = uint64(n_steps - 1)  # loads past a warp's range are clamped here (never used)
        uks = uint64(ks * n_steps // ksplit) if contig else uint64(ks)  # this warp's first step
        KS = uint64(1) if contig else uint64(ksplit)  # its step stride
        w = cuda.local.array(WORDS, int32)
        sw = cuda.local.array(SW, uint32)  # the steps' scale words
        w2 = cuda.local.array(WORDS, int32)  # the other buffer: the next steps' loads
        sw2 = cuda.local.array(SW, uint32)
        tile = uint64(cuda.blockIdx.x * tiles + ti)
        # the first tile's first loads go out before x is staged: the weights stream in meanwhile
        row_g = min(tile * uint64(16) + ug, last_row)
        row_g8 = min(tile * uint64(16) + ug + uint64(8), last_row)
        load(codes, scales, row_g, row_g8, uks, s_last, KS, ut, r0, ugsh, w, sw)
        first = True
        # stage x: 8 columns a thread at a time -> 4 pairs (x_p, x_p+4) as fp16 high and low parts
        words_hi = cuda.local.array(2, int32)
        words_lo = cuda.local.array(2, int32)
        for c8 in range(tid, k_cols // 8, cuda.blockDim.x):
            region, j = c8 // 4, c8 % 4
            for h in range(2):
                for b in range(2):
                    p = 2 * h + b
                    a0, a1 = x[8 * c8 + p], x[8 * c8 + p + 4]
                    hw = pack_f16x2(a0, a1)
                    f0, f1 = h2f2(hw)
                    words_hi[b] = hw
                    words_lo[b] = pack_f16x2(a0 - f0, a1 - f1)
                k = region * RSTRIDE + 2 * j + h
                xs[k] = uint64(uint32(words_hi[0])) | (uint64(uint32(words_hi[1])) << uint64(32))
                xs[PSTRIDE + k] = uint64(uint32(words_lo[0])) | (uint64(uint32(words_lo[1])) << uint64(32))
        xv = cuda.local.array(32, float32)
        for r in range(tid, n_regions, cuda.blockDim.x):
            for c in range(32):
                xv[c] = x[32 * r + c]
            s = float32(0.0)
            for c in range(32):
                s += xv[c]
            xsum[r] = s
            xsum[REGIONS + r] = float32(0.0)
        if tid < 8:
            xs[ZERO + tid] = uint64(0)
        cuda.syncthreads()  # x, its sums and the zeros staged
        while tile - uint64(ti) < n_tiles:
            row_g = min(tile * uint64(16) + ug, last_row)
            row_g8 = min(tile * uint64(16) + ug + uint64(8), last_row)
            acc_g = float32(0.0)
            acc_g8 = float32(0.0)
            s0 = uks
            STEPU = KS * uint64(unroll)  # noqa: N806
            if not first:
                load(codes, scales, row_g, row_g8, s0, s_last, KS, ut, r0, ugsh, w, sw)
            first = False
            while True:  # two iterations a turn: each computes one buffer while the other loads
                s1 = s0 + STEPU
                load(codes, scales, row_g, row_g8, s1, s_last, KS, ut, r0, ugsh, w2, sw2)
                acc_g, acc_g8 = compute(
                    xs, xsum, s0, n_st, KS, b_base, b_step, jm, x_base, r0, w, sw, acc_g, acc_g8
                )
                if s1 >= n_st:
                    break
                s0 = s1 + STEPU
                load(codes, scales, row_g, row_g8, s0, s_last, KS, ut, r0, ugsh, w, sw)
                acc_g, acc_g8 = compute(
                    xs, xsum, s1, n_st, KS, b_base, b_step, jm, x_base, r0, w2, sw2, acc_g, acc_g8
                )
                if s0 >= n_st:
                    break
            # the quad's four lanes hold the four regions' sums: add them (fixed order)
            acc_g += cuda.shfl_xor_sync(0xFFFFFFFF, acc_g, 1)
            acc_g8 += cuda.shfl_xor_sync(0xFFFFFFFF, acc_g8, 1)
            acc_g += cuda.shfl_xor_sync(0xFFFFFFFF, acc_g, 2)
            acc_g8 += cuda.shfl_xor_sync(0xFFFFFFFF, acc_g8, 2)
            rw = uint64((ti * ksplit + ks) * 16)
            if t == 0:
                red[rw + ug] = acc_g
                red[rw + ug + uint64(8)] = acc_g8
            cuda.syncthreads()  # every K-split warp's sums in red
            if ks == 0 and lane < 16:
                total = float32(0.0)
                for k in range(ksplit):
                    total += red[uint64((ti * ksplit + k) * 16 + lane)]
                row = tile * uint64(16) + uint64(lane)
                if row <= last_row:
                    out[row] = total
            cuda.syncthreads()  # red read before the next round writes it
            tile += uint64(cuda.gridDim.x * tiles)

    return kernel


def launch(codes: object, scales: object, x: object, out: object, tiles: int, ksplit: int, unroll: int,
           blocks_per_sm: int, contig: int = 0, stream: object = 0) -> None:  # fmt: skip
    n_tiles = (codes.shape[0] + 15) // 16
    if SIM:
        blocks = 2
    else:
        blocks = min(-(-n_tiles // tiles), 132 * blocks_per_sm)
    make_kernel(tiles, ksplit, unroll, bool(contig))[blocks, tiles * ksplit * WARP, stream](
        codes, scales, x, out
    )


def check(rows: int, cols: int, group: int, cfg: tuple, rng: np.random.Generator) -> float:
    w = formats.q4_encode(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, group)
    x = rng.standard_normal(cols).astype(np.float32)
    want = matvec_ref(w, x, "q4")
    scale = np.abs(formats.decode(w, "q4")) @ np.abs(x)
    codes = cuda.to_device(w.codes)
    scales = cuda.to_device(np.ascontiguousarray(w.scales).view(np.uint32).reshape(rows, -1))
    out = cuda.device_array(rows, np.float32)
    launch(codes, scales, cuda.to_device(x), out, *cfg)
    got = out.copy_to_host()
    return float(np.max(np.abs(got - want) / scale))


CONFIGS = [  # (tiles, ksplit, unroll, blocks an SM, contiguous K split)
    (7, 2, 2, 1, 0), (7, 2, 2, 1, 1), (7, 2, 4, 1, 1), (4, 4, 2, 2, 1), (4, 4, 4, 2, 1), (2, 8, 2, 2, 1),
    (2, 4, 4, 4, 1), (14, 1, 4, 1, 0), (14, 1, 2, 1, 0), (7, 1, 4, 2, 0),
]  # fmt: skip
SHAPES = [(14336, 4096), (4096, 4096), (6144, 4096), (2048, 2048), (5632, 2048), (4096, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--profile",
        default="",
        help="TILES,KSPLIT,U,BPS: one launch of it and of the shipped kernel (for ncu)",
    )
    args = ap.parse_args()
    if args.profile:
        profile(tuple(int(v) for v in args.profile.split(",")))
        return
    rng = np.random.default_rng(0)
    shapes = [(37, 256, 32), (16, 384, 64)] if args.tiny else [(1000, 4096, 32), (333, 2048, 64)]
    cfgs = [(1, 2, 2, 1, 0), (2, 1, 1, 1, 0), (1, 3, 2, 1, 1)] if SIM else CONFIGS
    refused = set()
    for rows, cols, group in shapes:
        for cfg in cfgs:
            try:
                err = check(rows, cols, group, cfg, rng)
            except Exception as e:  # noqa: BLE001  (too many registers for the block, and the like)
                print(f"check {cfg}: refused ({type(e).__name__})", flush=True)
                refused.add(cfg)
                continue
            print(f"check {rows}x{cols} G{group} {cfg}: max err / sum|w||x| {err:.2e}", flush=True)
            assert err < 1e-5, err
    if args.check or SIM:
        return
    import matvec as mvx

    s = cuda.stream()
    for rows, cols in SHAPES:
        ws = [mvx.random_weights(rows, cols, "q4", i) for i in range(mvx.n_copies(rows, cols, "q4"))]
        xd = cuda.to_device(rng.standard_normal(cols).astype(np.float32))
        y = cuda.device_array(rows, np.float32)
        nb = mvx.bytes_moved(mvx.mv.PLAIN, ws[0], xd, False)
        line = []
        t = mvx.time_version(s, mvx.V(), ws, xd, y, None, "q4", mvx.mv.PLAIN)
        line.append(f"shipped {nb / t / 1e9:.0f} ({t * 1e6:.1f} us)")
        for other in ("gf4", "fp8"):  # the shipped kernel in the formats it is compared with
            wo = [mvx.random_weights(rows, cols, other, i) for i in range(mvx.n_copies(rows, cols, other))]
            t = mvx.time_version(s, mvx.V(), wo, xd, y, None, other, mvx.mv.PLAIN)
            line.append(f"{other} {t * 1e6:.1f} us")
            del wo
        for cfg in [c for c in CONFIGS if c not in refused]:
            pairs = [(w.codes, as_words(w.scales, rows)) for w in ws]

            def run(i: int, cfg: tuple = cfg, pairs: list = pairs, xd: object = xd, y: object = y) -> None:
                c, sw = pairs[i % len(pairs)]
                launch(c, sw, xd, y, *cfg, stream=s)

            try:
                t = mvx.timed(s, run, max(len(pairs), 16))
            except Exception as e:  # noqa: BLE001
                line.append(f"{cfg}: {type(e).__name__}")
                continue
            line.append(f"{cfg} {nb / t / 1e9:.0f} ({t * 1e6:.1f} us)")
        print(f"q4 {rows}x{cols}: " + " | ".join(line), flush=True)
        del ws


def profile(cfg: tuple) -> None:
    """One 14336 x 4096 launch of cfg and of the shipped kernel, twice each (run under ncu)."""
    import matvec as mvx

    rows, cols = 14336, 4096
    w = mvx.random_weights(rows, cols, "q4", 0)
    xd = cuda.to_device(np.random.default_rng(0).standard_normal(cols).astype(np.float32))
    y = cuda.device_array(rows, np.float32)
    for _ in range(2):
        launch(w.codes, as_words(w.scales, rows), xd, y, *cfg)
        mvx.launch_version(mvx.V(), w, w, xd, None, y, "q4", mvx.mv.PLAIN, 0)
    cuda.synchronize()


def as_words(scales: object, rows: int) -> object:
    """A device q4 scales array (rows, groups, 2) float16 as (rows, groups) uint32 words."""
    return scales.reshape(rows, scales.shape[1] * 2).view(np.uint32)


if __name__ == "__main__":
    main()
