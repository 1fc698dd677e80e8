"""Deterministic model weights from a seed (no downloads), int4 block-quantized linears.

Layout of a quantized linear of shape (out, in), block 32 along `in`:
  packed  uint8 (out, in // 2): element 2j in the low nibble of byte j, 2j+1 in the high nibble;
          a nibble n stands for the integer n - 8, in [-8, 7]
  scales  float16 (out, in // 32)
  w[o, i] = (nibble(o, i) - 8) * scales[o, i // 32]

Every tensor is drawn from its own stream, `SeedSequence([seed, crc32(name)])`, so a tensor does
not change when another is added, and generation is lazy: the 36 GiB `large` config is produced
tensor by tensor straight into pinned memory, never as floats.

A decoder layer runs q/k/v as one linear and gate/up as one (FUSED_LINEARS, DESIGN 6.2: fewer
nodes a step): `fuse_linears` concatenates their tensors along N (rows) as they stream to the
device, for generated and checkpoint weights alike; a checkpoint's loader converts the parts
straight into their rows (`Fusion.array`, `Checkpoint.weights(fuse=True)`), so nothing is copied
twice. Every tensor of a linear has N rows (int4
packed (N, K/2) and scales (N, K/32), fp16 (N, K), a bias (N,)), so the concatenation is exact
and the fused linear is the same linear with a bigger N. The sources (`generate`, a checkpoint,
`weight_names`, the NumPy references) keep the per-projection keys.
"""
from __future__ import annotations

import os
import re
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from gpu_worker.models.configs import QUANT_BLOCK, ModelConfig
from gpu_worker.models.rope import inv_freq

# Uniform integers on [-8, 7] have a standard deviation of ~4.61; scales centre on
# 1 / (4.61 * sqrt(in)) so a linear roughly preserves the activations' scale.
_NIBBLE_STD = float(np.sqrt((16**2 - 1) / 12.0))


@dataclass(frozen=True)
class QuantizedLinear:
    packed: np.ndarray   # uint8 (out, in // 2)
    scales: np.ndarray   # float16 (out, in // 32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def dequantize(self) -> np.ndarray:
        """float32 (out, in)."""
        return dequantize(self.packed, self.scales)


