"""Fuzz the file readers: thousands of mutated model files, each read must end in PycalmError.

The readers are the pycalm model file's (open_model, then every tensor read) and the GGUF
converter's front end (from_gguf: metadata, tensor infos, vocabulary; then every planned tensor
read and dequantized, which is everything the conversion reads from the file). Each is fed files
made from a small valid one (tests/tiny_models.py) by a seeded mutation: truncation at the
boundaries of the file's fields, flipped bytes, lying offsets, shapes, counts and lengths
(2**63, 10**12, one past the file), wrong dtypes and value types, a header that is not a JSON
object. Every input must be read whole or rejected with a PycalmError whose message is one line
and names the file: never another exception, a hang, or memory beyond the file's size.

The inputs run in a worker process (this file run as a script) with its address space limited
(RLIMIT_AS) to what it holds after reading the valid files plus MEMORY_MARGIN, and a timer per
input, so an allocation sized by an unchecked count fails as a MemoryError and a loop over one
as a timeout, both reported as failures. Each input is a function of (seed, index): a failure
names both, and the worker keeps the failing file.

CI runs FUZZ_INPUTS inputs of each reader (about 15 s each on a CI core); PYCALM_FUZZ_INPUTS=N runs N each,
and PYCALM_FUZZ_SEED picks another seed.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

FUZZ_INPUTS = 2500  # inputs per reader in CI
FUZZ_SEED = 16
MEMORY_MARGIN = 64 << 20  # bytes the worker may allocate beyond its warm state and the file
INPUT_SECONDS = 5.0  # one input's time limit (a valid tiny file reads in milliseconds)

BIG = (2**63, 2**64 - 1, 10**12, 2**40, 2**32)  # counts, lengths and offsets that lie

# =============================================================================================
# the pycalm model file (safetensors): 8-byte header length, JSON header, tensor bytes


def _split_safetensors(data: bytes) -> tuple[int, dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def _join_safetensors(header: object, body: bytes, raw: bytes | None = None) -> bytes:
    if raw is None:
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _lie(rng: np.random.Generator, value: int, size: int) -> int:
    """A count, length or offset that does not fit a file of `size` bytes (or is just off)."""
    return int(rng.choice([*BIG, size, size + 1, value + 1, max(value - 1, 0), 0, value * 2 + 7]))


def _json_lie(rng: np.random.Generator) -> object:
    """A JSON value of the wrong kind or size for wherever it goes."""
    lies = [None, -1, 0, 1.5, "x", [], {}, True, 2**63, 10**12, [2**40, 2**40], ["3"], [-1]]
    return lies[int(rng.integers(len(lies)))]


def mutate_safetensors(data: bytes, rng: np.random.Generator) -> tuple[str, bytes]:
    """One mutation of a pycalm file: (what was done, the new bytes)."""
    n, header, body = _split_safetensors(data)
    names = [k for k in header if k != "__metadata__"]
    kind = rng.choice(["truncate", "prefix", "flip_header", "flip_any", "json", "json", "json", "entry"])
    if kind == "truncate":
        ends = [header[k]["data_offsets"] for k in names]
        cuts = [0, 1, 7, 8, 9, 8 + n - 1, 8 + n, 8 + n + 1, len(data) - 1]
        cuts += [8 + n + int(e) + d for pair in ends for e in pair for d in (-1, 0, 1)]
        cut = int(rng.choice(cuts)) if rng.random() < 0.8 else int(rng.integers(len(data)))
        return f"truncate at {cut}", data[: max(cut, 0)]
    if kind == "prefix":
        value = int(rng.choice([*BIG, 0, n - 1, n + 1, len(data), len(data) - 8, 100 * 1024 * 1024 + 1]))
        return f"header length {value}", struct.pack("<Q", value % 2**64) + data[8:]
    if kind in ("flip_header", "flip_any"):
        out = bytearray(data)
        top = 8 + n if kind == "flip_header" else len(data)
        where = rng.integers(0, top, int(rng.integers(1, 9)))
        for i in where:
            out[i] ^= int(rng.integers(1, 256))
        return f"{kind} at {sorted(where.tolist())}", bytes(out)
    meta = header.get("__metadata__", {})
    if kind == "json":
        what = int(rng.integers(8))
        if what == 0:  # not an object, or nested past any parser's stack
            raw = rng.choice([b"[]", b"1", b'"x"', b"null", b"[" * 100_000, b'{"a":' * 50_000, b"\xff\xfe"])
            raw = bytes(raw) + b" " * (-len(raw) % 8)
            return f"header {raw[:12]!r}", _join_safetensors(None, body, raw)
        if what == 1:  # __metadata__ of the wrong kind
            header["__metadata__"] = _json_lie(rng)
            return f"__metadata__ = {header['__metadata__']!r}", _join_safetensors(header, body)
        key = str(rng.choice(sorted(meta)))
        if what <= 4:  # one config field lies
            config = json.loads(meta["pycalm.config"])
            field = str(rng.choice(sorted(config)))
            config[field] = _json_lie(rng)
            meta["pycalm.config"] = json.dumps(config)
            return f"config {field} = {config[field]!r}", _join_safetensors(header, body)
        if what == 5:  # the config is not a JSON object
            meta["pycalm.config"] = str(rng.choice(["[]", "1", "null", "{", '"x"', "[" * 100_000]))
            return f"config {meta['pycalm.config'][:12]!r}", _join_safetensors(header, body)
        if what == 6:  # a metadata value of the wrong kind or missing
            if rng.random() < 0.5:
                del meta[key]
                return f"no metadata {key}", _join_safetensors(header, body)
            meta[key] = _json_lie(rng)
            return f"metadata {key} = {meta[key]!r}", _join_safetensors(header, body)
        meta[key] = str(rng.choice(["2", "", "x", "\x00"]))
        return f"metadata {key} = {meta[key]!r}", _join_safetensors(header, body)
    # one tensor entry lies: its offsets, shape or dtype, or the entry itself
    name = str(rng.choice(names))
    entry = header[name]
    begin, end = entry["data_offsets"]
    what = int(rng.integers(7))
    if what == 0:
        choices = [[begin, _lie(rng, end, len(body))], [_lie(rng, begin, len(body)), end], [end, begin]]
        choices += [[0, end - begin], [begin + 1, end + 1], [-1, end], [begin], "x", [begin, end, 0]]
        entry["data_offsets"] = choices[int(rng.integers(len(choices)))]
    elif what == 1:
        shape = list(entry["shape"])
        choices = [[2**40, 2**40], [2**62, 4], [-1, *shape], [], [*shape, 0], ["3"], 3.5, [1.5]]
        choices += [[d + 1 for d in shape], [*shape, 1], [2**63] * 3, [len(body) + 1]]
        entry["shape"] = choices[int(rng.integers(len(choices)))]
    elif what == 2:
        entry["dtype"] = str(rng.choice(["F64", "I8", "BF16", "XYZ", "F8_E4M3", "U32", "", "f32"]))
    elif what == 3:
        entry["dtype"] = _json_lie(rng)
    elif what == 4:
        header[name] = _json_lie(rng)
    elif what == 5:
        del header[name]
    else:
        del entry[str(rng.choice(sorted(entry)))]
    return f"tensor {name} = {header.get(name)!r}", _join_safetensors(header, body)


# =============================================================================================
# GGUF: magic, version, tensor count, key/value count, key/values, tensor infos, aligned data


class GGUFLayout:
    """Where each field of a GGUF file's header sits: (offset, size) of every count, length,
    type and offset, so that a mutation can make exactly one of them lie."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.u64: list[tuple[str, int]] = []  # (role, offset) of 8-byte counts, lengths, offsets
        self.u32: list[tuple[str, int]] = []  # (role, offset) of 4-byte types, n_dims, version
        self.strings: list[int] = []  # offsets of string bytes (after their length)
        self.bounds: list[int] = [0, 4]  # offsets where a field starts or ends
        self.pos = 4
        self._u32("version")
        n_tensors = self._u64("tensor count")
        n_kv = self._u64("kv count")
        for _ in range(n_kv):
            self._string("key")
            self._value(self._u32("value type"))
        for _ in range(n_tensors):
            self._string("tensor name")
            n_dims = self._u32("n_dims")
            for _ in range(n_dims):
                self._u64("dim")
            self._u32("tensor type")
            self._u64("tensor offset")
        self.header_end = self.pos

    def _u32(self, role: str) -> int:
        self.u32.append((role, self.pos))
        (value,) = struct.unpack_from("<I", self.data, self.pos)
        self.pos += 4
        self.bounds.append(self.pos)
        return value

    def _u64(self, role: str) -> int:
        self.u64.append((role, self.pos))
        (value,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        self.bounds.append(self.pos)
        return value

    def _string(self, role: str) -> None:
        n = self._u64(role + " length")
        self.strings.append(self.pos)
        self.pos += n
        self.bounds.append(self.pos)

    def _value(self, vtype: int) -> None:
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vtype == 8:
            self._string("string value")
        elif vtype == 9:
            etype = self._u32("array type")
            for _ in range(self._u64("array count")):
                self._value(etype)
        else:
            self.pos += sizes[vtype]
            self.bounds.append(self.pos)


def mutate_gguf(data: bytes, layout: GGUFLayout, rng: np.random.Generator) -> tuple[str, bytes]:
    """One mutation of a GGUF file: (what was done, the new bytes)."""
    kind = rng.choice(["truncate", "u64", "u64", "u32", "flip_header", "flip_any", "utf8"])
    out = bytearray(data)
    if kind == "truncate":
        cut = int(rng.choice(layout.bounds)) if rng.random() < 0.8 else int(rng.integers(len(data)))
        return f"truncate at {cut}", data[:cut]
    if kind == "u64":
        role, at = layout.u64[int(rng.integers(len(layout.u64)))]
        (value,) = struct.unpack_from("<Q", data, at)
        lie = _lie(rng, value, len(data)) % 2**64
        struct.pack_into("<Q", out, at, lie)
        return f"{role} at {at}: {value} -> {lie}", bytes(out)
    if kind == "u32":
        role, at = layout.u32[int(rng.integers(len(layout.u32)))]
        (value,) = struct.unpack_from("<I", data, at)
        lie = int(rng.choice([value + 1, max(value - 1, 0), 0, 5, 8, 9, 13, 39, 255, 2**31, 2**32 - 1]))
        struct.pack_into("<I", out, at, lie)
        return f"{role} at {at}: {value} -> {lie}", bytes(out)
    if kind == "utf8":
        at = layout.strings[int(rng.integers(len(layout.strings)))]
        out[at] = 0xFF
        return f"invalid UTF-8 at {at}", bytes(out)
    top = layout.header_end if kind == "flip_header" else len(data)
    where = rng.integers(0, top, int(rng.integers(1, 9)))
    for i in where:
        out[i] ^= int(rng.integers(1, 256))
    return f"{kind} at {sorted(where.tolist())}", bytes(out)


# =============================================================================================
# the readers, as the engine and the converter call them


def read_pycalm(path: Path) -> None:
    from pycalm.model.loader import open_model

    with open_model(path) as model:
        for name in model.names():
            model.tensor(name)


def read_gguf(path: Path) -> None:
    from pycalm.convert.common import Source
    from pycalm.convert.gguf import from_gguf

    conv = from_gguf(path, "fp16")
    for item in conv.plan.values():
        if isinstance(item, Source):
            item.take(np.arange(item.rows))
        else:
            item()


# =============================================================================================
# the worker: python tests/test_fuzz_files.py FORMAT SEED_FILE FOLDER SEED FIRST COUNT


class _Timeout(Exception):
    pass


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def worker(fmt: str, seed_file: Path, folder: Path, seed: int, first: int, count: int) -> dict:
    """Read `count` mutations of seed_file; the summary and the failures, as a dict."""
    import resource
    import signal

    from pycalm.errors import PycalmError

    data = seed_file.read_bytes()
    read = read_pycalm if fmt == "pycalm" else read_gguf
    layout = GGUFLayout(data) if fmt == "gguf" else None
    target = folder / f"input.{fmt}"
    target.write_bytes(data)
    for _ in range(3):  # warm: every import and first-use allocation happens before the limit
        read(target)
    limit = _vm_size() + MEMORY_MARGIN + 4 * len(data)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def on_alarm(signum: int, frame: object) -> None:
        raise _Timeout()

    signal.signal(signal.SIGALRM, on_alarm)
    counts = {"inputs": 0, "read whole": 0, "rejected": 0}
    failures = []
    for index in range(first, first + count):
        rng = np.random.default_rng([seed, index])
        if fmt == "pycalm":
            what, mutated = mutate_safetensors(data, rng)
        else:
            what, mutated = mutate_gguf(data, layout, rng)
        target.write_bytes(mutated)
        # the input in hand, for the report should the worker itself die on it
        (folder / "current.txt").write_text(f"#{index} {what}")
        problem = None
        signal.setitimer(signal.ITIMER_REAL, INPUT_SECONDS)
        try:
            read(target)
            counts["read whole"] += 1
        except PycalmError as e:
            message = str(e)
            if "\n" in message or "\r" in message:
                problem = f"PycalmError message of several lines: {message!r}"
            elif target.name not in message:
                problem = f"PycalmError message does not name the file: {message!r}"
            counts["rejected"] += 1
        except _Timeout:
            problem = f"no answer in {INPUT_SECONDS} s"
        except MemoryError:
            problem = f"MemoryError: more than {MEMORY_MARGIN >> 20} MiB beyond the warm reader"
        except BaseException as e:  # noqa: BLE001 - anything else is what the fuzz test finds
            problem = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        counts["inputs"] += 1
        if problem:
            keep = folder / f"failure-{seed}-{index}.{fmt}"
            keep.write_bytes(mutated)
            failures.append({"index": index, "mutation": what, "problem": problem, "file": str(keep)})
    return {**counts, "failures": failures}


def run_worker(fmt: str, seed_file: Path, folder: Path, seed: int, count: int) -> dict:
    """The worker in a process of its own (its memory limit and timers stay there)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, __file__, fmt, str(seed_file), str(folder), str(seed), "0", str(count)]
    # the whole run's bound: a hang the per-input timer cannot interrupt (inside C) ends here
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60 + count * 0.1)
    if done.returncode != 0:
        current = (folder / "current.txt").read_text() if (folder / "current.txt").exists() else "?"
        raise AssertionError(
            f"the worker died (exit {done.returncode}) on input {current}: {done.stderr[-2000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _inputs() -> tuple[int, int]:
    return int(os.environ.get("PYCALM_FUZZ_INPUTS", FUZZ_INPUTS)), int(
        os.environ.get("PYCALM_FUZZ_SEED", FUZZ_SEED)
    )


def _check(result: dict, fmt: str) -> None:
    print(
        f"fuzz {fmt}: {result['inputs']} inputs, {result['rejected']} rejected with one line, "
        f"{result['read whole']} read whole, {len(result['failures'])} failures"
    )
    shown = "\n".join(f"  #{f['index']} {f['mutation']}: {f['problem']}" for f in result["failures"][:20])
    assert not result["failures"], f"{len(result['failures'])} inputs broke the {fmt} reader:\n{shown}"
    # the mutations reach the checks: most inputs are rejected, and some survive (a flipped
    # weight byte changes no structure)
    assert result["rejected"] > result["inputs"] // 2 and result["read whole"] > 0


# =============================================================================================
# the tests


def _tiny_gguf(folder: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tiny_models import make_gguf

    # qwen2: biases too; Q8_0 blocks, F16 embeddings and F32 norms: every kind of tensor data
    return make_gguf(folder, arch="qwen2", qtype="Q8_0", n_layers=1, dim=32, hidden_dim=64).path


def test_fuzz_pycalm_file(tmp_path):
    from pycalm.convert.main import convert

    count, seed = _inputs()
    model = convert(_tiny_gguf(tmp_path), tmp_path / "tiny.pycalm", "fp8", progress=False)
    _check(run_worker("pycalm", model, tmp_path, seed, count), "pycalm")


def test_fuzz_gguf_file(tmp_path):
    count, seed = _inputs()
    _check(run_worker("gguf", _tiny_gguf(tmp_path), tmp_path, seed, count), "gguf")


def test_mutations_are_reproducible(tmp_path):
    """An input is a function of (seed, index) alone, so a failure's index reproduces it."""
    path = _tiny_gguf(tmp_path)
    data = path.read_bytes()
    layout = GGUFLayout(data)
    assert layout.header_end < len(data) and len(layout.u64) > 20
    again = [mutate_gguf(data, layout, np.random.default_rng([3, i])) for i in range(50)]
    assert again == [mutate_gguf(data, layout, np.random.default_rng([3, i])) for i in range(50)]
    assert len({m for _, m in again}) > 40  # and they differ from each other


if __name__ == "__main__":
    fmt_, seed_file_, folder_, seed_, first_, count_ = sys.argv[1:7]
    result_ = worker(fmt_, Path(seed_file_), Path(folder_), int(seed_), int(first_), int(count_))
    print(json.dumps(result_))
