"""The whole GPU engine (pycalm.gpu) against the reference engine, on tiny random models.

Under the CUDA simulator in CI (the step runs as eager launches), on the GPU with
PYCALM_TEST_GPU=1 (the step is a captured CUDA graph). Greedy tokens must be identical and the
logits close: both engines read the same stored weights and round the KV cache the same way,
so the difference is float32 summation order only.
"""

import os

import numpy as np
import pytest
from tiny_models import make_hf_llama

from pycalm.convert import convert
from pycalm.engine import CpuEngine
from pycalm.gpu import EngineOptions, GpuEngine, step_bytes
from pycalm.loader import open_model
from pycalm.sampler import SamplingParams

PROMPT = [5, 9]
GPU_ONLY = pytest.mark.skipif(os.environ.get("PYCALM_TEST_GPU") != "1", reason="simulator time: GPU only")


def tiny_model(tmp_path, arch: str, dtype: str, **kw):
    tiny = make_hf_llama(
        tmp_path, arch=arch, dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, **kw
    )
    return open_model(convert(tiny.path, tmp_path / f"{arch}-{dtype}.pycalm", dtype, progress=False))


@pytest.mark.parametrize(
    "arch,dtype,kv",
    # every weight format, both KV dtypes and the Qwen2 biases; the simulator takes about 40 s a
    # token step here, so CI runs the one case that covers the most (biases, gf4, fp8 KV) and
    # the GPU runs all three
    [
        ("qwen2", "gf4", "fp8"),
        pytest.param("llama", "fp16", "fp16", marks=GPU_ONLY),
        pytest.param("llama", "fp8", "fp16", marks=GPU_ONLY),
    ],
)
def test_gpu_engine_matches_reference(tmp_path, arch, dtype, kv):
    model = tiny_model(tmp_path, arch, dtype)
    cpu = CpuEngine(model, seq_len=12, kv_dtype=kv)
    gpu = GpuEngine(model, seq_len=12, kv_dtype=kv)
    assert gpu.kv_dtype == kv

    # logits at every position of the prompt
    for pos, tok in enumerate(PROMPT):
        want = cpu.logits(tok, pos)
        got = gpu.logits(tok, pos)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * scale)

    # greedy generation from a fresh cache: the prompt fed by graph replays, tokens sampled on the
    # device; attention chunks of 2 positions, so that the steps at positions 0, 1 (one live
    # chunk) and 2 (two, the combine) are the steps of two attention spans, 2 and 4
    cpu = CpuEngine(model, seq_len=12, kv_dtype=kv)
    gpu = GpuEngine(model, seq_len=12, kv_dtype=kv, options=EngineOptions(attention_chunk=2))
    greedy = SamplingParams(temperature=0.0)
    want = list(cpu.generate(PROMPT, 0, 2, greedy))
    got = list(gpu.generate(PROMPT, 0, 2, greedy))
    assert sorted(span for _, span in gpu._graphs) == [2, 4]
    assert got == want and len(got) == 2  # no end-of-sequence token: the step at 2 ran


@pytest.mark.skipif(
    os.environ.get("PYCALM_TEST_GPU") != "1", reason="realistic shapes: GPU only (PYCALM_TEST_GPU=1)"
)
@pytest.mark.parametrize(
    "dtype,programmatic", [("fp16", False), ("fp8", False), ("gf4", False), ("fp8", True), ("gf4", True)]
)
def test_gpu_engine_realistic_shape(tmp_path, dtype, programmatic):
    """Many blocks per kernel, chunked attention, GQA 8:1, head_dim 128, a 150-token context;
    also with the graph's edges programmatic (each kernel may start before the one before it
    ends, and waits for it after loading its weights)."""
    tiny = make_hf_llama(
        tmp_path,
        arch="llama",
        dim=1024,
        hidden_dim=2816,
        n_layers=2,
        n_heads=8,
        n_kv_heads=1,
        vocab_size=4096,
    )
    model = open_model(convert(tiny.path, tmp_path / f"big-{dtype}.pycalm", dtype, progress=False))
    cpu = CpuEngine(model, seq_len=160)
    gpu = GpuEngine(model, seq_len=160, options=EngineOptions(programmatic=programmatic))
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, 4096, 150)]
    greedy = SamplingParams(temperature=0.0)
    want = list(cpu.generate(prompt, 0, 8, greedy))
    got = list(gpu.generate(prompt, 0, 8, greedy))
    assert got == want
    # the step's graph really has programmatic edges (one between each two kernels) or none
    edges = gpu.graph(greedy).programmatic_edges
    assert edges > 10 if programmatic else edges == 0
    for pos, tok in [(len(prompt) + len(want) - 1, want[-1])]:  # the last sampled token was never fed
        w, g = cpu.logits(tok, pos), gpu.logits(tok, pos)
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-4 * np.abs(w).max())


