"""Real compilation of every kernel in COMPILE_CHECK lists (sm_90), without a GPU.

Each pycalm.kernels module lists its kernels and numba signatures in COMPILE_CHECK. A
subprocess (the simulator must be off before numba is imported) compiles each with
cuda.compile_ptx and reports: a compile error (typing the simulator lets through), `.f64`
(an untyped literal made the arithmetic float64), or `ld.local` / `st.local` (an array spilled
to local memory). Modules are compiled in parallel, one subprocess each.
"""

import json
import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pycalm.kernels

MINE = {"common", "matvec", "qkv"}  # modules that must have COMPILE_CHECK entries (common: via users)

_SCRIPT = r"""
import importlib, json, sys
from numba import cuda
mod = importlib.import_module("pycalm.kernels." + sys.argv[1])
out = {"has": hasattr(mod, "COMPILE_CHECK"), "n": 0, "problems": []}
for kernel, sig in getattr(mod, "COMPILE_CHECK", []):
    fn = getattr(kernel, "py_func", kernel)
    try:
        ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    except Exception as e:  # noqa: BLE001
        out["problems"].append(f"{fn.__name__} {sig}: {type(e).__name__}: {str(e)[:300]}")
        continue
    out["n"] += 1
    if ".f64" in ptx:
        out["problems"].append(f"{fn.__name__} {sig}: float64 in PTX")
    if "ld.local" in ptx or "st.local" in ptx:
        out["problems"].append(f"{fn.__name__} {sig}: local-memory spill in PTX")
print("RESULT" + json.dumps(out))
"""


def _modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(pycalm.kernels.__path__) if not m.name.startswith("_")]


def _check(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT, name], capture_output=True, text=True, env=env, timeout=900
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert p.returncode == 0 and lines, f"{name}: import or compile crashed:\n{p.stderr[-2000:]}"
    return json.loads(lines[-1][len("RESULT") :])


def test_every_kernel_compiles_without_f64_or_spills():
    names = _modules()
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = dict(zip(names, pool.map(_check, names), strict=True))
    problems = [f"{name}: {p}" for name, r in results.items() for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for name in ("matvec", "qkv"):
        assert results[name]["has"] and results[name]["n"] > 0, f"{name} has no COMPILE_CHECK entries"
    assert MINE <= set(names)
