"""The GPU engine's batched step (pycalm.gpu.batched.BatchedGpuEngine, the server's --parallel N):
S sequences advanced one token each in one pass over the paged KV pool, random weights of a
model shape, every sequence at position POS. Prints the ms of a step (the arrays to the device,
the pass, the S rows' logits back to the host) and the tokens a second it makes, beside the
token step of the same engine (one sequence, a CUDA graph, sampled on the device).

    python3 scripts/bench_batched.py --shapes llama3-8b --dtypes fp16 --seqs 1,8,32,64
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import RandomDeviceModel, config_for, time_replays  # noqa: E402

from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.gpu.batched import BatchedGpuEngine  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine  # noqa: E402

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3-8b")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--seqs", default="1,8,32,64")
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    seqs = [int(v) for v in args.seqs.split(",")]
    print("| shape | weights | token step ms | " + " | ".join(f"{s} seqs: ms, tok/s" for s in seqs) + " |")
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            cfg = config_for(shape, dtype, 1024)
            engine = GpuEngine(RandomDeviceModel(cfg), seq_len=1024, kv_dtype="fp16", options=EngineOptions())
            step = functools.partial(engine.graph, SamplingParams())
            step(0)
            time_replays(engine, step, 0, 8)  # warm-up
            token_ms = time_replays(engine, step, args.pos, 32) * 1e3
            per_seq = -(-(args.pos + 1) // BLOCK)  # blocks a sequence holds
            batched = BatchedGpuEngine(engine, max(seqs) * per_seq, BLOCK)
            cells = []
            for s in seqs:
                table = np.arange(s * per_seq, dtype=np.int32).reshape(s, per_seq)  # (S, blocks)
                rows = np.arange(s, dtype=np.int32)
                tokens = (rows * 7919 + 11) % cfg.vocab_size
                positions = np.full(s, args.pos, np.int32)
                batched.step(tokens, positions, rows, table, rows)  # compiles, warms up
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    batched.step(tokens, positions, rows, table, rows)
                ms = (time.perf_counter() - t0) / args.reps * 1e3
                cells.append(f"{ms:.2f}, {s / ms * 1e3:,.0f}")
            print(f"| {shape} | {dtype} | {token_ms:.2f} | " + " | ".join(cells) + " |", flush=True)
            del batched, engine


if __name__ == "__main__":
    main()
