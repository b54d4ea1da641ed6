"""min_tokens and ignore_eos (vLLM's request fields) end to end, on a tiny random model whose
greedy reply to one prompt ends with an EOS after a few tokens: the Python API, the server's
one-at-a-time worker and its --parallel runner (through OpenAI's client), the CLI, the speculative
loop, and (GPU only) the GPU engine, its simple kernels and the batched GPU runner.

What each run must give, by its definition: under ignore_eos, max_tokens tokens, whose first
ones are the plain reply's and its EOS (an EOS has no text); under min_tokens = n, the first n
tokens of a run whose EOS logits are banned (logit_bias -100), then plain decoding from there;
with a stop string, the text cut where it first ends in the n-th token's text or later.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from gpu import gpu_only
from tiny_models import make_hf_llama

import pycalm
from pycalm.app.generation import StopText
from pycalm.convert.main import convert
from pycalm.cpu.sampler import MinTokens, SamplingParams
from pycalm.errors import PycalmError

CONTEXT = 128
MAX = 16  # max_tokens of the runs
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 5}  # (the server's default top_p is 1, the API's 0.9)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eos_options")
    tiny = make_hf_llama(tmp, dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64)
    return convert(tiny.path, tmp / "tiny.pycalm", "fp16", progress=False)


@pytest.fixture(scope="module")
def llm(model):
    return pycalm.load(str(model), device="cpu", context=CONTEXT, batch_invariant=True, verbose=False)


@pytest.fixture(scope="module")
def early(llm) -> str:
    """A prompt whose greedy reply ends with an EOS after 3 to 8 tokens."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        prompt = " ".join(f"w{t}" for t in rng.integers(0, 61, int(rng.integers(1, 10))))
        gen = llm.generate(prompt, max_tokens=MAX, temperature=0.0, stream=True)
        "".join(gen)
        if gen.finish_reason == "stop" and 3 <= gen.completion_tokens <= 8:
            return prompt
    raise AssertionError("no prompt of this model ends early")


def run(llm, prompt: str | list[int], **options) -> tuple[list[int], object]:
    """The API's reply to prompt: its token ids (an EOS that ends it is not among them) and its
    Generation; greedy and MAX tokens unless options say otherwise."""
    options = {"max_tokens": MAX, "temperature": 0.0, **options}
    gen = llm.generate(prompt, logprobs=0, **options)
    return [x.token for x in gen.logprobs], gen


def texts(llm, tokens: list[int]) -> list[str]:
    """Each token's text (the word-level tokenizer's pieces need no context); an EOS has none."""
    eos = llm.config.eos_ids
    return ["" if t in eos else llm.tokenizer.token_bytes(t).decode() for t in tokens]


def banned(llm) -> dict[int, float]:
    return {t: -100.0 for t in llm.config.eos_ids}


# ---------------------------------------------------------------------------------------------
# the pieces: StopText and MinTokens


def test_stop_text_ends_only_from_the_min_tokens_th_piece():
    """A piece a token; a stop string counts where its last character comes from piece
    min_tokens or a later one, wherever it begins (vLLM's check from min_tokens on)."""

    def pushed(stops: list[str], min_tokens: int, pieces: list[str]) -> tuple[str, bool, int]:
        text = StopText(stops, min_tokens)
        out = ""
        for i, piece in enumerate(pieces):
            out += text.push(piece)
            if text.stopped:
                return out + text.finish(lambda: ""), True, i + 1
        return out + text.finish(lambda: ""), False, len(pieces)

    assert pushed(["ab"], 0, ["xab", "c"]) == ("x", True, 1)
    assert pushed(["ab"], 3, ["xab", "ab", "c"]) == ("xababc", False, 3)  # pieces 1, 2 unchecked
    assert pushed(["ab"], 3, ["ab", "xa", "b c"]) == ("abx", True, 3)  # begins in piece 2, ends in 3
    assert pushed(["ab"], 2, ["a", "b"]) == ("", True, 2)
    assert pushed(["ab", "c"], 2, ["cab", "zc"]) == ("cabz", True, 2)


