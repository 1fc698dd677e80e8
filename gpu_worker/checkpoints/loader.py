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
BERT ([bert.] prefix optional; LayerNorm gamma/beta accepted for weight/bias):
  embeddings.word_embeddings -> embed; embeddings.position_embeddings (first max_context rows)
  + token_type_embeddings row 0 -> pos_embed; embeddings.LayerNorm -> embed_norm.{w,b}
  encoder.layer.{i}.attention.self.{query,key,value}, attention.output.dense, intermediate.dense,
  output.dense -> layers.{i}.{wq,wk,wv,wo,w_up,w_down} (int4 + .b biases);
  attention.output.LayerNorm -> attn_norm, output.LayerNorm -> mlp_norm
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

import numpy as np

from gpu_worker.checkpoints import gptq
from gpu_worker.checkpoints.hf_config import CheckpointSpec, read_spec
from gpu_worker.checkpoints.safetensors import CheckpointError, SafetensorsFile, to_float32
from gpu_worker.models.configs import QUANT_BLOCK, ModelConfig
from gpu_worker.models.rope import inv_freq
from gpu_worker.models.weights import quantize, weight_names
from services.common.errors import FailedPrecondition

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
    kind: str                    # "table" (f16) | "vector" (f32) | "int4" (.q/.s pair) |
                                 # "gptq" (.q/.s pair from `<hf_name>.qweight/.qzeros/.scales`)
    shape: tuple[int, ...]       # ours
    hf_shape: tuple[int, ...] | None = None  # the stored one, where it differs (position table)
    plus_row0: str = ""          # BERT: token-type row 0 folded into the position table


# BERT (sentence-transformers layout): our encoder weight -> the tensor under `encoder.layer.{i}.`
_BERT_LINEARS = {"wq": "attention.self.query", "wk": "attention.self.key",
                 "wv": "attention.self.value", "wo": "attention.output.dense",
                 "w_up": "intermediate.dense", "w_down": "output.dense"}
_BERT_NORMS = {"attn_norm": "attention.output.LayerNorm", "mlp_norm": "output.LayerNorm"}


