"""Row reductions: argmax over the vocabulary (greedy sampling) and mean pooling (encoder output).

- argmax: out (rows,) int32 = index of the largest value of each row of x (rows, cols) f32, ties to
  the lowest index (numpy's rule); one block per row. Inputs are assumed NaN-free.
- mean_pool: out (batch, hidden) = mean of x (batch, seq, hidden) over the first n_b positions,
  n_b = clamp(lens[b], 0, seq) when `lens` (device int32 per sequence) is given, else seq; n_b = 0
  gives zeros. Thread per output element, coalesced over hidden.
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import (
    BLOCK,
    KernelDef,
    cu_source,
    grid_1d,
    max_grid_1d,
    require,
    require_sizes,
)

SOURCE = cu_source("gp_reduce", "reduce.cu")


def launch_argmax(device, function, out: int, x: int, rows: int, cols: int, stream=None) -> None:
    require_sizes("argmax", rows=rows, cols=cols)
    require(cols > 0, "argmax: cols must be positive (an empty row has no argmax)")
    if rows == 0:
        return
    device.launch(function, (min(rows, max_grid_1d(device)), 1, 1), BLOCK,
                  [ptr(out), ptr(x), i32(rows), i32(cols)], stream=stream)


def launch_mean_pool(device, function, out: int, x: int, lens: int, batch: int, seq: int,
                     hidden: int, stream=None) -> None:
    require_sizes("mean_pool", batch=batch, seq=seq, hidden=hidden, outputs=batch * hidden)
    if batch * hidden == 0:
        return
    device.launch(function, grid_1d(device, batch * hidden), BLOCK,
                  [ptr(out), ptr(x), ptr(lens), i32(batch), i32(seq), i32(hidden)], stream=stream)


ARGMAX = KernelDef("argmax", "gp_argmax", SOURCE, reference.argmax, launch_argmax)
MEAN_POOL = KernelDef("mean_pool", "gp_mean_pool", SOURCE, reference.mean_pool, launch_mean_pool)

KERNELS = [ARGMAX, MEAN_POOL]
