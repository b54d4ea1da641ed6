"""The GPU engine's batched step (pycalm.gpu.batched.BatchedGpuEngine, the server's --parallel N):
S sequences advanced one token each in one pass over the paged KV pool, random weights of a
model shape, every sequence at position POS. Prints the ms of a step and the tokens a second it
makes, beside the token step of the same engine (one sequence, a CUDA graph, sampled on the
device). A step is the arrays to the device, the pass and either
  - sampled: each row's token drawn on the device (step_tokens, what the server runs), one int
    a row back to the host; or
  - logits: the S rows' logits back to the host (step, where a request has penalties).
GPU time: the same step timed by CUDA events around it alone, the rest is the host's.

    python3 scripts/bench_batched.py --shapes llama3-8b --dtypes fp16 --seqs 1,8,32,64 --pos 128,384
    python3 scripts/bench_batched.py --seqs 64 --pos 384 --chunk 192    # steps that feed a prompt too
    python3 scripts/bench_batched.py --seqs 1,64 --top-p 1              # temperature alone (the wide sampler)
    python3 scripts/bench_batched.py --seqs 64 --pos 384 --chunk 0,64,192,448,960   # a row each: the
        # cost of each row bucket (64 + chunk rows, padded to a power of two): bench_serve --stand-in's table
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
from pycalm.gpu.engine import GpuEngine  # noqa: E402
from pycalm.gpu.graph import GraphStep  # noqa: E402

BLOCK = 16


def host_ms(run: Callable[[], object], reps: int) -> float:
    """ms a call of run, as the host sees it (after two calls that compile and capture)."""
    run()
    run()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - t0) / reps * 1e3


def attention_ms(batched: BatchedGpuEngine, engine: GpuEngine, reps: int) -> float:
    """GPU ms of the last step's attention launches (every layer, over the pages), alone in a graph."""
    from pycalm.kernels.attention import attention
    from pycalm.kernels.rows import Pages

    b, rows = batched.prefill._rows(batched.rows), batched.rows
    pages = Pages(batched.positions[:rows], batched.seq_of_row[:rows], batched.table, batched.block_size,
                  batched.span, batched.scratch)  # fmt: skip

    def record() -> None:
        for pool in batched.pools:
            attention(b.q, pool, engine.state, b.att, batched.config, batched.scratch, stream=engine.stream,
                      span=batched.span, pages=pages)  # fmt: skip

    record()
    graph = GraphStep(engine.stream, record)
    return time_replays(engine, lambda _p: graph, 0, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3-8b")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--seqs", default="1,8,32,64")
    ap.add_argument("--pos", default="128", help="the sequences' position, or a list: a row each")
    ap.add_argument(
        "--chunk", default="0", help="and a prompt chunk of this many rows each step, or a list: a row each"
    )
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--top-p", type=float, default=0.95, help="the rows' top-p at temperature 0.8 (1: temperature alone)"
    )
    args_ = ap.parse_args()
    seqs = [int(v) for v in args_.seqs.split(",")]
    spots = [int(v) for v in args_.pos.split(",")]
    chunks = [int(v) for v in args_.chunk.split(",")]
    context = 2048
    print("steps of S decode rows and a prompt chunk of C rows (positions 0..C-1 of one more sequence): ms a step "
          "sampled on the device, and with the logits back; GPU: the graph alone; attention: its attention launches")  # fmt: skip
    print(
        "| shape | weights | position | C | token step ms | " + " | ".join(f"{s} seqs" for s in seqs) + " |"
    )
    for shape in args_.shapes.split(","):
        for dtype in args_.dtypes.split(","):
            cfg = config_for(shape, dtype, context)
            engine = GpuEngine(RandomDeviceModel(cfg), seq_len=context, kv_dtype="fp16")
            step = functools.partial(engine.graph, SamplingParams())
            step(0)
            time_replays(engine, step, 0, 8)  # warm-up
            per_seq = -(-(max(spots) + max(chunks) + 1) // BLOCK)  # blocks a sequence holds
            batched = BatchedGpuEngine(engine, (max(seqs) + 1) * per_seq, BLOCK)
            for pos, chunk in [(p, c) for p in spots for c in chunks]:
                token_ms = time_replays(engine, step, pos, 32) * 1e3
                cells = []
                for s in seqs:
                    table = np.arange((s + 1) * per_seq, dtype=np.int32).reshape(
                        s + 1, per_seq
                    )  # (S + 1, blocks)
                    seq = np.concatenate([np.arange(s), np.full(chunk, s)]).astype(np.int32)
                    tokens = (np.arange(len(seq)) * 7919 + 11) % cfg.vocab_size
                    positions = np.concatenate([np.full(s, pos), np.arange(chunk)]).astype(np.int32)
                    sample = np.arange(s + (chunk > 0), dtype=np.int32)
                    if chunk:
                        sample[-1] = len(seq) - 1
                    options = [SamplingParams(0.8, top_p=args_.top_p)] * len(sample)
                    coins = np.linspace(0.05, 0.95, len(sample))
                    args = (tokens, positions, seq, table[: s + (chunk > 0)], sample)
                    sampled = functools.partial(batched.step_tokens, *args, options, coins)
                    logits = functools.partial(batched.step, *args)
                    ms = host_ms(sampled, args_.reps)
                    key = (batched.bucket(len(seq)), batched.bucket(len(sample)), batched.span, True)
                    graph = next(
                        g for k, g in batched.graphs.items() if k[:4] == key
                    )  # (ahead, one sequence)
                    gpu_ms = time_replays(engine, lambda _p: graph, 0, args_.reps) * 1e3  # noqa: B023
                    att_ms = attention_ms(batched, engine, args_.reps)
                    cells.append(f"{ms:.2f} ({s / ms * 1e3:,.0f} tok/s), logits {host_ms(logits, args_.reps):.2f}; "
                                 f"GPU {gpu_ms:.2f}, attention {att_ms:.2f}")  # fmt: skip
                print(
                    f"| {shape} | {dtype} | {pos} | {chunk} | {token_ms:.2f} | " + " | ".join(cells) + " |",
                    flush=True,
                )
            del batched, engine


if __name__ == "__main__":
    main()
