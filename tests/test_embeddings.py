"""Embeddings (LLM.embed, POST /v1/embeddings, CpuEngine.embed / GpuEngine.embed) on tiny random
models: the hidden states after the final RMSNorm, pooled by mean or last token, L2-normalised.

The CPU engine's vectors are checked against NumPy written out here from the reference's
forward (and the hidden rows against the token step's logits); the GPU engine's (the simulator
here) against the CPU engine's within test_prefill.py's 2e-3 relative L2 (the multi-token
forward rounds activations to fp16); a text's vector is the same bits whatever was embedded or
generated before it and whatever texts share its request. The server runs as a real process
on the CPU engine, driven by the openai client.
"""

from __future__ import annotations

import base64
import re

import httpx
import numpy as np
import openai
import pytest
from gpu import GPU
from test_prefill import prefill_ref
from test_serve import cpu_server
from tiny_models import make_hf_llama

import pycalm
from pycalm.app.serve import parse_args
from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.reference import ReferenceEngine, embed_pool_ref
from pycalm.errors import PycalmError
from pycalm.gpu.engine import EngineOptions, GpuEngine
from pycalm.model.loader import open_model

SEQ_LEN = 64
# the GPU engine's model: tiny under the simulator (a launch a Python thread a GPU thread), a
# realistic width and a prompt of several chunks on the GPU
GPU_SHAPE = (
    dict(dim=256, hidden_dim=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32)
    if GPU
    else dict(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
)
GPU_TOKENS, GPU_CHUNK, GPU_SEQ = (300, 128, 512) if GPU else (11, 8, 16)
TEXTS = ["w1 w2 w3 w4 w5", "w7", "w9 w8 w7 w6 w5 w4 w3 w2 w1 w0 w10 w11", "w1 w2 w3 w4 w5"]


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def ids_of(n: int, seed: int = 0) -> list[int]:
    """The BOS, then n - 1 random ids (no BOS / EOS among them)."""
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, 64, n - 1)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed")
    hf = make_hf_llama(tmp, dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
    return convert(hf.path, tmp / "tiny.pycalm", "fp16", progress=False)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed_gpu")
    hf = make_hf_llama(tmp, **GPU_SHAPE)
    return open_model(convert(hf.path, tmp / "gpu.pycalm", "fp16", progress=False))


@pytest.fixture(scope="module")
def llm(model_path):
    return pycalm.load(model_path, device="cpu", context=SEQ_LEN, verbose=False)


# ---------------------------------------------------------------------------------------------
# the CPU engine against NumPy


@pytest.mark.parametrize("chunk", [512, 4])
def test_cpu_embedding_matches_numpy(model_path, chunk):
    """Mean and last pooling of rmsnorm(x) * norm, x the reference's residual stream after the
    last layer, written out in NumPy; the hidden rows times the classifier are the token
    step's logits (so they are the final norm's output, not some other state)."""
    model = open_model(model_path)
    cfg = model.config
    ids = ids_of(13)
    ref = ReferenceEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    x = ref.forward_rows(np.asarray(ids), 0).astype(np.float64)  # (T, dim)
    norm = model.tensor("norm").astype(np.float64)
    hidden = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + cfg.norm_eps) * norm  # (T, dim)
    step = ReferenceEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    logits = np.stack([step.forward(t, pos) for pos, t in enumerate(ids)])
    assert rel_l2(hidden @ ref.output.T, logits) < 1e-5
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16", prefill_chunk=chunk)
    for pooling, pooled in (("mean", hidden.mean(axis=0)), ("last", hidden[-1])):
        got = cpu.embed(ids, pooling)
        assert got.dtype == np.float32 and got.shape == (cfg.dim,)
        np.testing.assert_allclose(got, pooled / np.linalg.norm(pooled), rtol=2e-5, atol=2e-6)
        raw = cpu.embed(ids, pooling, normalize=False)
        np.testing.assert_allclose(raw, pooled, rtol=2e-5, atol=2e-5 * np.abs(pooled).max())


