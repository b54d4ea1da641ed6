"""The Python API (pycalm.load, LLM) on the CPU engine with the real SmolLM2 (fp16, conftest).

The expected texts are transformers' greedy continuations (the same as test_cli's), so the API
is checked against the CLI and the reference at once; perplexity is compared with the CLI's -x.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from test_cli import REPO, _env

import pycalm
from pycalm.errors import PycalmError

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_fp16):
    return pycalm.load(smollm2_fp16, device="cpu", context=512, verbose=False)


def test_generate_greedy(llm):
    # transformers' first 4 greedy ids are " Paris", ".", "\n", "\n" (test_cli's prompt test)
    assert llm.generate(PROMPT, max_tokens=4, temperature=0) == " Paris.\n\n"


def test_batch_invariant_load(smollm2_fp16):
    """load(batch_invariant=True) takes the flag to the engine; on the CPU engine, which feeds
    every token alone anyway, the text is the same (the GPU engine's mode: test_prefill.py)."""
    llm = pycalm.load(smollm2_fp16, device="cpu", context=512, verbose=False, batch_invariant=True)
    assert llm.generate(PROMPT, max_tokens=4, temperature=0) == " Paris.\n\n"


def test_stream_pieces_and_counts(llm):
    gen = llm.generate(PROMPT, max_tokens=4, temperature=0, stream=True)
    pieces = list(gen)
    assert pieces == [" Paris", ".", "\n", "\n"]
    assert (gen.prompt_tokens, gen.completion_tokens, gen.finish_reason) == (5, 4, "length")


def test_stop_strings(llm):
    gen = llm.generate(PROMPT, max_tokens=8, temperature=0, stop=".", stream=True)
    assert "".join(gen) == " Paris" and gen.finish_reason == "stop"
    # a stop string spread over three tokens ("\n", "\n", "The"): nothing of it is handed out
    gen = llm.generate(PROMPT, max_tokens=8, temperature=0, stop=["\n\nThe", "xyz"], stream=True)
    assert list(gen) == [" Paris", "."] and gen.finish_reason == "stop"
    assert gen.completion_tokens == 5
    # a stop string that never comes: the whole text
    assert llm.generate(PROMPT, max_tokens=4, temperature=0, stop="Berlin") == " Paris.\n\n"


def test_chat_and_prefix_reuse(llm):
    gen = llm.chat(QUESTION, max_tokens=24, temperature=0, stream=True)
    first = "".join(gen)
    assert first == "The capital of France is Paris."  # transformers' greedy reply
    assert gen.finish_reason == "stop"  # at the EOS
    turn1_tokens = gen.prompt_tokens + gen.completion_tokens - 1  # in the cache: all but the EOS
    messages = [
        *QUESTION,
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And what is the capital of Germany?"},
    ]
    gen = llm.chat(messages, max_tokens=24, temperature=0, stream=True)
    second = "".join(gen)
    # the first turn's prompt and reply are in the cache: only the tokens after them are fed
    # (the template renders the reply to the same ids it was sampled as)
    assert gen.reused_tokens == turn1_tokens
    assert llm.chat_ids(messages)[:turn1_tokens] == llm.chat_ids(QUESTION) + llm.tokenize(
        first, add_bos=False
    )
    # ... and the reply equals the one from an empty cache
    llm.reset()
    fresh = llm.chat(messages, max_tokens=24, temperature=0, stream=True)
    assert "".join(fresh) == second and fresh.reused_tokens == 0
    assert "Berlin" in second


def test_sampling_is_seeded(llm):
    a = llm.generate(PROMPT, max_tokens=6, temperature=1.0, top_p=1.0, seed=5)
    b = llm.generate(PROMPT, max_tokens=6, temperature=1.0, top_p=1.0, seed=5)
    assert a == b


def test_closing_a_stream_frees_the_engine(llm):
    gen = llm.generate(PROMPT, max_tokens=50, temperature=0, stream=True)
    assert next(gen) == " Paris"
    gen.close()
    assert gen.finish_reason is None and gen.completion_tokens == 1
    # the cache holds the prompt (the sampled token was never fed): the next request reuses it
    again = llm.generate(PROMPT + " Paris", max_tokens=1, temperature=0, stream=True)
    assert "".join(again) == "." and again.reused_tokens == 5


def test_tokenize_round_trip(llm):
    text = "Hello, world! Ünïcödé and   spaces\n"
    ids = llm.tokenize(text)
    assert ids[0] == llm.config.bos_id or llm.config.bos_id < 0
    assert llm.detokenize(llm.tokenize(text, add_bos=False)) == text


def test_bad_arguments(llm):
    with pytest.raises(PycalmError, match="longer than the context"):
        llm.generate("word " * 600, max_tokens=1)
    with pytest.raises(PycalmError, match="stop strings"):
        llm.generate(PROMPT, stop=[""])
    with pytest.raises(PycalmError, match="device"):
        pycalm.load("smollm2", device="tpu")


def test_perplexity_equals_cli(llm, smollm2_fp16, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France.\n"
    path = tmp_path / "t.txt"
    path.write_text(text)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "pycalm.generate",
            str(smollm2_fp16),
            "-x",
            str(path),
            "--device",
            "cpu",
            "-c",
            "512",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    m = re.match(r"perplexity ([0-9.]+) over (\d+) tokens", cli.stdout)
    assert m, cli.stdout
    assert f"{llm.perplexity(text):.4f}" == m.group(1)
    assert int(m.group(2)) == len(llm.tokenize(text)) - 1


def test_readme_python_example(smollm2_gguf_path, tmp_path):
    """The README's Python example, run as written (SmolLM2 from a pre-filled cache folder, so
    nothing is downloaded; it is converted once, as for a new user)."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(b for b in blocks if "pycalm.load(" in b)
    cache = tmp_path / "cache" / "pycalm"
    cache.mkdir(parents=True)
    (cache / smollm2_gguf_path.name).symlink_to(smollm2_gguf_path)
    env = {**_env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_perplexity_of_a_long_text_equals_cli(tmp_path):
    """A text longer than the context: the API and the CLI's -x share one windowed evaluation."""
    from tiny_models import make_gguf

    from pycalm.convert.main import convert

    model = convert(make_gguf(tmp_path, qtype="F16").path, tmp_path / "tiny.pycalm", "fp16", progress=False)
    text = "the cat sat on the hat then the bat ate the rat " * 3
    path = tmp_path / "long.txt"
    path.write_text(text)
    cli = subprocess.run(
        [sys.executable, "-m", "pycalm.generate", str(model), "-x", str(path), "--device", "cpu", "-c", "16"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert cli.returncode == 0 and "windows of 16 tokens" in cli.stderr, cli.stderr
    small = pycalm.load(model, device="cpu", context=16, verbose=False)
    assert len(small.tokenize(text)) > 4 * 16
    assert cli.stdout.startswith(
        f"perplexity {small.perplexity(text):.4f} over {len(small.tokenize(text)) - 1} tokens"
    )
    # the KV cache holds the last window (from position 0): a prompt that starts with it reuses it
    from pycalm.app.perplexity import windows

    ids = small.tokenize(text)
    start, _, _ = windows(len(ids), 16)[-1]
    gen = small.generate(ids[start : start + 6], max_tokens=1, temperature=0, stream=True)
    "".join(gen)  # the counts are final once it is exhausted
    assert gen.reused_tokens == 5 and gen.completion_tokens == 1
