"""How far a real model's logits move when only the summation order of its matrix products
changes, with float32 activations and with every product's input rounded to fp16 (CPU only).

    python scripts/rounding_sensitivity.py MODEL.gguf|MODEL.pycalm [-n 12] [--dtype fp16]

The reference engine (pycalm.cpu.reference) runs the same tokens four times: its matvecs summed in
float32 (as it is) or in float64 and then rounded to float32 (another summation order, a change
of about 1e-7 of each product), each with float32 inputs or with the inputs rounded to fp16 as
the multi-token forward's tensor-core matmuls take them. Per position it prints the relative L2
distance of the logits between the two summation orders, for each kind of input.

What it shows (docs/BENCHMARKS.md at b282afd, fifth 2026-12-02 session): on SmolLM2 with float32
inputs the orders differ by 6e-6 to 9e-5; with fp16 inputs by 6e-5 to 1.8e-3, as much as fp16
against float32 inputs. A difference of 1e-7 moves some activations across an fp16 rounding
boundary, and the real model's large activations carry those one-unit steps to the logits. So the
GPU's token step (matvecs) and multi-token forward (mma tiles) cannot agree closer than this by
rounding both the same way: only the same summation order would make them agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pycalm.cpu.reference as ref  # noqa: E402
from pycalm.convert.main import convert  # noqa: E402
from pycalm.model import formats  # noqa: E402
from pycalm.model.loader import open_model  # noqa: E402


def matvec_variant(fp16_inputs: bool, float64_sums: bool):  # noqa: ANN201
    """A stand-in for reference.matvec_ref: x rounded to fp16 first or not, the products summed
    in float32 or in float64 (then rounded to float32)."""

    def matvec(w: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
        x = formats.fp16_encode(x).astype(np.float32) if fp16_inputs else x.astype(np.float32)
        wd = formats.decode(w, dtype)
        if float64_sums:
            return (wd.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
        return (wd @ x).astype(np.float32)

    return matvec


def logits(model: object, ids: list[int], fp16_inputs: bool, float64_sums: bool) -> np.ndarray:
    """(len(ids), vocab) logits of the reference engine, one token step a position, with every
    matvec (QKV, wo, the gate, w2, the classifier: all go through matvec_ref) replaced."""
    saved = ref.matvec_ref
    ref.matvec_ref = matvec_variant(fp16_inputs, float64_sums)
    try:
        engine = ref.ReferenceEngine(model, seq_len=len(ids), kv_dtype="fp16")
        return np.stack([engine.forward(t, pos) for pos, t in enumerate(ids)])
    finally:
        ref.matvec_ref = saved


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF file (converted next to it) or a .pycalm file")
    ap.add_argument("-n", type=int, default=12, help="positions (random token ids)")
    ap.add_argument("--dtype", default="fp16", help="weight format of the conversion")
    args = ap.parse_args()
    path = Path(args.model)
    if path.suffix != ".pycalm":
        out = path.with_suffix(f".{args.dtype}.pycalm")
        if not out.exists():
            convert(str(path), out, args.dtype, progress=False)
        path = out
    model = open_model(path)
    ids = [int(t) for t in np.random.default_rng(0).integers(100, model.config.vocab_size // 2, args.n)]
    for fp16_inputs in (False, True):
        a = logits(model, ids, fp16_inputs, float64_sums=False)
        b = logits(model, ids, fp16_inputs, float64_sums=True)
        label = "fp16 inputs   " if fp16_inputs else "float32 inputs"
        print(
            f"{label}: float32 vs float64 sums, per position:",
            " ".join(f"{rel_l2(a[i], b[i]):.1e}" for i in range(len(ids))),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
