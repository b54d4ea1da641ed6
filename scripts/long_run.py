"""Long runs on the GPU (issue 16): generation to the end of a 4,096-token context in each weight
format and KV cache format, with every step's logits checked for NaN and infinity, and the greedy
tokens identical across two runs.

    python scripts/long_run.py [--dtypes fp16,fp8,gf4,q8,q4] [--kv fp16,fp8] [--context 4096]
                               [--layers 4] [--cache-dir DIR]

The model: SmolLM2-135M's shape (dim 576, 9 heads of 64, 3 KV heads, hidden 1536, vocabulary
49,152, tied embeddings) with --layers layers of random weights (normal, scaled by 1/sqrt of the
row length: activations stay of order one), written as a pycalm file in each weight format
(pycalm.model.formats.encode, pycalm.model.loader.ModelWriter) and loaded the way the CLI loads one. Each
case (weight format x KV format) builds a GpuEngine with EngineOptions(check_finite=True) and
runs greedy generation from a 16-token prompt to the last position of the context, twice on the
same engine (the second run rewrites the cache), and compares the two token lists. No EOS is
set, so every run reaches the end of the context.

One summary line per case (tokens, tok/s, the check, the comparison); the exit code is non-zero
if any case fails. Compiled kernels are kept in the kernel cache under --cache-dir (default
pycalm's cache folder), so a second run of the script compiles nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pycalm.errors import PycalmError  # noqa: E402
from pycalm.model import formats  # noqa: E402
from pycalm.model.config import WEIGHT_DTYPES, ModelConfig  # noqa: E402
from pycalm.model.loader import ModelWriter, open_model  # noqa: E402
from pycalm.paths import cache_dir  # noqa: E402

PROMPT_TOKENS = 16


def smollm2_config(n_layers: int, dtype: str, context: int) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        dim=576,
        hidden_dim=1536,
        head_dim=64,
        n_layers=n_layers,
        n_heads=9,
        n_kv_heads=3,
        vocab_size=49152,
        max_seq_len=context,
        rope_theta=100000.0,
        rotary_dim=64,
        norm_eps=1e-5,
        bos_id=1,
        eos_ids=(),  # no end of sequence: every run reaches the end of the context
        tied_embeddings=True,
        weight_dtype=dtype,
    )


def write_random_model(path: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """A pycalm file of cfg with random weights, every matrix encoded in its dtype."""
    rng = np.random.default_rng(seed)
    rows_cols = {
        "tok_embeddings": (cfg.vocab_size, cfg.dim),
        "wqkv": (cfg.qkv_dim, cfg.dim),
        "wo": (cfg.dim, cfg.q_dim),
        "w1": (cfg.hidden_dim, cfg.dim),
        "w3": (cfg.hidden_dim, cfg.dim),
        "w2": (cfg.dim, cfg.hidden_dim),
    }
    scales: dict[str, np.ndarray] = {}  # q8 / q4: a matrix's scales, written after its codes
    with ModelWriter(path, cfg, "tokenizers-json", b"{}") as w:
        for spec in w.pending():
            role = spec.name.split(".")[-1]
            if spec.name in scales:
                w.write(spec.name, scales.pop(spec.name))
            elif role in rows_cols:
                rows, cols = rows_cols[role]
                x = (rng.standard_normal((rows, cols), np.float32) / np.sqrt(cols)).astype(np.float32)
                dtype = cfg.dtype_of(spec.name)
                if dtype in formats.QUANTIZED:
                    q = formats.encode(x, dtype, group=cfg.group_of(spec.name))
                    scales[spec.name + ".scales"] = q.scales
                    w.write(spec.name, q.codes)
                else:
                    w.write(spec.name, formats.encode(x, dtype))
            elif role == "rope_freqs":
                i = np.arange(cfg.rotary_dim // 2, dtype=np.float64)
                w.write(spec.name, (cfg.rope_theta ** (-2 * i / cfg.rotary_dim)).astype(np.float32))
            else:  # the RMSNorm weights
                w.write(spec.name, np.ones(spec.shape, np.float32))
    return path


def run_case(model: object, kv: str, context: int) -> tuple[bool, str]:
    """(passed, summary) of two greedy runs to the end of the context on one engine."""
    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.engine import EngineOptions, GpuEngine

    engine = GpuEngine(model, seq_len=context, kv_dtype=kv, options=EngineOptions(check_finite=True))
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, model.config.vocab_size, PROMPT_TOKENS)]
    greedy = SamplingParams(temperature=0.0)
    want = context - PROMPT_TOKENS + 1  # positions len(prompt) - 1 .. context - 1 each sample one
    engine.prepare(greedy, range(PROMPT_TOKENS - 1, context))  # compile and capture, untimed
    runs, rates = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        runs.append(list(engine.generate(prompt, 0, context, greedy)))  # raises on a NaN / inf
        rates.append(len(runs[-1]) / (time.perf_counter() - t0))
    first, second = runs
    same = first == second
    where = ""
    if not same:
        where = f", first difference at token {next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)}"
    distinct = len(set(first))
    ok = same and len(first) == want
    summary = (
        f"{len(first)} tokens to position {context - 1} (want {want}), {rates[0]:.0f} / {rates[1]:.0f} tok/s, "
        f"logits finite at every step, {distinct} distinct tokens, runs {'identical' if same else 'DIFFER'}{where}"
    )
    return ok, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default=",".join(WEIGHT_DTYPES), help="weight formats (default: every one)")
    ap.add_argument("--kv", default="fp16,fp8", help="KV cache formats")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cache-dir", help="pycalm's cache folder, for the compiled kernels")
    args = ap.parse_args()
    from pycalm.gpu import kernel_cache as kernel_cache

    kernel_cache.set_root(cache_dir(args.cache_dir))  # before any kernel module is imported
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            t0 = time.perf_counter()
            try:
                cfg = smollm2_config(args.layers, dtype, args.context)
                model = open_model(write_random_model(Path(tmp) / f"smollm2-{dtype}.pycalm", cfg))
            except (PycalmError, ValueError, KeyError) as e:
                failed += 1
                print(f"long_run {dtype:5} FAIL: cannot make the model: {type(e).__name__}: {e}", flush=True)
                continue
            made = time.perf_counter() - t0
            for kv in args.kv.split(","):
                t0 = time.perf_counter()
                try:
                    ok, summary = run_case(model, kv, args.context)
                except Exception as e:  # noqa: BLE001 - a failed case is reported, the others run
                    ok, summary = False, f"{type(e).__name__}: {e}"
                failed += not ok
                took = time.perf_counter() - t0
                print(
                    f"long_run {dtype:5} kv {kv:4} {'ok  ' if ok else 'FAIL'} {summary} "
                    f"(model {made:.0f} s, case {took:.0f} s)",
                    flush=True,
                )
    print(f"long_run: {'all passed' if not failed else f'{failed} failed'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
