"""Where a draft model's pass goes on the GPU: drafts, the pass, and the host between passes.

    python3 scripts/speculative_profile.py TARGET.gguf DRAFT.gguf [--draft-dtype q8] [--k 7] [--task code]

The real pair (the target in fp16), k fixed, greedy, 64 new tokens after each of the task's 3
prompts of tests/data/speculative_prompts.json. A CUDA event on the draft engine's stream as
ModelDrafter.propose starts (a), the drafts' own event (b: GpuEngine.greedy_tokens records it
after the k drafts, before the step beside the pass), an event after each forward_rows of the
target returns (d), and host marks. Printed a prompt, medians over its passes: the wall time
from one propose to the next; b - a, the draft steps on the GPU (with the host's set-up before
the first); d - b, from the drafts' end to the pass's result back on the host (the pass, and
the step beside it where it slows the pass); the host's time in propose (its launches run ahead
of the GPU), and how much of it passes before the first draft step's launch (the GPU idle); and
the host's time from a pass's result to the next propose (the loop's own work, on the critical
path). The costs are measured at positions 0 and 256 (the prompts run at about 100 to 300). --beside on,off: with and without the step that feeds the last
draft beside the pass (off: that step runs before the next drafts, as on the CPU engine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_speculative
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # pycalm

import numpy as np  # noqa: E402
from bench_speculative import prompt_ids  # noqa: E402
from numba import cuda  # noqa: E402

import pycalm  # noqa: E402
from pycalm.app.speculative import (  # noqa: E402
    MEASURE_ROWS,
    Draft,
    ModelDrafter,
    SpeculationOptions,
    SpeculativeEngine,
    measure_costs,
)
from pycalm.cpu.sampler import SamplingParams  # noqa: E402

GREEDY = SamplingParams()
CONTEXT = 1024


def median(values: list[float]) -> float:
    return float(np.median(values))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--draft-dtype", default="q8")
    ap.add_argument("--k", default="7", help="comma-separated fixed k values")
    ap.add_argument("--task", default="code")
    ap.add_argument("--beside", default="on", help="on, off or on,off: the step beside the pass")
    args = ap.parse_args()
    options = {"device": "gpu", "context": CONTEXT, "verbose": False, "speculate": "off"}
    llm = pycalm.load(args.target, dtype="fp16", **options)
    small = pycalm.load(args.draft, dtype=args.draft_dtype, **options)
    target, draft = llm.engine, small.engine
    for e in (target, draft):
        e.prepare(GREEDY, range(CONTEXT), rows=MEASURE_ROWS)
    drafter = ModelDrafter(draft, target.config)
    for pos in (0, 256):  # (the prompts' text runs at positions of about 100 to 300)
        costs = measure_costs(target, pos, drafter)
        rows = ", ".join(f"{n} rows {s * 1e3:.3f}" for n, s in costs.rows)
        print(f"costs at position {pos} (ms): token step {costs.step * 1e3:.3f}; {rows}; draft step "
              f"{costs.draft_step * 1e3:.3f}")  # fmt: skip

    marks: list[dict] = []  # a pass each: its events and host times
    propose, forward_rows = drafter.propose, target.forward_rows

    def timed_propose(context: list[int], k: int) -> object:
        a = cuda.event()
        t = time.perf_counter()
        a.record(draft.stream)
        mark = {"t": t, "a": a}
        marks.append(mark)
        mark["draft"] = propose(context, k)
        mark["propose"] = time.perf_counter() - t
        return mark["draft"]

    greedy_steps = draft._greedy_steps

    def timed_steps(*a: object, **k: object) -> object:
        steps = greedy_steps(*a, **k)  # (launched as soon as this returns)
        if marks and "first" not in marks[-1]:
            marks[-1]["first"] = time.perf_counter()
        return steps

    def timed_rows(*a: object, **k: object) -> object:
        out = forward_rows(*a, **k)
        if not marks or "back" in marks[-1]:  # (a prompt's prefill, not a pass)
            return out
        d = cuda.event()
        d.record(target.stream)
        d.synchronize()
        m = marks[-1]
        b = m["draft"].device.event  # (reused by the next drafts: read now)
        m.update(drafts=cuda.event_elapsed_time(m["a"], b), to_pass=cuda.event_elapsed_time(b, d))
        m["back"] = time.perf_counter()
        return out

    beside = True
    whole = drafter.draft

    def draft_call(fed: list[int], pos: int, k: int) -> object:
        if beside:
            return whole(fed, pos, k)
        return Draft([], device=draft.greedy_tokens(fed, pos, k))  # (fed_last False: settled as on the CPU)

    drafter.propose, target.forward_rows, drafter.draft = timed_propose, timed_rows, draft_call
    draft._greedy_steps = timed_steps
    prompts = json.load(open(Path(__file__).resolve().parent.parent / "tests/data/speculative_prompts.json"))
    for k, beside in ((int(x), b == "on") for x in args.k.split(",") for b in args.beside.split(",")):
        spec = SpeculativeEngine(target, drafter, SpeculationOptions(k=k, costs=costs))
        drafter.forget()
        for prompt in prompts[args.task][:3]:
            ids = prompt_ids(llm, prompt)
            spec.prefill(ids[:-1], 0)
            marks.clear()
            out = list(spec.generate(ids[-1:], len(ids) - 1, 64, GREEDY))
            m = [x for x in marks if "back" in x]

            wall = median([(n["t"] - p["t"]) * 1e3 for p, n in zip(m, m[1:], strict=False)])
            after = median([(n["t"] - p["back"]) * 1e3 for p, n in zip(m, m[1:], strict=False)])
            drafts = median([x["drafts"] for x in m])
            to_pass = median([x["to_pass"] for x in m])
            host = median([x["propose"] * 1e3 for x in m])
            before = median([(x["first"] - x["t"]) * 1e3 for x in m if "first" in x])
            print(
                f"k {k}, beside {'on' if beside else 'off'}: {len(out)} tokens, {len(m)} passes; ms a pass: wall {wall:.3f} = drafts on the GPU "
                f"{drafts:.3f} + drafts' end to the result {to_pass:.3f} + the host after it {after:.3f} "
                f"(propose's host time {host:.3f}, {before:.3f} of it before the first draft step's launch)",
                flush=True,
            )


if __name__ == "__main__":
    main()
