"""The command lines, run as a user runs them: `python -m pycalm.generate` / `python -m pycalm.convert`.

Each test starts a real process, so what is checked is what a user sees: stdout holds only the
generated text, stderr the notices and the tok/s line, and bad input ends in exactly one
'error: ...' line and a non-zero exit code, never a traceback.

The processes run without numba's CUDA simulator (conftest.py turns it on for this process), as
on a CPU-only machine: `--device auto` must then fall back to the CPU with a one-line notice.
Tiny random models (tests/tiny_models.py) cover behaviour; the real SmolLM2 (fp16, from
conftest's cache) covers the text itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_models import make_gguf, make_hf_llama

from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.sampler import SamplingParams
from pycalm.model.loader import open_model
from pycalm.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
TOK_S = re.compile(r"\d+(\.\d+)? tok/s")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(*args: str, module: str = "pycalm.generate", stdin: str = "", timeout: float = 300):
    """Run `python -m module args...`; returns the CompletedProcess (text mode)."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=timeout,
    )


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str, code: int | None = None) -> str:
    """The process failed with one 'error: ...' line on stderr holding every fragment, no traceback."""
    assert proc.returncode != 0, proc
    if code is not None:
        assert proc.returncode == code, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip("\n").splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny random Llama (byte-level BPE, 64 tokens) as a pycalm file."""
    tmp = tmp_path_factory.mktemp("tiny")
    src = make_gguf(tmp, arch="llama", qtype="F16")
    return convert(src.path, tmp / "tiny.pycalm", "fp16", progress=False)


# ---------------------------------------------------------------------------------------------
# prompt mode


def test_prompt_streams_only_the_continuation(smollm2_fp16):
    proc = run(smollm2_fp16, "-i", "The capital of France is", "-n", "4", "-t", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    # transformers' first 4 greedy ids are " Paris", ".", "\n", "\n"; then the closing newline
    assert proc.stdout == " Paris.\n\n\n"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and TOK_S.search(lines[0]), proc.stderr
    assert "prompt 5 tokens" in lines[0] and "decode 4 tokens" in lines[0], proc.stderr


def test_greedy_is_deterministic(tiny):
    a = run(tiny, "-i", "the cat", "-n", "12", "-t", "0", "--device", "cpu")
    b = run(tiny, "-i", "the cat", "-n", "12", "-t", "0", "-s", "99", "--device", "cpu")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_batch_invariant_flag_on_the_cpu_engine(tiny):
    """--batch-invariant is accepted everywhere; the CPU engine feeds every token alone anyway,
    so the tokens are those of a run without it (the GPU engine's mode: tests/test_prefill.py)."""
    a = run(tiny, "-i", "the cat", "-n", "6", "-t", "0", "--device", "cpu")
    b = run(tiny, "-i", "the cat", "-n", "6", "-t", "0", "--device", "cpu", "--batch-invariant")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert b.stdout == a.stdout and a.stdout.strip()


def test_seeded_sampling(tiny):
    def sample(seed: int) -> str:
        p = run(tiny, "-i", "the", "-n", "16", "-t", "0.8", "-p", "1", "-s", seed, "--device", "cpu")
        assert p.returncode == 0, p.stderr
        return p.stdout

    first = sample(1)
    assert sample(1) == first  # same seed, same text
    others = {sample(s) for s in (2, 3, 4)}
    assert others - {first}  # another seed gives another text (random weights: near-flat logits)


def test_penalties_and_logit_bias(tiny):
    """--presence-penalty, --frequency-penalty, --repeat-penalty and -l/--logit-bias (llama.cpp's
    TOKEN_ID+BIAS) give the Python API's text for the same options; a malformed bias is one
    error line before anything loads."""
    from pycalm.app.api import load

    flags = [
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "1",
        "--repeat-penalty",
        "2",
        "-l",
        "40+3",
        "-l",
        "41-100",
    ]
    p = run(tiny, "-i", "the cat", "-n", "8", "-t", "0", "--device", "cpu", *flags)
    assert p.returncode == 0, p.stderr
    llm = load(str(tiny), device="cpu", verbose=False)
    options = dict(
        presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=2.0, logit_bias={40: 3, 41: -100}
    )
    want = llm.generate("the cat", max_tokens=8, temperature=0, **options)
    assert p.stdout == want + "\n" and want != llm.generate("the cat", max_tokens=8, temperature=0)
    assert_one_error_line(run(tiny, "-i", "x", "-l", "40*3"), "--logit-bias 40*3", code=2)


def test_long_flags_equal_short_flags(tiny):
    a = run(
        tiny,
        "-i",
        "he",
        "-n",
        "8",
        "-t",
        "0.9",
        "-k",
        "5",
        "-m",
        "0.05",
        "-p",
        "0.8",
        "-s",
        "7",
        "--device",
        "cpu",
    )
    b = run(
        tiny,
        "--prompt",
        "he",
        "--steps",
        "8",
        "--temperature",
        "0.9",
        "--top-k",
        "5",
        "--min-p",
        "0.05",
        "--top-p",
        "0.8",
        "--seed",
        "7",
        "--device",
        "cpu",
    )
    assert a.returncode == 0 and b.returncode == 0
    assert a.stdout == b.stdout


def test_device_auto_falls_back_with_one_notice(tiny):
    proc = run(tiny, "-i", "the", "-n", "3", "-t", "0", "--device", "auto")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert "CPU" in lines[0] and "GPU" in lines[0]  # the notice: why, and what runs instead
    assert TOK_S.search(lines[1]) and "(cpu)" in lines[1]
    assert proc.stdout == run(tiny, "-i", "the", "-n", "3", "-t", "0", "--device", "cpu").stdout


TIMINGS = re.compile(
    r"pycalm \((cpu|gpu)\): load [0-9.]+ s(, [0-9.]+ GB/s)? \| compile (none|[0-9.]+ s \((cache hit|\d+ kernels compiled)\))"
    r" \| prompt (\d+) tokens, [0-9.]+ s(, [0-9.]+ tok/s)? \| decode (\d+) tokens, [0-9.]+ s(, [0-9.]+ tok/s)?"
)


@pytest.mark.parametrize("steps", [6, 1, 0])
def test_timing_line(tiny, steps):
    """One line at the end says where the time went; no rate where there is nothing to divide
    (one token: no decode interval; -n 0: no token at all), so never nan."""
    proc = run(tiny, "-i", "the cat", "-n", steps, "-t", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    m = TIMINGS.fullmatch(last)
    assert m, last
    assert "nan" not in last and "inf" not in last
    assert m.group(1) == "cpu" and m.group(3) == "none"  # the CPU engine compiles nothing
    model = open_model(tiny)
    cfg = model.config
    tok = Tokenizer.from_blob(model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, "")
    assert int(m.group(5)) == len(tok.encode("the cat", add_bos=True))
    # the tiny model may sample its EOS early: the decode count is what was generated
    generated = int(m.group(7))
    assert 1 <= generated <= steps if steps else generated == 0
    assert (m.group(6) is not None) == (generated > 0)  # a prompt rate once a token came
    assert (m.group(8) is not None) == (generated > 1)  # a decode rate once there are two


def _gpu_present() -> bool:
    probe = "from pycalm.gpu.engine import gpu_unavailable_reason as r; print(r() is None)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), cwd=REPO)
    return out.stdout.strip() == "True"


def test_device_gpu_without_gpu_is_one_error(tiny):
    if _gpu_present():
        pytest.skip("a CUDA GPU is present: --device gpu is valid here (tested by the GPU tests)")
    proc = run(tiny, "-i", "the", "-n", "3", "--device", "gpu")
    assert_one_error_line(proc, "--device gpu")
    assert proc.stdout == ""


# ---------------------------------------------------------------------------------------------
# chat and perplexity modes


def test_chat_two_turns(smollm2_fp16):
    turns = ["What is the capital of France?", "And what is the capital of Germany?"]
    proc = run(
        smollm2_fp16, "-y", "", "-n", "24", "-t", "0", "--device", "cpu", stdin="\n".join(turns) + "\n"
    )
    assert proc.returncode == 0, proc.stderr
    first = "The capital of France is Paris."  # transformers' greedy reply (golden_smollm2.json)
    assert proc.stdout.startswith(first + "\n"), proc.stdout
    # The second reply reuses the KV cache of the first turn; it must equal a fresh greedy run on
    # the whole conversation, rendered with the model's own template.
    model = open_model(smollm2_fp16)
    cfg = model.config
    tok = Tokenizer.from_blob(
        model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
    )
    messages = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": turns[1]},
    ]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)
    engine = CpuEngine(model, seq_len=256)
    reply = [t for t in engine.generate(ids, 0, 24, SamplingParams(temperature=0.0)) if t not in cfg.eos_ids]
    second = tok.decode(reply)
    assert "Berlin" in second
    assert proc.stdout == f"{first}\n{second}\n"


