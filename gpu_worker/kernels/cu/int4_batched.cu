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
__device__ __forceinline__ unsigned gp_pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float gp_lo_f(unsigned v) { return gp_half_to_float((unsigned short)(v & 0xffffu)); }
__device__ __forceinline__ float gp_hi_f(unsigned v) { return gp_half_to_float((unsigned short)(v >> 16)); }

// d = a * b (16x16 fp16 row, 16x8 fp16 col), fp32 out, zero accumulator.
__device__ __forceinline__ void gp_mma0(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}
__device__ __forceinline__ void gp_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 4 A registers of both k16 chunks of a quant block for rows g (word wg) and g + 8 (w8):
// chunk 0 = {p0(g), p0(g+8), p1(g), p1(g+8)}, chunk 1 = {p2.., p3..}; p_i holds k (8t + i,
// 8t + 4 + i) as the exact fp16 integers nib - 8.
__device__ __forceinline__ void gp_dequant(unsigned (&a)[2][4], unsigned wg, unsigned w8) {
    const unsigned bias = 0x64086408u;  // fp16x2 (1032, 1032): 1024 + nib - 1032 = nib - 8
    a[0][0] = gp_hsub2(gp_lop_nib(wg), bias);
    a[0][1] = gp_hsub2(gp_lop_nib(w8), bias);
    a[0][2] = gp_hsub2(gp_lop_nib(wg >> 4), bias);
    a[0][3] = gp_hsub2(gp_lop_nib(w8 >> 4), bias);
    a[1][0] = gp_hsub2(gp_lop_nib(wg >> 8), bias);
    a[1][1] = gp_hsub2(gp_lop_nib(w8 >> 8), bias);
    a[1][2] = gp_hsub2(gp_lop_nib(wg >> 12), bias);
    a[1][3] = gp_hsub2(gp_lop_nib(w8 >> 12), bias);
}

// hi + lo fp16x2 halves of the 8 floats x[k .. k+7] of one quant block slice, paired (k + i,
// k + 4 + i) as the A registers pair nibbles i and 4 + i: x = hi + lo to ~2^-22.
__device__ __forceinline__ void gp_split8(uint4& h, uint4& l, float4 f0, float4 f1) {
    const float a[4] = {f0.x, f0.y, f0.z, f0.w}, b[4] = {f1.x, f1.y, f1.z, f1.w};
    unsigned hh[4], ll[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        hh[i] = gp_pack2(a[i], b[i]);
        ll[i] = gp_pack2(a[i] - gp_lo_f(hh[i]), b[i] - gp_hi_f(hh[i]));
    }
    h = make_uint4(hh[0], hh[1], hh[2], hh[3]);
    l = make_uint4(ll[0], ll[1], ll[2], ll[3]);
}

// 16 bytes global -> shared without registers; zeros when !in (src-size 0 reads nothing).
__device__ __forceinline__ void gp_cp_async16(void* dst, const void* src, bool in) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(in ? 16 : 0)
                 : "memory");
}

// Thread-block clusters (sm_90): the CTAs of one cluster split K of the same rows and sum their
// partials through distributed shared memory. Without a cluster launch a CTA is its own cluster
// of one (rank 0 of 1); below sm_90 there are no clusters and the launcher never asks for one.
__device__ __forceinline__ int gp_cluster_rank() {
#if __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return (int)r;
#else
    return 0;
#endif
}
__device__ __forceinline__ int gp_cluster_size() {
#if __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return (int)r;
#else
    return 1;
#endif
}
__device__ __forceinline__ void gp_cluster_sync() {  // every thread of every CTA of the cluster
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __syncthreads();
#endif
}
// The float at shared-window address `local` of the cluster's CTA `rank`.
__device__ __forceinline__ float gp_ld_cluster(unsigned local, int rank) {
#if __CUDA_ARCH__ >= 900
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    return 0.f;
#endif
}

