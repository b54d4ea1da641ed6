"""Greedy and sampled picks on the GPU: each launch checked against the reference and timed.

Versions:
  argmax, two passes   pycalm.kernels.argmax with its scratch (what the engine launches)
  argmax, one block    the same without scratch: one block over every logit
  sample               pycalm.kernels.sample with four settings (temperature alone, top-k and
                       top-p, min-p and top-p, top-p alone: the CLI's default -t 0.7 -p 0.9), on
                       normal logits and on peaked ones (20 tokens far above the rest, a
                       language model's kind of distribution)
  sample, wide         the settings without top-k or min-p with the scratch of
                       pycalm.kernels.sample_wide (what the engine launches there): six launches
                       (eleven with top-p) of many blocks a row where the one-block walk runs
                       its passes on one SM (about 250 logits a thread, each an expf, a key and
                       a shared-memory float atomic: 0.38 ms on the H200, 2026-11-29); at
                       temperature alone also with BLOCKS blocks a row instead of wide_blocks'
                       32 (timed, not under --tiny)

How to run (on the GPU machine, from the repository root):

    python3 scripts/kernels/sample.py
    NUMBA_ENABLE_CUDASIM=1 python3 scripts/kernels/sample.py --tiny   # the checks, small vocabulary

Over VOCAB logits, each version as a graph of REPS launches, replayed and timed with CUDA events
(median). Every version's picks are first compared with pycalm.cpu.reference.sample_ref for the
same coins, COINS: the same tokens, or (over the full vocabulary, where a coin deep in the walk
lies among tokens of p ~ 1e-7) a token the reference picks for a coin within NEAR of it.
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
from pycalm.kernels.sample import RowSampling, host_rows, sample, sample_rows  # noqa: E402
from pycalm.kernels.sample_wide import WideScratch  # noqa: E402

VOCAB = 128256
TINY_VOCAB = 301
REPS = 32
RUNS = 15
BLOCKS = (8, 16, 64, 128)  # the wide walk's blocks a row, timed beside its default
ROWS, TINY_ROWS = (1, 8, 16, 32, 64), (1, 3)  # sample_rows' row counts (--tiny: the second)
NEAR = 1e-5  # a coin this close to the one drawn: picks there differ by float32 rounding
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
    versions = []  # (name, launch(state), the reference: coin -> token)
    wide = WideScratch.allocate(1)

    normal = logits_of("normal", vocab)
    greedy = lambda c: sample_ref(normal, 0.0)  # noqa: E731
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
            want = lambda c, h=host, s=s: sample_ref(h, s.temperature, s.top_k, s.top_p, s.min_p, c)  # noqa: E731
            name = f"sample {kind} T={s.temperature} top_k={s.top_k} top_p={s.top_p} min_p={s.min_p}"
            launch = lambda st, d=d_logits, s=s: sample(d, st, coins, s, stream=stream, **threads)  # noqa: E731
            versions.append((name, launch, want))
            if s.top_k == 0 and s.min_p == 0.0:  # what sample_wide takes
                launch = lambda st, d=d_logits, s=s: sample(d, st, coins, s, stream=stream, wide=wide)  # noqa: E731
                wname = f"sample, wide {kind} T={s.temperature} top_p={s.top_p}"
                versions.append((wname, launch, want))
                for blocks in () if tiny or s.top_p < 1.0 else BLOCKS:  # wide_blocks' 32 against others
                    launch = lambda st, d=d_logits, s=s, b=blocks: wide.sample_state(  # noqa: E731
                        d, st, coins, 1.0 / s.temperature, s.top_p, stream=stream, blocks=b
                    )
                    versions.append((f"{wname}, {blocks} blocks", launch, want))
    ties = np.round(logits_of("normal", vocab)).astype(np.float32)  # many equal logits: the id walk
    d_ties = cuda.to_device(ties)
    want = lambda c: sample_ref(ties, 1.0, 0, 1.0, 0.0, c)  # noqa: E731
    plain = SamplingParams(1.0, 0, 1.0, 0.0)
    versions.append(
        ("sample ties T=1.0", lambda st: sample(d_ties, st, coins, plain, stream=stream, **threads), want)
    )
    versions.append(
        (
            "sample, wide ties T=1.0",
            lambda st: sample(d_ties, st, coins, plain, stream=stream, wide=wide),
            want,
        )
    )
    failed = []
    for name, launch, want in versions:
        got = []
        for pos in range(len(COINS)):
            state = cuda.to_device(np.array([0, pos, 0], np.int32))
            launch(state)
            stream.synchronize()
            got.append(int(state.copy_to_host()[0]))
        replay = lambda f=launch, st=state: [f(st) for _ in range(REPS)]  # noqa: E731
        refs = [(want, float(c)) for c in coins_host]
        failed += report(f"{name} over {vocab} logits", got, refs, tiny, stream, replay)
    failed += rows_versions(vocab, tiny, stream)
    if failed:
        sys.exit("picks off the reference:\n" + "\n".join(failed))


def rows_versions(vocab: int, tiny: bool, stream: object) -> list[str]:
    """sample_rows over ROWS (--tiny: TINY_ROWS) rows of normal logits at temperature 0.8 alone, one block a row and
    wide (the engine's rows passes and batched steps): checked row by row, then timed."""
    failed = []
    counts = TINY_ROWS if tiny else ROWS
    wide = WideScratch.allocate(max(counts))
    for rows in counts:
        logits = np.stack([logits_of("normal", vocab) * (1 + r / rows) for r in range(rows)])  # (rows, vocab)
        coins = np.random.default_rng(rows).random(rows).astype(np.float32)  # (rows,)
        settings = [SamplingParams(0.8)] * rows
        refs = [
            (lambda c, x=x: sample_ref(x, 0.8, coin=c), float(c)) for x, c in zip(logits, coins, strict=True)
        ]
        d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
        params = RowSampling.from_host(*host_rows(settings), stream=stream)
        tokens = cuda.to_device(np.full(rows, -1, np.int32))
        threads = {"threads": 64} if tiny else {}
        for name, options in (("one block a row", threads), ("wide", {**threads, "wide": wide})):

            def launch(o: dict = options, x: object = d_logits, p: object = params, c: object = d_coins,
                       t: object = tokens) -> None:  # fmt: skip
                sample_rows(x, p, c, t, stream=stream, **o)

            launch()
            stream.synchronize()
            got = tokens.copy_to_host().tolist()
            replay = lambda f=launch: [f() for _ in range(REPS)]  # noqa: E731
            failed += report(f"sample_rows {rows} rows T=0.8, {name}", got, refs, tiny, stream, replay)
    return failed


def report(name: str, got: list[int], refs: list, tiny: bool, stream: object, replay: object) -> list[str]:
    """A version's picks against the reference's (refs: (the reference, coin) a pick): printed
    with --tiny, else its time a launch (replay makes REPS of its launches, replayed as a graph);
    -> the failure, if any. A pick that the reference makes for a coin within NEAR of the one
    drawn is float32 rounding (the kernels' sums against the reference's float64), not a failure."""
    want = [ref(c) for ref, c in refs]
    near = all(
        g == w or g in {ref(c + k * NEAR / 10) for k in range(-10, 11)}
        for g, w, (ref, c) in zip(got, want, refs, strict=True)
    )
    verdict = "ok" if got == want else "ok within float32 rounding" if near else "WRONG"
    if tiny:
        print(f"{name}: tokens {got} ({verdict})", flush=True)
    else:
        from gpubench import graph_seconds

        t = graph_seconds(stream, replay, RUNS) / REPS
        print(f"{name}: {t * 1e6:.1f} us (picks {verdict})", flush=True)
    return [] if near else [f"{name}: tokens {got}, the reference's {want}"]


if __name__ == "__main__":
    main()
