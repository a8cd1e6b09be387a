"""One pass over a GGUF file's header: its metadata as Python values and its tensor table, tensors as views.

gguf-py's `GGUFReader` makes a numpy memmap view of every scalar and string it meets: ~4 s for the default
model's 49k-token vocabulary, before any weight is read, and transformers ran it once for the config and again
for the tokenizer. This reader walks the same layout with `struct` on one mapped buffer (~0.1 s) and maps
tensor data only when asked. Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (v2 and v3,
little-endian).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# value type id -> struct format of one scalar (8 is a string, 9 an array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml types whose tensors are plain numbers (any other is quantized blocks, read as bytes)
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]   # torch order (ggml stores the fastest-moving dimension first)
    ggml_type: int
    offset: int              # from the start of the file


@dataclass(frozen=True)
class GGUFContents:
    path: Path
    version: int
    metadata: dict[str, Any]           # scalars, strings, and lists for arrays
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"model: {self.path} ends inside its GGUF header (truncated file?)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise ValueError(f"model: {self.path} ends inside its GGUF header (truncated file?)")
        text = self.buf[self.pos:end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type in _SCALARS:   # a block of numbers: one unpack
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                if self.pos + size * count > len(self.buf):
                    raise ValueError(f"model: {self.path} ends inside its GGUF header (truncated file?)")
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += size * count
                return values
            return [self.value(item_type) for _ in range(count)]
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        raise ValueError(f"model: {self.path} has a GGUF value of unknown type {value_type}")


def read_gguf(path: str | os.PathLike[str]) -> GGUFContents:
    """The header of a GGUF file, parsed once per file version in this process (see `_read_cached`)."""
    p = Path(path).resolve()
    stat = p.stat()
    return _read_cached(p, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _read_cached(path: Path, size: int, mtime_ns: int) -> GGUFContents:
    # size and mtime are part of the key so that a file replaced in place is read again
    if size < 24:   # (mmap refuses an empty file; 24 bytes: magic, version and the two counts)
        raise ValueError(f"model: {path} is not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        if buf[:4] != _MAGIC:
            raise ValueError(f"model: {path} is not a GGUF file (no GGUF magic bytes)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in _VERSIONS:
            raise ValueError(f"model: {path} is GGUF v{version}; v2 and v3 are supported")
        tensor_count = cur.scalar("<Q")
        kv_count = cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        table = []
        for _ in range(tensor_count):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            ggml_type = cur.scalar("<I")
            table.append((name, tuple(reversed(dims)), ggml_type, cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
    tensors = tuple(GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
                    for name, shape, ggml_type, offset in table)
    return GGUFContents(path=path, version=version, metadata=metadata, tensors=tensors)


def tensor_data(contents: GGUFContents, tensor: GGUFTensorInfo) -> np.ndarray:
    """A read-only view of one tensor's stored data, shaped as gguf-py's reader shapes it (quantized types as
    rows of bytes) so that `gguf.quants.dequantize` takes it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    qtype = GGMLQuantizationType(tensor.ggml_type)
    n_elems = int(np.prod(tensor.shape))
    if tensor.ggml_type in _PLAIN:
        dtype: Any = _PLAIN[tensor.ggml_type]
        count, shape = n_elems, tensor.shape
    else:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        dtype, count = np.uint8, n_elems * type_size // block_size
        shape = quant_shape_to_byte_shape(tensor.shape, qtype)
    data = np.memmap(contents.path, dtype=dtype, mode="r", offset=tensor.offset, shape=(count,))
    return np.asarray(data).reshape(shape)
