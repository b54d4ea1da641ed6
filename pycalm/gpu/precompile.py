"""A cold kernel cache filled by worker processes, in parallel, while the weights load.

numba compiles one kernel at a time and holds the GIL while it does, so a cold start (an empty
kernel cache, pycalm.gpu.kernel_cache) pays the sum of every kernel's compile time. Here separate
processes compile them side by side into the cache, and the engine then loads each one from it:
a cold start costs about the slowest kernel's compile plus a process start, not the sum.

    GpuEngine.__init__ -> start(): the cache folder lacks this engine's marker files
        -> N workers: python -m pycalm.gpu.precompile SPEC WORKER   (N: min(cores, 8))
    ... the weights upload in the main process meanwhile ...
    GpuEngine.graph / prepare / the first prefill -> Precompile.wait_for(groups): the marker
        of each group of kernels they launch -> they load those kernels from the cache

A worker needs no weights and no real buffers, only the kernels' signatures, and numba types an
array argument by its dtype, rank and layout. So it builds the same GpuEngine on stand-in device
arrays of the real shapes (the launchers choose specialisations from shapes) whose memory is
never allocated or copied (`virtual_memory`: one small real allocation stands behind every
array; copies to the device do nothing, copies to the host read zeros), and with numba's launch
replaced by a record of (kernel, argument types) (`Walk`). It then runs what a real run runs:
the token step for every attention span graph() captures, greedy and sampled, and the
multi-token forward (pycalm.gpu.prefill) at its chunk sizes and row buckets, with the logits
rows, and serve --parallel's batched step over a paged pool (pycalm.gpu.batched.BatchedGpuEngine
.walk). That visits every launch site, and each worker records the same list in the same order.
Each kernel belongs to the group whose walk reached it first: "step" (the greedy token step),
"sample" (what a sampled step adds: the sampling kernels), "prefill" (the multi-token forward's
kernels) and "batch" (what the batched step adds: the paged QKV epilogue and attention, the
gathers, the row buckets above the prefill's).

Then the workers share the list out: it is ordered by an estimated compile cost, largest first
(`estimated_cost`: the tensor-core matmuls, then the attention kernels, ...), the batch group's
after all the others (a server waits for them before it says it is ready: its first requests
then compile nothing; a CLI run never waits for them), and each worker walks it and compiles
the kernels it claims, a claim being a file created with O_EXCL in a folder of this run: a
worker that is done with a large kernel takes the next unclaimed one, so
the kernels spread as a longest-first schedule would spread them. Compiling writes the cache
entry (cache=True); two workers adding entries to one index file take turns (cache.install's
lock). A worker marks each kernel it compiled done, and whichever worker finds every kernel of
a group done writes the group's marker file in the cache folder.

The engine waits only for the groups it is about to launch: a greedy run starts while a worker
still compiles the sampling kernel (the slowest, docs/BENCHMARKS.md). Workers still running
when the engine's process ends are stopped (what they finished stays in the cache), so a run
leaves nothing behind that could compile into the cache during the next one. The next run
starts workers again only where the step's, the multi-token forward's or the batched step's
kernels are missing; a sampling kernel missing alone is compiled where it is first launched, as
without workers. A worker that fails breaks nothing: the engine compiles whatever is missing
itself, as without workers, and says so in one line on stderr. Under the CUDA simulator (no
compiler, no cache) nothing starts; EngineOptions.parallel_compile = 0 turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

WALK_VERSION = "4"  # in the marker's digest: a change in what the walk visits refills the cache
MAX_WORKERS = 8
# the EngineOptions that choose which kernels an engine launches (the others change no kernel)
KERNEL_OPTIONS = ("attention_chunk", "prefill_chunk", "check_finite")
WORKER_TIMEOUT_S = 900  # the engine waits no longer for a group; it compiles what is missing
POLL_S = 0.02  # how often the engine looks for a group's marker
GROUPS = ("step", "sample", "prefill", "batch")  # in the order the walk visits them

# the compile cost of a kernel by its module, in seconds, roughly as measured with 8 workers
# compiling at once on the H200's machine (docs/BENCHMARKS.md at b282afd): the sampling kernel is the
# slowest, then the tensor-core matmuls and the matvecs, whose quantized decode makes them slower
MODULE_COST = {
    "sample": 14,
    "wgmma_matmul": 8,  # (not timed with the others: a guess above the mma.sync tile's)
    "matmul": 5,
    "skinny": 3,
    "moe_rows": 5,
    "matvec": 4,
    "moe": 4,
    "qkv": 3,
    "attention": 2.5,
    "prefill_attention": 2.5,
    "rows": 0.3,
}
QUANTIZED_NAMES = ("gf4", "q4", "q8", "fp8")  # closure values that make a kernel's decode longer


# ---------------------------------------------------------------------------------------------
# the kernels a run launches, and how they are shared out


@dataclass(frozen=True)
class Item:
    """One (kernel, argument types) to compile: `key` names it the same in every process."""

    key: str
    cost: float
    kernel: object  # the numba dispatcher
    argtypes: tuple
    group: str = "step"  # GROUPS: the part of a run that launches it first

    @property
    def file(self) -> str:
        """Its claim file's name (and with .done, the file that says it is compiled)."""
        return hashlib.sha256(self.key.encode()).hexdigest()[:32]


