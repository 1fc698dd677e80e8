"""The safetensors files of one checkpoint directory: which file holds which tensor.

One `model.safetensors`, or shards named by `model.safetensors.index.json` (only the shards its
`weight_map` names are opened, each at most once, lazily). Tensor lookups accept the old BERT
spelling of LayerNorm parameters (gamma/beta). `close()` unmaps every opened file.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from gpu_worker.checkpoints.safetensors import CheckpointError, SafetensorsFile, to_float32

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "F16", "BF16")


def _alias(name: str) -> str:
    """Old BERT checkpoints spell LayerNorm weight/bias as gamma/beta."""
    return name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")


def _shard_map(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> its shard file; {} when everything is in model.safetensors."""
    index = directory / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return {str(k): directory / str(v) for k, v in weight_map.items()}
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{INDEX} is not a valid index ({exc!r})", file=str(index)) from None
    if not (directory / "model.safetensors").exists():
        raise CheckpointError(f"{directory.name}: neither model.safetensors nor {INDEX} is present "
                              "(only safetensors checkpoints are supported)",
                              file=str(directory / "model.safetensors"))
    return {}


class ShardSet:
    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self._shard_of = _shard_map(directory)
        self._single = directory / "model.safetensors"
        self._files: dict[pathlib.Path, SafetensorsFile] = {}
        self._found: dict[str, tuple[SafetensorsFile, str]] = {}

    def _file(self, name: str) -> SafetensorsFile | None:
        path = self._shard_of.get(name) if self._shard_of else self._single
        if path is None:
            return None
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

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
            raise CheckpointError(f"{INDEX}: tensor {name!r} is not in the weight_map",
                                  file=str(self.directory / INDEX), tensor=name)
        fallback.info(name)  # raises "tensor is missing", naming the file
        raise AssertionError("unreachable: info() refuses a missing tensor")

    def require(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None,
                what: str) -> None:
        """Refuse `name` unless its dtype is one of `dtypes` and (when given) its shape `shape`."""
        f, stored = self.locate(name)
        dtype, got = f.info(stored)
        if dtype not in dtypes or (shape is not None and tuple(got) != tuple(shape)):
            want = f" of shape {list(shape)}" if shape is not None else ""
            raise CheckpointError(f"{f.path.name}, tensor {stored!r}: {dtype}{list(got)} disagrees "
                                  f"with config.json, which implies {what}{want}",
                                  file=str(f.path), tensor=stored)

    def file_name(self, name: str) -> str:
        return self.locate(name)[0].path.name

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
