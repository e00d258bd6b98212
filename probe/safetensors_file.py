"""Reading a safetensors file one tensor at a time, without mapping it into memory.

`safetensors.torch.load_file` gives every tensor of a file at once, all views of one mapping of the whole file,
which stays as long as any of them does. Loading a large checkpoint onto a device wants one tensor at a time:
here the header is read and checked (dtypes, shapes and byte ranges inside the file) without touching the data,
and each tensor is a copy-on-write view of a mapping of its own, made when it is asked for, so a loader can
convert it, move it to its device and let it go (its pages with it) before reading the next. Kept on the CPU,
the tensors stay views of the file: nothing is copied that is not changed. The format: 8 bytes of little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the data.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    **{name: getattr(torch, attr) for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                                                    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"))
       if hasattr(torch, attr)},
}
MAX_HEADER_BYTES = 100 * 2**20  # as the safetensors library itself allows


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; the message names the file and what is wrong."""


@dataclass(frozen=True)
class StoredTensor:
    """A tensor still in its file: its dtype and shape are known, its data is read by `load()`."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: torch.Size
    start: int  # absolute byte offsets in the file
    end: int

    def load(self) -> torch.Tensor:
        """The tensor, as a copy-on-write view of its bytes in the file: nothing is copied until it is written,
        and the mapping (its own, of this tensor's pages only once touched) goes when the tensor does."""
        numel, itemsize = math.prod(self.shape), self.dtype.itemsize
        if numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        with open(self.path, "rb") as f:
            if self.start % itemsize:  # data not aligned to its element size (a header length not padded): copy
                buffer = torch.empty(self.end - self.start, dtype=torch.uint8)
                f.seek(self.start)
                got = f.readinto(buffer.numpy())
                if got != len(buffer):
                    raise SafetensorsError(f"{self.path} ends inside the tensor {self.name!r}: the file is truncated")
                return buffer.view(self.dtype).reshape(self.shape)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(mapped) < self.end:
            raise SafetensorsError(f"{self.path} ends inside the tensor {self.name!r}: the file is truncated")
        return torch.frombuffer(mapped, dtype=self.dtype, count=numel, offset=self.start).reshape(self.shape)


def read_header(path: Path) -> dict[str, StoredTensor]:
    """{name: StoredTensor} of a safetensors file, every entry checked against the file's size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path} is too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsError(f"{path} is not a safetensors file (it claims a {n}-byte header in {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise SafetensorsError(f"{path}: the safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    base, data_bytes = 8 + n, size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _entry(path, name, entry, base, data_bytes)
    # as the safetensors library requires: the entries tile the data exactly, so no two tensors share bytes and
    # no bytes hide between or after them (an aliased or polyglot file)
    covered = 0
    for stored in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if stored.start != base + covered:
            raise SafetensorsError(
                f"{path}: the header entry for {stored.name!r} has data_offsets starting at byte {stored.start - base}, "
                f"but the tensors before it end at byte {covered}: "
                + ("tensors overlap" if stored.start < base + covered else "the data has a hole"))
        covered = stored.end - base
    if covered != data_bytes:
        raise SafetensorsError(f"{path}: the header's data_offsets cover {covered} of the {data_bytes} data bytes; "
                               "the file has bytes no tensor indexes")
    return tensors


def _entry(path: Path, name: str, entry, base: int, data_bytes: int) -> StoredTensor:
    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: the header entry for {name!r} {what}")

    if not isinstance(entry, dict):
        raise bad(f"is a {type(entry).__name__}, not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise bad(f"has dtype {dtype!r}, which safetensors does not define (or this torch cannot hold)")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise bad(f"has shape {shape!r}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r}; they are [begin, end] with 0 <= begin <= end")
    if offsets[1] > data_bytes:
        raise bad(f"points past the end of the file (byte {offsets[1]} of {data_bytes}): the file is truncated")
    itemsize = DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        raise bad(f"spans {offsets[1] - offsets[0]} bytes, but {dtype} of shape {shape} needs {math.prod(shape) * itemsize}")
    return StoredTensor(path, name, DTYPES[dtype], torch.Size(shape), base + offsets[0], base + offsets[1])