def test_min_tokens_mask():
    """No EOS bit until n tokens are accepted; no bit past the vocabulary; over an inner
    constraint's mask (whose finished it reports), an EOS that is all it allows stays."""

    def allowed(c: object) -> list[int]:
        mask = np.zeros(2, np.uint32)
        c.fill_mask(mask)
        return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist()

    m = MinTokens(2, (2, 3), 40)
    assert allowed(m) == [0, 1, *range(4, 40)]
    m.accept(5)
    assert m.banning and allowed(m) == [0, 1, *range(4, 40)]
    m.accept(2)
    assert not m.banning and allowed(m) == list(range(40)) and not m.finished

    class Only:  # a constraint that allows `ids`
        vocab_size, finished = 40, True

        def __init__(self, ids: list[int]) -> None:
            self.ids, self.taken = ids, []

        def fill_mask(self, out: np.ndarray) -> None:
            out[:] = 0
            for t in self.ids:
                out[t // 32] |= np.uint32(1 << (t % 32))

        def accept(self, token: int) -> None:
            self.taken.append(token)

    inner = Only([2, 9, 35])
    m = MinTokens(1, (2, 3), 40, inner)
    assert allowed(m) == [9, 35] and m.finished
    m.accept(9)
    assert inner.taken == [9] and allowed(m) == [2, 9, 35]
    assert allowed(MinTokens(1, (2, 3), 40, Only([3]))) == [3]  # nothing else to sample
    assert MinTokens.over(None, SamplingParams(), (2,), 40) is None
    assert MinTokens.over(inner, SamplingParams(min_tokens=0), (2,), 40) is inner


# ---------------------------------------------------------------------------------------------
# the Python API (the CPU engine)


def test_ignore_eos_runs_to_max_tokens(llm, early):
    plain, p = run(llm, early)
    assert p.finish_reason == "stop" and p.completion_tokens == len(plain) + 1 < MAX
    tokens, g = run(llm, early, ignore_eos=True)
    assert (g.finish_reason, g.completion_tokens, len(tokens)) == ("length", MAX, MAX)
    assert tokens[: len(plain)] == plain and tokens[len(plain)] in llm.config.eos_ids
    assert g.text == "".join(texts(llm, tokens)) and g.text.startswith(p.text)
    # sampled: the same coins, so the same tokens up to the plain reply's EOS
    plain, _ = run(llm, early, **SAMPLED)
    tokens, g = run(llm, early, ignore_eos=True, **SAMPLED)
    assert tokens[: len(plain)] == plain and g.completion_tokens == MAX


def test_min_tokens_bans_eos_until_then(llm, early):
    plain, _ = run(llm, early)
    # at the plain reply's length nothing changes; one more, and its EOS is banned
    same, s = run(llm, early, min_tokens=len(plain))
    assert same == plain and s.finish_reason == "stop"
    moved, _ = run(llm, early, min_tokens=len(plain) + 1)
    assert moved[: len(plain)] == plain and len(moved) > len(plain)
    n = len(plain) + 3
    for options in ({}, SAMPLED):
        tokens, g = run(llm, early, min_tokens=n, **options)
        want, _ = run(llm, early, max_tokens=n, logit_bias=banned(llm), **options)
        assert len(want) == n and tokens[:n] == want and g.completion_tokens >= n
    # greedy: from the n-th token on, plain decoding of the prompt and those n tokens
    tokens, g = run(llm, early, min_tokens=n)
    rest, r = run(llm, llm.tokenize(early) + tokens[:n], max_tokens=MAX - n)
    assert tokens[n:] == rest and g.finish_reason == r.finish_reason


def test_stop_strings_wait_for_min_tokens(llm, early):
    """Every word's text holds a "w": stop="w" ends the text at the first word from the
    min_tokens-th token on (the text before it kept), or at once without min_tokens."""
    for n in (0, 2, 5):
        tokens, _ = run(llm, early, min_tokens=n)
        pieces = texts(llm, tokens)
        j = next(i for i in range(max(n - 1, 0), len(pieces)) if "w" in pieces[i])
        _, g = run(llm, early, min_tokens=n, stop="w")
        assert g.text == "".join(pieces[:j]) + pieces[j][: pieces[j].index("w")], n
        assert (g.finish_reason, g.completion_tokens) == ("stop", j + 1)


def test_bad_values_are_one_line_errors(llm):
    for options, message in (
        ({"min_tokens": -1}, "min_tokens must be a whole number >= 0, not -1"),
        ({"min_tokens": 1.5}, "min_tokens must be a whole number >= 0, not 1.5"),
        ({"min_tokens": 5}, r"min_tokens \(5\) must be at most max_tokens \(4\)"),
        ({"ignore_eos": "yes"}, "ignore_eos must be True or False, not 'yes'"),
    ):
        with pytest.raises(PycalmError, match=message):
            llm.generate("w1", max_tokens=4, **options)
    with pytest.raises(PycalmError, match="min_tokens must be"):
        llm.start([1, 5], 4, SamplingParams(min_tokens=-2))


def test_list_of_prompts_in_one_batch(llm, early):
    """LLM.generate over a list (the continuous-batching runner): each as alone."""
    prompts = [early, "w7 w8", early + " w3"]
    for options in ({"ignore_eos": True}, {"min_tokens": 9}, {"min_tokens": 4, "stop": "w", **SAMPLED}):
        options = {"max_tokens": MAX, "temperature": 0.0, **options}
        assert llm.generate(prompts, **options) == [llm.generate(p, **options) for p in prompts]


def test_speculative_loop(model, llm, early):
    """Speculative decoding (n-gram drafts, 2 a pass): ignore_eos speculates through the EOS and
    gives plain decoding's tokens; min_tokens decodes plainly (its mask is a constraint)."""
    from pycalm.app.speculative import NgramDrafter, SpeculationOptions, SpeculativeEngine
    from pycalm.cpu.engine import CpuEngine
    from pycalm.model.loader import open_model

    m = open_model(model)
    ids, n = llm.tokenize(early), 40
    plain = CpuEngine(m, seq_len=CONTEXT, batch_invariant=True)
    options = SpeculationOptions(k=2)
    spec = SpeculativeEngine(CpuEngine(m, seq_len=CONTEXT, batch_invariant=True), NgramDrafter(), options)
    for sampling in (SamplingParams(ignore_eos=True), SamplingParams(0.9, seed=5, ignore_eos=True)):
        want = list(plain.generate(ids, 0, n, sampling))
        assert len(want) == n and list(spec.generate(ids, 0, n, sampling)) == want
    assert options.stats.passes > 0
    sampling = SamplingParams(min_tokens=12)
    assert list(spec.generate(ids, 0, n, sampling)) == list(plain.generate(ids, 0, n, sampling))


def test_cli_flags(model, llm, early, capsys):
    """--min-tokens and --ignore-eos: the API's text; --min-tokens past -n is an error."""
    from pycalm.app.generate import main

    common = [str(model), "-i", early, "-n", str(MAX), "-t", "0", "--device", "cpu", "-c", str(CONTEXT)]
    common.append("--batch-invariant")
    for flags, options in (
        (["--ignore-eos"], {"ignore_eos": True}),
        (["--min-tokens", "9", "--stop", "w"], {"min_tokens": 9, "stop": "w"}),
    ):
        assert main([*common, *flags]) == 0
        want = llm.generate(early, max_tokens=MAX, temperature=0.0, **options)
        assert capsys.readouterr().out == want + "\n" and want
    with pytest.raises(SystemExit):
        main([*common, "--min-tokens", str(MAX + 1)])
    assert "--min-tokens 17: must be at most -n/--steps (16)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the server, one request at a time and --parallel, through OpenAI's client


@pytest.fixture(scope="module", params=["worker", "parallel"])
def server(request, model, tmp_path_factory):
    from test_serve import cpu_server

    log = tmp_path_factory.mktemp(f"eos_serve_{request.param}") / "server.log"
    args = ("--batch-invariant", *(("--parallel", "4") if request.param == "parallel" else ()))
    with cpu_server(model, log, CONTEXT, *args) as url:
        yield url


def test_server_takes_the_fields(server, llm, early):
    """Completions (one streamed) and chats with extra_body's min_tokens / ignore_eos, sent at
    once: each the API's text, finish reason and token count."""
    import openai  # (here: the GPU machine runs this file's other tests without it)

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    cases = [  # (extra_body, other options)
        ({"ignore_eos": True}, {}),
        ({"min_tokens": 9}, {}),
        ({"min_tokens": 9}, SAMPLED),
        ({"min_tokens": 4}, {"stop": "w"}),
    ]
    messages = [{"role": "user", "content": early}]

    def served(i: int) -> tuple[str, str, int]:
        extra, options = cases[i % len(cases)]
        args = {"model": "m", "max_tokens": MAX, "temperature": 0.0, **options, "extra_body": extra}
        if i >= len(cases):  # a chat
            r = client.chat.completions.create(messages=messages, **args)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        if i == 0:  # streamed
            chunks = list(client.completions.create(prompt=early, stream=True, **args))
            text = "".join(c.text for chunk in chunks for c in chunk.choices)
            return text, chunks[-1].choices[0].finish_reason, None
        r = client.completions.create(prompt=early, **args)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(2 * len(cases)) as pool:
        got = list(pool.map(served, range(2 * len(cases))))
    for i, (text, finish, n) in enumerate(got):
        extra, options = cases[i % len(cases)]
        options = {"max_tokens": MAX, "temperature": 0.0, **options, **extra, "stream": True}
        gen = llm.chat(messages, **options) if i >= len(cases) else llm.generate(early, **options)
        want = "".join(gen)
        assert (text, finish) == (want, gen.finish_reason), (i, extra, options)
        assert n in (None, gen.completion_tokens)
    assert got[0][1] == "length" and got[len(cases)][2] == MAX  # ignore_eos: to max_tokens


def test_server_bad_values_are_400s(server):
    for body, message in (
        ({"min_tokens": -1}, "'min_tokens' must be at least 0, not -1"),
        ({"min_tokens": "3"}, "'min_tokens' must be an integer, not str"),
        ({"min_tokens": 5}, "'min_tokens' must be at most max_tokens (4), not 5"),
        ({"ignore_eos": 1}, "'ignore_eos' must be true or false, not int"),
    ):
        param = next(iter(body))
        for path, prompt in (
            ("completions", {"prompt": "w1"}),
            ("chat/completions", {"messages": [{"role": "user", "content": "w1"}]}),
        ):
            r = httpx.post(f"{server}/v1/{path}", json={**prompt, "max_tokens": 4, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
            assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------------------------------------
# the GPU engine (token steps under the simulator take seconds each: GPU only)


@gpu_only("simulator time: tens of token steps")
def test_gpu_engine(model, llm):
    """The fast kernels (min_tokens through the masked steps, greedy and sampled) and the simple
    kernels (drawn on the host): the definitions above, on the GPU engine's own plain runs (for a
    prompt of its own: its fp16 activations part from the CPU engine's at this random model's
    near ties)."""
    from pycalm.gpu.engine import EngineOptions, GpuEngine
    from pycalm.model.loader import open_model

    eos = llm.config.eos_ids
    ban = tuple(sorted(banned(llm).items()))

    def ends_early(e: object, s: SamplingParams) -> tuple[list[int], list[int]]:
        """A prompt whose reply under s ends with an EOS after 3 to 10 tokens, and that reply."""
        rng = np.random.default_rng(1)
        for _ in range(300):
            ids = [1, *(int(t) for t in rng.integers(3, 64, int(rng.integers(1, 10))))]
            plain = list(e.generate(ids, 0, MAX, s))
            if plain[-1] in eos and 4 <= len(plain) <= 11:
                return ids, plain
        raise AssertionError("no prompt ends early")

    for kernels in ("fast", "simple"):
        e = GpuEngine(open_model(model), seq_len=CONTEXT, options=EngineOptions(kernels=kernels))
        for s in (SamplingParams(), SamplingParams(0.9, seed=5)):
            ids, plain = ends_early(e, s)
            tokens = list(e.generate(ids, 0, MAX, SamplingParams(**{**vars(s), "ignore_eos": True})))
            assert len(tokens) == MAX and tokens[: len(plain)] == plain
            n = len(plain) + 3
            tokens = list(e.generate(ids, 0, MAX, SamplingParams(**{**vars(s), "min_tokens": n})))
            want = list(e.generate(ids, 0, n, SamplingParams(**{**vars(s), "logit_bias": ban})))
            assert tokens[:n] == want and not set(want) & set(eos)


@gpu_only("simulator time: tens of batched steps")
def test_gpu_batch_runner_and_speculation(model, early):
    """On the GPU: a list of prompts in the batched runner (a min_tokens row on the host until
    then, on the device after), each as alone. Speculation: this model's head_dim (8) is not
    the multi-token forward's, so there is no rows pass to check drafts with: --speculate auto
    decodes plainly, and ngram is refused in one line (test_speculative_loop: the CPU's)."""
    gpu = pycalm.load(str(model), device="gpu", context=CONTEXT, verbose=False)
    prompts = [early, "w7 w8", early + " w3"]
    for options in ({"ignore_eos": True}, {"min_tokens": 9}, {"min_tokens": 4, "stop": "w", **SAMPLED}):
        options = {"max_tokens": MAX, "temperature": 0.0, **options}
        assert gpu.generate(prompts, **options) == [gpu.generate(p, **options) for p in prompts]
    from pycalm.app.speculative import SpeculativeEngine

    assert not isinstance(gpu.engine, SpeculativeEngine)
    with pytest.raises(PycalmError, match="the multi-token forward does not take head_dim 8"):
        pycalm.load(str(model), device="gpu", context=CONTEXT, verbose=False, speculate="ngram")