// Layout of one staged x chunk (G groups of 128 k, i.e. 4G quant blocks) in shared memory: for
// x row m, quant block q and quad thread t, the 8 floats x[m][q*32 + 8t ..] as one 16-byte hi slot
// and one lo slot at m * RS + 4q + t of the hi and lo planes. RS = 16G + 4: the pad of 4 slots
// makes the 8 threads of a quarter warp (rows g, g+1; t 0..3) hit 8 distinct 16-byte bank groups,
// for the loads of the mma B fragments and for the staging stores alike.
template <int NT, int G>
struct GpStage {
    static constexpr int MP = NT * 8;             // staged x rows (n side of the mma, padded)
    static constexpr int RS = 16 * G + 4;         // 16-byte slots per staged row
    static constexpr int PLANE = MP * RS;         // slots per plane (hi, then lo)
    static constexpr int ITEMS = MP * 16 * G;     // (row, quant block, t) items per chunk
    static constexpr int IPT = (ITEMS + GP_MMA_WARPS * 32 - 1) / (GP_MMA_WARPS * 32);
    static constexpr int RAW = 2 * 2 * PLANE;     // after two buffers of hi + lo planes: the raw
    static constexpr int BYTES = (RAW + 2 * PLANE) * 16;  // f32 planes (x[..k+3], x[k+4..])
};