def test_perplexity_mode(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the hat then the bat ate the rat\n")
    proc = run(tiny, "-x", text, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    m = re.fullmatch(r"perplexity ([0-9.]+) over (\d+) tokens \([0-9.]+ tok/s, cpu\)\n", proc.stdout)
    assert m, proc.stdout
    ppl = float(m.group(1))
    assert 1 < ppl < 1e4 and np.isfinite(ppl)
    assert int(m.group(2)) >= 10


# ---------------------------------------------------------------------------------------------
# model resolution


def test_default_model_from_cache(smollm2_gguf_path, tmp_path):
    """No MODEL: SmolLM2 from the cache folder (pre-filled, so nothing is downloaded), converted once."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smollm2_gguf_path.name).symlink_to(smollm2_gguf_path)
    args = ("-i", "The capital of France is", "-n", "2", "-t", "0", "--device", "cpu", "--cache-dir", cache)
    first = run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == " Paris.\n"
    assert "converting" in first.stderr and "fetching" not in first.stderr
    assert len(list(cache.glob("*.pycalm"))) == 1
    again = run(*args)
    assert again.returncode == 0 and again.stdout == " Paris.\n"
    assert "converting" not in again.stderr  # cached
    assert len(again.stderr.strip().splitlines()) == 1  # just the tok/s line


def test_gguf_and_hf_sources_convert_once(tmp_path):
    src = make_gguf(tmp_path, arch="qwen2", qtype="Q8_0")
    cache = tmp_path / "cache"
    proc = run(src.path, "-i", "the", "-n", "3", "-t", "0", "--device", "cpu", "--cache-dir", cache)
    assert proc.returncode == 0, proc.stderr
    assert "converting" in proc.stderr
    assert len(list(cache.glob("*.pycalm"))) == 1
    hf = make_hf_llama(tmp_path, arch="llama")
    proc = run(
        hf.path, "-i", "a b", "-n", "3", "-t", "0", "--dtype", "gf4", "--device", "cpu", "--cache-dir", cache
    )
    assert proc.returncode == 0, proc.stderr
    assert len(list(cache.glob("*gf4*.pycalm"))) == 1


def test_convert_cli(tmp_path):
    src = make_gguf(tmp_path, arch="llama", qtype="Q4_0")
    out = tmp_path / "m.pycalm"
    proc = run(src.path, out, "--dtype", "fp8", "--quiet", module="pycalm.convert")
    assert proc.returncode == 0, proc.stderr
    assert out.exists() and open_model(out).config.weight_dtype == "fp8"
    assert proc.stdout == ""
    *summary, wrote = proc.stderr.strip("\n").splitlines()  # how the matrices were made, then the file
    assert wrote.startswith(f"wrote {out} ") and "fp8" in wrote
    assert summary and all(re.fullmatch(r"\d+ matrices: .+", line) for line in summary), proc.stderr


# ---------------------------------------------------------------------------------------------
# bad input: one line, non-zero exit, no traceback


def test_missing_model(tmp_path):
    assert_one_error_line(run(tmp_path / "nope.pycalm", "-i", "x"), "not found", "nope.pycalm")


def test_truncated_model_file(tiny, tmp_path):
    data = tiny.read_bytes()
    bad = tmp_path / "truncated.pycalm"
    bad.write_bytes(data[: len(data) // 2])
    assert_one_error_line(run(bad, "-i", "x", "--device", "cpu"), "truncated.pycalm")


def test_corrupt_safetensors_header(tmp_path):
    bad = tmp_path / "corrupt.safetensors"
    header = b'{"__metadata__": {"pycalm.config": '  # cut short: not JSON
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    assert_one_error_line(run(bad, "-i", "x", "--device", "cpu"), "corrupt.safetensors")
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    assert_one_error_line(run(huge, "-i", "x", "--device", "cpu"), "huge.safetensors")


def test_not_a_model(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    assert_one_error_line(run(bad, "-i", "x"), "notes.txt")


@pytest.mark.parametrize("module", ["pycalm.convert", "pycalm.generate"])
def test_gguf_unsupported_arch(tmp_path, module):
    src = make_gguf(tmp_path, arch="gpt2")
    args = (
        (src.path, tmp_path / "o.pycalm")
        if module == "pycalm.convert"
        else (src.path, "-i", "x", "--cache-dir", tmp_path)
    )
    line = assert_one_error_line(run(*args, module=module))  # the source is checked before any notice
    assert "gpt2" in line and "architecture" in line


def test_gguf_unsupported_tensor_type(tmp_path):
    src = make_gguf(tmp_path, raw_types={"blk.1.ffn_up.weight": "Q2_K"}, dim=256, hidden_dim=256)
    line = assert_one_error_line(run(src.path, tmp_path / "o.pycalm", module="pycalm.convert"))
    assert "Q2_K" in line and "blk.1.ffn_up.weight" in line
    assert not (tmp_path / "o.pycalm").exists() and not list(tmp_path.glob("o.pycalm*"))


def test_hf_unsupported_arch(tmp_path):
    hf = make_hf_llama(tmp_path)
    cfg = json.loads((hf.path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (hf.path / "config.json").write_text(json.dumps(cfg))
    line = assert_one_error_line(run(hf.path, tmp_path / "o.pycalm", module="pycalm.convert"))
    assert "GPT2LMHeadModel" in line
    line = assert_one_error_line(run(hf.path, "-i", "x", "--cache-dir", tmp_path / "c"))
    assert "GPT2LMHeadModel" in line


def test_prompt_longer_than_context(tiny):
    proc = run(tiny, "-i", "the cat sat on the mat " * 4, "-c", "8", "--device", "cpu")
    assert_one_error_line(proc, "context")
    assert proc.stdout == ""


def test_perplexity_file_missing_or_not_text(tiny, tmp_path):
    assert_one_error_line(run(tiny, "-x", tmp_path / "missing.txt", "--device", "cpu"), "missing.txt")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ab\x90\xff" * 10)
    assert_one_error_line(run(tiny, "-x", binary, "--device", "cpu"), "binary.txt", "UTF-8")


def test_empty_prompt_without_bos(tmp_path):
    # a model whose tokenizer adds no BOS has nothing to start an empty prompt from
    src = make_gguf(tmp_path, add_bos=False)
    model = convert(src.path, tmp_path / "nobos.pycalm", "fp16", progress=False)
    assert_one_error_line(run(model, "-n", "3", "--device", "cpu"), "empty prompt", "-i")


@pytest.mark.parametrize(
    "module",
    [
        "pycalm.convert",
        "pycalm.generate",
    ],
)
def test_bad_dtype_flag(tmp_path, module):
    args = ("a", "b", "--dtype", "int4") if module == "pycalm.convert" else ("--dtype", "int4")
    assert_one_error_line(run(*args, module=module), "int4", code=2)


def test_bad_flag_values(tiny):
    assert_one_error_line(run(tiny, "-i", "x", "-t", "-1"), "temperature", code=2)
    assert_one_error_line(run(tiny, "-i", "x", "-y", "sys"), "choose one", code=2)


def test_prompt_from_a_file_and_stop_strings(tiny, tmp_path):
    """-f FILE continues the file's text as -i does with the same text; --stop STR ends the text
    where STR first appears, STR not printed (the stop strings are cut from the greedy output
    itself, so each one does appear in it); a missing -f file or an empty --stop is one line."""
    args = (tiny, "-n", "24", "-t", "0", "--device", "cpu")
    full = run(*args, "-i", "hello world")
    assert full.returncode == 0, full.stderr
    text = full.stdout.rstrip("\n")
    assert len(text) >= 8, text
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello world", encoding="utf-8")
    assert run(*args, "-f", prompt).stdout == full.stdout
    for stop in (text[3:6], text[-3:], text[:2]):
        cut = run(*args, "-i", "hello world", "--stop", "never there", "--stop", stop)
        assert cut.returncode == 0, cut.stderr
        assert cut.stdout == text[: text.find(stop)] + "\n", (stop, cut.stdout)
    assert run(*args, "-i", "hello world", "--stop", "never there").stdout == full.stdout
    assert_one_error_line(run(*args, "-f", tmp_path / "missing.txt"), "prompt file not found")
    proc = run(*args, "-i", "hello world", "--stop", "")
    assert proc.returncode == 2 and "--stop: an empty stop string" in proc.stderr


def test_speculate_gives_plain_decodings_text(tiny):
    """--speculate ngram, and --draft-model (the model drafting for itself), on the CPU engine
    with --batch-invariant: the text of plain greedy decoding; a draft option alone is one error."""
    args = (tiny, "-i", "the cat the cat the", "-n", "24", "-t", "0", "--device", "cpu", "--batch-invariant")
    plain = run(*args)
    ngram = run(*args, "--speculate", "ngram")
    draft = run(*args, "--draft-model", tiny, "--draft-k", "3")
    for p in (plain, ngram, draft):
        assert p.returncode == 0, p.stderr
    assert ngram.stdout == plain.stdout == draft.stdout and plain.stdout.strip()
    assert_one_error_line(run(tiny, "--speculate", "draft", "-i", "x"), "--draft-model")
