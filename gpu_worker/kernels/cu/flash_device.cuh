#pragma once
// Flash attention device helpers and templates: included by flash_attention.cu and
// paged_attention.cu (each compiles them into its own module with its own entry points).
#include "gpuplane_common.cuh"
#define GP_FA_BM 64
#define GP_FA_BN 64
#define GP_FA_MINB 3  // blocks per SM the registers must allow: 3 x 4 warps at <= 168 registers
#define GP_FA_PAD 8
#define GP_FA_LOG2E 1.4426950408889634f
#define GP_FD_HPB 4
#define GP_FD_UNROLL 4
#define GP_FD_THREADS 128
// the split block's shared floats at any head_dim: NGRP * HPB * (D + 2), NGRP = 128 / (D / 8),
// largest at head_dim 16 (64 groups)
#define GP_FD_SMEM (64 * GP_FD_HPB * 2 + GP_FD_THREADS * 8 * GP_FD_HPB)

__device__ __forceinline__ unsigned gp_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, asynchronously; bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void gp_cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void gp_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void gp_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

__device__ __forceinline__ void gp_ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void gp_ldsm_x4_t(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c += a (16x16 fp16, row) * b (16x8 fp16, col), fp32 accumulate.
__device__ __forceinline__ void gp_mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                            unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register of two fp16 (lo in the low half: the lower element index).
__device__ __forceinline__ unsigned gp_pack_h2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ unsigned short gp_f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float gp_h2f_lo(unsigned v) { return gp_half_to_float((unsigned short)(v & 0xffffu)); }
__device__ __forceinline__ float gp_h2f_hi(unsigned v) { return gp_half_to_float((unsigned short)(v >> 16)); }

// 2^x by the SFU (ex2.approx: ~2 ulp; 2^-inf = +0, which masking relies on).
__device__ __forceinline__ float gp_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned gp_ld32(const unsigned short* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Where key j of one KV head lives: rows of a contiguous cache (row j at base + j * stride)...
struct gp_kv_rows {
    const unsigned short* base;
    long long stride;
    __device__ __forceinline__ const unsigned short* row(int j) const {
        return base + (long long)j * stride;
    }
};

// ...or slots of a paged pool: key j in block table[j >> shift], slot j & mask; `base` already
// points at the (layer, K or V, KV head) of block 0 (paged_attention.py has the layout).
struct gp_kv_paged {
    const unsigned short* base;
    const int* __restrict__ table;
    long long block_stride;
    int shift, mask, slot_stride;
    __device__ __forceinline__ const unsigned short* row(int j) const {
        return base + (long long)table[j >> shift] * block_stride + (j & mask) * slot_stride;
    }
};

// Stage keys [n0, n0 + BN) of one KV head into a padded shared tile; rows at or past `kend`
// are zero-filled (their P is 0, and 0 * stale bits could be NaN).
template <int D, int BN, class KV>
__device__ __forceinline__ void gp_fa_stage(unsigned short* tile, const KV& kv, int n0, int kend) {
    constexpr int LD = D + GP_FA_PAD, CHUNKS = D / 8, THREADS = 128;  // the prefill block
    // a compile-time stride, two chunks per step: a paged row's table loads overlap (a full
    // unroll spills the prefill's registers)
#pragma unroll 2
    for (int i = 0; i < BN * CHUNKS / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS;
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8, j = n0 + r;
        const bool in = j < kend;
        gp_cp_async16(gp_smem(tile + r * LD + col), in ? kv.row(j) + col : kv.base, in ? 16 : 0);
    }
}

// S (16 rows x 8*NT keys, fp32) = Q K^T from a staged K tile at shared address ks.
template <int D, int NT>
__device__ __forceinline__ void gp_fa_qk(float (&s)[NT][4], const unsigned (&qf)[D / 16][4],
                                         unsigned ks, int lm, int lr) {
    constexpr int LD = D + GP_FA_PAD;
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned b[4];
            gp_ldsm_x4(b, ks + 2u * ((np * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8));
            gp_mma16816(s[2 * np], qf[kc], b[0], b[1]);
            gp_mma16816(s[2 * np + 1], qf[kc], b[2], b[3]);
        }
    }
}

// Online softmax of one S tile (keys n0..): masks, updates the row state (m in scaled log2
// units, l this thread's share of the row sum), returns the O correction factors and P as the
// A fragments of the P.V mma (the S accumulator layout is the A layout: no shared memory).
template <int NT>
__device__ __forceinline__ void gp_fa_softmax(float (&s)[NT][4], unsigned (&pf)[NT / 2][4],
                                              float& m_lo, float& m_hi, float& l_lo, float& l_hi,
                                              float& corr_lo, float& corr_hi, bool mask, int n0,
                                              int tq, int lim_lo, int lim_hi, float scale_log2) {
    if (mask) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = n0 + nt * 8 + 2 * tq + e;
                if (j >= lim_lo) s[nt][e] = -INFINITY;
                if (j >= lim_hi) s[nt][2 + e] = -INFINITY;
            }
    }
    // Row maxima of the raw scores (scale > 0 commutes with max) by a tree, not a chain:
    // with 3 warps per scheduler a 16-long dependent chain shows up as latency stalls.
    float tl[NT], th[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        tl[nt] = fmaxf(s[nt][0], s[nt][1]);
        th[nt] = fmaxf(s[nt][2], s[nt][3]);
    }
