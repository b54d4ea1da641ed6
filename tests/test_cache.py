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


def test_module_key_follows_the_module_and_what_it_imports(tmp_path):
    """A kernel module's folder key changes with its own text and with the text of the kernel
    modules it imports, directly or through another, and with nothing else."""
    kernels = tmp_path / "kernels"
    shutil.copytree(cache.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    (kernels / "lazy.py").write_text("def f():\n    from pycalm.kernels.simple import decode\n")
    (kernels / "simple" / "rel.py").write_text("from . import decode\nfrom .. import step\n")

    def keys() -> dict[str, str]:
        names = ("skinny", "matmul", "attention", "lazy", "simple/rel", "simple/matvec")
        return {n: cache.module_key(kernels / f"{n}.py", kernels) for n in names}

    before = keys()
    assert before["skinny"] == cache.module_key(cache.KERNELS_DIR / "skinny.py")  # the text decides
    assert len(set(before.values())) == len(before)

    def edit(name: str) -> set[str]:
        path = kernels / name
        path.write_text(path.read_text() + "\n# changed\n")
        after = keys()
        changed = {n for n in after if after[n] != before[n]}
        before.update(after)
        return changed

    assert edit("attention.py") == {"attention", "skinny"}  # skinny through rows and qkv
    assert edit("matmul.py") == {"matmul", "skinny"}  # skinny imports matmul
    assert edit("tensorcore.py") == {"matmul", "skinny", "attention"}  # through matmul too
    assert edit("simple/decode.py") == {
        "lazy",
        "simple/rel",
        "simple/matvec",
    }  # a lazy import, a relative one
    assert edit("step.py") == {"simple/rel"}
    assert edit("common.py") == set(before)  # every one of them, through some import


def test_imports_read_from_the_statements_are_the_whole_modules():
    """For every kernel module, the pycalm.kernels names its import statements give (what the key
    reads, statement by statement) are those of an ast of the whole module."""
    import ast

    top = cache.KERNELS_DIR
    for path in sorted(top.rglob("*.py")):
        package = ("pycalm", "kernels", *path.parent.relative_to(top).parts)
        whole = cache._names_of(ast.walk(ast.parse(path.read_text())), package)
        assert cache._imported_names(path.read_text(), package) == whole, path.name
    assert cache._imported_names(
        "from pycalm.kernels.common import (\n    a,\n    b,\n)\n", ("pycalm", "kernels")
    ) == (("common",), ("common", "a"), ("common", "b"))


def test_folders_are_under_the_root_and_the_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_root", None)
    cache.set_root(tmp_path)
    assert cache.folder() == tmp_path / "kernels" / cache.kernels_key()
    skinny = cache.KERNELS_DIR / "skinny.py"
    assert cache.module_folder(skinny) == tmp_path / "kernels" / f"skinny-{cache.module_key(skinny)}"
    assert cache.module_folder(cache.KERNELS_DIR / "simple" / "matvec.py").name.startswith("simple.matvec-")
    assert cache.cached_kernels() == 0  # no folder yet: nothing cached
    for f in cache.folders()[:2]:
        f.mkdir(parents=True)
        (f / "a.nbc").write_bytes(b"")
    (tmp_path / "kernels" / "skinny-0000000000000000").mkdir()  # another tree's: not counted
    (tmp_path / "kernels" / "skinny-0000000000000000" / "a.nbc").write_bytes(b"")
    assert cache.cached_kernels() == 2


_HELD = r"""
from pathlib import Path
from pycalm.gpu import kernel_cache as cache
from pycalm.kernels import matvec
kernel = matvec.matvec_kernel("q4").py_func
print(cache.closure_digest(kernel))
seen = set()
def other_key(py_file):
    seen.add(Path(py_file).name)
    return "0" * 16
cache._module_key = other_key
print(cache.closure_digest(kernel), *sorted(seen))
"""


def test_kernel_key_names_the_module_of_a_device_function_it_holds():
    """A factory's kernel that holds another module's device function (a closure cell) has that
    module's key in its own: an edit there that the function's bytecode does not show (a constant
    it reads by name) makes a new entry. Simulator off, as numba computes the key on a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, "-c", _HELD], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (digest,), (other, *modules) = (line.split() for line in p.stdout.splitlines())
    assert other != digest and "rowgroup.py" in modules


@gpu_only("numba caches only on a GPU")
def test_second_cli_run_compiles_nothing(tmp_path, monkeypatch):
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
    monkeypatch.setattr(cache, "_root", tmp_path / "cache")
    made = set((tmp_path / "cache" / "kernels").iterdir())
    assert cache.folder() in made and made <= set(cache.folders())  # the markers' and the modules' folders


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
