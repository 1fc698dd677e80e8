"""The int4 linear on tensor cores for 1..64 rows (a decode batch): y = x @ dequant(W)^T that
reads the int4 weight once per call, whatever the row count. Kernels of one contract:
gp_int4_mma (below), gp_int4_mma_rows / rows16 (its split for up to 8 / 16 rows with
registers of their own), gp_int4_mma_xa (x as the mma's A operand, 9..64 rows), gp_int4_wgmma
(warpgroup MMA with x by the TMA unit, sm_90 only, 40..64 rows), each of the last four also as
a `_tiled` entry over the 16-row tile layout (rows_tiled), and, measured and not routed,
gp_int4_mma_rows(16)_async and gp_int4_mma_xk4 / xk8; mma_kernel picks one. CUDA: cu/int4_batched.cu (the weight as A),
cu/int4_xa.cu (x as A), cu/int4_wgmma.cu, sharing cu/int4_mma.cuh.

Contract: every int4 linear's (reference.int4_matmul): x (M, K) fp16, packed (N, K/2) u8 + scales
(N, K/32) fp16 in the reference layout (unchanged: checkpoints and GPTQ map onto it), y (M, N)
f32, optional bias, `accumulate` adds into y. K a multiple of 128, M <= 64 (launcher refuses
others; ops.py then keeps the GEMV). Each weight enters the mma as f16(scale * (nib - 8)): the
integer nib - 8 made exactly (fp16 1024 + nib or 64 + nib magic, two per LOP3, one HSUB2), then one
`mul.rn.f16x2` by the block's scale, the single rounding the reference applies; x enters as
stored; the mma sums in f32. So the result equals the GEMV's and the prefill's dequant tile +
cuBLAS up to f32 summation order, and a stream's tokens do not depend on its batch.

Design (as Marlin, Frantar 2024; its offline weight reshuffle is rows_tiled's 16-row tile
layout, which a model's weights are stored in on the device and the `_tiled` entries read):
the weight is the mma A
operand (16 weight rows x 16 k), x the B operand (16 k x 8 batch rows), so the batch fills the
n = 8 side and M = 64 needs 8 mmas per 16x16 weight tile. The k order inside a quant block is
permuted identically for A and B: thread t of a quad owns the 32-bit word t of each 16-byte
block (8 consecutive k), whose nibbles i and 4 + i form one fp16x2 A register with one LOP3;
its B registers are the same k of x, one 16-byte load of 8 halves put in (k, k + 4) pairs by
four byte permutes. So every weight byte is loaded once,
by one thread, as part of 16-byte row segments. A block is 8 warps over the same 16 * MT weight
rows, each warp a contiguous eighth of K (split-K inside the block, summed through shared memory
in warp order: deterministic, no atomics, no workspace). MT (16-row tiles per warp) is chosen per
NT by the launcher (MT_CHOICES, MT_TOP), one block of 8 warps per SM. Two mmas per 16 x 32
weight tile and 8-row tile of x (one per k16 chunk), accumulating in the mma's own registers.
Cost: the weight once from HBM; x (M * K * 2 bytes) once per block from L2, i.e. N / (16 * MT)
times per call: the price of keeping the whole block on one row range (see docs/kernels.md).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from gpu_worker.device.backend import i32, ptr, tmap
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import (
    NVRTC_OPTIONS,
    SIM_SM_COUNT,
    KernelDef,
    ceil_div,
    cu_source,
    require,
    require_sizes,
    sm_count,
)

MMA_MAX_ROWS = 64   # rows of x the kernel takes (8 n-tiles of 8)
MMA_K_ALIGN = 128   # K granule: a k-group of 4 quant blocks, one per lane of a quad
MMA_WARPS = 8


# 16-row weight tiles per warp the kernel is built for, by NT (8-row tiles of x): the registers
# (acc MT * NT * 4 floats) and the reduction buffer bound MT * NT <= 16.
MT_CHOICES: dict[int, tuple[int, ...]] = {1: (1, 2, 4), 2: (1, 2, 4), 4: (1, 2, 4), 8: (1, 2)}
# The largest MT the launcher picks by default per NT (bench/int4_batched_bench.py --mt-sweep
# measures every choice; docs/kernels.md has the figures): larger tiles re-read x from L2 fewer
# times, so they pay while the grid still keeps SM_FILL of the SMs busy.
MT_TOP: dict[int, int] = {1: 4, 2: 4, 4: 4, 8: 2}
SM_FILL = 0.7   # blocks / SMs at or above which the larger tile wins (H200 sweep, 2026-12-03)


def x_tiles(m: int) -> int:
    """NT: 8-row tiles of x the kernel instantiates for m rows (1, 2, 4 or 8)."""
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8


def mma_tiles(m: int, n: int, sms: int = SIM_SM_COUNT) -> tuple[int, int]:
    """(NT n-tiles of 8 rows of x, MT 16-row weight tiles per warp) for an m x n output on a
    device of `sms` multiprocessors (the launcher passes the device's own count): the largest MT
    up to MT_TOP[NT] whose grid of ceil(n / (16 MT)) blocks still gives SM_FILL of the SMs a block
    (one block of 8 warps per SM). On the H200 at Llama-3-8B shapes this picked the fastest
    swept MT of every shape and batch (QKV's 96 blocks of 64 rows at 2..32 rows included; wo
    and w_down at N = 4096 stay at 32 rows: 64 blocks would idle half the SMs)."""
    nt = x_tiles(m)
    for mt in (4, 2, 1):
        if mt <= MT_TOP[nt] and mt in MT_CHOICES[nt] and ceil_div(n, 16 * mt) >= SM_FILL * sms:
            return nt, mt
    return nt, 1


# Two NVRTC modules of one contract: the weight as the mma's A operand (gp_int4_mma, the rows
# kernels) and x as A (gp_int4_mma_xa, gp_int4_mma_xk), sharing cu/int4_mma.cuh; a tuning build
# of one recompiles only its own.
SOURCE = cu_source("gp_int4_batched", "int4_batched.cu")
SOURCE_XA = cu_source("gp_int4_xa", "int4_xa.cu")


def mma_supported(m: int, k: int) -> bool:
    """Whether the tensor-core kernels take this linear (else the GEMV serves it)."""
    return 1 <= m <= MMA_MAX_ROWS and k % MMA_K_ALIGN == 0 and k > 0


def _require_linear(kernel: str, x: int, packed: int, scales: int, m: int, n: int, k: int) -> None:
    """The arguments both tensor-core kernels take (InvalidArgument otherwise)."""
    require_sizes(kernel, m=m, n=n, k=k, elements=m * k)
    require(m <= MMA_MAX_ROWS, f"{kernel}: m={m} rows > {MMA_MAX_ROWS}")
    require(k % MMA_K_ALIGN == 0, f"{kernel}: k={k} must be a multiple of {MMA_K_ALIGN}")
    require(packed % 16 == 0 and scales % 8 == 0 and x % 16 == 0,
            f"{kernel}: packed (16), scales (8) and x (16) must be aligned")


def launch_int4_mma(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                    m: int, n: int, k: int, accumulate: bool = False, stream=None,
                    mt: int | None = None) -> None:
    """y (m, n) f32 = x (m, k) fp16 @ f16(dequant(W))^T (+ bias), W streamed once; 1 <= m <= 64.
    `mt` forces the 16-row tiles per warp (one of MT_CHOICES[NT]; default: mma_tiles)."""
    kernel = "int4_mma"
    _require_linear(kernel, x, packed, scales, m, n, k)
    if m == 0 or n == 0:
        return
    if mt is None:
        _, mt = mma_tiles(m, n, sm_count(device))
    require(mt in MT_CHOICES[x_tiles(m)],
            f"{kernel}: mt={mt} not built for m={m} rows (choices {MT_CHOICES[x_tiles(m)]})")
    device.launch(function, (ceil_div(n, 16 * mt), 1, 1), (32 * MMA_WARPS, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0), i32(mt)], stream=stream)


INT4_MMA = KernelDef("int4_mma", "gp_int4_mma", SOURCE, reference.int4_matmul, launch_int4_mma)


# gp_int4_mma_rows / rows16 (below): up to 8 / 16 rows, registers bounded per entry.
ROWS_MAX_ROWS = 16     # up to: the rows kernels (gp_int4_mma_rows: 8 rows, rows16: 16)
ROW_DEPTH = 2          # k-groups in flight per warp (GP_ROW_DEPTH in the source)
ROW_CTAS = 4           # blocks per SM the 8-row entry's registers are bounded for (GP_ROW_CTAS)
ROW16_CTAS = 4         # and the 16-row entry's (GP_ROW16_CTAS)
ROW_LONG_K_GROUPS = 64  # from this many k-groups of 128 (K 8192) a rows block runs ROW_LONG_K_WARPS
ROW_LONG_K_WARPS = 16   # warps, each a contiguous 1/16 of K (GP_ROW_MAX_WARPS bounds it)


ROW_WARP_CHOICES = (4, MMA_WARPS, ROW_LONG_K_WARPS)   # a rows block's warps
ROW_FILL = 0.7   # of the warps the SMs hold (ROW_CTAS blocks of 8) a rows grid fills at least


def rows_warps(n: int, sms: int, max_rows: int = 8) -> int:
    """Warps of a rows block (gp_int4_mma_rows(16) and their tiled entries): the fewest of
    ROW_WARP_CHOICES (at least 4 an 8-row x tile) whose ceil(n / 16) blocks hold ROW_FILL of
    the warps the SMs keep resident, else the most. Fewer warps give each a longer K slice
    (gate/up and lm_head: 4), a small N more warps to keep the SMs loading (wo and the down
    projection: 16); measured per shape, int4_batched_bench --tiled (docs/kernels.md). A
    function of N, the device and the entry, never of the row count: a row's bits are the
    same at 1..8 rows."""
    choices = [w for w in ROW_WARP_CHOICES if w >= 4 * ceil_div(max_rows, 8)]
    need = ROW_FILL * sms * ROW_CTAS * MMA_WARPS
    return next((w for w in choices if ceil_div(n, 16) * w >= need), choices[-1])


def row_warps(k: int) -> int:
    """Warps of one block of the async rows builds (gp_int4_mma_rows(16)_async) for K = k:
    ROW_LONG_K_WARPS for a long K (the down projection's 14336: 256 blocks of 8 warps left the
    SMs starved of loads in flight), else 8 (each warp gp_int4_mma's K slice)."""
    return ROW_LONG_K_WARPS if k // MMA_K_ALIGN >= ROW_LONG_K_GROUPS else MMA_WARPS

MAX_SPLIT = 8          # CTAs per cluster splitting K (the portable cluster size)


def mma_kernel(m: int, arch: str = "sm_90") -> str:
    """Which tensor-core kernel serves an m-row linear on a device of `arch` (a key of
    MMA_KERNELS): "rows" (gp_int4_mma_rows) up to 8 rows, "xa" (gp_int4_mma_xa) from XA_MIN_ROWS,
    "wgmma" (gp_int4_wgmma, sm_90 only) from WGMMA_MIN_ROWS. On the H200 (int4_batched_bench
    --rows-sweep, --xa-sweep; docs/kernels.md) the rows kernel beats the GEMV and gp_int4_mma at
    every 8b shape up to 8 rows, and gp_int4_mma_xa on its plan beats every other mma.sync kernel
    from 9 to 64 rows in the decode step's sum (2.67 ms against rows16's 3.65 at 16 rows,
    2026-12-05); on the H100 (--wgmma, 2026-12-07) the wgmma kernel's step is 3.44 ms at 48 rows
    and 3.54 at 64 against xa's 3.91 and 4.79, and 3.52 at 32 against xa's 3.20."""
    if m < XA_MIN_ROWS:
        return "rows"
    return "wgmma" if m >= WGMMA_MIN_ROWS and wgmma_supported(arch) else "xa"


# gp_int4_mma_xa: the same contract with x as the mma's A operand (16 batch rows per mma, by
# ldmatrix) and the weight as B (8 weight rows), so a dequantized weight register serves 16 rows
# of x per mma instead of 8; weights, scales and x through an XA_STAGES-deep cp.async pipeline,
# K split over a cluster where N is small. For 9..64 rows.
XA_MIN_ROWS = 9
XA_NT = (2, 4)    # 8-row weight tiles per warp built (a CTA: 8 warps, 64 NT weight rows)
XA_STAGES = 3     # k-groups in the pipeline (GP_XA_STAGES)
XA_CTAS = 2       # CTAs per SM its registers and shared memory are bounded for (GP_XA_CTAS)


def xa_tile(m: int, nt: int) -> tuple[int, int]:
    """(weight rows, x rows) of one gp_int4_mma_xa CTA: 8 warps of nt 8-row weight tiles, by
    x in 16-row tiles (1 up to 16 rows, 2 up to 32, 3 up to 48, 4 above)."""
    return MMA_WARPS * 8 * nt, 16 * ceil_div(max(m, 1), 16)


def xa_shared_bytes(m: int, nt: int, stages: int = XA_STAGES) -> int:
    """Dynamic shared memory of one gp_int4_mma_xa CTA: `stages` x (weights 64 B + scales 8 B
    per weight row, x 256 B per x row) per k-group (GpXa in the source)."""
    bn, xr = xa_tile(m, nt)
    return stages * (bn * 72 + xr * 256)


XA_FILL = 0.7     # of the CTA slots (XA_CTAS per SM) the plan's grid fills at least


def xa_plan(m: int, n: int, k: int, sms: int = SIM_SM_COUNT) -> tuple[int, int]:
    """(nt, split) of gp_int4_mma_xa: nt 4 (256 weight rows a CTA) up to 32 rows where its grid
    alone fills every CTA slot (lm_head; at 4 x tiles that build spills), else nt 2; K split
    over the fewest CTAs of a cluster (up to MAX_SPLIT, at least 2 k-groups each) whose nt-2
    grid fills XA_FILL of the slots (8b shapes: gate/up unsplit, QKV split 4, wo and w_down 6;
    int4_batched_bench --xa-sweep times every tile and split against it, docs/kernels.md).
    The split depends on N and K only and nt changes no output's summation order, so a row's
    bits do not depend on its batch."""
    slots = XA_CTAS * sms
    nt = 4 if m <= 32 and ceil_div(n, xa_tile(m, 4)[0]) >= slots else 2
    tiles = ceil_div(n, xa_tile(m, 2)[0])
    split = 1
    while tiles * split < XA_FILL * slots and split < min(MAX_SPLIT, k // MMA_K_ALIGN // 2):
        split += 1
    return nt, split


def launch_int4_mma_xa(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                       m: int, n: int, k: int, accumulate: bool = False, stream=None,
                       nt: int | None = None, split: int | None = None,
                       stages: int = XA_STAGES) -> None:
    """int4_mma's contract and arguments on gp_int4_mma_xa, for m <= 64 rows (mma_kernel routes
    it from XA_MIN_ROWS; below that, for the sweep); `nt` and
    `split` force the weight tile and the K split (default: xa_plan); `stages` is the
    GP_XA_STAGES `function` was built with (a tuning build of the benchmark)."""
    _launch_xa("int4_mma_xa", device, function, y, x, packed, scales, bias, m, n, k, accumulate,
               stream, nt, split, stages)


def launch_int4_mma_xa_tiled(device, function, y: int, x: int, packed: int, scales: int,
                             bias: int, m: int, n: int, k: int, accumulate: bool = False,
                             stream=None, nt: int | None = None, split: int | None = None,
                             stages: int = XA_STAGES) -> None:
    """gp_int4_mma_xa over weights in the 16-row tile layout (rows_tiled): its bits."""
    _launch_xa("int4_mma_xa_tiled", device, function, y, x, packed, scales, bias, m, n, k,
               accumulate, stream, nt, split, stages)


def _launch_xa(kernel: str, device, function, y: int, x: int, packed: int, scales: int,
               bias: int, m: int, n: int, k: int, accumulate: bool, stream, nt: int | None,
               split: int | None, stages: int) -> None:
    _require_linear(kernel, x, packed, scales, m, n, k)
    if m == 0 or n == 0:
        return
    plan_nt, plan_split = xa_plan(m, n, k, sm_count(device))
    nt = plan_nt if nt is None else nt
    split = plan_split if split is None else split
    require(nt in XA_NT, f"{kernel}: nt={nt} not built (choices {XA_NT})")
    require(1 <= split <= min(MAX_SPLIT, k // MMA_K_ALIGN),
            f"{kernel}: split={split} must be 1..{min(MAX_SPLIT, k // MMA_K_ALIGN)}")
    tiles = ceil_div(n, xa_tile(m, nt)[0])
    require(tiles < 65536, f"{kernel}: n={n} too large")
    device.launch(function, (split, tiles, 1), (32 * MMA_WARPS, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0), i32(nt)], stream=stream,
                  shared_bytes=xa_shared_bytes(m, nt, stages),
                  cluster=(split, 1, 1) if split > 1 else None, pdl=True)


INT4_MMA_XA = KernelDef("int4_mma_xa", "gp_int4_mma_xa", SOURCE_XA, reference.int4_matmul,
                        launch_int4_mma_xa)
# the weights in rows_tiled's layout, so the oracle is reference.int4_matmul on rows_untiled's
INT4_MMA_XA_TILED = KernelDef("int4_mma_xa_tiled", "gp_int4_mma_xa_tiled", SOURCE_XA,
                              reference.int4_matmul, launch_int4_mma_xa_tiled)


# gp_int4_mma_rows / gp_int4_mma_rows16: the same contract for up to 8 / 16 rows (one or two 8-row
# tiles of x), K over the block's warps (rows_warps: 4, 8 or 16 by N; at 8, bitwise gp_int4_mma's
# result: the same K slice per warp, summed in the same order), each entry with registers
# bounded for its own tile: ROW_CTAS blocks per SM and ROW_DEPTH k-groups of weights in flight
# per warp. The 1-row decode linear at HBM pace, and 2..16 rows at nearly the same cost.


def _rows_warps(kernel: str, max_rows: int, x: int, packed: int, scales: int, m: int, n: int,
                k: int, warps: int, least: int = 4) -> int:
    """The rows kernels' (and their async builds') argument checks; the block's warps."""
    _require_linear(kernel, x, packed, scales, m, n, k)
    require(m <= max_rows, f"{kernel}: m={m} rows > {max_rows}")
    # the block's last step sums 4 outputs a lane of each 8-row x tile, a warp each: 4 warps a tile
    choices = tuple(w for w in ROW_WARP_CHOICES if w >= max(least, 4 * ceil_div(max_rows, 8)))
    require(warps in choices, f"{kernel}: warps={warps} not built (choices {choices})")
    require(ceil_div(n, 16) * 16 * (k // 32) < 2**32 - 1 and m * k // 8 < 2**32 - 1,
            f"{kernel}: n={n} x k={k} too large for its 32-bit offsets; use the GEMV")
    return warps


def _launch_rows(kernel: str, max_rows: int, device, function, y: int, x: int, packed: int,
                 scales: int, bias: int, m: int, n: int, k: int, accumulate: bool,
                 stream, warps: int | None) -> None:
    """Both rows entries: grid ceil(n / 16) blocks of `warps` warps (default rows_warps), 16
    weight rows a block, K over its warps."""
    if warps is None:
        warps = rows_warps(n, sm_count(device), max_rows)
    warps = _rows_warps(kernel, max_rows, x, packed, scales, m, n, k, warps)
    if m == 0 or n == 0:
        return
    device.launch(function, (ceil_div(n, 16), 1, 1), (32 * warps, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream, pdl=True)


def launch_int4_mma_rows(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                         m: int, n: int, k: int, accumulate: bool = False, stream=None,
                         warps: int | None = None) -> None:
    """int4_mma's contract and arguments on gp_int4_mma_rows, for m <= 8 rows; `warps` forces
    the block's warps (4, 8 or 16; default rows_warps)."""
    _launch_rows("int4_mma_rows", 8, device, function, y, x, packed, scales, bias, m, n, k,
                 accumulate, stream, warps)


def launch_int4_mma_rows16(device, function, y: int, x: int, packed: int, scales: int,
                           bias: int, m: int, n: int, k: int, accumulate: bool = False,
                           stream=None, warps: int | None = None) -> None:
    """int4_mma's contract and arguments on gp_int4_mma_rows16, for m <= 16 rows."""
    _launch_rows("int4_mma_rows16", ROWS_MAX_ROWS, device, function, y, x, packed, scales, bias,
                 m, n, k, accumulate, stream, warps)


INT4_MMA_ROWS = KernelDef("int4_mma_rows", "gp_int4_mma_rows", SOURCE, reference.int4_matmul,
                          launch_int4_mma_rows)
INT4_MMA_ROWS16 = KernelDef("int4_mma_rows16", "gp_int4_mma_rows16", SOURCE,
                            reference.int4_matmul, launch_int4_mma_rows16)


# The 16-row tile layout (Marlin's offline reshuffle, for the rows kernels' lanes): quant block
# 4 kg + t of row 16 tile + 8 h + g at index (tile * KG + kg) * 64 + 32 h + 4 g + t, its scale at
# the same index. A tile's k-group is then 1 KiB of weights in one piece, and each 16-byte weight
# load of a warp reads 512 contiguous bytes, where the reference layout gives it 8 rows x 64
# bytes, K / 2 apart. The decode kernels read it faster (docs/kernels.md, "The 16-row tile
# layout"), so a model's int4 weights are stored so on the device wherever tiled_layout holds
# (execution/ops.device_weight, through the no-copy views below).
def tiled_layout(n: int, k: int) -> bool:
    """Whether an (n, k) int4 weight is stored in the 16-row tile layout on the device: whole
    tiles (n % 16 == 0) and whole k-groups (k % 128 == 0)."""
    return n % 16 == 0 and k % MMA_K_ALIGN == 0 and n > 0


_ROW_KGROUP = np.dtype((np.void, 64))   # one row's k-group of packed weights: 4 quant blocks


def packed_tile_view(packed: np.ndarray) -> np.ndarray:
    """An (N, K/2) packed weight (tiled_layout(N, K), C-contiguous) in the 16-row tile order,
    as a view, no copy: (N/16, K/128, 2, 8) elements of 64 bytes, one row's k-group each (its
    4 quant blocks t are adjacent in both layouts). Its bytes in C order are tile_packed's: the
    weight store copies it straight into pinned memory, one pass instead of two."""
    n, half = packed.shape
    require(tiled_layout(n, 2 * half) and packed.dtype == np.uint8 and
            packed.flags.c_contiguous, f"packed_tile_view: {packed.shape} {packed.dtype} is not "
            "a contiguous u8 weight of whole 16-row tiles and k-groups of 128")
    rows = packed.view(_ROW_KGROUP).reshape(n // 16, 2, 8, half // 64)
    return rows.transpose(0, 3, 1, 2)


def scales_tile_view(scales: np.ndarray) -> np.ndarray:
    """An (N, K/32) fp16 scale array (tiled_layout(N, K), C-contiguous) in the 16-row tile
    order, as a view: (N/16, K/128, 2, 8) elements of 8 bytes (one row's 4 scales of a k-group);
    its bytes in C order are tile_scales'."""
    n, kb = scales.shape
    require(tiled_layout(n, 32 * kb) and scales.dtype == np.float16 and
            scales.flags.c_contiguous, f"scales_tile_view: {scales.shape} {scales.dtype} is not "
            "contiguous fp16 scales of whole 16-row tiles and k-groups of 128")
    return scales.view(np.uint64).reshape(n // 16, 2, 8, kb // 4).transpose(0, 3, 1, 2)


def tile_packed(packed: np.ndarray) -> np.ndarray:
    """An (N, K/2) packed weight (tiled_layout(N, K)) in the 16-row tile layout, same shape."""
    n, half = packed.shape
    view = packed_tile_view(np.ascontiguousarray(packed, np.uint8))
    return np.ascontiguousarray(view).view(np.uint8).reshape(n, half)


def tile_scales(scales: np.ndarray) -> np.ndarray:
    """An (N, K/32) fp16 scale array (tiled_layout(N, K)) in the 16-row tile layout."""
    n, kb = scales.shape
    view = scales_tile_view(np.ascontiguousarray(scales, np.float16))
    return np.ascontiguousarray(view).view(np.float16).reshape(n, kb)


def rows_tiled(packed: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed, scales) of the reference layout, (N, K/2) u8 and (N, K/32) fp16, in the 16-row
    tile layout, flat; N is padded to whole tiles with nibble 8 and scale 0 (weight 0)."""
    n, kb = scales.shape
    require(kb % 4 == 0 and packed.shape == (n, kb * 16),
            f"rows_tiled: packed {packed.shape} and scales {scales.shape} are not one int4 "
            "weight with K a multiple of 128")
    n16 = ceil_div(n, 16) * 16
    blocks = np.full((n16, kb * 16), 0x88, np.uint8)
    blocks[:n] = packed
    sc = np.zeros((n16, kb), np.float16)
    sc[:n] = scales
    return tile_packed(blocks).reshape(-1), tile_scales(sc).reshape(-1)


def rows_untiled(packed: np.ndarray, scales: np.ndarray, n: int,
                 k: int) -> tuple[np.ndarray, np.ndarray]:
    """rows_tiled's inverse: the reference layout's (N, K/2) packed and (N, K/32) scales, from
    the tiled bytes in C order (rows_tiled's, tile_packed's / tile_scales' or the views')."""
    n16, kb = ceil_div(n, 16) * 16, k // 32

    def untile(a: np.ndarray, dtype: np.dtype) -> np.ndarray:   # (tile, kg, h, g, t) -> rows
        flat = np.ascontiguousarray(a).reshape(-1).view(dtype)
        return np.ascontiguousarray(flat.reshape(n16 // 16, kb // 4, 2, 8, 4)
                                    .transpose(0, 2, 3, 1, 4)).reshape(n16, kb)
    pk = untile(packed, np.dtype((np.void, 16))).view(np.uint8)
    return pk[:n], untile(scales, np.dtype(np.float16))[:n]


def launch_int4_mma_rows_tiled(device, function, y: int, x: int, packed: int, scales: int,
                               bias: int, m: int, n: int, k: int, accumulate: bool = False,
                               stream=None, warps: int | None = None) -> None:
    """gp_int4_mma_rows over weights in the 16-row tile layout (rows_tiled): its bits."""
    _launch_rows("int4_mma_rows_tiled", 8, device, function, y, x, packed, scales, bias, m, n,
                 k, accumulate, stream, warps)


def launch_int4_mma_rows16_tiled(device, function, y: int, x: int, packed: int, scales: int,
                                 bias: int, m: int, n: int, k: int, accumulate: bool = False,
                                 stream=None, warps: int | None = None) -> None:
    """gp_int4_mma_rows16 over weights in the 16-row tile layout (rows_tiled): its bits."""
    _launch_rows("int4_mma_rows16_tiled", ROWS_MAX_ROWS, device, function, y, x, packed, scales,
                 bias, m, n, k, accumulate, stream, warps)


# the weights rows_tiled's layout, so the oracle is reference.int4_matmul on rows_untiled's
INT4_MMA_ROWS_TILED = KernelDef("int4_mma_rows_tiled", "gp_int4_mma_rows_tiled", SOURCE,
                                reference.int4_matmul, launch_int4_mma_rows_tiled)
INT4_MMA_ROWS16_TILED = KernelDef("int4_mma_rows16_tiled", "gp_int4_mma_rows16_tiled", SOURCE,
                                  reference.int4_matmul, launch_int4_mma_rows16_tiled)

# gp_int4_mma_xk4 / xk8: gp_int4_mma_xa's operands with a block's 8 warps as WN = 8 / wk groups over
# the weight rows by wk over each k-group's k16 steps, so x is read from shared memory WN times
# a stage (xa: 8). Builds (XK_BUILDS, (nt, wk)): 8/4 (128 weight rows a block, one block per
# SM), 8/8 (64), 8/2 (256), 4/4 (64, two blocks per SM), 4/2 (128, two); a group's warps summed
# in a fixed tree, K split over a cluster as xa. Checked against the reference; not routed
# until `int4_batched_bench --xk` times one faster than xa (docs/kernels.md).
XK_BUILDS = ((8, 4), (8, 8), (8, 2), (4, 4), (4, 2))   # (nt, wk)
XK_STAGES = 4      # k-groups in the pipeline (GP_XK_STAGES)
XK_CTAS = {4: 2, 8: 1}   # blocks per SM each entry's registers are bounded for, by nt


def xk_rows(nt: int, wk: int) -> int:
    """Weight rows of one gp_int4_mma_xk block: 8 / wk groups of nt 8-row tiles."""
    return 8 * nt * (MMA_WARPS // wk)


def xk_shared_bytes(m: int, nt: int, wk: int, stages: int = XK_STAGES) -> int:
    """Dynamic shared memory of one gp_int4_mma_xk block: `stages` x (weights 64 B + scales 8 B
    per weight row, x 256 B per x row) per k-group, and at least the final sums' room: the
    block's M x BN sum, then a slot per warp the tree's first round stores."""
    bn, xr = xk_rows(nt, wk), xa_tile(max(m, XA_MIN_ROWS), 2)[1]
    final = xr * (bn + 4) + (MMA_WARPS // 2) * xr * (8 * nt + 4)
    return max(stages * (bn * 72 + xr * 256), 4 * final)


def xk_plan(m: int, n: int, k: int, nt: int, wk: int, sms: int = SIM_SM_COUNT) -> int:
    """The K split of gp_int4_mma_xk's (nt, wk) build: the fewest CTAs of a cluster (up to
    MAX_SPLIT, at least 2 k-groups each) whose grid fills XA_FILL of the blocks the SMs hold at
    once. A function of N, K and the build only: a row's bits do not depend on its batch."""
    slots = XK_CTAS[nt] * sms
    tiles = ceil_div(n, xk_rows(nt, wk))
    split = 1
    while tiles * split < XA_FILL * slots and split < min(MAX_SPLIT, k // MMA_K_ALIGN // 2):
        split += 1
    return split


def _launch_xk(nt: int, device, function, y: int, x: int, packed: int, scales: int, bias: int,
               m: int, n: int, k: int, accumulate: bool, stream, wk: int, split: int | None,
               stages: int) -> None:
    """Both xk entries: grid (split, ceil(n / xk_rows)) in clusters of split."""
    kernel = f"int4_mma_xk{nt}"
    _require_linear(kernel, x, packed, scales, m, n, k)
    require(m >= XA_MIN_ROWS or m == 0, f"{kernel}: m={m} rows < {XA_MIN_ROWS} (the rows kernels serve them)")
    require((nt, wk) in XK_BUILDS, f"{kernel}: wk={wk} not built (builds {XK_BUILDS})")
    require(n * k // 2 < 2**31 and m * k < 2**31,
            f"{kernel}: n={n} x k={k} too large for its 32-bit offsets")
    if m == 0 or n == 0:
        return
    split = xk_plan(m, n, k, nt, wk, sm_count(device)) if split is None else split
    require(1 <= split <= min(MAX_SPLIT, k // MMA_K_ALIGN),
            f"{kernel}: split={split} must be 1..{min(MAX_SPLIT, k // MMA_K_ALIGN)}")
    tiles = ceil_div(n, xk_rows(nt, wk))
    require(tiles < 65536, f"{kernel}: n={n} too large")
    device.launch(function, (split, tiles, 1), (32 * MMA_WARPS, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0), i32(wk)], stream=stream,
                  shared_bytes=xk_shared_bytes(m, nt, wk, stages),
                  cluster=(split, 1, 1) if split > 1 else None, pdl=True)


def launch_int4_mma_xk4(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                        m: int, n: int, k: int, accumulate: bool = False, stream=None,
                        wk: int = 4, split: int | None = None, stages: int = XK_STAGES) -> None:
    """int4_mma's contract and arguments on gp_int4_mma_xk4 (nt 4, two blocks per SM; wk 4: 64
    weight rows a block, wk 2: 128), for 17 <= m <= 64 rows; `split` forces the cluster's K split
    (default xk_plan); `stages` is the GP_XK_STAGES `function` was built with (a tuning build)."""
    _launch_xk(4, device, function, y, x, packed, scales, bias, m, n, k, accumulate, stream,
               wk, split, stages)


def launch_int4_mma_xk8(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                        m: int, n: int, k: int, accumulate: bool = False, stream=None,
                        wk: int = 4, split: int | None = None, stages: int = XK_STAGES) -> None:
    """launch_int4_mma_xk4 on gp_int4_mma_xk8 (nt 8, one block per SM): wk 4 (128 weight rows
    a block), 8 (64) or 2 (256)."""
    _launch_xk(8, device, function, y, x, packed, scales, bias, m, n, k, accumulate, stream,
               wk, split, stages)


INT4_MMA_XK4 = KernelDef("int4_mma_xk4", "gp_int4_mma_xk4", SOURCE_XA, reference.int4_matmul,
                         launch_int4_mma_xk4)
INT4_MMA_XK8 = KernelDef("int4_mma_xk8", "gp_int4_mma_xk8", SOURCE_XA, reference.int4_matmul,
                         launch_int4_mma_xk8)
XK_KERNELS = {4: INT4_MMA_XK4, 8: INT4_MMA_XK8}


def xk_build(stages: int) -> dict[int, KernelDef]:
    """XK_KERNELS (by nt) built with GP_XK_STAGES = `stages` and launched accordingly."""
    require(2 <= stages <= 8, f"int4_mma_xk: stages={stages} must be 2..8")
    if stages == XK_STAGES:
        return XK_KERNELS
    source = dataclasses.replace(SOURCE_XA, module_name=f"{SOURCE_XA.module_name}_xk{stages}",
                                 options=(*SOURCE_XA.options, f"-DGP_XK_STAGES={stages}"))
    return {nt: dataclasses.replace(kdef, source=source, launcher=functools.partial(
        kdef.launcher, stages=stages)) for nt, kdef in XK_KERNELS.items()}


# gp_int4_mma_rows_async / rows16_async: the rows kernels' warps, K slices and warp-order sums
# (so their bits at the same warps), with each warp's weights and scales streamed through a ring
# of ROW_ASYNC_STAGES k-groups in shared memory by cp.async (no registers held for bytes in
# flight), on a persistent grid whose rings run on from one 16-row tile to the next. Checked
# against the rows kernels' bits; not routed until `int4_batched_bench --rows-sweep` says it is
# faster (docs/kernels.md).
ROW_ASYNC_STAGES = 4      # k-groups a warp's ring holds (GP_RA_STAGES)
ROW_ASYNC_CTAS = 4        # blocks of 8 warps per SM its registers are bounded for (GP_RA_CTAS)
ROW_ASYNC_WARP_STAGE = 1152   # one warp's k-group: 1 KiB of weights, 128 bytes of scales
SM_SHARED_BYTES = 228 * 1024  # shared memory per SM on sm_90, 1 KiB of it reserved per block


def rows_async_shared_bytes(m: int, warps: int, stages: int = ROW_ASYNC_STAGES) -> int:
    """Dynamic shared memory of one rows-async block: each warp's ring, then the warps' partials
    of two tiles (double-buffered: one barrier a tile)."""
    nt = 1 if m <= 8 else 2
    return warps * (stages * ROW_ASYNC_WARP_STAGE + 2 * 4 * nt * 32 * 4)


def rows_async_grid(m: int, n: int, warps: int, sms: int, stages: int = ROW_ASYNC_STAGES,
                    ctas: int = ROW_ASYNC_CTAS) -> int:
    """Blocks of the persistent grid: as many as are resident at once (registers bounded for
    `ctas` blocks of 8 warps, threads, shared memory), at most one per 16-row tile. Any count
    gives the same result; this one keeps every block's ring streaming."""
    per_sm = min(ctas * MMA_WARPS // warps, 2048 // (32 * warps),
                 SM_SHARED_BYTES // (rows_async_shared_bytes(m, warps, stages) + 1024))
    return max(1, min(ceil_div(n, 16), per_sm * sms))


def _launch_rows_async(kernel: str, max_rows: int, device, function, y: int, x: int, packed: int,
                       scales: int, bias: int, m: int, n: int, k: int, accumulate: bool, stream,
                       warps: int | None, grid: int | None, stages: int, ctas: int) -> None:
    warps = _rows_warps(kernel, max_rows, x, packed, scales, m, n, k,
                        row_warps(k) if warps is None else warps, least=MMA_WARPS)
    if m == 0 or n == 0:
        return
    blocks = rows_async_grid(m, n, warps, sm_count(device), stages, ctas) if grid is None else grid
    require(1 <= blocks <= ceil_div(n, 16), f"{kernel}: grid={blocks} must be 1..{ceil_div(n, 16)}")
    device.launch(function, (blocks, 1, 1), (32 * warps, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream,
                  shared_bytes=rows_async_shared_bytes(m, warps, stages), pdl=True)


def launch_int4_mma_rows_async(device, function, y: int, x: int, packed: int, scales: int,
                               bias: int, m: int, n: int, k: int, accumulate: bool = False,
                               stream=None, warps: int | None = None, grid: int | None = None,
                               stages: int = ROW_ASYNC_STAGES, ctas: int = ROW_ASYNC_CTAS) -> None:
    """int4_mma's contract and arguments on gp_int4_mma_rows_async, for m <= 8 rows; `warps` as
    the rows kernels', `grid` forces the block count (default rows_async_grid), `stages` and
    `ctas` are the GP_RA_STAGES / GP_RA_CTAS `function` was built with (a tuning build)."""
    _launch_rows_async("int4_mma_rows_async", 8, device, function, y, x, packed, scales, bias,
                       m, n, k, accumulate, stream, warps, grid, stages, ctas)


def launch_int4_mma_rows16_async(device, function, y: int, x: int, packed: int, scales: int,
                                 bias: int, m: int, n: int, k: int, accumulate: bool = False,
                                 stream=None, warps: int | None = None, grid: int | None = None,
                                 stages: int = ROW_ASYNC_STAGES,
                                 ctas: int = ROW_ASYNC_CTAS) -> None:
    """launch_int4_mma_rows_async for m <= 16 rows (gp_int4_mma_rows16_async)."""
    _launch_rows_async("int4_mma_rows16_async", ROWS_MAX_ROWS, device, function, y, x, packed,
                       scales, bias, m, n, k, accumulate, stream, warps, grid, stages, ctas)


INT4_MMA_ROWS_ASYNC = KernelDef("int4_mma_rows_async", "gp_int4_mma_rows_async", SOURCE,
                                reference.int4_matmul, launch_int4_mma_rows_async)
INT4_MMA_ROWS16_ASYNC = KernelDef("int4_mma_rows16_async", "gp_int4_mma_rows16_async", SOURCE,
                                  reference.int4_matmul, launch_int4_mma_rows16_async)
ROW_ASYNC_BUILDS = ((3, 4), (4, 4), (6, 3), (8, 2))   # (stages, ctas) int4_batched_bench sweeps


def rows_async_build(stages: int, ctas: int) -> tuple[KernelDef, KernelDef]:
    """(rows_async, rows16_async) built with GP_RA_STAGES = `stages`, GP_RA_CTAS = `ctas` and
    launched accordingly; the library's build is (ROW_ASYNC_STAGES, ROW_ASYNC_CTAS)."""
    require(2 <= stages <= 8 and 1 <= ctas <= 8,
            f"int4_mma_rows_async: stages={stages} (2..8), ctas={ctas} (1..8)")
    if (stages, ctas) == (ROW_ASYNC_STAGES, ROW_ASYNC_CTAS):
        return INT4_MMA_ROWS_ASYNC, INT4_MMA_ROWS16_ASYNC
    source = dataclasses.replace(
        SOURCE, module_name=f"{SOURCE.module_name}_ra{stages}_{ctas}",
        options=(*SOURCE.options, f"-DGP_RA_STAGES={stages}", f"-DGP_RA_CTAS={ctas}"))
    return tuple(dataclasses.replace(kdef, source=source, launcher=functools.partial(
        kdef.launcher, stages=stages, ctas=ctas))
        for kdef in (INT4_MMA_ROWS_ASYNC, INT4_MMA_ROWS16_ASYNC))

# gp_int4_wgmma (cu/int4_wgmma.cu): the same contract on Hopper's warpgroup MMA, WGMMA_GROUPS
# warpgroups per CTA, each on 64 weight rows over the whole of K, sharing each x tile; a
# WGMMA_STAGES-deep pipeline of x by the TMA unit and the weights by cp.async. Its module is
# built for sm_90a alone (the last --gpu-architecture wins), so it runs only on a device of
# compute capability 9.0 (wgmma_supported, KernelDef.arches).
WGMMA_GROUPS = 2           # warpgroups per CTA (GP_WG_GROUPS)
WGMMA_ROWS = 64 * WGMMA_GROUPS   # weight rows per CTA
WGMMA_STAGES = 4           # k-groups in the pipeline (GP_WG_STAGES)
WGMMA_CTAS = 2             # CTAs per SM at WGMMA_GROUPS (GP_WG_CTAS)
WGMMA_ARCH = "sm_90a"
WGMMA_X_ROWS = 64          # rows of x a TMA box of x carries (the wgmma's N)
# mma_kernel's first row count on gp_int4_wgmma: its time barely moves with the rows (the same
# n64 wgmmas), xa's grows; the step's sums cross between the 32 and 48 rows measured
WGMMA_MIN_ROWS = 40
SOURCE_WGMMA = dataclasses.replace(cu_source("gp_int4_wgmma", "int4_wgmma.cu"),
                                   options=(*NVRTC_OPTIONS, f"--gpu-architecture={WGMMA_ARCH}"))


def wgmma_supported(arch: str) -> bool:
    """Whether gp_int4_wgmma loads on a device of `arch` (its sm_90a image: sm_90 devices only)."""
    return INT4_WGMMA.loads_on(arch)


def wgmma_shared_bytes(stages: int = WGMMA_STAGES, groups: int = WGMMA_GROUPS,
                       x_rows: int = WGMMA_X_ROWS) -> int:
    """Dynamic shared memory of one gp_int4_wgmma CTA: `stages` x (x_rows rows of x's 128 k +
    the CTA's weight rows' 64 bytes and 4 fp16 scales each), 64 bytes for the stages' mbarriers
    (GP_WG_BARS), and 1 KiB to align the stages (the 128-byte swizzle's atoms are 1 KiB)."""
    return stages * (256 * x_rows + 64 * groups * 72) + 64 + 1024


def launch_int4_wgmma(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                      m: int, n: int, k: int, accumulate: bool = False, stream=None,
                      stages: int = WGMMA_STAGES, groups: int = WGMMA_GROUPS,
                      split: int | None = None, x_rows: int = WGMMA_X_ROWS) -> None:
    """int4_mma's contract and arguments on gp_int4_wgmma: ceil(n / (64 groups)) tiles of
    `groups` warpgroups, each 64 weight rows, by `split` CTAs of a cluster over K (default:
    wgmma_plan); 1 <= m <= x_rows. `stages`, `groups`, `x_rows`: the GP_WG_STAGES, GP_WG_GROUPS,
    GP_WG_N `function` was built with (a tuning build of the benchmark; the library's are
    WGMMA_STAGES, WGMMA_GROUPS, WGMMA_X_ROWS)."""
    _launch_wgmma("int4_wgmma", device, function, y, x, packed, scales, bias, m, n, k, accumulate,
                  stream, stages, groups, split, x_rows)


def launch_int4_wgmma_tiled(device, function, y: int, x: int, packed: int, scales: int,
                            bias: int, m: int, n: int, k: int, accumulate: bool = False,
                            stream=None, stages: int = WGMMA_STAGES,
                            groups: int = WGMMA_GROUPS, split: int | None = None,
                            wtma: bool = False, x_rows: int = WGMMA_X_ROWS) -> None:
    """gp_int4_wgmma over weights in the 16-row tile layout (rows_tiled; tiled_layout(n, k)):
    its bits. `wtma`: `function` is the GP_WG_WTMA build (wgmma_build(wtma=True)), which takes
    the weights' and scales' tensor maps too."""
    require(tiled_layout(n, k), f"int4_wgmma_tiled: n={n}, k={k} is not a tiled layout (n a "
            f"multiple of 16, k of 128)")
    maps = []
    if wtma:   # a tile's whole K a row of u64, the CTA's tiles a box (GP_WG_WTMA in the source)
        kg, tiles = k // MMA_K_ALIGN, 64 * groups // 16
        maps = [tmap(device.tensor_map_2d(packed, kg * 128, n // 16, kg * 1024, (128, tiles), 8, 0)),
                tmap(device.tensor_map_2d(scales, kg * 16, n // 16, kg * 128, (16, tiles), 8, 0))]
    _launch_wgmma("int4_wgmma_tiled", device, function, y, x, packed, scales, bias, m, n, k,
                  accumulate, stream, stages, groups, split, x_rows, maps)


def wgmma_plan(n: int, k: int, sms: int = SIM_SM_COUNT, groups: int = WGMMA_GROUPS) -> int:
    """gp_int4_wgmma's K split: the fewest CTAs of a cluster (up to MAX_SPLIT, at least 2
    k-groups each) whose grid fills XA_FILL of the CTA slots (WGMMA_CTAS a SM at 2 warpgroups,
    else 1), as xa_plan's (8b shapes: gate/up and lm_head unsplit, QKV 4, wo and w_down 6). It
    depends on N and K only, so a row's bits do not depend on its batch."""
    slots = (WGMMA_CTAS if groups <= 2 else 1) * sms
    tiles = ceil_div(n, 64 * groups)
    split = 1
    while tiles * split < XA_FILL * slots and split < min(MAX_SPLIT, k // MMA_K_ALIGN // 2):
        split += 1
    return split


def _launch_wgmma(kernel: str, device, function, y: int, x: int, packed: int, scales: int,
                  bias: int, m: int, n: int, k: int, accumulate: bool, stream, stages: int,
                  groups: int, split: int | None, x_rows: int,
                  maps: list | None = None) -> None:
    _require_linear(kernel, x, packed, scales, m, n, k)
    require(x_rows in (32, 64) and m <= x_rows,
            f"{kernel}: m={m} rows > the {x_rows} rows of x its build carries (GP_WG_N)")
    if m == 0 or n == 0:
        return
    split = wgmma_plan(n, k, sm_count(device), groups) if split is None else split
    require(1 <= split <= min(MAX_SPLIT, k // MMA_K_ALIGN),
            f"{kernel}: split={split} must be 1..{min(MAX_SPLIT, k // MMA_K_ALIGN)}")
    tiles = ceil_div(n, 64 * groups)
    require(tiles < 65536, f"{kernel}: n={n} too large")
    # x by the TMA unit (its tensor map a kernel parameter): boxes of 64 k x x_rows rows of the
    # m rows of x; the rows past m read zero
    xmap = device.tensor_map_2d(x, k, m, 2 * k, (64, x_rows))
    device.launch(function, (split, tiles, 1), (128 * groups, 1, 1),
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0), tmap(xmap), *(maps or ())], stream=stream,
                  shared_bytes=wgmma_shared_bytes(stages, groups, x_rows),
                  cluster=(split, 1, 1) if split > 1 else None, pdl=True)


WGMMA_ARCHES = ("sm_90", "sm_90a")   # the devices its sm_90a image loads on
INT4_WGMMA = KernelDef("int4_wgmma", "gp_int4_wgmma", SOURCE_WGMMA, reference.int4_matmul,
                       launch_int4_wgmma, arches=WGMMA_ARCHES)
# the weights in rows_tiled's layout, so the oracle is reference.int4_matmul on rows_untiled's
INT4_WGMMA_TILED = KernelDef("int4_wgmma_tiled", "gp_int4_wgmma_tiled", SOURCE_WGMMA,
                             reference.int4_matmul, launch_int4_wgmma_tiled, arches=WGMMA_ARCHES)


def wgmma_build(stages: int = WGMMA_STAGES, groups: int = WGMMA_GROUPS, *, ahead: bool = False,
                wtma: bool = False, tiled: bool = False, x_rows: int = WGMMA_X_ROWS) -> KernelDef:
    """gp_int4_wgmma (`tiled`: gp_int4_wgmma_tiled) built with `stages` k-group stages
    (GP_WG_STAGES) and `groups` warpgroups a CTA (GP_WG_GROUPS; above 2, one CTA an SM);
    `ahead`: a quant block's weights read from shared memory one block ahead (GP_WG_NEXT);
    `wtma`: the tiled entry's weights and scales by the TMA unit too (GP_WG_WTMA); `x_rows` 32:
    m64n32k16 wgmmas over at most 32 rows of x (GP_WG_N), half the x bytes. The library's
    build is WGMMA_STAGES, WGMMA_GROUPS, neither; int4_batched_bench --wgmma times the others."""
    base = INT4_WGMMA_TILED if tiled else INT4_WGMMA
    require(tiled or not wtma, "wgmma_build: wtma is a build of the tiled entry")
    require(x_rows in (32, 64), f"wgmma_build: x_rows={x_rows}: 32 or 64")
    if (stages, groups, ahead, wtma, x_rows) == (WGMMA_STAGES, WGMMA_GROUPS, False, False,
                                                 WGMMA_X_ROWS):
        return base
    ctas = 2 if groups <= 2 else 1
    tag = (f"_s{stages}_g{groups}" + ("_next" if ahead else "") + ("_wtma" if wtma else "")
           + (f"_n{x_rows}" if x_rows != WGMMA_X_ROWS else ""))
    source = dataclasses.replace(
        base.source, module_name=f"{base.source.module_name}{tag}",
        options=(*base.source.options, f"-DGP_WG_STAGES={stages}", f"-DGP_WG_GROUPS={groups}",
                 f"-DGP_WG_CTAS={ctas}", f"-DGP_WG_NEXT={int(ahead)}", f"-DGP_WG_WTMA={int(wtma)}",
                 f"-DGP_WG_N={x_rows}"))
    launcher = (functools.partial(launch_int4_wgmma_tiled, wtma=wtma) if tiled
                else launch_int4_wgmma)
    return dataclasses.replace(base, source=source, launcher=functools.partial(
        launcher, stages=stages, groups=groups, x_rows=x_rows))

# mma_kernel's names -> the kernel (its KernelDef's launcher takes int4_mma's arguments)
MMA_KERNELS = {"rows": INT4_MMA_ROWS, "xa": INT4_MMA_XA, "wgmma": INT4_WGMMA}
# and over a weight in the 16-row tile layout (tiled_layout)
MMA_KERNELS_TILED = {"rows": INT4_MMA_ROWS_TILED, "xa": INT4_MMA_XA_TILED,
                     "wgmma": INT4_WGMMA_TILED}

KERNELS = [INT4_MMA, INT4_MMA_XA, INT4_MMA_XA_TILED, INT4_MMA_ROWS, INT4_MMA_ROWS16, INT4_MMA_ROWS_TILED,
           INT4_MMA_ROWS16_TILED, INT4_MMA_ROWS_ASYNC,
           INT4_MMA_ROWS16_ASYNC, INT4_MMA_XK4, INT4_MMA_XK8, INT4_WGMMA, INT4_WGMMA_TILED]