#pragma unroll
    for (int w = NT / 2; w > 0; w >>= 1)
#pragma unroll
        for (int nt = 0; nt < w; ++nt) {
            tl[nt] = fmaxf(tl[nt], tl[nt + w]);
            th[nt] = fmaxf(th[nt], th[nt + w]);
        }
    float mx_lo = tl[0], mx_hi = th[0];
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    // p = 2^(s * scale_log2 - m): one FFMA and one MUFU per score.
    const float mn_lo = fmaxf(m_lo, mx_lo * scale_log2), mn_hi = fmaxf(m_hi, mx_hi * scale_log2);
    // A row that has seen no key yet keeps m = -inf; exponents then use base 0 (no inf - inf).
    const float base_lo = mn_lo == -INFINITY ? 0.f : mn_lo;
    const float base_hi = mn_hi == -INFINITY ? 0.f : mn_hi;
    corr_lo = gp_exp2(m_lo - base_lo);
    corr_hi = gp_exp2(m_hi - base_hi);
    m_lo = mn_lo;
    m_hi = mn_hi;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = gp_exp2(fmaf(s[nt][0], scale_log2, -base_lo));
        s[nt][1] = gp_exp2(fmaf(s[nt][1], scale_log2, -base_lo));
        s[nt][2] = gp_exp2(fmaf(s[nt][2], scale_log2, -base_hi));
        s[nt][3] = gp_exp2(fmaf(s[nt][3], scale_log2, -base_hi));
        tl[nt] = s[nt][0] + s[nt][1];
        th[nt] = s[nt][2] + s[nt][3];
    }
#pragma unroll
    for (int w = NT / 2; w > 0; w >>= 1)
#pragma unroll
        for (int nt = 0; nt < w; ++nt) {
            tl[nt] += tl[nt + w];
            th[nt] += th[nt + w];
        }
    l_lo = l_lo * corr_lo + tl[0];
    l_hi = l_hi * corr_hi + th[0];
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {  // key tiles 2kk, 2kk+1 form one k16 A fragment
        pf[kk][0] = gp_pack_h2(s[2 * kk][0], s[2 * kk][1]);
        pf[kk][1] = gp_pack_h2(s[2 * kk][2], s[2 * kk][3]);
        pf[kk][2] = gp_pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pf[kk][3] = gp_pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// O (16 rows x D, fp32) = O * corr + P V from a staged V tile at shared address vs.
template <int D, int NT>
__device__ __forceinline__ void gp_fa_pv(float (&o)[D / 8][4], const unsigned (&pf)[NT / 2][4],
                                         unsigned vs, int lm, int lr, float corr_lo,
                                         float corr_hi) {
    constexpr int LD = D + GP_FA_PAD;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        o[i][0] *= corr_lo; o[i][1] *= corr_lo;
        o[i][2] *= corr_hi; o[i][3] *= corr_hi;
    }
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            unsigned b[4];
            gp_ldsm_x4_t(b, vs + 2u * ((kk * 16 + (lm & 1) * 8 + lr) * LD + dp * 16 + (lm >> 1) * 8));
            gp_mma16816(o[2 * dp], pf[kk], b[0], b[1]);
            gp_mma16816(o[2 * dp + 1], pf[kk], b[2], b[3]);
        }
    }
}

