"""probe.safetensors_file: tensors read one at a time equal what the safetensors library reads, every dtype;
headers that lie about the file are refused naming the file and the entry; the loader reads a tensor only when
its conversion takes it."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import HookedDecoder
from probe.safetensors_file import SafetensorsError, StoredTensor, read_header


def test_every_dtype_reads_as_the_safetensors_library_reads_it(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen), "f64": torch.randn(4, generator=gen, dtype=torch.float64),
        "f16": torch.randn(2, 3, generator=gen).half(), "bf16": torch.randn(7, generator=gen).bfloat16(),
        "i64": torch.arange(6).view(2, 3), "i8": torch.tensor([-3, 4], dtype=torch.int8), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "f8": torch.randn(5, generator=gen).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    stored = read_header(path)
    assert set(stored) == set(expected)
    for name, want in expected.items():
        got = stored[name].load()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name  # bit for bit


def _write(path, header: dict, data: bytes = b"", claimed: int = None):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if claimed is None else claimed) + raw + data)
    return path


@pytest.mark.parametrize("header, data, claimed, message", [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, r"past the end of the file"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, None, r"spans 12 bytes, but F32 of shape \[4\] needs 16"),
    ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, None, r"dtype 'Q4'"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, r"non-negative integers"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, None, r"begin <= end"),
    ({"w": [1, 2]}, b"", None, r"is a list, not an object"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, 2**40, r"claims a 1099511627776-byte header"),
])
def test_headers_that_lie_about_the_file_are_refused_by_name(tmp_path, header, data, claimed, message):
    path = _write(tmp_path / "bad.safetensors", header, data, claimed)
    with pytest.raises(SafetensorsError, match=message) as caught:
        read_header(path)
    assert str(path) in str(caught.value)


def test_a_header_that_is_not_an_object_or_not_json_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(SafetensorsError, match="a JSON list, not an object"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 3) + b"{no")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        read_header(path)


def test_the_loader_reads_each_tensor_once_when_it_is_taken(tiny_dir, monkeypatch):
    """Reads happen one at a time inside the conversion (never a whole file up front), each tensor once, and
    the loaded model is the one transformers' files describe."""
    reads = []
    original = StoredTensor.load
    monkeypatch.setattr(StoredTensor, "load", lambda self: reads.append(self.name) or original(self))
    model = HookedDecoder.from_pretrained(tiny_dir)
    names = set(load_file(str(tiny_dir / "model.safetensors")))
    assert sorted(reads) == sorted(set(reads)) and set(reads) <= names
    ignored = {n for n in names if n.endswith((".attn.bias", ".attn.masked_bias"))}
    assert set(reads) | ignored == names  # every weight read, the causal-mask buffers never
    stored = load_file(str(tiny_dir / "model.safetensors"))
    [wte] = [name for name in names if name.endswith("wte.weight")]
    assert torch.equal(model.embed.W_E, stored[wte])


@pytest.mark.parametrize("offsets, size", [
    ([[0, 8], [4, 12]], 12),  # b's first half is a's second half
    ([[0, 8], [0, 8]], 8),  # one buffer read as two weights
    ([[0, 8], [12, 20]], 20),  # a hole between them
    ([[0, 8], [8, 16]], 24),  # bytes after the last tensor
], ids=["overlap", "alias", "hole", "trailing"])
def test_offsets_that_overlap_or_leave_bytes_unindexed_are_refused_as_the_library_refuses_them(tmp_path, offsets, size):
    """The format indexes the data buffer exactly, no holes and no overlaps (a polyglot or aliased file is not
    safetensors): the safetensors library refuses every one of these; so must the reader."""
    header = {name: {"dtype": "F32", "shape": [2], "data_offsets": o} for name, o in zip("ab", offsets)}
    path = _write(tmp_path / "bad.safetensors", header, bytes(range(size)))
    with pytest.raises(Exception, match="invalid offset|not fully covered"):
        load_file(str(path))
    with pytest.raises(SafetensorsError, match="data_offsets") as caught:
        read_header(path)
    assert str(path) in str(caught.value)
