"""Bandwidth of the weight-reading kernels on the GPU (run on the H200, simulator off).

    python scripts/bench_kernels.py            # matvec, every shape x dtype, plus knob variants
    python scripts/bench_kernels.py --check    # first compare a big shape with float64 NumPy
    python scripts/bench_kernels.py --all      # also matvec_residual, ffn_gate (more compiles)

Weights are random bit patterns made on the GPU by a hash kernel (finite values only), so no
large host arrays cross the bus. Each launch is timed with CUDA events after warm-up; the
median of RUNS launches is reported, rotating over COPIES weight copies so that the 50 MB L2
does not hold the weights between launches. GB/s counts the bytes the launcher reports; the
ceiling is a uint64 grid-stride copy measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

import numpy as np  # noqa: E402
from numba import cuda, uint32  # noqa: E402

from pycalm import formats  # noqa: E402
from pycalm.kernels import matvec as mv  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (2048, 2048), (5632, 2048)]
DTYPES = ["fp16", "fp8", "gf4"]
RUNS = 20
COPIES = 3
# finite-value masks on random uint32 words: clear one exponent bit of each fp16 / e5m2 / scale
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF, "gf4": 0xFFFFFFBF}


@cuda.jit
def fill_kernel(words, seed, mask):
    """words[i] = hash(i, seed) & mask (a 32-bit integer hash, lowbias32)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < words.shape[0]:
        h = uint32(i) * uint32(0x9E3779B9) + uint32(seed)
        h ^= h >> uint32(16)
        h *= uint32(0x7FEB352D)
        h ^= h >> uint32(15)
        h *= uint32(0x846CA68B)
        h ^= h >> uint32(16)
        words[i] = h & uint32(mask)
        i += stride


@cuda.jit
def copy_kernel(src, dst):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < src.shape[0]:
        dst[i] = src[i]
        i += stride


def random_weights(rows: int, cols: int, dtype: str, seed: int) -> object:
    shape = formats.storage_shape(rows, cols, dtype)
    w = cuda.device_array(shape, formats.STORAGE_DTYPE[dtype])
    words = w.reshape(-1).view(np.uint32)
    fill_kernel[1024, 256](words, seed, MASK[dtype])
    return w


def time_launches(launch, n_args: int) -> float:
    """Median seconds of one launch; launch(i) uses weight copy i % n_args."""
    for i in range(3):
        launch(i % n_args)
    cuda.synchronize()
    times = []
    for i in range(RUNS):
        a, b = cuda.event(timing=True), cuda.event(timing=True)
        a.record()
        launch(i % n_args)
        b.record()
        b.synchronize()
        times.append(cuda.event_elapsed_time(a, b) / 1e3)
    return float(np.median(times))


def copy_ceiling() -> float:
    n = 1 << 27  # 1 GiB of uint64
    src = cuda.device_array(n, np.uint64)
    dst = cuda.device_array(n, np.uint64)
    fill_kernel[1024, 256](src.view(np.uint32), 1, 0xFFFFFFFF)
    t = time_launches(lambda i: copy_kernel[132 * 16, 256](src, dst), 1)
    return 2 * n * 8 / t / 1e9


