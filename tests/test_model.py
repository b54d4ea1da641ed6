"""The whole GPU engine (pycalm.gpu.engine) against the reference engine, on tiny random models.

Under the CUDA simulator in CI (the step runs as eager launches), on the GPU with
PYCALM_TEST_GPU=1 (the step is a captured CUDA graph). Greedy tokens must be identical and the
logits close: both engines read the same stored weights and round the KV cache the same way,
so the difference is float32 summation order only.
"""

import numpy as np
import pytest
from gpu import gpu_only
from tiny_models import make_hf_llama

from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.sampler import SamplingParams
from pycalm.gpu.engine import EngineOptions, GpuEngine, step_bytes
from pycalm.model.loader import open_model

PROMPT = [5, 9]
GPU_ONLY = gpu_only("simulator time")


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


@gpu_only("realistic shapes")
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
    got = list(gpu.generate(prompt, 0, 8, greedy))  # the prompt through the multi-token forward
    assert got == want
    # the step's graph really has programmatic edges (one between each two kernels) or none
    edges = gpu.graph(greedy).programmatic_edges
    assert edges > 10 if programmatic else edges == 0
    # the token step alone: prompt and continuation fed one token step at a time on both engines
    # (generate's prefill rounds activations to fp16 for the tensor cores: test_prefill.py holds
    # it to its own bound), the last sampled token's logits compared
    tokens = prompt + want
    for pos, tok in enumerate(tokens[:-1]):
        cpu.logits(tok, pos)
        gpu.logits(tok, pos)
    w, g = cpu.logits(tokens[-1], len(tokens) - 1), gpu.logits(tokens[-1], len(tokens) - 1)
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


# ---------------------------------------------------------------------------------------------
# GPU memory: what does not fit is one line (pycalm.gpu.memory)


def _free_memory(monkeypatch, *free: int) -> None:
    """The free-memory query answers free[0], free[1], ... (then the last) of a 1 GiB GPU: the
    simulator's own answer is infinite."""
    import pycalm.gpu.memory

    answers = iter(free)
    last = [free[-1]]

    def info() -> tuple[int, int]:
        last[0] = next(answers, last[0])
        return last[0], 1 << 30

    monkeypatch.setattr(pycalm.gpu.memory, "gpu_memory_info", info)


