"""A Hugging Face checkpoint directory -> our weight keys, streamed one tensor at a time.

Hazard: an 8B model is 16 GB of bf16; holding it as floats and then as int4 would need three
times that in host memory. Contract: `Checkpoint.weights()` yields (key, host array) in
`weight_names` order, each converted straight from the mmap of its shard (linears quantized in
row chunks of `CHUNK_ROWS`), so the largest transient is one chunk of float32 plus the int4 result
of one tensor. Every tensor's name, shape and dtype are checked against config.json before any is
converted (`Checkpoint.open` does it), so a bad checkpoint fails before the device is touched and
names the file and the tensor. Cost: one pass over the files; the quantization is vectorized NumPy.
`weight_format="fp16"` keeps every linear as stored: cast to one fp16 `<key>.h` matrix in the same
row chunks (no quantization); a value beyond fp16's range (|x| > 65504) is refused, naming the
tensor, rather than served as inf. GPTQ files are already 4-bit: they load as int4 only.
The name mapping is in mapping.py, file lookup in shards.py, GPTQ's layout in gptq.py.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import numpy as np

from gpu_worker.checkpoints import gptq
from gpu_worker.checkpoints.hf_config import CheckpointSpec, read_spec
from gpu_worker.checkpoints.mapping import Source, sources
from gpu_worker.checkpoints.safetensors import CheckpointError
from gpu_worker.checkpoints.shards import FLOAT_DTYPES, ShardSet
from gpu_worker.models.configs import QUANT_BLOCK, WEIGHT_FORMATS, ModelConfig
from gpu_worker.models.rope import inv_freq
from gpu_worker.models.weights import quantize, weight_names
from services.common.errors import FailedPrecondition, InvalidArgument

CHUNK_ROWS = 1024  # rows of a linear converted at once: 1024 x 14336 f32 is 59 MB
# NumPy releases the GIL inside its loops, so row chunks quantize in parallel threads; the
# transient host memory is QUANT_THREADS chunks of f32.
QUANT_THREADS = max(1, min(8, os.cpu_count() or 1))
F16_MAX = 65504.0   # the largest finite fp16


def _check_float(shards: ShardSet, spec: CheckpointSpec, src: Source) -> None:
    shards.require(src.hf_name, FLOAT_DTYPES, src.hf_shape or src.shape, "a float tensor")
    if src.plus_row0:  # BERT's token-type table: any number of types (row 0 is used), hidden wide
        shape = shards.shape(src.plus_row0)
        types = shape[0] if len(shape) == 2 else 0
        shards.require(src.plus_row0, FLOAT_DTYPES, (max(types, 1), spec.cfg.hidden),
                       "a float table with at least one row")


def _check_gptq(shards: ShardSet, spec: CheckpointSpec, src: Source) -> None:
    """Shapes and dtypes of the GPTQ tensors, then what does not map onto our blocks without
    requantizing: act-order (g_idx other than i // group) and zero points other than 8."""
    out_dim, in_dim = src.shape
    group = in_dim if spec.gptq_group == -1 else spec.gptq_group
    base = src.hf_name
    if in_dim % group:
        raise CheckpointError(f"GPTQ group_size {group} does not divide the input dimension "
                              f"{in_dim} of {base!r}", tensor=base)
    shards.require(base + ".qweight", ("I32",), (in_dim // 8, out_dim), "int32 nibbles")
    shards.require(base + ".qzeros", ("I32",), (in_dim // group, out_dim // 8), "int32 zeros")
    shards.require(base + ".scales", ("F16",), (in_dim // group, out_dim), "fp16 scales")
    if shards.present(base + ".g_idx"):
        shards.require(base + ".g_idx", ("I32",), (in_dim,), "int32 group indices")
        if not np.array_equal(shards.raw(base + ".g_idx"), np.arange(in_dim) // group):
            raise FailedPrecondition(f"{shards.file_name(base + '.g_idx')}, tensor "
                                     f"{base + '.g_idx'!r}: act-order (desc_act) GPTQ is not "
                                     "supported", tensor=base + ".g_idx")
    if not (gptq.zeros(shards.raw(base + ".qzeros"), spec.gptq_v2) == 8).all():
        raise CheckpointError(f"{shards.file_name(base + '.qzeros')}, tensor {base + '.qzeros'!r}: "
                              "zero points other than 8 (asymmetric GPTQ) are not supported",
                              tensor=base + ".qzeros")


def _resolve(shards: ShardSet, spec: CheckpointSpec) -> dict[str, Source]:
    """The sources of this checkpoint's files: the BERT prefix, a GPTQ file's lm_head."""
    prefix = ""
    if spec.cfg.family == "encoder" and shards.present("bert.embeddings.word_embeddings.weight"):
        prefix = "bert."  # saved from a task model
    srcs = sources(spec, prefix)
    if spec.gptq_group:
        head = srcs["lm_head"]
        if shards.present("lm_head.qweight"):
            srcs["lm_head"] = Source("lm_head", "gptq", head.shape)
        else:  # GPTQ files usually keep lm_head (or the tied embedding) in float
            name = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
            srcs["lm_head"] = Source(name, "int4", head.shape)
    return srcs


def _by_row_chunks(rows: int, convert: Callable[[slice], None]) -> None:
    """`convert` every CHUNK_ROWS rows, on QUANT_THREADS threads when there are several chunks."""
    chunks = [slice(r, min(r + CHUNK_ROWS, rows)) for r in range(0, rows, CHUNK_ROWS)]
    if QUANT_THREADS == 1 or len(chunks) == 1:
        for c in chunks:
            convert(c)
    else:
        with ThreadPoolExecutor(QUANT_THREADS) as pool:
            list(pool.map(convert, chunks))   # list(): re-raise a chunk's exception here


class Checkpoint:
    """An opened, fully validated checkpoint; `weights()` streams it. `close()` unmaps."""

    def __init__(self, directory: pathlib.Path, spec: CheckpointSpec, shards: ShardSet,
                 srcs: dict[str, Source]) -> None:
        self.directory, self.spec, self._shards, self._sources = directory, spec, shards, srcs

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.cfg

    @classmethod
    def open(cls, directory: pathlib.Path, max_context: int,
             weight_format: str = "int4") -> Checkpoint:
        """`weight_format`: "int4" (quantized on load; the default) or "fp16" (kept as stored)."""
        directory = pathlib.Path(directory)
        if weight_format not in WEIGHT_FORMATS:
            raise InvalidArgument(f"weight_format {weight_format!r}: use 'int4' (the default) "
                                  "or 'fp16'")
        spec = read_spec(directory, max_context)
        if weight_format == "fp16" and spec.gptq_group:
            raise InvalidArgument(f"{directory.name} is a GPTQ checkpoint (already 4-bit): load "
                                  "it with weight_format 'int4'; 'fp16' serves float checkpoints")
        spec = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg,
                                                                 weight_format=weight_format))
        shards = ShardSet(directory)
        try:
            srcs = _resolve(shards, spec)
            for src in srcs.values():
                (_check_gptq if src.kind == "gptq" else _check_float)(shards, spec, src)
        except BaseException:
            shards.close()
            raise
        return cls(directory, spec, shards, srcs)

    def weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """(key, host array) in weight_names order: f16 tables, f32 vectors, int4 .q/.s pairs
        (or fp16 `.h` linears)."""
        cfg, shards = self.cfg, self._shards
        emitted = []
        for key, src in self._sources.items():
            if src.kind == "table":
                table = shards.float32(src.hf_name, slice(0, src.shape[0]))
                if src.plus_row0:  # BERT: every position has token type 0
                    table = table + shards.float32(src.plus_row0, slice(0, 1))
                emitted.append(key)
                yield key, table.astype(np.float16)
                continue
            if src.kind == "vector":
                emitted.append(key)
                yield key, shards.float32(src.hf_name)
                continue
            if self.cfg.weight_format == "fp16":   # GPTQ is refused at open
                emitted.append(key + ".h")
                yield key + ".h", self._to_f16(src.hf_name, src.shape)
                continue
            if src.kind == "gptq":
                packed, scales = gptq.to_blocks(shards.raw(src.hf_name + ".qweight"),
                                                shards.raw(src.hf_name + ".scales"),
                                                self.spec.gptq_group)
            else:
                packed, scales = self._quantize(src.hf_name, src.shape)
            emitted += [key + ".q", key + ".s"]
            yield key + ".q", packed
            yield key + ".s", scales
        if cfg.rope_scaling is not None:
            emitted.append("rope.inv_freq")
            yield "rope.inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta,
                                            cfg.rope_scaling).astype(np.float32)
        assert sorted(emitted) == sorted(weight_names(cfg)), "loader and weight_names disagree"

    def _to_f16(self, hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The linear as stored, cast to fp16 row chunk by row chunk (bf16 -> fp16 is exact for
        every value in fp16's normal range; f32 rounds to nearest)."""
        out = np.empty(shape, np.float16)

        def chunk(rows: slice) -> None:
            values = self._shards.float32(hf_name, rows)
            if not (np.abs(values) <= F16_MAX).all():   # also catches inf and NaN
                raise CheckpointError(f"{self._shards.file_name(hf_name)}, tensor {hf_name!r}: "
                                      "values beyond fp16's range (|x| > 65504, inf or NaN): "
                                      "load it with weight_format 'int4'", tensor=hf_name)
            out[rows] = values
        _by_row_chunks(shape[0], chunk)
        return out

    def _quantize(self, hf_name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        out_dim, in_dim = shape
        packed = np.empty((out_dim, in_dim // 2), np.uint8)
        scales = np.empty((out_dim, in_dim // QUANT_BLOCK), np.float16)

        def chunk(rows: slice) -> None:
            q = quantize(self._shards.float32(hf_name, rows))
            packed[rows], scales[rows] = q.packed, q.scales
        _by_row_chunks(out_dim, chunk)
        return packed, scales

    def host_weights(self) -> dict[str, np.ndarray]:
        """Every weight in host memory (tests and the NumPy reference; small models only)."""
        return dict(self.weights())

    def close(self) -> None:
        self._shards.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
