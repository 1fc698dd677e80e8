#include "gpuplane_common.cuh"
// T: float (gp_silu_gate) or gp_h (gp_silu_gate_f16: the same f32 value rounded to fp16, for a
// down projection on tensor cores). The fused gate|up linear's rows are read in place:
// gate = row, up = row + cols, both strides 2 * cols.
template <typename T>
__device__ __forceinline__ void gp_silu_gate_t(T* out, const float* gate, const float* up,
                                               int rows, int cols, int gate_stride,
                                               int up_stride) {
    GP_GRID_STRIDE(i, (long long)rows * cols) {
        const long long r = i / cols, c = i % cols;
        const float g = gate[r * gate_stride + c];
        gp_st(out + i, g / (1.0f + expf(-g)) * up[r * up_stride + c]);
    }
}

extern "C" __global__ void gp_silu_gate(float* out, const float* gate, const float* up, int rows,
                                        int cols, int gate_stride, int up_stride) {
    GP_PDL_ENTRY();
    gp_silu_gate_t(out, gate, up, rows, cols, gate_stride, up_stride);
}

extern "C" __global__ void gp_silu_gate_f16(unsigned short* out, const float* gate,
                                            const float* up, int rows, int cols, int gate_stride,
                                            int up_stride) {
    GP_PDL_ENTRY();
    gp_silu_gate_t(reinterpret_cast<gp_h*>(out), gate, up, rows, cols, gate_stride, up_stride);
}

extern "C" __global__ void gp_gelu(float* out, const float* x, int n, int exact) {
    GP_GRID_STRIDE(i, n) {
        const float v = x[i];
        out[i] = exact ? 0.5f * v * (1.0f + erff(v * 0.7071067811865476f))
                       : 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
}

extern "C" __global__ void gp_add(float* out, const float* a, const float* b, int n) {
    GP_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

extern "C" __global__ void gp_bias_add(float* out, const float* x, const float* __restrict__ bias,
                                       int rows, int cols) {
    GP_GRID_STRIDE(i, (long long)rows * cols) out[i] = x[i] + bias[i % cols];
}

extern "C" __global__ void gp_add_i32(int* p, int delta, int n) {
    GP_GRID_STRIDE(i, n) p[i] += delta;
}