def kernel_function(kernel: object) -> object:
    """The Python function behind a numba dispatcher (or the simulator's kernel)."""
    return getattr(kernel, "py_func", None) or kernel.fn


def item_key(fn: object, argtypes: tuple) -> str:
    """The function's module and qualified name, its closure (cache.closure_digest: the same in
    every process) and the argument types."""
    from pycalm.gpu.kernel_cache import closure_digest

    try:
        digest = closure_digest(fn)[:16]
    except (TypeError, AttributeError):  # the simulator's device functions: a digest of this process
        digest = f"local{id(fn):x}"
    return f"{fn.__module__}.{fn.__qualname__} {digest} ({', '.join(map(str, argtypes))})"


def estimated_cost(fn: object) -> float:
    """A relative compile cost: MODULE_COST of the kernel's module, half as much again where
    its closure names a quantized format."""
    cost = float(MODULE_COST.get(fn.__module__.rsplit(".", 1)[-1], 1))
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    if any(isinstance(v, str) and v in QUANTIZED_NAMES for v in cells):
        cost *= 1.5
    return cost


def schedule(items: list[Item]) -> list[Item]:
    """The order every worker walks the list in: largest estimated cost first, then by key; the
    batch group's kernels after all the others (only a server waits for them)."""
    return sorted(items, key=lambda i: (i.group == "batch", -i.cost, i.key))


def claim(folder: Path, name: str) -> bool:
    """True for the one process that creates the claim file `name` in `folder` first."""
    path = folder / name
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


class StubKernel:
    """What a recorded compile hands back to the launchers (pycalm.kernels.launch asks a
    compiled kernel how many blocks fit; any answer does, nothing is launched)."""

    def max_cooperative_grid_blocks(self, threads: int) -> int:
        from pycalm.kernels.launch import BLOCKS_PER_SM, n_sm

        return BLOCKS_PER_SM * n_sm()


class Walk:
    """Launches and compiles recorded, nothing compiled or run: `items` holds each distinct
    (kernel, argument types) in the order the engine first reached it."""

    def __init__(self) -> None:
        self._items: dict[str, Item] = {}
        self.group = "step"  # the group of the kernels recorded from now on (new ones only)

    @property
    def items(self) -> list[Item]:
        return list(self._items.values())

    def record(self, kernel: object, argtypes: tuple) -> StubKernel:
        fn = kernel_function(kernel)
        key = item_key(fn, argtypes)
        if key not in self._items:
            self._items[key] = Item(key, estimated_cost(fn), kernel, tuple(argtypes), self.group)
        return StubKernel()

    def launch(self, kernel: object, args: tuple) -> None:
        """A launch: record the kernel with the types numba gives its arguments, run nothing."""
        self.record(kernel, tuple(kernel.typeof_pyval(a) for a in args))

    @contextlib.contextmanager
    def installed(self, dispatcher_class: type) -> Iterator[Callable[[object, tuple], object]]:
        """Within: `dispatcher_class`'s launch (call) and compile record instead; yields the
        real compile, compile(kernel, argtypes)."""
        real_call, real_compile = dispatcher_class.call, dispatcher_class.compile

        def call(kernel: object, args: tuple, launch_config: object) -> None:
            self.launch(kernel, args)

        def compile(kernel: object, sig: object) -> StubKernel:  # noqa: A001 - numba's name
            return self.record(kernel, tuple(sig))

        dispatcher_class.call, dispatcher_class.compile = call, compile
        try:
            yield real_compile
        finally:
            dispatcher_class.call, dispatcher_class.compile = real_call, real_compile


