"""n choices, penalties and logit_bias through a real server process (the CPU engine, a tiny
random model) with the openai client, streamed and not, against the Python API on the same
model file (LLM.generate with the same options: the same engine and sampler)."""

from __future__ import annotations

import openai
import pytest
from test_logprobs import server  # noqa: F401 - the module's server fixture

from pycalm.app.api import load


@pytest.fixture(scope="module")
def llm(server):  # noqa: F811
    return load(str(server["path"]), device="cpu", context=64, verbose=False)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


PROMPT = "w4 w9 w4"
MESSAGES = [{"role": "user", "content": "w5 w9 w12"}]


def test_n_choices(client, llm):
    """n = 3: three choices, index 0, 1, 2, choice i drawn with seed + i (the API's n=3, its
    Generations streamed one after another), usage counting every choice's tokens and the
    prompt once; streamed, choice 0's chunks all come before choice 1's, each with its index and
    a finish_reason, and join to the same texts; chat likewise; n above 8 is a 400."""
    opts = {"max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seed": 11}  # the API defaults to 0.9
    gens, want = [], []
    for gen in llm.generate(PROMPT, n=3, stream=True, **opts):  # each read before the next starts
        want.append("".join(gen))
        gens.append(gen)
    assert len(set(want)) > 1  # seeds 11, 12, 13 differ
    assert want == llm.generate(PROMPT, n=3, **opts)
    reply = client.completions.create(model="m", prompt=PROMPT, n=3, **opts)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == want
    assert [c.finish_reason for c in reply.choices] == [g.finish_reason for g in gens]
    assert reply.usage.completion_tokens == sum(g.completion_tokens for g in gens)
    assert reply.usage.prompt_tokens == len(llm.tokenize(PROMPT))

    chunks = list(client.completions.create(model="m", prompt=PROMPT, n=3, stream=True, **opts))
    indices = [c.choices[0].index for c in chunks]
    assert indices == sorted(indices) and set(indices) == {0, 1, 2}
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)] == want
    finishes = [
        (c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason
    ]
    assert finishes == [(i, g.finish_reason) for i, g in enumerate(gens)]

    chat = client.chat.completions.create(model="m", messages=MESSAGES, n=3, **opts)
    texts = [c.message.content for c in chat.choices]
    assert texts == llm.chat(MESSAGES, n=3, **opts)
    parts = list(client.chat.completions.create(model="m", messages=MESSAGES, n=3, stream=True, **opts))
    roles = [p.choices[0].index for p in parts if p.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]
    joined = [
        "".join(p.choices[0].delta.content or "" for p in parts if p.choices[0].index == i) for i in range(3)
    ]
    assert joined == texts

    # temperature 0: n identical choices
    same = client.completions.create(model="m", prompt=PROMPT, n=2, max_tokens=4, temperature=0)
    assert same.choices[0].text == same.choices[1].text
    with pytest.raises(openai.BadRequestError, match="'n' must be at most 8") as e:
        client.completions.create(model="m", prompt=PROMPT, n=9)
    assert e.value.response.json()["error"]["param"] == "n"


def test_penalties(client, llm):
    """Greedy with each penalty (presence, frequency, repetition) and all three: the server's
    text is the API's, and each changes the greedy text of this prompt; streamed, the same text;
    out-of-range values are 400s naming the field."""
    greedy = {"max_tokens": 8, "temperature": 0}
    plain = llm.generate(PROMPT, **greedy)
    for penalties in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 4.0},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.5},
    ):
        want = llm.generate(PROMPT, **greedy, **penalties)
        assert want != plain, penalties
        extra = (
            {"extra_body": {"repetition_penalty": penalties.pop("repetition_penalty")}}
            if "repetition_penalty" in penalties
            else {}
        )
        got = client.completions.create(model="m", prompt=PROMPT, **greedy, **penalties, **extra)
        assert got.choices[0].text == want, penalties
    stream = client.completions.create(model="m", prompt=PROMPT, stream=True, frequency_penalty=2.0, **greedy)
    assert "".join(c.choices[0].text for c in stream) == llm.generate(PROMPT, frequency_penalty=2.0, **greedy)
    for bad, param in (
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", prompt=PROMPT, **greedy, **bad)
        assert e.value.response.json()["error"]["param"] == param


def test_logit_bias(client, llm):
    """+100 on a token forces it at every step; -100 on the greedy first token bans it (the
    API's tokens); streamed chat the same; a token id outside the vocabulary, or a bias above
    100, is a 400 with one line naming logit_bias. The logprobs stay the model's."""
    greedy = {"max_tokens": 3, "temperature": 0, "logprobs": 1}
    first = llm.generate(PROMPT, **greedy).logprobs[0].token
    forced = 7 if first != 7 else 8
    got = client.completions.create(
        model="m", prompt=PROMPT, logit_bias={str(forced): 100}, **greedy
    ).choices[0]
    token = llm.tokenizer.token_bytes(forced).decode()
    assert got.logprobs.tokens == [token] * 3
    want = llm.generate(PROMPT, logit_bias={forced: 100}, **greedy)
    assert [lp.token for lp in want.logprobs] == [forced] * 3 and got.text == want.text
    assert got.logprobs.token_logprobs[0] == pytest.approx(want.logprobs[0].logprob, abs=1e-9)
    assert want.logprobs[0].top_ids == [first]  # the model's most likely token, not the forced one
    banned = llm.generate(PROMPT, logit_bias={first: -100}, **greedy)
    assert banned.logprobs[0].token != first
    got = client.completions.create(model="m", prompt=PROMPT, logit_bias={str(first): -100}, **greedy)
    assert got.choices[0].text == banned.text

    chat = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(forced): 100}}
    parts = client.chat.completions.create(model="m", messages=MESSAGES, stream=True, **chat)
    streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert streamed == llm.chat(MESSAGES, max_tokens=3, temperature=0, logit_bias={forced: 100})
    for bias, match in (({"64": 1}, "not a token id of this model"), ({"3": 101}, "from -100 to 100")):
        with pytest.raises(openai.BadRequestError, match=match) as e:
            client.completions.create(model="m", prompt=PROMPT, max_tokens=2, logit_bias=bias)
        assert e.value.response.json()["error"]["param"] == "logit_bias"