def quantize(w: np.ndarray) -> QuantizedLinear:
    """Symmetric int4 per block of 32 along the input dimension (absmax / 7, fp16 scales)."""
    out_dim, in_dim = w.shape
    if in_dim % QUANT_BLOCK:
        raise ValueError(f"input dimension {in_dim} is not a multiple of {QUANT_BLOCK}")
    blocks = w.astype(np.float32).reshape(out_dim, in_dim // QUANT_BLOCK, QUANT_BLOCK)
    scales = (np.abs(blocks).max(axis=2) / 7.0).astype(np.float16)
    safe = np.where(scales == 0, np.float16(1), scales).astype(np.float32)[..., None]
    q = np.clip(np.rint(blocks / safe), -8, 7).astype(np.int16).reshape(out_dim, in_dim)
    nib = (q + 8).astype(np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return QuantizedLinear(packed, scales)


def dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    out_dim = packed.shape[0]
    nib = np.empty((out_dim, packed.shape[1] * 2), dtype=np.int16)
    nib[:, 0::2] = packed & 0x0F
    nib[:, 1::2] = packed >> 4
    q = (nib - 8).astype(np.float32).reshape(out_dim, -1, QUANT_BLOCK)
    return (q * scales.astype(np.float32)[..., None]).reshape(out_dim, -1)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """`rng.bytes(n)` as uint8, drawn 5x faster: Generator.bytes takes full-range uint32s, which
    PCG64 serves as the low then the high half of each 64-bit output, i.e. the raw outputs'
    little-endian bytes; the generator's state advances the same. n a multiple of 8 (a linear's
    packed bytes always are)."""
    if n % 8 or np.little_endian is False:
        return np.frombuffer(rng.bytes(n), dtype=np.uint8)
    return rng.bit_generator.random_raw(n // 8).view(np.uint8)


def random_linear(seed: int, name: str, out_dim: int, in_dim: int) -> QuantizedLinear:
    rng = _rng(seed, name)
    packed = _random_bytes(rng, out_dim * in_dim // 2).reshape(out_dim, in_dim // 2)
    base = 1.0 / (_NIBBLE_STD * np.sqrt(in_dim))
    scales = (base * rng.uniform(0.75, 1.25, size=(out_dim, in_dim // QUANT_BLOCK))).astype(np.float16)
    return QuantizedLinear(packed, scales)


def random_vector(seed: int, name: str, n: int, mean: float, spread: float) -> np.ndarray:
    return (mean + spread * _rng(seed, name).uniform(-1.0, 1.0, size=n)).astype(np.float32)


def random_table(seed: int, name: str, rows: int, cols: int) -> np.ndarray:
    return _rng(seed, name).standard_normal((rows, cols), dtype=np.float32).astype(np.float16)


def weight_names(cfg: ModelConfig) -> list[str]:
    """Every weight key of the model, in load order."""
    names = ["embed"] + (["pos_embed", "embed_norm.w", "embed_norm.b"] if cfg.family == "encoder" else [])
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        norms = ["attn_norm.w", "mlp_norm.w"] if cfg.family == "decoder" else \
            ["attn_norm.w", "attn_norm.b", "mlp_norm.w", "mlp_norm.b"]
        names += [p + n for n in norms]
        for lin in cfg.linear_shapes():
            names += cfg.linear_keys(p + lin)
        if cfg.qkv_bias:
            names += [p + "wq.b", p + "wk.b", p + "wv.b"]
        if cfg.linear_bias:
            names += [p + lin + ".b" for lin in cfg.linear_shapes()]
    if cfg.family == "decoder":
        names += ["final_norm.w", *cfg.linear_keys("lm_head")]
        if cfg.rope_scaling is not None:
            names.append("rope.inv_freq")
    return names


def weight_sizes(cfg: ModelConfig) -> list[int]:
    """Bytes of every weight tensor, in load order, without generating any of them."""
    h = cfg.hidden
    sizes = [cfg.vocab_size * h * 2]
    if cfg.family == "encoder":
        sizes += [cfg.max_context * h * 2, h * 4, h * 4]
    norms = 2 if cfg.family == "decoder" else 4
    per_layer = [h * 4] * norms
    for o, i in cfg.linear_shapes().values():
        per_layer += cfg.linear_sizes(o, i)
    if cfg.qkv_bias:
        kvd = cfg.kv_heads * cfg.head_dim
        per_layer += [h * 4, kvd * 4, kvd * 4]
    if cfg.linear_bias:
        per_layer += [o * 4 for o, _ in cfg.linear_shapes().values()]
    sizes += per_layer * cfg.layers
    if cfg.family == "decoder":
        sizes += [h * 4, *cfg.linear_sizes(cfg.vocab_size, h)]
        if cfg.rope_scaling is not None:
            sizes.append(cfg.head_dim // 2 * 4)
    return sizes


GENERATE_THREADS = min(8, os.cpu_count() or 1)   # tensors drawn at once (NumPy drops the GIL)
GENERATE_AHEAD = 2   # tensors in flight per thread: bounds the host memory generation holds


def generate(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (key, host array) for every weight, deterministically from `seed`.

    Quantized linears yield two keys, `<name>.q` (packed uint8) and `<name>.s` (fp16 scales);
    with `cfg.weight_format == "fp16"` one, `<name>.h`: the same weight dequantized to fp16.
    Tensors are drawn GENERATE_THREADS at a time, at most GENERATE_AHEAD a thread ahead of the
    consumer, and yielded in load order: each has its own stream, so the values do not depend
    on the threads (the `large` config's 36 GiB took minutes one tensor at a time).
    """
    h = cfg.hidden
    draws: list[Callable[[], list[tuple[str, np.ndarray]]]] = [
        lambda: [("embed", random_table(seed, "embed", cfg.vocab_size, h))]]
    if cfg.family == "encoder":
        draws.append(lambda: [
            ("pos_embed", random_table(seed, "pos_embed", cfg.max_context, h) * np.float16(0.1)),
            ("embed_norm.w", random_vector(seed, "embed_norm.w", h, 1.0, 0.1)),
            ("embed_norm.b", random_vector(seed, "embed_norm.b", h, 0.0, 0.1))])
    linears = cfg.linear_shapes()

    def vector(key: str, n: int, mean: float) -> Callable[[], list[tuple[str, np.ndarray]]]:
        return lambda: [(key, random_vector(seed, key, n, mean, 0.1))]

    def linear(name: str, o: int, i: int) -> Callable[[], list[tuple[str, np.ndarray]]]:
        return lambda: list(_linear(cfg, name, random_linear(seed, name, o, i)))

    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        for norm in ("attn_norm", "mlp_norm"):
            draws.append(vector(p + norm + ".w", h, 1.0))
            if cfg.family == "encoder":
                draws.append(vector(p + norm + ".b", h, 0.0))
        draws += [linear(p + lin, o, i) for lin, (o, i) in linears.items()]
        if cfg.qkv_bias:
            draws += [vector(p + lin + ".b", linears[lin][0], 0.0) for lin in ("wq", "wk", "wv")]
        if cfg.linear_bias:
            draws += [vector(p + lin + ".b", o, 0.0) for lin, (o, _) in linears.items()]
    if cfg.family == "decoder":
        draws.append(vector("final_norm.w", h, 1.0))
        draws.append(linear("lm_head", cfg.vocab_size, h))
        if cfg.rope_scaling is not None:
            draws.append(lambda: [("rope.inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta,
                                                              cfg.rope_scaling).astype(np.float32))])
    yield from _in_order(draws, GENERATE_THREADS, GENERATE_THREADS * GENERATE_AHEAD)


def _in_order(draws: list[Callable[[], list[tuple[str, np.ndarray]]]], threads: int,
              ahead: int) -> Iterator[tuple[str, np.ndarray]]:
    """The draws' items in order, up to `ahead` draws computed ahead on `threads` threads."""
    if threads <= 1:
        for draw in draws:
            yield from draw()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="weights") as pool:
        pending: deque[Future] = deque()
        try:
            for draw in draws:
                pending.append(pool.submit(draw))
                if len(pending) > ahead:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:   # a consumer that stops early: drop what was not started
            for f in pending:
                f.cancel()


def _linear(cfg: ModelConfig, name: str, q: QuantizedLinear) -> Iterator[tuple[str, np.ndarray]]:
    if cfg.weight_format == "fp16":
        yield name + ".h", q.dequantize().astype(np.float16)
    else:
        yield name + ".q", q.packed
        yield name + ".s", q.scales


def load_host(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """All weights in host memory (for the NumPy reference and small configs)."""
    return dict(generate(cfg, seed))


# A decoder layer's linears that run as one, in concatenation order: out rows are q | k | v and
# gate | up.
FUSED_LINEARS: dict[str, tuple[str, ...]] = {"wqkv": ("wq", "wk", "wv"),
                                             "w_gateup": ("w_gate", "w_up")}
_MEMBER = {m: fused for fused, members in FUSED_LINEARS.items() for m in members}
_FUSABLE = re.compile(r"^(layers\.\d+\.)(" + "|".join(_MEMBER) + r")\.([qshb])$")


def fuses(cfg: ModelConfig) -> bool:
    """Whether `cfg`'s layers run fused linears (decoders; the encoder keeps its projections)."""
    return cfg.family == "decoder"


def fused_key(key: str) -> str:
    """The device key a source key loads into: `layers.3.wk.q` -> `layers.3.wqkv.q`."""
    m = _FUSABLE.match(key)
    return f"{m.group(1)}{_MEMBER[m.group(2)]}.{m.group(3)}" if m else key


def device_weight_names(cfg: ModelConfig) -> list[str]:
    """The weight keys the model's graphs read: weight_names with the fused linears' parts
    named once, by their fused key."""
    names = weight_names(cfg)
    return list(dict.fromkeys(fused_key(k) for k in names)) if fuses(cfg) else names


class Fusion:
    """The fused linears of one model, built part by part. `array(key, shape, dtype)` is where a
    source tensor goes: for a part of a fused linear, its rows of the fused tensor (allocated at
    its first part), so a producer that writes there (the checkpoint loader) copies nothing more;
    for any other key a new array. `done(key, host)` takes a finished tensor (copied into its rows
    unless it is that very view) and returns what is ready to yield: the fused tensor once its
    last part is in, nothing before; any other tensor as it is. `close()` refuses missing parts."""

    def __init__(self, cfg: ModelConfig) -> None:
        self._rows = {lin: o for lin, (o, _) in cfg.linear_shapes().items()}
        self._pending: dict[str, tuple[np.ndarray, set[str]]] = {}
        self._views: dict[str, np.ndarray] = {}   # source key -> its rows, handed out by array()

    def array(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if _FUSABLE.match(key) is None:
            return np.empty(shape, dtype)
        view = self._rows_of(key, tuple(shape), np.dtype(dtype))
        self._views[key] = view
        return view

    def done(self, key: str, host: np.ndarray) -> list[tuple[str, np.ndarray]]:
        m = _FUSABLE.match(key)
        if m is None:
            return [(key, host)]
        host = np.asarray(host)
        view = self._views.pop(key, None)
        if view is None or host is not view:
            view = self._rows_of(key, host.shape, host.dtype)
            view[...] = host
        lin, out_key = m.group(2), fused_key(key)
        fused, seen = self._pending[out_key]
        seen.add(lin)
        if len(seen) < len(FUSED_LINEARS[_MEMBER[lin]]):
            return []
        del self._pending[out_key]
        return [(out_key, fused)]

    def close(self) -> None:
        if self._pending:
            raise ValueError(f"fused linears missing parts: {sorted(self._pending)}")

    def _rows_of(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        m = _FUSABLE.match(key)
        lin, out_key = m.group(2), fused_key(key)
        members = FUSED_LINEARS[_MEMBER[lin]]
        if shape[:1] != (self._rows[lin],):
            raise ValueError(f"{key}: {shape[0]} rows, the config says {self._rows[lin]}")
        if out_key not in self._pending:
            total = sum(self._rows[x] for x in members)
            self._pending[out_key] = (np.empty((total, *shape[1:]), dtype), set())
        fused, seen = self._pending[out_key]
        if shape[1:] != fused.shape[1:] or dtype != fused.dtype or lin in seen:
            raise ValueError(f"{key}: {dtype} {shape} does not concatenate into "
                             f"{out_key} ({fused.dtype} {fused.shape})")
        row0 = sum(self._rows[x] for x in members[:members.index(lin)])
        return fused[row0:row0 + self._rows[lin]]


def fuse_linears(cfg: ModelConfig, source: Iterable[tuple[str, np.ndarray]]
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """`source`'s (key, host array)s with each layer's q/k/v and gate/up tensors concatenated
    along N into one (FUSED_LINEARS), yielded once its last part arrives; other tensors (and
    tensors already fused, as a checkpoint's `weights(fuse=True)` yields them) pass through in
    order. Each fused tensor is allocated at its first part and filled part by part, so the host
    holds it and the part in hand, not every part and a copy."""
    if not fuses(cfg):
        yield from source
        return
    fusion = Fusion(cfg)
    for key, host in source:
        yield from fusion.done(key, host)
    fusion.close()
