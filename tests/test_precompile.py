"""Parallel cold compilation (pycalm.gpu.precompile): the order and the claims that share the kernels
out, the recording launch that replaces numba's in a worker, the engine's side when workers fail,
and on a GPU (PYCALM_TEST_GPU=1) a cold run whose workers leave a cache from which the engine and
a second process compile nothing, with the same tokens.
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from gpu import GPU, gpu_only

from pycalm.gpu import precompile
from pycalm.gpu.engine import EngineOptions
from pycalm.gpu.precompile import Item, Precompile, Walk, claim, estimated_cost, schedule
from pycalm.model.config import ModelConfig

REPO = Path(__file__).resolve().parent.parent


def _factory(dtype: str):  # noqa: ANN202 - a closure like the kernel factories' (dtype in a cell)
    def kernel(x):  # noqa: ANN001, ANN202
        return dtype, x

    return kernel


def test_schedule_puts_the_costly_kernels_first_in_a_fixed_order():
    items = [Item(key, cost, None, ()) for key, cost in [("b", 1.0), ("a", 10.0), ("c", 4.0), ("a2", 4.0)]]
    order = [i.key for i in schedule(items)]
    assert order == ["a", "a2", "c", "b"]
    assert [i.key for i in schedule(list(reversed(items)))] == order  # the same in every worker
    # the batch group's kernels (a server's alone) after all the others, however costly
    served = [Item("s", 20.0, None, (), "batch"), Item("t", 0.5, None, (), "batch")]
    assert [i.key for i in schedule(served + items)] == [*order, "s", "t"]
    # a kernel's module sets its cost; a quantized format in its closure makes it dearer
    plain, gf4 = _factory("fp16"), _factory("gf4")
    plain.__module__ = gf4.__module__ = "pycalm.kernels.matmul"
    assert estimated_cost(plain) == precompile.MODULE_COST["matmul"]
    assert estimated_cost(gf4) == 1.5 * precompile.MODULE_COST["matmul"]
    plain.__module__ = "pycalm.kernels.step"
    assert estimated_cost(plain) == 1.0


def test_claims_give_each_kernel_to_exactly_one_worker(tmp_path):
    keys = [Item(f"kernel{i} (float32[::1])", 1.0, None, ()).file for i in range(40)]
    taken: dict[int, list[str]] = {w: [] for w in range(4)}
    start = threading.Barrier(4)

    def worker(w: int) -> None:
        start.wait()
        taken[w] += [k for k in keys if claim(tmp_path, k)]

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [k for w in taken.values() for k in w]
    assert sorted(everything) == sorted(keys)  # each claimed once, none left over
    assert not claim(tmp_path, keys[0])


class FakeDispatcher:
    """numba's CUDADispatcher as far as a Walk touches it: call launches, compile compiles."""

    launched: list = []
    compiled: list = []

    def __init__(self, fn: object) -> None:
        self.py_func = fn

    def typeof_pyval(self, value: object) -> str:
        return type(value).__name__

    def call(self, args: tuple, launch_config: object) -> None:
        FakeDispatcher.launched.append(args)

    def compile(self, sig: tuple) -> str:
        FakeDispatcher.compiled.append(sig)
        return "compiled"


def test_walk_records_each_launch_and_runs_nothing():
    walk = Walk()
    walk.group = "prefill"
    fp16, gf4 = FakeDispatcher(_factory("fp16")), FakeDispatcher(_factory("gf4"))
    original = FakeDispatcher.call, FakeDispatcher.compile
    with walk.installed(FakeDispatcher) as real_compile:
        fp16.call((1, 2.0), None)
        fp16.call((3, 4.0), None)  # same types: one entry
        fp16.call((1, "x"), None)
        gf4.call((1, 2.0), None)  # another closure: its own entry
        stub = gf4.compile(("int", "int"))  # a launcher asking for the compiled kernel
        assert stub.max_cooperative_grid_blocks(256) > 0
        assert real_compile(gf4, ("int",)) == "compiled"  # the real one, for the claimed kernels
    assert FakeDispatcher.launched == [] and FakeDispatcher.compiled == [("int",)]
    assert (FakeDispatcher.call, FakeDispatcher.compile) == original  # restored
    items = walk.items
    assert [i.argtypes for i in items] == [("int", "float"), ("int", "str"), ("int", "float"), ("int", "int")]
    assert items[0].key != items[2].key  # fp16 and gf4 closures of one function differ
    assert all("_factory.<locals>.kernel" in i.key for i in items)
    assert {i.group for i in items} == {"prefill"}  # the group the walk was in
    fp16.call((1, 2.0), None)  # outside: numba's launch again
    assert FakeDispatcher.launched == [(1, 2.0)]


