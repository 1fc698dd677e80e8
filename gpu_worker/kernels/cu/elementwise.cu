#include "gpuplane_common.cuh"
// T: float (gp_silu_gate) or gp_h (gp_silu_gate_f16: the same f32 value rounded to fp16, for a
// down projection on tensor cores). The fused gate|up linear's rows are read in place:
// gate = row, up = row + cols, both strides 2 * cols.
// Rows of a multiple of 4 columns with 16-byte aligned gate, up and out rows take 4 columns
// a thread (float4 loads, one division per 4 values); any other shape the scalar loop.
__device__ __forceinline__ float gp_silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

template <typename T>
__device__ __forceinline__ void gp_silu_gate_t(T* out, const float* gate, const float* up,
                                               int rows, int cols, int gate_stride,
                                               int up_stride) {
    const unsigned long long addr = reinterpret_cast<unsigned long long>(gate) |
        reinterpret_cast<unsigned long long>(up) | reinterpret_cast<unsigned long long>(out);
    if (((cols | gate_stride | up_stride) & 3) == 0 && (addr & 15) == 0) {
        const int c4 = cols >> 2;
        GP_GRID_STRIDE(i, (long long)rows * c4) {
            const long long r = i / c4, c = 4 * (i % c4);
            const float4 g = *reinterpret_cast<const float4*>(gate + r * gate_stride + c);
            const float4 u = *reinterpret_cast<const float4*>(up + r * up_stride + c);
            gp_st4(out + r * cols + c, make_float4(gp_silu_mul(g.x, u.x), gp_silu_mul(g.y, u.y),
                                                   gp_silu_mul(g.z, u.z), gp_silu_mul(g.w, u.w)));
        }
        return;
    }
    GP_GRID_STRIDE(i, (long long)rows * cols) {
        const long long r = i / cols, c = i % cols;
        gp_st(out + i, gp_silu_mul(gate[r * gate_stride + c], up[r * up_stride + c]));
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
