"""A GGUF file's header read directly, its tensors left in the file: views of one memory map.

A GGUF file is a header and the tensors' bytes::

    "GGUF" | version u32 | tensor count u64 | entry count u64
    entries:  key (u64 length + UTF-8) | value type u32 | value
    tensors:  name | dimension count u32 | dimensions u64 × n (innermost first) | type u32 | offset u64
    padding to general.alignment (32 by default) | the tensors' bytes, each at its offset

A value is a number (u8, i8, u16, i16, u32, i32, u64, i64, f32, f64), a bool, a string, or an array of one
of those (type u32, count u64, items). :func:`read_gguf_header` parses that with ``struct`` and ``numpy``: an
array of numbers is one ``frombuffer``, so the vocabulary and merges of a tokenizer take milliseconds, and no
tensor byte is read until a layer asks for its rows (the operating system pages in what is touched). Every count
and offset is checked against the file's size before anything is allocated.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# value type -> (struct format, numpy dtype) of the numbers; 8: string, 9: array
_NUMBERS = {0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"), 5: ("i", "i4"),
            6: ("f", "f4"), 7: ("?", "?"), 10: ("Q", "u8"), 11: ("q", "i8"), 12: ("d", "f8")}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its name, ggml shape (innermost first), type, and bytes.

    Attributes:
        data: the stored bytes as ``(rows, bytes_per_row)`` uint8, a view of the file's memory map (a vector is
            one row).
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray = field(repr=False)
    span: tuple[int, int] = (0, 0)  # its bytes' offsets in the file
    buffer: Any = field(default=None, repr=False)  # the file's memory map

    def release(self, rows: tuple[int, int] | None = None) -> None:
        """Take the pages of this tensor (or of its ``rows``, first and past-the-last) that were read out of the
        process's memory (they stay in the operating system's file cache): once a layer holds its own copy, the
        file's pages need not count twice. A large table is read a chunk of rows at a time, each let go as it is
        copied: Gemma's 262,144 rows would otherwise be resident twice while it loads."""
        if isinstance(self.buffer, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            first, last = self.span
            if rows is not None:
                row_bytes = self.data.shape[1] * self.data.itemsize
                first, last = first + rows[0] * row_bytes, first + rows[1] * row_bytes
            begin = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE if rows else first // mmap.PAGESIZE * mmap.PAGESIZE
            end = last // mmap.PAGESIZE * mmap.PAGESIZE if rows else -(-last // mmap.PAGESIZE) * mmap.PAGESIZE
            if end > begin:  # the pages wholly inside; a page the next rows share stays
                self.buffer.madvise(mmap.MADV_DONTNEED, begin, min(end, len(self.buffer)) - begin)


@dataclass
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor] = field(repr=False)


class _Cursor:
    """Reads the header's values in order, each checked to lie inside the file."""

    def __init__(self, buffer, order: str) -> None:
        self.buffer, self.order, self.at = buffer, order, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buffer):
            raise ValueError(f"the header runs past the end of the file (at byte {self.at}, {n} more wanted)")
        view = memoryview(self.buffer)[self.at : self.at + n]
        self.at += n
        return view

    def number(self, fmt: str):
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.number("Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _NUMBERS:
            return self.number(_NUMBERS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"unknown value type {kind} in the metadata")

    def array(self) -> list:
        kind, count = self.number("I"), self.number("Q")
        if kind in _NUMBERS:
            dtype = np.dtype(_NUMBERS[kind][1]).newbyteorder(self.order)
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        if count > len(self.buffer) - self.at:  # each item takes a byte at least
            raise ValueError(f"an array of {count} items cannot fit in the rest of the file")
        if kind == _STRING:
            return self.strings(count)
        return [self.value(kind) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, its merges: 100,000 of them and more), in one tight loop."""
        buffer, at, end = self.buffer, self.at, len(self.buffer)
        length = struct.Struct(self.order + "Q").unpack_from
        out = []
        for _ in range(count):
            n = length(buffer, at)[0] if at + 8 <= end else -1
            if n < 0 or at + 8 + n > end:
                raise ValueError(f"the header runs past the end of the file (a string at byte {at})")
            out.append(str(buffer[at + 8 : at + 8 + n], "utf-8", "replace"))
            at += 8 + n
        self.at = at
        return out


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensors of the GGUF file at ``path`` (see the module's text).

    Raises:
        ValueError: not a GGUF file, a version other than 2 or 3, an unknown tensor type, or counts, sizes and
            offsets that reach past the end of the file (truncated or damaged).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        # Copy-on-write: the views are writable arrays, as PyTorch wants to wrap them, and a write (none is
        # made) could never reach the file; pages only read are the file cache's, as with a read-only map.
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if path.stat().st_size else b""
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    order = ">" if struct.unpack("<I", buffer[4:8])[0] & 0xFFFF == 0 else "<"
    cursor = _Cursor(buffer, order)
    cursor.take(4)
    version, n_tensors, n_entries = cursor.number("I"), cursor.number("Q"), cursor.number("Q")
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF version {version}; qkv reads versions 2 and 3")
    metadata = {}
    for _ in range(n_entries):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.number("I"))
    infos = []
    for _ in range(n_tensors):
        name, dims = cursor.string(), cursor.number("I")
        shape = tuple(cursor.number("Q") for _ in range(dims))
        infos.append((name, shape, cursor.number("I"), cursor.number("Q")))
    alignment = metadata.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment={alignment!r}; expected a power of two (32 by default): the "
                         "file is damaged or not written by a GGUF writer")
    start = cursor.at + -cursor.at % alignment
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has an unknown type {kind}") from None
        block, size = GGML_QUANT_SIZES[tensor_type]
        if not shape or shape[0] % block:
            raise ValueError(f"{path}: tensor {name!r} of shape {shape} is not whole {tensor_type.name} blocks")
        rows, row_bytes = int(np.prod(shape[1:], dtype=np.int64)), shape[0] // block * size
        begin, end = start + offset, start + offset + rows * row_bytes
        if end > len(buffer):
            raise ValueError(f"{path}: tensor {name!r} reaches past the end of the file (truncated?)")
        data = np.frombuffer(buffer, dtype=np.uint8, count=end - begin, offset=begin).reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, shape, tensor_type, data, (begin, end), buffer))
    return GGUFHeader(path, metadata, tensors)


__all__ = ["GGUFHeader", "GGUFTensor", "read_gguf_header"]
