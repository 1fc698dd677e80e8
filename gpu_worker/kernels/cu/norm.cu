#include "gpuplane_common.cuh"
// T: float (gp_rmsnorm) or gp_h (gp_rmsnorm_f16: the same f32 value rounded to fp16, nearest
// even, for a linear whose operand is fp16: it replaces an rmsnorm + to_f16 pair).
// One block per row. A decode step runs two per layer on a handful of rows, so a row's latency is
// what counts: a thread loads its GP_NORM_VEC float4s of a chunk at once (not one float per
// dependent iteration: 16 serial loads a thread were ~10 us a row on the H200), and a row of at
// most one chunk (hidden <= 4 * GP_NORM_VEC * blockDim: 4096 at 256 threads) stays in registers
// between the sum and the scaling. Rows, x, w and out not 16-byte aligned take the scalar loop.
#define GP_NORM_VEC 4

__device__ __forceinline__ float gp_sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

template <typename T>
__device__ __forceinline__ void gp_rmsnorm_t(T* out, const float* x, const float* __restrict__ w,
                                             int rows, int hidden, float eps) {
    __shared__ float scratch[33];
    const bool vec = (hidden & 3) == 0 && ((reinterpret_cast<unsigned long long>(x) |
                      reinterpret_cast<unsigned long long>(w) | reinterpret_cast<unsigned long long>(out)) & 15) == 0;
    const int h4 = hidden >> 2, step = GP_NORM_VEC * blockDim.x;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + (size_t)r * hidden;
        T* o = out + (size_t)r * hidden;
        float ss = 0.f;
        if (!vec) {
            for (int c = threadIdx.x; c < hidden; c += blockDim.x) { const float v = xr[c]; ss += v * v; }
            ss = gp_block_sum(ss, scratch);
            const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
            for (int c = threadIdx.x; c < hidden; c += blockDim.x) gp_st(o + c, xr[c] * inv * w[c]);
            continue;
        }
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4 v[GP_NORM_VEC];
        for (int c0 = threadIdx.x; c0 < h4; c0 += step) {
#pragma unroll
            for (int j = 0; j < GP_NORM_VEC; ++j) {
                const int c = c0 + j * blockDim.x;
                v[j] = c < h4 ? x4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int j = 0; j < GP_NORM_VEC; ++j) ss += gp_sq4(v[j]);
        }
        ss = gp_block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int c0 = threadIdx.x; c0 < h4; c0 += step) {
            float4 g[GP_NORM_VEC];
#pragma unroll
            for (int j = 0; j < GP_NORM_VEC; ++j) {
                const int c = c0 + j * blockDim.x;
                if (c >= h4) continue;
                g[j] = w4[c];
                if (h4 > step) v[j] = x4[c];   // a row of several chunks: read x again
            }
#pragma unroll
            for (int j = 0; j < GP_NORM_VEC; ++j) {
                const int c = c0 + j * blockDim.x;
                if (c >= h4) continue;
                gp_st4(o + 4 * c, make_float4(v[j].x * inv * g[j].x, v[j].y * inv * g[j].y,
                                              v[j].z * inv * g[j].z, v[j].w * inv * g[j].w));
            }
        }
    }
}

extern "C" __global__ void gp_rmsnorm(float* out, const float* x, const float* __restrict__ w,
                                      int rows, int hidden, float eps) {
    GP_PDL_ENTRY();
    gp_rmsnorm_t(out, x, w, rows, hidden, eps);
}

extern "C" __global__ void gp_rmsnorm_f16(unsigned short* out, const float* x,
                                          const float* __restrict__ w, int rows, int hidden,
                                          float eps) {
    GP_PDL_ENTRY();
    gp_rmsnorm_t(reinterpret_cast<gp_h*>(out), x, w, rows, hidden, eps);
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