@contextlib.contextmanager
def virtual_memory() -> Iterator[None]:
    """Within: device arrays of any size cost nothing (every allocation is a view of one small
    real one, and the GPU reports all its memory free), copies to the device and memsets do
    nothing, copies to the host fill the host buffer with zeros (so host code that reads a
    device result gets a stand-in 0), and a TMA map is a stand-in array of its type, neither
    encoded by the driver (which the walk may lack) nor kept in wgmma_matmul's cache of maps by
    address (every stand-in array has the same one). Nothing may launch meanwhile (Walk)."""
    import ctypes

    import numpy as np
    from numba import cuda
    from numba.cuda.cudadrv import driver

    from pycalm.kernels import wgmma_matmul

    backing = cuda.device_array(256, "u1")  # the address every stand-in array points at
    base = backing.gpu_data.device_pointer_value

    def memalloc(context: object, size: int) -> object:
        pointer = driver.binding.CUdeviceptr(base)
        return driver.MemoryPointer(context, pointer, size, owner=backing.gpu_data)

    def to_host(dst: object, src: object, size: int, stream: object = 0) -> None:
        ctypes.memset(driver.host_pointer(dst), 0, size)

    def nothing(*args: object, **kwargs: object) -> None:
        return None

    def plenty(context: object) -> tuple[int, int]:  # (free, total): the stand-ins take none
        return 1 << 60, 1 << 60

    def tma_map(array: object, box_rows: int, stream: object = 0) -> object:
        return cuda.device_array(16, np.uint64)  # (16,) the 128 bytes of a map

    saved = {
        (driver.Context, "memalloc"): driver.Context.memalloc,
        (driver.Context, "get_memory_info"): driver.Context.get_memory_info,
        (driver.MemoryPointer, "memset"): driver.MemoryPointer.memset,
        (driver, "host_to_device"): driver.host_to_device,
        (driver, "device_to_device"): driver.device_to_device,
        (driver, "device_memset"): driver.device_memset,
        (driver, "device_to_host"): driver.device_to_host,
        (wgmma_matmul, "tma_map"): wgmma_matmul.tma_map,
    }
    replacement = {
        "memalloc": memalloc,
        "get_memory_info": plenty,
        "device_to_host": to_host,
        "tma_map": tma_map,
    }
    for owner, name in saved:
        setattr(owner, name, replacement.get(name, nothing))
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


# ---------------------------------------------------------------------------------------------
# the walk: a stand-in engine through everything a run launches


def mark_groups(items: list[Item], claims: Path, markers: dict[str, Path]) -> None:
    """Write the marker of every group whose kernels are all done (each worker writes its done
    file before it looks, so the last one to finish a group's kernel sees them all)."""
    for group, marker in markers.items():
        if not marker.exists() and all(
            (claims / f"{i.file}.done").exists() for i in items if i.group == group
        ):
            marker.write_text(json.dumps(dict(kernels=sum(i.group == group for i in items))))


# ---------------------------------------------------------------------------------------------
# the engine's side: start the workers, wait for them


