"""A small safetensors reader over mmap: one tensor at a time, never the whole file in memory.

Hazard: a checkpoint is user input. A header can lie (offsets past the end of the file, ranges
that overlap, a byte count that disagrees with dtype x shape), a file can be truncated after a
failed copy. Contract: `SafetensorsFile` checks the whole header against the file's size when it
opens, so every later `tensor()` is a bounds-checked view; every refusal is `CheckpointError`
(INVALID_ARGUMENT) naming the file and the tensor. Cost: opening reads only the header (one
`read` of N bytes); a tensor is a zero-copy NumPy view of the mapping until its caller converts it.

Format: 8 bytes little-endian u64 N, N bytes of UTF-8 JSON header, then the data buffer; header
entries are {"dtype", "shape", "data_offsets": [begin, end)} relative to the data buffer, plus an
optional "__metadata__" of strings.
"""
from __future__ import annotations

import json
import mmap
import pathlib
import struct
from itertools import pairwise
from typing import Self

import numpy as np

from services.common.errors import InvalidArgument

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

# BF16 has no NumPy dtype: it is read as uint16 and widened by `to_float32`.
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}


class CheckpointError(InvalidArgument):
    """A checkpoint file or tensor that cannot be used as it is (INVALID_ARGUMENT)."""


class SafetensorsFile:
    """One `.safetensors` file, mapped read-only. Use as a context manager or call `close()`."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115  (open as long as the mapping)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path.name}: file is missing", file=str(self.path)) from None
        self._map: mmap.mmap | None = None
        try:
            self.entries, self.metadata, self._data_start = self._read_header()
            size = self.path.stat().st_size
            if size > 0:
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._file.close()
            raise

    def _fail(self, message: str, tensor: str | None = None) -> CheckpointError:
        where = f"{self.path.name}" + (f", tensor {tensor!r}" if tensor else "")
        return CheckpointError(f"{where}: {message}", file=str(self.path), tensor=tensor or "")

    def _read_header(self) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], dict, int]:
        size = self.path.stat().st_size
        raw = self._file.read(8)
        if len(raw) < 8:
            raise self._fail(f"truncated: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise self._fail(f"header length {n} does not fit the file of {size} bytes (truncated?)")
        try:
            header = json.loads(self._file.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._fail(f"header is not UTF-8 JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + n, size - 8 - n
        entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            try:
                dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._fail("entry lacks dtype, shape or data_offsets", name) from None
            if dtype not in DTYPES:
                raise self._fail(f"dtype {dtype} is not supported (supported: {sorted(DTYPES)})", name)
            if any(d < 0 for d in shape) or not 0 <= begin <= end:
                raise self._fail(f"bad shape {list(shape)} or offsets [{begin}, {end})", name)
            want = DTYPES[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
            if end - begin != want:
                raise self._fail(f"header says {end - begin} bytes but {dtype}{list(shape)} "
                                 f"needs {want}", name)
            if end > data_size:
                raise self._fail(f"data [{begin}, {end}) runs past the end of the data "
                                 f"({data_size} bytes): the file is truncated or the header lies", name)
            entries[name] = (dtype, shape, begin, end)
        spans = sorted((b, e, name) for name, (_, _, b, e) in entries.items() if e > b)
        for (_, e0, a), (b1, _, b) in pairwise(spans):
            if b1 < e0:
                raise self._fail(f"data of {a!r} and {b!r} overlap", b)
        return entries, metadata, data_start

    def names(self) -> list[str]:
        return list(self.entries)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape) of tensor `name`, from the header."""
        if name not in self.entries:
            raise self._fail("tensor is missing", name)
        dtype, shape, _, _ = self.entries[name]
        return dtype, shape

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes in its stored dtype (BF16 as uint16)."""
        dtype, shape = self.info(name)
        _, _, begin, end = self.entries[name]
        if end == begin:
            return np.zeros(shape, DTYPES[dtype])
        assert self._map is not None, "a non-empty tensor implies a non-empty file"
        return np.frombuffer(self._map, DTYPES[dtype], count=int(np.prod(shape)),
                             offset=self._data_start + begin).reshape(shape)

    def will_need(self, name: str) -> None:
        """Ask the kernel to start reading tensor `name`'s pages now (MADV_WILLNEED: asynchronous
        readahead into the page cache), so a later first touch does not wait on the disk."""
        _, _, begin, end = self.entries[name]
        if self._map is None or end == begin:
            return
        start = (self._data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_WILLNEED, start, self._data_start + end - start)
        except (OSError, ValueError):
            pass  # only a hint: the first touch reads the pages anyway

    def float32(self, name: str) -> np.ndarray:
        """The tensor widened to float32 (F32, F16, BF16 only)."""
        dtype, _ = self.info(name)
        if dtype not in ("F32", "F16", "BF16"):
            raise self._fail(f"dtype {dtype} where a float tensor (F32, F16, BF16) is expected", name)
        return to_float32(self.tensor(name), dtype)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a caller still holds a view: the mapping closes when the view is dropped
            self._map = None
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        # bf16 is the top half of an f32: shift the bits into place.
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (F32/F16/I32/U8...; no BF16) as a safetensors file (tests, tools)."""
    names = {np.dtype(v): k for k, v in DTYPES.items() if k != "BF16"}
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, arr in tensors.items():
        nbytes = arr.nbytes
        header[name] = {"dtype": names[arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1
                                       else arr.dtype],
                        "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
