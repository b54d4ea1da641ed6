"""Real compilation of every kernel the GPU engine launches (sm_90), without a GPU.

Which kernels, with which numba signatures, is not written down here: it is what GpuEngine
launches. Worker subprocesses (the simulator must be off before numba is imported) build the
engine of each config of MODELS, in each weight format and KV format, on stand-in weights, and
walk everything a run launches (pycalm.gpu.precompile_worker.walk_engine: the token step for
every attention span, greedy and sampled, the multi-token forward, and serve --parallel's
batched steps over a paged pool), recording each distinct
(kernel, argument types) as pycalm.gpu.precompile.Walk does for the precompile workers. There is
no GPU here, so the walk runs in `no_device()`: a stand-in CUDA context whose arrays are never
allocated and whose copies do nothing (numba types an array argument by its dtype, rank and
layout, so the signatures are those of a real run). A kernel reached by several configs (the same
closure and argument types) is compiled once.

Each worker compiles its share with cuda.compile_ptx and reports a compile error (typing the
simulator lets through), `.f64` (an untyped literal made the arithmetic float64) or `ld.local` /
`st.local` (an array spilled to local memory). Each PTX then goes through ptxas (the NVVM wheel's
own, sm_90) for what only the machine code shows: any spill to local memory, and a register
count above the kernel's limit: the MAX_REGISTERS of its module where it states one
(pycalm.kernels.attention: two blocks of 256 threads an SM; a restructured kernel at 154-188
registers once ran at one block an SM, up to 1.8x slower at long context, while the PTX looked
clean; pycalm.kernels.matvec: a block of 16 warps, which the q8 / q4 staging once exceeded, and
the launch failed), else what its launch bounds allow, else, for a kernel launched in blocks of a
fixed size, what one block of the largest launch the walk saw can have at all (64k registers an
SM; the row-group kernels choose their block size by occupancy, for the registers they have).

Every kernel must also contain griddepcontrol.wait and griddepcontrol.launch_dependents
(pycalm.kernels.common.dependent_start): in a graph with programmatic edges a kernel without the
wait could read what the kernel before it has not finished writing.

They also compile small kernels around the bit-level decoders and encoders of
pycalm.kernels.common and require 32-bit integer PTX: real numba computes int32 op int32 in
int64, so an unwrapped shift compiles to shl.b64 / shr.s64 (wrong bits, and twice the
instructions) while the simulator, with NumPy's int32 rules, passes.

Compiling is the cost (a few seconds a kernel): the walk takes seconds, and every worker walks
the same configs in the same order, then compiles every n-th kernel of the list (largest
estimated cost first, pycalm.gpu.precompile.schedule), n the number of workers (the cores).
Most of a compile is numba's Python front end, which pycalm.gpu.numba_patch (installed by the
engine's import) makes about twice as fast; test_numba_patch_changes_no_ptx compiles kernels
with and without its inliner copies and compares their PTX.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SEQ_LEN = 512  # the walked engines' context: a few attention spans
_SHAPE = dict(rope_theta=1e4, norm_eps=1e-5, bos_id=1, eos_ids=(2,), n_layers=1, max_seq_len=4096)
_FORMATS = ("fp16", "fp8", "gf4", "q8", "q4")
# the walked models: the head shapes, widths and features of the models in use, one layer each
# (nothing is allocated, so the widths are the real ones: they choose the kernels' loads and
# splits), each in every weight format it takes, with both KV formats
MODELS = {
    "smollm2-135m": (dict(arch="llama", dim=576, hidden_dim=1536, head_dim=64, n_heads=9, n_kv_heads=3,
                          vocab_size=49152, tied_embeddings=True), _FORMATS),
    "tinyllama-1.1b": (dict(arch="llama", dim=2048, hidden_dim=5632, head_dim=64, n_heads=32, n_kv_heads=4,
                            vocab_size=32000), _FORMATS),
    "llama3-8b": (dict(arch="llama", dim=4096, hidden_dim=14336, head_dim=128, n_heads=32, n_kv_heads=8,
                       vocab_size=128256), _FORMATS),
    "qwen2.5-0.5b": (dict(arch="qwen2", dim=896, hidden_dim=4864, head_dim=64, n_heads=14, n_kv_heads=2,
                          vocab_size=151936, qkv_bias=True, tied_embeddings=True), _FORMATS),
    "mistral-7b": (dict(arch="mistral", dim=4096, hidden_dim=14336, head_dim=128, n_heads=32, n_kv_heads=8,
                        vocab_size=32000, sliding_window=4096), _FORMATS),
    "mixtral-8x7b": (dict(arch="mixtral", dim=4096, hidden_dim=14336, head_dim=128, n_heads=32, n_kv_heads=8,
                          vocab_size=32000, n_experts=8, n_experts_active=2), _FORMATS),
    # a test-sized model: rows of 24 to 72 bytes take the narrow loads that only such shapes
    # launch (no q4: its groups of 32 columns do not divide 48)
    "tiny": (dict(arch="llama", dim=48, hidden_dim=72, head_dim=16, n_heads=3, n_kv_heads=1, vocab_size=64),
             ("fp16", "fp8", "gf4", "q8")),
}  # fmt: skip
# kernels allowed to spill, each measured faster than its spill-free neighbours: the arguments of
# their factory and the bytes ptxas may spill (any other spill, or more, fails). skinny's gf4 w2
# at 17 to 32 rows (K > LONG_K: blocks of 16 warps, 128 registers a thread) with two A tiles and
# X loaded ahead (skinny.X_AHEAD): 52 bytes, its step loop 56 instructions per 8 mma (66 with 20
# bytes spilled and X loaded where used); on an H100 (2026-12-05) two tiles took 32.8 us against
# 59.1 with one tile and 43.4 in blocks of 8, and X ahead cut the layer's products 166 -> 120 us
# Its FOLD form (the rows pass's w2 with the next RMSNorm folded in, skinny.NormFold; the plain
# form, NO_NORM, is the last layer's) spills 56 (ptxas, 2026-12-06), 4 bytes more; not yet timed.
# The panel's q4 kernels (64 rows, blocks of 16 warps, 128 registers a thread): 32 bytes plain
# and residual, 36 the gate (scaled or not), 24 the residual with the next norm folded in (gf4's:
# 12, 12, 4 and 8, its 64-row pass 7.75 ms against 10.02 on the split tile, H100; q8's fold 4, its
# 64-row pass 9.05 ms against 9.07 with none, H100s of 2026-12-07); on an H100 (2026-12-07) q4's
# layer's four products took 238 us against 279 in blocks of 8 warps of two tiles (254 registers,
# no spill) and 278 on the split tile; 186 since its (d, m) word is split where it is used.
# The prefill attention with fp16 KV, since its K/V staging by cp.async (two threads a key row,
# the row and its address found once a tile): at head_dim 128, group 4 (255 registers, 2 blocks
# an SM) 36 bytes, 44 in its paged form; at head_dim 64 (168 registers, 3 blocks) 28 in the
# paged forms (groups 3, 7, 8): values stored before the tile loop and loaded after it (at most
# one reload in a tile turn of 1,157-1,422 instructions: their machine code, 2026-12-07). The
# staging a unit at a time (registers between a load and its store) spilled 24 and 0 around a
# loop of 1,702 instructions, and a 2,048-row prompt's layer took 0.523 ms against 0.419 (fp16,
# H100, 2026-12-07). The splits' count and index wait in shared
# memory across the loop, without which the paged forms spilled 8-28 bytes more.
KNOWN_SPILLS = [
    (("pycalm.kernels.skinny", "make_skinny_kernel"), ("gf4", 1, 4, 16, 1, 0, 2, 64, 0), 52),
    (("pycalm.kernels.skinny", "make_skinny_kernel"), ("gf4", 1, 4, 16, 1, 0, 2, 64, 2), 56),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("q4", 0, 8, 16, 1, 3, 1, 1, 0), 32),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("q4", 1, 8, 16, 1, 3, 1, 1, 0), 32),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("q4", 2, 8, 16, 1, 3, 1, 1, 0), 36),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("q4", 2, 8, 16, 1, 3, 1, 1, 1), 36),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("q4", 1, 8, 16, 1, 3, 1, 1, 2), 24),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("q8", 1, 8, 16, 1, 3, 1, 1, 2), 4),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("gf4", 0, 8, 16, 1, 3, 1, 1, 0), 12),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("gf4", 1, 8, 16, 1, 3, 1, 1, 0), 12),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("gf4", 1, 8, 16, 1, 3, 1, 1, 2), 8),
    (("pycalm.kernels.panel", "make_panel_kernel"), ("gf4", 2, 8, 16, 1, 3, 1, 1, 1), 4),
    (("pycalm.kernels.prefill_attention", "prefill_attention_kernel"), (128, 4, "fp16", 4, 64, False, 2), 36),
    (("pycalm.kernels.prefill_attention", "prefill_attention_kernel"), (128, 4, "fp16", 4, 64, True, 2), 44),
    (("pycalm.kernels.prefill_attention", "prefill_attention_kernel"), (64, 3, "fp16", 4, 64, True, 2), 28),
    (("pycalm.kernels.prefill_attention", "prefill_attention_kernel"), (64, 7, "fp16", 4, 64, True, 2), 28),
    (("pycalm.kernels.prefill_attention", "prefill_attention_kernel"), (64, 8, "fp16", 4, 64, True, 2), 28),
]
# the kernel modules the walk must reach (a guard on MODELS, not a list of kernels)
FAMILIES = {"argmax", "attention", "embed", "finite", "matmul", "matvec", "moe",
            "moe_rows", "panel", "penalty", "prefill_attention", "qkv", "rows", "sample", "sample_wide",
            "step"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the walk, without a GPU (in a worker: the simulator off)


@contextlib.contextmanager
def no_device() -> Iterator[None]:
    """Within: numba's CUDA API works without a driver, on a stand-in context of an sm_90 device
    with 132 SMs. Device arrays are never allocated (each points at one fake address), copies to
    the device and memsets do nothing, copies to the host read zeros, streams and events do
    nothing, TMA maps are stand-ins. Only typing and recording may happen meanwhile (pycalm.gpu.precompile.Walk): a real
    launch or compile would fail."""
    import numpy as np
    from numba.cuda.cudadrv import devices, driver

    class Device:
        compute_capability = (9, 0)
        MULTIPROCESSOR_COUNT = 132
        name = b"stand-in sm_90"
        id = 0

    class Stream(driver.Stream):  # a launch takes a driver.Stream; handle None: the default one
        def __init__(self) -> None:
            self.handle, self.external = None, False

        def synchronize(self) -> None:
            pass

    class Event:
        def record(self, stream: object = 0) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

        def elapsed_time(self, other: object) -> float:
            return 0.0

    class Context:
        device = Device()

        def memalloc(self, size: int) -> object:
            return driver.MemoryPointer(self, driver.binding.CUdeviceptr(1 << 20), size)

        def memhostalloc(self, size: int, **kwargs: object) -> object:
            return np.zeros(size, np.uint8)

        def get_memory_info(self) -> tuple[int, int]:  # (free, total): the stand-ins take none
            return 1 << 60, 1 << 60

        def create_stream(self) -> Stream:
            return Stream()

        def get_default_stream(self) -> Stream:
            return Stream()

        def create_event(self, timing: bool = True) -> Event:
            return Event()

        def synchronize(self) -> None:
            pass

    context = Context()

    @contextlib.contextmanager
    def ensure_context() -> Iterator[None]:
        yield

    def nothing(*args: object, **kwargs: object) -> None:
        return None

    def to_host(dst: object, src: object, size: int, stream: object = 0) -> None:
        ctypes.memset(driver.host_pointer(dst), 0, size)

    def tma_map(array: object, box_rows: int, stream: object = 0) -> object:  # no driver to encode one
        from numba import cuda

        return cuda.device_array(16, np.uint64)  # (16,) the 128 bytes of a map

    from pycalm.kernels import wgmma_matmul

    runtime = devices._runtime
    saved = [
        (runtime, "ensure_context"),
        (runtime, "get_or_create_context"),
        (driver, "host_to_device"),
        (driver, "device_to_device"),
        (driver, "device_memset"),
        (driver, "device_to_host"),
        (driver.MemoryPointer, "memset"),
        (wgmma_matmul, "tma_map"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    replacement = {
        "ensure_context": ensure_context,
        "get_or_create_context": lambda devnum=None: context,
        "device_to_host": to_host,
        "tma_map": tma_map,
    }
    for owner, name, _ in saved:
        setattr(owner, name, replacement.get(name, nothing))
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def walk_configs() -> Iterator[tuple[object, str, str]]:
    """(config, weight format, KV format) for every walked engine, in a fixed order."""
    from pycalm.model.config import ModelConfig

    for shape, formats in MODELS.values():
        for weight_dtype in formats:
            for kv_dtype in ("fp16", "fp8"):
                cfg = ModelConfig(**_SHAPE, **shape, rotary_dim=shape["head_dim"], weight_dtype=weight_dtype)
                yield cfg, weight_dtype, kv_dtype


def launched_kernels() -> tuple[list, dict]:
    """Every distinct (kernel, argument types) the engines of walk_configs() launch (precompile
    Items, in schedule order), and for each kernel function whose blocks have a fixed size the
    most threads a block of its launches had. A launcher that asks for the compiled kernel
    before it launches (pycalm.kernels.launch.resident_blocks: the row-group kernels) sizes its
    blocks by the occupancy calculator, for the registers the kernel has: those kernels are left
    out (the walk's stand-in answers for every size). In a process with the simulator off; no
    GPU needed."""
    from numba.cuda.dispatcher import CUDADispatcher

    from pycalm.gpu.engine import EngineOptions
    from pycalm.gpu.precompile import Walk, engine_spec, kernel_function, schedule
    from pycalm.gpu.precompile_worker import walk_engine

    walk, threads, sized = Walk(), {}, set()
    options = EngineOptions(check_finite=True)  # the finite check is the engine's to launch too
    with walk.installed(CUDADispatcher), no_device():
        recording = CUDADispatcher.call, CUDADispatcher.compile

        def call(kernel: object, args: tuple, launch_config: object) -> None:
            fn = kernel_function(kernel)
            x, y, z = launch_config.blockdim
            threads[fn] = max(threads.get(fn, 0), x * y * z)
            recording[0](kernel, args, launch_config)

        def compile(kernel: object, sig: object) -> object:  # noqa: A001 - numba's name
            sized.add(kernel_function(kernel))
            return recording[1](kernel, sig)

        CUDADispatcher.call, CUDADispatcher.compile = call, compile
        try:
            for cfg, _, kv_dtype in walk_configs():
                walk_engine(engine_spec(cfg, SEQ_LEN, kv_dtype, options), walk)
        finally:
            CUDADispatcher.call, CUDADispatcher.compile = recording
    return schedule(walk.items), {fn: t for fn, t in threads.items() if fn not in sized}


# ---------------------------------------------------------------------------------------------
# a worker: walk, then compile its share


def _ptxas() -> str | None:
    try:
        import nvidia.cuda_nvcc as nvcc  # the wheel that brings NVVM also brings ptxas

        path = os.path.join(list(nvcc.__path__)[0], "bin", "ptxas")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return shutil.which("ptxas")


class _Checks:
    """PTX and ptxas checks, with the problems found (one line each)."""

    INT64 = re.compile(r"\b(shl|shr|and|or|xor)\.[bsu]64\b")

    def __init__(self) -> None:
        self.out = {"n": 0, "sass": 0, "problems": []}
        self.ptxas = _ptxas()

    def ptx_of(self, fn: object, sig: object, label: str, launch_bounds: object = None) -> str | None:
        from numba import cuda

        try:
            # (on a GPU of compute capability 9.0 numba compiles for the arch-specific sm_90a,
            # whose instructions the wgmma kernels take)
            ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0, "a"), launch_bounds=launch_bounds)
        except Exception as e:  # noqa: BLE001
            self.out["problems"].append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
            return None
        self.out["n"] += 1
        if ".f64" in ptx:
            self.out["problems"].append(f"{label}: float64 in PTX")
        if "ld.local" in ptx or "st.local" in ptx:
            self.out["problems"].append(f"{label}: local-memory spill in PTX")
        return ptx

    def sass(self, ptx: str, label: str, max_regs: int | None, spill: int = 0) -> None:
        """ptxas -v on the PTX: spills past `spill` bytes, and registers against max_regs (None:
        no limit)."""
        if self.ptxas is None:
            self.out["problems"].append("no ptxas (the nvidia-cuda-nvcc wheel's bin/ptxas, or on PATH)")
            return
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run(
                [self.ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                capture_output=True,
                text=True,
            )
        regs = [int(m) for m in re.findall(r"Used (\d+) registers", r.stderr)]
        spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", r.stderr)]
        if r.returncode != 0 or not regs:
            self.out["problems"].append(f"{label}: ptxas failed: {r.stderr[-300:]}")
            return
        self.out["sass"] += 1
        if spills and max(spills) > spill:
            self.out["problems"].append(f"{label}: ptxas spills {max(spills)} bytes to local memory")
        if max_regs is not None and max(regs) > max_regs:
            self.out["problems"].append(f"{label}: {max(regs)} registers a thread, above {max_regs}")


def register_limit(kernel: object, threads: int) -> int | None:
    """The most registers a thread of `kernel` may use: its module's MAX_REGISTERS where it states
    one, else what its launch bounds allow, else what a block of `threads` (the largest launch
    seen; 0: sized by occupancy) can have; None: no limit below the machine's 255."""
    import importlib

    fn = getattr(kernel, "py_func", kernel)
    stated = getattr(importlib.import_module(fn.__module__), "MAX_REGISTERS", None)
    if stated is not None:
        return stated
    bounds = getattr(kernel, "targetoptions", {}).get("launch_bounds")
    if bounds:
        return min(255, 65536 // (bounds[0] * (bounds[1] if len(bounds) > 1 else 1)))
    limit = 65536 // threads if threads else 255
    return limit if limit < 255 else None


def _decoder_kernels(checks: _Checks) -> None:
    """Small kernels around the bit-level decoders and encoders: scalar arguments and fixed
    output slots, no address arithmetic, so any 64-bit shift or logic op in the PTX is the
    decoders' own data path."""
    from pycalm.kernels import common as c

    def fp(w, out):  # noqa: ANN001, ANN202
        f0, f1 = c.h2f2(w)
        out[0] = f0 + f1
        out[1] = c.fp8_byte_raw(w, 1)
        out[2] = c.fp8_decode(w)

    def fp8(w, out):  # noqa: ANN001, ANN202
        g0, g1, g2, g3 = c.fp8x4_cvt(w)
        out[0] = g0 + g1 + g2 + g3

    def gf4(w, x, out):  # noqa: ANN001, ANN202
        out[0] = c.gf4_dot8_raw(w, x, x, x, x, x, x, x, x)
        out[1] = c.gf4_decode(w, 6) + c.gf4_decode(w, 2) + c.gf4_scale(w)

    def enc(x, out):  # noqa: ANN001, ANN202
        out[0] = c.fp8_encode(x)

    def q4(w, out):  # noqa: ANN001, ANN202
        out[0] = c.q4_code(w, 1) + c.q4_code(w, 6)

    def pairs(w, out):  # noqa: ANN001, ANN202  (the W tiles' f16x2 decoders)
        h0, h1 = c.q8_pairs(w)
        out[0] = h0 ^ h1 ^ c.gf4_pair(w, 1, c.gf4_factor(w)) ^ c.q4_pair(w, 3, w, h0)

    for fn, sig in (
        (fp, "void(int32, float32[::1])"),
        (fp8, "void(int32, float32[::1])"),
        (gf4, "void(int32, float32, float32[::1])"),
        (enc, "void(float32, int32[::1])"),
        (q4, "void(int32, float32[::1])"),
        (pairs, "void(int32, int32[::1])"),
    ):
        ptx = checks.ptx_of(fn, sig, f"decoder kernel {fn.__name__}")
        if ptx is not None and checks.INT64.search(ptx):
            ops = sorted(set(m.group(0) for m in checks.INT64.finditer(ptx)))
            checks.out["problems"].append(f"decoder kernel {fn.__name__}: 64-bit integer ops {ops} in PTX")


def worker(index: int, n_workers: int) -> None:
    """Walk, compile kernels index, index + n_workers, ... of the list (worker 0 also the
    decoder kernels), print RESULT and the findings as JSON."""
    items, threads = launched_kernels()
    checks = _Checks()
    allowed = {}  # the py_func of each KNOWN_SPILLS kernel -> the bytes it may spill
    for (module, factory), args, nbytes in KNOWN_SPILLS:
        allowed[getattr(importlib.import_module(module), factory)(*args).py_func] = nbytes
    for item in items[index::n_workers]:
        fn = getattr(item.kernel, "py_func", item.kernel)
        label = item.key
        bounds = getattr(item.kernel, "targetoptions", {}).get("launch_bounds")
        ptx = checks.ptx_of(fn, item.argtypes, label, bounds)
        if ptx is None:
            continue
        checks.sass(ptx, label, register_limit(item.kernel, threads.get(fn, 0)), allowed.get(fn, 0))
        # every kernel of the token step may be a programmatic dependent (pycalm.gpu.graph)
        for inst in ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;"):
            if inst not in ptx:
                checks.out["problems"].append(f"{label}: no {inst} (a programmatic graph would race)")
    if index == 0:
        _decoder_kernels(checks)
    modules = sorted({i.key.split(" ")[0].split(".")[2] for i in items})
    print("RESULT" + json.dumps({**checks.out, "kernels": len(items), "modules": modules}))


def same_ptx_worker(patched: bool, per_function: int) -> None:
    """Compile the first `per_function` kernels of each kernel function in the walk's list (0:
    every kernel) in order, with numba_patch's inliner copies or (patched False) numba's own, and
    print RESULT: each kernel's PTX digest and the seconds of the compiles. Two workers, one
    each way, name their kernels alike (numba numbers its symbols by the compiles before, in the
    process), so their digests compare."""
    import copy
    import hashlib
    import time

    from numba import cuda
    from numba.cuda.core import inline_closurecall

    items, _ = launched_kernels()
    if per_function:  # the list is largest first: each function's largest specialisations
        taken: dict = {}
        for item in items:
            taken.setdefault(item.key.split(" ")[0], []).append(item)
        items = [item for group in taken.values() for item in group[:per_function]]
    assert inline_closurecall.copy is not copy, "numba_patch.share_inline_copies did not install"
    if not patched:
        inline_closurecall.copy = copy
    digests, start = {}, time.perf_counter()
    for item in items:
        fn = getattr(item.kernel, "py_func", item.kernel)
        bounds = getattr(item.kernel, "targetoptions", {}).get("launch_bounds")
        ptx, _ = cuda.compile_ptx(fn, item.argtypes, cc=(9, 0, "a"), launch_bounds=bounds)
        digests[item.key] = hashlib.sha256(ptx.encode()).hexdigest()
    print("RESULT" + json.dumps({"ptx": digests, "seconds": time.perf_counter() - start}))


# ---------------------------------------------------------------------------------------------
# the tests


def _run(call: str) -> dict:
    """The RESULT of test_ptx.`call` (a worker's call, e.g. "worker(0, 2)") in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_ptx; test_ptx.{call}"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1500)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert p.returncode == 0 and lines, f"compile worker crashed:\n{p.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT") :])


def test_every_launched_kernel_compiles_without_f64_spills_or_64bit_decoders():
    n_workers = max(1, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        results = list(pool.map(_run, [f"worker({i}, {n_workers})" for i in range(n_workers)]))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    kernels = results[0]["kernels"]
    assert all(r["kernels"] == kernels and r["modules"] == results[0]["modules"] for r in results)  # one walk
    assert FAMILIES <= set(results[0]["modules"]), sorted(FAMILIES - set(results[0]["modules"]))
    assert sum(r["n"] for r in results) == kernels + 6  # + the 6 decoder kernels
    assert sum(r["sass"] for r in results) == kernels  # every launched kernel through ptxas


def test_numba_patch_changes_no_ptx():
    """numba_patch's inliner copies (share_inline_copies) give the same PTX bytes as numba's
    own, for the largest specialisation of each kernel function the engine launches."""
    calls = ["same_ptx_worker(True, 1)", "same_ptx_worker(False, 1)"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        patched, plain = pool.map(_run, calls)
    assert len(patched["ptx"]) >= len(FAMILIES) and patched["ptx"].keys() == plain["ptx"].keys()
    differ = [key for key, digest in patched["ptx"].items() if plain["ptx"][key] != digest]
    assert not differ, differ
    print(
        f"{len(patched['ptx'])} kernels, the same PTX: compiled in {patched['seconds']:.0f} s with"
        f" numba_patch's inliner copies, {plain['seconds']:.0f} s without"
    )
