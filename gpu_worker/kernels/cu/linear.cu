#include "gpuplane_common.cuh"
extern "C" __global__ void gp_int4_dequant(float* __restrict__ w, const unsigned char* __restrict__ packed,
                                           const unsigned short* __restrict__ scales, int n, int k) {
    const int kb = (k + 31) >> 5;
    GP_GRID_STRIDE(i, (long long)n * k) {
        const int r = (int)(i / k), c = (int)(i % k);
        const unsigned char byte = packed[(size_t)r * kb * 16 + (c >> 1)];
        const int nib = (c & 1) ? (byte >> 4) : (byte & 15);
        w[i] = (float)(nib - 8) * gp_half_to_float(scales[(size_t)r * kb + (c >> 5)]);
    }
}

#define GP_TM 64
#define GP_TN 64
#define GP_TK 16
// y[M,N] = x[M,K] . w[N,K]^T (+ bias). Block 256 = 16x16 threads, each a 4x4 patch of a 64x64 tile.
extern "C" __global__ void __launch_bounds__(256)
gp_matmul_nt(float* y, const float* __restrict__ x, const float* __restrict__ w,
             const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    __shared__ float xs[GP_TK][GP_TM + 4];
    __shared__ float ws[GP_TK][GP_TN + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * GP_TM, n0 = blockIdx.x * GP_TN;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += GP_TK) {
        for (int e = tid; e < GP_TM * GP_TK; e += 256) {
            const int r = e / GP_TK, kk = e % GP_TK, gk = k0 + kk;
            const int gm = m0 + r, gn = n0 + r;
            xs[kk][r] = (gm < M && gk < K) ? x[(size_t)gm * K + gk] : 0.f;
            ws[kk][r] = (gn < N && gk < K) ? w[(size_t)gn * K + gk] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GP_TK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int gm = m0 + ty * 4 + i;
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int gn = n0 + tx * 4 + j;
            if (gn >= N) continue;
            float v = acc[i][j] + (bias ? bias[gn] : 0.f);
            float* yp = y + (size_t)gm * N + gn;
            *yp = accumulate ? *yp + v : v;
        }
    }
}

// matmul_nt_large: same contract as gp_matmul_nt with 128x128 tiles, K step 8, an 8x8 patch per
// thread (rows ty*4+i and 64+ty*4+i, columns likewise) read from shared memory as float4: twice
// the FLOPs per shared/global byte of the 64x64 kernel. For large M and N (prefill).
extern "C" __global__ void __launch_bounds__(256)
gp_matmul_nt_large(float* y, const float* __restrict__ x, const float* __restrict__ w,
                   const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    __shared__ __align__(16) float xs[8][132];
    __shared__ __align__(16) float ws[8][132];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * 128, n0 = blockIdx.x * 128;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += 8) {
#pragma unroll
        for (int e = tid; e < 1024; e += 256) {
            const int r = e >> 3, kk = e & 7, gk = k0 + kk;
            const int gm = m0 + r, gn = n0 + r;
            xs[kk][r] = (gm < M && gk < K) ? x[(size_t)gm * K + gk] : 0.f;
            ws[kk][r] = (gn < N && gk < K) ? w[(size_t)gn * K + gk] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&xs[kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&xs[kk][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&ws[kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&ws[kk][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int gm = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int gn = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + (j - 4));
            if (gn >= N) continue;
            const float v = acc[i][j] + (bias ? bias[gn] : 0.f);
            float* yp = y + (size_t)gm * N + gn;
            *yp = accumulate ? *yp + v : v;
        }
    }
}

// Fused int4 matmul for few rows (decode): streams W at HBM bandwidth.
// Contract (every int4 linear's, docs/kernels.md "Numerics"): y = x16 @ f16(s * (nib - 8))^T in f32,
// x fp16 as stored, each weight the fp16 rounding of its exact dequantized value: the same
// products as int4_mma and the prefill's dequant tile + cuBLAS, so a row's result does not
// depend on which path (which batch) served it, up to f32 summation order.
// Block = GP_I4_WARPS warps x GP_I4_NC output columns each, GP_I4_ROWS rows of x (grid.y). K is walked in chunks of
// GP_I4_U * 32 quant blocks: lane l owns quant blocks l, l + 32, ... of the chunk and loads each as
// one uint4 (16 bytes = 32 weights = one fp16 scale), so a warp reads 512 contiguous bytes per
// column per load and holds GP_I4_U * GP_I4_NC such loads in flight. The chunk of x is staged by
// the whole block in shared memory as f32 (exact), padded to 36 floats per 32 so a lane's float4
// reads of its own block are bank-conflict free; x is then reused from registers across the
// warp's columns. Nibbles become (nib - 8) exactly through the fp16x2 magic 1024 + nib, two per
// 32-bit op, then one mul.rn.f16x2 by the block's scale rounds both weights as the reference does;
// lanes meet in a warp shuffle sum.
// The macros are the tuning knobs of bench/int4_gemv_sweep.py; the defaults are the measured best
// and must match FUSED_WARPS / FUSED_WARP_COLS / FUSED_ROWS (tests/kernels/test_int4_gemv.py).
#ifndef GP_I4_NC
#define GP_I4_NC 4                      // output columns per warp
#endif
#ifndef GP_I4_U
#define GP_I4_U 2                       // quant blocks per lane per chunk
#endif
#ifndef GP_I4_WARPS
#define GP_I4_WARPS 8                   // warps per block (FUSED_COLS = GP_I4_WARPS * GP_I4_NC)
#endif
#ifndef GP_I4_ROWS
#define GP_I4_ROWS 4                    // rows of x per block (FUSED_ROWS)
#endif
#ifndef GP_I4_PREFETCH
#define GP_I4_PREFETCH 0                // 1: load chunk c + 1's weights before computing chunk c
#endif
#define GP_I4_CB (GP_I4_U * 32)          // quant blocks per chunk
#define GP_I4_CK (GP_I4_CB * 32)         // k per chunk

// Nibbles s and 16 + s of q (s in 0, 4, 8, 12) -> f16(scale * (nib - 8)) as two floats; s2 holds
// the block's fp16 scale in both halves.
__device__ __forceinline__ void gp_i4_pair(unsigned int q, unsigned int s2, float& lo, float& hi) {
    unsigned int h = (q & 0x000F000Fu) | 0x64006400u;   // fp16x2 (1024 + nib, 1024 + nib')
    const unsigned int bias = 0x64086408u;              // fp16x2 (1032, 1032)
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(h), "r"(bias));   // nib - 8, exact
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(h), "r"(s2));     // rounded once, as f16(s * q)
    asm("{.reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b;}"
        : "=f"(lo), "=f"(hi) : "r"(h));
}

