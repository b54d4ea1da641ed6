"""Converter tests: tiny HF folders and GGUF files in, every output tensor checked by value.

Expected values are computed here independently of pycalm.convert.main (the rotary permutation as a
reshape, the RoPE frequencies from their formulas) and passed through formats.encode/decode, so
they carry exactly the rounding of the chosen weight dtype.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_gguf, make_hf_llama  # noqa: E402

from pycalm.convert import main as convert_mod  # noqa: E402
from pycalm.convert.hf import _hf_rope  # noqa: E402
from pycalm.convert.main import convert, main  # noqa: E402
from pycalm.errors import PycalmError  # noqa: E402
from pycalm.model import formats  # noqa: E402
from pycalm.model.loader import open_model  # noqa: E402

DTYPES = ("fp16", "fp8", "gf4")


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a matrix decodes to after storage in `dtype`."""
    return formats.decode(formats.encode(x, dtype), dtype)


def interleave(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rotate-half rows -> interleaved pairs, full rotary: the classic HF -> Meta permutation."""
    rows = w.shape[0] // n_heads
    x = w.reshape(n_heads, 2, rows // 2, *w.shape[1:])
    return np.swapaxes(x, 1, 2).reshape(w.shape)


def stored(m, name: str) -> np.ndarray:
    return formats.decode(m.tensor(name), m.config.weight_dtype)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mixtral"])
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_tensors(tmp_path, arch, src_dtype, dtype):
    tiny = make_hf_llama(tmp_path, arch=arch, dtype=src_dtype)
    out = convert(tiny.path, tmp_path / "m.safetensors", dtype, progress=False)
    w = tiny.weights
    with open_model(out) as m:
        c = m.config
        assert (c.arch, c.dim, c.hidden_dim, c.head_dim, c.n_layers) == (arch, 32, 48, 8, 2)
        assert (c.n_heads, c.n_kv_heads, c.vocab_size, c.rotary_dim, c.weight_dtype) == (4, 2, 64, 8, dtype)
        assert c.qkv_bias == (arch == "qwen2")
        assert c.sliding_window == (16 if arch == "mistral" else 0)
        assert (c.n_experts, c.n_experts_active) == ((4, 2) if arch == "mixtral" else (0, 0))
        assert not c.tied_embeddings
        np.testing.assert_array_equal(
            stored(m, "tok_embeddings"), rounded(w["model.embed_tokens.weight"], dtype)
        )
        np.testing.assert_array_equal(stored(m, "output"), rounded(w["lm_head.weight"], dtype))
        np.testing.assert_array_equal(m.tensor("norm"), w["model.norm.weight"])
        theta = 1e6 if arch == "qwen2" else 1e4
        np.testing.assert_allclose(m.tensor("rope_freqs"), theta ** -(np.arange(0, 8, 2) / 8), rtol=1e-6)
        for layer in range(2):
            p, hf = f"layers.{layer}.", f"model.layers.{layer}."
            att = hf + "self_attn."
            qkv = np.concatenate(
                [
                    interleave(w[att + "q_proj.weight"], 4),
                    interleave(w[att + "k_proj.weight"], 2),
                    w[att + "v_proj.weight"],
                ]
            )
            np.testing.assert_array_equal(stored(m, p + "wqkv"), rounded(qkv, dtype))
            np.testing.assert_array_equal(stored(m, p + "wo"), rounded(w[att + "o_proj.weight"], dtype))
            np.testing.assert_array_equal(m.tensor(p + "attn_norm"), w[hf + "input_layernorm.weight"])
            np.testing.assert_array_equal(m.tensor(p + "ffn_norm"), w[hf + "post_attention_layernorm.weight"])
            if arch == "qwen2":
                b = np.concatenate(
                    [
                        interleave(w[att + "q_proj.bias"], 4),
                        interleave(w[att + "k_proj.bias"], 2),
                        w[att + "v_proj.bias"],
                    ]
                )
                np.testing.assert_array_equal(m.tensor(p + "bqkv"), b)
            else:
                assert not m.has(p + "bqkv")
            if arch == "mixtral":
                moe = hf + "block_sparse_moe."
                assert m.tensor(p + "moe_gate").dtype == np.float32
                np.testing.assert_array_equal(m.tensor(p + "moe_gate"), w[moe + "gate.weight"])
                for ours in ("w1", "w2", "w3"):
                    stack = np.stack([w[f"{moe}experts.{e}.{ours}.weight"] for e in range(4)])
                    got = stored(m, p + ours)
                    assert got.shape == stack.shape
                    np.testing.assert_array_equal(got, rounded(stack, dtype))
            else:
                mlp = hf + "mlp."
                np.testing.assert_array_equal(
                    stored(m, p + "w1"), rounded(w[mlp + "gate_proj.weight"], dtype)
                )
                np.testing.assert_array_equal(
                    stored(m, p + "w2"), rounded(w[mlp + "down_proj.weight"], dtype)
                )
                np.testing.assert_array_equal(stored(m, p + "w3"), rounded(w[mlp + "up_proj.weight"], dtype))
    # the file is plain safetensors: the library itself reads every tensor
    assert len(load_file(out)) == len(open_model(out).names())


def test_hf_bf16_exact_in_fp16(tmp_path):
    """bf16 -> float32 is exact (the top half of a float32); check one value by hand too."""
    tiny = make_hf_llama(tmp_path, dtype="bfloat16")
    x = tiny.weights["model.embed_tokens.weight"]
    assert np.all((x.view(np.uint32) & 0xFFFF) == 0)  # really bf16 values
    out = convert(tiny.path, tmp_path / "m.safetensors", "fp16", progress=False)
    np.testing.assert_array_equal(open_model(out).tensor("tok_embeddings"), x.astype(np.float16))


def test_hf_config_fields(tmp_path):
    tiny = make_hf_llama(tmp_path, arch="llama", tie=True)
    (tiny.path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    with open_model(convert(tiny.path, tmp_path / "m.safetensors", "fp8", progress=False)) as m:
        assert m.config.tied_embeddings and not m.has("output")
        assert m.config.eos_ids == (2, 3, 7)  # config's list, then generation_config's extra
        assert m.config.bos_id == 1  # the tokenizer.json post-processor prepends <s> (id 1)
        assert m.config.norm_eps == 1e-5 and m.config.max_seq_len == 256
        assert m.tokenizer_kind == "tokenizers-json"
        assert m.tokenizer_blob == (tiny.path / "tokenizer.json").read_bytes()
        assert m.chat_template == "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def test_hf_qwen2_no_bos_and_sentencepiece(tmp_path):
    tiny = make_hf_llama(tmp_path, arch="qwen2")
    with open_model(convert(tiny.path, tmp_path / "a.safetensors", "fp16", progress=False)) as m:
        assert m.config.bos_id == -1 and m.config.eos_ids == (2,)
    # no tokenizer.json: tokenizer.model travels as a sentencepiece blob; template from .jinja
    (tiny.path / "tokenizer.json").unlink()
    (tiny.path / "tokenizer_config.json").write_text("{}")
    (tiny.path / "tokenizer.model").write_bytes(b"\x0a\x03abc")
    (tiny.path / "chat_template.jinja").write_text("JINJA")
    with open_model(convert(tiny.path, tmp_path / "b.safetensors", "fp16", progress=False)) as m:
        assert m.tokenizer_kind == "sentencepiece" and m.tokenizer_blob == b"\x0a\x03abc"
        assert m.chat_template == "JINJA"
        assert m.config.bos_id == 1  # sentencepiece: config's bos_token_id


def test_hf_sharded(tmp_path):
    one = make_hf_llama(tmp_path, arch="mistral", name="one")
    three = make_hf_llama(tmp_path, arch="mistral", shards=3, name="three")
    assert (three.path / "model.safetensors.index.json").is_file()
    a = load_file(convert(one.path, tmp_path / "a.safetensors", "gf4", progress=False))
    b = load_file(convert(three.path, tmp_path / "b.safetensors", "gf4", progress=False))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_llama3_rope_scaling(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    tiny = make_hf_llama(tmp_path, head_dim=128, rope_theta=500000.0, rope_scaling=scaling)
    with open_model(convert(tiny.path, tmp_path / "m.safetensors", "fp16", progress=False)) as m:
        got = m.tensor("rope_freqs")
    assert got.shape == (64,)
    expected, regimes = [], set()
    for i in range(64):
        f = 500000.0 ** (-2 * i / 128)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            expected.append(f)
            regimes.add("high")
        elif wavelen > 8192 / 1:
            expected.append(f / 8)
            regimes.add("low")
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            expected.append((1 - smooth) * f / 8 + smooth * f)
            regimes.add("medium")
    assert regimes == {"high", "medium", "low"}
    np.testing.assert_allclose(got, expected, rtol=2e-6)


def test_partial_rotary(tmp_path):
    tiny = make_hf_llama(tmp_path, head_dim=16, partial_rotary_factor=0.5)
    with open_model(convert(tiny.path, tmp_path / "m.safetensors", "fp16", progress=False)) as m:
        assert (m.config.head_dim, m.config.rotary_dim) == (16, 8)
        np.testing.assert_allclose(m.tensor("rope_freqs"), 1e4 ** -(np.arange(0, 8, 2) / 8), rtol=1e-6)
        wqkv = stored(m, "layers.0.wqkv")
    q = tiny.weights["model.layers.0.self_attn.q_proj.weight"]
    for h in range(4):
        for i in range(4):  # pairs (i, i + 4) of the rotated 8 dims become rows (2i, 2i + 1)
            np.testing.assert_array_equal(wqkv[16 * h + 2 * i], rounded(q[16 * h + i], "fp16"))
            np.testing.assert_array_equal(wqkv[16 * h + 2 * i + 1], rounded(q[16 * h + i + 4], "fp16"))
        np.testing.assert_array_equal(
            wqkv[16 * h + 8 : 16 * h + 16], rounded(q[16 * h + 8 : 16 * h + 16], "fp16")
        )


# ---------------------------------------------------------------------------------------------
# YaRN (Qwen2.5 beyond 32k): frequencies, the attention factor folded into q and k, a forward pass


def yarn_expected(
    theta: float,
    d: int,
    factor: float,
    old_ctx: float,
    beta_fast: float = 32,
    beta_slow: float = 1,
    truncate: bool = True,
) -> tuple[np.ndarray, int | float, int | float]:
    """transformers' _compute_yarn_parameters reread in float64: (inverse frequencies, lo, hi).

    Pair i turns by theta^(-2i/d) a position; the pair that turns r times over the original
    context is d ln(old_ctx / (2 pi r)) / (2 ln theta). Up to lo (r = beta_fast, floored) the
    frequency is kept, from hi (r = beta_slow, ceiled) on it is divided by factor, and between
    them the divided one's weight rises linearly from 0 at lo to 1 at hi.
    """
    pair = lambda r: d * math.log(old_ctx / (2 * math.pi * r)) / (2 * math.log(theta))  # noqa: E731
    lo, hi = pair(beta_fast), pair(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    f = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    w = np.clip((np.arange(d // 2) - lo) / (hi - lo), 0, 1)  # weight of f / factor
    return f * (1 - w) + f / factor * w, lo, hi


def qwen25_cfg(**scaling: float | bool) -> dict:
    """Qwen2.5-7B's config.json with the rope_scaling its model card asks for above 32k tokens."""
    return {
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, **scaling},
    }


