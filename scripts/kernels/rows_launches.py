"""What the rows pass's launches beside the weight products cost: the captured pass of a few rows
timed as shipped (its RMSNorms folded into the residual products, pycalm.kernels.skinny.NormFold),
unfolded (an RMSNorm launch before qkv and before the gate, as longer passes run), and unfolded
with its RMSNorm launches, its QKV epilogue (qkv_rows), or both, replaced by nothing (those
outputs are wrong: timing only). The last ones bound what folding a launch away can save.

    python scripts/kernels/rows_launches.py [--shapes llama3-8b,qwen2.5-1.5b] [--dtypes fp16,q4] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ROWS, RandomDeviceModel, config_for, fit_layers  # noqa: E402

import pycalm.kernels.rows as rows_module  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine  # noqa: E402
from pycalm.gpu.prefill import Prefill  # noqa: E402

SHIPPED = {name: getattr(rows_module, name) for name in ("rmsnorm_rows", "qkv_rows")}
FOLDS = Prefill.folds
# variant -> (folded, the launches left out)
VARIANTS = {
    "shipped (folded)": (True, ()),
    "unfolded": (False, ()),
    "unfolded, no norm": (False, ("rmsnorm_rows",)),
    "folded, no qkv_rows": (True, ("qkv_rows",)),
}


def skip(*args: object, **kwargs: object) -> None:
    """A launch left out."""


def time_pass(
    shape: str, dtype: str, rows: list[int], folded: bool, left_out: tuple[str, ...]
) -> dict[int, float]:
    """ms of the captured logits pass of each row count at position 128, folded or not, with
    `left_out` launches replaced by nothing while it is captured (the classifier's RMSNorm too)."""
    for name, fn in SHIPPED.items():
        setattr(rows_module, name, skip if name in left_out else fn)
    Prefill.folds = FOLDS if folded else (lambda self, n_rows: False)
    cfg = fit_layers(config_for(shape, dtype, 4096), max(rows), 4096)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=4096, kv_dtype="fp16", options=EngineOptions())
    prefill = engine._prefill_step()
    rng = np.random.default_rng(0)
    out = {}
    for n in rows:
        ids = [int(t) for t in rng.integers(3, cfg.vocab_size, n)]
        engine.forward_rows(ids, 128)  # compiles and captures the bucket's pass
        engine.forward_rows(ids, 128)
        bucket = next(b for b in ROWS if b >= n)
        graph = prefill._rows_graphs[(bucket, "logits", prefill.span_of(128, bucket))]
        for _ in range(5):  # warm-up
            graph.launch()
        s, e = cuda.event(timing=True), cuda.event(timing=True)
        s.record(engine.stream)
        for _ in range(40):
            graph.launch()
        e.record(engine.stream)
        e.synchronize()
        out[n] = cuda.event_elapsed_time(s, e) / 40
    del engine, prefill
    gc.collect()
    cuda.current_context().deallocations.clear()
    for name, fn in SHIPPED.items():
        setattr(rows_module, name, fn)
    Prefill.folds = FOLDS
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,qwen2.5-1.5b")
    ap.add_argument("--dtypes", default="fp16,q4")
    ap.add_argument("--rows", default="1,8")
    args = ap.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    print(f"| shape | weights | launches | {' | '.join(f'{n} rows, ms' for n in rows)} |")
    print("|---|---|---|" + "---|" * len(rows))
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for variant, (folded, left_out) in VARIANTS.items():
                cells = time_pass(shape, dtype, rows, folded, left_out)
                body = " | ".join(f"{cells[n]:.3f}" for n in rows)
                print(f"| {shape} | {dtype} | {variant} | {body} |", flush=True)


if __name__ == "__main__":
    main()
