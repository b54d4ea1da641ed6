"""The simple tier (pycalm/kernels/simple/, EngineOptions(kernels="simple")) against the NumPy
references, under the CUDA simulator (and on the GPU with PYCALM_TEST_GPU=1).

Each kernel at small odd shapes, in every weight format and both KV formats; the engine on
the simple kernels against the CPU engine on tiny random models: the token step's logits close
(float32 summation order only, over the same cached values), the prompt pass's to its own
rounding in NumPy and to the CPU engine within what that rounding moves, greedy and sampled
tokens the same wherever a near tie cannot split them. The simulator runs each format once (1
layer, about 5 s a token step); the GPU runs every architecture and format. Last, every simple
kernel compiles for sm_90 without a GPU, with no float64 in its PTX (a worker process, the
simulator off).
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from device_weights import to_device
from numba import cuda
from test_prefill import check_kv, decoded, prefill_ref, rel_l2
from tiny_models import make_hf_llama

from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.reference import (
    embed_rows_ref,
    kv_round,
    matmul_ref,
    matvec_ref,
    prefill_attention_ref,
    qkv_rows_ref,
    rmsnorm_ref,
    rmsnorm_rows_ref,
    sample_ref,
    silu_ref,
)
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.gpu.engine import EngineOptions, GpuEngine
from pycalm.kernels.attention import KVCache
from pycalm.kernels.common import STATE_POS, STATE_SIZE, STATE_TOKEN
from pycalm.model import formats
from pycalm.model.loader import open_model

GPU = os.environ.get("PYCALM_TEST_GPU") == "1"
GPU_ONLY = pytest.mark.skipif(not GPU, reason="simulator time: GPU only")
DTYPES = ["fp16", "fp8", "gf4", "q8", "q4"]
STREAM = 0


def _stored(rng, rows: int, cols: int, dtype: str) -> tuple[object, np.ndarray]:
    """(the stored matrix, its float32 values)."""
    w = formats.encode(rng.standard_normal((rows, cols)).astype(np.float32), dtype)
    return w, formats.decode(w, dtype)


def _state(pos: int, token: int = 0) -> object:
    state = np.zeros(STATE_SIZE, np.int32)
    state[STATE_POS], state[STATE_TOKEN] = pos, token
    return cuda.to_device(state)


# ---------------------------------------------------------------------------------------------
# the kernels


# (rows, cols): rows odd (a partial last block), cols whole gf4 words and q4 groups of 32 or 64
MATVEC_SHAPES = [(37, 128)] + ([(4099, 4096), (1021, 14336)] if GPU else [])


@pytest.mark.parametrize("dtype", [*DTYPES, "q4/64"])
@pytest.mark.parametrize("rows,cols", MATVEC_SHAPES)
def test_matvec(dtype, rows, cols):
    from pycalm.kernels.simple.matvec import matvec

    base, _, group = dtype.partition("/")
    rng = np.random.default_rng(rows)
    w = formats.encode(rng.standard_normal((rows, cols)).astype(np.float32), base, group=int(group or 32))
    x = rng.standard_normal(cols).astype(np.float32)
    y = cuda.to_device(np.full(rows, np.nan, np.float32))
    matvec(to_device(w), cuda.to_device(x), y, base, stream=STREAM)
    wd = formats.decode(w, base)
    want = matvec_ref(wd, x, "fp32")  # the decoded weights times x as it is (the CPU engine's)
    scale = np.abs(wd) @ np.abs(x)  # a float32 sum in another order: a few roundings of this
    assert np.all(np.abs(y.copy_to_host() - want) <= 1e-5 * scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed(dtype):
    from pycalm.kernels.simple.embed import embed

    table, _ = _stored(np.random.default_rng(3), 11, 96, dtype)
    tokens = np.array([3, 0, 10], np.int32)
    x = cuda.to_device(np.full((3, 96), np.nan, np.float32))
    embed(to_device(table), cuda.to_device(tokens), x, dtype, stream=STREAM)
    np.testing.assert_array_equal(x.copy_to_host(), embed_rows_ref(table, tokens, dtype))  # exact


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_rmsnorm(out_dtype):
    from pycalm.kernels.simple.rmsnorm import rmsnorm

    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 45)).astype(np.float32)
    w = rng.standard_normal(45).astype(np.float32)
    out = cuda.to_device(np.zeros((3, 45), out_dtype))
    rmsnorm(cuda.to_device(x), cuda.to_device(w), 1e-5, out, stream=STREAM)
    got = out.copy_to_host().astype(np.float32)
    if out_dtype == np.float32:
        want = np.stack([rmsnorm_ref(row, w, 1e-5) for row in x])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:  # rounded to fp16 from a float32 that may differ in its last bits: one fp16 step at most
        want = rmsnorm_rows_ref(x, w, 1e-5).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2.0**-10, atol=2.0**-24)


MATMUL_CASES = [
    ("fp16", 19, 21, 37),
    ("fp8", 19, 21, 40),
    ("gf4", 19, 21, 40),
    ("q8", 19, 21, 40),
    ("q4", 19, 21, 64),
]
if GPU:
    MATMUL_CASES += [(d, 300, 1001, 2048) for d in DTYPES]


@pytest.mark.parametrize("dtype,n_rows,n,cols", MATMUL_CASES)
def test_matmul(dtype, n_rows, n, cols):
    """Rows of X and of W that fill no whole tile (the simulator's 19 x 21: a full and a partial
    16-row tile, two full and a partial 8-column one); K not a multiple of 16 where the format
    allows it."""
    from pycalm.kernels.simple.matmul import matmul

    rng = np.random.default_rng(cols)
    x = rng.standard_normal((n_rows, cols)).astype(np.float16)
    w, wd = _stored(rng, n, cols, dtype)
    y = cuda.to_device(np.full((n_rows, n), np.nan, np.float32))
    matmul(cuda.to_device(x), to_device(w), y, dtype, stream=STREAM)
    scale = np.abs(x.astype(np.float32)) @ np.abs(wd).T
    # the tensor cores' operands: fp16, fp8 and gf4 weights and q8's codes are exact in fp16 (q8's
    # row scale multiplies the sums); a q4 weight d q + m is rounded to it, the kernel's rounding
    wt = formats.fp16_encode(wd).astype(np.float32) if dtype == "q4" else wd
    assert np.all(np.abs(y.copy_to_host() - matmul_ref(x, wt, "fp32")) <= 1e-5 * scale)


@pytest.mark.parametrize("kv,rotary_dim,bias", [("fp16", 8, True), ("fp8", 6, False)])
def test_rope_kv(kv, rotary_dim, bias):
    """3 rows at positions 5, 6, 7: 4 query heads and 2 kv heads of 8; a partial rotary part."""
    from pycalm.kernels.simple.rope_kv import rope_kv

    rng = np.random.default_rng(5)
    n_heads, n_kv_heads, head_dim, pos0 = 4, 2, 8, 5
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    qkv = rng.standard_normal((3, q_dim + 2 * kv_dim)).astype(np.float32)
    bqkv = rng.standard_normal(q_dim + 2 * kv_dim).astype(np.float32) if bias else None
    freqs = (10000.0 ** (-np.arange(rotary_dim // 2) * 2 / rotary_dim)).astype(np.float32)
    store = np.float16 if kv == "fp16" else np.uint8
    cache = KVCache(
        cuda.to_device(np.zeros((10, kv_dim), store)), cuda.to_device(np.zeros((10, kv_dim), store)), kv
    )
    q = cuda.to_device(np.zeros((3, q_dim), np.float32))
    dev_bias = None if bqkv is None else cuda.to_device(bqkv)
    rope_kv(
        cuda.to_device(qkv), dev_bias, cuda.to_device(freqs), _state(pos0), q, cache, head_dim, stream=STREAM
    )
    want_q, want_k, want_v = qkv_rows_ref(qkv, bqkv, pos0, freqs, n_heads, n_kv_heads, head_dim)
    # sin and cos to ~1e-6 (pycalm.kernels.common.sincos) and fused multiply-adds
    np.testing.assert_allclose(q.copy_to_host(), want_q, rtol=0, atol=1e-5)
    step = 2.0**-10 if kv == "fp16" else 2.0**-2  # a neighbouring value of the cache's format
    for got, want in ((cache.k, want_k), (cache.v, want_v)):
        rows = (
            formats.decode(got.copy_to_host(), kv) if kv == "fp8" else got.copy_to_host().astype(np.float32)
        )
        assert not rows[:pos0].any() and not rows[pos0 + 3 :].any()  # only rows 5, 6, 7 written
        np.testing.assert_allclose(rows[pos0 : pos0 + 3], kv_round(want, kv), rtol=step, atol=1e-6)


@pytest.mark.parametrize("kv,window,out_dtype", [("fp16", 0, np.float32), ("fp8", 4, np.float16)])
def test_attention(kv, window, out_dtype):
    """3 query rows at positions 9, 10, 11 over a cache of 13; 4 query heads on 2 kv heads of 8."""
    from pycalm.kernels.simple.attention import attention

    rng = np.random.default_rng(6)
    n_heads, n_kv_heads, head_dim, pos0 = 4, 2, 8, 9
    cfg = SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, sliding_window=window)
    keys, values = (formats.encode(rng.standard_normal((13, n_kv_heads * head_dim)), kv) for _ in range(2))
    cache = KVCache(cuda.to_device(keys), cuda.to_device(values), kv)
    q = rng.standard_normal((3, n_heads * head_dim)).astype(np.float32)
    scores = cuda.to_device(np.zeros((3, n_heads, 13), np.float32))
    out = cuda.to_device(np.zeros((3, n_heads * head_dim), out_dtype))
    attention(cuda.to_device(q), cache, _state(pos0), scores, out, cfg, stream=STREAM)
    k, v = formats.decode(keys, kv), formats.decode(values, kv)
    want = prefill_attention_ref(q, k, v, pos0, n_heads, n_kv_heads, head_dim, window)
    tol = 2.0**-10 if out_dtype == np.float16 else 1e-5
    np.testing.assert_allclose(out.copy_to_host().astype(np.float32), want, rtol=tol, atol=tol)


def test_silu_gate_and_residual_add():
    from pycalm.kernels.simple.elementwise import residual_add, silu_gate

    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal((2, 45)).astype(np.float32) for _ in range(2))
    for out_dtype in (np.float32, np.float16):
        out = cuda.to_device(np.zeros((2, 45), out_dtype))
        silu_gate(cuda.to_device(a), cuda.to_device(b), out, stream=STREAM)
        np.testing.assert_allclose(out.copy_to_host().astype(np.float32), silu_ref(a) * b,
                                   rtol=1e-6 if out_dtype == np.float32 else 2.0**-10, atol=1e-7)  # fmt: skip
    x = cuda.to_device(a)
    residual_add(x, cuda.to_device(b), stream=STREAM)
    np.testing.assert_array_equal(x.copy_to_host(), a + b)


def test_argmax():
    """The lowest id among equal maxima, as sample_ref (np.argmax), across threads."""
    from pycalm.kernels.simple.argmax import argmax

    logits = np.random.default_rng(8).standard_normal(100).astype(np.float32)
    for ties in ([70, 33, 97], [5]):
        x = logits.copy()
        x[ties] = 9.0
        state = _state(0, token=-1)
        argmax(cuda.to_device(x), state, stream=STREAM)
        assert state.copy_to_host()[STATE_TOKEN] == sample_ref(x, 0.0) == min(ties)


# ---------------------------------------------------------------------------------------------
# the engine on the simple kernels


def tiny_model(tmp_path, arch: str, dtype: str, n_layers: int = 1):
    """A model the simulator runs a token step of in a few seconds (its time goes by the threads
    of the matvecs: 32 a row); q4 needs rows of whole groups of 32 columns. 4 query heads share
    one kv head of 8."""
    tiny = make_hf_llama(tmp_path, arch=arch, dim=32, hidden_dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=1,
                         vocab_size=32)  # fmt: skip
    return open_model(convert(tiny.path, tmp_path / f"{arch}-{dtype}.pycalm", dtype, progress=False))


SIMPLE = EngineOptions(kernels="simple")
GREEDY = SamplingParams(temperature=0.0)
LAYERS = 2 if GPU else 1
# the simulator runs each format once, the architectures and KV formats alternating; the GPU runs all
SIM_CASES = [("llama", "fp16", "fp16"), ("qwen2", "fp8", "fp8"), ("llama", "gf4", "fp16"), ("qwen2", "q8", "fp16"),
             ("llama", "q4", "fp8")]  # fmt: skip
ALL_CASES = [(arch, dtype, kv) for arch in ("llama", "qwen2") for dtype in DTYPES for kv in ("fp16", "fp8")]


def cases(sim: list[tuple]) -> list:
    """The simulator's cases, and the rest of ALL_CASES on the GPU only."""
    return sim + [pytest.param(*c, marks=GPU_ONLY) for c in ALL_CASES if c not in sim]