@pytest.mark.parametrize(
    "arch,dtype,kv,pos,chunk",
    [("qwen2", "gf4", "fp8", 5, 4), ("llama", "fp8", "fp16", 3, 4), ("mixtral", "fp16", "fp16", 9, 2)],
)
def test_step_bytes_counts_every_array(tmp_path, arch, dtype, kv, pos, chunk):
    """step_bytes (from the config) against a count of the model file's own arrays and the
    engine's buffers, launch by launch: the stored formats' sizes, Qwen2's biases, the active
    experts of a MoE layer, the KV rows at pos, attention's partials past one chunk."""
    model = tiny_model(tmp_path, arch, dtype)
    cfg = model.config

    def nbytes(name: str) -> int:
        return model.tensor(name).nbytes

    f32 = np.dtype(np.float32).itemsize
    kv_row = np.zeros(cfg.kv_dim, np.float16 if kv == "fp16" else np.uint8).nbytes  # one of K or V
    x, q, h = (np.zeros(n, np.float32).nbytes for n in (cfg.dim, cfg.q_dim, cfg.hidden_dim))
    k = cfg.n_experts_active if cfg.n_experts else 1
    route = 2 * k * f32  # ids and weights
    want = {"embed": nbytes("tok_embeddings") // cfg.vocab_size + x}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        bias = nbytes(p + "bqkv") if cfg.qkv_bias else 0
        qkv = nbytes(p + "wqkv") + bias + nbytes(p + "attn_norm") + nbytes("rope_freqs") + x + q + 2 * kv_row
        live = -(-(pos + 1) // chunk)
        partials = 2 * live * cfg.n_heads * (cfg.head_dim + 2) * f32 if live > 1 else 0
        per_layer = {
            "qkv_rope": qkv,
            "attention": (pos + 1) * 2 * kv_row + 2 * q + partials,
            "wo+res": nbytes(p + "wo") + q + 2 * x,
        }
        if cfg.n_experts:  # k of the n_experts stacked matrices
            per_layer["moe_route"] = nbytes(p + "moe_gate") + nbytes(p + "ffn_norm") + x + route
            w13 = (nbytes(p + "w1") + nbytes(p + "w3")) * k // cfg.n_experts
            per_layer["ffn_gate"] = w13 + nbytes(p + "ffn_norm") + x + k * h + route
            per_layer["w2+res"] = nbytes(p + "w2") * k // cfg.n_experts + k * h + 2 * x + route
        else:
            per_layer["ffn_gate"] = nbytes(p + "w1") + nbytes(p + "w3") + nbytes(p + "ffn_norm") + x + h
            per_layer["w2+res"] = nbytes(p + "w2") + h + 2 * x
        for role, n in per_layer.items():
            want[role] = want.get(role, 0) + n
    out = nbytes("tok_embeddings" if cfg.tied_embeddings else "output")
    want["classifier"] = out + nbytes("norm") + x + cfg.vocab_size * f32
    got = step_bytes(cfg, kv, pos, chunk)
    assert {r: got[r] for r in want} == want
    assert list(got) == ["embed", *per_layer, "classifier", "argmax", "advance"]  # forward's order
    assert got["argmax"] > cfg.vocab_size * f32 and got["advance"] > 0
