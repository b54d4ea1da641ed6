"""The kernels' compile cache on disk: every kernel compiles once per machine, later runs load it.

Every kernel in pycalm.kernels is declared `@cuda.jit(cache=True)` (closure factories:
`cuda.jit(cache=True)(fn)`). numba-cuda then keeps each compiled (kernel, signature) as a data
file holding its PTX and cubin, listed in an index file per Python function, and a later process
loads the cubin instead of compiling. numba's index key covers the kernel function's own
bytecode, the values of its closure cells (so each specialisation a factory makes is its own
entry), the signature, the CUDA runtime version, the compute capability and the numba-cuda
version. It does not cover the device functions and intrinsics a kernel calls from another
module: a change in common.py alone would leave every stale kernel in place.

So pycalm chooses the folder, one a kernel module: CACHE_ROOT/kernels/NAME-KEY (`module_folder`),
where NAME is the module's name below pycalm.kernels (`skinny`, `simple.matvec`) and KEY hashes
the numba-cuda version and the text of the module and of every pycalm.kernels module it imports,
directly or through another (`module_key`; the imports are read from the source, at any depth
of it), and CACHE_ROOT is pycalm's cache folder (pycalm.paths.cache_dir: --cache-dir, else
$XDG_CACHE_HOME/pycalm). An edit to common.py gives every module that imports it a new, empty
folder; an edit to skinny.py only skinny's and its importers'. Nothing in an old folder is ever
read again. A device function a kernel gets from a module it does not import (a factory's
argument) is in the kernel's own key: closure_digest adds that module's KEY.
CACHE_ROOT/kernels/KEY (`folder`, KEY of every pycalm/kernels/**/*.py: `kernels_key`) holds
pycalm.gpu.precompile's marker files, which stand for the whole tree's kernels.

How (numba-cuda 0.30.4 internals, all set by `install()`, all confined to pycalm's kernels, so
the caching of anyone else's numba code in the same process is left as it was):
- Where. numba-cuda asks a list of "cache locator" classes, in order, where a function's cache
  lives (numba.cuda.core.caching.CacheImpl._locator_classes, here the class attribute of
  numba.cuda.dispatcher.CUDACacheImpl; its first entry honours NUMBA_CACHE_DIR, the next one the
  source file's __pycache__). `KernelsLocator` goes first and answers only for functions whose
  source file is in pycalm/kernels/ or a folder below it. numba builds the locator when the kernel is declared (at
  import of its module), so `set_root` must run before the kernel modules are imported; the CLI
  calls it first thing.
- The key. numba hashes the closure cells by pickling them, and a pickled device function carries
  the numba intrinsics it calls (pycalm.kernels.common's inline PTX), each with a uuid drawn
  afresh in every process: the key of a factory's kernel (matvec, qkv, matmul, ...) would never
  match the next run's. CUDACache._index_key is wrapped so that, for a KernelsLocator's function,
  the cells are described by `closure_digest` instead (values by repr, device functions by their
  code and their own cells); the rest of the key is numba's.
- Several processes at once. numba adds an entry to a function's index file by reading it,
  adding the entry and writing it back, and names the entry's data file by the index's length:
  two processes adding entries to one index at once (pycalm.gpu.precompile's workers, which compile
  the specialisations of one factory side by side) would lose an entry or, worse, write two
  kernels to one data file, which the index of one of them then names. IndexDataCacheFile.save
  is wrapped so that, in a pycalm kernel folder, it runs under an exclusive lock on the folder's
  `.lock` file (fcntl; where there is none, as numba does it).
- Loading. numba's Cache.load_overload first refreshes the target context (loads every typing
  and lowering registry numba-cuda has, importing numba.cuda.np's modules and, through them,
  scipy.linalg where scipy is installed: 0.88 s of a warm CLI run on the H200 machine), then
  rebuilds the kernel from its cached cubin, which needs no registry (numba-cuda 0.30.4:
  CUDACacheImpl.rebuild is _Kernel._rebuild(**payload); a compile refreshes the context itself,
  and so does a lowering lookup that misses). For a KernelsLocator's function the wrapper loads
  without the refresh.
Under the CUDA simulator nothing compiles and nothing is cached.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import os
import re
import tempfile
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

KERNELS_DIR = (
    Path(__file__).resolve().parent.parent / "kernels"
)  # pycalm/kernels/: the sources the key hashes

# the cache root of this process (None: pycalm.paths.cache_dir()); chosen once, by set_root,
# before any kernel module is imported: numba fixes each kernel's folder when it is declared
_root: Path | None = None
_folders: set[str] = set()  # the folders KernelsLocator has answered with (their saves take the lock)


def set_root(root: str | os.PathLike[str]) -> None:
    """Keep the compiled kernels under root/kernels/KEY (root: pycalm's cache folder). Takes effect
    for the kernel modules imported after it."""
    global _root
    _root = Path(root)


def _digest(texts: dict[str, bytes]) -> str:
    """A hex digest of the numba-cuda version and source files (relative path -> text)."""
    import numba_cuda

    h = hashlib.sha256(f"numba-cuda {numba_cuda.__version__}\n".encode())
    for rel in sorted(texts):
        h.update(f"{rel} {len(texts[rel])}\n".encode())
        h.update(texts[rel])
    return h.hexdigest()[:16]


def kernels_key(folder: Path = KERNELS_DIR) -> str:
    """A hex digest of every *.py file in `folder` and the folders below it (path and text) and
    the numba-cuda version: it changes whenever any kernel module, or a helper it imports from
    its neighbours, changes."""
    return _digest({path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*.py")})


@functools.cache
def _key() -> str:
    return kernels_key()


def _kernels_root() -> Path:
    from pycalm.paths import cache_dir

    return (_root or cache_dir()) / "kernels"


def folder() -> Path:
    """The folder of this tree's precompile markers: ROOT/kernels/KEY (KEY: every kernel module)."""
    return _kernels_root() / _key()


_IMPORT = re.compile(r"[ \t]*(from[ \t]+\S+[ \t]+import|import)[ \t]")  # a line that starts an import


def _import_statements(text: str) -> Iterator[str]:
    """Each import statement of a module's source, at any depth (a function's lazy import too),
    as text that parses alone: its lines (to the closing parenthesis, or past a backslash),
    dedented. Parsing these, not the whole module, keeps a kernel module's key at about 1 ms."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not _IMPORT.match(lines[i]):
            i += 1
            continue
        j, depth = i, lines[i].count("(") - lines[i].count(")")
        while (depth > 0 or lines[j].endswith("\\")) and j + 1 < len(lines):
            j += 1
            depth += lines[j].count("(") - lines[j].count(")")
        yield textwrap.dedent("\n".join(lines[i : j + 1]))
        i = j + 1


@functools.cache
def _imported_names(text: str, package: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The dotted names below pycalm.kernels that a module's source imports from any statement in
    it, each as its parts after "pycalm.kernels"; a `from M import N` gives M and M.N (N may be
    a module). package: the module's package, for relative imports. A line that only looks like
    an import (in a docstring) and does not parse is skipped; one that parses only adds a key."""
    nodes = []
    for statement in _import_statements(text):
        with contextlib.suppress(SyntaxError):
            nodes.extend(ast.parse(statement).body)
    return _names_of(nodes, package)


def _names_of(nodes: Iterable[ast.AST], package: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The names below pycalm.kernels that the import statements among `nodes` import (as
    _imported_names gives them)."""
    names: set[tuple[str, ...]] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            dotted = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            dotted = [module] + [[*module, alias.name] for alias in node.names]
        else:
            continue
        names.update(tuple(d[2:]) for d in dotted if d[:2] == ["pycalm", "kernels"])
    return tuple(sorted(names))


def _imports(path: Path, text: bytes, top: Path) -> frozenset[Path]:
    """The files of the pycalm.kernels modules (package `top`) that the module at `path`, of source
    `text`, imports."""
    return _files(
        _imported_names(text.decode(), ("pycalm", "kernels", *path.parent.relative_to(top).parts)), top
    )


@functools.cache
def _files(names: tuple[tuple[str, ...], ...], top: Path) -> frozenset[Path]:
    """The module files of package `top` that dotted names (parts below it) name."""
    found = set()
    for parts in names:
        rel = top.joinpath(*parts)
        for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
            if candidate.is_file():
                found.add(candidate)
    return frozenset(found)


def module_key(path: Path, top: Path = KERNELS_DIR) -> str:
    """A hex digest of the numba-cuda version and the text of the kernel module at `path` and of
    every module of package `top` (pycalm/kernels/) it imports, directly or through another."""
    texts: dict[str, bytes] = {}  # relative path -> text of each module reached
    todo = [path.resolve()]
    while todo:
        module = todo.pop()
        rel = module.relative_to(top).as_posix()
        if rel not in texts:
            texts[rel] = module.read_bytes()
            todo.extend(_imports(module, texts[rel], top))
    return _digest(texts)


@functools.cache
def _module_key(py_file: str) -> str:
    return module_key(Path(py_file).resolve())


def module_folder(py_file: str | os.PathLike[str]) -> Path:
    """Where the kernels of the module at py_file (in pycalm/kernels/) are cached: ROOT/kernels/
    NAME-KEY."""
    path = Path(py_file).resolve()
    name = ".".join(path.relative_to(KERNELS_DIR).with_suffix("").parts)
    return _kernels_root() / f"{name}-{_module_key(str(path))}"


def folders() -> list[Path]:
    """This tree's folders: folder() (the markers), then every kernel module's."""
    return [folder(), *(module_folder(p) for p in sorted(KERNELS_DIR.rglob("*.py")))]


def cached_kernels() -> int:
    """How many compiled (kernel, signature) entries this tree's folders hold: the difference over
    a run is the number of kernels that run compiled (0: everything came from the cache)."""
    return sum(sum(1 for _ in f.glob("*.nbc")) for f in folders() if f.is_dir())


def install() -> None:
    """Make numba-cuda cache pycalm's kernels in folder() (idempotent; not under the simulator)."""
    import numba_cuda
    from numba.cuda.core.caching import IndexDataCacheFile, _CacheLocator, _SourceFileBackedLocatorMixin
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class KernelsLocator(_SourceFileBackedLocatorMixin, _CacheLocator):
        """numba's locator protocol for the functions of pycalm/kernels/**/*.py: the module's
        folder (module_folder) as the place, its key as the source stamp (numba drops an index
        whose stamp differs; the folder's name already carries the key, so a touched file costs
        nothing)."""

        def __init__(self, py_func: object, py_file: str) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(module_folder(py_file))
            self._stamp = _module_key(str(Path(py_file).resolve()))

        def get_cache_path(self) -> str:
            return self._cache_path

        def get_source_stamp(self) -> str:
            return self._stamp

        @classmethod
        def from_function(cls, py_func: object, py_file: str) -> KernelsLocator | None:
            if not Path(py_file).resolve().is_relative_to(KERNELS_DIR):
                return None  # not a pycalm kernel: numba's own locators decide
            self = cls(py_func, py_file)
            if self._cache_path not in _folders:  # checked once a process, not once a kernel
                try:
                    self.ensure_cache_path()  # makes the folder and checks that it is writable
                except OSError:
                    # an unwritable cache folder: a fresh temporary one, never numba's __pycache__
                    # beside the source (whose key would miss a change in another kernel module)
                    self._cache_path = str(Path(_temporary_folder()) / Path(self._cache_path).name)
            _folders.add(self._cache_path)
            return self

    locators = CUDACacheImpl._locator_classes
    if any(c.__name__ == KernelsLocator.__name__ for c in locators):
        return
    CUDACacheImpl._locator_classes = [KernelsLocator, *locators]
    numba_key = CUDACache._index_key

    def index_key(self: CUDACache, sig: object, codegen: object) -> tuple:
        if not isinstance(self._impl.locator, KernelsLocator):
            return numba_key(self, sig, codegen)
        # numba's key (Cache._index_key, CUDACache._index_key) with closure_digest for the cells
        key = (sig, codegen.magic_tuple(), numba_cuda.__version__, closure_digest(self._py_func))
        if self._launch_config_key is not None:
            key += (("launch_config", self._launch_config_key),)
        return key

    CUDACache._index_key = index_key

    numba_save = IndexDataCacheFile.save

    def save(self: IndexDataCacheFile, key: object, data: object) -> None:
        if self._cache_path not in _folders:
            return numba_save(self, key, data)
        with _locked(Path(self._cache_path) / ".lock"):
            return numba_save(self, key, data)

    IndexDataCacheFile.save = save

    numba_load = CUDACache.load_overload

    def load_overload(self: CUDACache, sig: object, target_context: object) -> object:
        if not isinstance(self._impl.locator, KernelsLocator):
            return numba_load(self, sig, target_context)
        # numba's Cache.load_overload without its target_context.refresh() (see the docstring)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)

    CUDACache.load_overload = load_overload


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (made if missing) while within; no lock without fcntl."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def closure_digest(fn: object) -> str:
    """A digest of a kernel function's bytecode and closure cells that is the same in every
    process: plain values by type and repr, device functions (numba dispatchers) by their own
    bytecode and cells and, for a pycalm kernel module's, that module's key (module_key: what its
    code refers to by name). What the kernel's own code refers to by name is in its folder's key."""
    h = hashlib.sha256(fn.__code__.co_code)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        value = cell.cell_contents
        inner = getattr(value, "py_func", None)
        if inner is not None:
            text = f"{inner.__qualname__} {closure_digest(inner)} {sorted(value.targetoptions.items())!r}"
            source = Path(inner.__code__.co_filename).resolve()
            if source.is_relative_to(KERNELS_DIR) and source.is_file():
                text += f" {_module_key(str(source))}"
        else:
            text = f"{type(value).__qualname__} {value!r}"
            if " at 0x" in text:  # a repr with an address: the same in no two processes
                raise TypeError(f"{fn.__qualname__}: closure cell {name} has no stable repr: {text}")
        h.update(f"{name}={text}\n".encode())
    return h.hexdigest()


@functools.cache
def _temporary_folder() -> str:
    return tempfile.mkdtemp(prefix="pycalm-kernels-")
