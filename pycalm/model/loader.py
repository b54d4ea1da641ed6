"""The pycalm model file: its tensor list, a streaming writer, and a validating reader.

The file is a plain safetensors file (docs/MODEL_FILE.md), so any safetensors tool can read it.
Every tensor's name, shape and dtype follows from the config alone, which lets both sides be
strict and cheap:

- the writer computes the whole header before the first weight exists and then streams each
  tensor's bytes in header order, so converting a model never holds the whole model in memory;
  it writes `OUT.<pid>.tmp` and renames it at the end, so an interrupted conversion never leaves a
  half-written file under the final name;
- the reader checks, from the header alone, that every expected tensor is present with the
  stored shape and dtype the config demands and that the file is long enough to hold them, so a
  truncated or mismatched file fails at open time with one line naming the file and the
  problem, not later as a wrong answer or a deep traceback.

Layout of a safetensors file: 8-byte little-endian header length N, N bytes of JSON header
(`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}`, offsets
relative to the end of the header), then the tensor bytes, back to back with no holes.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from pycalm.errors import PycalmError
from pycalm.model import formats
from pycalm.model.config import METADATA_KEY, ModelConfig
from pycalm.model.tokenizer import TOKENIZER_KINDS

FORMAT_VERSION = "1"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit; a larger "length" means a corrupt file

# numpy dtype -> safetensors dtype name, for the dtypes a pycalm file uses
_ST_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint8): "U8"}
_ST_DTYPE.update({np.dtype(np.uint32): "U32", np.dtype(np.int8): "I8"})
_NP_DTYPE = {v: k for k, v in _ST_DTYPE.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model file: its name, stored dtype and stored shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def expected_tensors(config: ModelConfig, tokenizer_nbytes: int) -> list[TensorSpec]:
    """Every tensor a model file for `config` holds, in file order (docs/MODEL_FILE.md).

    Matrices use the stored shape of their dtype (config.dtype_of: gf4 packs 8 columns in one
    uint32; q8 and q4 store codes under the matrix's name and scales under `<name>.scales`);
    norms, biases, the MoE router and the RoPE frequencies are float32.
    """
    f32 = np.dtype(np.float32)

    def matrix(name: str, rows: int, cols: int, lead: tuple[int, ...] = ()) -> list[TensorSpec]:
        dtype = config.dtype_of(name)
        try:
            shape = formats.storage_shape(rows, cols, dtype)
            codes = TensorSpec(name, formats.STORAGE_DTYPE[dtype], lead + shape)
            if dtype not in formats.QUANTIZED:
                return [codes]
            scales = formats.scales_shape(rows, cols, dtype, config.group_of(name))
        except ValueError as e:
            raise PycalmError(f"{name}: {e}") from None
        return [codes, TensorSpec(name + ".scales", formats.SCALES_DTYPE[dtype], lead + scales)]

    specs = [
        *matrix("tok_embeddings", config.vocab_size, config.dim),
        TensorSpec("rope_freqs", f32, (config.rotary_dim // 2,)),
    ]
    experts = (config.n_experts,) if config.n_experts else ()
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        specs.append(TensorSpec(p + "attn_norm", f32, (config.dim,)))
        specs += matrix(p + "wqkv", config.qkv_dim, config.dim)
        if config.qkv_bias:
            specs.append(TensorSpec(p + "bqkv", f32, (config.qkv_dim,)))
        specs += matrix(p + "wo", config.dim, config.q_dim)
        specs.append(TensorSpec(p + "ffn_norm", f32, (config.dim,)))
        if config.n_experts:
            specs.append(TensorSpec(p + "moe_gate", f32, (config.n_experts, config.dim)))
        specs += matrix(p + "w1", config.hidden_dim, config.dim, experts)
        specs += matrix(p + "w2", config.dim, config.hidden_dim, experts)
        specs += matrix(p + "w3", config.hidden_dim, config.dim, experts)
    specs.append(TensorSpec("norm", f32, (config.dim,)))
    if not config.tied_embeddings:
        specs += matrix("output", config.vocab_size, config.dim)
    specs.append(TensorSpec("tokenizer", np.dtype(np.uint8), (tokenizer_nbytes,)))
    return specs


# ---------------------------------------------------------------------------------------------
# safetensors header parsing (shared with the converter, which reads HF shards with it)


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a safetensors header describes it; offsets are absolute file positions."""

    name: str
    dtype: str  # safetensors name: F32, F16, BF16, U8, U32, ...
    shape: tuple[int, ...]
    begin: int
    end: int


_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
_ST_ITEMSIZE.update({"U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E5M2": 1, "F8_E4M3": 1})


def read_safetensors_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Parse and validate a safetensors header: (tensors by name, __metadata__).

    Checks what a truncated or corrupt file gets wrong: the length prefix, the JSON, each entry's
    dtype, shape and offsets (which must agree with each other), and that the file is long enough
    to hold every tensor. Reads only the header, so it is cheap on a multi-gigabyte file.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise PycalmError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or n + 8 > size:
                raise PycalmError(
                    f"{path}: not a safetensors file or truncated (header length {n}, file {size} bytes)"
                )
            raw = f.read(n)
    except OSError as e:
        raise PycalmError(f"{path}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except RecursionError:
        raise PycalmError(f"{path}: corrupt safetensors header (JSON nested too deep)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise PycalmError(f"{path}: corrupt safetensors header ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise PycalmError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    entries: dict[str, HeaderEntry] = {}
    data_start = 8 + n
    for name, info in header.items():
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            itemsize = _ST_ITEMSIZE[dtype]
            # exact JSON integers only (a float or a string is a corrupt entry, not a size)
            if not all(type(d) is int for d in (*shape, *offsets)) or len(offsets) != 2:
                raise TypeError
            shape, (begin, end) = tuple(shape), offsets
        except (KeyError, TypeError, ValueError):
            raise PycalmError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        # Python integers: a product of lying dimensions cannot wrap around to match the offsets
        if min(shape, default=0) < 0 or end - begin != itemsize * math.prod(shape):
            raise PycalmError(
                f"{path}: tensor {name!r}: offsets {begin}..{end} disagree with {dtype} {shape}"
            )
        if begin < 0 or data_start + end > size:
            raise PycalmError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} but the file has {size}"
            )
        entries[name] = HeaderEntry(name, dtype, shape, data_start + begin, data_start + end)
    return entries, {str(k): str(v) for k, v in meta.items()}


# ---------------------------------------------------------------------------------------------
# reading


class ModelFile:
    """An open pycalm model file: config, tokenizer, chat template, and lazy tensor reads.

    Opening validates the header against the config (see open_model); tensor() then reads one
    tensor at a time through safetensors, so a caller uploading weights to the GPU never holds
    more than one tensor in host memory.
    """

    def __init__(
        self,
        path: Path,
        config: ModelConfig,
        tokenizer_kind: str,
        chat_template: str,
        entries: dict[str, HeaderEntry],
    ) -> None:
        from safetensors import safe_open

        self.path = path
        self.config = config
        self.tokenizer_kind = tokenizer_kind
        self.chat_template = chat_template
        self._entries = entries
        try:
            self._handle: Any = safe_open(str(path), framework="numpy")
        except Exception as e:  # safetensors raises its own error types
            raise PycalmError(f"{path}: safetensors cannot open it: {e}") from None
        self.tokenizer_blob = self.tensor("tokenizer").tobytes()

    def names(self) -> list[str]:
        return list(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def tensor(self, name: str) -> np.ndarray | formats.Quantized:
        """Read one tensor (stored dtype and shape, see docs/MODEL_FILE.md) into host memory; a
        q8 or q4 matrix comes as formats.Quantized(codes, scales) (its scales are also the
        tensor `<name>.scales`)."""
        if self.config.dtype_of(name) in formats.QUANTIZED and name + ".scales" in self._entries:
            return formats.Quantized(self._read(name), self._read(name + ".scales"))
        return self._read(name)

    def _read(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise PycalmError(f"{self.path}: no tensor {name!r}")
        if self._handle is None:
            raise PycalmError(f"{self.path}: model file already closed")
        try:
            return self._handle.get_tensor(name)
        except Exception as e:
            raise PycalmError(f"{self.path}: cannot read tensor {name!r}: {e}") from None

    def close(self) -> None:
        self._handle = None

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# the config's whole-number fields and the least each may be
_CONFIG_MINIMUM = {"dim": 1, "hidden_dim": 1, "head_dim": 1, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1}
_CONFIG_MINIMUM.update(vocab_size=1, max_seq_len=1, rotary_dim=0, bos_id=-1, n_experts=0)
_CONFIG_MINIMUM.update(n_experts_active=0, sliding_window=0)


def _check_config(path: Path, config: ModelConfig, n_tensors: int) -> None:
    """The config's fields have their types and ranges, and its tensor count fits the header's,
    before anything is sized by them (a lying n_layers of 10**12 would list 10**13 tensors)."""
    for name, least in _CONFIG_MINIMUM.items():
        value = getattr(config, name)
        if type(value) is not int or value < least:
            raise PycalmError(f"{path}: bad model config in metadata: {name} = {value!r}")
    for name in ("rope_theta", "norm_eps"):
        value = getattr(config, name)
        if type(value) not in (int, float) or not 0 < value < float("inf"):
            raise PycalmError(f"{path}: bad model config in metadata: {name} = {value!r}")
    if config.bos_id >= config.vocab_size or not all(0 <= i < config.vocab_size for i in config.eos_ids):
        raise PycalmError(f"{path}: bad model config in metadata: bos_id or eos_ids past the vocabulary")
    if config.n_layers * 7 > n_tensors:  # a layer has 7 tensors at least
        raise PycalmError(
            f"{path}: config has {config.n_layers} layers but the file only {n_tensors} tensors"
        )


def open_model(path: str | os.PathLike[str]) -> ModelFile:
    """Open and validate a pycalm model file (header only: cheap even for a large model).

    Raises PycalmError naming the file and the problem when the file is missing, is not a
    safetensors file, is truncated, lacks pycalm metadata, or has a tensor that is missing or
    whose stored shape/dtype differs from what the config requires.
    """
    path = Path(path)
    if not path.is_file():
        raise PycalmError(f"model file not found: {path}")
    entries, meta = read_safetensors_header(path)
    version = meta.get("pycalm.format_version")
    if version is None or METADATA_KEY not in meta:
        raise PycalmError(
            f"{path}: not a pycalm model file (no pycalm metadata); convert it with python -m pycalm.convert"
        )
    if version != FORMAT_VERSION:
        raise PycalmError(f"{path}: pycalm format version {version!r}, this pycalm reads {FORMAT_VERSION!r}")
    try:
        config = ModelConfig.from_json(meta[METADATA_KEY])
    except PycalmError as e:
        raise PycalmError(f"{path}: {e}") from None
    except ZeroDivisionError:
        raise PycalmError(f"{path}: bad model config in metadata: n_kv_heads is 0") from None
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        raise PycalmError(f"{path}: bad model config in metadata: {e or type(e).__name__}") from None
    _check_config(path, config, len(entries))
    kind = meta.get("pycalm.tokenizer", "")
    if kind not in TOKENIZER_KINDS:
        raise PycalmError(
            f"{path}: unknown tokenizer kind {kind!r} (expected one of {', '.join(TOKENIZER_KINDS)})"
        )
    tok = entries.get("tokenizer")
    if tok is None or len(tok.shape) != 1:
        raise PycalmError(f"{path}: missing tensor 'tokenizer'")
    try:
        specs = expected_tensors(config, tok.shape[0])
    except PycalmError as e:
        raise PycalmError(f"{path}: {e}") from None
    for spec in specs:
        got = entries.get(spec.name)
        if got is None:
            raise PycalmError(f"{path}: missing tensor {spec.name!r}")
        want_dtype = _ST_DTYPE[spec.dtype]
        if got.dtype != want_dtype or got.shape != spec.shape:
            raise PycalmError(
                f"{path}: tensor {spec.name!r} is {got.dtype} {list(got.shape)}, expected {want_dtype} "
                f"{list(spec.shape)} for this config (weight dtype {config.weight_dtype})"
            )
    return ModelFile(path, config, kind, meta.get("pycalm.chat_template", ""), entries)


# ---------------------------------------------------------------------------------------------
# uploading

STAGING_BYTES = 16 << 20  # one pinned staging buffer
STAGING_BUFFERS = 8  # buffers, and so reads, in flight
# threads reading the file: a read releases the GIL, and one thread alone gets a fraction of the
# page cache's rate (docs/BENCHMARKS.md, "Start-up": the weights' upload by reader threads)
READERS = min(8, os.cpu_count() or 1)


class Upload:
    """Tensors on their way to the device: `arrays` (name -> device array of the stored dtype
    and shape) exist at once, their bytes arrive from a thread; wait() returns them once every
    copy is done, or raises what the thread raised."""

    def __init__(
        self, arrays: dict[str, object], thread: threading.Thread, errors: list[BaseException]
    ) -> None:
        self.arrays, self._thread, self._errors = arrays, thread, errors

    def wait(self) -> dict[str, object]:
        self._thread.join()
        if self._errors:
            raise self._errors[0]
        return self.arrays


def start_upload(model: ModelFile, names: list[str], *, stream: object) -> Upload:
    """Start copying every tensor of `names` from the file to the device, at the page cache's
    rate, on `stream`, from a thread: the caller goes on (the engine compiles its kernels
    meanwhile: a file read and an asynchronous copy release the GIL).

    The tensors' bytes are cut into pieces of STAGING_BYTES in file order. READERS threads read
    the pieces (os.preadv) into STAGING_BUFFERS pinned host buffers, a piece a buffer; the
    upload's thread copies each piece, in order, from its buffer to its place in the tensor's
    device array (an asynchronous copy: pinned memory, the stream) and records an event; a
    buffer is read into again only once the event of its last copy has passed. So the file
    reads, which are the slow part, run on several cores while the copies overlap them.
    """
    from numba import cuda

    entries = sorted((model._entries[n] for n in names), key=lambda e: e.begin)
    out, pieces = {}, []  # pieces: (file offset, device bytes view, bytes)
    for e in entries:
        flat = cuda.device_array(e.end - e.begin, np.uint8, stream=stream)  # (nbytes,) the tensor
        out[e.name] = flat.view(_NP_DTYPE[e.dtype]).reshape(e.shape)
        for off in range(0, e.end - e.begin, STAGING_BYTES):
            size = min(STAGING_BYTES, e.end - e.begin - off)
            pieces.append((e.begin + off, flat[off : off + size], size))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _copy_pieces(model.path, pieces, stream)
        except BaseException as e:  # noqa: BLE001 - handed to wait(), on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="pycalm-upload", daemon=True)
    thread.start()
    return Upload(out, thread, errors)


def upload_tensors(model: ModelFile, names: list[str], *, stream: object) -> dict[str, object]:
    """Every tensor of `names` as a device array of its stored dtype and shape (start_upload,
    waited for)."""
    return start_upload(model, names, stream=stream).wait()


def _copy_pieces(path: Path, pieces: list[tuple[int, object, int]], stream: object) -> None:
    """Read each (file offset, device view, bytes) piece into a pinned buffer and copy it on."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from numba import cuda

    buffers = [cuda.pinned_array(STAGING_BYTES, np.uint8) for _ in range(min(STAGING_BUFFERS, len(pieces)))]
    copied = [cuda.event() for _ in buffers]  # passed: the buffer's last copy is done
    fd = os.open(path, os.O_RDONLY)

    def read(i: int) -> None:
        offset, _, size = pieces[i]
        view = memoryview(buffers[i % len(buffers)])[:size]
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise PycalmError(f"{path}: file ends inside tensor data (offset {offset + done})")
            done += n

    try:
        with ThreadPoolExecutor(max_workers=READERS) as pool:
            reads = deque(pool.submit(read, i) for i in range(len(buffers)))
            for i, (_, dst, size) in enumerate(pieces):
                reads.popleft().result()  # piece i is in buffer i % len(buffers)
                slot = i % len(buffers)
                dst.copy_to_device(buffers[slot][:size], stream=stream)
                copied[slot].record(stream)
                if i + len(buffers) < len(pieces):
                    copied[slot].synchronize()  # ... before the buffer takes piece i + len(buffers)
                    reads.append(pool.submit(read, i + len(buffers)))
        stream.synchronize()
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# writing


class ModelWriter:
    """Write a pycalm model file tensor by tensor, in the order expected_tensors() gives.

    Usage:
        with ModelWriter(out, config, "tokenizers-json", blob, template) as w:
            for spec in w.pending():          # every tensor but `tokenizer`, in file order
                w.write(spec.name, rows)      # one or more row chunks of the stored array
    The header is written first, so each chunk goes straight to disk. `tokenizer` is written by
    close(). On success the file is renamed from OUT.<pid>.tmp to OUT; on an exception it is removed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: ModelConfig,
        tokenizer_kind: str,
        tokenizer_blob: bytes,
        chat_template: str = "",
    ) -> None:
        if tokenizer_kind not in TOKENIZER_KINDS:
            raise PycalmError(f"unknown tokenizer kind {tokenizer_kind!r}")
        self.path = Path(path)
        # a name of its own per process, so that two conversions to the same OUT never share a file
        self.tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        self.config = config
        self._tokenizer_blob = bytes(tokenizer_blob)
        self.specs = expected_tensors(config, len(self._tokenizer_blob))
        header: dict[str, Any] = {
            "__metadata__": {
                "pycalm.format_version": FORMAT_VERSION,
                METADATA_KEY: config.to_json(),
                "pycalm.tokenizer": tokenizer_kind,
                "pycalm.chat_template": chat_template or "",
            }
        }
        offset = 0
        for s in self.specs:
            header[s.name] = {
                "dtype": _ST_DTYPE[s.dtype],
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offset += s.nbytes
        self.total_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header with spaces to 8-byte alignment
        self._index = 0  # the tensor being written
        self._written = 0  # bytes of it written so far
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def pending(self) -> Iterator[TensorSpec]:
        """The tensors the caller writes (all but the tokenizer), in order."""
        return iter(self.specs[:-1])

    def write(self, name: str, data: np.ndarray) -> None:
        """Append a chunk of rows of tensor `name` in its stored dtype.

        A chunk is any array whose last axis is the tensor's last axis (any run of values, for a
        1-D tensor): its rows continue the tensor in C order (for a 3-D expert stack, rows run
        through expert 0 first).
        """
        if self._index >= len(self.specs):
            raise ValueError(f"writing {name!r} but every tensor is already written")
        spec = self.specs[self._index]
        if name != spec.name:
            raise ValueError(f"writing {name!r} but the next tensor in the file is {spec.name!r}")
        data = np.ascontiguousarray(data)
        if data.dtype != spec.dtype or (len(spec.shape) > 1 and data.shape[-1:] != spec.shape[-1:]):
            raise ValueError(
                f"{name}: chunk {data.dtype} {data.shape} does not fit {spec.dtype} {spec.shape}"
            )
        nbytes = data.nbytes
        if self._written + nbytes > spec.nbytes:
            raise ValueError(f"{name}: more data than its shape {spec.shape} holds")
        self._f.write(
            memoryview(data.reshape(-1).view(np.uint8))
        )  # little-endian hosts only, like safetensors
        self._written += nbytes
        if self._written == spec.nbytes:
            self._index += 1
            self._written = 0

    def close(self) -> Path:
        """Write the tokenizer, check every tensor is complete, and move the file into place."""
        if self._index != len(self.specs) - 1 or self._written:
            raise ValueError(f"model file incomplete: tensor {self.specs[self._index].name!r} not written")
        self.write("tokenizer", np.frombuffer(self._tokenizer_blob, dtype=np.uint8))
        self._f.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file (called on any error, including KeyboardInterrupt)."""
        self._f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ModelWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


def write_model(
    path: str | os.PathLike[str],
    config: ModelConfig,
    tensors: Iterator[tuple[str, np.ndarray]],
    tokenizer_kind: str,
    tokenizer_blob: bytes,
    chat_template: str = "",
) -> Path:
    """Write a whole model from (name, stored array or row chunk) pairs in file order.

    A convenience over ModelWriter for tests and small models; the converter uses ModelWriter
    directly to stream row chunks.
    """
    w = ModelWriter(path, config, tokenizer_kind, tokenizer_blob, chat_template)
    try:
        for name, arr in tensors:
            w.write(name, arr)
        return w.close()
    except BaseException:
        w.abort()
        raise
