"""A draft model's speculation replayed offline: how k's policies fare at a GPU's measured costs.

    python3 scripts/speculative_replay.py trace TARGET.gguf DRAFT.gguf --out traces.json \\
        [--dtype fp16] [--draft-dtype q8] [--tasks code,chat,grounded] [--prompts 3] [--new 64]
    python3 scripts/speculative_replay.py replay traces.json [--step 1.875] [--passes 2:2.18,...]
        [--draft 0.81] [--beside 0.38] [--host 0.08] [--stretch 0.15] [--catch-up 1.6]
        [--believed-step 1.80 --believed-pass ... --believed-draft 0.74] [--k 3,...,8,adaptive]

Acceptance does not depend on the device, and with greedy drafts neither does the text: the
target's greedy tokens are plain decoding's, and at each position p of them the draft model's
greedy continuation of the text so far agrees with them for some L(p) tokens (L(p) >= k: a
pass from p keeps all k drafts). `trace` computes, on the CPU engine, each prompt's greedy output
(the bench's prompts, tests/data/speculative_prompts.json) and L(p) at every p (up to 9: k is 8 at
most), stopping each continuation at its first miss.

`replay` then runs pycalm.app.speculative.SpeculativeEngine's own loop (AdaptiveK, probes,
stretches off, the draft model's catch-up) over stand-ins whose tokens come from the trace and
whose time is a clock advanced by costs, ms: a plain token (--step), a pass of n rows (--passes,
the n-row bucket's), a draft step as the loop runs it (--draft), what the step beside the pass
adds to it (--beside), the host's time a pass (--host), a plain stretch's start and end
(--stretch), a catch-up pass of up to 64 rows of the draft model (--catch-up). The
policy's own belief (the PassCosts measure_costs gives it, at position 0) comes from --believed
(the same keys; default the costs above). Printed per task: each k's tok/s ratio to plain
decoding, tokens a pass and passes / plain steps. Its aim: to tell what the policy costs against
the best fixed k, apart from the GPU's noise (a run of 3 prompts of 64 tokens moves a few %).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from pycalm.app import speculative  # noqa: E402
from pycalm.app.speculative import (  # noqa: E402
    CATCH_UP_PASSES,
    ROWS_MOST,
    Draft,
    ModelDrafter,
    PassCosts,
    SpeculationOptions,
    SpeculativeEngine,
)
from pycalm.cpu.sampler import SamplingParams  # noqa: E402

GREEDY = SamplingParams()
LONGEST = 9  # L(p) is counted up to this (a pass takes k <= 8 drafts)


# ---------------------------------------------------------------------------------------------
# trace


def trace(args: argparse.Namespace) -> None:
    from bench_speculative import PROMPTS, prompt_ids

    import pycalm

    options = dict(device="cpu", context=1024, threads=args.threads, speculate="off", verbose=False)
    target = pycalm.load(args.target, dtype=args.dtype, **options)
    draft = pycalm.load(args.draft, dtype=args.draft_dtype, **options)
    prompts = json.loads(PROMPTS.read_text())
    out: dict[str, list] = {}
    for task in args.tasks.split(","):
        out[task] = []
        for prompt in prompts[task][: args.prompts]:
            ids = prompt_ids(target, prompt)
            t, d = target.engine, draft.engine
            t.prefill(ids[:-1], 0)
            made = list(t.generate(ids[-1:], len(ids) - 1, args.new, GREEDY))
            text = ids + made
            d.prefill(ids[:-1], 0)
            agree = []  # L(p) for p = 0 .. len(made) - 1, the p-th new token's position len(ids) + p
            for p in range(len(made)):
                at = len(ids) + p  # the position of made[p]
                n = 0
                for token in d.generate([text[at - 1]], at - 1, min(LONGEST, len(made) - p), GREEDY):
                    if token != text[at + n]:
                        break
                    n += 1
                agree.append(n)
            out[task].append(dict(prompt=ids, made=made, agree=agree))
            print(f"{task}: {len(made)} tokens, mean L {np.mean(agree):.2f}", flush=True)
    Path(args.out).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# replay


class Clock:
    """Simulated milliseconds."""

    def __init__(self) -> None:
        self.ms = 0.0


class Target:
    """The target as SpeculativeEngine sees it: plain stretches and passes give the trace's
    tokens (greedy: a pass's row i samples the token after row i's prefix), and advance the
    clock."""

    multi_token, simple = True, False

    def __init__(self, config: object, clock: Clock, costs: dict) -> None:
        self.config, self.seq_len, self.clock, self.costs = config, 1 << 20, clock, costs
        self.text: list[int] = []  # the prompt and its greedy tokens

    def prefill(self, ids: list[int], start_pos: int) -> None:
        pass

    def set_next(self, token: int, pos: int) -> None:
        pass

    def generate(self, ids: list[int], start_pos: int, n: int, sampling: object) -> object:
        self.clock.ms += self.costs["stretch"]  # (a call's start and end leave the GPU idle a moment)
        for i in range(n):
            self.clock.ms += self.costs["step"]
            yield self.text[start_pos + 1 + i]

    def forward_rows(
        self, ids: list[int], pos: int, samplings: object = None, coins: object = None
    ) -> np.ndarray:
        n = len(ids)
        pass_ms = next(ms for rows, ms in self.costs["pass"] if rows >= n)
        self.clock.ms += pass_ms + self.costs["beside"] + self.costs["host"]
        return np.array(self.text[pos + 1 : pos + 1 + n], np.int32)


class Drafter:
    """ModelDrafter's bookkeeping over the trace: its cache follows the text by position (the
    drafts but the last, and the last too where a step beside the pass feeds it), a stretch it
    did not draft for is caught up in passes of up to ROWS_MOST rows, and each draft costs a
    draft step; its drafts agree with the text for L(p) tokens, then miss."""

    name, one_source, PRIOR, DECAY = "draft", True, ModelDrafter.PRIOR, ModelDrafter.DECAY

    def __init__(self, clock: Clock, costs: dict) -> None:
        self.clock, self.costs = clock, costs
        self.text: list[int] = []  # the prompt and its greedy tokens
        self.start, self.agree = 0, []  # the position of the first new token, L(p) from there
        self.valid = 0  # the leading tokens of the text its cache holds

    def prior(self, key: object) -> float:
        return self.PRIOR

    def source(self, context: list[int]) -> str:
        return "model"

    def prefill(self, ids: list[int], start_pos: int) -> None:
        self.valid = start_pos + len(ids)

    def propose(self, context: list[int], k: int) -> Draft:
        catch_up = max(len(context) - 1 - self.valid, 0)
        fed = 1
        if catch_up == 1:
            fed = 2
        elif catch_up:
            self.clock.ms += -(-catch_up // ROWS_MOST) * self.costs["catch_up"]
            if catch_up > CATCH_UP_PASSES * ROWS_MOST:
                raise SystemExit("a catch-up longer than the loop takes in pieces: not replayed")
        p = len(context) - self.start  # the new token the first draft stands for
        k = min(k, len(self.agree) - p)
        self.clock.ms += (fed - 1 + k) * self.costs["draft"]
        n = min(k, self.agree[p])
        drafts = [self.text[len(context) + i] if i < n else -1 for i in range(k)]  # n agree, then misses
        kept_most = k if self.costs["beside"] > 0 else k - 1  # its cache: the drafts but the last, or all
        self.valid = len(context) + min(n, kept_most)
        draft = Draft(drafts)
        draft.caught_up = catch_up > 1
        return draft


def replay(args: argparse.Namespace) -> None:
    from pycalm.model.config import ModelConfig

    def table(text: str) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(a), float(b)) for a, b in (x.split(":") for x in text.split(","))))

    costs = dict(step=args.step, draft=args.draft, beside=args.beside, catch_up=args.catch_up, host=args.host,
                 stretch=args.stretch)  # fmt: skip
    costs["pass"] = table(args.passes)
    believed_pass = table(args.believed_pass) if args.believed_pass else costs["pass"]
    believed = PassCosts(
        args.believed_step / 1e3,
        tuple((n, ms / 1e3) for n, ms in believed_pass),
        draft_step=args.believed_draft / 1e3,
        draft_call=0.0,
        feed_last=0.0 if args.beside > 0 else None,
        measured=True,
    )
    Drafter.DECAY = ModelDrafter.DECAY if args.decay is None else args.decay
    Drafter.PRIOR = ModelDrafter.PRIOR if args.prior is None else args.prior
    traces = json.loads(Path(args.traces).read_text())
    config = ModelConfig(
        arch="llama", dim=16, hidden_dim=16, head_dim=16, n_layers=1, n_heads=1, n_kv_heads=1,
        vocab_size=1 << 20, max_seq_len=1 << 20, rope_theta=1e4, rotary_dim=16, norm_eps=1e-5,
        bos_id=1, eos_ids=(), weight_dtype="fp16",
    )  # fmt: skip
    print(f"| task | k | x plain | tokens a pass | passes / plain steps | (costs ms: {costs})")
    print("|---|---|---|---|---|")
    for task, prompts in traces.items():
        for k in [None if x == "adaptive" else int(x) for x in args.k.split(",")]:
            clock = Clock()
            # the loop's own wall times (AdaptiveK's online correction) read the clock
            speculative.time = SimpleNamespace(perf_counter=lambda clock=clock: clock.ms / 1e3)
            target, drafter = Target(config, clock, costs), Drafter(clock, costs)
            options = SpeculationOptions(k=k, costs=believed)
            spec = SpeculativeEngine(target, drafter, options)
            made = 0
            for t in prompts:
                ids = t["prompt"]
                target.text = drafter.text = ids + t["made"]
                drafter.start, drafter.agree = len(ids), t["agree"]
                spec.prefill(ids[:-1], 0)
                out = list(spec.generate(ids[-1:], len(ids) - 1, len(t["made"]), GREEDY))
                assert out == t["made"], "the replay parted from the trace"
                made += len(out)
            st = options.stats
            x = made * args.step / clock.ms
            tokens = st.pass_tokens / max(st.passes, 1)
            print(
                f"| {task} | {k or 'adaptive'} | {x:.3f} | {tokens:.2f} | {st.passes} / {st.plain_tokens} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace")
    t.add_argument("target")
    t.add_argument("draft")
    t.add_argument("--out", required=True)
    t.add_argument("--dtype", default="fp16")
    t.add_argument("--draft-dtype", default="q8")
    t.add_argument("--tasks", default="code,chat,grounded")
    t.add_argument("--prompts", type=int, default=3)
    t.add_argument("--new", type=int, default=64)
    t.add_argument("--threads", type=int, default=None)
    r = sub.add_parser("replay")
    r.add_argument("traces")
    # the H100's of 2026-12-07 (docs/BENCHMARKS.md, bench_speculative and speculative_profile):
    # plain 533 tok/s, passes of 2-16 rows 2.18-2.35 ms and 0.38 more beside the draft's step, 7
    # drafts 5.69 ms in the loop, the host 0.06-0.08 ms a pass; a stretch's start and end 0.15
    # ms; a catch-up pass of the 0.5B (q8, up to 64 rows) 1.6 ms (not measured)
    r.add_argument("--step", type=float, default=1.875)
    r.add_argument("--passes", default="2:2.18,4:2.19,8:2.21,16:2.35")
    r.add_argument("--draft", type=float, default=0.81)
    r.add_argument("--beside", type=float, default=0.38)
    r.add_argument("--host", type=float, default=0.08)
    r.add_argument("--stretch", type=float, default=0.15)
    r.add_argument("--catch-up", type=float, default=1.6)
    # what measure_costs told the policy (position 0): a step 1.80 ms, passes 1.36-1.44 steps, a draft 0.41
    r.add_argument("--believed-step", type=float, default=1.80)
    r.add_argument("--believed-pass", default="2:2.45,4:2.47,8:2.48,16:2.59")
    r.add_argument("--believed-draft", type=float, default=0.74)
    r.add_argument("--k", default="3,4,5,6,7,8,adaptive")
    r.add_argument("--decay", type=float, help="the drafter's DECAY (default ModelDrafter's)")
    r.add_argument("--prior", type=float, help="the drafter's PRIOR (default ModelDrafter's)")
    args = ap.parse_args()
    trace(args) if args.command == "trace" else replay(args)


if __name__ == "__main__":
    main()
