"""A GGUF file's header: key/value metadata and tensor infos, read and checked against the file.

GGUF (llama.cpp's format): the magic "GGUF", a version, the tensor count, the key/value count,
the key/values (a string key, a value type, the value: scalars, strings, arrays), one info a
tensor (name, dimensions innermost first, type, offset into the data), then the tensor data
from the next multiple of general.alignment (default 32). Every count, length and offset is
checked against the file's size before anything is sized by it, so a corrupt or truncated file
is a PycalmError naming it, never an endless loop or an allocation of a lying count.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pycalm.errors import PycalmError

# GGUF metadata value types -> numpy dtypes (8 = string, 9 = array are handled apart)
_GGUF_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_BOOL = 8, 9, 7
GGUF_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class TensorInfo(NamedTuple):
    """A tensor of a GGUF file, as read_gguf_header checked it."""

    qtype: int  # ggml type (gguf.GGMLQuantizationType's value)
    nbytes: int  # bytes of data
    dims: tuple[int, ...]  # dimensions, innermost (the row length) first
    start: int  # offset of its data from the start of the file


GGUF_MAX_NESTING = 4  # arrays of arrays: deeper than any GGUF writes, shallow enough to recurse


class _GGUFMeta:
    """Reads GGUF key/value metadata from a buffer (gguf.GGUFReader parses every array element
    into its own numpy view, which takes tens of seconds for a 150k-token vocabulary)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError("file ends inside its metadata")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def string(self, errors: str = "replace") -> str:
        return bytes(self.take(self.u64())).decode("utf-8", errors=errors)

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            etype, count = self.u32(), self.u64()
            if etype != _GGUF_STRING and etype != _GGUF_ARRAY and etype not in _GGUF_SCALARS:
                raise ValueError(f"unknown metadata array type {etype}")
            # each value takes this many bytes at least: a count the file cannot hold is a lie,
            # caught before a list of that length is built
            least = {_GGUF_STRING: 8, _GGUF_ARRAY: 12}.get(etype) or np.dtype(_GGUF_SCALARS[etype]).itemsize
            if count * least > len(self.buf) - self.pos:
                raise ValueError(f"an array of {count} values runs past the end of the file")
            if etype == _GGUF_STRING:
                return [self.string() for _ in range(count)]
            if etype == _GGUF_ARRAY:
                if depth >= GGUF_MAX_NESTING:
                    raise ValueError(f"arrays nested more than {GGUF_MAX_NESTING} deep")
                return [self.value(_GGUF_ARRAY, depth + 1) for _ in range(count)]
            dtype = np.dtype(_GGUF_SCALARS[etype])
            values = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            return [bool(v) for v in values] if etype == _GGUF_BOOL else values.tolist()
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        dtype = np.dtype(_GGUF_SCALARS[vtype])
        value = np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0].item()
        return bool(value) if vtype == _GGUF_BOOL else value


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (str, int, float, bool, list)."""
    return read_gguf_header(path)[0]


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """A GGUF file's metadata and its tensors' TensorInfo, every count, length, type,
    shape and offset checked against the file before anything is sized by it: each tensor of a
    known type, whole blocks a row, aligned, and its bytes inside the file. (gguf.GGUFReader
    trusts them: a lying array count makes it loop and allocate without end.)"""
    from gguf import GGML_QUANT_SIZES

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta = _GGUFMeta(memoryview(mm))
            try:
                if bytes(meta.take(4)) != b"GGUF":
                    raise ValueError("not a GGUF file (bad magic)")
                version = meta.u32()
                if version not in (2, 3):
                    raise ValueError(f"unsupported GGUF version {version}")
                n_tensors, n_fields = meta.u64(), meta.u64()
                fields: dict[str, Any] = {}
                for _ in range(n_fields):
                    key = meta.string(errors="strict")
                    if key in fields:
                        raise ValueError(f"key {key!r} twice")
                    fields[key] = meta.value(meta.u32())
                infos = []  # (name, type, dims innermost first, offset)
                for _ in range(n_tensors):
                    name, n_dims = meta.string(errors="strict"), meta.u32()
                    if not 1 <= n_dims <= GGUF_MAX_DIMS:
                        raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
                    dims = [meta.u64() for _ in range(n_dims)]
                    infos.append((name, meta.u32(), dims, meta.u64()))
                header_end, size = meta.pos, len(meta.buf)
            finally:
                meta.buf.release()
        alignment = fields.get("general.alignment", 32)
        if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-header_end // alignment) * alignment
        known_types = {int(t): t for t in GGML_QUANT_SIZES}
        tensors: dict[str, tuple[int, int]] = {}
        for name, qtype, dims, offset in infos:
            if qtype not in known_types:
                raise ValueError(f"tensor {name!r} has unknown type {qtype}")
            block, block_bytes = GGML_QUANT_SIZES[known_types[qtype]]
            if min(dims) < 1 or dims[0] % block:
                raise ValueError(f"tensor {name!r} has shape {dims[::-1]} (rows of whole blocks of {block})")
            nbytes = math.prod(dims) // block * block_bytes
            if name in tensors:
                raise ValueError(f"tensor {name!r} twice")
            if offset % alignment or data_start + offset + nbytes > size:
                raise ValueError(
                    f"tensor {name!r} at offset {offset} ({nbytes} bytes) lies outside the file's "
                    f"{size - data_start} bytes of data or off its {alignment}-byte alignment"
                )
            tensors[name] = TensorInfo(qtype, nbytes, tuple(dims), data_start + offset)
        return fields, tensors
    except FileNotFoundError:
        raise PycalmError(f"GGUF file not found: {path}") from None
    except UnicodeDecodeError:
        raise PycalmError(f"{path}: not a readable GGUF file (a key or tensor name is not UTF-8)") from None
    except (ValueError, OSError) as e:
        raise PycalmError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from None
