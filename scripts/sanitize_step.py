"""One prefill chunk and one token step of each architecture and weight format, at tiny shapes,
for compute-sanitizer (scripts/sanitize.sh runs this under each of its tools).

    python scripts/sanitize_step.py [--archs llama,qwen2,mistral,mixtral] [--dtypes fp16,fp8,...]
                                    [--graph]

Each case converts a tiny random Hugging Face model (tests/tiny_models.py: 2 layers, dim 64,
heads of 16, so the multi-token forward takes it) to the weight format, builds a GpuEngine with
a 32-position context and runs: the prefill of a 24-token prompt in chunks of 16 rows (two
chunks, the second starting mid-cache; Mistral's window is 16 positions, so the second chunk's
rows and the step attend through the window; Mixtral's rows go to their experts in groups),
then the token step at position 24 (logits read back). Qwen2 brings the q/k/v biases. The
steps run as plain launches, one kernel a launch, so a sanitizer report names the kernel;
--graph runs the token step as the captured CUDA graph instead (programmatic edges on sm_90).

Every case prints one line (ok, or FAIL with the error) and the exit code is non-zero if any
failed; a weight format this engine cannot load yet is reported as such and counts as a failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_models import make_hf_llama  # noqa: E402

from pycalm.convert.main import convert  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine  # noqa: E402
from pycalm.model.config import WEIGHT_DTYPES  # noqa: E402
from pycalm.model.loader import open_model  # noqa: E402

ARCHS = ("llama", "qwen2", "mistral", "mixtral")
PROMPT_TOKENS, CHUNK, SEQ_LEN = 24, 16, 32


def run_case(arch: str, dtype: str, folder: Path, graph: bool) -> str:
    """Prefill and one token step of arch in dtype; a short description of what ran."""
    tiny = make_hf_llama(
        folder, arch=arch, dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, name=f"hf-{arch}"
    )
    model = open_model(convert(tiny.path, folder / f"{arch}-{dtype}.pycalm", dtype, progress=False))
    options = EngineOptions(use_graph=graph, prefill_chunk=CHUNK, attention_chunk=8)
    engine = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16" if arch != "qwen2" else "fp8", options=options)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, PROMPT_TOKENS)]
    engine.prefill(prompt, 0)
    logits = engine.logits(prompt[-1], PROMPT_TOKENS)
    if not np.all(np.isfinite(logits)):
        raise RuntimeError("non-finite logits")
    path = "multi-token prefill" if engine.multi_token else "prefill by token steps"
    return f"{path} of {PROMPT_TOKENS} tokens, token step at {PROMPT_TOKENS} ({engine.kv_dtype} KV)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--dtypes", default=",".join(WEIGHT_DTYPES))
    ap.add_argument("--graph", action="store_true", help="the token step as a captured graph")
    args = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            for dtype in args.dtypes.split(","):
                folder = Path(tmp) / f"{arch}-{dtype}"
                try:
                    what = run_case(arch, dtype, folder, args.graph)
                    print(f"sanitize_step {arch:8} {dtype:5} ok: {what}", flush=True)
                except Exception as e:  # noqa: BLE001 - every case reports, then the exit code
                    failed += 1
                    print(f"sanitize_step {arch:8} {dtype:5} FAIL: {type(e).__name__}: {e}", flush=True)
                    traceback.print_exc(limit=3, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