// y (M, N) = x (M, K) @ dequant(W)^T for the 128 * MT weight rows of blockIdx.y and the K slice
// of this CTA's cluster rank. 8 warps, each 16 * MT rows over the whole slice, share each x chunk
// staged once in shared memory (double-buffered); the next chunk's weights and x are loaded into
// registers while this one's mmas run.
template <int MT, int NT, int G>
__device__ __forceinline__ void gp_i4mma(float* y, const float* __restrict__ x,
                                         const unsigned* __restrict__ w,
                                         const unsigned short* __restrict__ sc,
                                         const float* __restrict__ bias, int M, int N, int K,
                                         int accumulate, unsigned char* smem) {
    using St = GpStage<NT, G>;
    constexpr int R = GP_MMA_WARPS * 16 * MT;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int KB = K >> 5, KG = K >> 7;  // quant blocks per row, groups of 4 of them
    const int S = gp_cluster_size(), rank = gp_cluster_rank();
    const int row0 = blockIdx.y * R, wrow0 = row0 + warp * 16 * MT;
    const int g0 = (int)((long long)KG * rank / S), g1 = (int)((long long)KG * (rank + 1) / S);
    const int chunks = (g1 - g0 + G - 1) / G;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    // weight words (word t of each 16-byte quant block) and scales of chunk c, rows g and g + 8
    auto load_w = [&](int c, unsigned (&wr)[MT][2][G][4], uint2 (&sr)[MT][2][G]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wrow0 + mt * 16 + g + 8 * h;
#pragma unroll
                for (int gi = 0; gi < G; ++gi) {
                    const int kg = g0 + c * G + gi;
                    const bool in = r < N && kg < g1;
                    const unsigned* wp = w + ((long long)(in ? r : 0) * KB + (in ? kg : 0) * 4) * 4 + t;
#pragma unroll
                    for (int j = 0; j < 4; ++j) wr[mt][h][gi][j] = in ? __ldg(wp + 4 * j) : 0x88888888u;
                    sr[mt][h][gi] = in ? __ldg(reinterpret_cast<const uint2*>(sc + (long long)r * KB + kg * 4))
                                       : make_uint2(0u, 0u);
                }
            }
    };
    // This thread's x items of chunk c, copied raw (f32) into the staging planes by cp.async
    // (zero-filled past M or past the slice), then split into hi + lo by the same thread once
    // they landed (cp.async.wait_all orders a thread's own copies, so no barrier between).
    auto issue_x = [&](int c) {
#pragma unroll
        for (int i = 0; i < St::IPT; ++i) {
            const int it = tid + i * GP_MMA_WARPS * 32;
            if (it >= St::ITEMS) continue;
            const int m = it / (16 * G), q = (it >> 2) % (4 * G), tt = it & 3;
            const int kg = g0 + c * G + (q >> 2);
            const bool in = m < M && kg < g1;
            const float* p = x + (in ? (long long)m * K + kg * 128 + (q & 3) * 32 + 8 * tt : 0);
            const int slot = St::RAW + m * St::RS + it % (16 * G);
            gp_cp_async16(xs + slot, p, in);
            gp_cp_async16(xs + slot + St::PLANE, p + 4, in);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    auto convert_x = [&](int buf) {
        asm volatile("cp.async.wait_all;\n" ::: "memory");
#pragma unroll
        for (int i = 0; i < St::IPT; ++i) {
            const int it = tid + i * GP_MMA_WARPS * 32;
            if (it >= St::ITEMS) continue;
            const int rs = (it / (16 * G)) * St::RS + it % (16 * G);
            const uint4 r0 = xs[St::RAW + rs], r1 = xs[St::RAW + rs + St::PLANE];
            const int slot = buf * 2 * St::PLANE + rs;
            gp_split8(xs[slot], xs[slot + St::PLANE], *reinterpret_cast<const float4*>(&r0),
                      *reinterpret_cast<const float4*>(&r1));
        }
    };

    unsigned wa[MT][2][G][4];
    uint2 sa[MT][2][G];
    load_w(0, wa, sa);
    issue_x(0);
    convert_x(0);
    __syncthreads();
    for (int c = 0; c < chunks; ++c) {
        const bool more = c + 1 < chunks;
        unsigned wb[MT][2][G][4];
        uint2 sb[MT][2][G];
        if (more) {
            load_w(c + 1, wb, sb);
            issue_x(c + 1);
        }
        const uint4* hi = xs + (c & 1) * 2 * St::PLANE;
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            if (g0 + c * G + gi >= g1) break;  // the slice's tail (uniform over the CTA)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned sh = 16 * (j & 1);
                unsigned a[MT][2][4];
                float sg[MT], s8[MT];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    gp_dequant(a[mt], wa[mt][0][gi][j], wa[mt][1][gi][j]);
                    sg[mt] = gp_half_to_float((unsigned short)((j < 2 ? sa[mt][0][gi].x : sa[mt][0][gi].y) >> sh));
                    s8[mt] = gp_half_to_float((unsigned short)((j < 2 ? sa[mt][1][gi].x : sa[mt][1][gi].y) >> sh));
                }
                // Four rounds of independent mmas (every n-tile and weight tile per round), so
                // no mma waits on the one before it; then each sum is scaled into its accumulator.
                uint4 xh[NT], xl[NT];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int slot = (nt * 8 + g) * St::RS + (gi * 4 + j) * 4 + t;
                    xh[nt] = hi[slot];
                    xl[nt] = hi[slot + St::PLANE];
                }
                float d[MT][NT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) gp_mma0(d[mt][nt], a[mt][0], xh[nt].x, xh[nt].y);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) gp_mma(d[mt][nt], a[mt][1], xh[nt].z, xh[nt].w);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) gp_mma(d[mt][nt], a[mt][0], xl[nt].x, xl[nt].y);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        gp_mma(d[mt][nt], a[mt][1], xl[nt].z, xl[nt].w);
                        acc[mt][nt][0] = fmaf(sg[mt], d[mt][nt][0], acc[mt][nt][0]);
                        acc[mt][nt][1] = fmaf(sg[mt], d[mt][nt][1], acc[mt][nt][1]);
                        acc[mt][nt][2] = fmaf(s8[mt], d[mt][nt][2], acc[mt][nt][2]);
                        acc[mt][nt][3] = fmaf(s8[mt], d[mt][nt][3], acc[mt][nt][3]);
                    }
            }
        }
        if (more) convert_x((c + 1) & 1);
        __syncthreads();
        if (more) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int gi = 0; gi < G; ++gi) {
                        sa[mt][h][gi] = sb[mt][h][gi];
#pragma unroll
                        for (int j = 0; j < 4; ++j) wa[mt][h][gi][j] = wb[mt][h][gi][j];
                    }
        }
    }

    if (S == 1) {  // this CTA holds whole sums: each warp writes its own rows
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = wrow0 + mt * 16 + g + 8 * (e >> 1), m = nt * 8 + 2 * t + (e & 1);
                    if (r >= N || m >= M) continue;
                    float v = acc[mt][nt][e];
                    if (bias) v += bias[r];
                    float* yp = y + (long long)m * N + r;
                    *yp = accumulate ? *yp + v : v;
                }
        return;
    }
    // Split K: partials to shared memory as [m][row] (row stride R + 4: conflict-free stores),
    // then cluster rank q sums its 1/S of the (m, row) outputs over ranks 0..S-1 in rank order
    // (deterministic, no atomics) and writes y. The loop's last barrier freed the x buffers.
    float* ps = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rl = warp * 16 * MT + mt * 16 + g + 8 * (e >> 1), m = nt * 8 + 2 * t + (e & 1);
                ps[m * (R + 4) + rl] = acc[mt][nt][e];
            }
    gp_cluster_sync();
    const unsigned base = (unsigned)__cvta_generic_to_shared(ps);
    const int total = M * R, lo = (int)((long long)total * rank / S), hi_ = (int)((long long)total * (rank + 1) / S);
    for (int idx = lo + tid; idx < hi_; idx += GP_MMA_WARPS * 32) {
        const int m = idx / R, rl = idx - m * R, r = row0 + rl;
        if (r >= N) continue;
        const unsigned off = base + 4u * (unsigned)(m * (R + 4) + rl);
        float v = 0.f;
        for (int s = 0; s < S; ++s) v += gp_ld_cluster(off, s);
        if (bias) v += bias[r];
        float* yp = y + (long long)m * N + r;
        *yp = accumulate ? *yp + v : v;
    }
    gp_cluster_sync();  // no CTA leaves while another still reads its shared memory
}