def test_out_of_memory_is_one_line(tmp_path, monkeypatch):
    from pycalm.errors import PycalmError

    model = tiny_model(tmp_path, "llama", "fp16")
    cfg = model.config
    weights = sum(model.tensor(n).nbytes for n in model.names() if n != "tokenizer")
    # the weights do not fit: named with the bytes they need and the bytes free
    _free_memory(monkeypatch, weights - 1)
    with pytest.raises(PycalmError) as e:
        GpuEngine(model, seq_len=12, kv_dtype="fp16")
    assert str(e.value) == (
        f"out of GPU memory: the weights of llama-fp16.pycalm needs 0 MiB ({weights:,} bytes), "
        f"0 MiB of the GPU's 1,024 MiB are free"
    )
    # the weights fit, the KV cache of 12 positions (2 layers of 12 x kv_dim fp16 keys and
    # values, and the feed and draw of each position) does not
    kv = 2 * cfg.n_layers * 12 * cfg.kv_dim * 2 + 8 * 12
    _free_memory(monkeypatch, weights, kv - 1)
    with pytest.raises(PycalmError, match=rf"^out of GPU memory: a KV cache of 12 positions \(fp16, 2 layers\) "
                       rf"needs 0 MiB \({kv:,} bytes\), 0 MiB of the GPU's 1,024 MiB are free$"):  # fmt: skip
        GpuEngine(model, seq_len=12, kv_dtype="fp16")
    # an out-of-memory error of the driver while allocating is the same kind of line
    from numba.cuda.cudadrv.driver import CudaAPIError

    def no_memory(*args: object) -> None:
        raise CudaAPIError(2, "CUDA_ERROR_OUT_OF_MEMORY")

    _free_memory(monkeypatch, 1 << 20)
    monkeypatch.setattr(GpuEngine, "_allocate", no_memory)
    with pytest.raises(PycalmError, match=r"^out of GPU memory: allocating a KV cache of 12 positions .* failed, "
                       r"1 MiB of the GPU's 1,024 MiB free$"):  # fmt: skip
        GpuEngine(model, seq_len=12, kv_dtype="fp16")


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_prefill_buffers_checked_before_allocating(tmp_path, monkeypatch, arch):
    """RowBuffers.nbytes is what allocate() takes (the sum of its arrays), and a prefill chunk
    whose buffers do not fit is one line naming them."""
    from pycalm.errors import PycalmError
    from pycalm.gpu.prefill import Prefill, RowBuffers

    cfg = tiny_model(tmp_path, arch, "fp16").config
    buffers = RowBuffers.allocate(cfg, 6, 4, stream=0)
    arrays = [v for v in vars(buffers).values() if hasattr(v, "nbytes")]
    arrays += [
        a for v in vars(buffers).values() if hasattr(v, "__dataclass_fields__") for a in vars(v).values()
    ]
    assert RowBuffers.nbytes(cfg, 6, 4) == sum(a.nbytes for a in arrays)
    if arch == "llama":  # heads of 16, which the multi-token forward takes (Mixtral: token steps)
        tiny = make_hf_llama(tmp_path, dim=64, hidden_dim=64, n_layers=1, n_heads=4, n_kv_heads=2)
        model = open_model(convert(tiny.path, tmp_path / "h16.pycalm", "fp16", progress=False))
        cfg = model.config
        engine = GpuEngine(model, seq_len=12, kv_dtype="fp16")
        need = RowBuffers.nbytes(cfg, 64, min(64, (64 << 20) // (4 * cfg.vocab_size)))
        _free_memory(monkeypatch, need - 1)
        with pytest.raises(
            PycalmError, match=rf"the prefill buffers of 64 rows .* needs 0 MiB \({need:,} bytes\)"
        ):
            Prefill(engine, 64)


@gpu_only("a real GPU's memory")
def test_context_larger_than_the_gpu(tmp_path):
    """A context of 10**7 positions on a tiny model whose KV rows are wide (6 layers of 8 heads
    of 256: 245 GB of fp8 keys and values) is refused before allocating, in one line."""
    import json

    from pycalm.errors import PycalmError

    tiny = make_hf_llama(tmp_path, dim=32, hidden_dim=32, n_layers=6, n_heads=8, n_kv_heads=8, head_dim=256)
    hf = json.loads((tiny.path / "config.json").read_text())
    (tiny.path / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 10**7}))
    model = open_model(convert(tiny.path, tmp_path / "wide.pycalm", "fp16", progress=False))
    with pytest.raises(PycalmError) as e:
        GpuEngine(model, seq_len=10**7)
    assert str(e.value).startswith(
        "out of GPU memory: a KV cache of 10,000,000 positions (fp8, 6 layers) needs"
    )
    # the keys and values, and each position's feed and draw (8 bytes), as test_out_of_memory_is_one_line
    assert f"({2 * 6 * 10**7 * 2048 + 8 * 10**7:,} bytes)" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# check_finite: the first position whose logits hold a NaN or an infinity


def test_check_finite_kernel():
    from numba import cuda

    from pycalm.kernels.common import STATE_POS, STATE_SIZE
    from pycalm.kernels.finite import FLAG_SIZE, check_finite, check_finite_ref

    logits = np.linspace(-3, 3, 300).astype(np.float32)  # 300: more than one block of threads
    state = np.zeros(STATE_SIZE, np.int32)
    flag = cuda.to_device(np.zeros(FLAG_SIZE, np.int32))
    want = np.zeros(FLAG_SIZE, np.int32)
    for pos, bad in [(3, None), (5, np.nan), (9, np.inf)]:  # finite, then a NaN, then an infinity
        state[STATE_POS] = pos
        x = logits.copy()
        if bad is not None:
            x[277] = bad
        check_finite(cuda.to_device(x), cuda.to_device(state), flag, stream=0)
        check_finite_ref(x, pos, want)
        np.testing.assert_array_equal(flag.copy_to_host(), want)
    assert want.tolist() == [1, 5, 277]  # the first failing step (position 5) stays recorded