def _config() -> ModelConfig:
    return ModelConfig(
        arch="llama", dim=32, hidden_dim=48, head_dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
        vocab_size=64, max_seq_len=128, rope_theta=10000.0, rotary_dim=16, norm_eps=1e-5,
        bos_id=1, eos_ids=(2,), weight_dtype="fp16",
    )  # fmt: skip


def _spec() -> dict:
    return precompile.engine_spec(_config(), 64, "fp16", EngineOptions())


def _markers(folder: Path) -> dict[str, Path]:
    return {g: folder / f"ready-x-{g}" for g in precompile.GROUPS}


def test_failed_workers_leave_the_compiling_to_the_engine(tmp_path):
    """Workers that exit with an error: one line says so (once), no marker is written (the next
    run tries again) and nothing raises; the engine then compiles on first use, as without."""
    markers = _markers(tmp_path)
    fail = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    lines: list[str] = []
    workers = Precompile(_spec(), markers, 2, command=fail)
    assert workers.wait_for(("step",), log=lines.append) is False
    assert workers.wait_for(("prefill",), log=lines.append) is False  # said once only
    assert len(lines) == 1, lines
    assert lines[0].startswith("pycalm: kernel compile workers did not finish the step kernels (worker ")
    assert "exited with 3: boom); compiling what is missing here" in lines[0]
    report = workers.finish()
    assert report.processes == 2 and report.compiled == [] and len(report.failures) == 2
    assert not any(m.exists() for m in markers.values())
    # a worker that never ends: the engine stops waiting at the timeout; finish() ends it
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    workers = Precompile(_spec(), markers, 1, command=hang)
    assert workers.wait_for(("step",), timeout_s=0.3, log=lines.append) is False
    assert lines[-1].startswith(
        "pycalm: kernel compile workers did not finish the step kernels (still running"
    )
    assert workers.finish(timeout_s=0.3).failures == ["worker 0 still running after 0 s"]
    # at the process's exit (atexit) the workers still running are stopped, which is no failure
    workers = Precompile(_spec(), markers, 2, command=hang)
    workers.stop()
    assert workers.finish(timeout_s=5).failures == []


_FAKE_WORKER = """
import json, sys, time
spec = json.load(open(sys.argv[1]))
assert spec["seq_len"] == 64
if sys.argv[2] == "0":
    open(spec["markers"]["step"], "w").write("{}")
    print(json.dumps(dict(worker=0, key="k0", s=0.25)), flush=True)
else:  # the slow one: the sampling kernel
    time.sleep(1.0)
    open(spec["markers"]["sample"], "w").write("{}")
    print(json.dumps(dict(worker=1, key="k1", s=1.0)), flush=True)
"""


def test_the_engine_waits_only_for_the_groups_it_launches(tmp_path):
    markers = _markers(tmp_path)
    workers = Precompile(_spec(), markers, 2, command=[sys.executable, "-c", _FAKE_WORKER])
    assert workers.wait_for(("step",), log=pytest.fail) is True
    assert not markers["sample"].exists()  # the greedy step goes on while worker 1 still compiles
    assert workers.wait_for(("step", "sample"), log=pytest.fail) is True
    report = workers.finish()
    assert sorted(report.compiled) == [("k0", 0.25), ("k1", 1.0)] and report.failures == []
    assert report.slowest == ("k1", 1.0) and report.wait_s == workers.wait_s > 0


_MEETING_WORKER = """
import json, sys, time
from pathlib import Path
spec = json.load(open(sys.argv[1]))
here, other = Path(spec["claims"]).parent.parent / spec["name"], spec["other"]
here.touch()  # this cell's worker is running; it ends once the other cell's is too (10 s at most)
deadline = time.monotonic() + 10
while not (Path(spec["claims"]).parent.parent / other).exists():
    if time.monotonic() > deadline:
        sys.exit(4)
    time.sleep(0.02)
print(json.dumps(dict(worker=0, key=spec["name"], s=0.5)), flush=True)
"""


