"""The safetensors reader refuses every lie a header can tell, naming the file and the tensor."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from gpu_worker.checkpoints.safetensors import CheckpointError, SafetensorsFile, write_safetensors


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_tensors_round_trip_through_the_mmap_reader(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(6, dtype=np.float16)
    write_safetensors(tmp_path / "m.safetensors", {"a": a, "b": b}, {"format": "pt"})
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        assert f.names() == ["a", "b"] and f.metadata == {"format": "pt"}
        assert f.info("a") == ("F32", (3, 4))
        np.testing.assert_array_equal(f.float32("a"), a)
        np.testing.assert_array_equal(f.float32("b"), b.astype(np.float32))


def test_bf16_is_widened_exactly_to_float32(tmp_path):
    values = np.array([1.0, -2.5, 3.140625, 0.0], np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2")   # exact in bf16
    _write_raw(tmp_path / "m.safetensors",
               {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, bits.tobytes())
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        np.testing.assert_array_equal(f.float32("w"), values)


@pytest.mark.parametrize("header, data, says", [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "past the end"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "needs 16"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
    ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, "not supported"),
    ({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "lacks"),
])
def test_a_header_that_lies_is_refused_naming_file_and_tensor(tmp_path, header, data, says):
    _write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=says) as err:
        SafetensorsFile(tmp_path / "bad.safetensors")
    assert "bad.safetensors" in str(err.value)
    assert err.value.details["tensor"] in header, "the message must name the tensor"


def test_a_truncated_file_is_refused(tmp_path):
    write_safetensors(tmp_path / "m.safetensors", {"a": np.ones((64, 64), np.float32)})
    raw = (tmp_path / "m.safetensors").read_bytes()
    for cut in (4, 20, len(raw) - 1):
        (tmp_path / "t.safetensors").write_bytes(raw[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            SafetensorsFile(tmp_path / "t.safetensors")


def test_a_header_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="not UTF-8 JSON"):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_a_missing_file_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match="gone.safetensors: file is missing"):
        SafetensorsFile(tmp_path / "gone.safetensors")


def test_will_need_accepts_every_tensor_of_a_file_whatever_its_offset(tmp_path):
    """MADV_WILLNEED needs a page-aligned start: tensors at odd offsets and empty ones are fine."""
    tensors = {"a": np.arange(3, dtype=np.uint8), "empty": np.zeros((0, 4), np.float32),
               "b": np.arange(5000, dtype=np.float32), "c": np.ones((7, 3), np.float16)}
    write_safetensors(tmp_path / "m.safetensors", tensors)
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        for name, want in tensors.items():
            f.will_need(name)
            np.testing.assert_array_equal(f.tensor(name), want)