class GpuRows(np.ndarray):
    """A reference engine's KV cache (n_layers, seq_len, kv_dim) that reads as the GPU's rows;
    the engine's own writes are kept aside, in .written[layer, pos]."""

    def __setitem__(self, key, value) -> None:
        self.written[key] = np.asarray(value, np.float32)


def over(cpu: CpuEngine, gpu: GpuEngine) -> CpuEngine:
    """cpu attending over gpu's KV cache as it stands (GpuRows): the same cached values, so its
    logits differ from the GPU step's by float32 summation order only. With its own cache, a k or
    v whose float32 lies within a few ulps of a rounding midpoint of the cache's format may be
    stored as the other neighbour on the GPU: one fp16 step of one key (layer 0, position 1,
    2.9e-7 from the midpoint) moved qwen2-q8-fp16's logits by 1.6e-3 (2.4e-4 of the largest) on
    the H200, and that flip in NumPy moves them by the same vector (and the next layer's keys
    and values by up to 2e-3, two fp16 steps)."""
    for name, side in (("key_cache", "k"), ("value_cache", "v")):
        rows = np.stack([decoded(getattr(c, side), gpu.kv_dtype) for c in gpu.kv_caches]).view(GpuRows)
        rows.written = {}
        setattr(cpu.ref, name, rows)
    return cpu


