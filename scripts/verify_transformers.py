"""Verify pycalm against Hugging Face transformers, the implementation nobody here wrote.

    python scripts/verify_transformers.py [--engine cpu|gpu]
        [--real smollm2=/path/SmolLM2-135M-Instruct.Q4_1.gguf] [--real qwen2=/path/qwen2.5-coder-0.5b.gguf]

Part 1, random weights, one small model per architecture (Llama, Mistral with a sliding window
shorter than the sequence, Qwen2 with q/k/v biases, Mixtral with 8 experts / top 2; Qwen2 also
saved as bfloat16). Each is built with transformers' own config and model classes, saved with
save_pretrained (safetensors), converted with pycalm.convert.main to fp16, and both sides read the same
SEQ random token ids: transformers in float32 in one forward over the whole sequence (eager
attention), pycalm one token at a time through its engine's KV cache. Reported per model:
  rel L2   ||ours - theirs|| / ||theirs|| over all SEQ x vocab logits, theirs = the float32 model;
  rel L2 (same w)  the same against transformers run on the weights pycalm holds (every matrix
           rounded to fp16 as the converter does): what is left is pycalm's own arithmetic and its
           fp16 KV cache, so a subtle bug cannot hide under the weight rounding;
  exact    (CPU engine only) the same with pycalm's KV cache in float32 instead of fp16: what is
           left is float32 summation order, so anything above ~1e-5 is a real difference;
  max abs, greedy (argmax identical at every position) and the smallest top1 - top2 gap of
  transformers' logits (how hard the greedy check is).

Part 2, real weights (--real NAME=GGUF, both optional): transformers loads the GGUF itself
(dequantized to float32) and greedy-decodes N_NEW tokens on several prompts; pycalm converts the
same GGUF to fp16 and greedy-decodes through the chosen engine. Greedy tokens must be identical
for all N_NEW tokens, both against transformers on the GGUF's float32 weights and against
transformers on the fp16-rounded weights pycalm holds. The engine's own generate() (on the GPU:
the CUDA graph with on-device argmax) must produce the same tokens as its per-step logits.

Bounds (docs/VERIFICATION.md gives the measurements behind them): REL_L2_BOUND against the
float32 model, REL_L2_SAME_WEIGHTS_BOUND against the fp16-weight model, REL_L2_EXACT_BOUND for
the float32-KV run. The script prints a table
and exits 1 if any check fails.

Runs on the CPU machine (torch CPU) and on the GPU machine (transformers stays on the CPU in
float32 there too; only pycalm's engine uses the GPU with --engine gpu). Only transformers APIs
that are the same in 5.17 and 5.24 are used: config classes, from_pretrained(gguf_file=),
save_pretrained, a plain forward returning .logits, and generate() with a GenerationConfig (no
cache objects, whose argument names changed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pycalm.convert.main import convert  # noqa: E402
from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.errors import PycalmError  # noqa: E402
from pycalm.model.loader import open_model  # noqa: E402

SEQ = 64  # positions compared per random model
VOCAB = 503  # a prime: no power-of-two shortcut anywhere
N_NEW = 32  # greedy tokens per prompt on the real models
REL_L2_BOUND = 5e-3  # vs the float32 model (fp16 weights); measured up to 1.9e-3, see VERIFICATION.md
REL_L2_SAME_WEIGHTS_BOUND = 2e-3  # vs the fp16-weight model; measured up to 9e-4 (fp16 KV cache)
REL_L2_EXACT_BOUND = 2e-5  # CPU only: fp16-weight model vs a float32 KV cache; measured up to 2e-6
REAL_SEQ_LEN = 256  # context of the engines on the real models


# ---------------------------------------------------------------------------------------------
# The random-weight models


@dataclass(frozen=True)
class Case:
    """One random model: transformers config keyword arguments and how it is saved."""

    name: str
    arch: str  # llama, mistral, qwen2, mixtral
    config: dict[str, Any]
    save_dtype: str = "float32"  # or "bfloat16": the checkpoint dtype (the reference is float32 of it)
    seed: int = 0


_QWEN2 = dict(
    hidden_size=224,
    intermediate_size=608,
    num_hidden_layers=3,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=1000000.0,
    use_sliding_window=False,
)
CASES = [
    # 8 query heads on 2 KV heads (4:1), head_dim 32, hidden 160, tied embeddings
    Case(
        "llama",
        "llama",
        dict(
            hidden_size=160,
            intermediate_size=432,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
        seed=1,
    ),
    # 6 heads on 2 (3:1), head_dim 64, hidden 192, window 24 < 64 positions
    Case(
        "mistral",
        "mistral",
        dict(
            hidden_size=192,
            intermediate_size=544,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            rope_theta=10000.0,
            sliding_window=24,
            tie_word_embeddings=False,
        ),
        seed=2,
    ),
    # 14 heads on 2 (7:1, as Qwen2.5-0.5B), head_dim 32 (q_dim 448 != hidden 224), q/k/v biases
    Case("qwen2", "qwen2", dict(_QWEN2, tie_word_embeddings=False), seed=3),
    Case("qwen2-bf16", "qwen2", dict(_QWEN2, tie_word_embeddings=True), save_dtype="bfloat16", seed=4),
    # 8 experts, top 2; 12 heads on 4 (3:1), head_dim 32, hidden 120
    Case(
        "mixtral",
        "mixtral",
        dict(
            hidden_size=120,
            intermediate_size=200,
            num_hidden_layers=2,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=32,
            rope_theta=1000000.0,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        seed=5,
    ),
]


def _hf_classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
    }[arch]


def _word_tokenizer(vocab_size: int) -> str:
    """A word-level tokenizer.json: the converter needs a tokenizer, the comparison feeds ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return tok.to_str()


