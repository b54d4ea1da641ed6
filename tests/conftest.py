"""Test session set-up.

Kernels run under numba's CUDA simulator unless PYCALM_TEST_GPU=1 (then the same tests run on
the real GPU). The simulator must be chosen before numba is first imported, so it is set here.
On a machine of several GPUs, PYCALM_TEST_GPUS=0,1,... gives each pytest-xdist worker one of
them in turn (CUDA_VISIBLE_DEVICES, set before CUDA starts).
"""

import os

if os.environ.get("PYCALM_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
elif os.environ.get("PYCALM_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _gpus = os.environ["PYCALM_TEST_GPUS"].split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_gpus)]


# ---------------------------------------------------------------------------------------------
# Real models converted once, shared by test_models.py and test_cli.py.
#
# A conversion is cached next to the fetched GGUF (tests/realmodels.py's cache folder) under a key
# made of the GGUF's sha256 and the sources of the modules that decide the file's bytes, so CI
# reruns reuse it while any change to the converter makes a fresh one (older ones are removed).

import hashlib  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# the packages whose code decides a converted file's bytes: the converters and the file format
_CONVERTER_PACKAGES = ("convert", "model")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def converted_model(gguf: Path, dtype: str) -> Path:
    """The pycalm file of `gguf` in `dtype`, converted on first use and cached between runs."""
    import realmodels

    from pycalm.convert.main import convert

    pkg = Path(__file__).resolve().parent.parent / "pycalm"
    sources = sorted(f for d in _CONVERTER_PACKAGES for f in (pkg / d).glob("*.py"))
    code = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()
    key = f"{_sha256(gguf)[:16]}-{code[:12]}"
    folder = realmodels.cache_dir() / "converted"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{gguf.stem}-{dtype}-{key}.pycalm"
    if out.exists():
        os.utime(out)  # mtime = last use, so a concurrent run's cleanup below leaves it alone
        return out
    # conversions by other converter versions, unused for an hour (a test run on older code may
    # still be reading a recent one: on a shared machine two checkouts can run at once)
    for old in folder.glob(f"{gguf.stem}-{dtype}-*.pycalm"):
        try:
            if time.time() - old.stat().st_mtime > 3600:
                old.unlink()
        except FileNotFoundError:  # another xdist worker removed it first
            pass
    convert(gguf, out, dtype, progress=False)  # written under a per-process name, then renamed
    return out


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    import realmodels

    return realmodels.smollm2_gguf()


@pytest.fixture(scope="session")
def qwen2_gguf_path() -> Path:
    import realmodels

    return realmodels.qwen2_gguf()


@pytest.fixture(scope="session")
def smollm2_fp16(smollm2_gguf_path: Path) -> Path:
    return converted_model(smollm2_gguf_path, "fp16")


@pytest.fixture(scope="session")
def smollm2_fp8(smollm2_gguf_path: Path) -> Path:
    return converted_model(smollm2_gguf_path, "fp8")


@pytest.fixture(scope="session")
def smollm2_gf4(smollm2_gguf_path: Path) -> Path:
    return converted_model(smollm2_gguf_path, "gf4")


@pytest.fixture(scope="session")
def qwen2_fp16(qwen2_gguf_path: Path) -> Path:
    return converted_model(qwen2_gguf_path, "fp16")
