"""The model cache: converted models and fetched GGUF files under one folder (cache_dir()).

    python -m pycalm.cache [list]                    every entry: model, format, size, source; the total
    python -m pycalm.cache clear [--older-than DAYS] remove every entry, or those unused for DAYS days

(`pycalm cache ...` is the same command.) The compiled kernels (the folder `kernels/`, see
pycalm.gpu.kernel_cache) are not entries: they are rebuilt on demand and are left alone here.

A conversion is keyed on the source's content, never its path, so a GGUF file or Hugging Face
folder that is copied, moved or renamed is not converted again: the key hashes the pycalm
version, the weight format, and for each source file its size, its first HEAD_BYTES (the GGUF
header with its tokenizer, or the safetensors header) and SAMPLES blocks of SAMPLE_BYTES spread
evenly over the rest (two models of one shape differ in every block of weights). Reading them
costs a few milliseconds even for a file of many gigabytes.

Entry files: `<source name>-<format>-<key>.pycalm`, and beside it `<same>.json` with where it was
last converted or found from (the source path) and the format; the JSON file's modification
time is when the entry was last used (a fetched GGUF's own modification time, likewise). A download or conversion under way writes a `*.tmp` name of
its own (the writer's pid in it) in the cache folder and renames it when complete; one that has
not been written to for STALE_TMP_S was left by a process killed hard, and is removed the next
time a model is resolved.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pycalm import __version__
from pycalm.app.fetch import KNOWN_MODELS
from pycalm.errors import OneLineParser, PycalmError
from pycalm.paths import cache_dir, make_folder, sweep_stale

HEAD_BYTES = 4 << 20  # the header of a GGUF file (its tokenizer vocabulary included) or safetensors file
SAMPLES = 64  # blocks of data hashed past the head
SAMPLE_BYTES = 64 << 10
KEY_CHARS = 16  # hex digits of the content hash in an entry's name


# ---------------------------------------------------------------------------------------------
# the content key


def _file_digest(path: Path, h: hashlib._Hash) -> None:
    """Feed `h` the file's size, its head and SAMPLES evenly spaced blocks of the rest."""
    size = path.stat().st_size
    h.update(f"{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        rest = size - HEAD_BYTES
        if rest <= 0:
            return
        for i in range(SAMPLES):  # the last block ends at the end of the file
            f.seek(HEAD_BYTES + max(0, (rest - SAMPLE_BYTES) * i // (SAMPLES - 1)))
            h.update(f.read(SAMPLE_BYTES))


def content_key(src: Path, dtype: str) -> str:
    """The cache key of converting `src` (a GGUF file or a Hugging Face folder) to `dtype`."""
    h = hashlib.sha256(f"pycalm {__version__} {dtype}\n".encode())
    try:
        if src.is_dir():  # every file of the folder, by its path inside it (hidden ones aside)
            for path in sorted(p for p in src.rglob("*") if p.is_file()):
                rel = path.relative_to(src)
                if not any(part.startswith(".") for part in rel.parts):
                    h.update(f"{rel.as_posix()}\n".encode())
                    _file_digest(path, h)
        else:
            _file_digest(src, h)
    except OSError as e:
        raise PycalmError(f"{src}: cannot read: {e.strerror}") from None
    return h.hexdigest()[:KEY_CHARS]


# ---------------------------------------------------------------------------------------------
# entries


@dataclass
class Entry:
    """One cached model file: a conversion (format: its weight format) or a fetched GGUF file."""

    path: Path
    model: str
    format: str
    source: str
    size: int
    last_used: float  # seconds since the epoch

    @property
    def sidecar(self) -> Path:
        return self.path.with_suffix(".json")


def _record(out: Path, src: Path, dtype: str, source: str | None = None) -> None:
    """Write (or refresh) an entry's JSON file: its source (the path of `src`, or `source` when
    given) and format, and now as its last use."""
    info = {"source": source or str(src.resolve()), "format": dtype, "pycalm": __version__}
    try:
        out.with_suffix(".json").write_text(json.dumps(info) + "\n")
    except OSError:  # the entry works without it; `list` then shows an unknown source
        pass


def entries(cache: Path) -> list[Entry]:
    """Every model file in the cache folder, oldest use first."""
    if not cache.is_dir():
        return []
    gguf_sources = {
        m.name: f"PyPI {', '.join(f'{p}=={v}' for p, v in m.wheels)}" for m in KNOWN_MODELS.values()
    }
    found = []
    for path in cache.iterdir():
        if not path.is_file() or path.suffix not in (".pycalm", ".gguf"):
            continue
        stat = path.stat()
        if path.suffix == ".gguf":
            found.append(
                Entry(path, path.stem, "gguf", gguf_sources.get(path.name, "?"), stat.st_size, stat.st_mtime)
            )
            continue
        parts = path.stem.rsplit("-", 2)  # <source name>-<format>-<key>
        model, fmt = (parts[0], parts[1]) if len(parts) == 3 else (path.stem, "?")
        source, last_used = "?", stat.st_mtime
        sidecar = path.with_suffix(".json")
        try:
            info = json.loads(sidecar.read_text())
            source, fmt = str(info.get("source", "?")), str(info.get("format", fmt))
            last_used = sidecar.stat().st_mtime
        except (OSError, ValueError, AttributeError):
            pass
        found.append(Entry(path, model, fmt, source, stat.st_size, last_used))
    return sorted(found, key=lambda e: e.last_used)


# ---------------------------------------------------------------------------------------------
# resolving a source to its conversion


def converted(
    src: Path,
    dtype: str,
    cache: Path,
    log: Callable[[str], None],
    name: str | None = None,
    source: str | None = None,
) -> Path:
    """The pycalm file of `src` (a GGUF file or Hugging Face folder) in `dtype`: from the cache
    when a conversion of the same content is there, else converted now. The source is read and
    checked (pycalm.convert.main.plan_conversion: header, architecture, tensors, tokenizer) before
    the conversion is announced. name: the entry's model name (default: the file or folder name);
    source: where it came from, for `pycalm cache list` (default: the path of `src`)."""
    from pycalm.convert.main import convert, plan_conversion

    make_folder(cache)
    sweep_stale(cache)
    key = content_key(src, dtype)
    hit = next(iter(sorted(cache.glob(f"*-{dtype}-{key}.pycalm"))), None)
    if hit is not None:
        _record(hit, src, dtype, source)
        return hit
    plan_conversion(src, dtype)  # raises on a bad source, before anything is said or written
    stem = name or (src.stem if src.suffix.lower() == ".gguf" else src.name)
    out = cache / f"{stem}-{dtype}-{key}.pycalm"
    log(f"pycalm: converting {name or src.name} to {dtype} (once; cached as {out})")
    convert(src, out, dtype, progress=sys.stderr.isatty())
    _record(out, src, dtype, source)
    return out


# ---------------------------------------------------------------------------------------------
# the command


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m pycalm.cache", description="List or clear the cached models.")
    ap.add_argument("action", nargs="?", choices=("list", "clear"), default="list", help="default: list")
    ap.add_argument(
        "--older-than", type=float, metavar="DAYS", help="clear: only entries unused for DAYS days"
    )
    ap.add_argument(
        "--cache-dir", help="the cache folder (default: $XDG_CACHE_HOME/pycalm or ~/.cache/pycalm)"
    )
    args = ap.parse_args(argv)
    if args.older_than is not None and (args.action != "clear" or not args.older_than >= 0):
        ap.error("--older-than takes a number of days >= 0, with clear")
    cache = cache_dir(args.cache_dir)
    try:
        found = entries(cache)
        if args.action == "list":
            for e in found:
                print(f"{e.model}\t{e.format}\t{_size(e.size)}\t{e.source}")
            total = sum(e.size for e in found)
            print(f"{len(found)} entries, {_size(total)} in {cache}", file=sys.stderr)
            return 0
        cutoff = time.time() - 86400 * (args.older_than or 0) if args.older_than is not None else None
        removed = [e for e in found if cutoff is None or e.last_used < cutoff]
        for e in removed:
            e.path.unlink(missing_ok=True)
            if e.path.suffix == ".pycalm":
                e.sidecar.unlink(missing_ok=True)
        sweep_stale(cache)
        freed = sum(e.size for e in removed)
        print(f"removed {len(removed)} entries, {_size(freed)} from {cache}", file=sys.stderr)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