// One block: 64 query rows [t0, t0 + 64) of one (sequence, head), 4 warps of 16 rows; 64-key
// tiles, one K and one V buffer: V(n) lands during QK(n), K(n+1) during softmax and PV(n).
// Rows at or past `rows_valid` are written zero (a paged prefill chunk's padding rows).
template <int D, class KV>
__device__ __forceinline__ void gp_fa_prefill_block(
        unsigned short* __restrict__ out, const unsigned short* __restrict__ q, const KV& k,
        const KV& v, unsigned short* k_s, unsigned short* v_s, int tokens, int rows_valid, int t0,
        int p, int valid, int causal, long long q_row_stride, long long out_row_stride,
        float scale_log2) {
    constexpr int KC = D / 16, DT = D / 8, BN = GP_FA_BN, NT = BN / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3, lm = lane >> 3, lr = lane & 7;
    const int row_lo = t0 + warp * 16 + g, row_hi = row_lo + 8;
    const int lim_lo = max(0, causal ? min(p + row_lo + 1, valid) : valid);
    const int lim_hi = max(0, causal ? min(p + row_hi + 1, valid) : valid);
    const int kend = max(0, causal ? min(p + t0 + GP_FA_BM, valid) : valid);
    const int kmin = max(0, causal ? min(p + t0 + 1, valid) : valid);  // the block's first row
    const int ntiles = t0 < rows_valid ? (kend + BN - 1) / BN : 0;

    unsigned qf[KC][4];
    {
        const unsigned short* q_lo = q + (long long)row_lo * q_row_stride + 2 * tq;
        const unsigned short* q_hi = q + (long long)row_hi * q_row_stride + 2 * tq;
        const bool in_lo = row_lo < tokens, in_hi = row_hi < tokens;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            qf[kc][0] = in_lo ? gp_ld32(q_lo + kc * 16) : 0u;
            qf[kc][1] = in_hi ? gp_ld32(q_hi + kc * 16) : 0u;
            qf[kc][2] = in_lo ? gp_ld32(q_lo + kc * 16 + 8) : 0u;
            qf[kc][3] = in_hi ? gp_ld32(q_hi + kc * 16 + 8) : 0u;
        }
    }
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
    const unsigned ks = gp_smem(k_s), vs = gp_smem(v_s);

    if (ntiles > 0) { gp_fa_stage<D, BN>(k_s, k, 0, kend); gp_cp_async_commit(); }
    for (int tile = 0; tile < ntiles; ++tile) {
        const int n0 = tile * BN;
        gp_fa_stage<D, BN>(v_s, v, n0, kend);
        gp_cp_async_commit();
        gp_cp_async_wait<1>();  // K(tile) landed (V(tile) may still be in flight)
        __syncthreads();
        float s[NT][4];
        unsigned pf[NT / 2][4];
        float corr_lo, corr_hi;
        gp_fa_qk<D, NT>(s, qf, ks, lm, lr);
        __syncthreads();  // every warp is done with k_s
        const bool more = tile + 1 < ntiles;
        if (more) { gp_fa_stage<D, BN>(k_s, k, n0 + BN, kend); gp_cp_async_commit(); }
        gp_fa_softmax<NT>(s, pf, m_lo, m_hi, l_lo, l_hi, corr_lo, corr_hi, n0 + BN > kmin, n0, tq,
                          lim_lo, lim_hi, scale_log2);
        if (more) gp_cp_async_wait<1>(); else gp_cp_async_wait<0>();  // V(tile) landed
        __syncthreads();
        gp_fa_pv<D, NT>(o, pf, vs, lm, lr, corr_lo, corr_hi);
        __syncthreads();  // every warp is done with v_s before the next tile overwrites it
    }
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const float inv_lo = l_lo > 0.f && row_lo < rows_valid ? 1.f / l_lo : 0.f;
    const float inv_hi = l_hi > 0.f && row_hi < rows_valid ? 1.f / l_hi : 0.f;
    unsigned short* o_lo = out + (long long)row_lo * out_row_stride + 2 * tq;
    unsigned short* o_hi = out + (long long)row_hi * out_row_stride + 2 * tq;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        if (row_lo < tokens)
            *reinterpret_cast<unsigned*>(o_lo + i * 8) = gp_pack_h2(o[i][0] * inv_lo, o[i][1] * inv_lo);
        if (row_hi < tokens)
            *reinterpret_cast<unsigned*>(o_hi + i * 8) = gp_pack_h2(o[i][2] * inv_hi, o[i][3] * inv_hi);
    }
}

