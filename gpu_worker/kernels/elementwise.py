"""Elementwise kernels: SiLU-gate multiply, GELU, residual add, bias add, int32 counter add.

All are grid-stride loops over the elements; outputs may alias inputs (in place).
- silu_gate: out (rows, cols) = silu(gate) * up, gate/up rows `gate_stride`/`up_stride` floats
  apart (both halves of a fused gate|up matmul output are addressed in place). silu_gate_f16: the
  same, fp16 out (the down projection's tensor-core operand, without a to_f16 node).
- gelu: tanh approximation, or the exact erf form (`exact`, BERT checkpoints). add: out = a + b. bias_add: out (rows, cols) = x + bias[col].
- add_i32: p[i] += delta for i < n; advances a device position/length counter inside a captured
  decode graph so the next replay sees the next position.
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import BLOCK, KernelDef, cu_source, grid_1d, require_sizes

SOURCE = cu_source("gp_elementwise", "elementwise.cu")


def _silu_items(out: int, gate: int, up: int, rows: int, cols: int, gs: int, us: int) -> int:
    """Threads the silu kernels want: 4 columns each where every row is 16-byte aligned (the
    kernel's own test), else one."""
    vec = (cols | gs | us) % 4 == 0 and (out | gate | up) % 16 == 0
    return rows * cols // 4 if vec else rows * cols


def launch_silu_gate(device, function, out: int, gate: int, up: int, rows: int, cols: int,
                     gate_stride: int | None = None, up_stride: int | None = None,
                     stream=None) -> None:
    gs = cols if gate_stride is None else gate_stride
    us = cols if up_stride is None else up_stride
    require_sizes("silu_gate", rows=rows, cols=cols, gate_stride=gs, up_stride=us,
                  elements=rows * cols)
    if rows * cols == 0:
        return
    device.launch(function, grid_1d(device, _silu_items(out, gate, up, rows, cols, gs, us)), BLOCK,
                  [ptr(out), ptr(gate), ptr(up), i32(rows), i32(cols), i32(gs), i32(us)],
                  stream=stream, pdl=True)


def launch_silu_gate_f16(device, function, out: int, gate: int, up: int, rows: int, cols: int,
                         gate_stride: int | None = None, up_stride: int | None = None,
                         stream=None) -> None:
    """launch_silu_gate with `out` (rows, cols) fp16."""
    gs = cols if gate_stride is None else gate_stride
    us = cols if up_stride is None else up_stride
    require_sizes("silu_gate_f16", rows=rows, cols=cols, gate_stride=gs, up_stride=us,
                  elements=rows * cols)
    if rows * cols == 0:
        return
    device.launch(function, grid_1d(device, _silu_items(out, gate, up, rows, cols, gs, us)), BLOCK,
                  [ptr(out), ptr(gate), ptr(up), i32(rows), i32(cols), i32(gs), i32(us)],
                  stream=stream, pdl=True)


def launch_gelu(device, function, out: int, x: int, n: int, stream=None, exact: bool = False) -> None:
    require_sizes("gelu", n=n)
    if n:
        device.launch(function, grid_1d(device, n), BLOCK, [ptr(out), ptr(x), i32(n), i32(int(exact))],
                      stream=stream)


def launch_add(device, function, out: int, a: int, b: int, n: int, stream=None) -> None:
    require_sizes("add", n=n)
    if n:
        device.launch(function, grid_1d(device, n), BLOCK, [ptr(out), ptr(a), ptr(b), i32(n)], stream=stream)


def launch_bias_add(device, function, out: int, x: int, bias: int, rows: int, cols: int,
                    stream=None) -> None:
    require_sizes("bias_add", rows=rows, cols=cols, elements=rows * cols)
    if rows * cols:
        device.launch(function, grid_1d(device, rows * cols), BLOCK,
                      [ptr(out), ptr(x), ptr(bias), i32(rows), i32(cols)], stream=stream)


def launch_add_i32(device, function, p: int, delta: int, n: int = 1, stream=None) -> None:
    require_sizes("add_i32", n=n)
    if n:
        device.launch(function, grid_1d(device, n), BLOCK, [ptr(p), i32(delta), i32(n)], stream=stream)


SILU_GATE = KernelDef("silu_gate", "gp_silu_gate", SOURCE, reference.silu_gate, launch_silu_gate)
SILU_GATE_F16 = KernelDef("silu_gate_f16", "gp_silu_gate_f16", SOURCE, reference.silu_gate_f16,
                          launch_silu_gate_f16)
GELU = KernelDef("gelu", "gp_gelu", SOURCE, reference.gelu, launch_gelu)
ADD = KernelDef("add", "gp_add", SOURCE, reference.add, launch_add)
BIAS_ADD = KernelDef("bias_add", "gp_bias_add", SOURCE, reference.bias_add, launch_bias_add)
ADD_I32 = KernelDef("add_i32", "gp_add_i32", SOURCE, reference.add_i32, launch_add_i32)

KERNELS = [SILU_GATE, SILU_GATE_F16, GELU, ADD, BIAS_ADD, ADD_I32]