def sources(spec: CheckpointSpec, prefix: str = "") -> dict[str, Source]:
    """Our weight name (without .q/.s) -> its HF source, in load order. `prefix`: "bert." for
    BERT checkpoints saved from a task model, "" for a bare BertModel."""
    if spec.cfg.family == "encoder":
        return _encoder_sources(spec, prefix)
    cfg = spec.cfg
    h, kvd = cfg.hidden, cfg.kv_heads * cfg.head_dim
    out = {"embed": Source("model.embed_tokens.weight", "table", (cfg.vocab_size, h))}
    shapes = cfg.linear_shapes()
    for i in range(cfg.layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        out[p + "attn_norm.w"] = Source(hf + "input_layernorm.weight", "vector", (h,))
        out[p + "mlp_norm.w"] = Source(hf + "post_attention_layernorm.weight", "vector", (h,))
        for lin, name in _LINEARS.items():
            out[p + lin] = (Source(hf + name, "gptq", shapes[lin]) if spec.gptq_group
                            else Source(hf + name + ".weight", "int4", shapes[lin]))
        if cfg.qkv_bias:
            for lin, dim in (("wq", h), ("wk", kvd), ("wv", kvd)):
                out[p + lin + ".b"] = Source(hf + _LINEARS[lin] + ".bias", "vector", (dim,))
    out["final_norm.w"] = Source("model.norm.weight", "vector", (h,))
    head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
    out["lm_head"] = Source(head, "int4", (cfg.vocab_size, h))
    return out


def _encoder_sources(spec: CheckpointSpec, prefix: str) -> dict[str, Source]:
    cfg, h, e = spec.cfg, spec.cfg.hidden, prefix + "embeddings."
    out = {"embed": Source(e + "word_embeddings.weight", "table", (cfg.vocab_size, h)),
           "pos_embed": Source(e + "position_embeddings.weight", "table", (cfg.max_context, h),
                               (spec.positions, h), e + "token_type_embeddings.weight"),
           "embed_norm.w": Source(e + "LayerNorm.weight", "vector", (h,)),
           "embed_norm.b": Source(e + "LayerNorm.bias", "vector", (h,))}
    shapes = cfg.linear_shapes()
    for i in range(cfg.layers):
        hf, p = f"{prefix}encoder.layer.{i}.", f"layers.{i}."
        for ours, theirs in _BERT_NORMS.items():
            out[p + ours + ".w"] = Source(hf + theirs + ".weight", "vector", (h,))
            out[p + ours + ".b"] = Source(hf + theirs + ".bias", "vector", (h,))
        for lin, name in _BERT_LINEARS.items():
            out[p + lin] = Source(hf + name + ".weight", "int4", shapes[lin])
            out[p + lin + ".b"] = Source(hf + name + ".bias", "vector", (shapes[lin][0],))
    return out


def _alias(name: str) -> str:
    """Old BERT checkpoints spell LayerNorm weight/bias as gamma/beta."""
    return name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")


def _check_gptq(files: dict[pathlib.Path, SafetensorsFile],
                where: dict[str, tuple[pathlib.Path, str]], base: str, group: int, v2: bool) -> None:
    """Refuse act-order (g_idx not i // group) and asymmetric zero points: neither maps onto our
    blocks without requantizing."""
    def read(part: str) -> tuple[str, np.ndarray]:
        path, stored = where[f"{base}.{part}"]
        return path.name, files[path].tensor(stored)
    if f"{base}.g_idx" in where:
        name, g_idx = read("g_idx")
        if not np.array_equal(g_idx, np.arange(g_idx.shape[0]) // group):
            raise FailedPrecondition(f"{name}, tensor {base + '.g_idx'!r}: act-order (desc_act) "
                                     "GPTQ is not supported", tensor=base + ".g_idx")
    name, qzeros = read("qzeros")
    if not (gptq.zeros(qzeros, v2) == 8).all():
        raise CheckpointError(f"{name}, tensor {base + '.qzeros'!r}: zero points other than 8 "
                              "(asymmetric GPTQ) are not supported", tensor=base + ".qzeros")


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
                 files: dict[pathlib.Path, SafetensorsFile],
                 where: dict[str, tuple[pathlib.Path, str]], srcs: dict[str, Source]) -> None:
        self.directory, self.spec, self._files, self._where = directory, spec, files, where
        self._sources = srcs

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
        where: dict[str, tuple[pathlib.Path, str]] = {}

        def locate(hf_name: str) -> tuple[pathlib.Path, str]:
            """(file, stored name) of `hf_name` or its gamma/beta alias; a name that is in
            neither is reported under its own name, by the file that should hold it."""
            fallback = None
            for candidate in dict.fromkeys((hf_name, _alias(hf_name))):
                path = shard_of.get(candidate, single if not shard_of else None)
                if path is None:
                    continue
                if path not in files:
                    files[path] = SafetensorsFile(path)
                if candidate in files[path].entries:
                    return path, candidate
                fallback = fallback or (path, hf_name)
            if fallback is None:
                raise CheckpointError(f"{INDEX}: tensor {hf_name!r} is not in the weight_map",
                                      file=str(directory / INDEX), tensor=hf_name)
            return fallback

        def present(hf_name: str) -> bool:
            if shard_of:
                return hf_name in shard_of
            return hf_name in files.setdefault(single, SafetensorsFile(single)).entries

        def check(path: pathlib.Path, stored: str, dtypes: tuple[str, ...],
                  want: tuple[int, ...] | None, what: str) -> None:
            dtype, shape = files[path].info(stored)
            if dtype not in dtypes or (want is not None and tuple(shape) != want):
                raise CheckpointError(
                    f"{path.name}, tensor {stored!r}: {dtype}{list(shape)} disagrees with "
                    f"config.json, which implies {what} of shape {list(want or [])}",
                    file=str(path), tensor=stored)

        try:
            prefix = ""
            if spec.cfg.family == "encoder":  # a task model's file prefixes every name
                if present("bert.embeddings.word_embeddings.weight"):
                    prefix = "bert."
            srcs = sources(spec, prefix)
            if spec.gptq_group and not present("lm_head.qweight"):  # lm_head is often left float
                head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
                srcs["lm_head"] = Source(head, "int4", srcs["lm_head"].shape)
            elif spec.gptq_group:
                srcs["lm_head"] = Source("lm_head", "gptq", srcs["lm_head"].shape)
            for src in srcs.values():
                if src.kind == "gptq":
                    out_dim, in_dim = src.shape
                    group = in_dim if spec.gptq_group == -1 else spec.gptq_group
                    if in_dim % group:
                        raise CheckpointError(f"GPTQ group_size {group} does not divide the input "
                                              f"dimension {in_dim} of {src.hf_name!r}")
                    parts = {"qweight": (("I32",), (in_dim // 8, out_dim), "int32 nibbles"),
                             "qzeros": (("I32",), (in_dim // group, out_dim // 8), "int32 zeros"),
                             "scales": (("F16",), (in_dim // group, out_dim), "fp16 scales")}
                    if present(src.hf_name + ".g_idx"):
                        parts["g_idx"] = (("I32",), (in_dim,), "int32 group indices")
                    for part, (dtypes, want, what) in parts.items():
                        path, stored = locate(f"{src.hf_name}.{part}")
                        check(path, stored, dtypes, want, what)
                        where[f"{src.hf_name}.{part}"] = (path, stored)
                    _check_gptq(files, where, src.hf_name, group, spec.gptq_v2)
                    continue
                for hf_name, want in ((src.hf_name, src.hf_shape or src.shape),
                                      (src.plus_row0, None)):
                    if not hf_name:
                        continue
                    path, stored = locate(hf_name)
                    dtype, shape = files[path].info(stored)
                    if (want is not None and tuple(shape) != want) or dtype not in FLOAT_DTYPES \
                            or (want is None and (len(shape) != 2 or shape[1] != spec.cfg.hidden)):
                        raise CheckpointError(
                            f"{path.name}, tensor {stored!r}: {dtype}{list(shape)} disagrees with "
                            f"config.json, which implies a float tensor of shape "
                            f"{list(want) if want else ['n', spec.cfg.hidden]}",
                            file=str(path), tensor=stored)
                    where[hf_name] = (path, stored)
        except BaseException:
            for f in files.values():
                f.close()
            raise
        return cls(directory, spec, files, where, srcs)

    def _float(self, hf_name: str, rows: slice | None = None) -> np.ndarray:
        path, stored = self._where[hf_name]
        src_file = self._files[path]
        dtype, _ = src_file.info(stored)
        view = src_file.tensor(stored)
        return to_float32(view if rows is None else view[rows], dtype)

    def weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """(key, host array) in weight_names order: f16 tables, f32 vectors, int4 .q/.s pairs."""
        cfg = self.cfg
        emitted = []
        for key, src in self._sources.items():
            if src.kind == "table":
                emitted.append(key)
                table = self._float(src.hf_name, slice(0, src.shape[0]))
                if src.plus_row0:  # BERT: every position has token type 0
                    table = table + self._float(src.plus_row0, slice(0, 1))
                yield key, table.astype(np.float16)
            elif src.kind == "vector":
                emitted.append(key)
                yield key, self._float(src.hf_name)
            elif src.kind == "gptq":
                packed, scales = gptq.to_blocks(self._raw(src.hf_name + ".qweight"),
                                                self._raw(src.hf_name + ".scales"), self.spec.gptq_group)
                emitted += [key + ".q", key + ".s"]
                yield key + ".q", packed
                yield key + ".s", scales
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

    def _raw(self, hf_name: str) -> np.ndarray:
        path, stored = self._where[hf_name]
        return np.array(self._files[path].tensor(stored))  # a copy: the mapping may close

    def _quantize(self, hf_name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        out_dim, in_dim = shape
        packed = np.empty((out_dim, in_dim // 2), np.uint8)
        scales = np.empty((out_dim, in_dim // QUANT_BLOCK), np.float16)
        for r in range(0, out_dim, CHUNK_ROWS):
            rows = slice(r, min(r + CHUNK_ROWS, out_dim))
            q = quantize(self._float(hf_name, rows))
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