def default_workers() -> int:
    """min(the cores this process may use, MAX_WORKERS)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


@dataclass
class Report:
    """What the workers did: processes started, kernels they compiled, the seconds the engine
    waited for them, and the failures (one line each)."""

    processes: int
    compiled: list[tuple[str, float]]  # (key, seconds) for each kernel a worker compiled
    wait_s: float
    failures: list[str]

    @property
    def slowest(self) -> tuple[str, float] | None:
        return max(self.compiled, key=lambda c: c[1]) if self.compiled else None


class Precompile:
    """Worker processes compiling an engine's kernels into the kernel cache (start() makes one).
    markers: GROUPS -> the file a worker writes once the group's kernels are all in the cache."""

    def __init__(
        self, spec: dict, markers: dict[str, Path], workers: int, command: list[str] | None = None
    ) -> None:
        self.markers = markers
        self.wait_s = 0.0  # seconds the engine has waited for groups
        self._said = False  # the one line about failed workers is out
        self.work = Path(tempfile.mkdtemp(prefix="pycalm-precompile-"))
        claims = self.work / "claims"
        claims.mkdir()
        spec = {**spec, "claims": str(claims), "markers": {g: str(m) for g, m in markers.items()}}
        spec_path = self.work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        package_parent = str(Path(__file__).resolve().parent.parent)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])),
        }
        command = command or [sys.executable, "-m", "pycalm.gpu.precompile_worker"]
        self._processes = []
        for i in range(workers):
            with open(self.work / f"worker{i}.log", "wb") as out:  # the child keeps its own handle
                argv = [*command, str(spec_path), str(i)]
                self._processes.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
        atexit.register(self.stop)

    @property
    def processes(self) -> int:
        return len(self._processes)

    def wait_for(
        self,
        groups: tuple[str, ...],
        timeout_s: float = WORKER_TIMEOUT_S,
        log: Callable[[str], None] | None = None,
    ) -> bool:
        """Wait until the workers have put every kernel of `groups` in the cache (True), or have
        all ended without (False: one line says so, the first time, and the engine compiles
        what is missing itself), or timeout_s has passed (False, the same)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        try:
            while not all(self.markers[g].exists() for g in groups):
                ended = all(p.poll() is not None for p in self._processes)
                if ended or time.monotonic() > deadline:
                    if not self._said:
                        self._said = True
                        why = self._failures() or [
                            f"still running after {timeout_s:.0f} s" if not ended else "ended"
                        ]
                        (log or _stderr)(
                            f"pycalm: kernel compile workers did not finish the {', '.join(groups)} kernels "
                            f"({why[0]}); compiling what is missing here"
                        )
                    return False
                time.sleep(POLL_S)
            return True
        finally:
            self.wait_s += time.perf_counter() - t0

    def finish(self, timeout_s: float = WORKER_TIMEOUT_S) -> Report:
        """Wait for every worker to end (one still running after timeout_s is ended) and report."""
        deadline = time.monotonic() + timeout_s
        timed_out = []
        for i, p in enumerate(self._processes):
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                timed_out.append(f"worker {i} still running after {timeout_s:.0f} s")
        compiled = []
        for i in range(self.processes):
            for line in (self.work / f"worker{i}.log").read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line) if line.startswith("{") else {}
                    if "key" in record:
                        compiled.append((record["key"], float(record["s"])))
        return Report(self.processes, compiled, self.wait_s, timed_out + self._failures())

    def stop(self) -> None:
        """End the workers still running (at the process's exit: nothing compiles into the cache
        after the run that started them)."""
        running = [p for p in self._processes if p.poll() is None]
        for p in running:
            p.terminate()
        for p in running:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _failures(self) -> list[str]:
        """A line for each worker that ended with an error: its exit status and last output line."""
        out = []
        for i, p in enumerate(self._processes):
            rc = p.poll()
            if rc not in (None, 0, -signal.SIGTERM, -signal.SIGKILL):  # not ended by stop() or finish()
                text = (self.work / f"worker{i}.log").read_text(errors="replace")
                out.append(
                    f"worker {i} exited with {rc}: {(text.strip().splitlines() or ['no output'])[-1][:200]}"
                )
        return out


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def engine_spec(cfg: object, seq_len: int, kv_dtype: str, options: object) -> dict:
    """What shapes an engine's kernels: the config, context length, KV format and the options
    (attention chunk, prefill chunk, ...)."""
    return dict(config=cfg.to_json(), seq_len=seq_len, kv_dtype=kv_dtype, options=dataclasses.asdict(options))


def marker_path(folder: Path, spec: dict, group: str) -> Path:
    """The file that says a group (GROUPS) of this spec's kernels is in `folder` (a kernel cache
    folder): named by a digest of the config, context, KV format and the options that choose
    kernels."""
    options = {k: v for k, v in spec["options"].items() if k in KERNEL_OPTIONS}
    text = json.dumps({**spec, "options": options, "walk": WALK_VERSION}, sort_keys=True)
    return folder / f"ready-{hashlib.sha256(text.encode()).hexdigest()[:24]}-{group}"


def start(cfg: object, seq_len: int, kv_dtype: str, options: object) -> Precompile | None:
    """Workers compiling this engine's kernels into the kernel cache, or None: under the CUDA
    simulator, with options.parallel_compile == 0, when the cache folder cannot be written, or
    when its markers say that the step's, the multi-token forward's and the batched step's
    kernels are there (the sampling kernel, if missing, then compiles on first use)."""
    from numba import config

    if config.ENABLE_CUDASIM or options.parallel_compile == 0:
        return None
    from pycalm.gpu import kernel_cache as cache

    folder = cache.folder()
    spec = engine_spec(cfg, seq_len, kv_dtype, options)
    markers = {g: marker_path(folder, spec, g) for g in GROUPS}
    if all(markers[g].exists() for g in ("step", "prefill", "batch")):
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None  # each process would cache in a temporary folder of its own
    workers = options.parallel_compile or default_workers()
    try:
        return Precompile({**spec, "root": str(folder.parent.parent)}, markers, workers)
    except OSError as e:  # no temporary folder, no process: this process compiles, as without
        _stderr(f"pycalm: no kernel compile workers ({e}); compiling here")
        return None
