"""f32 -> fp16 at the edges of the fp16 kernels: int4 -> fp16 dequantization, f32 -> fp16.

The prefill linear y = x @ W^T runs on tensor cores through cuBLAS (gpu_worker.device.blas): both
operands must be fp16. These kernels produce them:
- `int4_dequant_f16` expands rows [row0, row0 + rows) of the int4 weight into fp16, each row
  k halves, into a bounded dequantization tile (the per-model workspace of execution.ops): a
  thread takes `DEQUANT_WORDS` packed 32-bit words (8 weights of one quant block each) a pass,
  its loads issued before its stores, one 16-byte store of 8 halves per word (a warp's loads and
  stores each contiguous), the integers nib - 8 made exactly in fp16 (magic 1024 + nib, one
  HFMA2) and one HMUL2 by the scale: the exact product rounded once to nearest even, what
  NumPy's astype(float16) of the f32 product does, so the result is bit-exact against
  reference.int4_dequantize_f16 whatever the build. It runs once per prefill chunk over every
  weight, so its bandwidth is a fixed cost of each chunk. `dequant_build(words)` is the kernel
  built for another words-per-thread count (bench/prefill_linear_bench.py times each).
- `to_f16` converts activations f32 -> fp16 (round to nearest even, bit-exact against NumPy);
  it disappears once activations are fp16 end to end. It also casts q for the flash attention
  kernels (gpu_worker.kernels.flash_attention).

Layout as gpu_worker.kernels.linear: packed (N, 16 * ceil(K/32)) u8, scales (N, ceil(K/32)) fp16.
The word path needs K % 8 == 0 (Llama-shaped weights); other K take a scalar path.
"""
from __future__ import annotations

import dataclasses
import functools

from gpu_worker.device.backend import i32, i64, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import (
    BLOCK,
    THREADS,
    KernelDef,
    ceil_div,
    cu_source,
    grid_1d,
    max_grid_1d,
    require,
    require_sizes,
)

# Packed words a thread of int4_dequant_f16 dequantizes per pass (GP_DQ_WORDS): its loads in
# flight. 1 is the build every figure so far was measured on.
DEQUANT_WORDS = 1
DEQUANT_WORDS_CHOICES = (1, 2, 4, 8)


def _source(words: int):
    base = cu_source("gp_half", "half.cu")
    name = base.module_name if words == DEQUANT_WORDS else f"{base.module_name}_w{words}"
    return dataclasses.replace(base, module_name=name,
                               options=(*base.options, f"-DGP_DQ_WORDS={words}"))


SOURCE = _source(DEQUANT_WORDS)


def launch_int4_dequant_f16(device, function, w16: int, packed: int, scales: int, row0: int,
                            rows: int, n: int, k: int, stream=None,
                            words: int = DEQUANT_WORDS) -> None:
    """Rows [row0, row0 + rows) of the (n, k) int4 weight into `w16` (rows * k fp16); `words`:
    the build's words per thread (it sizes the grid; any grid gives the same result)."""
    _launch_dequant("int4_dequant_f16", device, function, w16, packed, scales, row0, rows, n, k,
                    stream, words)


def launch_int4_dequant_f16_tiled(device, function, w16: int, packed: int, scales: int,
                                  row0: int, rows: int, n: int, k: int, stream=None,
                                  words: int = DEQUANT_WORDS) -> None:
    """int4_dequant_f16 of a weight in the 16-row tile layout (int4_batched.rows_tiled): K a
    multiple of 128 and row0 of 16; the same fp16 rows out."""
    require(k % 128 == 0 and row0 % 16 == 0 and n % 16 == 0,
            f"int4_dequant_f16_tiled: n={n}, k={k}, row0={row0}: a tiled weight is whole "
            "16-row tiles of k-groups of 128, read from a tile's first row")
    _launch_dequant("int4_dequant_f16_tiled", device, function, w16, packed, scales, row0, rows,
                    n, k, stream, words)


def _launch_dequant(kernel: str, device, function, w16: int, packed: int, scales: int, row0: int,
                    rows: int, n: int, k: int, stream, words: int) -> None:
    require_sizes(kernel, row0=row0, rows=rows, n=n, k=k, elements=rows * k)
    require(row0 + rows <= n, f"{kernel}: rows [{row0}, {row0 + rows}) outside n={n}")
    require(packed % 16 == 0 and w16 % 16 == 0,
            f"{kernel}: packed weight and tile must be 16-byte aligned")
    require(rows * k // 8 < 2**31,
            f"{kernel}: {rows} rows x {k // 8} packed words must be < 2^31 (split the rows)")
    if rows == 0 or k == 0:
        return
    if k % 8 == 0:
        grid = (max(1, min(ceil_div(rows * k // 8, THREADS * words), max_grid_1d(device))), 1, 1)
    else:
        grid = grid_1d(device, rows * k)
    device.launch(function, grid, BLOCK,
                  [ptr(w16), ptr(packed), ptr(scales), i32(row0), i32(rows), i32(k)],
                  stream=stream)


def launch_to_f16(device, function, out: int, x: int, n: int, stream=None) -> None:
    require(isinstance(n, int) and 0 <= n < 2**62, f"to_f16: n={n!r} must be a non-negative int")
    if n == 0:
        return
    device.launch(function, grid_1d(device, n), BLOCK, [ptr(out), ptr(x), i64(n)],
                  stream=stream)


def _tile_workspace(*, rows: int, k: int, **_: int) -> int:
    return 2 * rows * k


INT4_DEQUANT_F16 = KernelDef("int4_dequant_f16", "gp_int4_dequant_f16", SOURCE,
                             reference.int4_dequantize_f16, launch_int4_dequant_f16,
                             workspace=_tile_workspace)
# the weight in int4_batched.rows_tiled's layout: the oracle on rows_untiled's
INT4_DEQUANT_F16_TILED = KernelDef("int4_dequant_f16_tiled", "gp_int4_dequant_f16_tiled", SOURCE,
                                   reference.int4_dequantize_f16, launch_int4_dequant_f16_tiled,
                                   workspace=_tile_workspace)
TO_F16 = KernelDef("to_f16", "gp_to_f16", SOURCE, reference.to_f16, launch_to_f16)


def dequant_build(words: int) -> KernelDef:
    """INT4_DEQUANT_F16 built and launched with `words` packed words per thread."""
    require(words in DEQUANT_WORDS_CHOICES,
            f"int4_dequant_f16: words={words!r} must be one of {DEQUANT_WORDS_CHOICES}")
    if words == DEQUANT_WORDS:
        return INT4_DEQUANT_F16
    return dataclasses.replace(INT4_DEQUANT_F16, source=_source(words),
                               launcher=functools.partial(launch_int4_dequant_f16, words=words))

KERNELS = [INT4_DEQUANT_F16, INT4_DEQUANT_F16_TILED, TO_F16]
