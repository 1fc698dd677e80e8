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
from gpu_worker.kernels.common import BLOCK, KernelDef, grid_1d, make_source, require, require_sizes

SOURCE = make_source("gp_rotary", r"""
extern "C" __global__ void gp_rotary(float* x, const int* __restrict__ pos, int batch, int tokens,
                                     int heads, int head_dim, int row_stride, int pos_offset,
                                     float theta, const float* __restrict__ inv_freq) {
    const int half = head_dim >> 1;
    const long long total = (long long)batch * tokens * heads * half;
    GP_GRID_STRIDE(i, total) {
        const int j = (int)(i % half);
        long long rest = i / half;
        const int h = (int)(rest % heads);
        rest /= heads;
        const int t = (int)(rest % tokens);
        const int b = (int)(rest / tokens);
        const int p = (pos ? pos[b] : 0) + pos_offset + t;
        // The angle is formed in double: at long contexts p * inv is thousands of radians, where
        // one float ulp of the frequency already moves sin/cos by ~1e-4 (seen on the H200 against
        // the NumPy reference). The references use float64 angles too.
        // inv_freq, when given, is a model's rescaled table (llama3 rope scaling).
        const double inv = inv_freq ? (double)inv_freq[j]
                                    : pow((double)theta, -((double)(2 * j) / (double)head_dim));
        double sd, cd;
        sincos((double)p * inv, &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        float* row = x + ((size_t)b * tokens + t) * row_stride + (size_t)h * head_dim;
        const float x1 = row[j], x2 = row[j + half];
        row[j] = x1 * c - x2 * s;
        row[j + half] = x2 * c + x1 * s;
    }
}

// Row r of x rotates at positions[r] (a decode batch: one sequence per row, each at its own
// position); a row whose position is negative (padding) is zeroed, all heads.
extern "C" __global__ void gp_rotary_rows(float* x, const int* __restrict__ positions, int rows,
                                          int heads, int head_dim, int row_stride, float theta,
                                          const float* __restrict__ inv_freq) {
    const int half = head_dim >> 1;
    const long long total = (long long)rows * heads * half;
    GP_GRID_STRIDE(i, total) {
        const int j = (int)(i % half);
        const long long rest = i / half;
        const int h = (int)(rest % heads), r = (int)(rest / heads);
        const int p = positions[r];
        float* row = x + (size_t)r * row_stride + (size_t)h * head_dim;
        if (p < 0) { row[j] = 0.f; row[j + half] = 0.f; continue; }
        // double angles, as gp_rotary (and the references)
        const double inv = inv_freq ? (double)inv_freq[j]
                                    : pow((double)theta, -((double)(2 * j) / (double)head_dim));
        double sd, cd;
        sincos((double)p * inv, &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        const float x1 = row[j], x2 = row[j + half];
        row[j] = x1 * c - x2 * s;
        row[j + half] = x2 * c + x1 * s;
    }
}
""")


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
    device.launch(function, grid_1d(total), BLOCK,
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
    device.launch(function, grid_1d(total), BLOCK,
                  [ptr(x), ptr(positions), i32(rows), i32(heads), i32(head_dim), i32(row_stride),
                   f32(theta), ptr(inv_freq)], stream=stream)


ROTARY = KernelDef("rotary", "gp_rotary", SOURCE, reference.rotary, launch_rotary)
ROTARY_ROWS = KernelDef("rotary_rows", "gp_rotary_rows", SOURCE, reference.rotary_rows,
                        launch_rotary_rows)

KERNELS = [ROTARY, ROTARY_ROWS]