// One split of one KV head for up to GP_FD_HPB of its query heads. A lane group of D/8 lanes
// owns a key (a lane: 8 dims, one 16-byte load of K and of V per key).
template <int D, class KV>
__device__ __forceinline__ void gp_fd_split_block(
        float* __restrict__ ws, const unsigned short* __restrict__ q, const KV& k, const KV& v,
        int nh, int j0, int j1, float scale_log2, int ws_stride_head, float* smem) {
    constexpr int LPK = D / 8, KPW = 32 / LPK, NGRP = GP_FD_THREADS / LPK;
    constexpr int STEP = (GP_FD_THREADS / 32) * KPW * GP_FD_UNROLL;
    // smem: GP_FD_SMEM floats, carved per head_dim (one buffer for every instantiation: static
    // __shared__ arrays in a template would be allocated once per instantiation)
    float (*sm_m)[GP_FD_HPB] = reinterpret_cast<float (*)[GP_FD_HPB]>(smem);
    float (*sm_l)[GP_FD_HPB] = reinterpret_cast<float (*)[GP_FD_HPB]>(smem + NGRP * GP_FD_HPB);
    float (*sm_acc)[GP_FD_HPB][D] = reinterpret_cast<float (*)[GP_FD_HPB][D]>(smem + 2 * NGRP * GP_FD_HPB);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = lane % LPK, gw = lane / LPK, grp = tid / LPK;
    float qv[GP_FD_HPB][8], acc[GP_FD_HPB][8], m[GP_FD_HPB], l[GP_FD_HPB];
#pragma unroll
    for (int i = 0; i < GP_FD_HPB; ++i) {
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);
        if (i < nh) raw = *reinterpret_cast<const uint4*>(q + i * D + sub * 8);
        const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            qv[i][2 * e] = gp_h2f_lo(w[e]) * scale_log2;
            qv[i][2 * e + 1] = gp_h2f_hi(w[e]) * scale_log2;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    // The loop bound depends on the warp only: every lane of a warp runs every step (shuffles).
    for (int jw = j0 + warp * KPW * GP_FD_UNROLL; jw < j1; jw += STEP) {
        uint4 kr[GP_FD_UNROLL], vr[GP_FD_UNROLL];
        const int jb = jw + gw * GP_FD_UNROLL;
#pragma unroll
        for (int u = 0; u < GP_FD_UNROLL; ++u) {
            kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
            if (jb + u < j1) {
                kr[u] = *reinterpret_cast<const uint4*>(k.row(jb + u) + sub * 8);
                vr[u] = *reinterpret_cast<const uint4*>(v.row(jb + u) + sub * 8);
            }
        }
        float sc[GP_FD_HPB][GP_FD_UNROLL];  // scores, then their weights e^(s - m)
#pragma unroll
        for (int i = 0; i < GP_FD_HPB; ++i) {
#pragma unroll
            for (int u = 0; u < GP_FD_UNROLL; ++u) {
                const unsigned w[4] = {kr[u].x, kr[u].y, kr[u].z, kr[u].w};
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    d = fmaf(qv[i][2 * e], gp_h2f_lo(w[e]), d);
                    d = fmaf(qv[i][2 * e + 1], gp_h2f_hi(w[e]), d);
                }
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                sc[i][u] = jb + u < j1 ? d : -INFINITY;
            }
            float mx = sc[i][0];
#pragma unroll
            for (int u = 1; u < GP_FD_UNROLL; ++u) mx = fmaxf(mx, sc[i][u]);
            const float mn = fmaxf(m[i], mx);
            const float base = mn == -INFINITY ? 0.f : mn;  // no key yet: no inf - inf
            const float corr = gp_exp2(m[i] - base);
            float ps = 0.f;
#pragma unroll
            for (int u = 0; u < GP_FD_UNROLL; ++u) { sc[i][u] = gp_exp2(sc[i][u] - base); ps += sc[i][u]; }
            l[i] = l[i] * corr + ps;
            m[i] = mn;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[i][e] *= corr;
        }
        // V one key at a time: 8 converted floats live, not 8 per key in flight.
#pragma unroll
        for (int u = 0; u < GP_FD_UNROLL; ++u) {
            const unsigned w[4] = {vr[u].x, vr[u].y, vr[u].z, vr[u].w};
            float vf[8];
#pragma unroll
            for (int e = 0; e < 4; ++e) { vf[2 * e] = gp_h2f_lo(w[e]); vf[2 * e + 1] = gp_h2f_hi(w[e]); }
#pragma unroll
            for (int i = 0; i < GP_FD_HPB; ++i)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[i][e] = fmaf(sc[i][u], vf[e], acc[i][e]);
        }
    }
#pragma unroll
    for (int i = 0; i < GP_FD_HPB; ++i) {
        if (sub == 0) { sm_m[grp][i] = m[i]; sm_l[grp][i] = l[i]; }
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_acc[grp][i][sub * 8 + e] = acc[i][e];
    }
    __syncthreads();
    for (int idx = tid; idx < nh * D; idx += blockDim.x) {
        const int i = idx / D, d = idx % D;
        float mx = -INFINITY;
        for (int gi = 0; gi < NGRP; ++gi) mx = fmaxf(mx, sm_m[gi][i]);
        float lt = 0.f, at = 0.f;
        if (mx != -INFINITY) {
            for (int gi = 0; gi < NGRP; ++gi) {
                const float w = sm_l[gi][i] > 0.f ? gp_exp2(sm_m[gi][i] - mx) : 0.f;
                lt = fmaf(sm_l[gi][i], w, lt);
                at = fmaf(sm_acc[gi][i][d], w, at);
            }
        }
        float* part = ws + (long long)i * ws_stride_head;
        if (d == 0) { part[0] = mx == -INFINITY ? -INFINITY : mx / GP_FA_LOG2E; part[1] = lt; }
        part[2 + d] = at;
    }
}

