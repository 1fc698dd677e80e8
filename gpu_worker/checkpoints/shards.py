"""The safetensors files of one checkpoint directory: which file holds which tensor.

One `model.safetensors`, or shards named by `model.safetensors.index.json` (only the shards its
`weight_map` names are opened, each at most once, lazily). Every name the index gives is a
hostile path: all of them are resolved when the set is built, through the checkpoint's
`CheckpointFiles` (under the model root, a regular file), before any is opened, so an index
naming `../../elsewhere` or `/etc/passwd` is refused without that file being read. Tensor lookups
accept the old BERT spelling of LayerNorm parameters (gamma/beta). `close()` unmaps every opened
file.
"""
from __future__ import annotations

import pathlib

import numpy as np

from gpu_worker.checkpoints.paths import CheckpointFiles
from gpu_worker.checkpoints.safetensors import CheckpointError, SafetensorsFile, to_float32
from gpu_worker.checkpoints.schema import MAX_INDEX_BYTES, parse_json, quote

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_SHARDS = 4096   # distinct files an index may name (Llama 3.1 405B: 191)


def _alias(name: str) -> str:
    """Old BERT checkpoints spell LayerNorm weight/bias as gamma/beta."""
    return name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")


def _shard_map(files: CheckpointFiles) -> dict[str, str]:
    """HF tensor name -> the file name of its shard, as the index writes it; {} when everything
    is in model.safetensors."""
    if files.exists(INDEX):
        index = parse_json(files.read_bytes(INDEX, MAX_INDEX_BYTES, "safetensors index"),
                           files.name(INDEX))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map \
                or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{files.name(INDEX)} is not a valid index: it needs a "
                                  "non-empty weight_map of tensor name -> file name",
                                  file=files.name(INDEX))
        shards = len(set(weight_map.values()))
        if shards > MAX_SHARDS:
            raise CheckpointError(f"{files.name(INDEX)} names {shards} files, more than the "
                                  f"{MAX_SHARDS} a checkpoint may have", file=files.name(INDEX))
        return dict(weight_map)
    if not files.exists(SINGLE):
        raise CheckpointError(f"{files.name(SINGLE)}: neither {SINGLE} nor {INDEX} is present "
                              "(only safetensors checkpoints are supported)",
                              file=files.name(SINGLE))
    return {}


class ShardSet:
    def __init__(self, files: CheckpointFiles | pathlib.Path) -> None:
        """`files`: the checkpoint's sandbox (a bare directory is its own root)."""
        files = files if isinstance(files, CheckpointFiles) else CheckpointFiles(files)
        self.files = files
        self.directory = files.path
        self._shard_of = _shard_map(files)
        # every file name resolved (and so refused if it leaves the root) before any is opened
        self._real = {rel: files.resolve(rel) for rel in set(self._shard_of.values()) or {SINGLE}}
        self._files: dict[str, SafetensorsFile] = {}
        self._found: dict[str, tuple[SafetensorsFile, str]] = {}

    def _file(self, name: str) -> SafetensorsFile | None:
        rel = self._shard_of.get(name) if self._shard_of else SINGLE
        if rel is None:
            return None
        real = self._real[rel]
        if real not in self._files:   # two spellings of one file open it once
            self._files[real] = SafetensorsFile(pathlib.Path(real), self.files.open(rel),
                                                self.files.name(rel))
        return self._files[real]

    def present(self, name: str) -> bool:
        f = self._file(name)
        return f is not None and name in f.entries

    def locate(self, name: str) -> tuple[SafetensorsFile, str]:
        """(file, stored name) of `name` or its alias. A name in neither is refused under its own
        name, by the file that should hold it (or by the index that does not list it)."""
        if name in self._found:
            return self._found[name]
        fallback = None
        for candidate in dict.fromkeys((name, _alias(name))):
            f = self._file(candidate)
            if f is not None and candidate in f.entries:
                self._found[name] = (f, candidate)
                return f, candidate
            fallback = fallback or f
        if fallback is None:
            raise CheckpointError(f"{self.files.name(INDEX)}: tensor {quote(name)} is not in "
                                  "the weight_map", file=self.files.name(INDEX), tensor=name)
        fallback.info(name)  # raises "tensor is missing", naming the file
        raise AssertionError("unreachable: info() refuses a missing tensor")

    def require(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None,
                what: str) -> None:
        """Refuse `name` unless its dtype is one of `dtypes` and (when given) its shape `shape`."""
        f, stored = self.locate(name)
        dtype, got = f.info(stored)
        if dtype not in dtypes or (shape is not None and tuple(got) != tuple(shape)):
            want = f" of shape {list(shape)}" if shape is not None else ""
            raise CheckpointError(f"{f.name}, tensor {quote(stored)}: {dtype}{list(got)} "
                                  f"disagrees with config.json, which implies {what}{want}",
                                  file=f.name, tensor=stored)

    def file_name(self, name: str) -> str:
        """The file holding `name`, relative to the model root (for error messages)."""
        return self.locate(name)[0].name

    def shape(self, name: str) -> tuple[int, ...]:
        f, stored = self.locate(name)
        return f.info(stored)[1]

    def float32(self, name: str, rows: slice | None = None) -> np.ndarray:
        f, stored = self.locate(name)
        view = f.tensor(stored)
        return to_float32(view if rows is None else view[rows], f.info(stored)[0])

    def stored(self, name: str) -> tuple[np.ndarray, str]:
        """(zero-copy view in the stored dtype, dtype name): valid until `close()`."""
        f, stored = self.locate(name)
        return f.tensor(stored), f.info(stored)[0]

    def will_need(self, name: str) -> None:
        f, stored = self.locate(name)
        f.will_need(stored)

    def raw(self, name: str) -> np.ndarray:
        """A copy in the stored dtype (the mapping may close before the caller is done)."""
        f, stored = self.locate(name)
        return np.array(f.tensor(stored))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files, self._found = {}, {}
