"""A draft model's drafts into the target's pass on the GPU, or through the host: ms a token.

    python3 scripts/speculative_chain.py [--draft-dtype q8] [--k 8,4] [--tokens 96]

Random weights of the Qwen2.5-Coder-1.5B (target, fp16) and 0.5B (draft) shapes
(bench.RandomDeviceModel, bench.SHAPES' qwen2.5-1.5b and qwen2.5-0.5b), k fixed: every draft is
rejected, so each pass gives one token and the launches are a real pass's (k draft steps, a
pass of k + 1 rows). "device": the drafts stay on
the GPU (GpuEngine.greedy_tokens) and the pass copies them into its inputs after an event;
"host": the same draft engine without greedy_tokens, so ModelDrafter reads each draft back
(engine.generate) and the pass takes them from the host. Two runs each, interleaved.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # pycalm

import numpy as np  # noqa: E402
from bench import RandomDeviceModel, config_for  # noqa: E402

from pycalm.app.speculative import (  # noqa: E402
    MEASURE_ROWS,
    ModelDrafter,
    SpeculationOptions,
    SpeculativeEngine,
    measure_costs,
)
from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.gpu.engine import GpuEngine  # noqa: E402


class ThroughTheHost:
    """The draft engine without greedy_tokens: its drafts come back step by step."""

    def __init__(self, engine: GpuEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> object:
        if name == "greedy_tokens":
            raise AttributeError(name)
        return getattr(self.engine, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft-dtype", default="q8")
    ap.add_argument("--k", default="8,4")
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    target = GpuEngine(RandomDeviceModel(config_for("qwen2.5-1.5b", "fp16", 1024)), seq_len=1024)
    draft = GpuEngine(RandomDeviceModel(config_for("qwen2.5-0.5b", args.draft_dtype, 1024)), seq_len=1024)
    greedy = SamplingParams()
    for e in (target, draft):
        e.prepare(greedy, range(1024), rows=MEASURE_ROWS)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 30000, 40)]
    costs = measure_costs(target, 100, ModelDrafter(draft, target.config))
    print(f"token step {costs.step * 1e3:.3f} ms, draft step {costs.draft_step * 1e3:.3f} ms, passes "
          + ", ".join(f"{m} rows {s * 1e3:.3f}" for m, s in costs.rows), flush=True)  # fmt: skip
    for k in (int(x) for x in args.k.split(",")):
        for run in range(2):
            for how, d in (("on the device", draft), ("through the host", ThroughTheHost(draft))):
                spec = SpeculativeEngine(
                    target, ModelDrafter(d, target.config), SpeculationOptions(k=k, costs=costs)
                )
                list(spec.generate(ids, 0, 8, greedy))  # warm-up
                t0 = time.perf_counter()
                out = list(spec.generate(ids, 0, args.tokens, greedy))
                ms = (time.perf_counter() - t0) / len(out) * 1e3
                print(f"k {k} run {run}: drafts {how}: {ms:.3f} ms a token", flush=True)


if __name__ == "__main__":
    main()
