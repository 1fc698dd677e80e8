"""A Hugging Face checkpoint directory -> our weight keys, streamed one tensor at a time.

Hazard: an 8B model is 16 GB of bf16; holding it as floats and then as int4 would need three
times that in host memory. Contract: `Checkpoint.weights()` yields (key, host array) in
`weight_names` order, each converted straight from the mmap of its shard (linears quantized in
row chunks of `CHUNK_ROWS`), so the largest transient is one chunk of float32 plus the int4 result
of one tensor. Every tensor's name, shape and dtype are checked against config.json before any is
converted (`Checkpoint.open` does it), so a bad checkpoint fails before the device is touched and
names the file and the tensor. Cost: one pass over the files; the quantization is vectorized NumPy.

Name mapping (Llama, Mistral and Qwen2 share it):
  model.embed_tokens.weight -> embed (f16)         model.norm.weight -> final_norm.w (f32)
  model.layers.{i}.input_layernorm.weight -> layers.{i}.attn_norm.w
  model.layers.{i}.post_attention_layernorm.weight -> layers.{i}.mlp_norm.w
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight -> layers.{i}.w{q,k,v,o}.{q,s} (int4)
  model.layers.{i}.self_attn.{q,k,v}_proj.bias -> layers.{i}.w{q,k,v}.b (Qwen2, f32)
  model.layers.{i}.mlp.{gate,up,down}_proj.weight -> layers.{i}.w_{gate,up,down}.{q,s} (int4)
  lm_head.weight -> lm_head.{q,s}; with tied embeddings, the embedding table quantized
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

import numpy as np

from gpu_worker.checkpoints.hf_config import CheckpointSpec, read_spec
from gpu_worker.checkpoints.safetensors import CheckpointError, SafetensorsFile, to_float32
from gpu_worker.models.configs import QUANT_BLOCK, ModelConfig
from gpu_worker.models.rope import inv_freq
from gpu_worker.models.weights import quantize, weight_names

CHUNK_ROWS = 4096  # rows of a linear converted at once: 4096 x 14336 f32 is 235 MB
FLOAT_DTYPES = ("F32", "F16", "BF16")
INDEX = "model.safetensors.index.json"

_LINEARS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
            "w_down": "mlp.down_proj"}


@dataclass(frozen=True)
class Source:
    """Where one of our weights comes from: an HF tensor, and how it is converted."""
    hf_name: str
    kind: str                    # "table" (f16) | "vector" (f32) | "int4" (.q/.s pair)
    shape: tuple[int, ...]


def sources(spec: CheckpointSpec) -> dict[str, Source]:
    """Our weight name (without .q/.s) -> its HF source, in load order."""
    cfg = spec.cfg
    h, kvd = cfg.hidden, cfg.kv_heads * cfg.head_dim
    out = {"embed": Source("model.embed_tokens.weight", "table", (cfg.vocab_size, h))}
    shapes = cfg.linear_shapes()
    for i in range(cfg.layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        out[p + "attn_norm.w"] = Source(hf + "input_layernorm.weight", "vector", (h,))
        out[p + "mlp_norm.w"] = Source(hf + "post_attention_layernorm.weight", "vector", (h,))
        for lin, name in _LINEARS.items():
            out[p + lin] = Source(hf + name + ".weight", "int4", shapes[lin])
        if cfg.qkv_bias:
            for lin, dim in (("wq", h), ("wk", kvd), ("wv", kvd)):
                out[p + lin + ".b"] = Source(hf + _LINEARS[lin] + ".bias", "vector", (dim,))
    out["final_norm.w"] = Source("model.norm.weight", "vector", (h,))
    head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
    out["lm_head"] = Source(head, "int4", (cfg.vocab_size, h))
    return out


def _shard_map(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> its shard file; only the shards the index names are opened."""
    index = directory / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return {str(k): directory / str(v) for k, v in weight_map.items()}
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{INDEX} is not a valid index ({exc!r})", file=str(index)) from None
    single = directory / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{directory.name}: neither model.safetensors nor {INDEX} is present "
                              "(only safetensors checkpoints are supported)", file=str(single))
    return {}  # every name lives in the single file


class Checkpoint:
    """An opened, fully validated checkpoint; `weights()` streams it. `close()` unmaps."""

    def __init__(self, directory: pathlib.Path, spec: CheckpointSpec,
                 files: dict[pathlib.Path, SafetensorsFile], where: dict[str, pathlib.Path]) -> None:
        self.directory, self.spec, self._files, self._where = directory, spec, files, where
        self._sources = sources(spec)

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.cfg

    @classmethod
    def open(cls, directory: pathlib.Path, max_context: int) -> Checkpoint:
        directory = pathlib.Path(directory)
        spec = read_spec(directory, max_context)
        shard_of = _shard_map(directory)
        single = directory / "model.safetensors"
        files: dict[pathlib.Path, SafetensorsFile] = {}
        where: dict[str, pathlib.Path] = {}
        try:
            for name, src in sources(spec).items():
                path = shard_of.get(src.hf_name, single if not shard_of else None)
                if path is None:
                    raise CheckpointError(f"{INDEX}: tensor {src.hf_name!r} is not in the weight_map",
                                          file=str(directory / INDEX), tensor=src.hf_name)
                if path not in files:
                    files[path] = SafetensorsFile(path)
                dtype, shape = files[path].info(src.hf_name)
                if tuple(shape) != src.shape or dtype not in FLOAT_DTYPES:
                    raise CheckpointError(
                        f"{path.name}, tensor {src.hf_name!r}: {dtype}{list(shape)} disagrees with "
                        f"config.json, which implies a float tensor of shape {list(src.shape)}",
                        file=str(path), tensor=src.hf_name)
                where[name] = path
        except BaseException:
            for f in files.values():
                f.close()
            raise
        return cls(directory, spec, files, where)

    def _float(self, key: str, rows: slice | None = None) -> np.ndarray:
        src_file, hf = self._files[self._where[key]], self._sources[key].hf_name
        dtype, _ = src_file.info(hf)
        view = src_file.tensor(hf)
        return to_float32(view if rows is None else view[rows], dtype)

    def weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """(key, host array) in weight_names order: f16 tables, f32 vectors, int4 .q/.s pairs."""
        cfg = self.cfg
        emitted = []
        for key, src in self._sources.items():
            if src.kind == "table":
                emitted.append(key)
                yield key, self._float(key).astype(np.float16)
            elif src.kind == "vector":
                emitted.append(key)
                yield key, self._float(key)
            else:
                packed, scales = self._quantize(key, src.shape)
                emitted += [key + ".q", key + ".s"]
                yield key + ".q", packed
                yield key + ".s", scales
        if cfg.rope_scaling is not None:
            emitted.append("rope.inv_freq")
            yield "rope.inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta,
                                            cfg.rope_scaling).astype(np.float32)
        assert sorted(emitted) == sorted(weight_names(cfg)), "loader and weight_names disagree"

    def _quantize(self, key: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        out_dim, in_dim = shape
        packed = np.empty((out_dim, in_dim // 2), np.uint8)
        scales = np.empty((out_dim, in_dim // QUANT_BLOCK), np.float16)
        for r in range(0, out_dim, CHUNK_ROWS):
            rows = slice(r, min(r + CHUNK_ROWS, out_dim))
            q = quantize(self._float(key, rows))
            packed[rows], scales[rows] = q.packed, q.scales
        return packed, scales

    def host_weights(self) -> dict[str, np.ndarray]:
        """Every weight in host memory (tests and the NumPy reference; small models only)."""
        return dict(self.weights())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
