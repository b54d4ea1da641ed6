"""Real compilation of every kernel the compile_check functions list (sm_90), without a GPU.

Each pycalm.kernels module lists its kernels and numba signatures in compile_check(). Worker
subprocesses (the simulator must be off before numba is imported) compile them with
cuda.compile_ptx and report: a compile error (typing the simulator lets through), `.f64` (an
untyped literal made the arithmetic float64), or `ld.local` / `st.local` (an array spilled to
local memory).

Each PTX then goes through ptxas (the NVVM wheel's own, sm_90) for what only the machine code
shows: any spill to local memory, and a register count above the kernel's limit: the third
item of its compile_check entry where there is one (pycalm.kernels.sample and argmax: what a
block of its launch's threads can have at all), else the module's MAX_REGISTERS
(pycalm.kernels.attention: two blocks of the shipped 256 threads an SM; a restructured kernel
at 154-188 registers once ran at one block an SM, up to 1.8x slower at long context, while the
PTX looked clean; pycalm.kernels.matvec: a block of 16 warps, which the q8 / q4 staging once
exceeded, and the launch failed).

Every listed kernel must also contain griddepcontrol.wait and griddepcontrol.launch_dependents
(pycalm.kernels.common.dependent_start): in a graph with programmatic edges a kernel without the
wait could read what the kernel before it has not finished writing.

They also compile small kernels around the bit-level decoders and encoders of
pycalm.kernels.common and require 32-bit integer PTX: real numba computes int32 op int32 in
int64, so an unwrapped shift compiles to shl.b64 / shr.s64 (wrong bits, and twice the
instructions) while the simulator, with NumPy's int32 rules, passes.

Compiling is the cost (a few seconds a kernel): every distinct (kernel, signature) is compiled
once, the list split over as many worker processes as there are cores.
"""

import json
import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module

import pycalm.kernels

# modules that must have compile_check entries (common and tensorcore: via the kernels that use them)
MINE = {"common", "matvec", "qkv", "moe", "matmul", "tensorcore", "prefill_attention", "rows"}

