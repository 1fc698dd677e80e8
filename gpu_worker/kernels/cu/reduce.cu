#include "gpuplane_common.cuh"
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
