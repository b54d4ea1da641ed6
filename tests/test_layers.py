"""The package's layers: imports flow one way, from the app down to the model, and no two
modules import each other, directly or around a cycle (function-level imports count too).

    pycalm.generate / serve / cache / __main__      the `python -m` entry points
    pycalm.app        CLI, API, server, downloads, model cache
    pycalm.gpu        GPU engine, multi-token forward, graphs, kernel compile cache
    pycalm.convert    HF / GGUF conversion, q4 policy          (beside gpu: neither imports the other)
    pycalm.kernels    @cuda.jit kernels and their launchers
    pycalm.cpu        the NumPy reference (the spec), CPU engine, sampler
    pycalm.batch      paged-KV block manager, continuous-batching scheduler   (beside cpu)
    pycalm.model      config, formats, the model file, tokenizer
    pycalm.errors, pycalm.paths
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pycalm"
LAYERS = {
    "errors": 0,
    "paths": 0,
    "model": 1,
    "cpu": 2,
    "batch": 2,
    "kernels": 3,
    "gpu": 4,
    "convert": 4,
    "app": 5,
    "generate": 6,
    "serve": 6,
    "cache": 6,
    "__main__": 6,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every pycalm module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pycalm")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pycalm"):
            for a in node.names:  # `from pycalm.gpu import engine` imports pycalm.gpu.engine
                sub = f"{node.module}.{a.name}"
                found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else node.module)
    return found


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> tuple[int, str]:
    top = module.split(".")[1] if "." in module else ""
    return LAYERS[top], top


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "pycalm"))
def test_imports_flow_down(module):
    """A module imports from its own layer or below; gpu and convert never from each other.
    (`pycalm` itself, the package's face, loads pycalm.app.api on first use of pycalm.load.)"""
    rank, top = layer(module)
    for target in MODULES[module]:
        if target == "pycalm":  # __version__
            continue
        t_rank, t_top = layer(target)
        assert t_rank <= rank, f"{module} (layer {top}) imports {target} (layer {t_top}, above it)"
        assert {top, t_top} != {"gpu", "convert"}, f"{module} imports its sibling layer: {target}"


def test_no_import_cycles():
    """The module graph, lazy imports included, is acyclic."""
    graph = {m: {t for t in deps if t in MODULES and t != m and t != "pycalm"} for m, deps in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t) :] + [t] if t in path else [m, t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_every_module_has_a_layer():
    for m in MODULES:
        if m != "pycalm":
            layer(m)
