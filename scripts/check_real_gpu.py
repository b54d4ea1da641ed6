"""On the GPU machine: a real model's greedy tokens, GPU engine vs reference engine vs transformers.

    python scripts/check_real_gpu.py MODEL.gguf tests/data/golden_smollm2.json [--dtypes fp16,fp8,gf4] [-n 32]

Converts the GGUF (cached next to it), then for every prompt of the golden file compares the
first N greedy tokens of the GPU engine with the reference engine's (fp16: also with the
transformers ids recorded in the golden file), and prints GPU decode tok/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pycalm.convert.main import convert  # noqa: E402
from pycalm.cpu.engine import CpuEngine  # noqa: E402
from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.gpu.engine import GpuEngine  # noqa: E402
from pycalm.model.loader import open_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("golden")
    ap.add_argument("--dtypes", default="fp16,fp8,gf4")
    ap.add_argument("-n", type=int, default=32)
    args = ap.parse_args()
    golden = json.loads(Path(args.golden).read_text())
    greedy = SamplingParams()
    failures = 0
    for dtype in args.dtypes.split(","):
        out = Path(args.gguf).with_suffix(f".{dtype}.pycalm")
        if not out.exists():
            convert(args.gguf, out, dtype, progress=False)
        model = open_model(out)
        gpu = GpuEngine(model, seq_len=512)
        cpu = CpuEngine(model, seq_len=512)
        for case in golden["cases"]:
            ids = case["prompt_ids"]
            t0 = time.perf_counter()
            got = list(gpu.generate(ids, 0, args.n, greedy))
            dt = time.perf_counter() - t0
            want = list(cpu.generate(ids, 0, args.n, greedy))
            hf = case["generated_ids"][: len(got)]
            same = got == want
            failures += not same
            note = f"; transformers {'same' if got == hf else 'differs'}" if dtype == "fp16" else ""
            print(
                f"{dtype} {case['prompt'][:40]!r}: gpu==ref {same} ({len(got)} tokens, {len(got) / dt:.0f} tok/s incl. prefill){note}"
            )
            if not same:
                print("   gpu", got, "\n   ref", want)
    print("FAILURES", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
