"""Run every kernel on a device against its NumPy reference: the library's self-check.

The CPU tests run it on the sim backend (argument plumbing, memory footprint, replay semantics)
and the GPU tests on the cuda backend (the CUDA code itself), over the same cases, so a case that
passes on one and fails on the other points at the CUDA source, not at the test.

    with KernelHarness(device, compiler) as h:
        outcome = CASES[0].run(h, np.random.default_rng(0))
        assert outcome.failure() is None, outcome.failure()
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import numpy as np

from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.attention import (
    ATTENTION_DECODE_KV16,
    ATTENTION_PREFILL,
    ATTENTION_PREFILL_KV16,
    KV_APPEND_KV16,
    launch_attention_decode,
    launch_attention_prefill,
    launch_kv_append,
)
from gpu_worker.kernels.common import KernelDef
from gpu_worker.kernels.elementwise import (
    ADD,
    ADD_I32,
    BIAS_ADD,
    GELU,
    SILU_GATE,
    SILU_GATE_F16,
    launch_add,
    launch_add_i32,
    launch_bias_add,
    launch_gelu,
    launch_silu_gate,
    launch_silu_gate_f16,
)
from gpu_worker.kernels.embedding import EMBEDDING_GATHER, launch_embedding_gather
from gpu_worker.kernels.half import (
    INT4_DEQUANT_F16,
    INT4_DEQUANT_F16_TILED,
    TO_F16,
    dequant_build,
    launch_int4_dequant_f16,
    launch_to_f16,
)
from gpu_worker.kernels.int4_batched import (
    INT4_MMA,
    INT4_MMA_ROWS,
    INT4_MMA_ROWS16,
    INT4_MMA_ROWS16_TILED,
    INT4_MMA_ROWS_TILED,
    INT4_MMA_XA,
    INT4_MMA_XA_TILED,
    INT4_WGMMA,
    INT4_WGMMA_TILED,
    ROW_ASYNC_CTAS,
    ROW_ASYNC_STAGES,
    XA_STAGES,
    XK_STAGES,
    launch_int4_mma,
    rows_async_build,
    rows_tiled,
    tile_packed,
    tile_scales,
    xk_build,
)
from gpu_worker.kernels.linear import (
    INT4_DEQUANT,
    INT4_MATMUL,
    MATMUL_NT,
    MATMUL_NT_LARGE,
    launch_int4_dequant,
    launch_int4_matmul,
    launch_matmul_nt,
    launch_matmul_nt_large,
)
from gpu_worker.kernels.norm import (
    LAYERNORM,
    RMSNORM,
    RMSNORM_F16,
    launch_layernorm,
    launch_rmsnorm,
    launch_rmsnorm_f16,
)
from gpu_worker.kernels.quantize import INT4_QUANTIZE, launch_int4_quantize, quantized_bytes
from gpu_worker.kernels.reduce import ARGMAX, MEAN_POOL, launch_argmax, launch_mean_pool
from gpu_worker.kernels.rotary import ROTARY, launch_rotary


class KernelHarness:
    """Loads the library's modules once per device and moves arrays to and from the device."""

    def __init__(self, device, compiler) -> None:
        self.device, self.compiler = device, compiler
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._allocs: list = []

    def function(self, kdef: KernelDef) -> object:
        name = kdef.source.module_name
        if (name, kdef.entry) not in self._functions:   # a tuning variant is another module
            if name not in self._modules:
                self._modules[name] = self.compiler.load(self.device, kdef.source)
            self._functions[name, kdef.entry] = self.device.get_function(self._modules[name],
                                                                          kdef.entry)
        return self._functions[name, kdef.entry]

    def put(self, host: np.ndarray) -> int:
        a = self.device.arena.alloc(max(1, host.nbytes), "activations")
        self._allocs.append(a)
        if host.nbytes:
            self.device.to_device(a.ptr, host)
        return a.ptr

    def get(self, p: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        self.device.synchronize()
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.device.from_device(p, n).view(dtype).reshape(shape).copy()

    def close(self) -> None:
        self.device.synchronize()
        for a in self._allocs:
            self.device.arena.free(a)
        self._allocs.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Outcome:
    got: np.ndarray
    want: np.ndarray
    rtol: float = 1e-5
    atol: float = 1e-6

    def failure(self) -> str | None:
        """None when got matches want within tolerance, else what differs and by how much."""
        if self.got.shape != self.want.shape:
            return f"shape {self.got.shape} != reference {self.want.shape}"
        if self.got.dtype.kind in "iu":
            bad = np.flatnonzero(self.got.reshape(-1) != self.want.reshape(-1))
            return None if bad.size == 0 else (
                f"{bad.size} of {self.got.size} differ; first at {bad[0]}: "
                f"{self.got.reshape(-1)[bad[0]]} != {self.want.reshape(-1)[bad[0]]}")
        err = np.abs(self.got.astype(np.float64) - self.want.astype(np.float64))
        limit = self.atol + self.rtol * np.abs(self.want.astype(np.float64))
        if np.all(err <= limit) and np.isfinite(self.got).all() == np.isfinite(self.want).all():
            return None
        i = int(np.argmax(err - limit))
        return (f"max error {err.max():.3g} (rtol {self.rtol}, atol {self.atol}); worst at flat "
                f"index {i}: got {self.got.reshape(-1)[i]!r}, want {self.want.reshape(-1)[i]!r}")


@dataclass(frozen=True)
class Case:
    kernel: str
    run_fn: Callable[..., Outcome]
    shapes: dict = field(default_factory=dict)
    covers: tuple[str, ...] = ()   # further KernelDef names the case launches

    @property
    def id(self) -> str:
        return self.kernel + "[" + ",".join(f"{k}={v}" for k, v in self.shapes.items()) + "]"

    def run(self, h: KernelHarness, rng: np.random.Generator) -> Outcome:
        return self.run_fn(h, rng, **self.shapes)


def _f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _kv(rng: np.random.Generator, kv16: bool, *shape: int) -> tuple[np.ndarray, np.ndarray]:
    """A K and a V cache, f32 or fp16."""
    dt = np.float16 if kv16 else np.float32
    return _f32(rng, *shape).astype(dt), _f32(rng, *shape).astype(dt)


# -- cases --------------------------------------------------------------------------------------
def embedding_case(h, rng, rows, hidden, vocab, accumulate=False) -> Outcome:
    table = _f32(rng, vocab, hidden).astype(np.float16)
    ids = rng.integers(0, vocab, rows).astype(np.int32)
    ids[::5] = vocab - 1
    if rows > 2:
        ids[1], ids[2] = -1, vocab  # out of range: zero rows, no out-of-bounds read
    init = _f32(rng, rows, hidden)
    out = h.put(init)
    launch_embedding_gather(h.device, h.function(EMBEDDING_GATHER), out, h.put(table), h.put(ids),
                            rows, hidden, vocab, accumulate)
    want = ref.embedding_gather(table, ids) + (init if accumulate else 0)
    return Outcome(h.get(out, (rows, hidden)), want.astype(np.float32), 0, 1e-6)


def rmsnorm_case(h, rng, rows, hidden) -> Outcome:
    x, w = _f32(rng, rows, hidden, scale=3.0), _f32(rng, hidden)
    out = h.put(np.zeros((rows, hidden), np.float32))
    launch_rmsnorm(h.device, h.function(RMSNORM), out, h.put(x), h.put(w), rows, hidden, 1e-5)
    return Outcome(h.get(out, (rows, hidden)), ref.rmsnorm(x, w, 1e-5), 1e-4, 1e-5)


def rmsnorm_f16_case(h, rng, rows, hidden) -> Outcome:
    """fp16 out: the f32 rmsnorm rounded once (one fp16 ulp of slack for an f32 ulp that flips
    the rounding)."""
    x, w = _f32(rng, rows, hidden, scale=3.0), _f32(rng, hidden)
    out = h.put(np.full((rows, hidden), np.nan, np.float16))
    launch_rmsnorm_f16(h.device, h.function(RMSNORM_F16), out, h.put(x), h.put(w), rows, hidden,
                       1e-5)
    return Outcome(h.get(out, (rows, hidden), np.float16).astype(np.float32),
                   ref.rmsnorm_f16(x, w, 1e-5).astype(np.float32), 1e-3, 1e-4)


def layernorm_case(h, rng, rows, hidden, bias=True) -> Outcome:
    x, w, b = _f32(rng, rows, hidden, scale=3.0) + 5.0, _f32(rng, hidden), _f32(rng, hidden)
    xp = h.put(x)  # in place: out aliases x
    launch_layernorm(h.device, h.function(LAYERNORM), xp, xp, h.put(w), h.put(b) if bias else 0,
                     rows, hidden, 1e-5)
    want = ref.layernorm(x, w, b if bias else None, 1e-5)
    return Outcome(h.get(xp, (rows, hidden)), want, 1e-4, 2e-5)


def _quantized(rng, n, k):
    return ref.int4_quantize(_f32(rng, n, k, scale=1.0 / np.sqrt(k)))


def int4_dequant_case(h, rng, n, k) -> Outcome:
    packed, scales = _quantized(rng, n, k)
    ws = h.put(np.full(INT4_DEQUANT.workspace_bytes(n=n, k=k) // 4, np.nan, np.float32))
    launch_int4_dequant(h.device, h.function(INT4_DEQUANT), ws, h.put(packed), h.put(scales), n, k)
    return Outcome(h.get(ws, (n, k)), ref.int4_dequantize(packed, scales, k), 0, 0)


def matmul_nt_case(h, rng, m, n, k, bias=False, accumulate=False, large=False) -> Outcome:
    x, w = _f32(rng, m, k), _f32(rng, n, k, scale=1.0 / np.sqrt(k))
    b = _f32(rng, n) if bias else None
    y0 = _f32(rng, m, n)
    y = h.put(y0)
    launch = launch_matmul_nt_large if large else launch_matmul_nt
    launch(h.device, h.function(MATMUL_NT_LARGE if large else MATMUL_NT), y, h.put(x), h.put(w),
           h.put(b) if bias else 0, m, n, k, accumulate)
    want = ref.matmul_nt(x, w, b) + (y0 if accumulate else 0)
    return Outcome(h.get(y, (m, n)), want, 1e-4, 1e-4)


def int4_matmul_case(h, rng, m, n, k, bias=False, accumulate=False) -> Outcome:
    """The int4 GEMV: fp16 x, fp16-rounded weights, f32 sums (reference.int4_matmul)."""
    packed, scales = _quantized(rng, n, k)
    x = _f32(rng, m, k).astype(np.float16)
    b = _f32(rng, n) if bias else None
    y0 = _f32(rng, m, n)
    y = h.put(y0)
    launch_int4_matmul(h.device, h.function(INT4_MATMUL), y, h.put(x), h.put(packed),
                       h.put(scales), h.put(b) if bias else 0, m, n, k, accumulate)
    want = ref.int4_matmul(x, packed, scales, b) + (y0 if accumulate else 0)
    return Outcome(h.get(y, (m, n)), want, 1e-4, 1e-4)


def _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, launch,
                         layout=None) -> Outcome:
    """One int4 linear of the contract (fp16 x sized by `scale`, fp16-rounded weights, f32 sums)
    through `launch(y, x, packed, scales, bias)` (device pointers; bias 0 when absent), against
    reference.int4_matmul at the GEMV's tolerance; `layout(packed, scales)` gives the weight's
    device layout (default the reference's)."""
    packed, scales = _quantized(rng, n, k)
    x = _f32(rng, m, k, scale=scale).astype(np.float16)
    b = _f32(rng, n) if bias else None
    y0 = _f32(rng, m, n)
    y = h.put(y0)
    dpacked, dscales = layout(packed, scales) if layout else (packed, scales)
    launch(y, h.put(x), h.put(dpacked), h.put(dscales), h.put(b) if bias else 0)
    want = ref.int4_matmul(x, packed, scales, b) + (y0 if accumulate else 0)
    return Outcome(h.get(y, (m, n)), want, 1e-4, 1e-4 * max(1.0, scale))


def int4_mma_case(h, rng, m, n, k, bias=False, accumulate=False, scale=1.0, mt=None) -> Outcome:
    """The batched tensor-core int4 linear (int4_batched.py): same contract and tolerance as the
    GEMV (fp16 x, fp16-rounded weights, f32 sums). `scale` sizes x; `mt` forces the 16-row tiles
    per warp (default: the launcher's choice)."""
    return _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, lambda *p: launch_int4_mma(
        h.device, h.function(INT4_MMA), *p, m, n, k, accumulate, mt=mt))


def int4_mma_xa_case(h, rng, m, n, k, bias=False, accumulate=False, scale=1.0, nt=None,
                     split=None, kernel=INT4_MMA_XA, stages=XA_STAGES) -> Outcome:
    """The x-as-A tensor-core int4 linear (gp_int4_mma_xa, 17..64 rows): int4_mma's contract and
    tolerance; `nt` and `split` force the weight tile and the cluster's K split (default:
    xa_plan); `kernel` and `stages` name a tuning build (bench/int4_batched_bench.py), or the
    entry over the 16-row tile layout (INT4_MMA_XA_TILED, its weights by rows_tiled)."""
    return _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, lambda *p: kernel.launcher(
        h.device, h.function(kernel), *p, m, n, k, accumulate, nt=nt, split=split, stages=stages),
        layout=rows_tiled if kernel.entry == INT4_MMA_XA_TILED.entry else None)