def check_rows(got: np.ndarray, want: np.ndarray, kv: str) -> None:
    """KV cache rows against reference rows rounded the same way from float32 a few ulps apart:
    each element the same value or a neighbour in the cache's format (a float32 near a rounding
    midpoint), and at most 1 in 8 not the same (a rounding that is off is off by a step often)."""
    step, tiny = (2.0**-10, 2.0**-24) if kv == "fp16" else (2.0**-2, 2.0**-16)  # a neighbour, relative
    np.testing.assert_allclose(got, want, rtol=step, atol=tiny)
    assert np.mean(got != want) <= 1 / 8


def gpu_rows(gpu: GpuEngine, rows: slice | int) -> np.ndarray:
    """The GPU's KV cache rows, (2 n_layers, ...) float32: each layer's keys, then its values."""
    return np.stack([decoded(getattr(c, side), gpu.kv_dtype)[rows] for side in "kv" for c in gpu.kv_caches])


def check_greedy(model, kv: str, gpu: GpuEngine, fed: int, pos: int, got: list[int], n: int) -> None:
    """got: the n greedy tokens gpu.generate gave after `fed` at `pos` (fewer after an end of
    sequence). Each is the argmax of the CPU engine's logits over the GPU's cache (`over`) up to
    twice 2e-4 of their largest (the step's bound, test_engine_token_step: within it the two
    engines may order a near tie either way); where the CPU's top two are further apart, the
    argmax itself. At least 3 in 4 steps must be such clear ones, or the check says little."""
    assert len(got) == n or (got and got[-1] in model.config.eos_ids)
    cpu, clear = over(CpuEngine(model, seq_len=gpu.seq_len, kv_dtype=kv), gpu), 0
    for i, (token, want) in enumerate(zip([fed, *got[:-1]], got, strict=True)):
        logits = cpu.logits(token, pos + i)
        tol = 4e-4 * np.abs(logits).max()
        assert logits[want] >= logits.max() - tol
        clear += int(np.sort(logits)[-2] < logits.max() - tol)
    assert clear >= len(got) - len(got) // 4


