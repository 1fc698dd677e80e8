#include "gpuplane_common.cuh"
// T: float (gp_rmsnorm) or gp_h (gp_rmsnorm_f16: the same f32 value rounded to fp16, nearest
// even, for a linear whose operand is fp16: it replaces an rmsnorm + to_f16 pair).
template <typename T>
__device__ __forceinline__ void gp_rmsnorm_t(T* out, const float* x, const float* __restrict__ w,
                                             int rows, int hidden, float eps) {
    __shared__ float scratch[33];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + (size_t)r * hidden;
        T* o = out + (size_t)r * hidden;
        float ss = 0.f;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) { const float v = xr[c]; ss += v * v; }
        ss = gp_block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) gp_st(o + c, xr[c] * inv * w[c]);
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
