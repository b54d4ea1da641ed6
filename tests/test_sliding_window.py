"""Sliding-window attention (Mistral): what the window means, and that the engine applies it.

The meaning, as transformers applies it (masking_utils.sliding_window_overlay: a key at kv_idx is
visible from query q_idx when q_idx - window < kv_idx <= q_idx): the query at position p attends
to the last W positions INCLUDING itself, p - W + 1 .. p. pycalm's attention_ref takes n_pos =
p + 1 cached positions and attends to [max(0, n_pos - W), n_pos): the same set. The GPU kernel
(test_attention.py compares it with attention_ref) must follow the same rule.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import make_hf_llama

from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.reference import attention_ref
from pycalm.model.loader import open_model

TOKENS = [7, 3, 60, 12, 45, 9, 31, 22, 5, 50]


def loop_attention(q, k, v, positions, n_heads, n_kv_heads, head_dim):  # noqa: ANN001, ANN201
    """Attention of one query over the given cache positions, head by head in float64 loops."""
    group = n_heads // n_kv_heads
    out = np.zeros((n_heads, head_dim))
    for h in range(n_heads):
        qh = q[h * head_dim : (h + 1) * head_dim].astype(np.float64)
        g = h // group
        ks = [k[t, g * head_dim : (g + 1) * head_dim].astype(np.float64) for t in positions]
        vs = [v[t, g * head_dim : (g + 1) * head_dim].astype(np.float64) for t in positions]
        s = np.array([qh @ kt for kt in ks]) / np.sqrt(head_dim)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[h] = sum(pt * vt for pt, vt in zip(p, vs, strict=True))
    return out.reshape(-1)


@pytest.mark.parametrize(
    "n_pos,window", [(10, 4), (10, 1), (10, 9), (10, 10), (3, 4), (4, 4), (5, 4), (10, 0)]
)
def test_window_is_last_w_positions(n_pos, window):
    n_heads, n_kv_heads, head_dim = 6, 2, 16
    rng = np.random.default_rng(n_pos * 100 + window)
    q = rng.standard_normal(n_heads * head_dim).astype(np.float32)
    k = rng.standard_normal((12, n_kv_heads * head_dim)).astype(np.float32)
    v = rng.standard_normal((12, n_kv_heads * head_dim)).astype(np.float32)
    got = attention_ref(q, k, v, n_pos, n_heads, n_kv_heads, head_dim, window)
    first = max(0, n_pos - window) if window else 0
    want = loop_attention(q, k, v, range(first, n_pos), n_heads, n_kv_heads, head_dim)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the same as full attention over a cache holding only those positions
    full = attention_ref(q, k[first:n_pos], v[first:n_pos], n_pos - first, n_heads, n_kv_heads, head_dim)
    np.testing.assert_allclose(got, full, rtol=1e-6, atol=1e-6)


def test_window_excludes_older_positions():
    """Crafted: every key outside the window matches the query strongly, with a value of 100;
    inside the window the keys are orthogonal to it and the values small. Any leak of an old
    position would dominate the output."""
    n_heads, n_kv_heads, head_dim, n_pos, window = 4, 2, 8, 9, 3
    q = np.zeros(n_heads * head_dim, np.float32)
    q[0::head_dim] = 10.0  # every head's query points along its first axis
    k = np.zeros((n_pos, n_kv_heads * head_dim), np.float32)
    v = np.zeros((n_pos, n_kv_heads * head_dim), np.float32)
    for t in range(n_pos):
        if t < n_pos - window:  # outside: score 10 * 10 / sqrt(8) ~ 35 against 0 inside
            k[t, 0::head_dim] = 10.0
            v[t] = 100.0
        else:
            k[t, 1::head_dim] = 1.0
            v[t] = t  # the window's values: 6, 7, 8
    out = attention_ref(q, k, v, n_pos, n_heads, n_kv_heads, head_dim, window)
    np.testing.assert_allclose(out, np.full_like(out, 7.0), rtol=1e-6)  # equal scores: mean of 6, 7, 8
    assert attention_ref(q, k, v, n_pos, n_heads, n_kv_heads, head_dim, 0).min() > 99.0  # no window: old win
    # window 1: the current position only
    np.testing.assert_allclose(attention_ref(q, k, v, n_pos, n_heads, n_kv_heads, head_dim, 1), 8.0)


# ---------------------------------------------------------------------------------------------
# a tiny Mistral model through the reference engine


def mistral(tmp_path, window: int | None, n_layers: int = 2) -> object:
    """The same random weights (seed 0) every call; only config.json's sliding_window differs."""
    name = f"mistral_w{window}_l{n_layers}"
    tiny = make_hf_llama(tmp_path, arch="mistral", n_layers=n_layers, name=name)
    cfg_path = tiny.path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["sliding_window"] = window
    cfg_path.write_text(json.dumps(cfg))
    model = open_model(convert(tiny.path, tmp_path / f"{name}.pycalm", "fp16", progress=False))
    assert model.config.sliding_window == (window or 0)
    return model


def run(model: object, tokens: list[int], kv: str = "fp16") -> np.ndarray:
    engine = CpuEngine(model, seq_len=len(tokens), kv_dtype=kv)
    return np.stack([engine.logits(t, pos) for pos, t in enumerate(tokens)])


def test_window_changes_logits_only_past_w(tmp_path):
    w4 = run(mistral(tmp_path, 4), TOKENS)
    w0 = run(mistral(tmp_path, None), TOKENS)
    # positions 0..3 see at most 4 positions: the window changes nothing, bit for bit
    np.testing.assert_array_equal(w4[:4], w0[:4])
    # from position 4 on the first token has left the window: clearly different logits
    for pos in range(4, len(TOKENS)):
        rel = np.linalg.norm(w4[pos] - w0[pos]) / np.linalg.norm(w0[pos])
        assert rel > 1e-2, (pos, rel)


def test_one_layer_window_equals_fresh_context(tmp_path):
    """With one layer, the windowed model at position p sees tokens p-3..p exactly as a model
    without a window sees them fed alone at positions 0..3: RoPE makes scores depend on relative
    positions only, and the layer's keys depend on their own token only. (Float32 KV cache, so
    only RoPE's rounding at different absolute angles differs.)"""
    windowed = run(mistral(tmp_path, 4, n_layers=1), TOKENS, kv="fp32")
    plain = mistral(tmp_path, None, n_layers=1)
    for p in range(3, len(TOKENS)):
        fresh = run(plain, TOKENS[p - 3 : p + 1], kv="fp32")[-1]
        rel = np.linalg.norm(windowed[p] - fresh) / np.linalg.norm(fresh)
        assert rel < 1e-5, (p, rel)
    # and a window of 3 or 5 would not match (the window counts the current position)
    for other in (3, 5):
        wrong = run(mistral(tmp_path, other, n_layers=1), TOKENS, kv="fp32")
        p = 7
        fresh = run(plain, TOKENS[p - 3 : p + 1], kv="fp32")[-1]
        assert np.linalg.norm(wrong[p] - fresh) / np.linalg.norm(fresh) > 1e-3
