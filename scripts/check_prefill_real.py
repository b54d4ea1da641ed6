"""On the GPU machine: a real model's multi-token prefill against its token-by-token path.

    python scripts/check_prefill_real.py SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/check_prefill_real.py MODEL.gguf --dtypes fp16,fp8 --kv fp16 --ppl-tokens 800

Converts the GGUF (cached next to it as MODEL.<dtype>.pycalm; a .pycalm file is taken as it is,
in its own format), then for every weight format and KV dtype:
  (a) for prompts of --lengths tokens (slices of the text), the last row's logits of the prefill
      (GpuEngine.prefill_logits) against the GPU token step's (GpuEngine.logits, one position at
      a time): relative L2, at most 2e-3;
  (b) greedy continuations of -n tokens of those prompts through generate (the prompt through the
      prefill, then token steps) and through token steps only: identical;
  (c) the perplexity (generate.mean_nll, the CLI's -x) of the first --ppl-tokens tokens of the
      text through the GPU prefill against the CPU reference engine's, within 0.5%;
  (d) batch-invariant decoding (EngineOptions.batch_invariant, the CLI's --batch-invariant):
      greedy continuations of the same prompts fed in one pass and fed one token at a time,
      identical; the decode rate of the mode, and how many continuations differ from (b)'s.
--only-invariant runs (d) alone.
The CPU perplexities (a token step a position in NumPy, the slow part) run in worker processes,
one a (format, KV dtype), alongside the GPU checks. Prints one line a check and exits 1 when
any fails.

The text defaults to README.md and docs/*.md of this repository, joined (any text of enough
tokens will do: --text FILE). Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) it runs given a
tiny model file and tiny --lengths / --ppl-tokens / -n / --seq-len, as a smoke test of the script
only (minutes).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.model.config import WEIGHT_DTYPES  # noqa: E402
from pycalm.model.loader import open_model  # noqa: E402

LOGITS_RTOL = 2e-3  # relative L2 of the prefill's last-row logits against the token step's
PPL_RTOL = 5e-3  # the GPU prefill's perplexity against the CPU reference's


def model_file(path: Path, dtype: str) -> Path:
    """The pycalm file of the GGUF (or Hugging Face folder) in `dtype`, converted once; a .pycalm
    file as it is."""
    if path.suffix == ".pycalm":
        return path
    out = path.with_suffix(f".{dtype}.pycalm")
    if not out.exists():
        from pycalm.convert.main import convert

        convert(path, out, dtype, progress=False)
    return out


def text_ids(model: object, text: str) -> list[int]:
    from pycalm.model.tokenizer import Tokenizer

    cfg = model.config
    tok = Tokenizer.from_blob(
        model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
    )
    return [int(t) for t in tok.encode(text)]


def cpu_perplexity(path: str, kv: str, ids: list[int], seq_len: int) -> float:
    """The CPU reference engine's perplexity of ids (a worker process)."""
    from pycalm.app.perplexity import mean_nll
    from pycalm.cpu.engine import CpuEngine

    model = open_model(path)
    return float(np.exp(mean_nll(CpuEngine(model, seq_len=seq_len, kv_dtype=kv), ids)))


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64)))


def near_tie(
    gpu: object, ids: list[int], prefill: list[int], steps: list[int], err: float
) -> tuple[str, bool]:
    """Where two greedy continuations part: the token path's logits of the two tokens there (the
    prompt and the common tokens fed a position at a time), and their gap against the logits'
    largest magnitude -> (that line, whether it is a near tie: a relative gap below err, the two
    paths' measured relative L2 distance on the prompt's last row)."""
    i = next((k for k, (a, b) in enumerate(zip(prefill, steps, strict=False)) if a != b), None)
    if i is None:
        return f"the same tokens, one stopping earlier ({len(prefill)} and {len(steps)})", False
    logits = [gpu.logits(t, pos) for pos, t in enumerate(ids + steps[:i])][-1]
    a, b = steps[i], prefill[i]
    gap = float(logits[a] - logits[b])
    rel = gap / float(np.abs(logits).max())
    tie = rel < err
    return (
        f"part at token {i}: the token path's logits {a}: {logits[a]:.5f}, {b}: {logits[b]:.5f}, gap"
        f" {gap:.2e} ({rel:.1e} of the largest{', below the paths distance: a near tie' if tie else ''})"
    ), tie


