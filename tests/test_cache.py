"""The kernels' compile cache (pycalm.gpu.kernel_cache): its folder's key, its per-kernel key, and a
second run that compiles nothing.

numba-cuda's cache needs a GPU to compile or load (its key holds the device's compute
capability), so the run-twice test runs with PYCALM_TEST_GPU=1 only; the keys are checked here,
the per-kernel one in fresh processes with the simulator off, as numba computes it on a GPU.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from gpu import gpu_only

from pycalm.gpu import kernel_cache as cache

REPO = Path(__file__).resolve().parent.parent


def test_folder_key_follows_every_kernel_module(tmp_path):
    kernels = tmp_path / "kernels"
    shutil.copytree(cache.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    key = cache.kernels_key(kernels)
    assert key == cache.kernels_key(cache.KERNELS_DIR)  # the text decides, not the place
    (kernels / "notes.txt").write_text("not a kernel module")
    os.utime(kernels / "step.py")  # a touched file, same text
    assert cache.kernels_key(kernels) == key
    # a change in a helper module that no kernel's own source shows (common.py's device code)
    common = kernels / "common.py"
    common.write_text(common.read_text() + "\n# changed\n")
    changed = cache.kernels_key(kernels)
    assert changed != key
    (kernels / "extra.py").write_text("")  # a new module
    assert cache.kernels_key(kernels) not in (key, changed)


def test_folder_is_under_the_root_and_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_root", None)
    cache.set_root(tmp_path)
    assert cache.folder() == tmp_path / "kernels" / cache.kernels_key()
    assert cache.cached_kernels() == 0  # no folder yet: nothing cached


_DIGESTS = r"""
from pycalm.gpu import kernel_cache as cache
from pycalm.kernels import attention, matvec, qkv
for kernel in (attention.attention_kernel(64, 3, "fp16"), attention.attention_kernel(64, 3, "fp8"),
               matvec.matvec_kernel("fp16"), matvec.matvec_kernel("fp8"), qkv.qkv_rope_kernel("fp16", 16, "fp16")):
    print(cache.closure_digest(kernel.py_func))
"""


def test_kernel_key_is_the_same_in_every_process():
    """numba's own key pickles the closure cells, and the intrinsics inside a factory's device
    functions carry a uuid drawn in each process; closure_digest must not."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO)
    runs = []
    for seed in ("1", "2"):
        env["PYTHONHASHSEED"] = seed
        p = subprocess.run(
            [sys.executable, "-c", _DIGESTS], capture_output=True, text=True, env=env, timeout=300
        )
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(p.stdout.split())
    assert len(runs[0]) == 5 and runs[0] == runs[1]
    assert len(set(runs[0])) == 5  # each specialisation is its own entry


@gpu_only("numba caches only on a GPU")
def test_second_cli_run_compiles_nothing(tmp_path):
    """The CLI twice on one cache folder: the first run compiles and says so, the second loads
    every kernel from the cache ('cache hit'); a changed kernel module would name a new folder."""
    from tiny_models import make_hf_llama

    from pycalm.convert.main import convert

    src = make_hf_llama(tmp_path, dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    model = convert(src.path, tmp_path / "tiny.pycalm", "fp16", progress=False)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    lines, outs = [], []
    for _ in range(2):
        p = subprocess.run(
            [sys.executable, "-m", "pycalm.generate", str(model), "-i", "hello", "-n", "8", "-t", "0"]
            + ["--device", "gpu", "--cache-dir", str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        lines.append(p.stderr.strip().splitlines()[-1])
        outs.append(p.stdout)
    assert re.search(r"compile [0-9.]+ s \(\d+ kernels compiled( in \d+ processes)?\)", lines[0]), lines[0]
    assert "(cache hit)" in lines[1], lines[1]
    assert outs[0] == outs[1]
    assert list((tmp_path / "cache" / "kernels").iterdir()) == [
        tmp_path / "cache" / "kernels" / cache.kernels_key()
    ]


_LOAD = r"""
import sys
from numba import cuda
from pycalm.gpu import kernel_cache as cache
cache.set_root(sys.argv[1])
cache.install()
from pycalm.kernels import step


class Context:  # what load_overload may use of a target context: codegen() for the key
    refreshed = 0

    def refresh(self):
        Context.refreshed += 1

    def codegen(self):
        return type("Codegen", (), {"magic_tuple": lambda self: ("nvptx64", "sm_90", "")})()


def other(state, out):  # not a pycalm kernel: numba's own locators and load_overload
    out[0] = state[0]


other = cuda.jit(cache=True)(other)
for kernel in (step.advance_kernel, other):
    kernel.enable_caching()
    got = kernel._cache.load_overload("void(int32[::1], int32[::1])", Context())
    print(type(kernel._cache._impl.locator).__name__, got, Context.refreshed)
"""


def test_pycalm_kernels_load_without_refreshing_numba_target_context(tmp_path):
    """A cached pycalm kernel loads without numba's target-context refresh (every typing and
    lowering registry, scipy included where installed); anyone else's numba function keeps
    numba's load_overload. Simulator off, no GPU needed: an empty cache answers None."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO)
    script = tmp_path / "load.py"  # a file, so that numba's own locator takes `other`
    script.write_text(_LOAD)
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    ours, theirs = p.stdout.splitlines()
    assert ours == "KernelsLocator None 0"  # looked up, found nothing, no refresh
    assert theirs.split()[1:] == ["None", "1"]  # numba's path: refreshed first
    assert theirs.split()[0] != "KernelsLocator"
