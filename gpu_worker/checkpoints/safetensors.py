"""A small safetensors reader over mmap: one tensor at a time, never the whole file in memory.

Hazard: a checkpoint is user input. A header can lie (offsets past the end of the file, ranges
that overlap, a byte count that disagrees with dtype x shape), a file can be truncated after a
failed copy, and a header can be built to break the reader itself: a length of 2^63, a shape
`[2^59, 32]` whose int64 byte count wraps to 0, infinities or floats as offsets, nesting deep
enough to exhaust the parser's stack. Contract: the file is opened only through `CheckpointFiles`
(a regular file under the model root); the header length is bounded (MAX_HEADER_BYTES) and its
JSON parsed by `schema.parse_json` (bounded depth, finite numbers); every entry is checked with
Python integers (no overflow): a known dtype, at most MAX_RANK integer dimensions in [0, MAX_DIM],
two integer offsets 0 <= begin <= end inside the data section, end - begin == itemsize x the
product of the shape, and no two ranges overlap. So every later `tensor()` is a bounds-checked
view; every refusal is `CheckpointError` (INVALID_ARGUMENT) naming the file (relative to the
model root) and the tensor. Cost: opening reads only the header (one `read` of N bytes); a tensor
is a zero-copy NumPy view of the mapping until its caller converts it.

Format: 8 bytes little-endian u64 N, N bytes of UTF-8 JSON header, then the data buffer; header
entries are {"dtype", "shape", "data_offsets": [begin, end)} relative to the data buffer, plus an
optional "__metadata__" of strings.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import pathlib
import struct
from itertools import pairwise
from typing import Self

import numpy as np

from gpu_worker.checkpoints.paths import CheckpointError, CheckpointFiles
from gpu_worker.checkpoints.schema import parse_json, quote

MAX_HEADER_BYTES = 100 * 1000 * 1000  # the format's own limit (the reference reader's)
MAX_RANK = 8                          # dimensions of one tensor
MAX_DIM = 1 << 48                     # one dimension (NumPy needs each to fit an intp)

# BF16 has no NumPy dtype: it is read as uint16 and widened by `to_float32`.
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}

__all__ = ["DTYPES", "CheckpointError", "SafetensorsFile", "to_float32", "write_safetensors"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SafetensorsFile:
    """One `.safetensors` file, mapped read-only. Use as a context manager or call `close()`.

    `fd`: an open descriptor of the file (from `CheckpointFiles.open`, which checked it), owned
    from then on; without one the path is opened through a sandbox of its own directory. `name`:
    how errors call the file (relative to the model root)."""

    def __init__(self, path: pathlib.Path, fd: int | None = None, name: str | None = None) -> None:
        self.path = pathlib.Path(path)
        self.name = name or self.path.name
        if fd is None:
            fd = CheckpointFiles(self.path.parent).open(self.path.name)
        self._file = os.fdopen(fd, "rb")  # open as long as the mapping
        self._map: mmap.mmap | None = None
        try:
            self.size = os.fstat(fd).st_size   # the descriptor's, never the path's again
            self.entries, self.metadata, self._data_start = self._read_header()
            if self.size > 0:
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._file.close()
            raise

    def _fail(self, message: str, tensor: str | None = None) -> CheckpointError:
        where = self.name + (f", tensor {quote(tensor)}" if tensor else "")
        return CheckpointError(f"{where}: {message}", file=self.name, tensor=tensor or "")

    def _read_header(self) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], dict, int]:
        size = self.size
        raw = self._file.read(8)
        if len(raw) < 8:
            raise self._fail(f"truncated: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise self._fail(f"header length {n} does not fit the file of {size} bytes "
                             f"(truncated?), or exceeds the format's {MAX_HEADER_BYTES}")
        text = self._file.read(n)
        if len(text) < n:
            raise self._fail("truncated while the header was read")
        header = parse_json(text, f"{self.name} header")
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._fail("__metadata__ is not an object of strings")
        data_start, data_size = 8 + n, size - 8 - n
        entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            entries[name] = self._entry(name, entry, data_size)
        spans = sorted((b, e, name) for name, (_, _, b, e) in entries.items() if e > b)
        for (_, e0, a), (b1, _, b) in pairwise(spans):
            if b1 < e0:
                raise self._fail(f"data of {quote(a)} and {quote(b)} overlap", b)
        return entries, metadata, data_start

    def _entry(self, name: str, entry: object,
               data_size: int) -> tuple[str, tuple[int, ...], int, int]:
        """One header entry, checked with Python integers (no int64 product can wrap)."""
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise self._fail("entry lacks dtype, shape or data_offsets", name)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._fail(f"dtype {quote(dtype)} is not supported (supported: "
                             f"{sorted(DTYPES)})", name)
        if not isinstance(shape, list) or len(shape) > MAX_RANK \
                or not all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape):
            raise self._fail(f"shape {quote(shape)} is not a list of at most {MAX_RANK} "
                             f"integers between 0 and 2^48", name)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets)) \
                or not 0 <= offsets[0] <= offsets[1]:
            raise self._fail(f"data_offsets {quote(offsets)} are not two integers "
                             "0 <= begin <= end", name)
        begin, end = offsets
        if end > data_size:
            raise self._fail(f"data [{begin}, {end}) runs past the end of the data "
                             f"({data_size} bytes): the file is truncated or the header lies", name)
        want = DTYPES[dtype].itemsize * math.prod(shape)
        if end - begin != want:
            raise self._fail(f"header says {end - begin} bytes but {dtype}{shape} needs {want}",
                             name)
        return dtype, tuple(shape), begin, end

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
        return np.frombuffer(self._map, DTYPES[dtype], count=math.prod(shape),
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
