"""Greedy and sampled picks on the GPU: each launch checked against the reference and timed.

Versions:
  argmax, two passes   pycalm.kernels.argmax with its scratch (what the engine launches)
  argmax, one block    the same without scratch: one block over every logit
  sample               pycalm.kernels.sample with four settings (temperature alone, top-k and
                       top-p, min-p and top-p, top-p alone: the CLI's default -t 0.7 -p 0.9), on
                       normal logits and on peaked ones (20 tokens far above the rest, a
                       language model's kind of distribution)

How to run (on the GPU machine, from the repository root):

    python3 scripts/kernels/sample.py
    NUMBA_ENABLE_CUDASIM=1 python3 scripts/kernels/sample.py --tiny   # the checks, small vocabulary

Over VOCAB logits, each version as a graph of REPS launches, replayed and timed with CUDA events
(median). Every version's picks are first compared with pycalm.cpu.reference.sample_ref for the
same coins, COINS (the tokens must be the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm.cpu.reference import sample_ref  # noqa: E402
from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.kernels.argmax import argmax, argmax_scratch_shape  # noqa: E402
from pycalm.kernels.sample import sample  # noqa: E402

VOCAB = 128256
TINY_VOCAB = 301
REPS = 32
RUNS = 15
COINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99)  # the step at position p draws COINS[p]
SETTINGS = [
    SamplingParams(0.8, 40, 0.95, 0.0),
    SamplingParams(1.0, 0, 1.0, 0.0),
    SamplingParams(1.0, 0, 0.9, 0.05),
    SamplingParams(0.7, 0, 0.9, 0.0),
]


def logits_of(kind: str, vocab: int) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal(vocab) * 3
    if kind == "peaked":
        x[np.random.default_rng(3).choice(vocab, 20, replace=False)] += 25
    return x.astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="check only, over a small vocabulary (simulator)")
    args = ap.parse_args()
    tiny = args.tiny or numba_config.ENABLE_CUDASIM
    vocab = TINY_VOCAB if tiny else VOCAB
    threads = {"threads": 64} if tiny else {}  # the simulator runs a Python thread per thread
    stream = cuda.stream()
    coins_host = np.array(COINS, np.float32)
    coins = cuda.to_device(coins_host)
    scratch = cuda.device_array((2, 2) if tiny else argmax_scratch_shape(), np.int32)
    versions = []  # (name, launch(state), the reference's tokens for COINS)
    normal = logits_of("normal", vocab)
    greedy = [sample_ref(normal, 0.0)] * len(COINS)
    d_normal = cuda.to_device(normal)
    versions.append(
        (
            "argmax, two passes",
            lambda st: argmax(d_normal, st, stream=stream, scratch=scratch, **threads),
            greedy,
        )
    )
    versions.append(("argmax, one block", lambda st: argmax(d_normal, st, stream=stream, **threads), greedy))
    for kind in ("normal", "peaked"):
        host = logits_of(kind, vocab)
        d_logits = cuda.to_device(host)
        for s in SETTINGS:
            want = [sample_ref(host, s.temperature, s.top_k, s.top_p, s.min_p, float(c)) for c in coins_host]
            name = f"sample {kind} T={s.temperature} top_k={s.top_k} top_p={s.top_p} min_p={s.min_p}"
            launch = lambda st, d=d_logits, s=s: sample(d, st, coins, s, stream=stream, **threads)  # noqa: E731
            versions.append((name, launch, want))
    failed = []
    for name, launch, want in versions:
        got = []
        for pos in range(len(COINS)):
            state = cuda.to_device(np.array([0, pos, 0], np.int32))
            launch(state)
            stream.synchronize()
            got.append(int(state.copy_to_host()[0]))
        ok = got == want
        if not ok:
            failed.append(f"{name}: tokens {got}, the reference's {want}")
        if tiny:
            print(f"{name}: tokens {got} ({'ok' if ok else 'WRONG'})", flush=True)
            continue
        from gpubench import graph_seconds

        t = graph_seconds(stream, lambda f=launch, st=state: [f(st) for _ in range(REPS)], RUNS) / REPS
        print(f"{name} over {vocab} logits: {t * 1e6:.1f} us (picks {'ok' if ok else 'WRONG'})", flush=True)
    if failed:
        sys.exit("picks off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
