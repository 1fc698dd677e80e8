#include "gpuplane_common.cuh"
// w16[r - row0, c] = fp16((nib(r, c) - 8) * scale(r, c / 32)) for r in [row0, row0 + rows)
extern "C" __global__ void gp_int4_dequant_f16(unsigned short* __restrict__ w16,
                                               const unsigned char* __restrict__ packed,
                                               const unsigned short* __restrict__ scales,
                                               int row0, int rows, int k) {
    const int kb = (k + 31) >> 5;
    if ((k & 7) == 0) {
        const int words = k >> 3;                       // 8 weights per 32-bit word
        GP_GRID_STRIDE(i, (long long)rows * words) {
            const int r = (int)(i / words), wd = (int)(i % words);
            const size_t gr = (size_t)(row0 + r);
            const unsigned int q = reinterpret_cast<const unsigned int*>(packed + gr * kb * 16)[wd];
            const float s = gp_half_to_float(scales[gr * kb + (wd >> 2)]);
            unsigned int h[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float lo = (float)((int)((q >> (8 * j)) & 15u) - 8) * s;
                const float hi = (float)((int)((q >> (8 * j + 4)) & 15u) - 8) * s;
                h[j] = (unsigned int)gp_float_to_half(lo) | ((unsigned int)gp_float_to_half(hi) << 16);
            }
            *reinterpret_cast<uint4*>(w16 + (size_t)r * k + (size_t)wd * 8) =
                make_uint4(h[0], h[1], h[2], h[3]);
        }
    } else {
        GP_GRID_STRIDE(i, (long long)rows * k) {
            const int r = (int)(i / k), c = (int)(i % k);
            const size_t gr = (size_t)(row0 + r);
            const unsigned char byte = packed[gr * kb * 16 + (c >> 1)];
            const int nib = (c & 1) ? (byte >> 4) : (byte & 15);
            w16[i] = gp_float_to_half((float)(nib - 8) * gp_half_to_float(scales[gr * kb + (c >> 5)]));
        }
    }
}

extern "C" __global__ void gp_to_f16(unsigned short* __restrict__ out, const float* __restrict__ x,
                                     long long n) {
    GP_GRID_STRIDE(i, n) out[i] = gp_float_to_half(x[i]);
}
