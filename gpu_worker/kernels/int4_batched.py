"""Batched int4 linear on tensor cores for 1..64 rows (a decode batch): y = x @ dequant(W)^T that
reads each weight byte from HBM once per call and x from L2 once per 128-256 weight rows.

Contract: the fused int4_matmul's (linear.py): x (M, K) f32, packed (N, K/2) u8 + scales
(N, K/32) fp16 in the reference layout (unchanged: checkpoints and GPTQ map onto it), y (M, N)
f32, optional bias, `accumulate` adds into y. K a multiple of 128, M <= 64 (launcher refuses
others; ops.py then keeps the GEMV). The result equals reference.int4_matmul up to f32 summation
order, like the GEMV: the weight enters the mma as the exact integers nib - 8 (fp16 1024 + nib
magic, two per LOP3), x as fp16 hi + lo halves (x = hi + lo to ~2^-22; two mmas), and each quant
block's scale multiplies that block's f32 mma sum afterwards (acc += scale * sum), so no value is
rounded to fp16. Deterministic: the summation order depends only on the shapes and the SM count.
Hazard: |x| > 65504 overflows the fp16 halves (as the tensor-core prefill path).

Design (the weight as the mma A operand, x as B, as Marlin, Frantar 2024, without its offline
weight reshuffle): a CTA of 8 warps owns 128 * mt weight rows, each warp 16 * mt of them over
the CTA's whole K slice. x is staged once per CTA per 128-256 k chunk (cp.async, raw f32, split
into hi + lo by the thread that copied it, double-buffered) and read by all 8 warps from shared
memory; the next chunk's weights are in flight in registers while this chunk's mmas run. Where
N / rows leaves SMs idle, K is split across the CTAs of a thread-block cluster (S <= 8, sm_90),
which sum their partials through distributed shared memory in rank order: no atomics, no
workspace, no second kernel. The k order inside a quant block is permuted identically for A and
B: thread t of a quad owns the 32-bit word t of each 16-byte block (8 consecutive k), whose
nibbles i and 4 + i form one fp16x2 A register with one LOP3.
Cost: the weight once from HBM; x (M * K * 4 bytes) once per CTA row block from L2, i.e.
N / (128 * mt) times per call (16 times for N = 4096 at mt = 2: ~1x the weight bytes at 64
rows); y written once. Registers: 216-255 per thread, one CTA per SM; one entry per n-tile count
(int4_batched.cu says why).
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import (
    SIM_SM_COUNT,
    KernelDef,
    ceil_div,
    cu_source,
    require,
    require_sizes,
    sm_count,
)

MMA_MAX_ROWS = 64   # rows of x the kernel takes (8 n-tiles of 8)
MMA_K_ALIGN = 128   # K granule: 4 quant blocks (one 8-byte load of 4 scales)
MMA_WARPS = 8
MAX_CLUSTER = 8     # the portable thread-block cluster size limit


def n_tiles(m: int) -> int:
    """n-tiles of 8 rows of x the kernel stages for m rows (the entry that serves them)."""
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8


CTA_OVERHEAD = 1024   # a CTA's fixed cost (pipeline fill, cluster reduction), in 64-byte row segments
X_COST = 3.2          # x bytes from L2 per weight byte from HBM, relative cost per x row per row


def mma_tiles(m: int, n: int, k: int, sms: int = SIM_SM_COUNT) -> tuple[int, int, int]:
    """(NT n-tiles, mt: 128 * mt weight rows per CTA, S: CTAs of a cluster splitting K) for an
    m x n x k linear on `sms` multiprocessors (the launcher passes the device's own count).

    One CTA per SM, so a grid runs in waves of `sms` CTAs; the tiling picked minimises the
    busiest SM's time in units of one 64-byte weight row segment (128 k): per CTA its weight
    segments, x read from L2 for them (X_COST * m / rows per segment: more rows per CTA, fewer
    re-reads of x) and a fixed CTA_OVERHEAD; ties go to more rows, then fewer splits."""
    nt = n_tiles(m)
    groups = k // MMA_K_ALIGN
    best: tuple[float, int, int, int] | None = None
    for mt in ((2, 1) if nt <= 2 else (1,)):   # the entries with 2 tiles per warp (registers)
        rows = 128 * mt
        blocks = ceil_div(n, rows)
        for s in range(1, min(MAX_CLUSTER, groups) + 1):
            per_cta = rows * ceil_div(groups, s) * (1 + X_COST * m / rows) + CTA_OVERHEAD
            key = (ceil_div(blocks * s, sms) * per_cta, -mt, s, mt)
            if best is None or key < best:
                best = key
    assert best is not None, (m, n, k)
    return nt, best[3], best[2]


def mma_shared_bytes(nt: int, mt: int, s: int) -> int:
    """Dynamic shared memory of one CTA (GpStage in int4_batched.cu): two hi + lo x buffers and
    the raw staging planes; with a split, at least the [m][row] partials."""
    g = 2 if nt <= 2 else 1
    plane = 8 * nt * (16 * g + 4)          # 16-byte slots
    stage = 6 * plane * 16
    partials = 8 * nt * (128 * mt + 4) * 4 if s > 1 else 0
    return max(stage, partials)


SOURCE = cu_source("gp_int4_batched", "int4_batched.cu")


def mma_supported(m: int, k: int) -> bool:
    """Whether gp_int4_mma takes this linear (else the GEMV serves it)."""
    return 2 <= m <= MMA_MAX_ROWS and k % MMA_K_ALIGN == 0 and k > 0


def launch_int4_mma(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                    m: int, n: int, k: int, accumulate: bool = False, stream=None) -> None:
    """y (m, n) f32 = x (m, k) f32 @ dequant(W)^T (+ bias), W streamed once; 1 <= m <= 64.
    `function` is the entry of mma_kernel(m)."""
    kernel = "int4_mma"
    require_sizes(kernel, m=m, n=n, k=k, elements=m * k)
    require(m <= MMA_MAX_ROWS, f"{kernel}: m={m} rows > {MMA_MAX_ROWS}")
    require(k % MMA_K_ALIGN == 0, f"{kernel}: k={k} must be a multiple of {MMA_K_ALIGN}")
    require(packed % 16 == 0 and scales % 8 == 0 and x % 16 == 0,
            f"{kernel}: packed (16), scales (8) and x (16) must be aligned")
    if m == 0 or n == 0:
        return
    nt, mt, s = mma_tiles(m, n, k, sm_count(device))
    device.launch(function, (s, ceil_div(n, 128 * mt), 1), (32 * MMA_WARPS, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0), i32(mt)], stream=stream,
                  shared_bytes=mma_shared_bytes(nt, mt, s), cluster=(s, 1, 1) if s > 1 else None)


INT4_MMA_BY_TILES = {
    nt: KernelDef(f"int4_mma_n{nt}", f"gp_int4_mma_n{nt}", SOURCE, reference.int4_matmul,
                  launch_int4_mma)
    for nt in (1, 2, 4, 8)
}


def mma_kernel(m: int) -> KernelDef:
    """The entry that serves m rows of x."""
    return INT4_MMA_BY_TILES[n_tiles(m)]


KERNELS = list(INT4_MMA_BY_TILES.values())