def init_weights(model: Any) -> None:
    """Random weights that make a meaningful test, in place (transformers' own init is not one).

    transformers draws matrices with std 0.02 and sets norms to 1 and biases to 0: the logits come
    out nearly flat (argmax ties everywhere) and norm weights and Qwen2's biases go untested. Here
    every matrix gets std scale / sqrt(fan_in), fan_in the last axis (so activations stay O(1)
    through the layers instead of growing into a chaotic regime that amplifies any rounding),
    with scale 1.5 for q and k (attention peaked enough that every position and the window
    matter), 2 for the MoE router (expert choices well separated), 4 for the embedding and the
    classifier (logits with a standard deviation of about 4, so top-1 / top-2 gaps are wide);
    norm weights 1 + N(0, 0.2), biases N(0, 0.5).
    """
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                scale = 1.0
                if "embed_tokens" in name or "lm_head" in name:
                    scale = 4.0
                elif "q_proj" in name or "k_proj" in name:
                    scale = 1.5
                elif name.endswith(".gate.weight"):  # Mixtral's router (mlp.gate / block_sparse_moe.gate)
                    scale = 2.0
                p.copy_(torch.randn_like(p) * (scale / p.shape[-1] ** 0.5))


def build_hf(case: Case, folder: Path) -> Any:
    """Make, initialise and save the model; -> transformers' float32 model read back from the
    saved folder (so the reference sees exactly the checkpoint pycalm converts, and a bfloat16
    checkpoint is widened to float32 by transformers itself, RoPE tables computed in float32)."""
    import torch

    config_cls, model_cls = _hf_classes(case.arch)
    torch.manual_seed(case.seed)
    cfg = config_cls(
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        **case.config,
    )
    model = model_cls(cfg)
    init_weights(model)
    model.to(getattr(torch, case.save_dtype)).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(_word_tokenizer(VOCAB))
    ref = model_cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    if getattr(ref.config, "_attn_implementation", "eager") != "eager":
        raise RuntimeError(f"{case.name}: transformers did not take attn_implementation='eager'")
    return ref


