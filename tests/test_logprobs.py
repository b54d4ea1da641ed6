"""Logprobs: the kernel (pycalm.kernels.logprobs) against logprobs_ref, the GPU engine's
generate(..., logprobs=k) against logprobs_ref over the CPU engine's logits, and the server's
`logprobs` / `top_logprobs` through the openai client."""

from __future__ import annotations

import numpy as np
import pytest
from gpu import GPU

from pycalm.cpu.reference import MAX_TOP_LOGPROBS, logprobs_ref
from pycalm.errors import PycalmError
from pycalm.kernels.common import STATE_SIZE, STATE_TOKEN


def run_kernel(logits: np.ndarray, token: int) -> np.ndarray:
    from numba import cuda

    from pycalm.kernels.logprobs import OUT_SIZE, logprobs

    state = np.zeros(STATE_SIZE, np.int32)
    state[STATE_TOKEN] = token
    out = cuda.to_device(np.zeros(OUT_SIZE, np.int32))
    s = cuda.stream()
    logprobs(cuda.to_device(logits.astype(np.float32)), cuda.to_device(state), out, stream=s)
    s.synchronize()
    return out.copy_to_host()


def check(got, want) -> None:
    """Kernel against reference: the same ids in the same order; logprobs within the float32
    logsumexp's rounding (a few ulps of the largest logit: 1e-5 absolute at logits of magnitude
    up to 30; -inf equal)."""
    assert got.token == want.token and got.top_ids == want.top_ids
    assert np.allclose(
        [got.logprob, *got.top_logprobs], [want.logprob, *want.top_logprobs], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("vocab", [37, 203, 4099] if not GPU else [151_936, 128_256, 49_153])
def test_kernel_matches_reference(vocab):
    """Random logits at odd vocabulary sizes (37: fewer than the block's threads, and under K
    per thread), with ties at the top (two equal maxima and equal logits straddling rank K) and
    -inf entries (masked tokens): the same top ids (descending logit, lower id first) and logprobs."""
    from pycalm.kernels.logprobs import K, token_logprobs

    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    order = np.argsort(-logits, kind="stable")
    logits[order[1]] = logits[order[0]]  # a tie at the top: the lower id goes first
    logits[order[K - 2 : K + 3]] = logits[order[K - 2]]  # a run of equal logits across rank K
    logits[rng.choice(vocab, vocab // 5, replace=False)] = -np.inf
    logits[order[0]] = logits[order[1]] = logits.max() + 1  # the two maxima kept finite
    for token in (int(order[0]), int(rng.integers(vocab))):
        out = run_kernel(logits, token)
        for k in (0, 1, 7, MAX_TOP_LOGPROBS):
            check(token_logprobs(out, token, k), logprobs_ref(logits, token, k))


def test_kernel_few_finite():
    """Fewer finite logits than K: the -inf ones fill the list by id (as the reference orders
    them); the chosen token's logprob is -inf when it is masked."""
    from pycalm.kernels.logprobs import token_logprobs

    logits = np.full(45, -np.inf, np.float32)
    logits[[3, 17, 40]] = [1.0, 2.5, 1.0]
    for token in (17, 5):
        check(token_logprobs(run_kernel(logits, token), token, 20), logprobs_ref(logits, token, 20))


def test_reference_rejects_k():
    with pytest.raises(PycalmError, match="top logprobs must be 0 to 20"):
        logprobs_ref(np.zeros(4), 0, 21)


def test_engine_generate_logprobs(tmp_path):
    """GpuEngine.generate(..., logprobs=k) on a tiny 1-layer model, greedy: the CPU's tokens; the last step's logprobs against logprobs_ref over the logits that step left on
    the device (the kernel in the captured step: the kernel test's 1e-5); and every token's
    logprob and top k against logprobs_ref over the CPU engine's logits at the same positions.
    The GPU's logits d are within 2e-3 relative L2 of the CPU's l (test_prefill's tolerance for
    logits); a logprob is a logit less the logsumexp, which moves by at most max |d|, so a
    logprob moves by at most 2 max |d| <= 2 ||d|| <= 4e-3 ||l||: the bound. The top ids are
    compared where neighbours are more than twice that apart (closer ones may swap)."""
    from test_prefill import SEQ_LEN, tiny_model, tokens

    from pycalm.cpu.engine import CpuEngine
    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.engine import EngineOptions, GpuEngine

    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    prompt = tokens(5, seed=8)
    greedy = SamplingParams(temperature=0.0)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16", options=EngineOptions(decode_lookahead=2))
    got = list(gpu.generate(prompt, 0, 3, greedy, logprobs=5))
    assert len(got) == 3
    check(got[-1], logprobs_ref(gpu.logits_buf.copy_to_host(), got[-1].token, 5))
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    cpu.prefill(prompt[:-1], 0)
    token = prompt[-1]
    for i, g in enumerate(got):
        logits = cpu.logits(token, len(prompt) - 1 + i)
        want = logprobs_ref(logits, g.token, 5)
        bound = 4e-3 * np.linalg.norm(logits)
        assert g.token == int(np.argmax(logits))
        assert len(g.top_ids) == 5 and g.top_ids[0] == g.token
        assert abs(g.logprob - want.logprob) < bound
        assert np.allclose(g.top_logprobs, want.top_logprobs, rtol=0, atol=bound)
        apart = [True, *(np.diff(want.top_logprobs) < -2 * bound), True]  # cannot swap with the next
        for j in range(5):
            if apart[j] and apart[j + 1]:
                assert g.top_ids[j] == want.top_ids[j]
        token = g.token
    # the CPU engine yields the reference itself; logprobs=0: no alternatives
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    zero = list(cpu.generate(prompt, 0, 2, greedy, logprobs=0))
    assert [z.token for z in zero] == [g.token for g in got[:2]] and all(z.top_ids == [] for z in zero)
    with pytest.raises(PycalmError, match="top logprobs must be 0 to 20"):
        next(gpu.generate(prompt, 0, 1, greedy, logprobs=21))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real server process (python -m pycalm.serve, the CPU engine) on a tiny random model
    with a word-level tokenizer and a chat template (tests/tiny_models.py); its URL once loaded."""
    from test_serve import cpu_server
    from tiny_models import make_hf_llama

    from pycalm.convert.main import convert

    tmp = tmp_path_factory.mktemp("logprobs_serve")
    tiny = make_hf_llama(tmp, dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64)
    path = convert(tiny.path, tmp / "tiny.pycalm", "fp16", progress=False)
    with cpu_server(path, tmp / "server.log", 64) as url:
        yield {"url": url, "path": path}


def _reference(path, prompt_ids: list[int], n: int, k: int) -> list:
    """The CPU engine's greedy tokens' TokenLogprobs for a prompt of ids (what the server runs)."""
    from pycalm.cpu.engine import CpuEngine
    from pycalm.cpu.sampler import SamplingParams
    from pycalm.model.loader import open_model

    return list(
        CpuEngine(open_model(path), seq_len=64).generate(prompt_ids, 0, n, SamplingParams(), logprobs=k)
    )


def test_server_logprobs(server):
    """Chat (logprobs: true, top_logprobs) and completions (logprobs: k), streamed and not,
    through the openai client: each token's logprob and top list are the CPU engine's
    (logprobs_ref), the streamed ones the same as the whole answer's, the completions' tokens
    and offsets spell the text; top_logprobs above 20 is a 400 naming the limit."""
    import openai

    from pycalm.app.api import load

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)
    llm = load(str(server["path"]), device="cpu", context=64, verbose=False)
    messages = [{"role": "user", "content": "w5 w9 w12"}]
    n, k = 4, 3
    greedy = {"max_tokens": n, "temperature": 0, "seed": 1}
    want = _reference(server["path"], llm.chat_ids(messages), n, k)
    eos = set(llm.config.eos_ids)
    want = [w for w in want if w.token not in eos]
    assert len(want) == n  # (this conversation's reply has no EOS within n tokens)

    def tok(i: int) -> str:
        return llm.tokenizer.token_bytes(i).decode("utf-8", errors="replace")

    # chat, whole
    reply = client.chat.completions.create(
        model="m", messages=messages, logprobs=True, top_logprobs=k, **greedy
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [tok(w.token) for w in want]
    for c, w in zip(content, want, strict=True):
        assert c.logprob == pytest.approx(w.logprob, abs=1e-9) and c.bytes == list(
            llm.tokenizer.token_bytes(w.token)
        )
        assert [t.token for t in c.top_logprobs] == [tok(i) for i in w.top_ids]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(w.top_logprobs, abs=1e-9)
    # chat, streamed: the chunks' entries join to the whole answer's
    chunks = client.chat.completions.create(
        model="m", messages=messages, logprobs=True, top_logprobs=k, stream=True, **greedy
    )
    streamed = [
        c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    # chat without logprobs: none
    assert client.chat.completions.create(model="m", messages=messages, **greedy).choices[0].logprobs is None

    # completions, whole and streamed
    prompt = "w4 w9"  # 4 tokens, no EOS
    want = [w for w in _reference(server["path"], llm.tokenize(prompt), n, 2) if w.token not in eos]
    assert len(want) == n
    done = client.completions.create(model="m", prompt=prompt, logprobs=2, **greedy).choices[0]
    lp = done.logprobs
    assert lp.tokens == [tok(w.token) for w in want]
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-9)
    got_top = [v for d in lp.top_logprobs for v in d.values()]
    assert got_top == pytest.approx([v for w in want for v in w.top_logprobs], abs=1e-9)
    assert [list(d) for d in lp.top_logprobs] == [[tok(i) for i in w.top_ids] for w in want]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    parts = client.completions.create(model="m", prompt=prompt, logprobs=2, stream=True, **greedy)
    tokens = [t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens]
    assert tokens == lp.tokens

    # the 400s
    for call in (
        lambda: client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=21),
        lambda: client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=-1),
        lambda: client.completions.create(model="m", prompt=prompt, logprobs=21),
    ):
        with pytest.raises(openai.BadRequestError, match="must be from 0 to 20"):
            call()

    # the Python API: generate(..., logprobs=k) returns the finished Generation
    gen = llm.generate(prompt, max_tokens=n, temperature=0, logprobs=2)
    assert gen.text == done.text and [g.token for g in gen.logprobs] == [w.token for w in want]
    assert llm.generate(prompt, max_tokens=n, temperature=0) == done.text
