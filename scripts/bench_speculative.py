"""Speculative decoding against plain decoding: acceptance length and tok/s, a row per task.

    python scripts/bench_speculative.py MODEL [--device cpu|gpu] [--drafter ngram|draft|ngram,draft]
        [--draft-model MODEL] [--k 4,adaptive] [--draft-k 4,6] [--new 64] [--prompts 2]
        [--dtype fp16] [--draft-dtype q4]
        [--tasks grounded,chat,code]

The prompts are tests/data/speculative_prompts.json, three tasks: grounded (edit, refactor or
summarise a text given in the prompt), chat (open questions) and code (completion of a code
prefix, no chat template). Each prompt decodes `--new` tokens greedily, plainly (once) and then
speculatively for each k, on the same engine (a fresh call from position 0 each time; a row's
speculative engine serves the task's prompts in turn, as a server's serves its requests, so its
acceptance estimates carry from one prompt to the next). The table gives, per model, task,
drafter and k:
  * accept: the acceptance length, tokens a verification pass gives (1 to k + 1);
  * tok/fwd: tokens per forward of the target (passes and plain token steps): the speed-up
    where a pass of k + 1 rows costs a token step;
  * plain and spec tok/s, end to end but for the prompt's prefill (the prompt but its last
    token is prefilled first, untimed); on the GPU, after every span's token step and the rows
    pass's buckets of 2 to 16 rows are compiled and captured (their costs printed first);
  * same: prompts whose speculative tokens are plain decoding's (a near tie between the rows
    pass's logits and the token step's can part them without --batch-invariant; each such
    prompt is listed).
Under each row a line gives the counts behind it: tokens, passes, drafts checked and kept, the
passes' tokens, and plain token steps (where the drafter had nothing to propose).
Acceptance length does not depend on the device: measure it on the CPU engine (--device cpu,
--threads for its BLAS), and tok/s on the GPU (--device gpu).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pycalm.app.speculative import (  # noqa: E402
    MEASURE_ROWS,
    SpeculationOptions,
    SpeculativeEngine,
    make_drafter,
    measure_costs,
)
from pycalm.cpu.sampler import SamplingParams  # noqa: E402

PROMPTS = REPO / "tests" / "data" / "speculative_prompts.json"


def prompt_ids(llm: object, prompt: dict) -> list[int]:
    if "chat" in prompt:
        return llm.chat_ids([{"role": "user", "content": prompt["chat"]}])
    return llm.tokenize(prompt["text"])


def timed(engine: object, ids: list[int], new: int) -> tuple[list[int], float]:
    """The greedy tokens after `ids` and the seconds of the call that makes them, the prompt but
    its last token prefilled before (untimed: the same for both; on the GPU the prefill is
    enqueued, so its engines' streams are waited for first)."""
    engine.prefill(ids[:-1], 0)
    drafter = getattr(engine, "drafter", None)
    for e in (getattr(engine, "engine", engine), getattr(drafter, "engine", None)):
        if hasattr(e, "stream"):
            e.stream.synchronize()
    t0 = time.perf_counter()
    out = list(engine.generate(ids[-1:], len(ids) - 1, new, SamplingParams()))
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument(
        "--drafter", default="ngram", help="ngram, draft or both (ngram,draft): one plain run for both"
    )
    ap.add_argument("--draft-model")
    ap.add_argument("--k", default="4,adaptive", help="comma-separated k values; 'adaptive' for AdaptiveK")
    ap.add_argument("--draft-k", help="the draft model's k values where they differ from --k")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2, help="prompts a task")
    ap.add_argument("--tasks", default="grounded,chat,code")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--draft-dtype", help="the draft model's weight format (default: --dtype)")
    ap.add_argument("--batch-invariant", action="store_true")
    args = ap.parse_args()
    drafters = args.drafter.split(",")
    if not drafters or any(d not in ("ngram", "draft") for d in drafters):
        ap.error(f"--drafter: ngram, draft or ngram,draft, not {args.drafter!r}")

    import pycalm

    # plain engines (speculate="off"): the baseline, and what each row's SpeculativeEngine wraps.
    # pycalm.load's default (auto) is n-gram speculation on the GPU: the baseline would speculate,
    # its first call would time the passes, and measure_costs would time n-gram passes as steps
    llm = pycalm.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        context=args.context,
        threads=args.threads,
        batch_invariant=args.batch_invariant,
        speculate="off",
    )
    engine = llm.engine
    draft_engine = None
    if "draft" in drafters:
        draft = pycalm.load(
            args.draft_model,
            device=args.device,
            dtype=args.draft_dtype or args.dtype,
            context=args.context,
            threads=args.threads,
            batch_invariant=args.batch_invariant,
            speculate="off",
        )
        draft_engine = draft.engine
    prompts = json.loads(PROMPTS.read_text())

    def k_values(text: str) -> list[int | None]:
        return [None if k == "adaptive" else int(k) for k in text.split(",")]

    # (drafter, k) a row; where one is adaptive, the pass costs measured once, at the start of the cache
    configs = [
        (d, k) for d in drafters for k in k_values(args.draft_k if d == "draft" and args.draft_k else args.k)
    ]
    costs: dict[str, object] = {}
    if args.device == "gpu":  # compile and capture before any timing: every span's token step and
        # rows passes of up to 16 rows (checks, catch-ups)
        engine.prepare(SamplingParams(), range(args.context), rows=MEASURE_ROWS)
        if draft_engine is not None:
            draft_engine.prepare(SamplingParams(), range(args.context), rows=MEASURE_ROWS)
    for d in drafters:
        # the costs also warm the rows pass's buckets up to 16 rows (GPU: compiled and captured)
        if args.device == "gpu" or any(c == (d, None) for c in configs):
            costs[d] = c = measure_costs(engine, 0, make_drafter(d, engine, draft_engine))
            rows = ", ".join(f"{n} rows {s / c.step:.2f}" for n, s in c.rows)
            print(f"costs ({d}): token step {c.step * 1e3:.2f} ms; passes in steps: {rows}; "
                  f"draft step {c.draft_step / c.step:.2f}, a pass's draft call {c.draft_call / c.step:.2f}",
                  flush=True)  # fmt: skip
    name = Path(args.model).stem
    print("| model | task | drafter | k | accept | tok/fwd | plain tok/s | spec tok/s | same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task in args.tasks.split(","):
        chosen = prompts[task][: args.prompts]
        plain_s = 0.0
        plain_n = 0
        # per (drafter, k): spec seconds, spec tokens, target forwards, prompts equal to plain, partings
        rows_k: list[list] = [[0.0, 0, 0, 0, []] for _ in configs]
        options_k = [SpeculationOptions(k=k, costs=costs.get(d)) for d, k in configs]
        # one speculative engine a row for the task's prompts, as a server keeps one: AdaptiveK's
        # acceptance and a draft model's cache carry from one prompt to the next
        spec_k = [
            SpeculativeEngine(engine, make_drafter(d, engine, draft_engine), o)
            for (d, _), o in zip(configs, options_k, strict=True)
        ]
        for i, prompt in enumerate(chosen):
            ids = prompt_ids(llm, prompt)
            plain, s = timed(engine, ids, args.new)  # once a prompt, against every (drafter, k)
            plain_s, plain_n = plain_s + s, plain_n + len(plain)
            for (d, _), row, options, spec_engine in zip(configs, rows_k, options_k, spec_k, strict=True):
                before = options.stats.passes + options.stats.plain_tokens
                spec, s = timed(spec_engine, ids, args.new)
                row[0] += s
                row[1] += len(spec)
                row[2] += options.stats.passes + options.stats.plain_tokens - before
                if spec == plain:
                    row[3] += 1
                else:
                    at = next(
                        (j for j, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b),
                        min(len(plain), len(spec)),
                    )
                    row[4].append(f"{task}[{i}] parts at token {at} ({d}, k {options.k or 'adaptive'})")
        for (d, k), row, options in zip(configs, rows_k, options_k, strict=True):
            spec_s, spec_n, forwards, same, parted = row
            st = options.stats
            print(
                f"| {name} | {task} | {d} | {k or 'adaptive'} | {st.acceptance_length:.2f} | "
                f"{spec_n / max(forwards, 1):.2f} | {plain_n / plain_s:.1f} | {spec_n / spec_s:.1f} | "
                f"{same}/{len(chosen)} |",
                flush=True,
            )
            print(
                f"  {task} {d} k {k or 'adaptive'}: {spec_n} tokens, {st.passes} passes ({st.drafted} drafts, "
                f"{st.kept} kept, {st.pass_tokens} tokens), {st.plain_tokens} plain token steps",
                flush=True,
            )
            for line in parted:
                print(f"  {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