def test_warm_kernels_starts_every_cell_before_waiting(tmp_path, monkeypatch):
    """scripts/warm_kernels.py: each cell's workers (its engine's spec, the workers it is given)
    start before any is waited for: two cells whose workers each end only once the other's has
    started both finish, where waiting cell by cell would leave the first one's to fail."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import warm_kernels

    monkeypatch.setattr(precompile.tempfile, "tempdir", str(tmp_path))
    seen = []

    def start(cfg, seq_len, kv_dtype, options):
        seen.append((cfg.weight_dtype, seq_len, kv_dtype, options.parallel_compile))
        name, other = ("a", "b") if len(seen) == 1 else ("b", "a")
        spec = {**precompile.engine_spec(cfg, seq_len, kv_dtype, options), "name": name, "other": other}
        markers = _markers(tmp_path / name)
        return Precompile(spec, markers, 1, command=[sys.executable, "-c", _MEETING_WORKER])

    def config(shape, dtype):
        return dataclasses.replace(_config(), weight_dtype=dtype)

    reports = warm_kernels.warm([("s", "fp16", "fp16"), ("s", "q8", "fp8")], config, 64, 3, start=start)
    assert seen == [("fp16", 64, "fp16", 3), ("q8", 64, "fp8", 3)]
    assert [cell for cell, _ in reports] == [("s", "fp16", "fp16"), ("s", "q8", "fp8")]
    assert [(r.compiled, r.failures) for _, r in reports] == [([("a", 0.5)], []), ([("b", 0.5)], [])]


def test_marker_names_everything_that_shapes_the_kernels(tmp_path):
    spec = _spec()
    marker = precompile.marker_path(tmp_path, spec, "step")
    assert marker == precompile.marker_path(tmp_path, json.loads(json.dumps(spec)), "step")
    assert marker != precompile.marker_path(tmp_path, spec, "sample")
    for change in (
        {"seq_len": 128},
        {"kv_dtype": "fp8"},
        {"options": {**spec["options"], "prefill_chunk": 16}},
    ):
        assert precompile.marker_path(tmp_path, {**spec, **change}, "step") != marker
    lookahead = {**spec, "options": {**spec["options"], "decode_lookahead": 1}}  # no kernel changes
    assert precompile.marker_path(tmp_path, lookahead, "step") == marker


def test_a_group_is_marked_once_every_kernel_in_it_is_done(tmp_path):
    items = [Item(k, 1.0, None, (), g) for k, g in [("a", "step"), ("b", "step"), ("c", "sample")]]
    markers = _markers(tmp_path)
    precompile.mark_groups(items, tmp_path, markers)
    assert [g for g, m in markers.items() if m.exists()] == ["prefill", "batch"]  # no kernels: done
    (tmp_path / f"{items[0].file}.done").touch()
    (tmp_path / f"{items[2].file}.done").touch()
    precompile.mark_groups(items, tmp_path, markers)
    assert [g for g, m in markers.items() if m.exists()] == ["sample", "prefill", "batch"]
    (tmp_path / f"{items[1].file}.done").touch()
    precompile.mark_groups(items, tmp_path, markers)
    assert all(m.exists() for m in markers.values())


def batched_steps_worker(prefill_chunk: int) -> None:
    """(A process with the simulator off.) A BatchedGpuEngine's steps driven through its calls
    (one row sampled on the device, a prompt chunk of one sequence, decode rows of several
    sequences fed ahead from the step before, a mixed step keeping some logits), recorded as
    the precompile's Walk records, on test_ptx's stand-in device: prints RESULT with the keys
    they launch that the precompile's walk of the same engine does not, and the walk's count
    of batch-group kernels."""
    import numpy as np
    from numba.cuda.dispatcher import CUDADispatcher
    from test_ptx import no_device

    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.batched import BatchedGpuEngine
    from pycalm.gpu.engine import GpuEngine
    from pycalm.gpu.precompile_worker import StandInModel, walk_engine

    cfg, walked, launched = _config(), Walk(), Walk()
    with walked.installed(CUDADispatcher), no_device():
        options = EngineOptions(prefill_chunk=prefill_chunk)
        walk_engine(precompile.engine_spec(cfg, 64, "fp16", options), walked)
    with launched.installed(CUDADispatcher), no_device():
        # (plain launches: a graph replays the same kernels)
        engine = GpuEngine(
            StandInModel(cfg),
            64,
            "fp16",
            options=dataclasses.replace(options, use_graph=False, parallel_compile=0),
        )
        b = BatchedGpuEngine(engine, n_blocks=16, block_size=16)
        table = np.arange(16, dtype=np.int32).reshape(4, 4)  # (4 sequences, 4 blocks)
        greedy, hot = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)
        # one sequence decoding alone: the one-row step, sampled on the device
        b.collect(b.enqueue_tokens([5], [3], [0], table[:1], [0], [hot], [0.5]))
        # one sequence's prompt chunk of 40 rows: the prefill attention over its pages
        b.step(np.arange(40) % 60, np.arange(40), np.zeros(40, np.int32), table[1:2], [39])
        # three sequences' decode rows, then the same fed ahead from that step's tokens
        ticket = b.enqueue_tokens(
            [1, 2, 3], [9, 20, 30], [0, 1, 2], table[:3], [0, 1, 2], [greedy] * 3, [0.1] * 3
        )
        ahead = b.enqueue_tokens([0, 0, 0], [10, 21, 31], [0, 1, 2], table[:3], [0, 1, 2], [hot] * 3, [0.2] * 3,
                                 prev=np.array([0, 1, 2]))  # fmt: skip
        b.collect(ticket), b.collect(ahead)
        # a mixed step: two decode rows and a 12-row chunk, sampled, one row's logits kept
        rows = 14
        seq = np.array([0, 1] + [2] * 12, np.int32)
        pos = np.array([11, 22] + list(range(12)), np.int32)
        b.step_tokens(
            np.ones(rows, np.int32), pos, seq, table[:3], [0, 1, 13], [hot] * 3, [0.3] * 3, keep=[2]
        )
    missing = sorted({i.key for i in launched.items} - {i.key for i in walked.items})
    batch = sum(i.group == "batch" for i in walked.items)
    print("RESULT" + json.dumps(dict(missing=missing, batch=batch, launched=len(launched.items))))


@pytest.mark.parametrize("prefill_chunk", [2048, 48])
def test_the_walk_reaches_every_kernel_a_batched_step_launches(prefill_chunk):
    """serve --parallel's steps launch only kernels the precompile's walk visits (so its workers
    compile them before a server says it is ready), some of them in the walk's batch group; also
    where a step's rows are at most a number that is no power of two (48: its last bucket)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    tests = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path[:0] = [{tests!r}, {str(REPO)!r}]; import test_precompile as t; t.batched_steps_worker({prefill_chunk})"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT") :])
    assert result["missing"] == [], result["missing"]
    assert result["batch"] > 0 and result["launched"] > result["batch"], result


