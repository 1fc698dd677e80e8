"""Linear layers: y = x @ W^T (+ bias) with W int4 block-quantized, two ways.

- Workspace path (prefill, many rows): `int4_dequant` expands W into a float32 workspace of
  N * K * 4 bytes (its `workspace_bytes(n=, k=)`), then `matmul_nt`, a shared-memory tiled matmul
  (64x64 tiles, K step 16, 4x4 outputs per thread), reads it. Dequantization is exact in float32
  (a 4-bit integer times an fp16 scale), so this path equals the reference up to summation order.
  `matmul_nt_large` is the same contract with 128x128 tiles and 8x8 outputs per thread for
  prefill-sized m and n (which of the two wins is for bench/kernels_bench.py [4] to say).
  This workspace is the "dequantization scratch" of DESIGN 1.1: it scales with the weight, so every
  per-node kernel variant that keeps one must have it booked in the `workspace` zone.
- Fused path (decode, few rows): `int4_matmul` reads fp16 x and the packed weight directly and
  streams the weight at bandwidth, to every int4 linear's contract (reference.int4_matmul: fp16 x,
  each weight rounded once to fp16, f32 sums; the same as int4_mma and the prefill's path): each lane loads one whole quant block (16 bytes, 32 weights, one scale) per column as a
  uint4, a warp serves FUSED_WARP_COLS columns (x reused from registers across them), a block of
  FUSED_WARPS warps stages the chunk of x it needs in padded shared memory (bank-conflict free),
  nibbles become exact fp16 integers through the magic 1024 + nib (two per integer op), one
  fp16x2 multiply by the block's scale rounds both weights, f32 accumulation, warp-shuffle sums. A batch-1 decode step reads
  0.56 bytes of HBM per weight. Needs no workspace. It re-reads W once per FUSED_ROWS rows of x,
  so above FUSED_MAX_ROWS rows the tensor-core path is faster: see `int4_path`. The tuning sweep
  behind the constants is bench/int4_gemv_sweep.py (docs/kernels.md).

Layout (gpu_worker.kernels.reference): packed (N, 16 * ceil(K/32)) uint8, scales (N, ceil(K/32))
fp16. `packed` must be 16-byte aligned (each row is a whole number of 16-byte blocks); the fused
kernel loads x 4 halves at a time when K % 4 == 0 and x is 8-byte aligned, else one by one.
Shapes: x (M, K) f32 for matmul_nt, fp16 for int4_matmul; y (M, N) f32, bias (N,) f32 or 0. `accumulate` adds into y (a fused residual).
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import (
    BLOCK,
    KernelDef,
    ceil_div,
    cu_source,
    grid_1d,
    require,
    require_sizes,
)

FUSED_MAX_ROWS = 16   # at or below: int4_matmul; above: the tensor-core path (int4_path)
TILE = 64             # matmul_nt output tile (rows and columns)
LARGE_TILE = 128      # matmul_nt_large output tile
FUSED_WARPS = 8       # int4_matmul: warps per block (GP_I4_WARPS in the source)
FUSED_WARP_COLS = 4   # int4_matmul: output columns per warp (GP_I4_NC)
FUSED_COLS = FUSED_WARPS * FUSED_WARP_COLS   # output columns per block
FUSED_ROWS = 4        # int4_matmul: rows of x per block (GP_I4_ROWS)

SOURCE = cu_source("gp_linear", "linear.cu")


def int4_path(m: int) -> str:
    """Which linear path serves `m` rows in a model graph: "fused" (the packed weight read
    directly: the int4_matmul GEMV for one row, the tensor-core int4_mma for 2..64 rows; ops.py
    picks) or "tensor" (int4_dequant_f16 into a bounded tile, then cuBLAS fp16 GEMM:
    gpu_worker.kernels.half and gpu_worker.device.blas). All of them read fp16 x and compute
    reference.int4_matmul up to f32 summation order, so the choice is speed only. The f32 dequant +
    matmul_nt path stays in the library as the measured baseline (bench/kernels_bench.py,
    docs/kernels.md). FUSED_MAX_ROWS stays the GEMV's own crossover (kernels_bench [3])."""
    from gpu_worker.kernels.int4_batched import MMA_MAX_ROWS

    return "fused" if m <= max(FUSED_MAX_ROWS, MMA_MAX_ROWS) else "tensor"