def test_pool_ref():
    hidden = np.array([[1.0, 0.0], [3.0, 4.0]], np.float32)
    np.testing.assert_allclose(embed_pool_ref(hidden, "mean"), [2**-0.5, 2**-0.5], rtol=1e-6)
    np.testing.assert_allclose(embed_pool_ref(hidden, "last"), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(embed_pool_ref(hidden, "last", normalize=False), [3.0, 4.0])
    assert not embed_pool_ref(np.zeros((2, 3), np.float32)).any()  # a zero vector stays zero
    with pytest.raises(PycalmError, match="pooling must be mean or last"):
        embed_pool_ref(hidden, "max")


# ---------------------------------------------------------------------------------------------
# the GPU engine against the CPU engine


def emulated(model, ids: list[int]) -> np.ndarray:
    """The final RMSNorm's rows (T, dim) of the multi-token forward with the GPU's fp16
    activations, in NumPy (test_prefill.prefill_ref)."""
    hidden: list[np.ndarray] = []
    prefill_ref(model, "fp16", ids, hidden=hidden)
    return hidden[0]


def test_gpu_embedding_matches_reference(gpu_model):
    """The hidden rows of a prompt of two chunks or more (the multi-token forward's residual rows,
    normed) against the NumPy multi-token forward's over all rows, test_prefill.py's criterion for
    the logits (these rows times the classifier); the last token's embedding is those rows
    pooled, to the bit. A short text's mean embedding: within 2e-3 of the NumPy one, and the
    same bits before and after the long text (its cache rows past the short one are not read).
    Under the simulator, also within 2e-3 of the CPU engine's (float32 activations; on the
    realistic shape the fp16 rounding alone moves a random model's rows by about 1%,
    test_prefill_realistic_shape)."""
    ids, short = ids_of(GPU_TOKENS), ids_of(5, seed=1)
    gpu = GpuEngine(
        gpu_model, seq_len=GPU_SEQ, kv_dtype="fp16", options=EngineOptions(prefill_chunk=GPU_CHUNK)
    )
    assert gpu.multi_token and GPU_TOKENS > GPU_CHUNK
    first = gpu.embed(short)
    assert first.dtype == np.float32 and abs(np.linalg.norm(first) - 1) < 1e-5
    assert rel_l2(first, embed_pool_ref(emulated(gpu_model, short))) < 2e-3
    if not GPU:
        assert rel_l2(first, CpuEngine(gpu_model, seq_len=GPU_SEQ).embed(short)) < 2e-3
    residual = np.concatenate(list(gpu._prefill_step().run(ids, 0, logits="residual")))  # (T, dim)
    hidden = ReferenceEngine(gpu_model, seq_len=GPU_SEQ).hidden_rows(residual)
    assert rel_l2(hidden, emulated(gpu_model, ids)) < 2e-3
    np.testing.assert_array_equal(gpu.embed(ids, "last"), embed_pool_ref(hidden, "last"))
    np.testing.assert_array_equal(gpu.embed(short), first)


def test_gpu_token_step_and_simple_kernels(tmp_path, gpu_model):
    """Where the multi-token forward does not take the model (head_dim 8), the token step feeds
    the text, its residual stream read back each position (float32 activations: the CPU
    engine's to float32 rounding); the simple kernels' prompt pass (fp16 activations) within
    2e-3 of the NumPy multi-token forward's."""
    hf = make_hf_llama(tmp_path, dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)
    odd = open_model(convert(hf.path, tmp_path / "odd.pycalm", "fp16", progress=False))
    ids = ids_of(3, seed=2)
    gpu = GpuEngine(odd, seq_len=8, kv_dtype="fp16")
    assert not gpu.multi_token
    np.testing.assert_allclose(gpu.embed(ids), CpuEngine(odd, seq_len=8).embed(ids), rtol=1e-4, atol=1e-5)
    ids = ids_of(4, seed=3)
    simple = GpuEngine(gpu_model, seq_len=8, kv_dtype="fp16", options=EngineOptions(kernels="simple"))
    assert rel_l2(simple.embed(ids), embed_pool_ref(emulated(gpu_model, ids))) < 2e-3


# ---------------------------------------------------------------------------------------------
# the Python API


def test_embed_batching_invariance_and_cache(llm):
    """A list's rows are the texts embedded one by one, to the bit, whatever came before (a
    chat's cached turn, other texts); an embedding leaves the cache forgotten, so the next
    prompt is fed whole and continues as from an empty cache."""
    together = llm.embed(TEXTS)
    assert together.shape == (len(TEXTS), llm.config.dim) and together.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(together[0], together[3])  # the same text twice
    llm.reset()
    text = llm.generate("w1 w2 w3", max_tokens=4, temperature=0)
    for i, t in enumerate(reversed(TEXTS)):
        alone = llm.embed(t)
        assert alone.shape == (1, llm.config.dim)
        np.testing.assert_array_equal(alone[0], together[len(TEXTS) - 1 - i])
    gen = llm.generate("w1 w2 w3", max_tokens=4, temperature=0, stream=True)
    assert "".join(gen) == text and gen.reused_tokens == 0


def test_poolings_differ_and_are_unit(llm):
    mean, last = llm.embed(TEXTS[2]), llm.embed(TEXTS[2], pooling="last")
    for v in (mean, last):
        assert abs(np.linalg.norm(v) - 1) < 1e-5
    assert rel_l2(mean, last) > 0.1
    raw = llm.embed(TEXTS[2], normalize=False)
    assert abs(np.linalg.norm(raw) - 1) > 1e-2
    np.testing.assert_allclose(raw / np.linalg.norm(raw), mean, rtol=1e-5, atol=1e-6)
    # a one-token text: its mean is its last token
    np.testing.assert_allclose(llm.embed_ids([[5]]), llm.embed_ids([[5]], "last"), rtol=1e-6)


def test_embed_cancelled(llm):
    """cancelled is asked before each text (the server's client gone): True stops there."""
    asked = []
    assert (
        llm.embed_ids([[1, 5], [1, 6], [1, 7]], cancelled=lambda: asked.append(1) or len(asked) > 1) is None
    )
    assert len(asked) == 2


@pytest.mark.parametrize(
    "texts,kwargs,message",
    [
        ([], {}, "nothing to embed"),
        ("", {}, "texts\\[0\\] is an empty string"),
        (["w1", 3], {}, "texts\\[1\\] must be a string, not int"),
        ("w1", {"pooling": "max"}, "pooling must be mean or last"),
        (" ".join(["w1"] * SEQ_LEN), {}, f"longer than the context of {SEQ_LEN}"),
    ],
)
def test_embed_errors(llm, texts, kwargs, message):
    with pytest.raises(PycalmError, match=message):
        llm.embed(texts, **kwargs)


# ---------------------------------------------------------------------------------------------
# the server, with the openai client


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """One server process for the module's tests, on the CPU engine, once it is ready."""
    log = tmp_path_factory.mktemp("serve_embed") / "server.log"
    with cpu_server(model_path, log, SEQ_LEN, alias="tiny", seconds=120) as url:
        yield {"url": url, "log": log}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_server_matches_api(server, client, llm):
    """The openai client's default (base64, decoded by the client), "float", and the raw base64
    string decoded here: the same floats as LLM.embed; token-id input as its text's ids."""
    want = llm.embed(TEXTS[:3])
    out = client.embeddings.create(model="tiny", input=TEXTS[:3])
    assert [d.index for d in out.data] == [0, 1, 2]
    np.testing.assert_array_equal(np.array([d.embedding for d in out.data], np.float32), want)
    n_tokens = sum(len(llm.tokenize(t)) for t in TEXTS[:3])
    assert out.usage.prompt_tokens == out.usage.total_tokens == n_tokens
    assert out.model == "tiny.pycalm"
    floats = client.embeddings.create(model="tiny.pycalm", input=TEXTS[2], encoding_format="float")
    np.testing.assert_array_equal(np.array(floats.data[0].embedding, np.float32), want[2])
    raw = httpx.post(
        server["url"] + "/v1/embeddings", json={"input": [TEXTS[0]], "encoding_format": "base64"}
    ).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, want[0])
    ids = [llm.tokenize(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model="tiny", input=ids)
    np.testing.assert_array_equal(np.array([d.embedding for d in by_ids.data], np.float32), want[:2])


def test_server_pooling_field(server, client, llm):
    out = client.embeddings.create(model="tiny", input=TEXTS[2], extra_body={"pooling": "last"})
    np.testing.assert_array_equal(np.array(out.data[0].embedding, np.float32), llm.embed(TEXTS[2], "last")[0])
    assert parse_args(["m", "--pooling", "last"]).pooling == "last"
    assert parse_args(["m"]).pooling == "mean"


@pytest.mark.parametrize(
    "body,message",
    [
        ({"input": []}, "'input' must be"),
        ({"input": ""}, "input\\[0\\] is an empty string"),
        ({"input": ["w1", ""]}, "input\\[1\\] is an empty string"),
        ({"input": ["w1", 7.5]}, "'input' must be"),
        ({"input": [[1, 2], [99]]}, "input\\[1\\]: a token id is outside the vocabulary"),
        ({"input": " ".join(["w1"] * SEQ_LEN)}, f"the context holds {SEQ_LEN}"),
        ({"input": "w1", "encoding_format": "int8"}, "'encoding_format' must be float or base64"),
        ({"input": "w1", "pooling": "max"}, "'pooling' must be mean or last"),
        ({"input": "w1", "dimensions": 8}, "'dimensions' is not supported"),
    ],
)
def test_server_bad_input(server, body, message):
    r = httpx.post(server["url"] + "/v1/embeddings", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].count("\n") == 0
    assert re.search(message, error["message"]), error["message"]


def test_server_errors_with_the_client(client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input=[])
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="other", input="w1")
    assert e.value.code == "model_not_found"
