"""What the rows pass's launches beside the weight products cost: the captured pass of a few rows
timed as shipped (its RMSNorms folded into the residual products, pycalm.kernels.skinny.NormFold,
and the QKV epilogue in the QKV product's, skinny_qkv), with the epilogue a launch of its own
(qkv_rows), with neither (an RMSNorm launch before qkv and before the gate, as longer passes run),
and that with its RMSNorm launches replaced by nothing (its outputs are wrong: timing only), which
bounds what folding them away can save.

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
import pycalm.kernels.skinny as skinny_module  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine  # noqa: E402
from pycalm.gpu.prefill import Prefill  # noqa: E402

SHIPPED = {"rmsnorm": rows_module.rmsnorm_rows, "qkv": skinny_module.skinny_qkv, "folds": Prefill.folds}
QKV: list = []  # qkv_apart's (64, qkv_dim) float32 buffer, allocated before the passes are captured


def qkv_apart(x, w, dtype, layer, freqs, state, q, cache, cfg, *, stream, scale=None) -> None:  # noqa: ANN001
    """skinny_qkv as two launches: the product into qkv, then qkv_rows."""
    qkv = QKV[0][: x.shape[0]]
    skinny_module.skinny_matmul(x, w, qkv, dtype, stream=stream, scale=scale)
    rows_module.qkv_rows(qkv, layer, freqs, state, q, cache, cfg, stream=stream)


def skip(*args: object, **kwargs: object) -> None:
    """A launch left out."""


# variant -> (folded, QKV epilogue fused, RMSNorm launches kept)
VARIANTS = {
    "shipped": (True, True, True),
    "qkv_rows apart": (True, False, True),
    "unfolded, qkv_rows apart": (False, False, True),
    "unfolded, no RMSNorm launch": (False, False, False),
}


def time_pass(shape: str, dtype: str, rows: list[int], variant: tuple[bool, bool, bool]) -> dict[int, float]:
    """ms of the captured logits pass of each row count at position 128 in this variant."""
    folded, fused, norms = variant
    Prefill.folds = SHIPPED["folds"] if folded else (lambda self, n_rows: False)
    skinny_module.skinny_qkv = SHIPPED["qkv"] if fused else qkv_apart
    rows_module.rmsnorm_rows = SHIPPED["rmsnorm"] if norms else skip
    cfg = fit_layers(config_for(shape, dtype, 4096), max(rows), 4096)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=4096, kv_dtype="fp16", options=EngineOptions())
    prefill = engine._prefill_step()
    QKV[:] = [cuda.device_array((64, cfg.qkv_dim), np.float32)]
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
    Prefill.folds, skinny_module.skinny_qkv, rows_module.rmsnorm_rows = (
        SHIPPED["folds"], SHIPPED["qkv"], SHIPPED["rmsnorm"],
    )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,qwen2.5-1.5b")
    ap.add_argument("--dtypes", default="fp16,q4")
    ap.add_argument("--rows", default="1,8")
    args = ap.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    print(f"| shape | weights | pass | {' | '.join(f'{n} rows, ms' for n in rows)} |")
    print("|---|---|---|" + "---|" * len(rows))
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for name, variant in VARIANTS.items():
                cells = time_pass(shape, dtype, rows, variant)
                body = " | ".join(f"{cells[n]:.3f}" for n in rows)
                print(f"| {shape} | {dtype} | {name} | {body} |", flush=True)


if __name__ == "__main__":
    main()