@pytest.mark.skipif(GPU, reason="the simulator's case")
def test_nothing_starts_under_the_simulator():
    assert precompile.start(_config(), 64, "fp16", EngineOptions()) is None


_RUN = r"""
import json, sys
from pycalm.gpu import kernel_cache as cache
cache.set_root(sys.argv[2])
from numba.cuda import dispatcher
compiles = []  # kernels this process compiles (a cache load rebuilds a _Kernel without __init__)
init = dispatcher._Kernel.__init__
def counted(self, py_func, *args, **kwargs):
    compiles.append(py_func.__qualname__)
    init(self, py_func, *args, **kwargs)
dispatcher._Kernel.__init__ = counted
from pycalm.gpu.engine import GpuEngine
from pycalm.model.loader import open_model
from pycalm.cpu.sampler import SamplingParams
before = cache.cached_kernels()
engine = GpuEngine(open_model(sys.argv[1]), seq_len=256)
ids = [1 + (5 * i) % 120 for i in range(40)]
greedy = list(engine.generate(ids, 0, 16, SamplingParams()))
sampled = list(engine.generate(ids, 0, 16, SamplingParams(temperature=0.8, top_p=0.9, seed=3)))
rows = sum(block.shape[0] for block in engine.prefill_logits(ids, 0))
p = engine.precompile and engine.precompile.finish()
print("RESULT" + json.dumps(dict(before=before, end=cache.cached_kernels(), compiles=compiles,
    greedy=greedy, sampled=sampled, rows=rows,
    workers=p and dict(processes=p.processes, compiled=len(p.compiled), failures=p.failures))))
"""


@gpu_only("numba compiles only on a GPU")
def test_cold_run_with_workers_leaves_everything_in_the_cache(tmp_path):
    """A cold engine: its workers compile every kernel the run launches (the engine itself compiles
    none after them), and a second process compiles nothing and gives the same tokens."""
    from tiny_models import make_hf_llama

    from pycalm.convert.main import convert

    src = make_hf_llama(tmp_path, dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    model = convert(src.path, tmp_path / "tiny.pycalm", "fp16", progress=False)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    for _ in range(2):
        p = subprocess.run(
            [sys.executable, "-c", _RUN, str(model), str(tmp_path / "cache")],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
        assert p.returncode == 0 and lines, p.stderr[-3000:]
        runs.append(json.loads(lines[-1][6:]))
    cold, warm = runs
    assert cold["workers"] is not None and cold["workers"]["failures"] == [], cold
    assert cold["compiles"] == [], cold  # the workers compiled every kernel the run launched
    assert cold["workers"]["compiled"] == cold["end"] - cold["before"] > 0, cold
    assert warm["workers"] is None and warm["compiles"] == [] and warm["end"] == cold["end"], warm
    assert (warm["greedy"], warm["sampled"], warm["rows"]) == (cold["greedy"], cold["sampled"], 40)