@pytest.mark.parametrize("arch,dtype,kv", cases(SIM_CASES))
def test_engine_token_step(tmp_path, arch, dtype, kv):
    """The token step's logits at positions 0 and 1 against the CPU engine over the GPU's cache
    (`over`: float32 summation order only, 2e-4 of the largest), and the cache row each step
    wrote against the CPU's from the same cache (check_rows); then greedy tokens from position
    2 through generate's decode loop (the argmax kernel's), check_greedy."""
    model = tiny_model(tmp_path, arch, dtype, LAYERS)
    gpu = GpuEngine(model, seq_len=8, kv_dtype=kv, options=SIMPLE)
    for pos, tok in enumerate([5, 9]):
        got = gpu.logits(tok, pos)
        cpu = over(CpuEngine(model, seq_len=8, kv_dtype=kv), gpu)
        want = cpu.logits(tok, pos)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
        written = [getattr(cpu.ref, name).written[layer, pos] for name in ("key_cache", "value_cache")
                   for layer in range(model.config.n_layers)]  # fmt: skip
        check_rows(gpu_rows(gpu, pos), np.stack(written), kv)
    n = 4 if GPU else 1
    check_greedy(model, kv, gpu, 12, 2, list(gpu.generate([12], 2, n, GREEDY)), n)