def launch_int4_dequant(device, function, workspace: int, packed: int, scales: int, n: int, k: int,
                        stream=None) -> None:
    """Expand W (n, k) into `workspace` (n * k float32, see INT4_DEQUANT.workspace_bytes)."""
    require_sizes("int4_dequant", n=n, k=k, elements=n * k)
    if n == 0 or k == 0:
        return
    device.launch(function, grid_1d(device, n * k), BLOCK,
                  [ptr(workspace), ptr(packed), ptr(scales), i32(n), i32(k)], stream=stream)


def launch_matmul_nt(device, function, y: int, x: int, w: int, bias: int, m: int, n: int, k: int,
                     accumulate: bool = False, stream=None) -> None:
    require_sizes("matmul_nt", m=m, n=n, k=k)
    if m == 0 or n == 0:
        return
    require(ceil_div(m, TILE) < 65536, f"matmul_nt: m={m} exceeds {65535 * TILE} rows")
    device.launch(function, (ceil_div(n, TILE), ceil_div(m, TILE), 1), BLOCK,
                  [ptr(y), ptr(x), ptr(w), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream)


def launch_matmul_nt_large(device, function, y: int, x: int, w: int, bias: int, m: int, n: int,
                           k: int, accumulate: bool = False, stream=None) -> None:
    """matmul_nt with 128x128 tiles (prefill-sized m and n); same arguments and result."""
    require_sizes("matmul_nt_large", m=m, n=n, k=k)
    if m == 0 or n == 0:
        return
    require(ceil_div(m, LARGE_TILE) < 65536, f"matmul_nt_large: m={m} exceeds {65535 * LARGE_TILE}")
    device.launch(function, (ceil_div(n, LARGE_TILE), ceil_div(m, LARGE_TILE), 1), BLOCK,
                  [ptr(y), ptr(x), ptr(w), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream)


def launch_int4_matmul(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                       m: int, n: int, k: int, accumulate: bool = False, stream=None) -> None:
    """y (m, n) f32 = x (m, k) fp16 @ f16(dequant(W))^T (+ bias) (reference.int4_matmul)."""
    require_sizes("int4_matmul", m=m, n=n, k=k)
    require(packed % 16 == 0, f"int4_matmul: packed weight 0x{packed:x} must be 16-byte aligned")
    if m == 0 or n == 0:
        return
    require(ceil_div(m, FUSED_ROWS) < 65536, f"int4_matmul: m={m} too large; use the dequant path")
    device.launch(function, (ceil_div(n, FUSED_COLS), ceil_div(m, FUSED_ROWS), 1),
                  (32 * FUSED_WARPS, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream)


def _dequant_workspace(*, n: int, k: int, **_: int) -> int:
    return 4 * n * k


INT4_DEQUANT = KernelDef("int4_dequant", "gp_int4_dequant", SOURCE, reference.int4_dequantize,
                         launch_int4_dequant, workspace=_dequant_workspace)
MATMUL_NT = KernelDef("matmul_nt", "gp_matmul_nt", SOURCE, reference.matmul_nt, launch_matmul_nt)
MATMUL_NT_LARGE = KernelDef("matmul_nt_large", "gp_matmul_nt_large", SOURCE, reference.matmul_nt,
                            launch_matmul_nt_large)
INT4_MATMUL = KernelDef("int4_matmul", "gp_int4_matmul", SOURCE, reference.int4_matmul,
                        launch_int4_matmul)

KERNELS = [INT4_DEQUANT, MATMUL_NT, MATMUL_NT_LARGE, INT4_MATMUL]