def check_engine(gpu: object, prompts: list[list[int]], n_new: int, label: str) -> tuple[int, int]:
    """(a) and (b) on one engine -> (failures, how many of them are greedy continuations that
    part at a near tie)."""
    failures = ties = 0
    greedy = SamplingParams(temperature=0.0)
    for ids in prompts:
        last = list(gpu.prefill_logits(ids, 0))[-1][-1]  # the last row of the last block
        steps = [gpu.logits(t, pos) for pos, t in enumerate(ids)][-1]  # the token path, its last
        err = rel_l2(last, steps)
        ok = err <= LOGITS_RTOL
        failures += not ok
        print(f"{label} T={len(ids)}: last-row logits rel L2 {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
        through_prefill = list(gpu.generate(ids, 0, n_new, greedy))
        gpu.multi_token = False  # the same engine, the prompt through token steps
        try:
            through_steps = list(gpu.generate(ids, 0, n_new, greedy))
        finally:
            gpu.multi_token = True
        same = through_prefill == through_steps
        failures += not same
        print(
            f"{label} T={len(ids)}: greedy {len(through_prefill)} tokens {'identical' if same else 'DIFFER'}"
        )
        if not same:
            print(f"   prefill {through_prefill}\n   steps   {through_steps}")
            line, tie = near_tie(gpu, ids, through_prefill, through_steps, err)
            ties += tie
            print("   " + line, flush=True)
    return failures, ties


def check_invariant(gpu: object, prompts: list[list[int]], n_new: int, label: str) -> int:
    """(d) on one engine -> failures."""
    import time

    failures = 0
    greedy = SamplingParams(temperature=0.0)
    for ids in prompts:
        gpu.batch_invariant = True
        try:
            t0 = time.perf_counter()
            whole = list(gpu.generate(ids, 0, n_new, greedy))
            seconds = time.perf_counter() - t0
            for pos, token in enumerate(ids[:-1]):  # the prompt one token at a time
                gpu.prefill([token], pos)
            by_token = list(gpu.generate(ids[-1:], len(ids) - 1, n_new, greedy))
        finally:
            gpu.batch_invariant = False
        default = list(gpu.generate(ids, 0, n_new, greedy))  # prefill, then token steps
        same = whole == by_token
        failures += not same
        parted = next((i for i, (a, b) in enumerate(zip(whole, default, strict=False)) if a != b), None)
        print(
            f"{label} T={len(ids)}: batch-invariant greedy {len(whole)} tokens, one pass against one token"
            f" at a time {'identical' if same else 'DIFFER'}; {len(whole) / seconds:.0f} tok/s with the"
            f" prompt's pass; against prefill + token steps: "
            + ("identical" if parted is None else f"part at token {parted}"),
            flush=True,
        )
        if not same:
            print(f"   one pass {whole}\n   by token {by_token}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF file or Hugging Face folder (converted), or a .pycalm file")
    ap.add_argument("--dtypes", default=",".join(WEIGHT_DTYPES), help="weight formats")
    ap.add_argument("--kv", default="fp16,fp8", help="KV-cache dtypes")
    ap.add_argument("--lengths", default="50,200,600", help="prompt lengths (tokens) of (a) and (b)")
    ap.add_argument("-n", type=int, default=32, help="greedy tokens of (b)")
    ap.add_argument("--ppl-tokens", type=int, default=1500, help="tokens of the perplexity text (c)")
    ap.add_argument("--text", help="the text (default: README.md and docs/*.md)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="CPU perplexity workers")
    ap.add_argument("--only-invariant", action="store_true", help="run (d) only")
    args = ap.parse_args()

    from pycalm.app.perplexity import mean_nll
    from pycalm.gpu.engine import GpuEngine

    if args.text:
        text = Path(args.text).read_text()
    else:
        text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    path = Path(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    kvs = args.kv.split(",")
    work = []  # (dtype, kv, model file) of every engine
    for dtype in args.dtypes.split(","):
        try:
            work += [(dtype, kv, model_file(path, dtype)) for kv in kvs]
        except Exception as e:  # noqa: BLE001 - a format the converter does not take: a failure
            print(f"{dtype}: conversion failed: {type(e).__name__}: {e}", flush=True)
            work.append((dtype, None, None))
    ids = text_ids(open_model(work[0][2] or path), text)
    if len(ids) < max(*lengths, args.ppl_tokens) + 1:
        print(f"the text has {len(ids)} tokens, fewer than the checks take", flush=True)
        return 1
    prompts = [ids[n : 2 * n] if 2 * n <= len(ids) else ids[:n] for n in lengths]  # different slices
    ppl_ids = ids[: args.ppl_tokens]
    failures, ties = sum(kv is None for _, kv, _ in work), 0
    work = [w for w in work if w[1] is not None]

    if args.only_invariant:
        for dtype, kv, f in work:
            gpu = GpuEngine(open_model(f), seq_len=args.seq_len, kv_dtype=kv)
            failures += check_invariant(gpu, prompts, args.n, f"{dtype} kv {kv}")
            del gpu
        print("FAILURES", failures)
        return 1 if failures else 0

    # the CPU perplexities (c) in worker processes, one thread each, while the GPU checks run
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    workers = max(1, min(args.jobs, len(work)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        cpu_ppl = {
            (dtype, kv): pool.submit(cpu_perplexity, str(f), kv, ppl_ids, args.seq_len)
            for dtype, kv, f in work
        }
        gpu_ppl = {}
        for dtype, kv, f in work:
            label = f"{dtype} kv {kv}"
            try:
                gpu = GpuEngine(open_model(f), seq_len=args.seq_len, kv_dtype=kv)
                engine_failures, engine_ties = check_engine(gpu, prompts, args.n, label)
                failures, ties = failures + engine_failures, ties + engine_ties
                failures += check_invariant(gpu, prompts, args.n, label)
                gpu_ppl[dtype, kv] = float(np.exp(mean_nll(gpu, ppl_ids)))
                del gpu
            except Exception as e:  # noqa: BLE001 - one engine's failure is reported, the rest go on
                print(f"{label}: failed: {type(e).__name__}: {e}", flush=True)
                failures += 1
        for (dtype, kv), future in cpu_ppl.items():
            if (dtype, kv) not in gpu_ppl:
                continue
            try:
                want = future.result()
            except Exception as e:  # noqa: BLE001
                print(
                    f"{dtype} kv {kv}: CPU reference perplexity failed: {type(e).__name__}: {e}", flush=True
                )
                failures += 1
                continue
            got = gpu_ppl[dtype, kv]
            ok = abs(got / want - 1) <= PPL_RTOL
            failures += not ok
            print(
                f"{dtype} kv {kv}: perplexity of {len(ppl_ids)} tokens: GPU prefill {got:.4f}, CPU reference"
                f" {want:.4f} ({100 * (got / want - 1):+.3f}%) {'ok' if ok else 'FAIL'}",
                flush=True,
            )
    print(
        "FAILURES", failures, f"({ties} of them greedy continuations that part at a near tie)" if ties else ""
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