def round_matrices_to_fp16(model: Any) -> None:
    """Round every matrix the converter stores in fp16 (all but norms, biases and the MoE router,
    which it keeps in float32), in place: the weights pycalm's engine really computes with."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.endswith(".gate.weight"):
                p.copy_(p.to(torch.float16).to(torch.float32))


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) float64: one causal forward over the whole sequence."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long))
    return out.logits[0].double().numpy()


def make_engine(kind: str, model: Any, seq_len: int, kv_dtype: str = "fp16") -> Any:
    if kind == "cpu":
        from pycalm.cpu.engine import CpuEngine

        return CpuEngine(model, seq_len=seq_len, kv_dtype=kv_dtype)
    from pycalm.gpu.engine import GpuEngine

    return GpuEngine(model, seq_len=seq_len)


def our_logits(engine: Any, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) float64, one token at a time through the engine's KV cache."""
    return np.stack([engine.logits(int(t), pos) for pos, t in enumerate(ids)]).astype(np.float64)


def rel_l2(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def top_gap(logits: np.ndarray) -> np.ndarray:
    """Per row: top-1 minus top-2 logit."""
    part = np.sort(logits, axis=-1)
    return part[..., -1] - part[..., -2]


@dataclass
class Row:
    """One line of the result table."""

    name: str
    ok: bool
    cells: dict[str, str] = field(default_factory=dict)
    note: str = ""


def verify_random(case: Case, engine_kind: str, work: Path) -> Row:
    t0 = time.perf_counter()
    folder = work / f"hf-{case.name}"
    hf = build_hf(case, folder)
    out = convert(folder, work / f"{case.name}.pycalm", "fp16", progress=False)
    model = open_model(out)
    cfg = model.config
    ids = np.random.default_rng(100 + case.seed).integers(0, VOCAB, SEQ).tolist()
    theirs = hf_logits(hf, ids)
    round_matrices_to_fp16(hf)
    theirs_same = hf_logits(hf, ids)
    try:
        ours = our_logits(make_engine(engine_kind, model, SEQ), ids)
    except PycalmError as e:
        return Row(case.name, False, note=f"pycalm: {e}")
    err = rel_l2(ours, theirs)
    err_same = rel_l2(ours, theirs_same)
    greedy = bool((ours.argmax(-1) == theirs.argmax(-1)).all())
    ok = err < REL_L2_BOUND and err_same < REL_L2_SAME_WEIGHTS_BOUND and greedy
    exact = "-"
    if engine_kind == "cpu":  # the reference engine can keep its KV cache in float32: no rounding left
        err_exact = rel_l2(our_logits(make_engine("cpu", model, SEQ, "fp32"), ids), theirs_same)
        exact = f"{err_exact:.1e}"
        ok = ok and err_exact < REL_L2_EXACT_BOUND
    window = f", window {cfg.sliding_window}" if cfg.sliding_window else ""
    experts = f", {cfg.n_experts} experts top {cfg.n_experts_active}" if cfg.n_experts else ""
    shape = (
        f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads of {cfg.head_dim}"
        f"{window}{experts}{', tied' if cfg.tied_embeddings else ''}, {case.save_dtype}"
    )
    cells = {
        "rel L2": f"{err:.2e}",
        "rel L2 (same w)": f"{err_same:.2e}",
        "exact": exact,
        "max abs": f"{np.abs(ours - theirs).max():.2e}",
        "|logit| max": f"{np.abs(theirs).max():.1f}",
        "greedy": f"{'same' if greedy else 'DIFFERS'} ({SEQ} pos)",
        "min gap": f"{top_gap(theirs).min():.3f}",
        "time": f"{time.perf_counter() - t0:.1f}s",
    }
    return Row(case.name, ok, cells, shape)


# ---------------------------------------------------------------------------------------------
# The real models

PROMPTS: dict[str, list[str | list[dict[str, str]]]] = {
    "smollm2": [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time,",
        [{"role": "user", "content": "What is the capital of France?"}],
    ],
    "qwen2": [
        "The capital of France is",
        "def quicksort(arr):",
        "# Write a function that reverses a string\n",
        [{"role": "user", "content": "Write a Python function that checks if a number is prime."}],
    ],
}


def _prompt_ids(tok: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    """The ids transformers' own tokenizer makes (a chat prompt through the GGUF's template)."""
    if isinstance(prompt, str):
        return list(tok(prompt)["input_ids"])
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def hf_greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """n argmax tokens from transformers' generate(), with its own KV cache.
    -> (tokens, (n, vocab) raw logits).

    generate() is the cache API that is the same in 5.17 and 5.24. It stops after an EOS token
    whatever eos_token_id says (None falls back to the model's own), so where it stops early it
    is called again on the longer sequence. That no logits processor changed a choice is checked
    against the raw logits.
    """
    import torch
    from transformers import GenerationConfig

    seq = list(ids)
    rows: list[np.ndarray] = []
    while len(seq) < len(ids) + n:
        gen = GenerationConfig(
            max_new_tokens=len(ids) + n - len(seq),
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([seq], dtype=torch.long),
                attention_mask=torch.ones(1, len(seq), dtype=torch.long),
                generation_config=gen,
            )
        new = out.sequences[0, len(seq) :].tolist()
        logits = torch.stack([step[0] for step in out.logits]).double().numpy()
        if not new or new != logits.argmax(-1).tolist():
            raise RuntimeError("transformers' generate() did not return the argmax of its raw logits")
        seq += new
        rows += list(logits)
    return seq[len(ids) :], np.stack(rows)


def our_greedy(engine: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """n argmax tokens through engine.logits (no EOS stop). -> (tokens, (n, vocab) logits)."""
    rows = []
    logits = None
    for pos, t in enumerate(ids):
        logits = engine.logits(int(t), pos)
    tokens: list[int] = []
    for step in range(n):
        rows.append(logits.astype(np.float64))
        tokens.append(int(logits.argmax()))
        if step < n - 1:
            logits = engine.logits(tokens[-1], len(ids) + step)
    return tokens, np.stack(rows)


def _first_diff(a: list[int], b: list[int]) -> int:
    """Index of the first difference, or len(a) if none."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _converted(gguf: Path, cache: Path) -> Path:
    """The fp16 pycalm file of gguf, converted once and kept in `cache` under a key made of the
    GGUF's size and mtime and the converter's sources (a converter change makes a fresh one)."""
    import pycalm

    h = hashlib.sha256(f"{gguf.resolve()}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}".encode())
    for mod in (
        "convert/common.py",
        "convert/main.py",
        "model/formats.py",
        "model/loader.py",
        "model/tokenizer.py",
        "model/config.py",
    ):
        h.update((Path(pycalm.__file__).parent / mod).read_bytes())
    out = cache / f"{gguf.stem}-fp16-{h.hexdigest()[:12]}.pycalm"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        convert(gguf, out, "fp16", progress=False)
    return out


def verify_real(name: str, gguf: Path, engine_kind: str, cache: Path) -> list[Row]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    if not gguf.is_file():
        return [Row(name, False, note=f"no such file {gguf}")]
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompts = PROMPTS.get(name, PROMPTS["smollm2"])
    all_ids = [_prompt_ids(tok, p) for p in prompts]
    ref32 = [hf_greedy(hf, ids, N_NEW) for ids in all_ids]
    round_matrices_to_fp16(hf)
    ref16 = [hf_greedy(hf, ids, N_NEW) for ids in all_ids]
    del hf
    t_hf = time.perf_counter() - t0

    t1 = time.perf_counter()
    model = open_model(_converted(gguf, cache))
    t_convert = time.perf_counter() - t1
    t1 = time.perf_counter()
    try:
        engine = make_engine(engine_kind, model, REAL_SEQ_LEN)
    except PycalmError as e:
        return [Row(name, False, note=f"pycalm: {e}")]
    eos = set(model.config.eos_ids)
    rows = []
    for prompt, ids, (tok32, lg32), (tok16, lg16) in zip(prompts, all_ids, ref32, ref16, strict=True):
        tokens, lg = our_greedy(engine, ids, N_NEW)
        d32, d16 = _first_diff(tokens, tok32), _first_diff(tokens, tok16)
        # logits compared over the steps whose prefixes are identical (up to the first difference)
        n32, n16 = min(d32 + 1, N_NEW), min(d16 + 1, N_NEW)
        gen = list(engine.generate(ids, 0, N_NEW, SamplingParams()))
        gen_ok = gen == tokens[: len(gen)] and (len(gen) == N_NEW or gen[-1] in eos)
        ok = d32 == N_NEW and d16 == N_NEW and gen_ok
        text = prompt if isinstance(prompt, str) else "chat: " + prompt[-1]["content"]
        cells = {
            "rel L2": f"{rel_l2(lg[:n32], lg32[:n32]):.2e}",
            "rel L2 (same w)": f"{rel_l2(lg[:n16], lg16[:n16]):.2e}",
            "max abs": f"{np.abs(lg[:n32] - lg32[:n32]).max():.2e}",
            "|logit| max": f"{np.abs(lg32).max():.1f}",
            "greedy": f"same {d32}/{N_NEW}" if d32 == d16 else f"same {d32} (same w {d16})/{N_NEW}",
            "min gap": f"{top_gap(lg32).min():.3f}",
        }
        note = repr(text[:44])
        if d32 < N_NEW:
            note += f"; first difference at step {d32}, transformers' gap there {top_gap(lg32[d32]):.3f}"
        if not gen_ok:
            note += f"; generate() gave {gen} but the per-step argmax {tokens}"
        rows.append(Row(f"{name} #{len(rows) + 1}", ok, cells, note))
    rows[-1].cells["time"] = (
        f"{time.perf_counter() - t1:.0f}s (+hf {t_hf:.0f}s, convert/open {t_convert:.0f}s)"
    )
    return rows


# ---------------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    cols = ["rel L2", "rel L2 (same w)", "exact", "max abs", "|logit| max", "greedy", "min gap", "time"]
    head = ["model", "ok", *cols]
    body = [[r.name, "ok" if r.ok else "FAIL", *(r.cells.get(c, "") for c in cols)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        print(line(b))
    for r in rows:
        if r.note:
            print(f"  {r.name}: {r.note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["cpu", "gpu"], default="cpu", help="pycalm engine to verify")
    ap.add_argument(
        "--real",
        action="append",
        default=[],
        metavar="NAME=GGUF",
        help="also a real model: smollm2=PATH or qwen2=PATH (repeatable)",
    )
    ap.add_argument("--only", help="comma-separated random cases to run (default: all)")
    ap.add_argument("--no-random", action="store_true", help="skip the random-weight models")
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "pycalm-verify",
        help="where real models' conversions are kept between runs",
    )
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would bury the table
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # "Writing model shards"
    except ImportError:
        pass
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, engine {args.engine}")
    print(
        f"bounds: rel L2 < {REL_L2_BOUND:g} vs float32, < {REL_L2_SAME_WEIGHTS_BOUND:g} vs fp16 weights, "
        f"< {REL_L2_EXACT_BOUND:g} exact (cpu); greedy identical"
    )
    rows: list[Row] = []
    t0 = time.perf_counter()
    if not args.no_random:
        only = set(args.only.split(",")) if args.only else None
        work = Path(tempfile.mkdtemp(prefix="pycalm-verify-"))
        try:
            for case in CASES:
                if only is None or case.name in only:
                    rows.append(verify_random(case, args.engine, work))
                    print(f"  {case.name}: {'ok' if rows[-1].ok else 'FAIL'} {rows[-1].cells}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for spec in args.real:
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"--real wants NAME=GGUF, got {spec!r}")
        rows += verify_real(name, Path(path), args.engine, args.cache_dir)
        print(
            f"  {name}: {'ok' if all(r.ok for r in rows if r.name.startswith(name)) else 'FAIL'}", flush=True
        )
    print()
    print_table(rows)
    failed = [r.name for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} passed in {time.perf_counter() - t0:.0f}s")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    if failed:
        print("FAILED:", ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