def test_yarn_qwen25_frequencies():
    rope = _hf_rope(qwen25_cfg(), 128)
    assert rope.theta == 1e6 and rope.max_seq_len == 4 * 32768
    assert rope.attention_factor == pytest.approx(1.1386294361119891, rel=1e-15)  # 0.1 ln 4 + 1
    want, lo, hi = yarn_expected(1e6, 128, 4.0, 32768)
    # the correction pairs: 32 turns over 32k at pair 23.60, one turn at pair 39.65
    assert (lo, hi) == (23, 40)
    f = 1e6 ** (-np.arange(0, 128, 2) / 128)
    np.testing.assert_allclose(want[:24], f[:24], rtol=1e-15)  # kept
    np.testing.assert_allclose(want[40:], f[40:] / 4, rtol=1e-15)  # interpolated
    np.testing.assert_allclose(want[30], f[30] * (10 / 17) + f[30] / 4 * (7 / 17), rtol=1e-15)
    assert rope.inv_freq.dtype == np.float32 and rope.inv_freq.shape == (64,)
    np.testing.assert_allclose(rope.inv_freq, want, rtol=2e-6)


def test_yarn_options():
    # truncate false: the ramp runs between the unrounded pairs 23.60 and 39.65
    rope = _hf_rope(qwen25_cfg(truncate=False), 128)
    want, lo, hi = yarn_expected(1e6, 128, 4.0, 32768, truncate=False)
    assert 23.5 < lo < 23.7 and 39.6 < hi < 39.7
    np.testing.assert_allclose(rope.inv_freq, want, rtol=2e-6)
    assert not np.allclose(rope.inv_freq, yarn_expected(1e6, 128, 4.0, 32768)[0], rtol=1e-3)
    # other betas
    rope = _hf_rope(qwen25_cfg(beta_fast=16, beta_slow=2), 128)
    np.testing.assert_allclose(rope.inv_freq, yarn_expected(1e6, 128, 4.0, 32768, 16, 2)[0], rtol=2e-6)
    # no original context: max_position_embeddings stands for it
    cfg = qwen25_cfg()
    del cfg["rope_scaling"]["original_max_position_embeddings"]
    cfg["max_position_embeddings"] = 8192
    rope = _hf_rope(cfg, 128)
    np.testing.assert_allclose(rope.inv_freq, yarn_expected(1e6, 128, 4.0, 8192)[0], rtol=2e-6)
    assert rope.max_seq_len == 4 * 8192
    # the attention factor: given, or DeepSeek's mscale ratio
    assert _hf_rope(qwen25_cfg(attention_factor=1.5), 128).attention_factor == 1.5
    ds = _hf_rope(qwen25_cfg(factor=40.0, mscale=0.707, mscale_all_dim=1.0), 128).attention_factor
    assert ds == pytest.approx((0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1), rel=1e-15)
    assert _hf_rope(qwen25_cfg(factor=40.0, mscale=1.0), 128).attention_factor == pytest.approx(
        0.1 * math.log(40) + 1, rel=1e-15
    )