def test_check_finite_engine(tmp_path):
    """A NaN in one token's embedding row: the token step that feeds it is reported, position
    and logit, in one line; without check_finite the same step returns the NaN logits."""
    from pycalm.errors import PycalmError

    tiny = make_hf_llama(tmp_path, dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64)
    model = open_model(convert(tiny.path, tmp_path / "one.pycalm", "fp16", progress=False))
    engine = GpuEngine(model, seq_len=8, kv_dtype="fp16", options=EngineOptions(check_finite=True))
    engine.tok_embeddings[7] = np.full(model.config.dim, np.nan, np.float16)
    with pytest.raises(PycalmError, match=r"^non-finite logits \(NaN or infinity\) at position 3, step 1 of this "
                       r"call \(logit \d+\): the first failing token step$"):  # fmt: skip
        engine.logits(7, 3)
    assert GpuEngine(model, seq_len=8, kv_dtype="fp16").finite_flag is None  # off by default


@GPU_ONLY
def test_check_finite_generate(tmp_path):
    """Greedy generation with a NaN in the embedding row of a token it samples (the first that
    is new, at index j): the step that feeds it, at position len(prompt) + j, step j + 2 of the
    call (step 1 samples token 0), is the first reported."""
    from pycalm.errors import PycalmError

    model = tiny_model(tmp_path, "llama", "fp16")
    greedy = SamplingParams(temperature=0.0)
    clean = list(GpuEngine(model, seq_len=64).generate(PROMPT, 0, 20, greedy))
    # a token fed after it is sampled (not the last, not an EOS) and new to the sequence there
    eos = model.config.eos_ids
    j = max(j for j, t in enumerate(clean[:-1]) if t not in PROMPT and t not in clean[:j] and t not in eos)
    engine = GpuEngine(model, seq_len=64, options=EngineOptions(check_finite=True))
    engine.tok_embeddings[clean[j]] = np.full(model.config.dim, np.nan, np.float16)
    with pytest.raises(PycalmError, match=rf"at position {len(PROMPT) + j}, step {j + 2} of this call"):
        list(engine.generate(PROMPT, 0, 20, greedy))


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["fp8", pytest.param("fp16", marks=GPU_ONLY)])
def test_step_past_8k_positions_matches_reference(tmp_path, kv):
    """The token step at position 8,300, past Llama 3.1's original 8,192 positions: the split
    attention over 8,301 positions (splits of many warp tiles, the last block's merge) and rope
    at angles past 8k with llama3 scaling, against the reference on the same cache (the
    reference's prefill of the 8,300 tokens before it, copied into the GPU engine's cache). fp8 KV
    (the default past 4,096 positions) under the simulator, about 50 s; both on the GPU."""
    import json

    from pycalm.model import formats

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    tiny = make_hf_llama(tmp_path, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, rope_theta=500000.0,
                         rope_scaling=scaling)  # fmt: skip
    config_path = tiny.path / "config.json"
    hf = json.loads(config_path.read_text())
    hf["max_position_embeddings"] = 16384
    config_path.write_text(json.dumps(hf))
    model = open_model(convert(tiny.path, tmp_path / "long.pycalm", "fp16", progress=False))
    seq_len, pos = 8320, 8300
    ids = [int(t) for t in np.random.default_rng(0).integers(4, 64, pos + 1)]
    cpu = CpuEngine(model, seq_len=seq_len, kv_dtype=kv)
    cpu.prefill(ids[:pos], 0)
    gpu = GpuEngine(model, seq_len=seq_len, kv_dtype=kv)
    for layer, cache in enumerate(gpu.kv_caches):  # the reference's cache rows, exact in the KV dtype
        cache.k.copy_to_device(formats.encode(np.ascontiguousarray(cpu.ref.key_cache[layer]), kv))
        cache.v.copy_to_device(formats.encode(np.ascontiguousarray(cpu.ref.value_cache[layer]), kv))
    want = cpu.logits(ids[pos], pos)
    got = gpu.logits(ids[pos], pos)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