def int4_mma_xa_tiled_case(h, rng, m, n, k, **kw) -> Outcome:
    """int4_mma_xa_case on gp_int4_mma_xa_tiled, its weights in the 16-row tile layout."""
    return int4_mma_xa_case(h, rng, m, n, k, kernel=INT4_MMA_XA_TILED, **kw)


def int4_mma_rows_case(h, rng, m, n, k, bias=False, accumulate=False, scale=1.0) -> Outcome:
    """The rows tensor-core int4 linear (int4_batched.py) on the entry for m rows
    (gp_int4_mma_rows up to 8, gp_int4_mma_rows16 up to 16): int4_mma's contract and tolerance."""
    kdef = INT4_MMA_ROWS if m <= 8 else INT4_MMA_ROWS16
    return _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, lambda *p: kdef.launcher(
        h.device, h.function(kdef), *p, m, n, k, accumulate))


def int4_mma_rows_tiled_case(h, rng, m, n, k, bias=False, accumulate=False,
                             scale=1.0) -> Outcome:
    """The rows kernels over weights in the 16-row tile layout (int4_batched.rows_tiled;
    gp_int4_mma_rows_tiled up to 8 rows, rows16_tiled up to 16): int4_mma's contract and
    tolerance."""
    kdef = INT4_MMA_ROWS_TILED if m <= 8 else INT4_MMA_ROWS16_TILED
    return _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, lambda *p: kdef.launcher(
        h.device, h.function(kdef), *p, m, n, k, accumulate), layout=rows_tiled)


