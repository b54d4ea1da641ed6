"""Calibration for the q4 policy, and perplexity over many tokens at once, on the CPU.

    python -m pycalm.convert.calibrate MODEL TEXT [-c N]     the perplexity of TEXT (as generate's -x)

`forward_rows` is the CPU engine's forward pass (pycalm.cpu.reference's token step) for T tokens
at once, in float32 with the KV values rounded through fp16 as the CPU engine caches them: the
same function of the weights, computed as matrix products (the order of float32 sums apart), so
a perplexity over a few thousand tokens takes seconds where the token path takes many minutes.
Dense models only (no MoE).

`rank_steps` (the converter's `--calibrate TEXT`) measures, for each freshly quantized matrix
of a q4 model, the KL divergence of the model's next-token distributions over the first
CALIBRATE_TOKENS tokens of TEXT when that matrix alone is q4 (the policy's starting group)
against the unquantized model; the layers before the matrix's own are not run again (their
outputs are kept from the unquantized pass). Each possible step of the policy (the matrix to
q8, which removes that divergence, or to groups of 32, which removes the share that the weight
error falls by) is ranked by divergence removed per stored bit added; pycalm.convert.quantize.plan_dtypes
takes them in that order within the budget.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pycalm.convert.quantize import Step, matrix_shapes
from pycalm.cpu.reference import kv_round, prefill_attention_ref, qkv_rows_ref, silu_ref
from pycalm.errors import OneLineParser, PycalmError
from pycalm.model import formats
from pycalm.model.config import ModelConfig

CALIBRATE_TOKENS = 128  # tokens of the calibration text scored; the cost is linear in it
LOGIT_ROWS = 256  # classifier rows at a time: bounds the (rows, vocab_size) logits in memory

Weights = dict[str, np.ndarray]  # name -> float32: matrices (rows, cols), norms, biases, freqs


def _rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm_ref of each row of x (T, dim), float32 (the token path's, not the prefill's fp16)."""
    ms = np.mean(x * x, axis=1, keepdims=True, dtype=np.float32)  # (T, 1)
    return (x * (np.float32(1.0) / np.sqrt(ms + np.float32(eps))) * w).astype(np.float32)


