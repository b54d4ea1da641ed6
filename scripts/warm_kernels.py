"""Fill the kernel cache for benchmark cells before timing them, every cell's kernels at once.

A fresh GPU machine spends most of a benchmark compiling: each cell's engine starts
pycalm.gpu.precompile's workers for its own kernels, and the cells run one after another (on the
H100 of 2026-12-05 the 8B prefill of q4 and q8 at 2,048 tokens compiled for about 190 s). Here
every (shape, format, KV format) cell's workers start together, each cell's engine described
the way scripts/bench.py builds it (its config_for, a context of --seq-len, the default
EngineOptions), and nothing is allocated or timed: the workers walk each engine on stand-in
arrays and compile what its token step, rows passes and prompt chunks launch into the cache,
where the benchmark's engines then find them. Cores are shared out: each cell gets
max(1, cores // cells) workers (at most pycalm.gpu.precompile's MAX_WORKERS).

    python3 scripts/warm_kernels.py --shapes llama3-8b --dtypes fp16,fp8,gf4,q8,q4
    python3 scripts/warm_kernels.py --shapes llama3-8b,tinyllama-1.1b --dtypes q4 --kv fp16,fp8

Prints a line a cell: workers, kernels compiled, the slowest, failures; then the wall time.
Under the CUDA simulator, or with every cell's kernels already cached, nothing starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (pycalm)

from pycalm.gpu import precompile  # noqa: E402
from pycalm.gpu.engine import EngineOptions  # noqa: E402

Cell = tuple[str, str, str]  # (shape, weight format, KV format)


def warm(
    cells: list[Cell],
    config: Callable[[str, str], object],
    seq_len: int,
    workers: int,
    start: Callable[..., precompile.Precompile | None] = precompile.start,
) -> list[tuple[Cell, precompile.Report | None]]:
    """Start every cell's workers (`start`: pycalm.gpu.precompile.start's arguments), then wait
    for them all; each cell's report, None where nothing started (already cached, simulator)."""
    started = []
    for shape, dtype, kv in cells:
        options = EngineOptions(parallel_compile=workers)
        started.append(((shape, dtype, kv), start(config(shape, dtype), seq_len, kv, options)))
    return [(cell, None if p is None else p.finish()) for cell, p in started]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3-8b", help="scripts/bench.py's shapes")
    ap.add_argument("--dtypes", default="fp16,fp8,gf4,q8,q4")
    ap.add_argument("--kv", default="fp16", help="KV cache formats")
    ap.add_argument("--seq-len", type=int, default=4096, help="the engines' context (bench.py's 4,096)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (bench.py)
    from bench import config_for

    cells = [
        (s, d, k) for s in args.shapes.split(",") for d in args.dtypes.split(",") for k in args.kv.split(",")
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(cores // len(cells), precompile.MAX_WORKERS))
    t0 = time.perf_counter()
    reports = warm(cells, lambda shape, dtype: config_for(shape, dtype, args.seq_len), args.seq_len, workers)
    for (shape, dtype, kv), report in reports:
        if report is None:
            print(f"{shape} {dtype} KV {kv}: nothing to compile (cached, or the simulator)")
            continue
        slowest = report.slowest
        print(
            f"{shape} {dtype} KV {kv}: {report.processes} workers, {len(report.compiled)} kernels compiled"
            + (f", slowest {slowest[1]:.1f} s" if slowest else "")
            + (f"; failures: {'; '.join(report.failures)}" if report.failures else "")
        )
    print(f"warm: {len(cells)} cells in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