// The 8 weights of one packed word, in k order.
__device__ __forceinline__ void gp_i4_word(unsigned int q, unsigned int s2, float* w) {
    gp_i4_pair(q, s2, w[0], w[4]);
    gp_i4_pair(q >> 4, s2, w[1], w[5]);
    gp_i4_pair(q >> 8, s2, w[2], w[6]);
    gp_i4_pair(q >> 12, s2, w[3], w[7]);
}

// Lane `lane`'s packed blocks and scales (fp16 in both halves) of chunk cb0 for columns
// n0..n0+NC-1; slots past K or N read nothing and hold nibble 8 (weight 0) with scale 0, so they
// add exactly 0.
__device__ __forceinline__ void gp_i4_load(uint4 (&wq)[GP_I4_U][GP_I4_NC], unsigned (&sc)[GP_I4_U][GP_I4_NC],
                                           const unsigned char* __restrict__ packed,
                                           const unsigned short* __restrict__ scales,
                                           int cb0, int lane, int n0, int N, int kb) {
#pragma unroll
    for (int u = 0; u < GP_I4_U; ++u) {
        const int b = cb0 + u * 32 + lane;
#pragma unroll
        for (int c = 0; c < GP_I4_NC; ++c) {
            const int n = n0 + c;
            if (b < kb && n < N) {
                wq[u][c] = __ldg(reinterpret_cast<const uint4*>(packed + ((size_t)n * kb + b) * 16));
                const unsigned s = __ldg(scales + (size_t)n * kb + b);
                sc[u][c] = s | (s << 16);
            } else {
                wq[u][c] = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
                sc[u][c] = 0u;
            }
        }
    }
}

