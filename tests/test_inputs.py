"""Bad and awkward inputs, met where a user meets them: `python -m pycalm.generate` and
`python -m pycalm.convert` run as processes. A bad input ends in exactly one 'error: ...' line
naming the problem and a non-zero exit, never a traceback; an input that runs but not as asked
(a --dtype that does not apply, a context too short) says so in one 'pycalm: ...' line.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_cli import TIMINGS, assert_one_error_line, run
from tiny_models import make_gguf

from pycalm.app.generate import ScoreProgress
from pycalm.app.perplexity import mean_nll, windows
from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.model.loader import open_model
from pycalm.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return make_gguf(tmp_path_factory.mktemp("gguf"), arch="llama", qtype="F16").path


@pytest.fixture(scope="module")
def tiny(tiny_gguf, tmp_path_factory) -> Path:
    """A tiny random Llama (byte-level BPE, 64 tokens) as a pycalm file."""
    return convert(tiny_gguf, tmp_path_factory.mktemp("tiny") / "tiny.pycalm", "fp16", progress=False)


def with_config(model: Path, out: Path, **changes: object) -> Path:
    """A copy of pycalm file `model` whose config metadata has `changes` (the header rewritten,
    the tensor bytes as they are: offsets count from the header's end)."""
    data = model.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    cfg = json.loads(header["__metadata__"]["pycalm.config"])
    cfg.update(changes)
    header["__metadata__"]["pycalm.config"] = json.dumps(cfg)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    return out


# ---------------------------------------------------------------------------------------------
# numeric options: checked before anything is fetched, converted or loaded


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("-s", "-5", "--seed"),
        ("-k", "-3", "--top-k"),
        ("-n", "-1", "--steps"),
        ("-c", "1", "--context"),
        ("-t", "nan", "--temperature"),
        ("-t", "-1", "--temperature"),
        ("-p", "0", "--top-p"),
        ("-m", "1.5", "--min-p"),
    ],
)
def test_numeric_option_checked_before_the_model(tmp_path, flag, value, named):
    # the model does not exist: the option's error, not "model not found", shows it is checked first
    proc = run(tmp_path / "absent.pycalm", "-i", "x", flag, value)
    line = assert_one_error_line(proc, named, value, code=2)
    assert "not found" not in line


# ---------------------------------------------------------------------------------------------
# output folders that cannot be written


def test_convert_into_a_folder_that_cannot_be_made(tiny_gguf, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    line = assert_one_error_line(
        run(tiny_gguf, blocker / "sub" / "o.pycalm", "--quiet", module="pycalm.convert"), "cannot write"
    )
    assert "o.pycalm" in line and "a file is in the way" in line
    # generate with the same cache folder: the same one line
    proc = run(tiny_gguf, "-i", "x", "--device", "cpu", "--cache-dir", blocker / "cache")
    assert_one_error_line(proc, "cannot make the cache folder", "a-file", "a file is in the way")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_convert_into_a_read_only_folder(tiny_gguf, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        proc = run(tiny_gguf, folder / "o.pycalm", "--quiet", module="pycalm.convert")
        assert_one_error_line(proc, "cannot write", "Permission denied")
    finally:
        folder.chmod(0o700)


# ---------------------------------------------------------------------------------------------
# files recognised by their contents


@pytest.mark.parametrize("name", ["smol.GGUF", "model-without-extension"])
def test_gguf_recognised_by_its_magic(tiny_gguf, tiny, tmp_path, name):
    src = tmp_path / name
    shutil.copyfile(tiny_gguf, src)
    proc = run(src, "-i", "the cat", "-n", "4", "-t", "0", "--device", "cpu", "--cache-dir", tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"pycalm: converting {name} to fp16")
    assert proc.stdout == run(tiny, "-i", "the cat", "-n", "4", "-t", "0", "--device", "cpu").stdout
    out = tmp_path / "o.pycalm"
    assert run(src, out, "--quiet", module="pycalm.convert").returncode == 0
    assert open_model(out).config.n_layers == 2


def test_pycalm_file_recognised_by_its_header(tiny, tmp_path):
    renamed = tmp_path / "weights.gguf"  # a pycalm file whatever its name
    shutil.copyfile(tiny, renamed)
    proc = run(renamed, "-i", "the cat", "-n", "3", "-t", "0", "--device", "cpu", "--cache-dir", tmp_path)
    assert proc.returncode == 0 and "converting" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "content",
    [b"hello, this is a text file\n", bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8))],
    ids=["text", "random"],
)
def test_not_a_model_named_gguf_is_refused_before_any_notice(tmp_path, content):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(content)
    proc = run(bad, "-i", "x", "--device", "cpu", "--cache-dir", tmp_path / "c")
    assert_one_error_line(proc, "x.gguf", "not a pycalm model file, GGUF file or Hugging Face model folder")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_bad_gguf_is_refused_before_any_notice(tmp_path):
    src = make_gguf(tmp_path, arch="gpt2")  # a good GGUF of an architecture pycalm does not run
    proc = run(src.path, "-i", "x", "--device", "cpu", "--cache-dir", tmp_path / "c")
    assert_one_error_line(proc, "gpt2", "architecture")
    cut = tmp_path / "cut.gguf"  # the GGUF magic, then the file ends
    cut.write_bytes(src.path.read_bytes()[:200])
    assert_one_error_line(run(cut, "-i", "x", "--device", "cpu", "--cache-dir", tmp_path / "c"), "cut.gguf")


