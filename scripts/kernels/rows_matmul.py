"""Weight products for a few rows (T = 1..64): the kernels that could run the rows pass, timed
against each other on the Llama-3-8B shapes (llm.c's dev/cuda pattern; pycalm.kernels.skinny
and pycalm.kernels.matmul are what the package runs).

Versions:
  matvec   pycalm.kernels.matvec, the token step's kernel (T = 1 only: the bar for one row)
  tile     pycalm.kernels.matmul with its row tile (16 x 32, T <= 16), its 64 x 128 tile (T <= 64)
           or its 128 x 128 tile, K walked by one block a tile
  split    the same tiles with K split over blocks where the tiles leave SMs idle (the rows
           pass's launches above skinny's rows)
  skinny   pycalm.kernels.skinny: weights streamed into mma A fragments, X as B, T <= 64;
           variants of warps a block (splitting K) and steps a warp loads at once
  panel    pycalm.kernels.panel: skinny's weight stream with X staged in shared memory, K split
           over blocks (--panel: block shapes warps,row_tiles,stages,min_blocks,ahead[,wgmma] beside
           split and skinny, each checked against the split tile's outputs; wgmma 1: panel_wg.py,
           the products on Hopper's wgmma)
  r1..r3   scripts/kernels/matmul.py's wgmma rows versions (--wgmma): a 64 x BN tile on Hopper's
           warpgroup instructions, X staged once a block for BN rows of W, K split over blocks
           (checked against the reference first, as matmul.py --wgmma checks them)

    python scripts/kernels/rows_matmul.py                     # table: every dtype, T = 1..64
    python scripts/kernels/rows_matmul.py --sweep             # skinny's warps x unroll at T = 8, 64
    python scripts/kernels/rows_matmul.py --dtypes fp16 --rows 1,8
    python scripts/kernels/rows_matmul.py --wgmma r1,r2,r3 --rows 16,32,64   # beside skinny, split
    python scripts/kernels/rows_matmul.py --panel "8,2,3,0,1;8,1,3,2,2;4,2,3,0,2" --rows 32,64
    python scripts/kernels/rows_matmul.py --panel "16,1,3,1,1;16,1,3,1,1,1" --rows 32,64   # and on wgmma

Each figure is a launch's share of a CUDA graph of REPEAT launches, replayed (the median of 9
replays): kernel time without the host's launch cost, as in the engine's graphs. GB/s counts the
weights' bytes only (what a pass must read).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
from numba import cuda, uint32

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (pycalm)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ (gpubench)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/kernels (matmul.py)

from gpubench import graph_seconds  # noqa: E402
from matmul import WGMMA_VERSIONS, check_wgmma, fill_kernel, row_splits, wgmma_matmul  # noqa: E402
from panel_wg import panel_wg_matmul  # noqa: E402

from pycalm.kernels import panel, skinny  # noqa: E402
from pycalm.kernels.matmul import MODES, SplitScratch, Tile, matmul, matmul_split_scratch, sm_count  # noqa: E402
from pycalm.kernels.matvec import ffn_gate, matvec, matvec_residual  # noqa: E402
from pycalm.model import formats  # noqa: E402

DTYPES = ["fp16", "fp8", "gf4", "q8", "q4"]
# (name, N, K, mode) of a Llama-3-8B layer
SHAPES = [("qkv", 6144, 4096, "plain"), ("wo", 4096, 4096, "residual"), ("gate", 14336, 4096, "gate"),
          ("w2", 4096, 14336, "residual")]  # fmt: skip
REPEAT = 10  # launches a timed graph


STREAM = None  # the stream the timed graphs are captured on (main makes it)


def time_launches(launch: object) -> float:
    """Seconds of one launch, replayed in a graph of REPEAT launches on STREAM."""

    def record() -> None:
        for _ in range(REPEAT):
            launch()

    return graph_seconds(STREAM, record, 9) / REPEAT


MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF, "gf4": 0xFFFFFFBF, "q8": 0x7F7F7F7F, "q4": 0xFFFFFFFF}


def random_words(n_words: int, seed: int, mask: int) -> object:
    words = cuda.device_array(n_words, np.uint32)
    fill_kernel[1024, 256](words, uint32(seed), uint32(mask))
    return words


def random_weights(n: int, k: int, dtype: str, seed: int) -> object:
    """A stored (n, k) matrix of `dtype` with random finite values (q8 / q4: a Quantized)."""
    rows, cols = formats.storage_shape(n, k, dtype)
    storage = formats.STORAGE_DTYPE[dtype]
    codes = (
        random_words(rows * cols * storage.itemsize // 4, seed, MASK[dtype]).view(storage).reshape(rows, cols)
    )
    if dtype == "q8":
        return formats.Quantized(codes, cuda.to_device(np.full(n, 0.01, np.float32)))
    if dtype == "q4":
        scales = np.zeros((n, k // 32, 2), np.float16)
        scales[..., 0], scales[..., 1] = 0.01, -0.08
        return formats.Quantized(codes, cuda.to_device(scales))
    return codes


def weight_bytes(n: int, k: int, dtype: str, gate: bool) -> float:
    return (2 if gate else 1) * n * k * formats.bits_per_weight(dtype, k) / 8


def shape_arrays(n: int, k: int, dtype: str, mode: str) -> tuple:
    """A shape's random weights W (and W3 for the gate), 64 rows of X and the out of 64 rows."""
    w = random_weights(n, k, dtype, 1)
    w3 = random_weights(n, k, dtype, 2) if mode == "gate" else None
    x = random_words(64 * k // 2, 3, MASK["fp16"]).view(np.float16).reshape(64, k)
    out = cuda.device_array((64, n), np.float16 if mode == "gate" else np.float32)
    return w, w3, x, out


def skinny_launch(x, w, w3, out, dtype, mode, warps, unroll, min_blocks=0, row_tiles=0, x_words=0):  # noqa: ANN001, ANN201
    """A skinny launch with a chosen block shape (0: the package's warps_for, UNROLL,
    row_tiles_for, x_words_for)."""
    warps = warps or skinny.warps_for(x.shape[1], dtype)
    n_tiles = skinny.n_tiles_for(x.shape[0])
    row_tiles = row_tiles or skinny.row_tiles_for(dtype, n_tiles)
    x_words = x_words or skinny.x_words_for(dtype, n_tiles)
    kernel = skinny.make_skinny_kernel(
        dtype,
        MODES[mode],
        n_tiles,
        warps,
        unroll or skinny.UNROLL,
        min_blocks,
        row_tiles,
        x_words,
    )
    args = skinny.stored_args(w, w3, dtype, x.shape[1])
    grid = skinny.blocks_for(out.shape[1], mode, row_tiles)
    xw = x.view(np.uint32)
    return lambda: kernel[grid, 32 * warps, STREAM](xw, *args, out)


def tile_launch(x, w, w3, out, dtype, mode, scratch=None, tile=None):  # noqa: ANN001, ANN201
    return lambda: matmul(x, w, out, dtype, stream=STREAM, mode=mode, w3=w3, scratch=scratch, tile=tile)


def matvec_launch(w, w3, x1, out1, dtype, mode):  # noqa: ANN001, ANN201
    if mode == "gate":
        norm = cuda.to_device(np.ones(x1.shape[0], np.float32))
        return lambda: ffn_gate(w, w3, x1, out1, dtype, stream=STREAM, norm_w=norm, eps=1e-5)
    if mode == "residual":
        return lambda: matvec_residual(w, x1, out1, dtype, stream=STREAM)
    return lambda: matvec(w, x1, out1, dtype, stream=STREAM)


def table(dtypes: list[str], rows: list[int], variant: tuple[int, int], tiles: bool) -> None:
    print(f"skinny: warps, unroll, min blocks {variant} (0: the package's); microseconds (GB/s of weights)")
    for dtype in dtypes:
        total: dict[str, list[float]] = {
            "matvec": [0.0],
            "tile": [0.0] * len(rows),
            "split": [0.0] * len(rows),
            "skinny": [0.0] * len(rows),
        }
        scratch = matmul_split_scratch(STREAM)
        for name, n, k, mode in SHAPES:
            w, w3, x, out = shape_arrays(n, k, dtype, mode)
            x1 = cuda.to_device(np.random.default_rng(0).standard_normal(k).astype(np.float32) * 0.1)
            out1 = cuda.device_array(n, np.float32)
            nbytes = weight_bytes(n, k, dtype, mode == "gate")
            mv = time_launches(matvec_launch(w, w3, x1, out1, dtype, mode))
            total["matvec"][0] += mv
            line = [f"{dtype:4s} {name:4s} matvec {mv * 1e6:7.1f} ({nbytes / mv / 1e9:5.0f})"]
            for i, t in enumerate(rows):
                tl = time_launches(tile_launch(x[:t], w, w3, out[:t], dtype, mode)) if tiles else float("nan")
                sp = time_launches(tile_launch(x[:t], w, w3, out[:t], dtype, mode, scratch))
                sk = time_launches(skinny_launch(x[:t], w, w3, out[:t], dtype, mode, *variant))
                total["tile"][i] += tl
                total["split"][i] += sp
                total["skinny"][i] += sk
                line.append(
                    f"T={t}: tile {tl * 1e6:7.1f} split {sp * 1e6:6.1f} ({nbytes / sp / 1e9:5.0f})"
                    f" skinny {sk * 1e6:6.1f} ({nbytes / sk / 1e9:5.0f})"
                )
            print("  ".join(line), flush=True)
        per_layer = "  ".join(
            f"T={t}: tile {total['tile'][i] * 1e6:6.0f} split {total['split'][i] * 1e6:6.0f} "
            f"({total['split'][i] / total['matvec'][0]:.2f}x) skinny {total['skinny'][i] * 1e6:6.0f} "
            f"({total['skinny'][i] / total['matvec'][0]:.2f}x matvec)"
            for i, t in enumerate(rows)
        )
        print(
            f"{dtype} a layer's four products: matvec {total['matvec'][0] * 1e6:.0f} us; {per_layer}",
            flush=True,
        )


def panel_launch(x, w, w3, out, dtype, mode, block, scratch):  # noqa: ANN001, ANN201
    """A panel launch with a chosen block (warps, row_tiles, stages, min_blocks, ahead), or with
    a sixth field 1 (row_tiles 1) panel_wg.py's products on wgmma."""
    scratch = panel.PanelScratch(*scratch)
    if len(block) == 6 and block[5]:
        warps, _, stages, min_blocks, ahead, _ = block
        return lambda: panel_wg_matmul(x, w, out, dtype, stream=STREAM, scratch=scratch, mode=mode, w3=w3,
                                       block=(warps, stages, min_blocks, ahead))  # fmt: skip
    return lambda: panel.panel_matmul(x, w, out, dtype, stream=STREAM, scratch=scratch, mode=mode, w3=w3,
                                      block=tuple(block[:5]))  # fmt: skip


def panel_table(dtypes: list[str], rows: list[int], variants: list[tuple[int, ...]]) -> None:
    """A layer's products by the split tile, skinny and panel block shapes (warps, row_tiles,
    stages, min_blocks, ahead), each panel output checked against the split tile's (max |diff|
    / max |split|)."""
    # a wave's accumulators at 64 rows (32 a thread an A tile; split_count keeps blocks x splits
    # within the SMs), and a counter a block
    words = sm_count() * 32 * 32 * max(v[0] * v[1] for v in variants)
    scratch = (cuda.device_array(words, np.float32), cuda.to_device(np.zeros(sm_count(), np.int32)))
    for dtype in dtypes:
        total = {t: [0.0] * (2 + len(variants)) for t in rows}
        split_scratch = matmul_split_scratch(STREAM)
        for name, n, k, mode in SHAPES:
            w, w3, x, out = shape_arrays(n, k, dtype, mode)
            ref = cuda.device_array_like(out)
            for t in rows:
                cells = []
                for j, launch in enumerate(
                    [tile_launch(x[:t], w, w3, ref[:t], dtype, mode, split_scratch),
                     skinny_launch(x[:t], w, w3, out[:t], dtype, mode, 0, 0)]
                    + [panel_launch(x[:t], w, w3, out[:t], dtype, mode, v, scratch) for v in variants]
                ):  # fmt: skip
                    sec = time_launches(launch)
                    total[t][j] += sec
                    cells.append(f"{sec * 1e6:6.1f}")
                    if j >= 2:  # checked: one more launch (residual: onto a zeroed out, as the split's)
                        if mode == "residual":
                            out[:t].copy_to_device(np.zeros(out[:t].shape, out.dtype))
                            ref[:t].copy_to_device(np.zeros(ref[:t].shape, ref.dtype))
                            tile_launch(x[:t], w, w3, ref[:t], dtype, mode, split_scratch)()
                        launch()
                        STREAM.synchronize()
                        want = ref[:t].copy_to_host().astype(np.float64)
                        got = out[:t].copy_to_host().astype(np.float64)
                        err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
                        cells[-1] += f" ({err:.0e}{' WRONG' if not err < 2e-3 else ''})"
                print(f"{dtype:4s} {name:4s} T={t}: split / skinny / panel " + " / ".join(cells), flush=True)
        for t in rows:
            cells = " / ".join(f"{v * 1e6:.0f}" for v in total[t])
            names = " / ".join(",".join(map(str, v)) for v in variants)
            print(f"{dtype} layer T={t}: split / skinny / panel {names}: {cells} us", flush=True)


def sweep(dtypes: list[str], rows: list[int]) -> None:
    variants = [
        (0, 1, 0),
        (0, 1, 4),
        (8, 1, 0),
        (16, 1, 0),
        (8, 2, 0),
    ]  # warps (0: warps_for), unroll, min blocks
    for dtype in dtypes:
        for name, n, k, mode in SHAPES:
            w, w3, x, out = shape_arrays(n, k, dtype, mode)
            nbytes = weight_bytes(n, k, dtype, mode == "gate")
            for t in rows:
                cells = []
                for v in variants:
                    launch = skinny_launch(x[:t], w, w3, out[:t], dtype, mode, *v)
                    s = time_launches(launch)
                    warps = v[0] or skinny.warps_for(k, dtype)
                    kernel = skinny.make_skinny_kernel(
                        dtype, MODES[mode], skinny.n_tiles_for(t), warps, v[1], v[2]
                    )
                    regs = (
                        next(iter(kernel.get_regs_per_thread().values()), 0)
                        if hasattr(kernel, "get_regs_per_thread")
                        else 0
                    )
                    cells.append(
                        f"{v[0]}x{v[1]}/{v[2]} {s * 1e6:6.1f} ({nbytes / s / 1e9:4.0f}, {regs} regs)"
                    )
                print(f"{dtype:4s} {name:4s} T={t:2d}  " + "  ".join(cells), flush=True)


def row_tiles_sweep(dtypes: list[str], rows: list[int], variants: list[tuple[int, ...]]) -> None:
    """skinny's A tiles a warp (with warps a block, min blocks an SM), beside the split tiles: each
    shape's us and a layer's four products."""
    scratch = matmul_split_scratch(STREAM)
    bad = 0
    for dtype in dtypes:
        totals: dict[tuple, float] = {}
        for name, n, k, mode in SHAPES:
            w, w3, x, out = shape_arrays(n, k, dtype, mode)
            for t in rows:
                split = tile_launch(x[:t], w, w3, out[:t], dtype, mode, scratch)
                ref = once(split, out[:t])
                sp = time_launches(split)
                totals[("split", t)] = totals.get(("split", t), 0.0) + sp
                cells = [f"split {sp * 1e6:6.1f}"]
                for v in variants:
                    warps, min_blocks, row_tiles, x_words = (*v, 0)[:4]
                    launch = skinny_launch(
                        x[:t], w, w3, out[:t], dtype, mode, warps, 1, min_blocks, row_tiles, x_words
                    )
                    err = float(np.abs(once(launch, out[:t]) - ref).max() / np.abs(ref).max())
                    # the split tile's sums against skinny's: a few fp16 roundings apart (a NaN fails)
                    wrong = not err <= 1e-2
                    bad += wrong
                    sk = time_launches(launch)
                    totals[(v, t)] = totals.get((v, t), 0.0) + sk
                    cells.append(f"{label(v)} {sk * 1e6:6.1f}" + (f" WRONG {err:.1e}" if wrong else ""))
                print(f"{dtype:4s} {name:4s} T={t:2d}  " + "  ".join(cells), flush=True)
        for t in rows:
            cells = [f"split {totals[('split', t)] * 1e6:5.0f}"]
            cells += [f"{label(v)} {totals[(v, t)] * 1e6:5.0f}" for v in variants]
            print(f"{dtype:4s} layer T={t:2d}  " + "  ".join(cells), flush=True)
    print(f"check: {'every variant matches the split tile' if not bad else f'{bad} cells WRONG'}")


def label(v: tuple[int, ...]) -> str:
    """A --row-tiles variant's name: warps / min blocks / A tiles (/ words of X a lane loads ahead
    / p: the weights a chunk ahead)."""
    return (
        f"{v[0]}w/{v[1]}b/{v[2]}t"
        + (f"/{v[3]}x" if len(v) > 3 else "")
        + ("/p" if len(v) > 4 and v[4] else "")
    )


def once(launch: object, out: object) -> np.ndarray:
    """out after one launch from zeros (a residual launch adds to it), on the host as float32."""
    out.copy_to_device(np.zeros(out.shape, out.dtype), stream=STREAM)
    launch()
    STREAM.synchronize()
    return out.copy_to_host().astype(np.float32)


def tile_sweep(dtypes: list[str], rows: list[int], tiles: list[Tile]) -> None:
    """The split launches of each tile: a layer's four products, us."""
    scratch = SplitScratch(
        cuda.device_array(64 << 20, np.float32), cuda.to_device(np.zeros(1 << 16, np.int32))
    )
    for dtype in dtypes:
        totals = {(tile, t): 0.0 for tile in tiles for t in rows}
        for _name, n, k, mode in SHAPES:
            w, w3, x, out = shape_arrays(n, k, dtype, mode)
            for tile in tiles:
                for t in rows:
                    launch = tile_launch(x[:t], w, w3, out[:t], dtype, mode, scratch, tile)
                    totals[(tile, t)] += time_launches(launch)
        for tile in tiles:
            cells = "  ".join(f"T={t}: {totals[(tile, t)] * 1e6:6.0f}" for t in rows)
            print(f"{dtype:4s} tile {tuple(tile)}: a layer's products, us  {cells}", flush=True)


def wgmma_table(dtypes: list[str], rows: list[int], versions: list[str], splits: list[int]) -> None:
    """The wgmma rows versions (each at row_splits' splits, and at each of `splits`) beside the
    package's launches: each shape's us, and a layer's four products against the matvec's."""
    print("check against pycalm.cpu.reference")
    if not all([check_wgmma(v, (61, 520, 1056), tuple(dtypes)) for v in versions]):
        sys.exit("check failed")
    scratch = matmul_split_scratch(STREAM)
    kinds = ["split", "skinny"] + [f"{v}/{z or 'auto'}" for v in versions for z in [0, *splits]]
    for dtype in dtypes:
        totals = dict.fromkeys([(kind, t) for kind in kinds for t in rows], 0.0)
        matvec_total = 0.0
        for name, n, k, mode in SHAPES:
            w, w3, x, out = shape_arrays(n, k, dtype, mode)
            x1 = cuda.to_device(np.random.default_rng(0).standard_normal(k).astype(np.float32) * 0.1)
            mv = time_launches(matvec_launch(w, w3, x1, cuda.device_array(n, np.float32), dtype, mode))
            matvec_total += mv
            for t in rows:
                timed = {
                    "split": time_launches(tile_launch(x[:t], w, w3, out[:t], dtype, mode, scratch)),
                    "skinny": time_launches(skinny_launch(x[:t], w, w3, out[:t], dtype, mode, 0, 0)),
                }
                for v in versions:
                    for z in [0, *splits]:
                        timed[f"{v}/{z or 'auto'}"] = time_launches(
                            functools.partial(wgmma_matmul, x[:t], w, out[:t], v, mode, w3, dtype, STREAM, z)
                        )
                for kind, sec in timed.items():
                    totals[(kind, t)] += sec
                cells = "  ".join(f"{kind} {sec * 1e6:6.1f}" for kind, sec in timed.items())
                auto = {
                    v: row_splits(v, -(-n // (WGMMA_VERSIONS[v][0] // (2 if mode == "gate" else 1))), k)
                    for v in versions
                }
                print(f"{dtype:4s} {name:4s} T={t:2d} matvec {mv * 1e6:6.1f}  {cells}  (auto splits: {auto})",
                      flush=True)  # fmt: skip
        for t in rows:
            cells = "  ".join(
                f"{kind} {totals[(kind, t)] * 1e6:5.0f} ({totals[(kind, t)] / matvec_total:.2f}x)"
                for kind in kinds
            )
            print(f"{dtype:4s} layer T={t:2d}  matvec {matvec_total * 1e6:5.0f}  {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--sweep", action="store_true", help="skinny's block shapes at T = 8 and 64")
    ap.add_argument("--no-tile", action="store_true", help="the table without matmul's tiles")
    ap.add_argument(
        "--variant", default="0,0,0", help="warps,unroll,min_blocks of the table (0: the package's)"
    )
    ap.add_argument(
        "--row-tiles",
        help="skinny's A tiles a warp: variants warps,min_blocks,row_tiles[,x_words];... (0: the package's)",
    )
    ap.add_argument("--tiles", help="time the split launches of these tiles (BM,BN,WM,WN,stages,blocks;...)")
    ap.add_argument("--wgmma", help="time matmul.py's wgmma rows versions, e.g. r1,r2,r3")
    ap.add_argument(
        "--panel", help="time pycalm.kernels.panel's block shapes warps,row_tiles,stages,min_blocks,ahead;..."
    )
    ap.add_argument(
        "--splits", default="", help="with --wgmma: splits of K to time beside the automatic, e.g. 2,4,8"
    )
    args = ap.parse_args()
    global STREAM
    STREAM = cuda.stream()
    dtypes = args.dtypes.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    if args.panel:
        variants = [tuple(int(v) for v in spec.split(",")) for spec in args.panel.split(";")]
        panel_table(dtypes, rows if args.rows != ap.get_default("rows") else [32, 64], variants)
    elif args.wgmma:
        splits = [int(z) for z in args.splits.split(",") if z]
        wgmma_table(
            dtypes,
            rows if args.rows != ap.get_default("rows") else [16, 32, 64],
            args.wgmma.split(","),
            splits,
        )
    elif args.row_tiles:
        variants = [tuple(int(v) for v in spec.split(",")) for spec in args.row_tiles.split(";")]
        row_tiles_sweep(dtypes, rows, variants)
    elif args.tiles:
        tiles = [Tile(*(int(v) for v in spec.split(","))) for spec in args.tiles.split(";")]
        tile_sweep(dtypes, rows, tiles)
    elif args.sweep:
        sweep(dtypes, rows if args.rows != ap.get_default("rows") else [8, 64])
    else:
        table(dtypes, rows, tuple(int(v) for v in args.variant.split(",")), not args.no_tile)


if __name__ == "__main__":
    main()