def tensor_core_weights(cpu: CpuEngine) -> CpuEngine:
    """cpu (a CpuEngine) multiplying by the weights the tensor cores take (pycalm.kernels.simple.
    matmul): q4 matrices rounded to fp16; the other formats' weights, and q8's codes, are exact."""
    ref, cfg = cpu.ref, cpu.config
    names = [f"layers.{i}.{m}" for i in range(cfg.n_layers) for m in ("wqkv", "wo", "w1", "w3", "w2")]
    for name in (n for n in names if cfg.dtype_of(n) == "q4"):
        ref._decoded[name] = formats.fp16_encode(ref._w(name)).astype(np.float32)
    if cfg.dtype_of("tok_embeddings" if cfg.tied_embeddings else "output") == "q4":
        ref.output = formats.fp16_encode(ref.output).astype(np.float32)
    return cpu


@pytest.mark.parametrize("arch,dtype,kv", cases([("qwen2", "gf4", "fp8")]))
def test_engine_prompt_pass(tmp_path, arch, dtype, kv):
    """A 4-token prompt through the prompt pass (the mma-tile matmuls) in chunks of 3 rows, one
    layer (as tests/test_prefill.py), then generate (the prompt but its last token through the
    prompt pass), check_greedy.

    1. Against its own rounding in NumPy (test_prefill.prefill_ref: fp16 activations into the
    matmuls, q4 weights rounded to fp16, q8 codes exact, as the simple and the fast matmul both
    do): relative L2 2e-3, and its cache rows (check_rows: one layer, so each row comes from its
    own token's activations alone). fp8 KV: attending over the pass's cache, whose e5m2 rounding
    turns a few-ulp difference into a 12-25% step now and then.

    2. Against the CPU engine (float32 throughout; fp8 KV: over the pass's cache, as 1.): the
    logits move by what the pass rounds. The fp16 activations (xb, att, h and the classifier's
    xb, 2**-11 relative each) move them by at most 1.6e-3 in this model (NumPy: every format and
    KV format, three prompts), 2e-3 allowed, as for the fast prefill. q4's weights rounded to
    fp16 move them too, by d = rel_l2(the CPU engine on those weights, the CPU engine), 1.1e-3 to
    1.6e-3 here: the bound is 2e-3 + d (the triangle inequality; d = 0 for the other formats).
    Two layers double the activations' share (up to 3.5e-3 in NumPy for other prompts), hence
    one."""
    model = tiny_model(tmp_path, arch, dtype)
    prompt = [7, 3, 24, 9]
    gpu = GpuEngine(model, seq_len=10, kv_dtype=kv, options=EngineOptions(kernels="simple", prefill_chunk=3))
    got = np.concatenate(list(gpu.prefill_logits(prompt, 0)))
    want, keys, values = prefill_ref(model, kv, prompt, over=gpu if kv == "fp8" else None)
    assert rel_l2(got, want) < 2e-3
    check_rows(gpu_rows(gpu, slice(0, len(prompt))), np.concatenate([keys, values]), kv)

    def cpu_logits(cpu: CpuEngine) -> np.ndarray:
        cpu = over(cpu, gpu) if kv == "fp8" else cpu
        return np.stack([cpu.logits(t, pos) for pos, t in enumerate(prompt)])

    cpu = cpu_logits(CpuEngine(model, seq_len=10, kv_dtype=kv))
    d = rel_l2(cpu_logits(tensor_core_weights(CpuEngine(model, seq_len=10, kv_dtype=kv))), cpu)
    assert d == 0 or dtype == "q4"
    assert rel_l2(got, cpu) < 2e-3 + d
    n = 4 if GPU else 1
    check_greedy(model, kv, gpu, prompt[-1], len(prompt) - 1, list(gpu.generate(prompt, 0, n, GREEDY)), n)


