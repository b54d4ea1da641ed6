"""Test session set-up: where the kernels run, the markers and the default selection, and the
real models converted once.

Kernels run under numba's CUDA simulator unless PYCALM_TEST_GPU=1 (tests/gpu.py: then the same
tests run on the real GPU). The simulator must be chosen before numba is first imported, so it is
set here. On a machine of several GPUs, PYCALM_TEST_GPUS=0,1,... gives each pytest-xdist worker
one of them in turn (CUDA_VISIBLE_DEVICES, set before CUDA starts).

Markers, given here from the tables below (test files carry none but `gpu`, through gpu_only):
  gpu      needs the real GPU; skipped under the simulator.
  e2e      a real model (SmolLM2-135M, Qwen2.5-Coder-0.5B: fetched from PyPI on first use and
           cached, tests/realmodels.py), end to end.
  compile  compiles the kernels for the GPU (sm_90) with numba's real compiler and ptxas; no GPU
           needed.
  slow     more than about half a minute on the 2-core CI machine: every e2e and compile test, and
           under the simulator the cases of SIMULATOR_SLOW (on a GPU they take a second).

`python -m pytest -q` (neither -m nor paths given) runs the fast set, `-m "not slow"`;
`python -m pytest -q -m slow` runs the rest. Naming files, folders or tests runs all of theirs.
CI (.ci/run) runs the fast set and `-m e2e`: the compile check and the long simulator cases take
longer than its 15 minutes allow.
"""

import hashlib
import os
import time
from pathlib import Path

import pytest
from gpu import GPU

