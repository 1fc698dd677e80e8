#include "gpuplane_common.cuh"
#define GP_MMA_WARPS 8

__device__ __forceinline__ unsigned gp_lop_nib(unsigned w) {  // (w & 0x000f000f) | 0x64006400
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(w), "r"(0x000f000fu), "r"(0x64006400u));
    return r;
}
__device__ __forceinline__ unsigned gp_hsub2(unsigned a, unsigned b) {
    unsigned r;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ unsigned gp_hmul2(unsigned a, unsigned b) {
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// d += a * b (16x16 fp16 row, 16x8 fp16 col), fp32 accumulate.
__device__ __forceinline__ void gp_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 4 A registers of both k16 chunks of a quant block for rows g (word wg, scale sg) and g + 8
// (w8, s8), scales fp16 in both halves: chunk 0 = {p0(g), p0(g+8), p1(g), p1(g+8)}, chunk 1 =
// {p2.., p3..}; p_i holds k (8t + i, 8t + 4 + i) as f16(scale * (nib - 8)): nib - 8 exact (the
// fp16 magic 1024 + nib minus 1032), then one rounding of the product, as the reference.
__device__ __forceinline__ void gp_dequant(unsigned (&a)[2][4], unsigned wg, unsigned w8,
                                           unsigned sg, unsigned s8) {
    const unsigned bias = 0x64086408u;  // fp16x2 (1032, 1032)
    a[0][0] = gp_hmul2(gp_hsub2(gp_lop_nib(wg), bias), sg);
    a[0][1] = gp_hmul2(gp_hsub2(gp_lop_nib(w8), bias), s8);
    a[0][2] = gp_hmul2(gp_hsub2(gp_lop_nib(wg >> 4), bias), sg);
    a[0][3] = gp_hmul2(gp_hsub2(gp_lop_nib(w8 >> 4), bias), s8);
    a[1][0] = gp_hmul2(gp_hsub2(gp_lop_nib(wg >> 8), bias), sg);
    a[1][1] = gp_hmul2(gp_hsub2(gp_lop_nib(w8 >> 8), bias), s8);
    a[1][2] = gp_hmul2(gp_hsub2(gp_lop_nib(wg >> 12), bias), sg);
    a[1][3] = gp_hmul2(gp_hsub2(gp_lop_nib(w8 >> 12), bias), s8);
}

// B registers of x row's k = 8t..8t+7 of a quant block (8 fp16, one 16-byte load v): the
// (k, k + 4) pairs, b[i] = (x[8t + i], x[8t + 4 + i]), by byte permutes.
__device__ __forceinline__ void gp_xfrag(unsigned (&b)[4], uint4 v) {
    b[0] = __byte_perm(v.x, v.z, 0x5410);
    b[1] = __byte_perm(v.x, v.z, 0x7632);
    b[2] = __byte_perm(v.y, v.w, 0x5410);
    b[3] = __byte_perm(v.y, v.w, 0x7632);
}

// Scale j (0..3) of a row's 4-scale group s, in both halves of a register.
__device__ __forceinline__ unsigned gp_scale2(uint2 s, int j) {
    const unsigned v = j < 2 ? s.x : s.y;
    return __byte_perm(v, 0u, (j & 1) ? 0x3232 : 0x1010);
}

template <int MT, int NT>
__device__ __forceinline__ void gp_i4mma(float* y, const unsigned short* __restrict__ x,
                                         const unsigned* __restrict__ w,
                                         const unsigned short* __restrict__ sc,
                                         const float* __restrict__ bias, int M, int N, int K,
                                         int accumulate, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int KB = K >> 5, KG = K >> 7;  // quant blocks, groups of 4 per row
    const int row0 = blockIdx.x * MT * 16;
    const int g0 = (int)((long long)KG * warp / GP_MMA_WARPS);
    const int g1 = (int)((long long)KG * (warp + 1) / GP_MMA_WARPS);
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    for (int kg = g0; kg < g1; ++kg) {
        const int kb0 = kg * 4;
        unsigned wr[MT][2][4];
        uint2 sr[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = row0 + mt * 16 + g + 8 * h;
                const bool in = r < N;
                const unsigned* wp = w + ((long long)(in ? r : 0) * KB + kb0) * 4 + t;
#pragma unroll
                for (int j = 0; j < 4; ++j) wr[mt][h][j] = in ? __ldg(wp + 4 * j) : 0x88888888u;
                sr[mt][h] = in ? *reinterpret_cast<const uint2*>(sc + (long long)r * KB + kb0)
                               : make_uint2(0u, 0u);
            }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint4 xv[NT];   // this quant block's x, every n-tile, loads issued together
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int m = nt * 8 + g;
                xv[nt] = m < M ? __ldg(reinterpret_cast<const uint4*>(x + (long long)m * K + (kb0 + j) * 32 + 8 * t))
                               : make_uint4(0u, 0u, 0u, 0u);
            }
            unsigned a[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                gp_dequant(a[mt], wr[mt][0][j], wr[mt][1][j], gp_scale2(sr[mt][0], j), gp_scale2(sr[mt][1], j));
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned b[4];
                gp_xfrag(b, xv[nt]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    gp_mma(acc[mt][nt], a[mt][0], b[0], b[1]);
                    gp_mma(acc[mt][nt], a[mt][1], b[2], b[3]);
                }
            }
        }
    }
    // Sum the warps' K slices in warp order (deterministic): red holds the running sum.
    for (int wv = 0; wv < GP_MMA_WARPS - 1; ++wv) {
        if (warp == wv) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float* p = red + ((mt * NT + nt) * 4 + e) * 32 + lane;
                        *p = wv == 0 ? acc[mt][nt][e] : *p + acc[mt][nt][e];
                    }
        }
        __syncthreads();
    }
    if (warp != GP_MMA_WARPS - 1) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + mt * 16 + g + 8 * (e >> 1), m = nt * 8 + 2 * t + (e & 1);
                if (r >= N || m >= M) continue;
                float v = red[((mt * NT + nt) * 4 + e) * 32 + lane] + acc[mt][nt][e];
                if (bias) v += bias[r];
                float* yp = y + (long long)m * N + r;
                *yp = accumulate ? *yp + v : v;
            }
}

