"""The decode step's int4 linears at 1..64 rows (gpu_worker.kernels.int4_batched) against copy
bandwidth measured in the same run, and against PyTorch fp16 `torch.matmul` on the same shapes.

Shapes: Llama-3-8B's linears as the decode graph runs them, QKV and gate/up each one matrix
(6144 and 28672 rows), each timed alone, then summed into one decode step's linears:
32 x (qkv + wo + gate_up + w_down) + lm_head. 1..64 rows are timed on the kernel the decode
graph runs (int4_batched.mma_kernel) over the weight as a model stores it on the device (the
16-row tile layout where int4_batched.tiled_layout holds: execution/ops.device_weight, the
`_tiled` entries); one row also on the int4 GEMV (linear.int4_matmul, reference layout);
16, 32 and 64 rows also on the prefill's path (each weight tile dequantized to fp16, then
cuBLAS: execution/ops.py), for the crossover. The sweeps below run the plain entries over the
reference layout. Each timed graph rotates through enough copies of the weight (bench/limits.rotation,
>= 4 x L2) that it streams from HBM, for ours and for torch alike.
Targets (MISSED: exit 1, issue 24): the step's linears at 64 rows within 2x their 1-row time; at
1 row (the faster kernel per shape) at least 0.7 of a copy of the same bytes: each shape's launch
reads its weight + scale bytes once (8-262 MB), so its limit is a copy moving those bytes,
launched as the kernels are (bench/limits.same_bytes), and the step's limit is the sum over the
shapes of uses x bytes / that copy's rate. The fraction of the 1 GiB D2D copy (read + write
counted: the same bytes-per-second meaning) stays a recorded figure; without torch the target
falls back to it.

Timing, the same on every side: one CUDA graph of `--reps` launches, replayed `--trials` times,
each replay timed by timing events around it; the median replay / reps
(bench/_kernel_bench.median_replay).

    python3 bench/int4_batched_bench.py [--reps 20 --trials 7 --record]   # on the GPU machine
    python3 bench/int4_batched_bench.py --backend sim --small              # smoke run of the code path

`--tiled` times the rows kernels (1 / 8 / 16 rows; the library's warps, and every warp count of
ROW_WARP_CHOICES on the tiled entries) and gp_int4_mma_xa (16 / 32 / 64 rows) over both layouts,
each tiled result first checked against the reference layout's bits: the figures the layout
and int4_batched.rows_warps are set from.
`--rows-sweep` times gp_int4_mma_rows / rows16 built with other pipeline depths and blocks per
SM, with a long K (in one build every K) over 8 or 16 warps (ROWS_BUILDS; each build first
checked against gp_int4_mma's result), gp_int4_mma_rows(16)_async in every ROW_ASYNC_BUILDS build (checked
against the library rows kernels' bits) and gp_int4_mma at 1 / 8 / 16 rows: the figures
int4_batched.ROW_DEPTH, ROW_CTAS, ROW16_CTAS, ROW_LONG_K_WARPS and ROW_ASYNC_* are set from,
and what says whether mma_kernel should route 1..16 rows to the async kernels. `--mt-sweep` also times, per shape and batch of 2..64 rows, every 16-row-tile count per warp the
kernel is built for (int4_batched.MT_CHOICES), and prints the decode step's linears with the
best choice per shape: the figures int4_batched.mma_tiles' rule is set from. `--xa-sweep`
times gp_int4_mma_xa at every built tile and K split (and at xa_plan's) against the default
kernel at 16 / 24 / 32 / 48 / 64 rows (the figures int4_batched.xa_plan's rule is set from, and
at 16 rows whether xa's 1-x-tile build beats rows16), on a
tuning build with `--xa-ctas` / `--xa-stages`, checked against the reference first (a wrong
build stops the run), over the weight in the model's layout (the tiled entry where
tiled_layout holds). `--xk` times gp_int4_mma_xk4 / xk8 (a block's warps over weight rows and
each k-group's k16 steps, so x is read from shared memory fewer times a stage; every build
(nt, wk) of XK_BUILDS, `--xk-stages` for other stage counts) on xk_plan's split
against the default kernel at 24 / 32 / 48 / 64 rows, each checked against it first: what says
whether mma_kernel should route 17..64 rows to one of them. `--wgmma` times gp_int4_wgmma
(`--wgmma-stages`, `--wgmma-groups`, `--wgmma-next`, `--wgmma-wtma` builds; `--wgmma-x-rows 32`
its m64n32k16 build at 16 / 24 / 32 rows) at 32 / 48 / 64 rows over the
weight in the model's layout (the tiled entry where tiled_layout holds) against
gp_int4_mma_xa on the same copies, each checked against it first (what sets
int4_batched.WGMMA_MIN_ROWS). `--wgmma-split-sweep` times the library's gp_int4_wgmma at 48
and 64 rows at every K split (CTAs of a cluster) its launcher takes, each checked against the
plan's result first, against int4_batched.wgmma_plan's split: the figures that rule is set
from. `--xa-ablate` times, at 64 rows, gp_int4_mma_xa beside builds that each remove a part of its loop
(XA_ABLATION_BUILDS: the copies, the dequantize, the shared-memory fragment loads; GP_XA_DROP
of cu/int4_xa.cu): timing only, their outputs are wrong and never checked, so what each build
keeps of xa's time is what the rest of the loop costs.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import limits as bench_limits
from bench._kernel_bench import kernel_bench_parser, median_replay, open_kernel_bench, torch_clock
from bench.attention_bench import ours
from bench.limits import SameBytes, same_bytes
from bench.record import add_record_flag
from gpu_worker.config import DEFAULT_DEQUANT_TILE_BYTES
from gpu_worker.device.sim_backend import SIM_MAX_SHARED_BYTES as MAX_SHARED_BYTES
from gpu_worker.execution.ops import tile_rows
from gpu_worker.kernels.common import sm_count
from gpu_worker.kernels.half import INT4_DEQUANT_F16, INT4_DEQUANT_F16_TILED
from gpu_worker.kernels.int4_batched import (
    INT4_MMA,
    INT4_MMA_ROWS,
    INT4_MMA_ROWS16,
    INT4_MMA_ROWS16_TILED,
    INT4_MMA_ROWS_TILED,
    INT4_MMA_XA,
    INT4_MMA_XA_TILED,
    MAX_SPLIT,
    MMA_K_ALIGN,
    MMA_KERNELS,
    MMA_KERNELS_TILED,
    MT_CHOICES,
    ROW16_CTAS,
    ROW_ASYNC_BUILDS,
    ROW_CTAS,
    ROW_DEPTH,
    ROW_WARP_CHOICES,
    WGMMA_GROUPS,
    WGMMA_STAGES,
    XA_CTAS,
    XA_NT,
    XA_STAGES,
    XK_BUILDS,
    XK_STAGES,
    launch_int4_mma,
    mma_kernel,
    mma_tiles,
    row_warps,
    rows_async_build,
    rows_tiled,
    rows_warps,
    tile_packed,
    tile_scales,
    tiled_layout,
    wgmma_build,
    wgmma_plan,
    x_tiles,
    xa_plan,
    xa_shared_bytes,
    xk_build,
    xk_plan,
)
from gpu_worker.kernels.linear import INT4_MATMUL, launch_int4_matmul
from gpu_worker.kernels.selfcheck import KernelHarness, int4_mma_xa_case

# (name, n, k, uses per decode step)
SHAPES = [("qkv", 6144, 4096, 32), ("wo", 4096, 4096, 32), ("gate_up", 28672, 4096, 32),
          ("w_down", 4096, 14336, 32), ("lm_head", 128256, 4096, 1)]
BATCHES = (1, 2, 8, 16, 32, 64)
# rows also timed on the prefill's path (int4_dequant_f16 into the tile, then cuBLAS fp16): would
# the decode batch be faster there? (information: its fp16 x would change the decode's numerics)
TENSOR_BATCHES = (16, 32, 64)
ONE_ROW_OF_COPY = 0.7
TARGET_64_OVER_1 = 2.0


def torch_matmul(batch: int, n: int, k: int, reps: int, trials: int) -> float | None:
    from bench import peer as bench_peer
    if not bench_peer.available():
        return None
    torch = bench_peer.torch
    copies = bench_limits.rotation(2 * n * k)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(copies)]
    x = torch.randn(batch, k, device="cuda", dtype=torch.float16)

    def run():
        for i in range(reps):
            torch.matmul(x, ws[i % copies].t())
    graph = bench_peer.capture(run, warmup=1).graph
    t = median_replay(graph.replay, torch_clock(), trials, reps)
    del graph
    torch.cuda.empty_cache()
    return t


def _launcher(dev, function, weights: list[tuple[int, int]], x: int, y: int, rows: int, n: int,
              k: int, gemv: bool, mt: int | None = None, split: int | None = None,
              kdef=None, warps: int | None = None, kw: dict | None = None):
    """launch(stream): the linear at `rows` rows, on the next weight copy at every call (the
    GEMV, gp_int4_mma, or `kdef`'s launcher with `kw`)."""
    turn = itertools.count()
    extra = dict(kw or {}, **({} if warps is None else {"warps": warps}))

    def launch(stream) -> None:
        packed, scales = weights[next(turn) % len(weights)]
        if kdef is not None:
            kdef.launcher(dev, function, y, x, packed, scales, 0, rows, n, k, stream=stream,
                          **extra)
        elif gemv:
            launch_int4_matmul(dev, function, y, x, packed, scales, 0, rows, n, k, stream=stream)
        else:
            launch_int4_mma(dev, function, y, x, packed, scales, 0, rows, n, k, stream=stream,
                            mt=mt)
    return launch


def _default(dev, h, weights, x, y, rows: int, n: int, k: int, tiled: bool = False):
    """The linear at `rows` rows on the kernel the decode graph runs (int4_batched.mma_kernel),
    over weights in the reference layout, or (`tiled`) in the 16-row tile layout the model's
    weights are stored in where tiled_layout holds (execution/ops.device_weight)."""
    return _library(dev, h, weights, x, y, rows, n, k, mma_kernel(rows, dev.info.arch), tiled)


def _library(dev, h, weights, x, y, rows: int, n: int, k: int, kernel: str, tiled: bool = False):
    """The linear at `rows` rows on the library's `kernel` (a key of MMA_KERNELS) on its plan."""
    kdef = (MMA_KERNELS_TILED if tiled else MMA_KERNELS)[kernel]
    return _launcher(dev, h.function(kdef), weights, x, y, rows, n, k, False, kdef=kdef)


ROWS_SWEEP_BATCHES = (1, 8, 16)
# depth, ctas, rows16 ctas, warps of a long-K block (K over 8 warps is gp_int4_mma's split), and
# where given, warps of a block below ROW_LONG_K_GROUPS (else 8: gp_int4_mma's split)
ROWS_BUILDS = ((2, 4, 3, 8), (2, 4, 4, 8), (2, 4, 4, 16), (3, 4, 4, 16), (2, 3, 3, 16),
               (2, 4, 4, 16, 16))


def rows_kernels(depth: int, ctas: int, ctas16: int, tiled: bool = False):
    """(gp_int4_mma_rows, gp_int4_mma_rows16), or their `tiled` entries, built with `depth`
    k-groups in flight per warp (GP_ROW_DEPTH) and registers bounded for `ctas` / `ctas16`
    blocks per SM (GP_ROW_CTAS, GP_ROW16_CTAS); the library's build is (ROW_DEPTH, ROW_CTAS,
    ROW16_CTAS)."""
    kdefs = (INT4_MMA_ROWS_TILED, INT4_MMA_ROWS16_TILED) if tiled else (INT4_MMA_ROWS,
                                                                           INT4_MMA_ROWS16)
    if (depth, ctas, ctas16) == (ROW_DEPTH, ROW_CTAS, ROW16_CTAS):
        return kdefs
    source = dataclasses.replace(
        INT4_MMA_ROWS.source,
        module_name=f"{INT4_MMA_ROWS.source.module_name}_rows{depth}_{ctas}_{ctas16}",
        options=(*INT4_MMA_ROWS.source.options, f"-DGP_ROW_DEPTH={depth}",
                 f"-DGP_ROW_CTAS={ctas}", f"-DGP_ROW16_CTAS={ctas16}"))
    return tuple(dataclasses.replace(kdef, source=source) for kdef in kdefs)


def rows_sweep(dev, h, weights, x, y, n: int, k: int, reps: int, trials: int) -> dict:
    """{(rows, build): seconds} of the rows kernels of every ROWS_BUILDS build (build None:
    gp_int4_mma's default tile). Each build's result is checked first: against gp_int4_mma's
    bits where its block splits K as gp_int4_mma does (8 warps), else against them within the
    contract's tolerance; a difference raises WrongBuild."""
    out = {}
    y_ref = h.put(np.zeros((max(ROWS_SWEEP_BATCHES), n), np.float32))
    packed, scales = weights[0]
    for b in ROWS_SWEEP_BATCHES:
        launch_int4_mma(dev, h.function(INT4_MMA), y_ref, x, packed, scales, 0, b, n, k)
        want = h.get(y_ref, (b, n))
        out[b, None] = ours(dev, _launcher(dev, h.function(INT4_MMA), weights, x, y, b, n, k,
                                           False), reps, trials)
        for build in ROWS_BUILDS:
            kdef = rows_kernels(*build[:3])[0 if b <= 8 else 1]
            warps = build[3] if row_warps(k) != 8 else (build[4] if len(build) > 4 else 8)
            kdef.launcher(dev, h.function(kdef), y, x, packed, scales, 0, b, n, k, warps=warps)
            got = h.get(y, (b, n))
            same = (np.array_equal(got, want) if warps == 8
                    else np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max()))
            if not same:
                raise WrongBuild(f"{kdef.source.module_name} m={b} warps={warps}: differs from "
                                 f"gp_int4_mma by {np.abs(got - want).max()}")
            out[b, build] = ours(dev, _launcher(dev, h.function(kdef), weights, x, y, b, n, k,
                                                False, kdef=kdef, warps=warps), reps, trials)
        rows_kdef = INT4_MMA_ROWS if b <= 8 else INT4_MMA_ROWS16   # at the async builds' warps
        rows_kdef.launcher(dev, h.function(rows_kdef), y_ref, x, packed, scales, 0, b, n, k,
                           warps=row_warps(k))
        want = h.get(y_ref, (b, n))
        for stages, ctas in ROW_ASYNC_BUILDS:
            kdef = rows_async_build(stages, ctas)[0 if b <= 8 else 1]
            kdef.launcher(dev, h.function(kdef), y, x, packed, scales, 0, b, n, k)
            got = h.get(y, (b, n))
            if not np.array_equal(got, want):   # the rows kernels' split and sums: their bits
                raise WrongBuild(f"{kdef.name} {kdef.source.module_name} m={b}: differs from "
                                 f"{rows_kdef.name} by {np.abs(got - want).max()}")
            out[b, ("async", stages, ctas)] = ours(dev, _launcher(
                dev, h.function(kdef), weights, x, y, b, n, k, False, kdef=kdef), reps, trials)
    return out