def test_yarn_folded_into_q_and_k(tmp_path):
    """The attention factor a multiplies the rotated q and k rows and biases before encoding (the
    stored rows equal the source's times a, then rounded); v and unrotated rows stay as they were."""
    tiny = make_hf_llama(
        tmp_path, arch="qwen2", rope_theta=100.0, rope_scaling={"type": "yarn", "factor": 4.0}
    )
    a = np.float32(0.1 * math.log(4) + 1)
    with open_model(convert(tiny.path, tmp_path / "m.safetensors", "fp16", progress=False)) as m:
        assert m.config.max_seq_len == 4 * 256  # the original context is max_position_embeddings
        want, lo, hi = yarn_expected(100.0, 8, 4.0, 256)
        assert (lo, hi) == (0, 4)  # every pair of the tiny heads blends its own way
        np.testing.assert_allclose(m.tensor("rope_freqs"), want, rtol=2e-6)
        for layer in range(2):
            att = f"model.layers.{layer}.self_attn."
            w = {k[len(att) :]: v for k, v in tiny.weights.items() if k.startswith(att)}
            qkv = [
                interleave(w["q_proj.weight"] * a, 4),
                interleave(w["k_proj.weight"] * a, 2),
                w["v_proj.weight"],
            ]
            np.testing.assert_array_equal(
                stored(m, f"layers.{layer}.wqkv"), rounded(np.concatenate(qkv), "fp16")
            )
            b = [interleave(w["q_proj.bias"] * a, 4), interleave(w["k_proj.bias"] * a, 2), w["v_proj.bias"]]
            np.testing.assert_array_equal(m.tensor(f"layers.{layer}.bqkv"), np.concatenate(b))
    # partial rotary: only the rotated rows of each head carry a
    tiny = make_hf_llama(
        tmp_path,
        head_dim=16,
        partial_rotary_factor=0.5,
        rope_scaling={"type": "yarn", "factor": 4.0},
        name="p",
    )
    with open_model(convert(tiny.path, tmp_path / "p.safetensors", "q8", progress=False)) as m:
        wqkv = stored(m, "layers.0.wqkv")
    q = tiny.weights["model.layers.0.self_attn.q_proj.weight"].reshape(4, 16, 32)
    q = np.concatenate([q[:, :8] * a, q[:, 8:]], axis=1).reshape(64, 32)
    perm = np.concatenate([16 * h + np.r_[np.arange(8).reshape(2, 4).T.reshape(-1), 8:16] for h in range(4)])
    np.testing.assert_array_equal(wqkv[:64], rounded(q[perm], "q8"))


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def hf_yarn_forward(w: dict[str, np.ndarray], cfg: dict, tokens: list[int], inv_freq: np.ndarray, a: float):
    """Logits (len(tokens), vocab) of a Qwen2 model as transformers runs it (float64): rotate-half
    RoPE of frequencies inv_freq, with cos and sin multiplied by the attention factor a."""
    n_heads, n_kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd = cfg["hidden_size"] // n_heads
    T = len(tokens)
    angles = np.arange(T)[:, None] * np.concatenate([inv_freq, inv_freq])[None, :]  # (T, hd)
    cos, sin = (a * np.cos(angles))[:, None, :], (a * np.sin(angles))[:, None, :]

    def rope(x: np.ndarray) -> np.ndarray:  # (T, heads, hd)
        rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
        return x * cos + rot * sin

    x = w["model.embed_tokens.weight"][tokens]  # (T, dim)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        xb = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        proj = {
            n: xb @ w[f"{p}self_attn.{n}_proj.weight"].T + w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"
        }
        q = rope(proj["q"].reshape(T, n_heads, hd))
        k = rope(proj["k"].reshape(T, n_kv, hd))
        v = proj["v"].reshape(T, n_kv, hd)
        att = np.zeros((T, n_heads, hd))
        for t in range(T):
            for h in range(n_heads):
                g = h // (n_heads // n_kv)
                s = k[: t + 1, g] @ q[t, h] / np.sqrt(hd)
                pr = np.exp(s - s.max())
                att[t, h] = (pr / pr.sum()) @ v[: t + 1, g]
        x = x + att.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        xb = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = xb @ w[p + "mlp.gate_proj.weight"].T, xb @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return rmsnorm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def test_yarn_engine_matches_hf_forward(tmp_path):
    """The CPU engine on a converted tiny Qwen2 with YaRN against transformers' way of running
    it, written here: cos and sin times the attention factor, not folded into the weights.

    The attention factor is given as 2 here: scaling by a power of two commutes with the fp16
    rounding of the stored matrices, so the only difference left is float32 against float64
    arithmetic (the default factor's folding is checked bit for bit above)."""
    from pycalm.cpu.engine import CpuEngine

    scaling = {"type": "yarn", "factor": 4.0, "attention_factor": 2.0, "original_max_position_embeddings": 64}
    tiny = make_hf_llama(tmp_path, arch="qwen2", rope_theta=100.0, rope_scaling=scaling)
    tokens = [5, 17, 3, 42, 9, 30, 11, 60]
    with open_model(convert(tiny.path, tmp_path / "m.safetensors", "fp16", progress=False)) as m:
        engine = CpuEngine(m, seq_len=len(tokens), kv_dtype="fp32")
        got = np.stack([engine.logits(t, pos) for pos, t in enumerate(tokens)]).astype(np.float64)
    held = {k: (rounded(v, "fp16") if v.ndim == 2 else v).astype(np.float64) for k, v in tiny.weights.items()}
    yarn, lo, hi = yarn_expected(100.0, 8, 4.0, 64)
    assert (lo, hi) == (0, 3)  # pair weights of f / 4: 0, 1/3, 2/3, 1

    def err(inv_freq: np.ndarray, a: float) -> float:
        want = hf_yarn_forward(held, tiny.config, tokens, inv_freq, a)
        return float((np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)).max())

    # float32 against float64: measured 4.1e-7
    assert err(yarn, 2.0) < 1e-5
    # and the test can tell (measured 1.0, 1.1, 1.4): without the factor, with plain frequencies
    # or with linear scaling
    plain = 100.0 ** (-np.arange(0, 8, 2) / 8)
    assert min(err(yarn, 1.0), err(plain, 2.0), err(plain / 4, 2.0)) > 1e-2


