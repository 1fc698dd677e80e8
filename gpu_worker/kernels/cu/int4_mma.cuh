#pragma once
// The int4 tensor-core kernels' shared pieces (int4_batched.cu: the weight as the mma's A
// operand; int4_xa.cu: x as A): fp16x2 arithmetic, the m16n8k16 mma and the LOP3 of the fp16
// magics, and the K split's sum over a cluster (int4_xa.cu, int4_wgmma.cu). Every int4 linear's
// contract is reference.int4_matmul's (int4_batched.py).
#include "gpuplane_common.cuh"
#define GP_MMA_WARPS 8

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

// (w & mask) | magic, one LOP3.
__device__ __forceinline__ unsigned gp_lop(unsigned w, unsigned mask, unsigned magic) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(w), "r"(mask), "r"(magic));
    return r;
}

// ---- K split over a thread-block cluster (gp_int4_mma_xa) ------------------------------------
// S CTAs of a cluster each sum a contiguous 1/S of K; their partials meet through distributed
// shared memory, summed in rank order (deterministic, no workspace, no atomics).

// Split K's last step, for S CTAs of a cluster whose partials are in shared memory (window
// address `base`) as [m][row] with a stride of `ps` floats: rank q sums its 1/S of the M x bn
// outputs over ranks 0..S-1 in rank order (deterministic) and writes y (+ bias, + y). Every
// thread of every CTA of the cluster calls it; it begins and ends with a cluster barrier.
// Latency: a thread takes GP_SUM_OUTPUTS outputs at a time and issues all their S remote loads
// (and y's, when accumulating) before its first add, so it waits one DSMEM round trip (~200
// cycles) a group, not one a partial: with a load and its add in turn, wo at 64 rows and split 6
// waited 32 round trips a thread. The sum's order, and so its bits, are unchanged.
#define GP_SUM_OUTPUTS 4
#define GP_SUM_MAX_SPLIT 8   // int4_batched.MAX_SPLIT: the portable cluster size
__device__ __noinline__ void gp_cluster_sum_store(float* y, const float* __restrict__ bias, int M,
                                                  int N, int row0, int bn, int ps, int accumulate,
                                                  unsigned base, int rank, int S) {
    gp_cluster_sync();
    const int total = M * bn, step = (int)blockDim.x;
    const int lo = (int)((long long)total * rank / S), hi = (int)((long long)total * (rank + 1) / S);
    for (int i0 = lo + (int)threadIdx.x; i0 < hi; i0 += GP_SUM_OUTPUTS * step) {
        float part[GP_SUM_OUTPUTS][GP_SUM_MAX_SPLIT], prev[GP_SUM_OUTPUTS];
        float* yp[GP_SUM_OUTPUTS];
        int r[GP_SUM_OUTPUTS];
#pragma unroll
        for (int u = 0; u < GP_SUM_OUTPUTS; ++u) {   // every load of the group first
            const int idx = i0 + u * step, m = idx / bn, rl = idx - m * bn;
            r[u] = idx < hi && row0 + rl < N ? row0 + rl : -1;
            yp[u] = y + (long long)m * N + row0 + rl;
            const unsigned off = base + 4u * (unsigned)(m * ps + rl);
#pragma unroll
            for (int s = 0; s < GP_SUM_MAX_SPLIT; ++s)
                part[u][s] = r[u] >= 0 && s < S ? gp_ld_cluster(off, s) : 0.f;
            prev[u] = r[u] >= 0 && accumulate ? *yp[u] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < GP_SUM_OUTPUTS; ++u) {
            if (r[u] < 0) continue;
            float v = 0.f;
#pragma unroll
            for (int s = 0; s < GP_SUM_MAX_SPLIT; ++s)
                if (s < S) v += part[u][s];
            if (bias) v += bias[r[u]];
            *yp[u] = accumulate ? prev[u] + v : v;
        }
    }
    gp_cluster_sync();  // no CTA leaves while another still reads its shared memory
}