def test_engine_sampled(tmp_path):
    """At a temperature the token is drawn on the host from the step's logits with the CPU
    sampler's coins (pycalm.gpu.simple.generate_sampled): the CPU engine's tokens, and the state
    left at the last one."""
    model = tiny_model(tmp_path, "llama", "fp8")
    hot = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=11)
    want = list(CpuEngine(model, seq_len=8).generate([5], 0, 2, hot))
    gpu = GpuEngine(model, seq_len=8, kv_dtype="fp16", options=SIMPLE)
    assert list(gpu.generate([5], 0, 2, hot)) == want
    assert gpu.state.copy_to_host()[[STATE_TOKEN, STATE_POS]].tolist() == [want[-1], 2]


@GPU_ONLY
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_realistic_shape(tmp_path, dtype):
    """Many blocks a kernel, GQA 8:1, head_dim 128, a 150-token prompt through the prompt pass
    in chunks of 64 rows: its cache rows against its own rounding in NumPy (test_prefill.prefill_ref
    and check_kv, which allows for rows that RoPE's cancellation leaves small), and its logits
    against prefill_ref attending over those rows (relative L2 2e-3), so that a cache value that
    rounds to the other fp16 neighbour (check_kv's business) is not counted again through the
    later layers (q4 on the H200: 2.04e-3 with prefill_ref's own cache); then 8 greedy tokens,
    check_greedy."""
    tiny = make_hf_llama(tmp_path, arch="llama", dim=1024, hidden_dim=2816, n_layers=2, n_heads=8, n_kv_heads=1,
                         vocab_size=4096)  # fmt: skip
    model = open_model(convert(tiny.path, tmp_path / f"big-{dtype}.pycalm", dtype, progress=False))
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 4096, 150)]
    gpu = GpuEngine(model, seq_len=160, options=EngineOptions(kernels="simple", prefill_chunk=64))
    got = np.concatenate(list(gpu.prefill_logits(prompt, 0)))
    want, keys, values = prefill_ref(model, "fp16", prompt, over=gpu)
    assert rel_l2(got, want) < 2e-3
    for got_rows, want_rows in zip(gpu_rows(gpu, slice(0, 150)), np.concatenate([keys, values]), strict=True):
        check_kv(got_rows, want_rows, "fp16")
    check_greedy(model, "fp16", gpu, prompt[-1], 149, list(gpu.generate(prompt, 0, 8, GREEDY)), 8)


def test_engine_refuses_what_it_does_not_take(tmp_path):
    model = tiny_model(tmp_path, "mixtral", "fp16")
    with pytest.raises(PycalmError, match=r"^the simple kernels do not take a mixture of experts"):
        GpuEngine(model, seq_len=8, options=SIMPLE)
    llama = tiny_model(tmp_path, "llama", "fp16")
    with pytest.raises(PycalmError, match=r"^the simple kernels do not take batch-invariant decoding"):
        GpuEngine(llama, seq_len=8, options=EngineOptions(kernels="simple", batch_invariant=True))
    with pytest.raises(PycalmError, match=r"^kernels must be fast or simple, not 'plain'$"):
        GpuEngine(llama, seq_len=8, options=EngineOptions(kernels="plain"))


# ---------------------------------------------------------------------------------------------
# real compilation for sm_90, no GPU needed

