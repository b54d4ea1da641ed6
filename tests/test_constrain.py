"""Constrained decoding: the mask kernel (pycalm.kernels.mask) against mask_logits_ref, the
Constraint (pycalm.app.constrain) against the continuations a finite language allows, the
engines' generate(..., constraint=) on a tiny random model, and the server's response_format,
grammar and regex through the openai client."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gpu import GPU

from pycalm.cpu.reference import mask_logits_ref
from pycalm.errors import PycalmError

# a schema whose language is finite, so that even a random model's output ends: with pycalm's
# separators (", " and ": ", no free whitespace) it is exactly these strings
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
LANGUAGE = {f'{{"ok": {b}, "n": {n}}}' for b in ("true", "false") for n in (1, 22)}


def json_tokenizer_json() -> str:
    """A 64-token byte-level BPE tokenizers JSON that can spell JSON: <unk>, <s>, </s> and
    <|eot|> (ids 0 to 3: special; the tiny llama's BOS is 1 and its EOS ids 2 and 3), then the
    characters of JSON, digits and letters, one token each (no merges: a string has one
    tokenization, so the continuations a language allows are exactly the tokens a mask may allow)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    special = ["<unk>", "<s>", "</s>", "<|eot|>"]
    chars = list('{}[]":, 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ')[:60]
    pieces = ["\u0120" if c == " " else c for c in chars]
    tok = Tokenizer(BPE({p: i for i, p in enumerate(special + pieces)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    return tok.to_str()


@pytest.fixture(scope="module")
def tok():
    from pycalm.model.tokenizer import Tokenizer

    return Tokenizer.from_blob("tokenizers-json", json_tokenizer_json().encode(), 1, (2, 3))


# ---------------------------------------------------------------------------------------------
# the mask kernel


@pytest.mark.parametrize("vocab", [37, 203, 4099] if not GPU else [151_936, 128_256, 49_153])
def test_mask_kernel_matches_reference(vocab):
    """Random logits and a random bitmask at odd vocabulary sizes (a last word partly used; a
    vocabulary below one block): the kernel's logits equal mask_logits_ref's exactly (-inf where
    a bit is clear, the logit itself untouched where it is set)."""
    from numba import cuda

    from pycalm.kernels.mask import mask_logits

    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal(vocab).astype(np.float32)
    mask = rng.integers(0, 2**32, -(-vocab // 32), dtype=np.uint64).astype(np.uint32)
    mask[0] = 0x80000001  # the first and the last id of a word
    d_logits = cuda.to_device(logits)
    s = cuda.stream()
    mask_logits(d_logits, cuda.to_device(mask), stream=s)
    s.synchronize()
    got, want = d_logits.copy_to_host(), mask_logits_ref(logits, mask)
    assert np.array_equal(got, want)
    assert got[0] == logits[0] and got[31] == logits[31] and got[1] == -np.inf
    assert 0 < np.isinf(want).sum() < vocab - 2  # both kinds of id, past the first word too


# ---------------------------------------------------------------------------------------------
# the Constraint


def _allowed_by_language(tok, prefix: bytes, language: set[str]) -> set[int]:
    """Every id whose bytes continue `prefix` into a prefix of a string of the language, and the
    EOS ids where the prefix is one of the strings."""
    strings = [s.encode() for s in language]
    out = set()
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if b and not tok.is_special(i) and any(s.startswith(prefix + b) for s in strings):
            out.add(i)
    if prefix in strings:
        out |= set(tok.eos_ids)
    return out


def test_json_schema_allows_exactly_the_valid_continuations(tok):
    """At every step along each string of SCHEMA's language, the mask allows exactly the ids
    that continue it within the language (brute force over the vocabulary); at the end only
    the EOS ids, and the constraint is finished. The model's vocab_size above the tokenizer's
    count: the extra ids are never allowed."""
    from pycalm.app.constrain import Constraint

    for text in sorted(LANGUAGE):
        c = Constraint.json_schema(tok, SCHEMA, vocab_size=70)
        prefix = b""
        for t in tok.encode(text, add_bos=False):
            assert c.mask().shape == (3,)
            assert set(c.allowed().tolist()) == _allowed_by_language(tok, prefix, LANGUAGE), prefix
            c.accept(t)
            prefix += tok.token_bytes(t)
        assert prefix == text.encode() and c.finished
        assert set(c.allowed().tolist()) == {2, 3}
    c = Constraint.json_schema(tok, SCHEMA)
    with pytest.raises(PycalmError, match="does not continue"):
        c.accept(tok.encode("[", add_bos=False)[0])


def test_regex_grammar_and_json_object(tok):
    """A regex, a Lark grammar (with an embedded %json schema) and any JSON object accept their
    strings and reject others token by token."""
    from pycalm.app.constrain import Constraint, make_constraint

    def accepts(c, text: str) -> bool:
        try:
            for t in tok.encode(text, add_bos=False):
                c.accept(t)
        except PycalmError:
            return False
        return c.accepting

    assert accepts(Constraint.regex(tok, r"(yes|no) [0-9]{2}"), "no 42")
    assert not accepts(Constraint.regex(tok, r"(yes|no) [0-9]{2}"), "no 4x")
    lark = (
        'start: "say " answer\nanswer: %json {"type": "array", "items": {"type": "integer"}, "maxItems": 2}'
    )
    assert accepts(Constraint.grammar(tok, lark), "say [1, 2]")
    assert not accepts(Constraint.grammar(tok, lark), "say [1, 2, 3]")
    obj = make_constraint(tok, response_format={"type": "json_object"})
    assert accepts(obj, '{"a": [1, {"b": null}]}') and obj.finished
    assert not accepts(make_constraint(tok, response_format={"type": "json_object"}), "[1]")
    assert make_constraint(tok, response_format={"type": "text"}) is None


@pytest.mark.parametrize(
    "kind, arg, message",
    [
        ("regex", "a(", "invalid regex: .*unclosed group"),
        ("grammar", "start: nothing_here", "invalid grammar: .*nothing_here"),
        ("json_schema", {"type": "float"}, "invalid json_schema: .*float"),
        ("response_format", {"type": "xml"}, "response_format type must be text, json_object or json_schema"),
        ("response_format", {"type": "json_schema"}, "needs"),
    ],
)
def test_bad_constraints_are_one_line_errors(tok, kind, arg, message):
    from pycalm.app.constrain import Constraint, make_constraint

    with pytest.raises(PycalmError, match=message) as e:
        if kind == "response_format":
            make_constraint(tok, response_format=arg)
        else:
            getattr(Constraint, kind)(tok, arg)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# the engines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama (1 layer, 64 ids, EOS 2 and 3) with the JSON tokenizer, converted."""
    from tiny_models import make_hf_llama

    from pycalm.convert.main import convert

    tmp = tmp_path_factory.mktemp("constrain")
    model = make_hf_llama(tmp, dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64)
    (model.path / "tokenizer.json").write_text(json_tokenizer_json())
    return convert(model.path, tmp / "tiny.pycalm", "fp16", progress=False)


def _run(engine, tok, prompt: list[int], sampling, make) -> str:
    c = make()
    out = list(engine.generate(prompt, 0, 24, sampling, constraint=c))
    assert c.finished and out[-1] not in tok.eos_ids
    return tok.decode(out)


def test_cpu_engine_follows_the_constraint(tiny, tok):
    """The CPU engine, greedy and at temperature 0.7 with top-p: every output is a string of
    SCHEMA's language and ends there (no EOS sampled); a regex likewise; a constraint over
    another vocabulary size is refused."""
    from pycalm.app.constrain import Constraint
    from pycalm.cpu.engine import CpuEngine
    from pycalm.cpu.sampler import SamplingParams
    from pycalm.model.loader import open_model

    engine = CpuEngine(open_model(tiny), seq_len=64)
    prompt = [1, 30, 31, 32]
    runs = [SamplingParams(temperature=0.0)] + [SamplingParams(0.7, top_p=0.9, seed=s) for s in range(4)]
    texts = [_run(engine, tok, prompt, sp, lambda: Constraint.json_schema(tok, SCHEMA)) for sp in runs]
    assert set(texts) <= LANGUAGE, texts
    text = _run(engine, tok, prompt, runs[1], lambda: Constraint.regex(tok, r"[a-f]{3} [0-9]{2}"))
    assert len(text) == 6 and text[3] == " " and text[4:].isdigit() and set(text[:3]) <= set("abcdef")
    with pytest.raises(PycalmError, match="the constraint masks 65 ids, the model has a vocabulary of 64"):
        next(
            engine.generate(
                prompt, 0, 2, runs[0], constraint=Constraint.json_schema(tok, SCHEMA, vocab_size=65)
            )
        )


def test_gpu_engines_follow_the_constraint(tiny, tok):
    """The GPU engine's fast step (split into its forward and its masked sampling, the mask
    computed while the forward runs), greedy and at temperature 0.7, and the simple kernels
    (masked on the host, the same code greedy or not) at 0.7: the CPU engine's tokens (the same
    coins; greedy, the best allowed id), in the regex's language. (A few tokens: a token step
    takes seconds under the simulator.)"""
    from pycalm.app.constrain import Constraint
    from pycalm.cpu.engine import CpuEngine
    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.engine import EngineOptions, GpuEngine
    from pycalm.model.loader import open_model

    model = open_model(tiny)
    prompt = [1, 30, 31, 32]
    pattern = r"[a-f][0-9]" if not GPU else r"[a-f]{5} [0-9]{4}"
    runs = [SamplingParams(temperature=0.0), SamplingParams(0.7, top_p=0.9, seed=3)]
    cpu = CpuEngine(model, seq_len=64)
    want = [_run(cpu, tok, prompt, sp, lambda: Constraint.regex(tok, pattern)) for sp in runs]
    assert all(w[0] in "abcdef" and w[-1].isdigit() for w in want)
    gpu = GpuEngine(model, 64, "fp16", options=EngineOptions(decode_lookahead=2))
    got = [_run(gpu, tok, prompt, sp, lambda: Constraint.regex(tok, pattern)) for sp in runs]
    assert got == want
    # the simple kernels draw every constrained token on the host, greedy or not: one run
    gpu = GpuEngine(model, 64, "fp16", options=EngineOptions(kernels="simple"))
    assert _run(gpu, tok, prompt, runs[1], lambda: Constraint.regex(tok, pattern)) == want[1]


# ---------------------------------------------------------------------------------------------
# the server, through the openai client


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """python -m pycalm.serve on the tiny JSON-spelling model (the CPU engine); its URL."""
    from test_serve import cpu_server

    with cpu_server(tiny, tmp_path_factory.mktemp("constrain_serve") / "server.log", 64) as url:
        yield url


def test_server_structured_output(server):
    """response_format json_schema (strict) and json_object on chat, streamed and not, and
    pycalm's regex / grammar fields on completions (extra_body): the text is in the schema's
    language (or, for json_object, a JSON object; a random model may run out of tokens, then
    finish_reason is "length"), finish_reason "stop"; an unsupported response_format type and a
    bad schema are 400s."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "abc"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2):
        reply = client.chat.completions.create(
            model="m", messages=messages, response_format=fmt, max_tokens=30, temperature=0.7, seed=seed
        )
        assert reply.choices[0].message.content in LANGUAGE and reply.choices[0].finish_reason == "stop"
        chunks = list(
            client.chat.completions.create(
                model="m", messages=messages, response_format=fmt, max_tokens=30, temperature=0.7, seed=seed,
                stream=True,
            )
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    obj = client.chat.completions.create(
        model="m", messages=messages, response_format={"type": "json_object"}, max_tokens=40, temperature=0
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].finish_reason == "length" and obj.choices[0].message.content.startswith("{")
    done = client.completions.create(
        model="m",
        prompt="abc",
        max_tokens=10,
        temperature=0.7,
        seed=3,
        extra_body={"regex": "(yes|no) [0-9]"},
    )
    assert done.choices[0].text[:-2] in ("yes", "no") and done.choices[0].text[-1].isdigit()
    lark = 'start: "n " %json {"type": "integer", "enum": [7, 42]}'
    streamed = client.completions.create(
        model="m",
        prompt="abc",
        max_tokens=10,
        temperature=0.7,
        seed=4,
        stream=True,
        extra_body={"grammar": lark},
    )
    assert "".join(c.choices[0].text for c in streamed) in ("n 7", "n 42")
    for body, param in (
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "x"}}}}, "response_format"),
        ({"regex": "a("}, "regex"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=messages, max_tokens=5, extra_body=body)
        assert e.value.status_code == 400 and e.value.body["param"] == param


def test_cli_json_schema_and_grammar(tiny, tmp_path, capsys):
    """python -m pycalm.generate --json-schema FILE / --grammar FILE: the printed text follows
    it; a grammar that does not compile is an error line and exit status 1."""
    from pycalm.app.generate import main

    schema, grammar = tmp_path / "s.json", tmp_path / "g.lark"
    schema.write_text(json.dumps(SCHEMA))
    grammar.write_text('start: "x" /[0-9]{3}/')
    common = [str(tiny), "-i", "abc", "-n", "30", "-t", "0.7", "-s", "5", "--device", "cpu"]
    assert main([*common, "--json-schema", str(schema)]) == 0
    assert capsys.readouterr().out.strip() in LANGUAGE
    assert main([*common, "--grammar", str(grammar)]) == 0
    out = capsys.readouterr().out.strip()
    assert out[0] == "x" and out[1:].isdigit() and len(out) == 4
    grammar.write_text("start: missing")
    assert main([*common, "--grammar", str(grammar)]) == 1
    assert "invalid grammar" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# a real model


def test_smollm2_structured_output(smollm2_gguf_path):
    """SmolLM2 on the CPU: json_object and a strict schema at temperature 0.7, two samples
    each, all parse and validate (scripts/check_structured.py runs 20 schemas x 5 samples)."""
    import pycalm

    llm = pycalm.load(str(smollm2_gguf_path), device="cpu", context=512, verbose=False)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    for seed in (0, 1):
        messages = [{"role": "user", "content": "Describe a person as JSON."}]
        gen = llm.chat(messages, max_tokens=60, temperature=0.7, seed=seed, response_format=fmt, stream=True)
        value = json.loads("".join(gen))
        assert gen.finish_reason == "stop" and set(value) == {"name", "age"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 16
        assert isinstance(value["age"], int) and value["age"] >= 0
        messages = [
            {"role": "user", "content": "Give the colour of the sky as a JSON object with one key, colour."}
        ]
        gen = llm.chat(
            messages,
            max_tokens=60,
            temperature=0.7,
            seed=seed,
            response_format={"type": "json_object"},
            stream=True,
        )
        text = "".join(gen)
        assert gen.finish_reason == "stop" and isinstance(json.loads(text), dict), text