def test_yarn_needs_a_factor(tmp_path, capsys):
    tiny = make_hf_llama(tmp_path, rope_scaling={"type": "yarn", "original_max_position_embeddings": 128})
    with pytest.raises(PycalmError, match=r"^yarn rope scaling needs a factor > 0: \{.*\}$"):
        convert(tiny.path, tmp_path / "m.safetensors", "fp16")
    assert main([str(tiny.path), str(tmp_path / "m.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "needs a factor" in err
    for bad in ({"factor": "4"}, {"factor": 4.0, "beta_fast": "x"}):
        with pytest.raises(PycalmError, match="yarn rope scaling"):
            _hf_rope(qwen25_cfg(**bad), 128)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers (on the GPU machine) absent"
)
@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32768},
        {"factor": 4.0},
        {"factor": 8.0, "original_max_position_embeddings": 32768, "beta_fast": 16, "beta_slow": 2},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0},
        {"factor": 4.0, "original_max_position_embeddings": 32768, "truncate": False},
    ],
)
def test_yarn_matches_transformers(scaling):
    """The converter's YaRN against transformers' own ROPE_INIT_FUNCTIONS["yarn"] (torch, CPU)."""
    import inspect

    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS["yarn"]
    unread = [key for key in scaling if key != "factor" and key not in inspect.getsource(fn)]
    if unread:  # older transformers (4.46: no original context, no mscale; 4.53: no truncate)
        pytest.skip(f"transformers {transformers.__version__}'s yarn does not read {unread}")
    # max_position_embeddings = factor x original: some transformers versions (4.5x) take the factor
    # as their ratio when original_max_position_embeddings is given, the others read `factor`
    old_ctx = scaling.get("original_max_position_embeddings", 32768)
    max_pos = int(scaling["factor"] * old_ctx) if "original_max_position_embeddings" in scaling else old_ctx
    rope_scaling = {"rope_type": "yarn", **scaling}
    kwargs = dict(
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max_pos,
    )
    if "rope_parameters" in inspect.signature(transformers.Qwen2Config.__init__).parameters:
        config = transformers.Qwen2Config(**kwargs, rope_parameters={**rope_scaling, "rope_theta": 1e6})
    else:
        config = transformers.Qwen2Config(**kwargs, rope_theta=1e6, rope_scaling=rope_scaling)
    inv_freq, attention_factor = fn(config, "cpu")
    cfg = {"max_position_embeddings": max_pos, "rope_theta": 1e6, "rope_scaling": rope_scaling}
    rope = _hf_rope(cfg, 128)
    assert rope.attention_factor == pytest.approx(float(attention_factor), rel=1e-12)
    np.testing.assert_allclose(rope.inv_freq, inv_freq.numpy(), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["gf4", "q8"])