// grid (ceil(N / (16 * mt))), 256 threads; NT from M, mt (16-row tiles per warp) from the
// launcher (int4_batched.mma_tiles): fewer rows per block for small N, so every SM gets a block;
// every MT of int4_batched.MT_CHOICES is built (MT * NT <= 16: the reduction buffer).
#define GP_I4MMA(MT_, NT_) gp_i4mma<MT_, NT_>(y, x, w, scales, bias, M, N, K, accumulate, red)
extern "C" __global__ void __launch_bounds__(256, 1)
gp_int4_mma(float* y, const unsigned short* __restrict__ x, const unsigned char* __restrict__ packed,
            const unsigned short* __restrict__ scales, const float* __restrict__ bias, int M, int N,
            int K, int accumulate, int mt) {
    __shared__ float red[16 * 4 * 32];  // MT * NT * 4 * 32 floats: MT * NT <= 16
    const unsigned* w = reinterpret_cast<const unsigned*>(packed);
    if (M <= 8) {
        if (mt == 4) GP_I4MMA(4, 1); else if (mt == 2) GP_I4MMA(2, 1); else GP_I4MMA(1, 1);
    } else if (M <= 16) {
        if (mt == 4) GP_I4MMA(4, 2); else if (mt == 2) GP_I4MMA(2, 2); else GP_I4MMA(1, 2);
    } else if (M <= 32) {
        if (mt == 4) GP_I4MMA(4, 4); else if (mt == 2) GP_I4MMA(2, 4); else GP_I4MMA(1, 4);
    } else {
        if (mt == 2) GP_I4MMA(2, 8); else GP_I4MMA(1, 8);
    }
}
