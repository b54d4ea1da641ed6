"""pycalm.cpu.reference, the CPU path: it runs without numba, and advance_ref's feed rule.

The forward pass itself is tested against independent NumPy forwards (test_moe, test_models)
and against transformers' logits (scripts/verify_transformers.py); each kernel test compares a
kernel with its reference here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from tiny_models import make_gguf

from pycalm.convert.main import convert
from pycalm.cpu.reference import advance_ref

REPO = Path(__file__).resolve().parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )


def test_cpu_engine_imports_no_numba() -> None:
    proc = _python(
        "import sys\n"
        "import pycalm.cpu.engine, pycalm.cpu.reference, pycalm.cpu.sampler\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_cli_on_the_cpu_imports_no_numba(tmp_path: Path) -> None:
    src = make_gguf(tmp_path, arch="llama", qtype="F16")
    model = convert(src.path, tmp_path / "tiny.pycalm", "fp16", progress=False)
    proc = _python(
        "import sys\n"
        "from pycalm.app.generate import main\n"
        f"rc = main([{str(model)!r}, '-i', 'ab', '-n', '3', '-t', '0', '--device', 'cpu'])\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
        "sys.exit(rc)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stderr, proc.stderr


def test_advance_ref_feeds_the_prompt_then_the_pick() -> None:
    feed = np.array([7, 8, 9, 0, 0], dtype=np.int32)  # a prompt of 3 tokens
    # inside the prompt the next step embeds the prompt's next token, whatever was sampled
    assert advance_ref(token=42, pos=0, feed_end=3, feed=feed) == (8, 1)
    assert advance_ref(token=42, pos=1, feed_end=3, feed=feed) == (9, 2)
    # from the prompt's last position on, the sampled token goes in
    assert advance_ref(token=42, pos=2, feed_end=3, feed=feed) == (42, 3)
    assert advance_ref(token=5, pos=3, feed_end=3, feed=feed) == (5, 4)
    # ... and is written at its position: feed holds every position's token
    assert feed.tolist() == [7, 8, 9, 42, 5]
    assert advance_ref(token=6, pos=4, feed_end=3, feed=feed) == (6, 5)  # the last position: no room