def print_rows_sweep(name: str, n: int, k: int, times: dict) -> None:
    builds = [*ROWS_BUILDS, *(("async", s, c) for s, c in ROW_ASYNC_BUILDS)]
    print(f"  {name} n={n} k={k} rows sweep, us (depth/ctas/ctas16/long-K warps[/short-K warps]; "
          f"async/stages/ctas: gp_int4_mma_rows(16)_async; mma = gp_int4_mma):    mma "
          + " ".join(f"{'/'.join(map(str, b)):>11}" for b in builds))
    for b in ROWS_SWEEP_BATCHES:
        print(f"    b{b:<3d} {times[b, None] * 1e6:7.1f} "
              + " ".join(f"{times[b, build] * 1e6:11.1f}" for build in builds), flush=True)


TILED_BATCHES = (1, 8, 16)
TILED_XA_BATCHES = (16, 32, 64)
# (depth, blocks per SM) builds of the tiled rows entry timed at 1 and 8 rows (library's first)
TILED_BUILDS = ((ROW_DEPTH, ROW_CTAS), (1, 4), (3, 4), (4, 4), (3, 3), (4, 3), (6, 2))


def tiled_times(dev, h, host_weights: list, weights, x, y, n: int, k: int, reps: int,
                trials: int) -> dict:
    """{(rows, layout, warps): seconds} of the rows kernels (rows up to 8 rows, rows16 at 16)
    over the reference layout ("rows") and over int4_batched.rows_tiled's 16-row tiles
    ("tiled"), both at the library's warps (warps "library": rows_warps), the tiled entries also
    at every warp count they take (ROW_WARP_CHOICES); then gp_int4_mma_xa on its plan over both
    ("xa", "xa tiled"). The same weight copies in both layouts. Each tiled result is checked
    first against the row-major entry's bits at the same warps (the same lanes, loads and
    sums); a difference raises WrongBuild."""
    tiled = [tuple(h.put(a) for a in rows_tiled(pk, sc)) for pk, sc in host_weights]
    out = {}
    for b in TILED_BATCHES:
        rows, tiled_k = ((INT4_MMA_ROWS, INT4_MMA_ROWS_TILED) if b <= 8
                         else (INT4_MMA_ROWS16, INT4_MMA_ROWS16_TILED))
        for warps in (None, *(w for w in ROW_WARP_CHOICES if w >= 4 * -(-b // 8))):
            bits = []
            for kdef, copies in ((rows, weights), (tiled_k, tiled)):
                kdef.launcher(dev, h.function(kdef), y, x, *copies[0], 0, b, n, k, warps=warps)
                bits.append(h.get(y, (b, n)))
            if not np.array_equal(*bits):
                raise WrongBuild(f"{tiled_k.name} m={b} warps={warps}: differs from {rows.name} "
                                 f"by {np.abs(bits[1] - bits[0]).max()}")
            out[b, "tiled", warps or "library"] = ours(dev, _launcher(
                dev, h.function(tiled_k), tiled, x, y, b, n, k, False, kdef=tiled_k, warps=warps),
                reps, trials)
        out[b, "rows", "library"] = ours(dev, _launcher(dev, h.function(rows), weights, x, y, b,
                                                        n, k, False, kdef=rows), reps, trials)
    for b in (1, 8):   # the tiled rows entry's builds, each checked against the library's bits
        want = None
        for depth, ctas in TILED_BUILDS:
            kdef = rows_kernels(depth, ctas, ctas, tiled=True)[0]
            kdef.launcher(dev, h.function(kdef), y, x, *tiled[0], 0, b, n, k)
            got = h.get(y, (b, n))
            want = got if want is None else want
            if not np.array_equal(got, want):
                raise WrongBuild(f"{kdef.source.module_name} tiled m={b}: differs from the "
                                 f"library's build by {np.abs(got - want).max()}")
            out[b, "tiled build", f"{depth}/{ctas}"] = ours(dev, _launcher(
                dev, h.function(kdef), tiled, x, y, b, n, k, False, kdef=kdef), reps, trials)
    for b in TILED_XA_BATCHES:   # gp_int4_mma_xa on its plan over both layouts
        bits = []
        for kdef, copies in ((INT4_MMA_XA, weights), (INT4_MMA_XA_TILED, tiled)):
            kdef.launcher(dev, h.function(kdef), y, x, *copies[0], 0, b, n, k)
            bits.append(h.get(y, (b, n)))
        if not np.array_equal(*bits):
            raise WrongBuild(f"int4_mma_xa_tiled m={b}: differs from int4_mma_xa by "
                             f"{np.abs(bits[1] - bits[0]).max()}")
        for kdef, copies, layout in ((INT4_MMA_XA, weights, "xa"),
                                     (INT4_MMA_XA_TILED, tiled, "xa tiled")):
            out[b, layout, "library"] = ours(dev, _launcher(dev, h.function(kdef), copies, x, y, b, n,
                                                       k, False, kdef=kdef), reps, trials)
    return out


WGMMA_BATCHES = (32, 48, 64)
WGMMA_BATCHES_N32 = (16, 24, 32)   # --wgmma-x-rows 32: the rows its m64n32k16 build takes


def wgmma_kernel(stages: int, groups: int = WGMMA_GROUPS, ahead: bool = False,
                 wtma: bool = False, tiled: bool = False, x_rows: int = 64):
    """int4_batched.wgmma_build: the bench's name for it."""
    return wgmma_build(stages, groups, ahead=ahead, wtma=wtma, tiled=tiled, x_rows=x_rows)


def wgmma_build_name(stages: int, groups: int, ahead: bool, wtma: bool, x_rows: int) -> str:
    """The name --wgmma's figures give a build: "wgmma" for the library's, else its options."""
    opts = ([f"{stages} stages"] if stages != WGMMA_STAGES else []) \
        + ([f"{groups} warpgroups"] if groups != WGMMA_GROUPS else []) \
        + (["weights a block ahead"] if ahead else []) + (["weights by TMA"] if wtma else []) \
        + ([f"{x_rows} rows of x"] if x_rows != 64 else [])
    return "wgmma" + (f" ({', '.join(opts)})" if opts else "")


def wgmma_batches(x_rows: int) -> tuple[int, ...]:
    """The row counts --wgmma times a build of `x_rows` rows of x at."""
    return WGMMA_BATCHES if x_rows == 64 else WGMMA_BATCHES_N32


def _default_result(dev, h, weights, x, y_ref, rows: int, n: int, k: int,
                    tiled: bool = False) -> np.ndarray:
    """The default kernel's (mma_kernel's) result at `rows` rows on the first weight copy (in
    the 16-row tile layout where `tiled`)."""
    _default(dev, h, weights[:1], x, y_ref, rows, n, k, tiled)(None)
    return h.get(y_ref, (rows, n))


def _check_near(h, kdef, kw: dict, weights, x, y, rows: int, n: int, k: int,
                want: np.ndarray) -> None:
    """`kdef`'s result (launched with `kw`) within the contract's tolerance of `want` (another
    summation order), else WrongBuild: a build whose result is wrong is never timed."""
    packed, scales = weights[0]
    kdef.launcher(h.device, h.function(kdef), y, x, packed, scales, 0, rows, n, k, **kw)
    got = h.get(y, (rows, n))
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max()):
        raise WrongBuild(f"{kdef.name} {kw} ({kdef.source.module_name}) m={rows} n={n} k={k}: "
                         f"differs from the default kernel by {np.abs(got - want).max()}")


def wgmma_times(dev, h, weights, x, y, n: int, k: int, reps: int, trials: int,
                stages: int = WGMMA_STAGES, groups: int = WGMMA_GROUPS, ahead: bool = False,
                tiled: bool = False, wtma: bool = False, x_rows: int = 64) -> dict:
    """{rows: seconds} of gp_int4_wgmma (built with `stages`, `groups`, `ahead`, `wtma`: the
    weights and scales by the TMA unit, tiled only; its tiled entry over
    `weights` in the 16-row tile layout where `tiled`) at WGMMA_BATCHES rows (`x_rows` 32: its
    m64n32k16 build at WGMMA_BATCHES_N32 rows), each first
    checked against xa's result on the same layout within the contract's tolerance (they
    differ by f32 summation order); a difference raises WrongBuild."""
    kdef = wgmma_kernel(stages, groups, ahead, wtma=wtma and tiled, tiled=tiled, x_rows=x_rows)
    batches = wgmma_batches(x_rows)
    out = {}
    y_ref = h.put(np.zeros((max(batches), n), np.float32))
    for b in batches:
        _library(dev, h, weights[:1], x, y_ref, b, n, k, "xa", tiled)(None)
        _check_near(h, kdef, {}, weights, x, y, b, n, k, h.get(y_ref, (b, n)))
        out[b] = ours(dev, _launcher(dev, h.function(kdef), weights, x, y, b, n, k, False,
                                     kdef=kdef), reps, trials)
    return out


WGMMA_SPLIT_BATCHES = (48, 64)   # --wgmma-split-sweep: rows it times every split at


def wgmma_split_times(dev, h, weights, x, y, n: int, k: int, reps: int, trials: int,
                      tiled: bool) -> dict:
    """{(rows, split): seconds} of the library's gp_int4_wgmma (its tiled entry where `tiled`)
    at WGMMA_SPLIT_BATCHES rows and every K split 1..min(MAX_SPLIT, k-groups), each checked
    first against wgmma_plan's split (another summation order: the contract's tolerance); a
    difference raises WrongBuild."""
    kdef = (MMA_KERNELS_TILED if tiled else MMA_KERNELS)["wgmma"]
    plan = wgmma_plan(n, k, sm_count(dev))
    out = {}
    for b in WGMMA_SPLIT_BATCHES:
        y_ref = h.put(np.zeros((b, n), np.float32))
        packed, scales = weights[0]
        kdef.launcher(dev, h.function(kdef), y_ref, x, packed, scales, 0, b, n, k, split=plan)
        want = h.get(y_ref, (b, n))
        for split in range(1, min(MAX_SPLIT, k // MMA_K_ALIGN) + 1):
            _check_near(h, kdef, {"split": split}, weights, x, y, b, n, k, want)
            out[b, split] = ours(dev, _launcher(dev, h.function(kdef), weights, x, y, b, n, k,
                                                False, kdef=kdef, kw={"split": split}),
                                 reps, trials)
    return out


XK_BATCHES = (24, 32, 48, 64)


def xk_times(dev, h, weights, x, y, n: int, k: int, reps: int, trials: int,
             stages: int = XK_STAGES) -> dict:
    """{(rows, (nt, wk)): seconds} of every gp_int4_mma_xk build (XK_BUILDS, built with
    `stages`) on xk_plan's split at XK_BATCHES rows, each first checked against the default
    kernel's result within the contract's tolerance (they differ by f32 summation order); a
    difference raises WrongBuild."""
    kdefs = xk_build(stages)
    out = {}
    y_ref = h.put(np.zeros((max(XK_BATCHES), n), np.float32))
    for b in XK_BATCHES:
        want = _default_result(dev, h, weights, x, y_ref, b, n, k)
        for nt, wk in XK_BUILDS:
            kdef = kdefs[nt]
            _check_near(h, kdef, {"wk": wk}, weights, x, y, b, n, k, want)
            out[b, (nt, wk)] = ours(dev, _launcher(dev, h.function(kdef), weights, x, y, b, n, k,
                                                   False, kdef=kdef, kw={"wk": wk}), reps, trials)
    return out


class WrongBuild(RuntimeError):
    """A tuning build's result differs from the reference: its times mean nothing."""


XA_SWEEP_BATCHES = (16, 24, 32, 48, 64)   # 16: the 1-x-tile build against the rows16 kernel
XA_SPLITS = (1, 2, 3, 4, 6, 8)


def xa_kernel(ctas: int, stages: int, tiled: bool = False):
    """gp_int4_mma_xa (or its `tiled` entry) with registers bounded for `ctas` CTAs per SM
    (GP_XA_CTAS) and a `stages`-deep pipeline (GP_XA_STAGES); the library's build is XA_CTAS,
    XA_STAGES."""
    kdef = INT4_MMA_XA_TILED if tiled else INT4_MMA_XA
    if (ctas, stages) == (XA_CTAS, XA_STAGES):
        return kdef
    source = dataclasses.replace(
        INT4_MMA_XA.source, module_name=f"{INT4_MMA_XA.source.module_name}_xa{ctas}_{stages}",
        options=(*INT4_MMA_XA.source.options, f"-DGP_XA_CTAS={ctas}", f"-DGP_XA_STAGES={stages}"))
    return dataclasses.replace(kdef, source=source)


# GP_XA_DROP's bits (cu/int4_xa.cu): the part of xa's loop each removes
XA_DROP = {"weight copies": 1, "x copies": 2, "dequantize": 4, "dequantize's PRMT": 8,
           "x loads": 16, "weight loads": 32}
XA_ABLATION_BUILDS = (   # (name, the parts removed)
    ("no weight copies", ("weight copies",)),
    ("no x copies", ("x copies",)),
    ("no copies", ("weight copies", "x copies")),
    ("no dequantize", ("dequantize",)),
    ("dequantize without its PRMT", ("dequantize's PRMT",)),
    ("no copies, no dequantize", ("weight copies", "x copies", "dequantize")),
    ("no copies, no dequantize, no x loads", ("weight copies", "x copies", "dequantize", "x loads")),
    ("mma only", tuple(XA_DROP)),
)
ABLATE_ROWS = 64


def xa_ablation(parts: tuple[str, ...], tiled: bool = False):
    """gp_int4_mma_xa (or its `tiled` entry) built without `parts` (keys of XA_DROP): a timing
    build whose outputs are wrong."""
    drop = sum(XA_DROP[p] for p in parts)
    kdef = INT4_MMA_XA_TILED if tiled else INT4_MMA_XA
    source = dataclasses.replace(
        INT4_MMA_XA.source, module_name=f"{INT4_MMA_XA.source.module_name}_drop{drop}",
        options=(*INT4_MMA_XA.source.options, f"-DGP_XA_DROP={drop}"))
    return dataclasses.replace(kdef, source=source)


def xa_ablation_times(dev, h, weights, x, y, n: int, k: int, reps: int, trials: int,
                      tiled: bool = False) -> dict[str, float]:
    """{build: seconds} at ABLATE_ROWS rows: "xa" on its plan, then every XA_ABLATION_BUILDS
    build on the same plan (never checked: their outputs are wrong)."""
    out = {"xa": ours(dev, _library(dev, h, weights, x, y, ABLATE_ROWS, n, k, "xa", tiled),
                      reps, trials)}
    for name, parts in XA_ABLATION_BUILDS:
        kdef = xa_ablation(parts, tiled)
        out[name] = ours(dev, _launcher(dev, h.function(kdef), weights, x, y, ABLATE_ROWS, n, k,
                                        False, kdef=kdef), reps, trials)
    return out


def xa_sweep(dev, h, weights, x, y, n: int, k: int, reps: int, trials: int, ctas: int = XA_CTAS,
             stages: int = XA_STAGES, tiled: bool = False) -> dict:
    """{(rows, nt, split): seconds} of gp_int4_mma_xa (a tuning build first checked against the
    reference: a wrong build raises WrongBuild) over every built tile and the splits XA_SPLITS
    the K range allows, with (rows, 0, 0) the default kernel (int4_batched.mma_kernel) and
    (rows, -1, -1) xa's own plan; `tiled`: the entries over `weights` in the 16-row tile
    layout (the model's, where tiled_layout holds)."""
    kdef = xa_kernel(ctas, stages, tiled)
    if kdef.source is not INT4_MMA_XA.source:
        for m in (24, 63):
            for nt in XA_NT:
                for split in (1, 3):
                    failure = int4_mma_xa_case(h, np.random.default_rng(m + nt + split), m,
                                               1000 + m, 4224, nt=nt, split=split, kernel=kdef,
                                               stages=stages).failure()
                    if failure is not None:
                        raise WrongBuild(f"{kdef.source.module_name} m={m} nt={nt} "
                                         f"split={split}: {failure}")
    out = {}
    for b in XA_SWEEP_BATCHES:
        out[b, 0, 0] = ours(dev, _default(dev, h, weights, x, y, b, n, k, tiled), reps, trials)
        out[b, -1, -1] = ours(dev, _launcher(dev, h.function(kdef), weights, x, y, b, n, k, False,
                                             kdef=kdef, kw={"stages": stages}), reps, trials)
        for nt in XA_NT:
            if xa_shared_bytes(b, nt, stages) > MAX_SHARED_BYTES:
                continue
            for split in XA_SPLITS:
                if split <= min(MAX_SPLIT, k // MMA_K_ALIGN):
                    out[b, nt, split] = ours(dev, _launcher(
                        dev, h.function(kdef), weights, x, y, b, n, k, False, kdef=kdef,
                        kw={"nt": nt, "split": split, "stages": stages}), reps, trials)
    return out


def print_xa_sweep(name: str, n: int, k: int, times: dict, sms: int) -> None:
    cols = sorted({(nt, s) for _, nt, s in times if nt > 0})
    print(f"  {name} n={n} k={k} xa sweep, us (nt/split; default = mma_kernel's, plan = "
          f"xa_plan's):  default    plan " + " ".join(f"{f'{nt}/{s}':>7}" for nt, s in cols))
    for b in XA_SWEEP_BATCHES:
        best = min((t, nt, s) for (bb, nt, s), t in times.items() if bb == b and nt > 0)
        print(f"    b{b:<3d} {times[b, 0, 0] * 1e6:7.1f} {times[b, -1, -1] * 1e6:7.1f} "
              + " ".join(f"{times[b, nt, s] * 1e6:7.1f}" if (b, nt, s) in times else f"{'-':>7}"
                         for nt, s in cols)
              + f"   best {best[1]}/{best[2]}, plan {'/'.join(map(str, xa_plan(b, n, k, sms)))}",
              flush=True)


def tensor_launcher(dev, function, weights: list[tuple[int, int]], x16: int, y: int, tile: int,
                    tile_bytes: int, rows: int, n: int, k: int, dequant=INT4_DEQUANT_F16,
                    gemm: bool = True):
    """launch(stream): the prefill path at `rows` rows (execution/ops.py's tensor-core linear):
    each tile of weight rows dequantized to fp16 (`dequant`'s build, `function` its entry), then
    one cuBLAS GEMM into its columns of y (without `gemm`: the dequantization alone)."""
    turn = itertools.count()
    per_tile = tile_rows(n, k, tile_bytes)

    def launch(stream) -> None:
        packed, scales = weights[next(turn) % len(weights)]
        for r0 in range(0, n, per_tile):
            part = min(per_tile, n - r0)
            dequant.launcher(dev, function, tile, packed, scales, r0, part, n, k, stream=stream)
            if gemm:
                dev.blas.gemm_nt(y + 4 * r0, x16, tile, rows, part, k, ldy=n, stream=stream)
    return launch


def sweep(dev, h, weights, x, y, n: int, k: int, reps: int, trials: int) -> dict:
    """{(rows, mt): seconds} over every built MT choice, rows 2..64."""
    return {(b, mt): ours(dev, _launcher(dev, h.function(INT4_MMA), weights, x, y, b, n, k,
                                         False, mt), reps, trials)
            for b in BATCHES[1:] for mt in MT_CHOICES[x_tiles(b)]}


def print_sweep(name: str, n: int, k: int, times: dict, sms: int) -> None:
    mts = sorted({mt for _, mt in times})
    print(f"  {name} n={n} sweep, us (mt = 16-row tiles per warp): "
          + "  ".join(f"{'mt' + str(mt):>9}" for mt in mts))
    for b in BATCHES[1:]:
        row = [f"{times[b, mt] * 1e6:9.1f}" if (b, mt) in times else f"{'-':>9}" for mt in mts]
        best = min((t, mt) for (bb, mt), t in times.items() if bb == b)
        print(f"    b{b:<3d}" + " ".join(row) + f"   best mt{best[1]}, default "
              f"mt{mma_tiles(b, n, sms)[1]}", flush=True)


def main() -> int:
    ap = kernel_bench_parser(__doc__)
    add_record_flag(ap)
    ap.add_argument("--mt-sweep", action="store_true",
                    help="time every built MT choice (16-row tiles per warp)")
    ap.add_argument("--rows-sweep", action="store_true",
                    help="time gp_int4_mma_rows / rows16 built with other pipeline depths and "
                         "blocks per SM, and gp_int4_mma, at 1 / 8 / 16 rows")
    ap.add_argument("--tiled", action="store_true",
                    help="time the rows kernels over the 16-row tile weight layout against the "
                         "reference layout at 1 / 8 / 16 rows")
    ap.add_argument("--wgmma", action="store_true",
                    help="time gp_int4_wgmma (warpgroup MMA) against the default kernel at "
                         "32 / 48 / 64 rows")
    ap.add_argument("--wgmma-stages", type=int, default=WGMMA_STAGES,
                    help="--wgmma on the kernel built with this many k-group stages")
    ap.add_argument("--wgmma-groups", type=int, default=WGMMA_GROUPS, choices=(1, 2, 3, 4),
                    help="--wgmma on the kernel built with this many warpgroups a CTA")
    ap.add_argument("--wgmma-next", action="store_true",
                    help="--wgmma on the kernel that reads a quant block's weights one block ahead")
    ap.add_argument("--wgmma-wtma", action="store_true",
                    help="--wgmma on the kernel whose weights and scales come by the TMA unit too "
                         "(the tiled entry; the reference layout's shapes keep cp.async)")
    ap.add_argument("--wgmma-x-rows", type=int, default=64, choices=(32, 64),
                    help="--wgmma on the kernel built for this many rows of x (32: m64n32k16, "
                         f"timed at {WGMMA_BATCHES_N32} rows)")
    ap.add_argument("--wgmma-split-sweep", action="store_true",
                    help="time the library's gp_int4_wgmma at 48 / 64 rows at every K split "
                         "against wgmma_plan's")
    ap.add_argument("--xk", action="store_true",
                    help="time gp_int4_mma_xk4 / xk8 (K over a block's warps) against the default "
                         "kernel at 24 / 32 / 48 / 64 rows")
    ap.add_argument("--xk-stages", type=int, default=XK_STAGES,
                    help="--xk on the kernels built with this many pipeline stages")
    ap.add_argument("--xa-sweep", action="store_true",
                    help="time gp_int4_mma_xa at every built tile and split of K against the "
                         "default kernel at 24 / 32 / 48 / 64 rows")
    ap.add_argument("--xa-ablate", action="store_true",
                    help="time gp_int4_mma_xa at 64 rows beside builds without parts of its loop "
                         "(timing only)")
    ap.add_argument("--xa-ctas", type=int, default=XA_CTAS, choices=(1, 2, 3),
                    help="--xa-sweep on the kernel built for this many CTAs per SM")
    ap.add_argument("--xa-stages", type=int, default=XA_STAGES,
                    help="--xa-sweep on the kernel built with this many pipeline stages")
    args = ap.parse_args()
    div = 64 if args.small else 1
    limits, dev, compiler, targets = open_kernel_bench(args, "int4_batched_bench")
    rng = np.random.default_rng(0)
    step = {b: 0.0 for b in BATCHES}
    step_gemv1 = step_bytes = 0.0
    launches: list[tuple[int, int]] = []      # (bytes one launch reads, uses a step) per shape
    step_torch = {b: 0.0 for b in BATCHES}
    step_best = {b: 0.0 for b in BATCHES[1:]}
    step_tensor = {b: 0.0 for b in TENSOR_BATCHES}
    step_rows = {}
    step_tiled = {}
    step_xa = {(b, key): 0.0 for b in XA_SWEEP_BATCHES for key in ("plan", "best", "default")}
    step_wgmma = {b: 0.0 for b in wgmma_batches(args.wgmma_x_rows)}
    step_ablate: dict[str, float] = {}
    step_xk = {(b, key): 0.0 for b in XK_BATCHES for key in (*XK_BUILDS, "best", "default")}
    step_wgmma_best = dict(step_wgmma)
    step_split = {(b, key): 0.0 for b in WGMMA_SPLIT_BATCHES for key in ("plan", "best")}
    step_default = dict(step_wgmma)
    have_torch = args.backend == "cuda"
    copy = limits.copy_gbs * 1e9 if limits else float("nan")
    print(f"\n{'shape':>8} {'n':>6} {'k':>6} {'gemv1 us':>9} " +
          " ".join(f"{'b' + str(b) + ' us':>9}" for b in BATCHES) +
          "   of copy: gemv1 mma1 mma64   tiles(64)   torch fp16 us (same batches)")
    sms = sm_count(dev)
    with KernelHarness(dev, compiler) as h:
        f_gemv = h.function(INT4_MATMUL)
        for name, n, k, uses in SHAPES:
            n, k = max(16, n // div), max(128, k // div // 128 * 128)
            wbytes = n * k // 2 + n * k // 16
            copies = bench_limits.rotation(wbytes) if not args.small else 1
            host = [(rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                     (rng.random((n, k // 32), dtype=np.float32) * 0.01).astype(np.float16))
                    for _ in range(copies)]
            weights = [(h.put(pk), h.put(sc)) for pk, sc in host]
            # the decode graph's copies: the model's layout on the device (ops.device_weight)
            laid = tiled_layout(n, k)
            decode_w = [(h.put(tile_packed(pk)), h.put(tile_scales(sc))) for pk, sc in host] \
                if laid else weights
            if not args.tiled:
                del host
            x16 = h.put(rng.standard_normal((max(BATCHES), k)).astype(np.float16))   # every path's x
            tile_bytes = DEFAULT_DEQUANT_TILE_BYTES if not args.small else 2 * k * min(n, 64)
            tile = h.put(np.zeros(tile_bytes // 2, np.float16))
            y = h.put(np.zeros((max(BATCHES), n), np.float32))
            gemv1 = ours(dev, _launcher(dev, f_gemv, weights, x16, y, 1, n, k, True), args.reps,
                         args.trials)
            times, torch_times = {}, {}
            for b in BATCHES:
                times[b] = ours(dev, _default(dev, h, decode_w, x16, y, b, n, k, laid),
                                args.reps, args.trials)
                if have_torch:
                    torch_times[b] = torch_matmul(b, n, k, args.reps, args.trials)
                    have_torch = torch_times[b] is not None
            for b in TENSOR_BATCHES:
                dequant = INT4_DEQUANT_F16_TILED if laid else INT4_DEQUANT_F16
                step_tensor[b] += uses * ours(dev, tensor_launcher(
                    dev, h.function(dequant), decode_w, x16, y, tile, tile_bytes, b, n, k,
                    dequant=dequant), args.reps, args.trials)
            if args.rows_sweep:
                rows_times = rows_sweep(dev, h, weights, x16, y, n, k, args.reps, args.trials)
                print_rows_sweep(name, n, k, rows_times)
                for key, t in rows_times.items():
                    step_rows[key] = step_rows.get(key, 0.0) + uses * t
            if args.tiled:
                tiled = tiled_times(dev, h, host, weights, x16, y, n, k, args.reps, args.trials)
                del host
                print(f"  {name} n={n} k={k} rows kernels, us, reference layout / tiled (the "
                      f"library's warps: {rows_warps(n, sms)}) / tiled at 4, 8, 16 warps: "
                      + ", ".join(
                          f"b{b} {tiled[b, 'rows', 'library'] * 1e6:.1f} / "
                          f"{tiled[b, 'tiled', 'library'] * 1e6:.1f} / " + " ".join(
                              f"{tiled[b, 'tiled', w] * 1e6:.1f}" for w in ROW_WARP_CHOICES
                              if (b, "tiled", w) in tiled) for b in TILED_BATCHES)
                      + "; xa, reference / tiled: " + ", ".join(
                          f"b{b} {tiled[b, 'xa', 'library'] * 1e6:.1f} / "
                          f"{tiled[b, 'xa tiled', 'library'] * 1e6:.1f}" for b in TILED_XA_BATCHES),
                      flush=True)
                for key, t in tiled.items():
                    step_tiled[key] = step_tiled.get(key, 0.0) + uses * t
            if args.wgmma:
                wg = wgmma_times(dev, h, decode_w, x16, y, n, k, args.reps, args.trials,
                                 args.wgmma_stages, args.wgmma_groups, args.wgmma_next, laid,
                                 args.wgmma_wtma, args.wgmma_x_rows)
                for b, t in wg.items():
                    base = ours(dev, _library(dev, h, decode_w, x16, y, b, n, k, "xa", laid),
                                args.reps, args.trials)
                    print(f"  {name} n={n} k={k} b{b}: wgmma {t * 1e6:7.1f} us, xa "
                          f"{base * 1e6:7.1f} us", flush=True)
                    step_wgmma[b] += uses * t
                    step_wgmma_best[b] += uses * min(t, base)
                    step_default[b] += uses * base
            if args.wgmma_split_sweep:
                split_times = wgmma_split_times(dev, h, decode_w, x16, y, n, k, args.reps,
                                                args.trials, laid)
                plan = wgmma_plan(n, k, sms)
                for b in WGMMA_SPLIT_BATCHES:
                    row = {sp: t for (bb, sp), t in split_times.items() if bb == b}
                    best = min(row, key=row.get)
                    print(f"  {name} n={n} k={k} b{b} wgmma by split, us: " + " ".join(
                        f"{sp}{'*' if sp == plan else ''} {t * 1e6:.1f}" for sp, t in row.items())
                        + f"   best {best}, plan {plan} (*)", flush=True)
                    step_split[b, "plan"] += uses * row[plan]
                    step_split[b, "best"] += uses * row[best]
            if args.xk:
                xk = xk_times(dev, h, weights, x16, y, n, k, args.reps, args.trials,
                              args.xk_stages)
                for b in XK_BATCHES:
                    base = ours(dev, _default(dev, h, weights, x16, y, b, n, k), args.reps,
                                args.trials)
                    print(f"  {name} n={n} k={k} b{b}: "
                          + ", ".join(f"xk {nt}/{wk} (split {xk_plan(b, n, k, nt, wk, sms)}) "
                                      f"{xk[b, (nt, wk)] * 1e6:7.1f} us" for nt, wk in XK_BUILDS)
                          + f", default ({mma_kernel(b)}) {base * 1e6:7.1f} us", flush=True)
                    for build in XK_BUILDS:
                        step_xk[b, build] += uses * xk[b, build]
                    step_xk[b, "best"] += uses * min(base, *(xk[b, bd] for bd in XK_BUILDS))
                    step_xk[b, "default"] += uses * base
            if args.xa_sweep:
                xa_times = xa_sweep(dev, h, decode_w, x16, y, n, k, args.reps, args.trials,
                                    args.xa_ctas, args.xa_stages, laid)
                print_xa_sweep(name, n, k, xa_times, sms)
                for b in XA_SWEEP_BATCHES:
                    step_xa[b, "default"] += uses * xa_times[b, 0, 0]
                    step_xa[b, "plan"] += uses * xa_times[b, -1, -1]
                    step_xa[b, "best"] += uses * min(t for (bb, _, _), t in xa_times.items()
                                                     if bb == b)
            if args.xa_ablate:
                ablate = xa_ablation_times(dev, h, decode_w, x16, y, n, k, args.reps,
                                           args.trials, laid)
                print(f"  {name} n={n} k={k} b{ABLATE_ROWS}, us (of xa's time): " + ", ".join(
                    f"{bd} {t * 1e6:.1f} ({t / ablate['xa']:.2f})" for bd, t in ablate.items()),
                    flush=True)
                for bd, t in ablate.items():
                    step_ablate[bd] = step_ablate.get(bd, 0.0) + uses * t
            if args.mt_sweep:
                swept = sweep(dev, h, weights, x16, y, n, k, args.reps, args.trials)
                print_sweep(name, n, k, swept, sms)
                for b in BATCHES[1:]:
                    step_best[b] += uses * min(t for (bb, _), t in swept.items() if bb == b)
            h.close()
            best1 = min(gemv1, times[1])
            for b in BATCHES:
                step[b] += uses * (best1 if b == 1 else times[b])
                if have_torch:
                    step_torch[b] += uses * torch_times[b]
            step_gemv1 += uses * gemv1
            step_bytes += uses * wbytes
            launches.append((wbytes, uses))
            frac = [wbytes / t / copy for t in (gemv1, times[1], times[64])]
            row = (f"{name:>8} {n:6d} {k:6d} {gemv1 * 1e6:9.1f} "
                   + " ".join(f"{times[b] * 1e6:9.1f}" for b in BATCHES)
                   + "   " + " ".join(f"{f:5.2f}" for f in frac)
                   + f"   {mma_tiles(64, n, sms)}")
            if torch_times and all(v is not None for v in torch_times.values()):
                row += "   " + " ".join(f"{torch_times[b] * 1e6:7.1f}" for b in BATCHES)
            print(row, flush=True)
    same = same_bytes_limits(launches, args.trials, copy / 1e9) if limits else {}
    dev.close()
    print("\ndecode step's linears (32 layers + lm_head), ms (1 row: the faster kernel per shape):")
    for b in BATCHES:
        line = (f"  batch {b:3d}: ours {step[b] * 1e3:8.3f} ({step[b] / step[1]:.2f}x 1 row, "
                f"{step_bytes / step[b] / copy:.2f} of copy)")
        if have_torch and step_torch[b]:
            line += f"  torch fp16 {step_torch[b] * 1e3:8.3f}  ours/torch {step[b] / step_torch[b]:.2f}"
        print(line, flush=True)
        targets.figure(f"decode step int4 linears, {b} rows", step[b] * 1e3, "ms",
                       peer=step_torch[b] * 1e3 if have_torch and step_torch[b] else None)
    targets.figure("decode step int4 linears, 1 row on the GEMV", step_gemv1 * 1e3, "ms")
    print("decode step's linears on the prefill's path (dequant tile + cuBLAS fp16), ms:")
    for b in TENSOR_BATCHES:
        print(f"  batch {b:3d}: {step_tensor[b] * 1e3:8.3f} (int4_mma {step[b] * 1e3:8.3f})",
              flush=True)
        targets.figure(f"decode step int4 linears, {b} rows, dequant tile + cuBLAS",
                       step_tensor[b] * 1e3, "ms")
    if args.rows_sweep:
        print("decode step's linears on each rows build (depth/ctas/ctas16/long-K warps[/short-K "
              "warps]; "
              "async/stages/ctas; mma = gp_int4_mma), ms:")
        for b in ROWS_SWEEP_BATCHES:
            print(f"  batch {b:3d}: " + "  ".join(
                f"{'mma' if build is None else '/'.join(map(str, build))} {t * 1e3:.3f}"
                for (bb, build), t in step_rows.items() if bb == b))
            for (bb, build), t in step_rows.items():
                if bb == b and build is not None:
                    targets.figure(f"decode step int4 linears, {b} rows, rows build "
                                   f"{'/'.join(map(str, build))}", t * 1e3, "ms")
    if args.tiled:
        print("decode step's linears on the rows kernels, reference layout / 16-row tiles, ms:")
        for b in TILED_BATCHES:
            rows, tiled = step_tiled[b, "rows", "library"], step_tiled[b, "tiled", "library"]
            forced = {w: step_tiled[b, "tiled", w] for w in ROW_WARP_CHOICES
                      if (b, "tiled", w) in step_tiled}
            print(f"  batch {b:3d}: {rows * 1e3:8.3f} / {tiled * 1e3:8.3f} (tiled / reference "
                  f"{tiled / rows:.3f}; tiled {step_bytes / tiled / copy:.2f} of copy); tiled, "
                  "every linear at " + ", ".join(f"{w} warps {t * 1e3:.3f}"
                                                 for w, t in forced.items()))
            targets.figure(f"decode step int4 linears, {b} rows, rows kernels, reference layout",
                           rows * 1e3, "ms")
            targets.figure(f"decode step int4 linears, {b} rows, rows kernels, 16-row tiles",
                           tiled * 1e3, "ms")
            for w, t in forced.items():
                targets.figure(f"decode step int4 linears, {b} rows, rows kernels, 16-row tiles, "
                               f"{w} warps a block", t * 1e3, "ms")
            builds = {bd: t for (bb, layout, bd), t in step_tiled.items()
                      if bb == b and layout == "tiled build"}
            if builds:
                print("    tiled rows builds (depth/blocks per SM): "
                      + ", ".join(f"{bd} {t * 1e3:.3f}" for bd, t in builds.items()))
            for bd, t in builds.items():
                targets.figure(f"decode step int4 linears, {b} rows, rows kernels, 16-row tiles, "
                               f"build {bd}", t * 1e3, "ms")
        print("decode step's linears on gp_int4_mma_xa (its plan), reference layout / 16-row "
              "tiles, ms:")
        for b in TILED_XA_BATCHES:
            ref_t, tiled = step_tiled[b, "xa", "library"], step_tiled[b, "xa tiled", "library"]
            print(f"  batch {b:3d}: {ref_t * 1e3:8.3f} / {tiled * 1e3:8.3f} (tiled / reference "
                  f"{tiled / ref_t:.3f})")
            targets.figure(f"decode step int4 linears, {b} rows, xa, reference layout",
                           ref_t * 1e3, "ms")
            targets.figure(f"decode step int4 linears, {b} rows, xa, 16-row tiles", tiled * 1e3,
                           "ms")
    if args.wgmma:
        print("decode step's linears on gp_int4_wgmma, and on the faster of it and xa "
              "per shape, ms:")
        build = wgmma_build_name(args.wgmma_stages, args.wgmma_groups, args.wgmma_next,
                                 args.wgmma_wtma, args.wgmma_x_rows)
        for b, t_wg in step_wgmma.items():
            print(f"  batch {b:3d}: {build} {t_wg * 1e3:8.3f}, faster per shape "
                  f"{step_wgmma_best[b] * 1e3:8.3f} (xa {step_default[b] * 1e3:8.3f})")
            targets.figure(f"decode step int4 linears, {b} rows, {build}", t_wg * 1e3, "ms")
            targets.figure(f"decode step int4 linears, {b} rows, {build} where faster",
                           step_wgmma_best[b] * 1e3, "ms")
    if args.wgmma_split_sweep:
        print("decode step's linears on gp_int4_wgmma at wgmma_plan's split, and at the "
              "fastest split per shape, ms:")
        for b in WGMMA_SPLIT_BATCHES:
            print(f"  batch {b:3d}: plan {step_split[b, 'plan'] * 1e3:8.3f}, fastest split "
                  f"{step_split[b, 'best'] * 1e3:8.3f}")
            targets.figure(f"decode step int4 linears, {b} rows, wgmma at the fastest split",
                           step_split[b, "best"] * 1e3, "ms")
    if args.xk:
        print(f"decode step's linears on each gp_int4_mma_xk build (nt/wk, stages "
              f"{args.xk_stages}) at its plan, and on the fastest of them and the default per "
              "shape, ms:")
        for b in XK_BATCHES:
            print(f"  batch {b:3d}: " + ", ".join(f"xk {nt}/{wk} {step_xk[b, (nt, wk)] * 1e3:8.3f}"
                                                  for nt, wk in XK_BUILDS)
                  + f", fastest per shape {step_xk[b, 'best'] * 1e3:8.3f} (default "
                    f"{step_xk[b, 'default'] * 1e3:8.3f})")
            for nt, wk in XK_BUILDS:
                targets.figure(f"decode step int4 linears, {b} rows, xk {nt}/{wk} (stages "
                               f"{args.xk_stages})", step_xk[b, (nt, wk)] * 1e3, "ms")
            targets.figure(f"decode step int4 linears, {b} rows, xk or default where faster "
                           f"(stages {args.xk_stages})", step_xk[b, "best"] * 1e3, "ms")
    if args.xa_sweep:
        build = f"ctas {args.xa_ctas}, stages {args.xa_stages}"
        print(f"decode step's linears on gp_int4_mma_xa ({build}) at its plan, and on the best "
              "swept of xa and the default per shape, ms:")
        for b in XA_SWEEP_BATCHES:
            print(f"  batch {b:3d}: xa plan {step_xa[b, 'plan'] * 1e3:8.3f}, best "
                  f"{step_xa[b, 'best'] * 1e3:8.3f} (default {step_xa[b, 'default'] * 1e3:8.3f})")
            targets.figure(f"decode step int4 linears, {b} rows, xa plan ({build})",
                           step_xa[b, "plan"] * 1e3, "ms")
            targets.figure(f"decode step int4 linears, {b} rows, best swept xa or default "
                           f"({build})", step_xa[b, "best"] * 1e3, "ms")
    if args.xa_ablate:
        print(f"decode step's linears at {ABLATE_ROWS} rows on xa and on builds without parts "
              "of its loop (timing only), ms (of xa's time):")
        for bd, t in step_ablate.items():
            print(f"  {bd}: {t * 1e3:8.3f} ({t / step_ablate['xa']:.2f})")
            targets.figure(f"decode step int4 linears, {ABLATE_ROWS} rows, "
                           + ("xa" if bd == "xa" else f"xa ablation: {bd}"), t * 1e3, "ms")
    if args.mt_sweep:
        print("decode step's linears with the best swept mt per shape, ms:")
        for b in BATCHES[1:]:
            print(f"  batch {b:3d}: {step_best[b] * 1e3:8.3f} (default {step[b] * 1e3:8.3f})")
            targets.figure(f"decode step int4 linears, {b} rows, best swept tiles", step_best[b] * 1e3,
                           "ms")
    targets.check("decode step int4 linears, 64 rows / 1 row", step[64] / step[1], "<=",
                  TARGET_64_OVER_1)
    record_one_row(targets, step[1], launches, copy / 1e9, same)
    return targets.exit_code()


def same_bytes_limits(launches: list[tuple[int, int]], trials: int,
                      copy_gbs: float) -> dict[int, SameBytes]:
    """bench/limits.same_bytes at each shape's bytes a launch, printed (empty without torch)."""
    print("\nthe copy limit at each shape's bytes a launch (bench/limits.same_bytes):")
    same: dict[int, SameBytes] = {}
    for nbytes, _ in launches:
        if nbytes not in same:
            found = same_bytes(nbytes, trials)
            if found is None:
                return {}
            same[nbytes] = found
            print(f"  {found.line(copy_gbs)}", flush=True)
    return same


def one_row_limit_s(launches: list[tuple[int, int]], same: dict[int, SameBytes]) -> float | None:
    """Seconds the step's linears would take with each launch at a copy of its own bytes (None
    where a shape's copy was not measured)."""
    if not launches or any(nbytes not in same for nbytes, _ in launches):
        return None
    return sum(uses * nbytes / (same[nbytes].copy_gbs * 1e9) for nbytes, uses in launches)


def record_one_row(targets, step1_s: float, launches: list[tuple[int, int]], copy_gbs: float,
                   same: dict[int, SameBytes]) -> None:
    """The 1-row target: on the copy of each launch's bytes where `same` has every shape's, else
    on the 1 GiB copy; the 1 GiB fraction is a figure beside the first."""
    step_bytes = sum(uses * nbytes for nbytes, uses in launches)
    of_1gib = step_bytes / step1_s / (copy_gbs * 1e9)
    limit_s = one_row_limit_s(launches, same)
    name = "decode step int4 linears at 1 row"
    if limit_s is None:
        targets.check(f"{name}, fraction of copy", of_1gib, ">=", ONE_ROW_OF_COPY, limit=copy_gbs)
        return
    targets.figure(f"{name}, fraction of copy", of_1gib, "fraction", limit=copy_gbs)
    limit_gbs = step_bytes / limit_s / 1e9
    print(f"  1 row: {of_1gib:.2f} of the 1 GiB copy, {limit_s / step1_s:.2f} of a copy of each "
          f"launch's bytes ({limit_s * 1e3:.3f} ms, {limit_gbs:,.0f} GB/s over the step)")
    targets.figure(f"{name}, the step at a copy of each launch's bytes", limit_s * 1e3, "ms")
    targets.check(f"{name}, fraction of a copy of the same bytes", limit_s / step1_s, ">=",
                  ONE_ROW_OF_COPY, unit="fraction", limit=limit_gbs)


if __name__ == "__main__":
    sys.exit(main())
