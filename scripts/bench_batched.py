"""The GPU engine's batched step (pycalm.gpu.batched.BatchedGpuEngine, the server's --parallel N):
S sequences advanced one token each in one pass over the paged KV pool, random weights of a
model shape, every sequence at position POS. Prints the ms of a step and the tokens a second it
makes, beside the token step of the same engine (one sequence, a CUDA graph, sampled on the
device). A step is the arrays to the device, the pass and either
  - sampled: each row's token drawn on the device (step_tokens, what the server runs), one int
    a row back to the host; or
  - logits: the S rows' logits back to the host (step, where a request has penalties).
GPU time: the same step timed by CUDA events around it alone, the rest is the host's.

    python3 scripts/bench_batched.py --shapes llama3-8b --dtypes fp16 --seqs 1,8,32,64
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import RandomDeviceModel, config_for, time_replays  # noqa: E402

from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.gpu.batched import BatchedGpuEngine  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine  # noqa: E402

BLOCK = 16


def host_ms(run: Callable[[], object], reps: int) -> float:
    """ms a call of run, as the host sees it (after two calls that compile and capture)."""
    run()
    run()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3-8b")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--seqs", default="1,8,32,64")
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    args_ = ap.parse_args()
    seqs = [int(v) for v in args_.seqs.split(",")]
    print("| shape | weights | token step ms | " + " | ".join(f"{s} seqs: ms, tok/s" for s in seqs) + " |")
    for shape in args_.shapes.split(","):
        for dtype in args_.dtypes.split(","):
            cfg = config_for(shape, dtype, 1024)
            engine = GpuEngine(RandomDeviceModel(cfg), seq_len=1024, kv_dtype="fp16", options=EngineOptions())
            step = functools.partial(engine.graph, SamplingParams())
            step(0)
            time_replays(engine, step, 0, 8)  # warm-up
            token_ms = time_replays(engine, step, args_.pos, 32) * 1e3
            per_seq = -(-(args_.pos + 1) // BLOCK)  # blocks a sequence holds
            batched = BatchedGpuEngine(engine, max(seqs) * per_seq, BLOCK)
            cells = []
            for s in seqs:
                table = np.arange(s * per_seq, dtype=np.int32).reshape(s, per_seq)  # (S, blocks)
                rows = np.arange(s, dtype=np.int32)
                tokens = (rows * 7919 + 11) % cfg.vocab_size
                positions = np.full(s, args_.pos, np.int32)
                options = [SamplingParams(0.8, top_p=0.95)] * s
                coins = np.linspace(0.05, 0.95, s)
                args = (tokens, positions, rows, table, rows)
                sampled = functools.partial(batched.step_tokens, *args, options, coins)
                logits = functools.partial(batched.step, *args)
                cell = [f"{what} {ms:.2f}, {s / ms * 1e3:,.0f}" for what, ms in
                        (("sampled", host_ms(sampled, args_.reps)), ("logits", host_ms(logits, args_.reps)))]  # fmt: skip
                graph = batched.graphs[(batched.bucket(s), batched.bucket(s), True)]
                gpu_ms = time_replays(engine, lambda _p: graph, 0, args_.reps) * 1e3  # noqa: B023
                cells.append("; ".join(cell) + f"; GPU {gpu_ms:.2f}")
            print(f"| {shape} | {dtype} | {token_ms:.2f} | " + " | ".join(cells) + " |", flush=True)
            del batched, engine


if __name__ == "__main__":
    main()