template <int MR>
__device__ __forceinline__ void gp_int4_matmul_body(
        float* y, const unsigned short* __restrict__ x, const unsigned char* __restrict__ packed,
        const unsigned short* __restrict__ scales, const float* __restrict__ bias,
        int M, int N, int K, int accumulate, float (*xs)[GP_I4_CB * 36]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = (blockIdx.x * GP_I4_WARPS + warp) * GP_I4_NC;
    const int m0 = blockIdx.y * GP_I4_ROWS;
    const int mrows = min(MR, M - m0);
    const int kb = (K + 31) >> 5;
    const bool vec = (K & 3) == 0 && (reinterpret_cast<size_t>(x) & 7) == 0;
    float acc[MR][GP_I4_NC];
#pragma unroll
    for (int r = 0; r < MR; ++r)
#pragma unroll
        for (int c = 0; c < GP_I4_NC; ++c) acc[r][c] = 0.f;
    // Weight loads are issued before the staging barriers, so they stay in flight across them.
    uint4 wq[GP_I4_U][GP_I4_NC];
    unsigned sc[GP_I4_U][GP_I4_NC];
    gp_i4_load(wq, sc, packed, scales, 0, lane, n0, N, kb);
    for (int cb0 = 0; cb0 < kb; cb0 += GP_I4_CB) {
#if GP_I4_PREFETCH
        uint4 wn[GP_I4_U][GP_I4_NC];
        unsigned sn[GP_I4_U][GP_I4_NC];
        gp_i4_load(wn, sn, packed, scales, cb0 + GP_I4_CB, lane, n0, N, kb);   // in flight meanwhile
#endif
        __syncthreads();   // the previous chunk's reads of xs are done
        const int k0 = cb0 * 32;
        for (int e = tid; e < mrows * (GP_I4_CK / 4); e += blockDim.x) {
            const int r = e / (GP_I4_CK / 4), kk = (e % (GP_I4_CK / 4)) * 4, gk = k0 + kk;
            const unsigned short* xr = x + (size_t)(m0 + r) * K;
            float4 v;
            if (vec && gk + 4 <= K) {
                const uint2 h = __ldg(reinterpret_cast<const uint2*>(xr + gk));
                v = make_float4(gp_half_to_float((unsigned short)(h.x & 0xffffu)),
                                gp_half_to_float((unsigned short)(h.x >> 16)),
                                gp_half_to_float((unsigned short)(h.y & 0xffffu)),
                                gp_half_to_float((unsigned short)(h.y >> 16)));
            } else {
                v.x = gk < K ? gp_half_to_float(xr[gk]) : 0.f;
                v.y = gk + 1 < K ? gp_half_to_float(xr[gk + 1]) : 0.f;
                v.z = gk + 2 < K ? gp_half_to_float(xr[gk + 2]) : 0.f;
                v.w = gk + 3 < K ? gp_half_to_float(xr[gk + 3]) : 0.f;
            }
            *reinterpret_cast<float4*>(&xs[r][(kk >> 5) * 36 + (kk & 31)]) = v;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < GP_I4_U; ++u) {
            const int slot = (u * 32 + lane) * 36;
#pragma unroll
            for (int wd = 0; wd < 4; ++wd) {
                float q[GP_I4_NC][8];
#pragma unroll
                for (int c = 0; c < GP_I4_NC; ++c) {
                    const uint4 w4 = wq[u][c];
                    gp_i4_word(wd == 0 ? w4.x : wd == 1 ? w4.y : wd == 2 ? w4.z : w4.w, sc[u][c], q[c]);
                }
#pragma unroll
                for (int r = 0; r < MR; ++r) {
                    if (r >= mrows) break;
                    const float4 a = *reinterpret_cast<const float4*>(&xs[r][slot + wd * 8]);
                    const float4 b = *reinterpret_cast<const float4*>(&xs[r][slot + wd * 8 + 4]);
#pragma unroll
                    for (int c = 0; c < GP_I4_NC; ++c) {
                        float p = acc[r][c];
                        p = fmaf(a.x, q[c][0], p); p = fmaf(a.y, q[c][1], p);
                        p = fmaf(a.z, q[c][2], p); p = fmaf(a.w, q[c][3], p);
                        p = fmaf(b.x, q[c][4], p); p = fmaf(b.y, q[c][5], p);
                        p = fmaf(b.z, q[c][6], p); p = fmaf(b.w, q[c][7], p);
                        acc[r][c] = p;
                    }
                }
            }
        }
#if GP_I4_PREFETCH
#pragma unroll
        for (int u = 0; u < GP_I4_U; ++u)
#pragma unroll
            for (int c = 0; c < GP_I4_NC; ++c) { wq[u][c] = wn[u][c]; sc[u][c] = sn[u][c]; }
#else
        if (cb0 + GP_I4_CB < kb) gp_i4_load(wq, sc, packed, scales, cb0 + GP_I4_CB, lane, n0, N, kb);
#endif
    }
#pragma unroll
    for (int r = 0; r < MR; ++r) {
        if (r >= mrows) break;
#pragma unroll
        for (int c = 0; c < GP_I4_NC; ++c) {
            const float v = gp_warp_sum(acc[r][c]);
            const int n = n0 + c;
            if (lane == c && n < N) {
                float* yp = y + (size_t)(m0 + r) * N + n;
                const float o = v + (bias ? bias[n] : 0.f);
                *yp = accumulate ? *yp + o : o;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GP_I4_WARPS * 32)
gp_int4_matmul(float* y, const unsigned short* __restrict__ x, const unsigned char* __restrict__ packed,
               const unsigned short* __restrict__ scales, const float* __restrict__ bias,
               int M, int N, int K, int accumulate) {
    __shared__ __align__(16) float xs[GP_I4_ROWS][GP_I4_CB * 36];
#if GP_I4_ROWS == 1
    gp_int4_matmul_body<1>(y, x, packed, scales, bias, M, N, K, accumulate, xs);
#else
    if (M - (int)blockIdx.y * GP_I4_ROWS == 1)   // block-uniform: batch-1 decode holds 1 row of state
        gp_int4_matmul_body<1>(y, x, packed, scales, bias, M, N, K, accumulate, xs);
    else
        gp_int4_matmul_body<GP_I4_ROWS>(y, x, packed, scales, bias, M, N, K, accumulate, xs);
#endif
}
