"""Rotary position embedding (Llama "rotate half"), in place.

Shapes: x (batch, tokens, heads, head_dim) f32 with `row_stride` floats between consecutive tokens
(so q and k can be rotated inside a fused QKV buffer), rotating pairs (i, i + head_dim/2).
Position of token t of sequence b: (pos ? pos[b] : 0) + pos_offset + t, where `pos` is a device
int32 per sequence. Reading the position from device memory is what lets a captured decode graph
be replayed at every step: the graph bakes the pointer, the step writes the value.
Angles are pos * theta^(-2i/d), or pos * inv_freq[i] when a table is given (0: none).
"""
from __future__ import annotations

from gpu_worker.device.backend import f32, i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import BLOCK, KernelDef, cu_source, grid_1d, require, require_sizes

SOURCE = cu_source("gp_rotary", "rotary.cu")


def launch_rotary(device, function, x: int, pos: int, batch: int, tokens: int, heads: int,
                  head_dim: int, row_stride: int, pos_offset: int, theta: float,
                  stream=None, inv_freq: int = 0) -> None:
    require_sizes("rotary", batch=batch, tokens=tokens, heads=heads, head_dim=head_dim,
                  row_stride=row_stride, items=batch * tokens * heads * head_dim)
    require(head_dim % 2 == 0, f"rotary: head_dim={head_dim} must be even")
    require(row_stride >= heads * head_dim or tokens * batch <= 1,
            f"rotary: row_stride={row_stride} < heads*head_dim={heads * head_dim}")
    total = batch * tokens * heads * (head_dim // 2)
    if total == 0:
        return
    device.launch(function, grid_1d(device, total), BLOCK,
                  [ptr(x), ptr(pos), i32(batch), i32(tokens), i32(heads), i32(head_dim),
                   i32(row_stride), i32(pos_offset), f32(theta), ptr(inv_freq)], stream=stream)


def launch_rotary_rows(device, function, x: int, positions: int, rows: int, heads: int,
                       head_dim: int, row_stride: int, theta: float, stream=None,
                       inv_freq: int = 0) -> None:
    """Row r of x (rows, row_stride floats) rotated in place at positions[r]; -1 rows zeroed."""
    require_sizes("rotary_rows", rows=rows, heads=heads, head_dim=head_dim, row_stride=row_stride,
                  items=rows * max(row_stride, heads * head_dim))
    require(head_dim % 2 == 0, f"rotary_rows: head_dim={head_dim} must be even")
    require(row_stride >= heads * head_dim,
            f"rotary_rows: row_stride={row_stride} < heads*head_dim={heads * head_dim}")
    require(positions != 0, "rotary_rows: needs positions (a device int32 per row)")
    total = rows * heads * (head_dim // 2)
    if total == 0:
        return
    device.launch(function, grid_1d(device, total), BLOCK,
                  [ptr(x), ptr(positions), i32(rows), i32(heads), i32(head_dim), i32(row_stride),
                   f32(theta), ptr(inv_freq)], stream=stream)


ROTARY = KernelDef("rotary", "gp_rotary", SOURCE, reference.rotary, launch_rotary)
ROTARY_ROWS = KernelDef("rotary_rows", "gp_rotary_rows", SOURCE, reference.rotary_rows,
                        launch_rotary_rows)

KERNELS = [ROTARY, ROTARY_ROWS]