def test_chunked_streaming_same_bytes(tmp_path, monkeypatch, dtype):
    """Row chunks (here 2 rows), encoded on 3 threads, give the same file as whole tensors on one,
    across expert boundaries."""
    tiny = make_hf_llama(tmp_path, arch="mixtral", dtype="bfloat16")
    a = convert(tiny.path, tmp_path / "a.safetensors", dtype, progress=False, threads=1).read_bytes()
    monkeypatch.setattr(convert_mod, "CHUNK_ELEMS", 100)
    b = convert(tiny.path, tmp_path / "b.safetensors", dtype, progress=False, threads=3).read_bytes()
    assert a == b


# ---------------------------------------------------------------------------------------------
# GGUF files


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16", "F32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_tensors(tmp_path, arch, qtype):
    tie = arch == "llama"
    tiny = make_gguf(tmp_path, arch=arch, qtype=qtype, tie=tie)
    dtype = {"Q8_0": "fp16", "Q4_0": "fp8", "Q4_1": "gf4", "Q5_0": "fp16", "F16": "fp8", "F32": "gf4"}[qtype]
    out = convert(tiny.path, tmp_path / "m.safetensors", dtype, progress=False)
    w = tiny.weights
    with open_model(out) as m:
        c = m.config
        assert (c.arch, c.dim, c.hidden_dim, c.head_dim, c.n_layers, c.n_heads, c.n_kv_heads) == (
            arch,
            64,
            96,
            16,
            2,
            4,
            2,
        )
        assert (c.vocab_size, c.rotary_dim, c.max_seq_len, c.norm_eps) == (64, 16, 256, 1e-5)
        assert c.rope_theta == (1e6 if arch == "qwen2" else 1e4)
        assert c.tied_embeddings == tie and m.has("output") == (not tie)
        assert c.qkv_bias == (arch == "qwen2")
        assert (c.bos_id, c.eos_ids) == (1, (2,))
        np.testing.assert_array_equal(stored(m, "tok_embeddings"), rounded(w["token_embd.weight"], dtype))
        if not tie:
            np.testing.assert_array_equal(stored(m, "output"), rounded(w["output.weight"], dtype))
        np.testing.assert_array_equal(m.tensor("norm"), w["output_norm.weight"])
        np.testing.assert_allclose(
            m.tensor("rope_freqs"), c.rope_theta ** -(np.arange(0, 16, 2) / 16), rtol=1e-6
        )
        # llama GGUF q/k are already interleaved; qwen2's are rotate-half and get permuted
        perm = interleave if arch == "qwen2" else (lambda x, n: x)
        for layer in range(2):
            p, b = f"layers.{layer}.", f"blk.{layer}."
            qkv = np.concatenate(
                [perm(w[b + "attn_q.weight"], 4), perm(w[b + "attn_k.weight"], 2), w[b + "attn_v.weight"]]
            )
            np.testing.assert_array_equal(stored(m, p + "wqkv"), rounded(qkv, dtype))
            if arch == "qwen2":
                bias = np.concatenate(
                    [perm(w[b + "attn_q.bias"], 4), perm(w[b + "attn_k.bias"], 2), w[b + "attn_v.bias"]]
                )
                np.testing.assert_array_equal(m.tensor(p + "bqkv"), bias)
            np.testing.assert_array_equal(stored(m, p + "wo"), rounded(w[b + "attn_output.weight"], dtype))
            np.testing.assert_array_equal(stored(m, p + "w1"), rounded(w[b + "ffn_gate.weight"], dtype))
            np.testing.assert_array_equal(stored(m, p + "w2"), rounded(w[b + "ffn_down.weight"], dtype))
            np.testing.assert_array_equal(stored(m, p + "w3"), rounded(w[b + "ffn_up.weight"], dtype))
            np.testing.assert_array_equal(m.tensor(p + "attn_norm"), w[b + "attn_norm.weight"])
            np.testing.assert_array_equal(m.tensor(p + "ffn_norm"), w[b + "ffn_norm.weight"])