// grid (S, ceil(N / (128 * mt)), 1) launched as clusters of (S, 1, 1) (none when S = 1), 256
// threads, dynamic shared memory int4_batched.mma_shared_bytes(); one entry per n-tile count NT
// (from M: registers are allocated per entry, and one entry for all would spill), mt and S from
// the launcher (int4_batched.mma_tiles).
template <int NT, int G, bool MT2>
__device__ __forceinline__ void gp_i4mma_entry(float* y, const float* __restrict__ x,
                                               const unsigned char* __restrict__ packed,
                                               const unsigned short* __restrict__ scales,
                                               const float* __restrict__ bias, int M, int N, int K,
                                               int accumulate, int mt) {
    extern __shared__ __align__(16) unsigned char gp_i4_smem[];
    const unsigned* w = reinterpret_cast<const unsigned*>(packed);
    if (MT2 && mt == 2)
        gp_i4mma<MT2 ? 2 : 1, NT, G>(y, x, w, scales, bias, M, N, K, accumulate, gp_i4_smem);
    else
        gp_i4mma<1, NT, G>(y, x, w, scales, bias, M, N, K, accumulate, gp_i4_smem);
}
#define GP_I4MMA_ARGS                                                                               \
    float *y, const float *__restrict__ x, const unsigned char *__restrict__ packed,                \
        const unsigned short *__restrict__ scales, const float *__restrict__ bias, int M, int N,    \
        int K, int accumulate, int mt
#define GP_I4MMA_PASS y, x, packed, scales, bias, M, N, K, accumulate, mt

extern "C" __global__ void __launch_bounds__(256, 1) gp_int4_mma_n1(GP_I4MMA_ARGS) {  // M 1..8
    gp_i4mma_entry<1, 2, true>(GP_I4MMA_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 1) gp_int4_mma_n2(GP_I4MMA_ARGS) {  // M 9..16
    gp_i4mma_entry<2, 2, true>(GP_I4MMA_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 1) gp_int4_mma_n4(GP_I4MMA_ARGS) {
    gp_i4mma_entry<4, 1, false>(GP_I4MMA_PASS);
}
// M 17..64: one 16-row weight tile per warp (two would spill)
extern "C" __global__ void __launch_bounds__(256, 1) gp_int4_mma_n8(GP_I4MMA_ARGS) {
    gp_i4mma_entry<8, 1, false>(GP_I4MMA_PASS);
}