def test_truncated_pycalm_file_gets_the_loaders_message(tiny, tmp_path):
    data = tiny.read_bytes()
    bad = tmp_path / "truncated.pycalm"
    bad.write_bytes(data[: len(data) // 2])
    line = assert_one_error_line(run(bad, "-i", "x", "--device", "cpu"), "truncated.pycalm")
    m = re.search(r"truncated: tensor '[\w.]+' ends at byte (\d+) but the file has (\d+)", line)
    assert m and int(m.group(1)) > int(m.group(2)) == len(data) // 2, line


# ---------------------------------------------------------------------------------------------
# options that do not apply, and the end of the context


def test_dtype_with_a_pycalm_file_runs_its_own_format(tiny):
    proc = run(tiny, "-i", "the", "-n", "3", "-t", "0", "--dtype", "gf4", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    notice, timing = proc.stderr.strip().splitlines()
    assert notice.startswith("pycalm: tiny.pycalm is a pycalm file in fp16; --dtype gf4 applies"), notice
    assert TIMINGS.fullmatch(timing)
    assert proc.stdout == run(tiny, "-i", "the", "-n", "3", "-t", "0", "--device", "cpu").stdout
    same = run(tiny, "-i", "the", "-n", "1", "--dtype", "fp16", "--device", "cpu")  # its own: no notice
    assert len(same.stderr.strip().splitlines()) == 1, same.stderr


def test_steps_past_the_context_say_so(tiny, tmp_path):
    never_ends = with_config(tiny, tmp_path / "no-eos.pycalm", eos_ids=[])
    proc = run(never_ends, "-i", "the", "-n", "50", "-c", "8", "-t", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    notice, timing = proc.stderr.strip().splitlines()
    # "the" is 3 tokens with the BOS: 6 fit after them, the first sampled at position 2
    assert (
        notice
        == "pycalm: stopped at the end of the context (8 tokens, -c) after 6 of the 50 tokens asked for"
    )
    assert "decode 6 tokens" in timing
    fits = run(never_ends, "-i", "the", "-n", "6", "-c", "8", "-t", "0", "--device", "cpu")
    assert len(fits.stderr.strip().splitlines()) == 1, fits.stderr  # asked for what fits: no notice


def test_immediate_eos_prints_no_nan(tiny, tmp_path):
    always_ends = with_config(tiny, tmp_path / "all-eos.pycalm", eos_ids=list(range(64)))
    proc = run(always_ends, "-i", "the cat", "-n", "5", "-t", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "\n"
    m = TIMINGS.fullmatch(proc.stderr.strip())
    assert m and m.group(7) == "1" and m.group(8) is None, proc.stderr  # one token (the EOS), no rate
    assert "nan" not in proc.stderr and "inf" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# perplexity of a text longer than the context


def test_windows_score_every_token_once_with_half_a_window_of_context():
    for n_tokens in range(2, 60):
        for window in (2, 3, 8, 9, 16, 64):
            scored = []
            for start, end, first in windows(n_tokens, window):
                assert 0 < end - start <= window and first >= 1
                scored += range(start + first, end)
                if n_tokens > window:
                    assert first >= window // 2 or start == 0
            assert scored == list(range(1, n_tokens)), (n_tokens, window)


def _nll_ref(model, ids: list[int], window: int) -> float:
    """The windowed mean NLL, spelled out: each window a fresh CPU engine from position 0, a
    token step a position, log-softmax in float64; tokens past the first half scored."""
    total, count, start = 0.0, 0, 0
    while True:
        chunk = ids[start : start + window]
        engine = CpuEngine(model, seq_len=window)
        for pos in range(len(chunk) - 1):
            logits = engine.logits(chunk[pos], pos).astype(np.float64)
            if start == 0 or pos + 1 >= window // 2:
                lse = logits.max() + math.log(np.exp(logits - logits.max()).sum())
                total += lse - logits[chunk[pos + 1]]
                count += 1
        if start + window >= len(ids):
            return total / count
        start += window - window // 2


class BlockEngine:
    """The CPU engine's token step behind the multi-token forward's interface: prefill_logits
    yields the logits of every position in blocks of 3 rows, as the multi-token forward yields
    its chunks."""

    def __init__(self, engine: CpuEngine) -> None:
        self.engine, self.seq_len = engine, engine.seq_len

    def prefill_logits(self, ids, start_pos):
        rows = [self.engine.logits(t, start_pos + i) for i, t in enumerate(ids)]
        for r in range(0, len(rows), 3):
            yield np.stack(rows[r : r + 3])


def test_perplexity_of_a_long_text_in_windows(tiny, tmp_path):
    text = "the cat sat on the hat then the bat ate the rat " * 3
    model = open_model(tiny)
    cfg = model.config
    tok = Tokenizer.from_blob(model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, "")
    ids = tok.encode(text, add_bos=True)
    window = 16
    assert len(ids) > 4 * window
    want = _nll_ref(model, ids, window)
    # token steps behind the interface of blocks of rows agree with it; the CPU engine's own
    # multi-token forward to its float32 sums through an fp16 KV cache (tests/test_cpu_rows.py)
    assert mean_nll(BlockEngine(CpuEngine(model, seq_len=window)), ids) == pytest.approx(want, rel=1e-9)
    assert mean_nll(CpuEngine(model, seq_len=window), ids) == pytest.approx(want, rel=1e-6)
    path = tmp_path / "long.txt"
    path.write_text(text)
    proc = run(tiny, "-x", path, "-c", window, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    n_windows = len(windows(len(ids), window))
    assert proc.stderr == (
        f"pycalm: the text is {len(ids)} tokens, longer than the context of {window}: evaluated in "
        f"{n_windows} windows of {window} tokens, each scoring the tokens past its first 8 (every token "
        "scored once, after 8 tokens of context at least)\n"
    )
    m = re.fullmatch(r"perplexity ([0-9.]+) over (\d+) tokens \([0-9.]+ tok/s, cpu\)\n", proc.stdout)
    assert m and int(m.group(2)) == len(ids) - 1, proc.stdout
    assert float(m.group(1)) == pytest.approx(math.exp(want), rel=1e-4)


def test_perplexity_progress_on_a_terminal(capsys):
    bar = ScoreProgress(200, enabled=True)
    bar.update(100, 100 * math.log(5.0))
    bar.update(200, 200 * math.log(4.0))
    bar.finish()
    err = capsys.readouterr().err
    assert "100/200 tokens, ppl 5.0000" in err and "200/200 tokens, ppl 4.0000" in err
    assert err.endswith("\n") and "\r" in err
    quiet = ScoreProgress(200, enabled=False)
    quiet.update(200, 1.0)
    quiet.finish()
    assert capsys.readouterr().err == ""


def test_gpu_engine_perplexity_in_windows(tmp_path):
    """The GPU engine (the simulator here) evaluates a text longer than its context in the same
    windows, each through its multi-token forward (prefill_logits); within 0.5% of the CPU's."""
    from tiny_models import make_hf_llama

    from pycalm.gpu.engine import GpuEngine

    hf = make_hf_llama(tmp_path, dim=32, hidden_dim=48, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16)
    model = open_model(convert(hf.path, tmp_path / "m.pycalm", "fp16", progress=False))
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 64, 12)]
    gpu = GpuEngine(model, seq_len=8, kv_dtype="fp16")
    assert gpu.multi_token and len(windows(len(ids), 8)) == 2
    got, want = mean_nll(gpu, ids), mean_nll(CpuEngine(model, seq_len=8, kv_dtype="fp16"), ids)
    assert math.isfinite(want) and abs(math.exp(got) / math.exp(want) - 1) < 5e-3
