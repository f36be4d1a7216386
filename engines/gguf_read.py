"""Reading GGUF files without mapping them: one header field, the tensors' shapes, or every
tensor dequantized.
`gguf.GGUFReader` maps the whole file and slices every entry of the vocabulary (3 s for a
49k-token one) to answer what these read by stepping over it."""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ALIGNMENT = 32  # where tensor data starts, unless `general.alignment` says otherwise
# Counts a file states are bounded before they are looped over: a coordinator's file must not buy
# minutes of a node's CPU (issue 55 point 11). Far above real models': ~50 fields, a few thousand
# tensors, 4 dimensions (GGML_MAX_DIMS), ~300k strings in the largest vocabulary or merge list.
MAX_FIELDS, MAX_TENSORS, MAX_DIMS, MAX_ITEMS = 1 << 16, 1 << 20, 4, 1 << 24


class _Header:
    """A GGUF header read in order, each read bounded by the file's size."""

    def __init__(self, f, path: Path):
        self.f, self.path, self.size = f, path, os.fstat(f.fileno()).st_size
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file")
        self.unpack("<I")  # version
        self.n_tensors = self.count(self.unpack("<Q"), MAX_TENSORS, "tensors")
        self.n_fields = self.count(self.unpack("<Q"), MAX_FIELDS, "metadata fields")

    def count(self, n: int, most: int, what: str, item_bytes: int = 1) -> int:
        """A count the file states, if it is at most `most` and its items (of at least
        `item_bytes` each) fit in what is left of the file."""
        if n > most or n * item_bytes > self.size - self.f.tell():
            raise ValueError(f"{self.path.name}: GGUF header states {n} {what}, more than it can hold")
        return n

    def unpack(self, fmt: str):
        width = struct.calcsize(fmt)
        data = self.f.read(width)
        if len(data) != width:
            raise ValueError(f"{self.path.name}: GGUF header cut short")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if length > self.size - self.f.tell():
            raise ValueError(f"{self.path.name}: GGUF header cut short")
        return self.f.read(length).decode("utf-8", errors="replace")

    def skip(self, kind: int) -> None:
        if kind == _STRING:
            self.f.seek(self.unpack("<Q"), 1)
        elif kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                width = struct.calcsize(_SCALARS[item])
                self.f.seek(width * self.count(count, self.size, "array items", width), 1)
            else:  # strings (a length each) or arrays (a type and a count each)
                for _ in range(self.count(count, MAX_ITEMS, "array items", 8 if item == _STRING else 12)):
                    self.skip(item)
        elif kind in _SCALARS:
            self.f.seek(struct.calcsize(_SCALARS[kind]), 1)
        else:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {kind}")

    def scalar(self, key: str, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        raise ValueError(f"{self.path.name}: {key} is not a scalar")


def read_field(path: Path, key: str) -> Any:
    """One scalar or string metadata field of a GGUF file, or None if it has none. Reads the
    header up to that field only."""
    with open(path, "rb") as f:
        header = _Header(f, path)
        for _ in range(header.n_fields):
            name, kind = header.string(), header.unpack("<I")
            if name == key:
                return header.scalar(key, kind)
            header.skip(kind)
    return None


def read_scalars(path: Path) -> dict[str, Any]:
    """Every scalar and string metadata field of a GGUF file in one pass (arrays, such as the
    vocabulary, are stepped over)."""
    fields = {}
    with open(path, "rb") as f:
        header = _Header(f, path)
        for _ in range(header.n_fields):
            name, kind = header.string(), header.unpack("<I")
            if kind == _ARRAY:
                header.skip(kind)
            else:
                fields[name] = header.scalar(name, kind)
    return fields


def _tensor_infos(f, path: Path) -> tuple[list[tuple[str, list[int], gguf.GGMLQuantizationType, int]], int]:
    """(name, file dimensions, type, offset) of every tensor, and where their data starts."""
    header = _Header(f, path)
    alignment = _ALIGNMENT
    for _ in range(header.n_fields):
        name, kind = header.string(), header.unpack("<I")
        if name == "general.alignment":
            alignment = int(header.scalar(name, kind))
        else:
            header.skip(kind)
    infos = []
    for _ in range(header.n_tensors):
        name, n_dims = header.string(), header.count(header.unpack("<I"), MAX_DIMS, "dimensions", 8)
        dims = [header.unpack("<Q") for _ in range(n_dims)]
        infos.append((name, dims, gguf.GGMLQuantizationType(header.unpack("<I")), header.unpack("<Q")))
    return infos, -(-f.tell() // alignment) * alignment


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as numpy sees it (the file's dimensions reversed), from the header alone."""
    with open(path, "rb") as f:
        return {name: tuple(reversed(dims)) for name, dims, _, _ in _tensor_infos(f, path)[0]}


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file under its GGUF name, dequantized to float32 (`gguf.quants`),
    shaped as numpy sees it: the file's dimensions reversed, (rows, columns) for a matrix."""
    with open(path, "rb") as f:
        infos, start = _tensor_infos(f, path)
        tensors = {}
        for name, dims, qtype, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            shape = (*reversed(dims[1:]), dims[0] // block * block_bytes)  # rows of bytes
            f.seek(start + offset)
            data = np.fromfile(f, dtype=np.uint8, count=math.prod(shape))
            if data.size != math.prod(shape):
                raise ValueError(f"{path.name}: tensor {name} cut short")
            tensors[name] = gguf.quants.dequantize(data.reshape(shape), qtype).astype(np.float32, copy=False)
    return tensors