def test_gguf_quantized_values_are_really_quantized(tmp_path):
    """Guards the test above: Q4_0 weights differ from their float source, so equality means
    the converter dequantized the blocks (gguf.quants), not that the test compared floats."""
    tiny = make_gguf(tmp_path, qtype="Q4_0")
    w = tiny.weights["blk.0.attn_q.weight"]
    levels = np.unique(np.abs(w[0, :32]) / np.abs(w[0, :32]).max())
    assert len(levels) <= 9  # a Q4_0 block holds at most 16 signed levels of one scale


def test_gguf_rope_freqs_and_tokenizer(tmp_path):
    tiny = make_gguf(tmp_path, rope_freqs=True, add_bos=False)
    with open_model(convert(tiny.path, tmp_path / "m.safetensors", "fp16", progress=False)) as m:
        base = 1e4 ** -(np.arange(0, 16, 2) / 16)
        divisors = 1 + np.arange(8) / 4
        np.testing.assert_allclose(m.tensor("rope_freqs"), base / divisors, rtol=1e-6)
        assert m.config.bos_id == -1  # add_bos_token false
        assert m.tokenizer_kind == "tokenizers-json"
        assert m.chat_template.startswith("{% for m in messages %}<|im_start|>")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(m.tokenizer_blob.decode())
        assert tok.get_vocab_size() == 64
        assert tok.token_to_id("th") == 62


