#include "gpuplane_common.cuh"
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
