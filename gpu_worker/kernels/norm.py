"""RMSNorm and LayerNorm over the last dimension, one block per row.

Shapes: out, x (rows, hidden) f32 (out may alias x), weight (hidden,) f32, bias (hidden,) f32 or 0.
Statistics accumulate in float32; LayerNorm takes two passes over the row (mean, then the centred
variance) because the one-pass E[x^2] - E[x]^2 cancels catastrophically for rows with a large mean.
"""
from __future__ import annotations

from gpu_worker.device.backend import f32, i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import BLOCK, MAX_GRID_1D, KernelDef, make_source, require_sizes

SOURCE = make_source("gp_norm", r"""
extern "C" __global__ void gp_rmsnorm(float* out, const float* x, const float* __restrict__ w,
                                      int rows, int hidden, float eps) {
    __shared__ float scratch[33];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + (size_t)r * hidden;
        float* o = out + (size_t)r * hidden;
        float ss = 0.f;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) { const float v = xr[c]; ss += v * v; }
        ss = gp_block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) o[c] = xr[c] * inv * w[c];
    }
}

extern "C" __global__ void gp_layernorm(float* out, const float* x, const float* __restrict__ w,
                                        const float* __restrict__ b, int rows, int hidden,
                                        float eps) {
    __shared__ float scratch[33];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + (size_t)r * hidden;
        float* o = out + (size_t)r * hidden;
        float s = 0.f;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) s += xr[c];
        const float mean = gp_block_sum(s, scratch) / (float)hidden;
        float var = 0.f;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) { const float d = xr[c] - mean; var += d * d; }
        var = gp_block_sum(var, scratch) / (float)hidden;
        const float inv = 1.0f / sqrtf(var + eps);
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            const float y = (xr[c] - mean) * inv * w[c];
            o[c] = b ? y + b[c] : y;
        }
    }
}
""")


def launch_rmsnorm(device, function, out: int, x: int, weight: int, rows: int, hidden: int,
                   eps: float, stream=None) -> None:
    require_sizes("rmsnorm", rows=rows, hidden=hidden)
    if rows == 0 or hidden == 0:
        return
    device.launch(function, (min(rows, MAX_GRID_1D), 1, 1), BLOCK,
                  [ptr(out), ptr(x), ptr(weight), i32(rows), i32(hidden), f32(eps)], stream=stream)


def launch_layernorm(device, function, out: int, x: int, weight: int, bias: int, rows: int,
                     hidden: int, eps: float, stream=None) -> None:
    require_sizes("layernorm", rows=rows, hidden=hidden)
    if rows == 0 or hidden == 0:
        return
    device.launch(function, (min(rows, MAX_GRID_1D), 1, 1), BLOCK,
                  [ptr(out), ptr(x), ptr(weight), ptr(bias), i32(rows), i32(hidden), f32(eps)],
                  stream=stream)


RMSNORM = KernelDef("rmsnorm", "gp_rmsnorm", SOURCE, reference.rmsnorm, launch_rmsnorm)
LAYERNORM = KernelDef("layernorm", "gp_layernorm", SOURCE, reference.layernorm, launch_layernorm)

KERNELS = [RMSNORM, LAYERNORM]