def test_gguf_k_quants(tmp_path):
    """Q4_K / Q6_K (256-value super-blocks, no gguf quantizer): hand-made blocks with finite
    scales, converted values equal gguf's own dequantization."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(1)
    tiny = make_gguf(tmp_path, dim=256, hidden_dim=256, n_layers=1, n_heads=4, n_kv_heads=4, qtype="F16")
    # rewrite the file with q in Q4_K and ffn_down in Q6_K
    src = gguf.GGUFReader(tiny.path)
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, f in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, f.contents())
        else:
            writer.add_key_value(key, f.contents(), vtype)
    expect = {}
    for t in src.tensors:
        kind = {"blk.0.attn_q.weight": T.Q4_K, "blk.0.ffn_down.weight": T.Q6_K}.get(t.name)
        if kind is None:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (256, 256 // block * size), dtype=np.uint8)
        scale = np.array([0.01], dtype=np.float16).view(np.uint8)
        if kind == T.Q4_K:  # d, dmin at bytes 0..3
            raw[:, 0:2], raw[:, 2:4] = scale, scale
        else:  # d at the last 2 bytes
            raw[:, -2:] = scale
        writer.add_tensor(t.name, raw, raw_dtype=kind)
        expect[t.name] = gguf.quants.dequantize(raw, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open_model(convert(path, tmp_path / "m.safetensors", "fp16", progress=False)) as m:
        np.testing.assert_array_equal(
            stored(m, "layers.0.wqkv")[:256], rounded(expect["blk.0.attn_q.weight"], "fp16")
        )
        np.testing.assert_array_equal(
            stored(m, "layers.0.w2"), rounded(expect["blk.0.ffn_down.weight"], "fp16")
        )


# ---------------------------------------------------------------------------------------------
# errors a user can cause


def test_missing_source(tmp_path):
    with pytest.raises(PycalmError, match="source not found"):
        convert(tmp_path / "nope", tmp_path / "m.safetensors", "fp16")


def test_unsupported_hf_arch(tmp_path):
    tiny = make_hf_llama(tmp_path)
    cfg = json.loads((tiny.path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PycalmError, match="unsupported architecture GPT2LMHeadModel"):
        convert(tiny.path, tmp_path / "m.safetensors", "fp16")


def test_unsupported_rope_scaling(tmp_path):
    tiny = make_hf_llama(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    supported = r"\(pycalm supports default, linear, llama3, yarn\)"
    with pytest.raises(PycalmError, match=f"unsupported rope scaling 'dynamic' {supported}"):
        convert(tiny.path, tmp_path / "m.safetensors", "fp16")


def test_bad_dtype(tmp_path):
    tiny = make_hf_llama(tmp_path)
    with pytest.raises(PycalmError, match="unsupported weight dtype 'int4'"):
        convert(tiny.path, tmp_path / "m.safetensors", "int4")


def test_gf4_needs_multiple_of_8(tmp_path):
    tiny = make_hf_llama(tmp_path, hidden_dim=36)
    convert(tiny.path, tmp_path / "ok.safetensors", "fp8", progress=False)  # fine in fp8
    with pytest.raises(PycalmError, match="w2: gf4 needs rows whose length is a multiple of 8, got 36"):
        convert(tiny.path, tmp_path / "m.safetensors", "gf4")


def test_missing_hf_tensor(tmp_path):
    tiny = make_hf_llama(tmp_path)
    from tiny_models import write_safetensors

    keep = {k: ("F32", v) for k, v in tiny.weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    write_safetensors(tiny.path / "model.safetensors", keep)
    with pytest.raises(PycalmError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        convert(tiny.path, tmp_path / "m.safetensors", "fp16")


@pytest.mark.parametrize("threads", [1, 3])
def test_nan_weights_leave_no_file(tmp_path, monkeypatch, threads):
    """A bad chunk stops the conversion with one error naming the tensor, whether it was encoded
    here or on one of the threads (chunks of 2 rows: others are under way beside it)."""
    monkeypatch.setattr(convert_mod, "CHUNK_ELEMS", 100)
    tiny = make_hf_llama(tmp_path)
    from tiny_models import write_safetensors

    weights = dict(tiny.weights)
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"].copy()
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    write_safetensors(tiny.path / "model.safetensors", {k: ("F32", v) for k, v in weights.items()})
    out = tmp_path / "m.safetensors"
    with pytest.raises(PycalmError, match="model.layers.1.mlp.down_proj.weight: weights contain NaN"):
        convert(tiny.path, out, "fp16", progress=False, threads=threads)
    assert not out.exists() and not (tmp_path / "m.safetensors.tmp").exists()


def test_gguf_unsupported_arch(tmp_path):
    tiny = make_gguf(tmp_path, arch="phi2")
    with pytest.raises(PycalmError, match="unsupported GGUF architecture 'phi2'"):
        convert(tiny.path, tmp_path / "m.safetensors", "fp16")


def test_gguf_unsupported_tensor_type(tmp_path):
    tiny = make_gguf(tmp_path, raw_types={"blk.1.ffn_up.weight": "Q2_K"}, dim=256, hidden_dim=256)
    with pytest.raises(PycalmError, match="tensor 'blk.1.ffn_up.weight' has type Q2_K"):
        convert(tiny.path, tmp_path / "m.safetensors", "fp16")


def test_gguf_truncated_and_garbage(tmp_path):
    tiny = make_gguf(tmp_path)
    data = tiny.path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PycalmError, match="cut.gguf"):
        convert(cut, tmp_path / "m.safetensors", "fp16")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(PycalmError, match="not a readable GGUF file"):
        convert(bad, tmp_path / "m.safetensors", "fp16")
    other = tmp_path / "x.bin"
    other.write_bytes(b"hello world")
    with pytest.raises(PycalmError, match="neither a Hugging Face folder nor a GGUF file"):
        convert(other, tmp_path / "m.safetensors", "fp16")


def test_cli(tmp_path, capsys):
    tiny = make_hf_llama(tmp_path)
    out = tmp_path / "cli.safetensors"
    assert main([str(tiny.path), str(out), "--dtype", "fp8"]) == 0
    err = capsys.readouterr().err
    assert "converting [" in err and "wrote" in err
    assert open_model(out).config.weight_dtype == "fp8"
    assert main([str(tmp_path / "missing"), str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: source not found: {tmp_path / 'missing'}"


def test_threads_must_not_be_negative(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), str(tmp_path / "m.safetensors"), "--threads", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --threads must be 0 or more, got -1 (see python -m pycalm.convert --help)"
    ]