_SCRIPT = r"""
import importlib, json, os, re, shutil, subprocess, sys, tempfile
from numba import cuda, float32, int32
from pycalm.kernels import common as c

INT64 = re.compile(r"\b(shl|shr|and|or|xor)\.[bsu]64\b")
out = {"n": 0, "problems": [], "sass": 0}


def ptxas_path():
    try:
        import nvidia.cuda_nvcc as nvcc  # the wheel that brings NVVM also brings ptxas
        path = os.path.join(list(nvcc.__path__)[0], "bin", "ptxas")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return shutil.which("ptxas")


def sass_check(ptx, label, max_regs):
    # ptxas -v on the PTX: spills, and registers against max_regs (None: no limit)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_90", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", r.stderr)]
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    if r.returncode != 0 or not regs:
        out["problems"].append(f"{label}: ptxas failed: {r.stderr[-300:]}")
        return
    out["sass"] += 1
    if any(spills):
        out["problems"].append(f"{label}: ptxas spills {max(spills)} bytes to local memory")
    if max_regs is not None and max(regs) > max_regs:
        out["problems"].append(f"{label}: {max(regs)} registers a thread, above {max_regs}")


PTXAS = ptxas_path()


def ptx_of(fn, sig, label):
    try:
        # a kernel's launch bounds (cuda.jit(launch_bounds=...)) go into its PTX, as at run time
        bounds = getattr(fn, "targetoptions", {}).get("launch_bounds")
        ptx, _ = cuda.compile_ptx(getattr(fn, "py_func", fn), sig, cc=(9, 0), launch_bounds=bounds)
    except Exception as e:  # noqa: BLE001
        out["problems"].append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        return None
    out["n"] += 1
    if ".f64" in ptx:
        out["problems"].append(f"{label}: float64 in PTX")
    if "ld.local" in ptx or "st.local" in ptx:
        out["problems"].append(f"{label}: local-memory spill in PTX")
    return ptx


checks = {}  # module name -> its compile_check() list, built once a worker
for mod_name, index in json.loads(sys.argv[1]):
    module = importlib.import_module("pycalm.kernels." + mod_name)
    if mod_name not in checks:
        checks[mod_name] = module.compile_check()
    entry = checks[mod_name][index]
    kernel, sig = entry[:2]
    label = f"{mod_name}[{index}] {getattr(kernel, '__name__', '?')} {sig}"
    ptx = ptx_of(kernel, sig, label)
    if ptx is not None:
        if PTXAS is None:
            out["problems"].append("no ptxas (the nvidia-cuda-nvcc wheel's bin/ptxas, or on PATH)")
        else:
            max_regs = entry[2] if len(entry) > 2 else getattr(module, "MAX_REGISTERS", None)
            sass_check(ptx, label, max_regs)
    # every kernel of the token step may be a programmatic dependent (pycalm.gpu.graph)
    for inst in ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;"):
        if ptx is not None and inst not in ptx:
            out["problems"].append(f"{label}: no {inst} (a programmatic graph would race)")

if sys.argv[2] == "decoders":
    # scalar arguments and fixed output slots: no address arithmetic, so any 64-bit shift or
    # logic op in the PTX is the decoders' own data path
    def fp(w, out):
        f0, f1 = c.h2f2(w)
        out[0] = f0 + f1
        out[1] = c.fp8_byte_raw(w, 1)
        out[2] = c.fp8_decode(w)

    def fp8(w, out):
        g0, g1, g2, g3 = c.fp8x4_cvt(w)
        out[0] = g0 + g1 + g2 + g3

    def gf4(w, x, out):
        out[0] = c.gf4_dot8_raw(w, x, x, x, x, x, x, x, x)
        out[1] = c.gf4_decode(w, 6) + c.gf4_decode(w, 2) + c.gf4_scale(w)

    def enc(x, out):
        out[0] = c.fp8_encode(x)

    def q8q4(w, out):
        g0, g1, g2, g3 = c.q8x4(w)
        out[0] = g0 + g1 + g2 + g3
        out[1] = c.q4_code(w, 1) + c.q4_code(w, 6)

    for fn, sig in ((fp, "void(int32, float32[::1])"), (fp8, "void(int32, float32[::1])"),
                    (gf4, "void(int32, float32, float32[::1])"), (enc, "void(float32, int32[::1])"),
                    (q8q4, "void(int32, float32[::1])")):
        ptx = ptx_of(fn, sig, f"decoder kernel {fn.__name__}")
        if ptx is not None and INT64.search(ptx):
            ops = sorted(set(m.group(0) for m in INT64.finditer(ptx)))
            out["problems"].append(f"decoder kernel {fn.__name__}: 64-bit integer ops {ops} in PTX")
print("RESULT" + json.dumps(out))
"""


def _modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(pycalm.kernels.__path__) if not m.name.startswith("_")]


def _run(work: list, extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(work), extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert p.returncode == 0 and lines, f"compile worker crashed:\n{p.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT") :])


def test_every_kernel_compiles_without_f64_spills_or_64bit_decoders():
    # the entries, counted here under the simulator (same lists), each distinct one once
    names = _modules()
    work, seen, counts = [], set(), {}
    for name in names:
        entries = getattr(import_module("pycalm.kernels." + name), "compile_check", list)()
        counts[name] = len(entries)
        for i, (kernel, sig, *_) in enumerate(entries):
            key = (getattr(kernel, "py_func", kernel), sig)
            if key not in seen:
                seen.add(key)
                work.append((name, i))
    for name in ("matvec", "qkv", "moe", "matmul", "prefill_attention", "rows"):
        assert counts.get(name, 0) > 0, f"{name} has no compile_check entries"
    assert MINE <= set(names)
    n_workers = max(1, min(os.cpu_count() or 1, len(work)))
    shares = [work[k::n_workers] for k in range(n_workers)]  # round-robin: similar mixes
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        results = list(pool.map(_run, shares, ["decoders"] + ["none"] * (n_workers - 1)))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert sum(r["n"] for r in results) == len(work) + 5  # + the 5 decoder kernels
    assert sum(r["sass"] for r in results) == len(work)  # every listed kernel through ptxas
