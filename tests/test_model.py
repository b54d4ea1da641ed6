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
from pycalm.gpu import GpuEngine
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
    gpu = GpuEngine(model, seq_len=12, kv_dtype=kv, attention_chunk=2)
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
    gpu = GpuEngine(model, seq_len=160, programmatic=programmatic)
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