if not GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
elif os.environ.get("PYCALM_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _gpus = os.environ["PYCALM_TEST_GPUS"].split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_gpus)]
if GPU:
    # the engine's compile set-up, before any test file imports a kernel module: numba_patch (about
    # half of a large kernel's compile time) and the disk cache of compiled kernels, so that a
    # second run, one cut short and run again, or the sanitizer's after the tests, loads them
    import pycalm.gpu  # noqa: F401


# ---------------------------------------------------------------------------------------------
# Markers and the default selection. A table entry names a file, a test function of a file (all
# its cases) or one case: "test_x.py", "test_x.py::test_y", "test_x.py::test_y[case]".

# the fixtures that open the real models (conftest's below; test_tokenizer's `real`: both models'
# tokenizers) and the tests that open them without one
E2E_FIXTURES = {
    "smollm2_gguf_path",
    "qwen2_gguf_path",
    "smollm2_fp16",
    "smollm2_fp8",
    "smollm2_gf4",
    "qwen2_fp16",
    "real",
}
E2E_TESTS = {"test_models.py", "test_tokenizer.py::test_gguf_metadata_reader_errors"}
COMPILE = {"test_ptx.py", "test_warpgroup.py::test_wgmma_compiles_for_sm90a"}
# Simulator cases of 10 s or more in a whole run on a loaded 2-core machine (two workers, other
# jobs beside them; --durations): each kernel keeps its cheaper cases in the fast set, and where
# every case of a test is long, its cheapest stays. With the shim's barriers (2026-12-05: the fast
# set 827 -> 453 s in CI) every format's expert products and prefill logits are back in the fast set.
SIMULATOR_SLOW = {
    "test_constrain.py::test_gpu_engines_follow_the_constraint",  # 60-100 s: token steps under the simulator
    "test_batched_gpu.py::test_batch_runner_runs_ahead_on_the_gpu_engine",  # 90 s
    "test_prefill_attention.py::test_kernel_script_wgmma_version_at_model_head_dims",  # 55 s: 128 threads a block
    "test_warpgroup.py::test_matmul_script_checks_its_wgmma_version",  # 90 s (ws), 5 min (rs), 20 s (ts), 70 s (ds), 6 min (dt)
    "test_attention.py::test_attention_matches_ref[7-1-16-fp16-21-0]",  # 12 s
    "test_attention.py::test_attention_over_a_span[50-64]",  # 14 s
    "test_attention.py::test_attention_over_a_span[37-37]",  # 10 s
    "test_attention.py::test_attention_tuning_keeps_the_result[tuning1]",  # 43 s
    "test_attention.py::test_kernel_script_runs_its_check",  # 42 s
    "test_inputs.py::test_gpu_engine_perplexity_in_windows",  # 14 s
    "test_matmul.py::test_matmul_rows_do_not_depend_on_the_tile[fp8-32]",  # 19 s
    "test_matmul.py::test_matmul_rows_do_not_depend_on_the_tile[fp16-32]",  # 12 s
    "test_matmul.py::test_matmul_rows_do_not_depend_on_the_tile[q4-64]",  # 10 s
    "test_matvec.py::test_kernel_script_versions",  # 33 s
    "test_matvec.py::test_matvec_split_kernel[q8]",  # 24 s
    "test_matvec.py::test_matvec_split_kernel[gf4]",  # 16 s
    "test_model.py::test_gpu_engine_matches_reference[qwen2-gf4-fp8]",  # 55 s
    "test_moe.py::test_mixtral_forced_experts[gpu-fp16-1e-05]",  # 27 s
    "test_moe_rows.py::test_expert_matmul_and_combine[q4/mixed]",  # 53 s
    "test_prefill.py::test_mixtral_prefill_chunks_deterministic",  # 104 s
    "test_prefill.py::test_generate_greedy_identical",  # 85 s
    "test_prefill.py::test_batch_invariant_tokens_do_not_depend_on_how_the_prompt_is_fed",  # 75 s
    "test_prefill.py::test_prefill_chunks_and_second_turn",  # 36 s
    "test_prefill.py::test_prefill_rows_do_not_depend_on_the_pass",  # 28 s
    "test_prefill.py::test_perplexity_matches_reference",  # 11 s
    "test_sample.py::test_kernel_script_runs_its_check",  # 50 s
    "test_penalty.py::test_engine_penalties_match_cpu[fast]",  # 28 s
}

# The files to start first, longest first (seconds of a whole run on the 2-core CI machine, fast
# set / slow set). pytest-xdist gives each worker whole files in this order (--dist loadfile
# --no-loadscope-reorder: its default order, by the number of tests a file, started the
# one-test compile check last, and the run waited minutes for it alone); a long file started
# last leaves the other core idle, so the long ones go first and the many short ones fill in.
LONGEST_FIRST = (
    "test_prefill.py",  # 26 / 248: token steps under the simulator
    "test_ptx.py",  # - / 132, on both cores (its own compile workers)
    "test_matmul.py",  # 125 / 19
    "test_simple.py",  # 107 / -
    "test_moe_rows.py",  # 11 / 81
    "test_constrain.py",  # 3 / 78
    "test_attention.py",  # 35 / 50
    "test_quality.py",  # - / 48 (and a minute a conversion, where the converter changed)
    "test_models.py",  # - / 46
    "test_tools.py",  # - / 46
    "test_embeddings.py",  # 44 / -
    "test_matvec.py",  # 40 / 39
    "test_penalty.py",  # 1 / 40
    "test_model.py",  # 5 / 36
    "test_logprobs.py",  # 31 / -
    "test_sample.py",  # 30 / 28
    "test_moe.py",  # 28 / 20
    "test_hub.py",  # 27 / -
)

MARKERS = {
    "gpu": "needs the real GPU (PYCALM_TEST_GPU=1); skipped under the simulator",
    "e2e": "a real model end to end (SmolLM2 / Qwen2.5-Coder, fetched once and cached)",
    "compile": "compiles the kernels for the GPU with numba's real compiler and ptxas",
    "slow": "minutes on a 2-core machine; left out of the default run (-m slow runs them)",
}

_FAST_SET = pytest.StashKey[bool]()  # the run is the default one, the fast set


def pytest_configure(config: pytest.Config) -> None:
    for name, about in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {about}")
    # NumPy's BLAS threads: each test process (and what it starts) gets its share of the cores.
    # Left at a thread a core, the workers oversubscribe them and OpenBLAS's waiting threads spin:
    # SmolLM2 on the CPU engine beside two busy processes ran 4.4-6.0 tok/s with 2 threads, 12.0
    # with 1 (17.9 alone). Set here, on the controller, before any NumPy is imported or any
    # pytest-xdist worker started; a value given in the environment stays.
    workers = getattr(config.option, "numprocesses", None)
    workers = workers if isinstance(workers, int) and workers > 0 else 1
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    # the default run is the fast set; on pytest-xdist workers -m comes from the controller
    if not config.option.markexpr and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        config.option.markexpr = "not slow"
        config.stash[_FAST_SET] = True


def _listed(item: pytest.Item, table: set[str]) -> bool:
    file = item.path.name
    function = getattr(item, "originalname", item.name)
    return bool({file, f"{file}::{function}", f"{file}::{item.name}"} & table)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        e2e = bool(E2E_FIXTURES.intersection(item.fixturenames)) or _listed(item, E2E_TESTS)
        compile_ = _listed(item, COMPILE)
        if e2e:
            item.add_marker("e2e")
        if compile_:
            item.add_marker("compile")
        if e2e or compile_ or (not GPU and _listed(item, SIMULATOR_SLOW)):
            item.add_marker("slow")
        gpu = item.get_closest_marker("gpu")
        if gpu and not GPU:
            why = gpu.kwargs.get("reason", "a test of the GPU")
            item.add_marker(pytest.mark.skip(reason=f"{why}: GPU only (PYCALM_TEST_GPU=1)"))
    # the long files first (a stable sort: each file's tests, and the other files, keep their order)
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if config.stash.get(_FAST_SET, False) and not config.option.collectonly:
        terminalreporter.write_line(
            "the fast set ran (-m 'not slow'); `python -m pytest -q -m slow` runs the rest"
        )


# ---------------------------------------------------------------------------------------------
# Real models converted once, shared by the e2e tests.
#
# A conversion is cached next to the fetched GGUF (tests/realmodels.py's cache folder) under a key
# made of the GGUF's sha256 and the sources of the modules that decide the file's bytes, so CI
# reruns reuse it while any change to the converter makes a fresh one (older ones are removed).

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
