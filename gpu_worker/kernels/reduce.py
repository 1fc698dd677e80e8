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
    MAX_GRID_1D,
    KernelDef,
    grid_1d,
    make_source,
    require,
    require_sizes,
)

SOURCE = make_source("gp_reduce", r"""
__device__ __forceinline__ void gp_argmax_merge(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
}

extern "C" __global__ void gp_argmax(int* out, const float* __restrict__ x, int rows, int cols) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + (size_t)r * cols;
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = xr[c];
            if (v > bv || bi == 0x7fffffff) { bv = v; bi = c; }
        }
        for (int o = 16; o > 0; o >>= 1)
            gp_argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o),
                            __shfl_xor_sync(0xffffffffu, bi, o));
        __syncthreads();  // the previous row's readers of sv / si are done
        if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
        __syncthreads();
        if (warp == 0) {
            bv = lane < nwarps ? sv[lane] : -INFINITY;
            bi = lane < nwarps ? si[lane] : 0x7fffffff;
            for (int o = 16; o > 0; o >>= 1)
                gp_argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o),
                                __shfl_xor_sync(0xffffffffu, bi, o));
            if (lane == 0) out[r] = bi;
        }
    }
}

extern "C" __global__ void gp_mean_pool(float* out, const float* __restrict__ x,
                                        const int* __restrict__ lens, int batch, int seq,
                                        int hidden) {
    GP_GRID_STRIDE(i, (long long)batch * hidden) {
        const int b = (int)(i / hidden), c = (int)(i % hidden);
        const int n = lens ? min(max(lens[b], 0), seq) : seq;
        const float* xb = x + (size_t)b * seq * hidden + c;
        float s = 0.f;
        for (int t = 0; t < n; ++t) s += xb[(size_t)t * hidden];
        out[i] = n ? s / (float)n : 0.f;
    }
}
""")


def launch_argmax(device, function, out: int, x: int, rows: int, cols: int, stream=None) -> None:
    require_sizes("argmax", rows=rows, cols=cols)
    require(cols > 0, "argmax: cols must be positive (an empty row has no argmax)")
    if rows == 0:
        return
    device.launch(function, (min(rows, MAX_GRID_1D), 1, 1), BLOCK,
                  [ptr(out), ptr(x), i32(rows), i32(cols)], stream=stream)


def launch_mean_pool(device, function, out: int, x: int, lens: int, batch: int, seq: int,
                     hidden: int, stream=None) -> None:
    require_sizes("mean_pool", batch=batch, seq=seq, hidden=hidden, outputs=batch * hidden)
    if batch * hidden == 0:
        return
    device.launch(function, grid_1d(batch * hidden), BLOCK,
                  [ptr(out), ptr(x), ptr(lens), i32(batch), i32(seq), i32(hidden)], stream=stream)


ARGMAX = KernelDef("argmax", "gp_argmax", SOURCE, reference.argmax, launch_argmax)
MEAN_POOL = KernelDef("mean_pool", "gp_mean_pool", SOURCE, reference.mean_pool, launch_mean_pool)

KERNELS = [ARGMAX, MEAN_POOL]
