"""The rows pass's RMSNorm launch: the shipped kernel against one that keeps a row's values in
registers, each checked against the reference and timed (llm.c dev/cuda style).

Versions:
  shipped     pycalm.kernels.rows.rmsnorm_rows: block t normalises row t; a thread's columns
              tid, tid + threads, ... in a loop, once for the sum of squares and again for the
              output (1,024 threads a block up to 64 rows, 256 above)
  regs-N      a thread's dim / N columns loaded at once into registers (the loop written out
              for the model's dim), summed in the same order, then written from the registers:
              one wait on L2 for the row instead of one a column step, twice; the same sums as
              shipped at the same N, so the same bits (checked)

Why: under ncu (H100, 2026-12-07) a launch over 64 rows of 4,096 takes 11 us for 1 MB in and
0.5 MB out, twice a layer of a 64-row pass; in the 8B's fp16 prefill the norms of 2,048 rows
took 6.4 ms of 69.7 (H200, 2026-12-06).

How to run (on the GPU machine, from the repository root):

    python3 scripts/kernels/rmsnorm_rows.py [--dim 4096] [--rows 8,32,64,2048]
    NUMBA_ENABLE_CUDASIM=1 python3 scripts/kernels/rmsnorm_rows.py --tiny   # the checks only

Each version over T rows as a graph of REPS launches, replayed and timed with CUDA events
(median). The check: |out - ref| within 2^-10 relative + 1e-6 of rmsnorm_rows_ref (the float32
sum in another order, then fp16 rounding), and regs-N's bits equal to shipped's where both take N
threads.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

from numba import config as numba_config  # noqa: E402
from numba import cuda, float32  # noqa: E402

import pycalm.kernels.rows as rows_module  # noqa: E402
from pycalm.cpu.reference import rmsnorm_rows_ref  # noqa: E402
from pycalm.kernels.common import WARP, block_reduce_sum, dependent_start, fp16_encode  # noqa: E402

REPS = 32
RUNS = 15
EPS = 1e-5


@functools.cache
def regs_kernel(dim: int, threads: int) -> object:
    """Block t: out[t] = fp16(x[t] * rsqrt(mean(x[t]^2) + eps) * w), a thread's PER columns
    tid + j threads held in registers (PER = ceil(dim / threads), a compile-time size)."""
    per = -(-dim // threads)

    @cuda.jit(fastmath=False)
    def kernel(x, w, eps, out):  # noqa: ANN001, ANN202
        # x (T, dim) float32, w (dim,) float32, out (T, dim) float16
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        scratch = cuda.shared.array(WARP, float32)  # block reduction
        v = cuda.local.array(per, float32)  # this thread's columns of the row
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        for j in range(per):  # every load first (predicated past dim), then the sum
            i = tid + j * threads
            v[j] = x[t, i] if i < dim else float32(0.0)
        ss = float32(0.0)
        for j in range(per):
            ss += v[j] * v[j]  # (columns past dim add 0: shipped's sum, bit for bit)
        ss = block_reduce_sum(ss, scratch)  # every thread gets the total (the call has barriers)
        r = float32(1.0) / math.sqrt(ss / float32(dim) + eps)
        for j in range(per):
            i = tid + j * threads
            if i < dim:
                out[t, i] = fp16_encode(v[j] * r * w[i])

    return kernel


def shipped_threads(n_rows: int) -> int:
    """The block width pycalm.kernels.rows.rmsnorm_rows takes for a pass of n_rows rows."""
    return rows_module.NORM_THREADS if n_rows <= rows_module.NORM_WIDE_ROWS else rows_module.THREADS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="check only, at a tiny shape (simulator)")
    ap.add_argument("--dim", type=int, default=4096, help="the row width (the model's dim)")
    ap.add_argument("--rows", default="8,32,64,2048", help="row counts T to time")
    args = ap.parse_args()
    tiny = args.tiny or numba_config.ENABLE_CUDASIM
    dim = 72 if tiny else args.dim
    counts = [5, 3] if tiny else [int(n) for n in args.rows.split(",")]
    widths = (rows_module.NORM_THREADS,) if tiny else (256, 512, 1024)  # tiny: shipped's width
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    failed = []
    for n_rows in counts:
        x = (rng.standard_normal((n_rows, dim)) * 2).astype(np.float32)
        w = rng.uniform(0.5, 1.5, dim).astype(np.float32)
        want = rmsnorm_rows_ref(x, w, EPS).astype(np.float32)
        dx, dw = cuda.to_device(x), cuda.to_device(w)
        outs = {}
        versions = [("shipped", shipped_threads(n_rows), None)]
        versions += [(f"regs-{n}", n, regs_kernel(dim, n)) for n in widths]
        for name, threads, kernel in versions:
            out = cuda.device_array((n_rows, dim), np.float16)
            if kernel is None:
                launch = functools.partial(rows_module.rmsnorm_rows, dx, dw, EPS, out, stream=stream)
            else:
                launch = functools.partial(kernel[n_rows, threads, stream], dx, dw, float32(EPS), out)
            launch()
            stream.synchronize()
            got = out.copy_to_host()
            outs[name] = (threads, got)
            err = np.abs(got.astype(np.float32) - want) / (2.0**-10 * np.abs(want) + 1e-6)
            ok = bool(np.all(err <= 1))
            same = ""
            if kernel is not None and threads == outs["shipped"][0]:
                bits = np.array_equal(got.view(np.uint16), outs["shipped"][1].view(np.uint16))
                same = ", shipped's bits" if bits else ", NOT shipped's bits"
                ok = ok and bits
            if not ok:
                failed.append(f"{name} at {n_rows} rows: worst {err.max():.2f}{same}")
            if tiny:
                print(
                    f"{name:10s} {n_rows} rows x {dim}: check {err.max():.2f}{same} ({'ok' if ok else 'WRONG'})"
                )
                continue
            from gpubench import graph_seconds

            t = graph_seconds(stream, lambda f=launch: [f() for _ in range(REPS)], RUNS) / REPS
            gbs = n_rows * dim * (4 + 2) / t / 1e9
            print(
                f"{name:10s} {n_rows:5d} rows x {dim}: {t * 1e6:7.2f} us, {gbs:6.0f} GB/s ({threads} threads){same}"
            )
    if failed:
        sys.exit("off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