def check(rows: int, cols: int) -> None:
    """Compare the launchers with float64 NumPy on a big random shape."""
    rng = np.random.default_rng(0)
    s = cuda.default_stream()
    for dtype in DTYPES:
        w = random_weights(rows, cols, dtype, 7)
        wh = formats.decode(w.copy_to_host(), dtype).astype(np.float64)
        x = rng.standard_normal(cols).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        y = cuda.to_device(np.full(rows, np.nan, np.float32))
        mv.matvec(w, cuda.to_device(x), y, dtype, stream=s)
        got = y.copy_to_host()
        err = np.max(np.abs(got - wh @ x) / (np.abs(wh) @ np.abs(x)))
        mv.matvec(w, cuda.to_device(x), y, dtype, stream=s, norm_w=cuda.to_device(nw), eps=1e-5)
        xn = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * nw
        errn = np.max(np.abs(y.copy_to_host() - wh @ xn) / (np.abs(wh) @ np.abs(xn)))
        ok = err < 1e-5 and errn < 1e-5 and np.all(np.isfinite(got))
        print(
            f"check {dtype} {rows}x{cols}: max err/|W||x| plain {err:.2e} normed {errn:.2e} {'OK' if ok else 'FAIL'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--all", action="store_true", help="also matvec_residual and ffn_gate")
    args = ap.parse_args()
    t0 = time.time()
    s = cuda.default_stream()
    if args.check:
        check(14336, 4104)  # cols not a multiple of 16: also the uint32 gf4 path
        check(4099, 14336)  # x in two chunks
    ceiling = copy_ceiling()
    print(f"uint64 copy ceiling: {ceiling:,.0f} GB/s (read + write)   [{time.time() - t0:.0f} s]")
    rows_out = []

    def report(name: str, dtype: str, shape: tuple, nbytes: int, t: float) -> None:
        gbs = nbytes / t / 1e9
        rows_out.append((name, dtype, f"{shape[0]}x{shape[1]}", t * 1e6, gbs, 100 * gbs / ceiling))
        print(f"{name:28s} {dtype:5s} {shape[0]:>6}x{shape[1]:<6} {t * 1e6:8.1f} us {gbs:7.0f} GB/s "
              f"{100 * gbs / ceiling:5.1f}%", flush=True)  # fmt: skip

    for dtype in DTYPES:
        for rows, cols in SHAPES:
            ws = [random_weights(rows, cols, dtype, c) for c in range(COPIES)]
            x = cuda.to_device(np.random.default_rng(1).standard_normal(cols).astype(np.float32))
            y = cuda.device_array(rows, np.float32)
            nbytes = mv.matvec(ws[0], x, y, dtype, stream=s)
            t = time_launches(
                lambda i, dtype=dtype, ws=ws, x=x, y=y: mv.matvec(ws[i], x, y, dtype, stream=s), COPIES
            )
            report("matvec", dtype, (rows, cols), nbytes, t)
            if (rows, cols) == (14336, 4096):
                # knobs: warps a block x grid cap (blocks an SM); the kernel reads both from the launch
                wvs = [mv.word_view(w, dtype) for w in ws]
                kernel = mv.MATVEC_KERNELS[(wvs[0][1], mv.PLAIN, False)]
                for n_warps in (4, 8, 16):
                    for bps in (1, 2, 4, 8, 64):
                        blocks = mv.grid_for((rows + 1) // 2, cols, n_warps, bps)

                        def launch(i, kernel=kernel, blocks=blocks, n_warps=n_warps, wvs=wvs, x=x, y=y):
                            kernel[blocks, 32 * n_warps, s](wvs[i][0], wvs[i][0], x, x, np.float32(0), y)

                        report(
                            f"  knob warps={n_warps} bps={bps}",
                            dtype,
                            (rows, cols),
                            nbytes,
                            time_launches(launch, COPIES),
                        )
            if args.all and (rows, cols) in ((14336, 4096), (4096, 14336)):
                r = cuda.device_array(rows, np.float32)
                nb = mv.matvec_residual(ws[0], x, r, dtype, stream=s)
                t = time_launches(
                    lambda i, dtype=dtype, ws=ws, x=x, r=r: mv.matvec_residual(ws[i], x, r, dtype, stream=s),
                    COPIES,
                )
                report("matvec_residual", dtype, (rows, cols), nb, t)
                if (rows, cols) == (14336, 4096):
                    nw = cuda.to_device(np.ones(cols, np.float32))
                    nb = mv.ffn_gate(ws[0], ws[1], x, y, dtype, stream=s, norm_w=nw, eps=1e-5)
                    t = time_launches(
                        lambda i, dtype=dtype, ws=ws, x=x, y=y, nw=nw: mv.ffn_gate(
                            ws[i], ws[(i + 1) % COPIES], x, y, dtype, stream=s, norm_w=nw, eps=1e-5
                        ),
                        COPIES,
                    )
                    report("ffn_gate (w1+w3)", dtype, (rows, cols), nb, t)
            del ws
    print(f"\n== summary (copy ceiling {ceiling:,.0f} GB/s, total {time.time() - t0:.0f} s) ==")
    print(f"{'kernel':28s} {'dtype':5s} {'shape':>12s} {'us':>8s} {'GB/s':>7s} {'%ceil':>6s}")
    for name, dtype, shape, us, gbs, pct in rows_out:
        print(f"{name:28s} {dtype:5s} {shape:>12s} {us:8.1f} {gbs:7.0f} {pct:6.1f}")


if __name__ == "__main__":
    main()