def forward_rows(
    cfg: ModelConfig,
    w: Weights,
    ids: np.ndarray,
    start_layer: int = 0,
    x: np.ndarray | None = None,
    capture: list[np.ndarray] | None = None,
) -> np.ndarray:
    """The final normed hidden rows (T, dim) float32 of tokens `ids` at positions 0..T-1.

    start_layer > 0 starts from x, the residual rows entering that layer (a capture of an
    earlier run); capture, when given, gets the residual rows entering each layer run.
    """
    if cfg.n_experts:
        raise PycalmError("forward_rows runs dense models only (no MoE)")
    if x is None:
        x = w["tok_embeddings"][ids].astype(np.float32)  # (T, dim) residual stream
    for layer in range(start_layer, cfg.n_layers):
        p = f"layers.{layer}."
        if capture is not None:
            capture.append(x)
        xb = _rmsnorm_rows(x, w[p + "attn_norm"], cfg.norm_eps)
        qkv = xb @ w[p + "wqkv"].T  # (T, qkv_dim)
        bias = w[p + "bqkv"] if cfg.qkv_bias else None
        q, k, v = qkv_rows_ref(qkv, bias, 0, w["rope_freqs"], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        k, v = kv_round(k, "fp16"), kv_round(v, "fp16")  # as the CPU engine's fp16 KV cache
        att = prefill_attention_ref(
            q, k, v, 0, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.sliding_window
        )  # (T, q_dim)
        x = (x + att @ w[p + "wo"].T).astype(np.float32)
        xb = _rmsnorm_rows(x, w[p + "ffn_norm"], cfg.norm_eps)
        h = silu_ref(xb @ w[p + "w1"].T) * (xb @ w[p + "w3"].T)  # (T, hidden_dim)
        x = (x + h @ w[p + "w2"].T).astype(np.float32)
    return _rmsnorm_rows(x, w["norm"], cfg.norm_eps)


def classifier(cfg: ModelConfig, w: Weights) -> np.ndarray:
    return w["tok_embeddings" if cfg.tied_embeddings else "output"]


def log_probs(cfg: ModelConfig, w: Weights, hidden: np.ndarray) -> np.ndarray:
    """log softmax of the logits of hidden rows (T, dim) -> (T, vocab_size) float32."""
    out = np.empty((hidden.shape[0], cfg.vocab_size), np.float32)
    cls = classifier(cfg, w)
    for r0 in range(0, hidden.shape[0], LOGIT_ROWS):
        logits = (hidden[r0 : r0 + LOGIT_ROWS] @ cls.T).astype(np.float64)
        m = logits.max(axis=1, keepdims=True)
        out[r0 : r0 + LOGIT_ROWS] = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    return out


def mean_nll(cfg: ModelConfig, w: Weights, ids: list[int]) -> float:
    """The mean negative log-likelihood of ids[1:], each given the ones before (generate's -x)."""
    hidden = forward_rows(cfg, w, np.asarray(ids[:-1]))
    nll = 0.0
    cls = classifier(cfg, w)
    for r0 in range(0, hidden.shape[0], LOGIT_ROWS):
        logits = (hidden[r0 : r0 + LOGIT_ROWS] @ cls.T).astype(np.float64)
        m = logits.max(axis=1)
        log_sum = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
        nexts = np.asarray(ids[r0 + 1 : r0 + 1 + len(logits)])
        nll += float((log_sum - logits[np.arange(len(logits)), nexts]).sum())
    return nll / (len(ids) - 1)


def model_weights(model: object) -> Weights:
    """Every tensor of an open pycalm model file (pycalm.model.loader.ModelFile), decoded to float32."""
    cfg: ModelConfig = model.config
    out = {}
    for name in model.names():
        if name == "tokenizer" or name.endswith(".scales"):
            continue
        t = model.tensor(name)
        dtype = cfg.dtype_of(name)
        out[name] = formats.decode(t, dtype) if name in matrix_shapes(cfg) else np.asarray(t, np.float32)
    return out


# ---------------------------------------------------------------------------------------------
# ranking the policy's steps


def _kl(ref: np.ndarray, got: np.ndarray) -> float:
    """Mean over rows of KL(ref || got), both (T, vocab_size) log-probabilities."""
    return float(np.mean(np.sum(np.exp(ref) * (ref - got), axis=1)))


def _rel_error(w: np.ndarray, group: int) -> float:
    """The squared error of q4 at `group` relative to the matrix's own squared norm."""
    d = formats.decode(formats.encode(w, "q4", group=group), "q4") - w
    return float(np.sum(d * d) / max(float(np.sum(w * w)), 1e-30))


def rank_steps(
    conv: object, text: Path, on_grid: set[str], log: Callable[[str], None] | None = None
) -> list[Step]:
    """The policy's steps ranked by divergence removed per bit added (module docstring), for a
    conversion plan (pycalm.convert.main.Converted) and a calibration text."""
    from pycalm.convert.common import Source
    from pycalm.model.tokenizer import Tokenizer

    cfg: ModelConfig = conv.config
    try:
        body = text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PycalmError(f"calibration text {text}: cannot read it as UTF-8 text ({e})") from None
    tok = Tokenizer.from_blob(conv.tokenizer_kind, conv.tokenizer_blob, cfg.bos_id, cfg.eos_ids, "")
    ids = np.asarray(tok.encode(body, add_bos=True)[:CALIBRATE_TOKENS])
    if len(ids) < 2:
        raise PycalmError(f"calibration text {text}: too short (needs 2 tokens or more)")
    shapes = matrix_shapes(cfg)
    w: Weights = {}
    for name, item in conv.plan.items():
        if isinstance(item, Source):
            w[name] = item.take(np.arange(item.rows)).reshape(item.rows, item.cols)
        else:
            w[name] = np.asarray(item(), np.float32)
    captured: list[np.ndarray] = []
    ref_hidden = forward_rows(cfg, w, ids, capture=captured)
    ref = log_probs(cfg, w, ref_hidden)
    steps: list[tuple[float, Step]] = []
    for name, (n_weights, cols) in shapes.items():
        if name in on_grid:
            continue
        group = 64 if cols % 64 == 0 else 32
        exact = w[name]
        w[name] = formats.decode(formats.encode(exact, "q4", group=group), "q4")
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            hidden = forward_rows(cfg, w, ids, layer, captured[layer])
        elif name == "output":  # the classifier alone: the hidden rows are the same
            hidden = ref_hidden
        else:  # the embedding table (and the classifier, when tied to it)
            hidden = forward_rows(cfg, w, ids)
        divergence = _kl(ref, log_probs(cfg, w, hidden))
        w[name] = exact
        q8_bits = formats.bits_per_weight("q8", cols) - formats.bits_per_weight("q4", cols, group)
        steps.append((divergence / (q8_bits * n_weights), Step(name, "q8")))
        if group == 64:  # groups of 32: the divergence falls as the weight error does
            kept = _rel_error(exact, 32) / max(_rel_error(exact, 64), 1e-30)
            steps.append((divergence * (1 - kept) / (0.5 * n_weights), Step(name, "q4", 32)))
        if log is not None:
            log(f"calibrate: {name} in q4 (groups of {group}): KL {divergence:.5f}")
    steps.sort(key=lambda s: -s[0])
    return [step for _, step in steps]


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m pycalm.convert.calibrate",
        description="Perplexity of a text over all its tokens at once on the CPU (generate's -x).",
    )
    parser.add_argument("model", help="pycalm model file")
    parser.add_argument("text", help="UTF-8 text file")
    parser.add_argument(
        "-c", "--context", type=int, default=4096, help="tokens scored at most (default 4096)"
    )
    args = parser.parse_args(argv)
    from pycalm.model.loader import open_model
    from pycalm.model.tokenizer import Tokenizer

    try:
        with open_model(args.model) as model:
            cfg = model.config
            tok = Tokenizer.from_blob(
                model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
            )
            w = model_weights(model)
        text = Path(args.text).read_text(encoding="utf-8")
        ids = tok.encode(text, add_bos=True)[: min(args.context, cfg.max_seq_len)]
        if len(ids) < 2:
            raise PycalmError(f"{args.text}: too short to measure perplexity (needs 2 tokens or more)")
        nll = mean_nll(cfg, w, ids)
    except (PycalmError, OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"perplexity {math.exp(nll):.4f} over {len(ids) - 1} tokens (cpu, all rows at once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