_COMPILE = r"""
import json
import numpy as np
from numba import cuda, typeof
from pycalm.kernels.simple import argmax, attention, elementwise, embed, matmul, matvec, rmsnorm, rope_kv
from pycalm.model import formats

f32, f16 = np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float16)
v32, i32 = np.zeros(2, np.float32), np.zeros(2, np.int32)
stored = {d: formats.encode(np.ones((2, 64), np.float32), d) for d in ("fp16", "fp8", "gf4", "q8", "q4")}
kv = {"fp16": f16, "fp8": np.zeros((2, 2), np.uint8)}
work = [(rmsnorm.rmsnorm_kernel, (f32, v32, np.float32(1), out)) for out in (f32, f16)]
work += [(elementwise.silu_gate_kernel, (f32, f32, out)) for out in (f32, f16)]
work += [(elementwise.residual_add_kernel, (f32, f32)), (argmax.argmax_kernel, (v32, i32))]
for d, w in stored.items():
    w, s = (w.codes, w.scales) if d in ("q8", "q4") else (w, w)
    work += [(matvec.matvec_kernel(d), (w, s, v32, v32)), (embed.embed_kernel(d), (w, s, i32, f32)),
             (matmul.matmul_kernel(d), (f16, w, s, f32))]
for d, c in kv.items():
    work += [(rope_kv.rope_kv_kernel(d), (f32, v32, True, v32, i32, f32, c, c, 8))]
    work += [(attention.attention_kernel(d), (f32, c, c, i32, np.zeros((1, 1, 1), np.float32), out, 8, 2, 0))
             for out in (f32, f16)]
problems = []
for kernel, args in work:
    label = f"{kernel.py_func.__name__}{tuple(str(typeof(a)) for a in args)}"
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, tuple(typeof(a) for a in args), cc=(9, 0))
    except Exception as e:
        problems.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        continue
    if ".f64" in ptx:
        problems.append(f"{label}: float64 in PTX")
print("RESULT" + json.dumps({"n": len(work), "problems": problems}))
"""


def test_simple_kernels_compile_for_sm90():
    """Every simple kernel, in every format and with every output type the engine launches it
    with, through numba's real compiler for sm_90 (argument types from example arrays)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=1200
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert p.returncode == 0 and lines, f"compile worker crashed:\n{p.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT") :])
    assert not result["problems"], "\n".join(result["problems"])
    assert result["n"] == 27  # 6 format-free, 3 for each of 5 formats, 3 for each KV format


def test_kernel_cache_key_covers_the_simple_tier(tmp_path):
    """A change in pycalm/kernels/simple/ gives the compiled kernels a new cache folder
    (pycalm.gpu.kernel_cache.kernels_key hashes the subfolders too)."""
    import shutil

    from pycalm.gpu import kernel_cache

    kernels = tmp_path / "kernels"
    shutil.copytree(kernel_cache.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    key = kernel_cache.kernels_key(kernels)
    decode = kernels / "simple" / "decode.py"
    decode.write_text(decode.read_text() + "\n# changed\n")
    assert kernel_cache.kernels_key(kernels) != key


def test_the_flag_reaches_the_engine(tmp_path, monkeypatch):
    """--kernels in the CLI and the server, pycalm.load(kernels=) and make_engine: the GPU
    engine runs the simple kernels (here the simulator stands in for the GPU)."""
    from pycalm.app import generate, serve
    from pycalm.app.api import load
    from pycalm.app.models import make_engine
    from pycalm.gpu import engine

    assert generate.parse_args(["--kernels", "simple", "-i", "hi"]).kernels == "simple"
    assert serve.parse_args(["--kernels", "simple"]).kernels == "simple"
    assert generate.parse_args(["-i", "hi"]).kernels == serve.parse_args([]).kernels == "fast"
    with pytest.raises(PycalmError, match=r"^kernels must be fast or simple, not 'plain'$"):
        load(tmp_path / "none", kernels="plain")
    monkeypatch.setattr(engine, "gpu_unavailable_reason", lambda: None)
    model = tiny_model(tmp_path, "llama", "fp16")
    assert make_engine(model, "gpu", 8, "fp16", print, kernels="simple").simple
    assert not make_engine(model, "gpu", 8, "fp16", print).simple