def int4_mma_xk_case(h, rng, m, n, k, bias=False, accumulate=False, scale=1.0, nt=8, wk=4,
                     split=None, stages=XK_STAGES) -> Outcome:
    """The K-over-warps tensor-core int4 linear (gp_int4_mma_xk4 / xk8, 17..64 rows; build
    (nt, wk) of int4_batched.XK_BUILDS): int4_mma's contract and tolerance; `split` forces the
    cluster's K split (default xk_plan); `stages` names a tuning build (int4_batched.xk_build)."""
    kdef = xk_build(stages)[nt]
    return _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, lambda *p: kdef.launcher(
        h.device, h.function(kdef), *p, m, n, k, accumulate, wk=wk, split=split))


def int4_mma_rows_async_case(h, rng, m, n, k, bias=False, accumulate=False, scale=1.0,
                             grid=None, stages=ROW_ASYNC_STAGES, ctas=ROW_ASYNC_CTAS) -> Outcome:
    """The rows kernels' split with weights by cp.async on a persistent grid (gp_int4_mma_rows_async
    up to 8 rows, rows16_async up to 16): int4_mma's contract and tolerance. `grid` forces the
    block count (few blocks: many tiles a block); `stages` and `ctas` name a tuning build
    (int4_batched.rows_async_build)."""
    kdef = rows_async_build(stages, ctas)[0 if m <= 8 else 1]
    return _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, lambda *p: kdef.launcher(
        h.device, h.function(kdef), *p, m, n, k, accumulate, grid=grid))


def int4_wgmma_case(h, rng, m, n, k, bias=False, accumulate=False, scale=1.0,
                    tiled=False, kernel=None) -> Outcome:
    """The warpgroup-MMA int4 linear (sm_90 devices only): int4_mma's contract and tolerance;
    `tiled`: gp_int4_wgmma_tiled, its weights in the 16-row tile layout; `kernel`: a tuning
    build of that entry (int4_batched.wgmma_build) in place of the library's."""
    kdef = kernel or (INT4_WGMMA_TILED if tiled else INT4_WGMMA)
    return _int4_linear_outcome(h, rng, m, n, k, bias, accumulate, scale, lambda *p: kdef.launcher(
        h.device, h.function(kdef), *p, m, n, k, accumulate), layout=rows_tiled if tiled else None)


