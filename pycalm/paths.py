"""Where pycalm keeps its files: the cache folder (models, conversions, compiled kernels), made
on demand, and swept of what killed processes left half-written."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from pycalm.errors import PycalmError

STALE_TMP_S = 3600.0  # a temporary file not written to for an hour is left by a dead process


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """--cache-dir if given, else $XDG_CACHE_HOME/pycalm, else ~/.cache/pycalm."""
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pycalm"


def make_folder(cache: Path) -> None:
    """Make the cache folder (and those above it) or say in one line why it cannot be made."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise PycalmError(f"cannot make the cache folder {cache}: a file is in the way") from None
    except OSError as e:
        raise PycalmError(f"cannot make the cache folder {cache}: {e.strerror}") from None


def sweep_stale(cache: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary files (and the folders of older pycalm versions' downloads) that no
    process has written to for STALE_TMP_S: what a conversion or download killed hard left."""
    now = time.time() if now is None else now
    removed = []
    if not cache.is_dir():
        return removed
    for path in cache.iterdir():
        stale_file = path.name.endswith(".tmp") and path.is_file()
        stale_dir = path.name.startswith("tmp") and path.is_dir()
        try:
            if (stale_file or stale_dir) and now - path.stat().st_mtime > STALE_TMP_S:
                if stale_dir:
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed.append(path)
        except OSError:  # another process swept it first, or it is not ours to remove
            pass
    return removed
