"""RMSNorm and LayerNorm over the last dimension, one block per row.

Shapes: out, x (rows, hidden) f32 (out may alias x), weight (hidden,) f32, bias (hidden,) f32 or 0.
`rmsnorm_f16` is rmsnorm with fp16 out (the f32 value rounded to nearest even): the input of a
linear on tensor cores, which otherwise took an rmsnorm and a to_f16 node.
Statistics accumulate in float32; LayerNorm takes two passes over the row (mean, then the centred
variance) because the one-pass E[x^2] - E[x]^2 cancels catastrophically for rows with a large mean.
"""
from __future__ import annotations

from gpu_worker.device.backend import f32, i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import BLOCK, KernelDef, cu_source, max_grid_1d, require_sizes

SOURCE = cu_source("gp_norm", "norm.cu")


def launch_rmsnorm(device, function, out: int, x: int, weight: int, rows: int, hidden: int,
                   eps: float, stream=None) -> None:
    require_sizes("rmsnorm", rows=rows, hidden=hidden)
    if rows == 0 or hidden == 0:
        return
    device.launch(function, (min(rows, max_grid_1d(device)), 1, 1), BLOCK,
                  [ptr(out), ptr(x), ptr(weight), i32(rows), i32(hidden), f32(eps)], stream=stream,
                  pdl=True)


def launch_rmsnorm_f16(device, function, out: int, x: int, weight: int, rows: int, hidden: int,
                       eps: float, stream=None) -> None:
    """launch_rmsnorm with `out` (rows, hidden) fp16."""
    require_sizes("rmsnorm_f16", rows=rows, hidden=hidden)
    if rows == 0 or hidden == 0:
        return
    device.launch(function, (min(rows, max_grid_1d(device)), 1, 1), BLOCK,
                  [ptr(out), ptr(x), ptr(weight), i32(rows), i32(hidden), f32(eps)], stream=stream,
                  pdl=True)


def launch_layernorm(device, function, out: int, x: int, weight: int, bias: int, rows: int,
                     hidden: int, eps: float, stream=None) -> None:
    require_sizes("layernorm", rows=rows, hidden=hidden)
    if rows == 0 or hidden == 0:
        return
    device.launch(function, (min(rows, max_grid_1d(device)), 1, 1), BLOCK,
                  [ptr(out), ptr(x), ptr(weight), ptr(bias), i32(rows), i32(hidden), f32(eps)],
                  stream=stream)


RMSNORM = KernelDef("rmsnorm", "gp_rmsnorm", SOURCE, reference.rmsnorm, launch_rmsnorm)
RMSNORM_F16 = KernelDef("rmsnorm_f16", "gp_rmsnorm_f16", SOURCE, reference.rmsnorm_f16,
                        launch_rmsnorm_f16)
LAYERNORM = KernelDef("layernorm", "gp_layernorm", SOURCE, reference.layernorm, launch_layernorm)

KERNELS = [RMSNORM, RMSNORM_F16, LAYERNORM]