def int4_linear_case(h, rng, m, n, k) -> Outcome:
    """The workspace path end to end: dequant into the booked workspace, then the tiled matmul."""
    packed, scales = _quantized(rng, n, k)
    x = _f32(rng, m, k)
    ws = h.put(np.zeros(INT4_DEQUANT.workspace_bytes(n=n, k=k) // 4, np.float32))
    y = h.put(np.zeros((m, n), np.float32))
    launch_int4_dequant(h.device, h.function(INT4_DEQUANT), ws, h.put(packed), h.put(scales), n, k)
    launch_matmul_nt(h.device, h.function(MATMUL_NT), y, h.put(x), ws, 0, m, n, k)
    want = ref.matmul_nt(x, ref.int4_dequantize(packed, scales, k))   # f32 throughout, exact W
    return Outcome(h.get(y, (m, n)), want, 1e-4, 1e-4)


def int4_dequant_f16_case(h, rng, n, k, row0=0, rows=None, wide=False, words=None,
                          tiled=False) -> Outcome:
    """`wide`: fp16 scales of either sign from subnormal to 8191 (subnormal products, the top
    exponents): the one rounding of the product must match the reference's bit for bit.
    `words`: the build with that many packed words per thread (half.dequant_build), else the
    library's. `tiled`: int4_dequant_f16_tiled over the weight in the 16-row tile layout."""
    kdef = INT4_DEQUANT_F16_TILED if tiled else INT4_DEQUANT_F16 if words is None \
        else dequant_build(words)
    packed, scales = _quantized(rng, n, k)
    if wide:
        bits = rng.integers(0, 0x7000, scales.shape, dtype=np.uint16)   # |8 * scale| < 65504
        scales = (bits | (rng.integers(0, 2, scales.shape, dtype=np.uint16) << 15)).view(np.float16)
    rows = n - row0 if rows is None else rows
    tile = h.put(np.full(kdef.workspace_bytes(rows=rows, k=k) // 2, np.nan, np.float16))
    dpacked, dscales = (tile_packed(packed), tile_scales(scales)) if tiled else (packed, scales)
    kdef.launcher(h.device, h.function(kdef), tile, h.put(dpacked), h.put(dscales), row0, rows, n,
                  k)
    want = ref.int4_dequantize_f16(packed, scales, k)[row0:row0 + rows]
    return Outcome(h.get(tile, (rows, k), np.uint16), want.view(np.uint16))   # bit-exact


def to_f16_case(h, rng, n) -> Outcome:
    x = _f32(rng, n, scale=100.0)
    x[: min(n, 4)] = np.array([7e4, -7e4, 1e-8, 0.33325], np.float32)[: min(n, 4)]  # overflow, subnormal
    out = h.put(np.zeros(n, np.float16))
    launch_to_f16(h.device, h.function(TO_F16), out, h.put(x), n)
    return Outcome(h.get(out, (n,), np.uint16), ref.to_f16(x).view(np.uint16))   # bit-exact


def stored_rows(rng: np.random.Generator, rows: int, in_dim: int, dtype: str,
                hard: bool = False) -> np.ndarray:
    """Rows of a checkpoint's stored values (BF16 as uint16 bits). `hard`: every row from the
    third on holds the quantizer's edge blocks, one kind per row: zeros and signed zeros,
    subnormals (scale 0 or subnormal), magnitudes whose scale overflows fp16, inf, NaN, and
    values exactly halfway between two steps (the rounding's ties)."""
    x = (rng.standard_normal((rows, in_dim)) / np.sqrt(in_dim)).astype(np.float32)
    if hard:
        edges = [
            lambda b: np.where(rng.integers(0, 2, b.shape) == 1, -0.0, 0.0),
            lambda b: b * np.float32(1e-40),                    # f32 subnormal: scale 0
            lambda b: b * np.float32(2e-8),                     # fp16-subnormal scales
            lambda b: b * np.float32(1e6),                      # max / 7 beyond fp16's range
            lambda b: np.where(np.arange(b.size).reshape(b.shape) % 9 == 4, np.inf, b),
            lambda b: np.where(np.arange(b.size).reshape(b.shape) % 11 == 3, -np.inf, b),
            lambda b: np.where(np.arange(b.size).reshape(b.shape) % 13 == 5, np.nan, b),
            # 7 at the top of each block sets scale 1: k + 0.5 are ties (to even)
            lambda b: np.concatenate([np.full((b.shape[0], 1), 7.0),
                                      (rng.integers(-16, 15, (b.shape[0], b.shape[1] - 1)) + 0.5)
                                      .clip(-7.5, 6.5)], axis=1).reshape(b.shape),
        ]
        with np.errstate(all="ignore"):
            for r in range(2, rows):
                blocks = x[r].reshape(-1, ref.QUANT_BLOCK)
                blocks[:] = edges[(r - 2) % len(edges)](blocks)
    if dtype == "BF16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)   # truncation: any bf16 will do
    with np.errstate(over="ignore"):   # F16: the 1e6 row overflows to inf, another edge
        return x.astype(np.float16 if dtype == "F16" else np.float32)


def _canonical(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed bytes then scale bytes, every NaN scale as one NaN (its payload is not part of
    the contract: a block with several NaNs may keep any of theirs)."""
    bits = np.where(np.isnan(scales), np.float16(np.nan), scales).view(np.uint16)
    return np.concatenate([packed.reshape(-1), bits.reshape(-1).view(np.uint8)])


def int4_quantize_case(h, rng, rows, in_dim, dtype, hard=False) -> Outcome:
    """Stored rows -> int4 blocks, bit for bit against the oracle (packed and scales)."""
    raw = stored_rows(rng, rows, in_dim, dtype, hard)
    packed_bytes, scale_bytes = quantized_bytes(rows, in_dim)
    packed = h.put(np.full(packed_bytes, 0xA5, np.uint8))
    scales = h.put(np.full(scale_bytes // 2, np.nan, np.float16))
    launch_int4_quantize(h.device, h.function(INT4_QUANTIZE), packed, scales, h.put(raw), dtype,
                         rows, in_dim)
    got = _canonical(h.get(packed, (packed_bytes,), np.uint8),
                     h.get(scales, (scale_bytes // 2,), np.float16))
    return Outcome(got, _canonical(*ref.int4_quantize_stored(raw, dtype)))   # bit-exact


def tensor_linear_case(h, rng, m, n, k, tile_rows, accumulate=False) -> Outcome:
    """The prefill linear end to end: x -> fp16, W dequantized one tile of rows at a time, each
    tile multiplied by the device's BLAS into its columns of y (row stride n)."""
    packed, scales = _quantized(rng, n, k)
    x = _f32(rng, m, k)
    y0 = _f32(rng, m, n)
    y, x16 = h.put(y0), h.put(np.zeros((m, k), np.float16))
    tile = h.put(np.zeros(tile_rows * k, np.float16))
    pk, sc = h.put(packed), h.put(scales)
    launch_to_f16(h.device, h.function(TO_F16), x16, h.put(x), m * k)
    for r0 in range(0, n, tile_rows):
        rows = min(tile_rows, n - r0)
        launch_int4_dequant_f16(h.device, h.function(INT4_DEQUANT_F16), tile, pk, sc, r0, rows, n, k)
        h.device.blas.gemm_nt(y + 4 * r0, x16, tile, m, rows, k, ldy=n, accumulate=accumulate)
    want = ref.int4_linear_f16(x, packed, scales) + (y0 if accumulate else 0)
    return Outcome(h.get(y, (m, n)), want, 1e-4, 1e-4)


def rotary_case(h, rng, batch, tokens, heads, head_dim, pad=0, offset=0, theta=10000.0) -> Outcome:
    stride = heads * head_dim + pad
    x = _f32(rng, batch * tokens, stride)
    pos = rng.integers(0, 500, batch).astype(np.int32)
    xp = h.put(x)
    launch_rotary(h.device, h.function(ROTARY), xp, h.put(pos), batch, tokens, heads, head_dim,
                  stride, offset, theta)
    want = x.copy()
    for b in range(batch):
        rows = slice(b * tokens, (b + 1) * tokens)
        xb = x[rows, :heads * head_dim].reshape(tokens, heads, head_dim)
        p = pos[b] + offset + np.arange(tokens)
        want[rows, :heads * head_dim] = ref.rotary(xb, p, theta).reshape(tokens, -1)
    return Outcome(h.get(xp, x.shape), want, 1e-4, 2e-5)


def prefill_case(h, rng, batch, tokens, heads, kv_heads, head_dim, causal=True, past=0,
                 past_arg=0, lens=None, kv16=False) -> Outcome:
    """q from a padded buffer; K/V in cache layout (batch, max_len, kv_heads, head_dim) holding
    `past + past_arg` earlier rows, then this prefill's rows; `kv16`: an fp16 cache."""
    p = past + past_arg
    max_len = p + tokens + 3
    q_stride = heads * head_dim + 8
    kv_row = kv_heads * head_dim
    q = _f32(rng, batch * tokens, q_stride)
    kc, vc = _kv(rng, kv16, batch, max_len, kv_heads, head_dim)
    lens_arr = None if lens is None else np.asarray(lens, np.int32)
    out = h.put(np.zeros((batch * tokens, heads * head_dim), np.float32))
    launch_attention_prefill(
        h.device, h.function(ATTENTION_PREFILL_KV16 if kv16 else ATTENTION_PREFILL), out, h.put(q), h.put(kc), h.put(vc),
        h.put(lens_arr) if lens is not None else 0,
        h.put(np.full(batch, past, np.int32)) if past else 0, batch, tokens, heads, kv_heads,
        head_dim, q_stride, kv_row, max_len * kv_row, p - past, causal)
    want = np.zeros((batch * tokens, heads * head_dim), np.float32)
    for b in range(batch):
        qb = q[b * tokens:(b + 1) * tokens, :heads * head_dim].reshape(tokens, heads, head_dim)
        valid = (tokens if lens is None else int(lens[b])) + p
        r = ref.attention(qb, kc[b, :valid].astype(np.float32), vc[b, :valid].astype(np.float32),
                          p + np.arange(tokens), causal)
        want[b * tokens:(b + 1) * tokens] = r.reshape(tokens, -1)
    return Outcome(h.get(out, want.shape), want, 1e-4, 2e-5)


def decode_case(h, rng, batch, heads, kv_heads, head_dim, lengths, len_add=0,
                max_len=None) -> Outcome:
    """f32 q against an fp16 KV cache (attention_decode_kv16)."""
    lengths = np.asarray(lengths, np.int32)
    max_len = int(lengths.max()) + len_add + 2 if max_len is None else max_len
    q = _f32(rng, batch, heads * head_dim)
    kc, vc = _kv(rng, True, batch, max_len, kv_heads, head_dim)
    out = h.put(np.zeros((batch, heads * head_dim), np.float32))
    kv_row = kv_heads * head_dim
    launch_attention_decode(h.device, h.function(ATTENTION_DECODE_KV16), out, h.put(q),
                            h.put(kc), h.put(vc), h.put(lengths), batch, heads, kv_heads,
                            head_dim, heads * head_dim, kv_row, max_len * kv_row, len_add, max_len)
    want = np.zeros((batch, heads * head_dim), np.float32)
    for b in range(batch):
        n = max(0, min(int(lengths[b]) + len_add, max_len))
        r = ref.attention(q[b].reshape(1, heads, head_dim), kc[b, :n].astype(np.float32),
                          vc[b, :n].astype(np.float32), np.array([n - 1]), False)
        want[b] = r.reshape(-1)
    return Outcome(h.get(out, want.shape), want, 1e-4, 2e-5)


def kv_append_case(h, rng, batch, tokens, kv_heads, head_dim, pos, offset=0,
                   max_len=16) -> Outcome:
    """f32 K/V rows into an fp16 cache (kv_append_kv16), bit-exact."""
    width = kv_heads * head_dim
    src_stride = 3 * width  # k and v inside a fused qkv-like row
    src = _f32(rng, batch * tokens, src_stride)
    kc, vc = _kv(rng, True, batch, max_len, width)
    kp, vp, sp = h.put(kc), h.put(vc), h.put(src)
    launch_kv_append(h.device, h.function(KV_APPEND_KV16), kp, vp, sp + 4 * width, sp + 8 * width,
                     h.put(np.asarray(pos, np.int32)), batch, tokens, kv_heads, head_dim,
                     src_stride, width, max_len * width, offset, max_len)
    wk, wv = kc.copy(), vc.copy()
    for b in range(batch):
        rows = src[b * tokens:(b + 1) * tokens]
        start = pos[b] + offset
        wk[b] = ref.kv_append(kc[b], rows[:, width:2 * width].astype(kc.dtype), start)
        wv[b] = ref.kv_append(vc[b], rows[:, 2 * width:].astype(vc.dtype), start)
    got = np.stack([h.get(kp, kc.shape, kc.dtype), h.get(vp, vc.shape, vc.dtype)])
    # bit-exact: rounded to nearest even on the way in
    return Outcome(got.view(np.uint16), np.stack([wk, wv]).view(np.uint16))


def silu_gate_case(h, rng, rows, cols) -> Outcome:
    gu = _f32(rng, rows, 2 * cols, scale=3.0)  # a fused gate|up matmul output
    out = h.put(np.zeros((rows, cols), np.float32))
    p = h.put(gu)
    launch_silu_gate(h.device, h.function(SILU_GATE), out, p, p + 4 * cols, rows, cols,
                     2 * cols, 2 * cols)
    return Outcome(h.get(out, (rows, cols)), ref.silu_gate(gu[:, :cols], gu[:, cols:]), 1e-5, 1e-6)


def silu_gate_f16_case(h, rng, rows, cols) -> Outcome:
    gu = _f32(rng, rows, 2 * cols, scale=3.0)  # a fused gate|up linear's output rows
    out = h.put(np.full((rows, cols), np.nan, np.float16))
    p = h.put(gu)
    launch_silu_gate_f16(h.device, h.function(SILU_GATE_F16), out, p, p + 4 * cols, rows, cols,
                         2 * cols, 2 * cols)
    return Outcome(h.get(out, (rows, cols), np.float16).astype(np.float32),
                   ref.silu_gate_f16(gu[:, :cols], gu[:, cols:]).astype(np.float32), 1e-3, 1e-4)


def gelu_case(h, rng, n, exact=False) -> Outcome:
    x = _f32(rng, n, scale=4.0)
    p = h.put(x)
    launch_gelu(h.device, h.function(GELU), p, p, n, exact=exact)
    return Outcome(h.get(p, (n,)), ref.gelu(x, exact), 1e-5, 1e-6)


def add_case(h, rng, n) -> Outcome:
    a, b = _f32(rng, n), _f32(rng, n)
    out = h.put(np.zeros(n, np.float32))
    launch_add(h.device, h.function(ADD), out, h.put(a), h.put(b), n)
    return Outcome(h.get(out, (n,)), ref.add(a, b), 0, 0)


def bias_add_case(h, rng, rows, cols) -> Outcome:
    x, b = _f32(rng, rows, cols), _f32(rng, cols)
    p = h.put(x)
    launch_bias_add(h.device, h.function(BIAS_ADD), p, p, h.put(b), rows, cols)
    return Outcome(h.get(p, (rows, cols)), ref.bias_add(x, b), 0, 0)


def add_i32_case(h, rng, n, delta) -> Outcome:
    v = rng.integers(-1000, 1000, n).astype(np.int32)
    p = h.put(v)
    launch_add_i32(h.device, h.function(ADD_I32), p, delta, n)
    return Outcome(h.get(p, (n,), np.int32), (v + delta).astype(np.int32))


def argmax_case(h, rng, rows, cols) -> Outcome:
    x = _f32(rng, rows, cols)
    for r in range(rows):  # a tie for the maximum: the lowest index must win
        i, j = sorted(rng.choice(cols, 2, replace=False)) if cols > 1 else (0, 0)
        x[r, i] = x[r, j] = x[r].max() + 1.0
    out = h.put(np.full(rows, -7, np.int32))
    launch_argmax(h.device, h.function(ARGMAX), out, h.put(x), rows, cols)
    return Outcome(h.get(out, (rows,), np.int32), ref.argmax(x))


def mean_pool_case(h, rng, batch, seq, hidden, lens=None) -> Outcome:
    x = _f32(rng, batch, seq, hidden)
    out = h.put(np.full((batch, hidden), np.nan, np.float32))
    lp = 0 if lens is None else h.put(np.asarray(lens, np.int32))
    launch_mean_pool(h.device, h.function(MEAN_POOL), out, h.put(x), lp, batch, seq, hidden)
    want = ref.mean_pool(x, None if lens is None else np.asarray(lens))
    return Outcome(h.get(out, (batch, hidden)), want, 1e-5, 1e-6)


def decode_graph_case(h, rng, steps, start, heads, kv_heads, head_dim,
                      theta=10000.0) -> Outcome:
    """One decode step captured once and replayed `steps` times: rotary at the device position,
    KV append at it, attention over position + 1 keys, position += 1. Every replay must see the
    position the previous one left, i.e. the graph must not bake the KV length."""
    max_len = start + steps + 2
    width, qw = kv_heads * head_dim, heads * head_dim
    kc = np.zeros((max_len, kv_heads, head_dim), np.float16)   # the fp16 cache
    vc = np.zeros_like(kc)
    kc[:start], vc[:start] = _f32(rng, start, kv_heads, head_dim), _f32(rng, start, kv_heads, head_dim)
    kp, vp = h.put(kc), h.put(vc)
    pos = h.put(np.array([start], np.int32))
    qp, knp, vnp = h.put(np.zeros(qw, np.float32)), h.put(np.zeros(width, np.float32)), \
        h.put(np.zeros(width, np.float32))
    out = h.put(np.zeros(qw, np.float32))
    dev, fn = h.device, h.function
    with dev.capture() as cap:
        launch_rotary(dev, fn(ROTARY), qp, pos, 1, 1, heads, head_dim, qw, 0, theta, stream=cap.stream)
        launch_rotary(dev, fn(ROTARY), knp, pos, 1, 1, kv_heads, head_dim, width, 0, theta,
                      stream=cap.stream)
        launch_kv_append(dev, fn(KV_APPEND_KV16), kp, vp, knp, vnp, pos, 1, 1, kv_heads, head_dim, width,
                         width, max_len * width, 0, max_len, stream=cap.stream)
        launch_attention_decode(dev, fn(ATTENTION_DECODE_KV16), out, qp, kp, vp, pos, 1, heads,
                                kv_heads, head_dim, qw, width, max_len * width, 1, max_len,
                                stream=cap.stream)
        launch_add_i32(dev, fn(ADD_I32), pos, 1, 1, stream=cap.stream)
    got, want = [], []
    try:
        for step in range(steps):
            q, kn, vn = _f32(rng, 1, heads, head_dim), _f32(rng, 1, kv_heads, head_dim), \
                _f32(rng, 1, kv_heads, head_dim)
            for p, a in ((qp, q), (knp, kn), (vnp, vn)):
                dev.to_device(p, a)
            dev.replay(cap.graph_exec)
            got.append(h.get(out, (qw,)))
            p = start + step
            at = np.array([p])
            kc[p], vc[p] = ref.rotary(kn, at, theta)[0], vn[0]
            r = ref.attention(ref.rotary(q, at, theta), kc[:p + 1].astype(np.float32),
                              vc[:p + 1].astype(np.float32), at, False)
            want.append(r.reshape(-1))
        got.append(h.get(pos, (1,), np.int32).astype(np.float32))
        want.append(np.array([start + steps], np.float32))
    finally:
        dev.synchronize()
        dev.destroy_graph_exec(cap.graph_exec)
    return Outcome(np.concatenate(got), np.concatenate(want), 1e-4, 2e-5)


def attention_case_sizes(tokens: int, heads: int, kv_heads: int, head_dim: int = 128) -> dict:
    """Shapes for a causal single-sequence prefill case (model-sized GPU tests)."""
    return {"batch": 1, "tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}


def C(kernel: str, fn: Callable[..., Outcome], covers: tuple[str, ...] = (), **shapes) -> Case:
    return Case(kernel, fn, shapes, covers)


# Odd sizes on purpose: K not a multiple of the tile or of the quant block, seq 1 / 7 / 33,
# lengths past one 256-key softmax chunk, head_dim past one thread per dimension.
CASES: list[Case] = [
    C("embedding_gather", embedding_case, rows=1, hidden=7, vocab=5),
    C("embedding_gather", embedding_case, rows=33, hidden=300, vocab=1031, accumulate=True),
    C("rmsnorm", rmsnorm_case, rows=1, hidden=7),
    C("rmsnorm", rmsnorm_case, rows=33, hidden=1000),
    C("rmsnorm_f16", rmsnorm_f16_case, rows=1, hidden=7),
    C("rmsnorm_f16", rmsnorm_f16_case, rows=65, hidden=1000),
    C("rmsnorm", rmsnorm_case, rows=3, hidden=8192),       # two float4 chunks a thread
    C("rmsnorm", rmsnorm_case, rows=2, hidden=5000),       # a ragged second chunk
    C("rmsnorm_f16", rmsnorm_f16_case, rows=3, hidden=8196),
    C("layernorm", layernorm_case, rows=7, hidden=33),
    C("layernorm", layernorm_case, rows=5, hidden=1024, bias=False),
    C("int4_dequant", int4_dequant_case, n=7, k=33),
    C("int4_dequant", int4_dequant_case, n=65, k=256),
    C("matmul_nt", matmul_nt_case, m=1, n=7, k=5),
    C("matmul_nt", matmul_nt_case, m=33, n=65, k=47, bias=True),
    C("matmul_nt", matmul_nt_case, m=130, n=200, k=300, accumulate=True),
    C("matmul_nt_large", matmul_nt_case, m=1, n=7, k=5, large=True),
    C("matmul_nt_large", matmul_nt_case, m=130, n=257, k=301, bias=True, accumulate=True,
      large=True),
    C("int4_matmul", int4_matmul_case, m=1, n=7, k=33),
    C("int4_matmul", int4_matmul_case, m=1, n=257, k=1024, bias=True),
    C("int4_matmul", int4_matmul_case, m=7, n=65, k=1100, accumulate=True),
    C("int4_matmul", int4_matmul_case, m=33, n=9, k=64),
    # several K chunks (2048 per chunk), K % 4 != 0 (scalar x staging), a partial last quant block,
    # a column tail inside a warp, and a 1-row last block after a 4-row one (both kernel bodies)
    C("int4_matmul", int4_matmul_case, m=5, n=70, k=4099, bias=True),
    C("int4_matmul", int4_matmul_case, m=2, n=33, k=2080, accumulate=True),
    # the batched tensor-core linear: every n-tile count (rows 2..64), ragged n, K slices that
    # leave warps idle (k = 128: one group for 8 warps), bias, accumulate, large |x|
    C("int4_mma", int4_mma_case, m=2, n=48, k=128),
    C("int4_mma", int4_mma_case, m=16, n=100, k=1024, bias=True, accumulate=True),
    C("int4_mma", int4_mma_case, m=9, n=17, k=384, scale=300.0),
    C("int4_mma", int4_mma_case, m=32, n=64, k=2048, bias=True),
    C("int4_mma", int4_mma_case, m=64, n=40, k=1152, accumulate=True),
    C("int4_mma", int4_mma_case, m=45, n=16, k=256),
    C("int4_mma_rows", int4_mma_rows_case, m=1, n=48, k=128),
    C("int4_mma_rows", int4_mma_rows_case, m=8, n=100, k=1024, bias=True, accumulate=True),
    C("int4_mma_rows", int4_mma_rows_case, m=3, n=17, k=384, scale=300.0),
    C("int4_mma_rows16", int4_mma_rows_case, m=9, n=40, k=1152, accumulate=True),
    C("int4_mma_rows16", int4_mma_rows_case, m=16, n=100, k=640, bias=True),
    C("int4_mma_rows_tiled", int4_mma_rows_tiled_case, m=1, n=48, k=128),
    C("int4_mma_rows_tiled", int4_mma_rows_tiled_case, m=5, n=37, k=1152, bias=True,
      accumulate=True),
    C("int4_mma_rows16_tiled", int4_mma_rows_tiled_case, m=13, n=100, k=640, scale=300.0),
    C("int4_mma_xk8", int4_mma_xk_case, m=17, n=200, k=1152, bias=True),
    C("int4_mma_xk8", int4_mma_xk_case, m=64, n=72, k=640, wk=8, accumulate=True, split=3),
    C("int4_mma_xk4", int4_mma_xk_case, m=40, n=33, k=512, nt=4, bias=True, accumulate=True),
    C("int4_mma_rows_async", int4_mma_rows_async_case, m=1, n=48, k=128),
    C("int4_mma_rows_async", int4_mma_rows_async_case, m=8, n=100, k=1024, bias=True,
      accumulate=True, grid=2),
    C("int4_mma_rows16_async", int4_mma_rows_async_case, m=13, n=40, k=1152, accumulate=True,
      grid=1),
    C("int4_wgmma", int4_wgmma_case, m=64, n=100, k=256, bias=True, accumulate=True),
    C("int4_wgmma", int4_wgmma_case, m=33, n=70, k=384, scale=300.0),
    C("int4_wgmma_tiled", int4_wgmma_case, m=64, n=96, k=384, bias=True, accumulate=True,
      tiled=True),
    C("int4_wgmma_tiled", int4_wgmma_case, m=7, n=400, k=1152, scale=300.0, tiled=True),
    C("int4_mma_xa", int4_mma_xa_case, m=17, n=48, k=128),
    C("int4_mma_xa", int4_mma_xa_case, m=32, n=100, k=1024, bias=True, accumulate=True),
    C("int4_mma_xa", int4_mma_xa_case, m=40, n=300, k=640, scale=300.0, nt=4),
    C("int4_mma_xa", int4_mma_xa_case, m=64, n=40, k=1152, accumulate=True, split=3),
    C("int4_mma_xa_tiled", int4_mma_xa_tiled_case, m=17, n=48, k=128),
    C("int4_mma_xa_tiled", int4_mma_xa_tiled_case, m=40, n=300, k=640, scale=300.0, nt=4),
    C("int4_mma_xa_tiled", int4_mma_xa_tiled_case, m=64, n=37, k=1152, bias=True,
      accumulate=True, split=3),
    C("int4_linear", int4_linear_case, m=33, n=70, k=96),
    C("int4_dequant_f16", int4_dequant_f16_case, n=7, k=33),
    C("int4_dequant_f16", int4_dequant_f16_case, n=200, k=256, row0=64, rows=128),
    C("int4_dequant_f16", int4_dequant_f16_case, n=97, k=96, row0=5, rows=61, wide=True),
    C("int4_dequant_f16", int4_dequant_f16_case, n=40, k=72, row0=3, rows=30, wide=True),
    C("int4_dequant_f16", int4_dequant_f16_case, n=97, k=96, row0=5, rows=61, wide=True, words=4),
    C("int4_dequant_f16_tiled", int4_dequant_f16_case, n=48, k=384, tiled=True),
    C("int4_dequant_f16_tiled", int4_dequant_f16_case, n=224, k=640, row0=64, rows=128,
      wide=True, tiled=True),
    C("int4_dequant_f16_tiled", int4_dequant_f16_case, n=64, k=128, row0=16, rows=37,
      tiled=True),
    C("int4_quantize", int4_quantize_case, rows=1, in_dim=32, dtype="BF16"),
    C("int4_quantize", int4_quantize_case, rows=21, in_dim=96, dtype="BF16", hard=True),
    C("int4_quantize", int4_quantize_case, rows=21, in_dim=64, dtype="F16", hard=True),
    C("int4_quantize", int4_quantize_case, rows=21, in_dim=160, dtype="F32", hard=True),
    C("to_f16", to_f16_case, n=1),
    C("to_f16", to_f16_case, n=70001),
    C("tensor_linear", tensor_linear_case, ("int4_dequant_f16", "to_f16"), m=33, n=200, k=96,
      tile_rows=64),
    C("tensor_linear", tensor_linear_case, ("int4_dequant_f16", "to_f16"), m=17, n=70, k=256,
      tile_rows=70, accumulate=True),
    C("rotary", rotary_case, batch=1, tokens=1, heads=1, head_dim=2),
    C("rotary", rotary_case, batch=2, tokens=7, heads=3, head_dim=64, pad=16, offset=3),
    C("rotary", rotary_case, batch=1, tokens=33, heads=4, head_dim=128, theta=500000.0),
    C("attention_prefill", prefill_case, batch=1, tokens=1, heads=2, kv_heads=1, head_dim=16),
    C("attention_prefill", prefill_case, batch=1, tokens=33, heads=4, kv_heads=2, head_dim=64),
    C("attention_prefill", prefill_case, batch=1, tokens=7, heads=8, kv_heads=2, head_dim=40,
      past=5, past_arg=2),
    C("attention_prefill", prefill_case, batch=2, tokens=7, heads=3, kv_heads=3, head_dim=32,
      causal=False, lens=[7, 4]),
    C("attention_prefill", prefill_case, batch=1, tokens=300, heads=2, kv_heads=1, head_dim=128),
    C("attention_prefill", prefill_case, batch=1, tokens=9, heads=2, kv_heads=2, head_dim=288),
    C("attention_decode_kv16", decode_case, batch=1, heads=4, kv_heads=2, head_dim=64,
      lengths=[1]),
    C("attention_decode_kv16", decode_case, batch=2, heads=8, kv_heads=2, head_dim=128,
      lengths=[7, 600], len_add=1),
    C("attention_decode_kv16", decode_case, batch=1, heads=2, kv_heads=1, head_dim=48,
      lengths=[40], max_len=33),
    C("attention_decode_kv16", decode_case, batch=1, heads=4, kv_heads=4, head_dim=288,
      lengths=[0], max_len=64),
    C("decode_graph", decode_graph_case, steps=3, start=5, heads=4, kv_heads=2, head_dim=16),
    C("decode_graph", decode_graph_case, steps=2, start=300, heads=2, kv_heads=1, head_dim=128),
    C("kv_append_kv16", kv_append_case, batch=1, tokens=7, kv_heads=2, head_dim=16, pos=[3]),
    C("kv_append_kv16", kv_append_case, batch=2, tokens=5, kv_heads=1, head_dim=8, pos=[0, 13],
      offset=1, max_len=16),
    C("attention_prefill_kv16", prefill_case, batch=1, tokens=7, heads=8, kv_heads=2, head_dim=40,
      past=5, past_arg=2, kv16=True),
    C("attention_prefill_kv16", prefill_case, batch=1, tokens=300, heads=2, kv_heads=1,
      head_dim=128, kv16=True),
    C("attention_prefill_kv16", prefill_case, batch=1, tokens=21, heads=4, kv_heads=2,
      head_dim=16, past=40, kv16=True),
    C("silu_gate", silu_gate_case, rows=7, cols=33),
    C("silu_gate_f16", silu_gate_f16_case, rows=1, cols=7),
    C("silu_gate", silu_gate_case, rows=5, cols=1028),       # 4 columns a thread
    C("silu_gate_f16", silu_gate_f16_case, rows=3, cols=516),
    C("silu_gate_f16", silu_gate_f16_case, rows=65, cols=1001),
    C("gelu", gelu_case, n=1001),
    C("gelu", gelu_case, n=1001, exact=True),
    C("add", add_case, n=1),
    C("add", add_case, n=70001),
    C("bias_add", bias_add_case, rows=7, cols=33),
    C("add_i32", add_i32_case, n=3, delta=1),
    C("argmax", argmax_case, rows=1, cols=1),
    C("argmax", argmax_case, rows=7, cols=1031),
    C("argmax", argmax_case, rows=2, cols=128256),
    C("mean_pool", mean_pool_case, batch=3, seq=7, hidden=33, lens=[7, 1, 0]),
    C("mean_pool", mean_pool_case, batch=2, seq=33, hidden=64),
]


def run_all(device, compiler, seed: int = 0) -> dict[str, str | None]:
    """Every case on `device`: case id -> None (passed) or the failure text."""
    results: dict[str, str | None] = {}
    with KernelHarness(device, compiler) as h:
        for i, case in enumerate(CASES):
            results[case.id] = case.run(h, np.random.default_rng(seed + i)).failure()
    return results
