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
// The decode split's builds (decode_attention_bench --cuda-core / --build time them in one run)
#ifndef GP_FD_MMA
#define GP_FD_MMA 1  // head_dim 64 and 128 on the tensor-core block (0: the lane-group block)
#endif
#ifndef GP_FD_QK_CHAINS
#define GP_FD_QK_CHAINS 1  // tensor-core block: S^T's D / 16 products as 1 or 2 accumulator chains
#endif
#ifndef GP_FD_PLO
#define GP_FD_PLO 1  // tensor-core block: P as fp16 hi + lo terms (0: hi only, one PV product a tile)
#endif
#ifndef GP_FD_TILE_ROWS
#define GP_FD_TILE_ROWS 0  // split kernel's tensor-core block: 1: a 16-key tile's rows from one table lookup
#endif
#ifndef GP_FD_EARLY
#define GP_FD_EARLY 1  // paged, tensor-core block: first K/V tile loaded before the dependent-launch wait (0: after)
#endif
// the split block's shared floats at any head_dim: NGRP * HPB * (D + 2), NGRP = 128 / (D / 8),
// largest at head_dim 16 (64 groups)
#define GP_FD_SMEM (64 * GP_FD_HPB * 2 + GP_FD_THREADS * 8 * GP_FD_HPB)

// The query heads one decode block serves: head block `index` (a grid coordinate) is KV head hk's
// head group hg, query heads h0 .. h0 + nh - 1 (up to GP_FD_HPB of the KV head's group).
struct gp_head_block {
    int hk, h0, nh;
};
__device__ __forceinline__ gp_head_block gp_decode_heads(int index, int heads, int kv_heads) {
    const int group = heads / kv_heads, hgroups = (group + GP_FD_HPB - 1) / GP_FD_HPB;
    const int hk = index / hgroups, hg = index % hgroups;
    return {hk, hk * group + hg * GP_FD_HPB, min(GP_FD_HPB, group - hg * GP_FD_HPB)};
}

__device__ __forceinline__ unsigned gp_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, asynchronously; bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void gp_cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
// 8 bytes global -> shared, asynchronously (through L1: cp.async.cg takes 16 only).
__device__ __forceinline__ void gp_cp_async8(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void gp_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void gp_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// 16 bytes of shared memory (volatile: never hoisted above the mbarrier wait that guards them)
__device__ __forceinline__ uint4 gp_lds128(unsigned addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr) : "memory");
    return r;
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
    __device__ __forceinline__ long long row_step() const { return stride; }
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
    // rows j .. j + 15 of a tile that starts at a multiple of 16 lie in one block (block_tokens
    // >= 16): row j + x is row(j) + x * row_step()
    __device__ __forceinline__ long long row_step() const { return slot_stride; }
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

// The split's partial state from NGRP groups' states in shared memory (sm_m[NGRP][HPB],
// sm_l[NGRP][HPB], sm_acc[NGRP][HPB][D], scores in log2 units): merged in group order into
// ws (natural-unit max, sum, acc: reference.attention_partial) for the block's nh heads.
template <int D, int NGRP>
__device__ __forceinline__ void gp_fd_merge_groups(float* __restrict__ ws, int nh,
                                                   int ws_stride_head, const float* smem) {
    const float (*sm_m)[GP_FD_HPB] = reinterpret_cast<const float (*)[GP_FD_HPB]>(smem);
    const float (*sm_l)[GP_FD_HPB] = reinterpret_cast<const float (*)[GP_FD_HPB]>(smem + NGRP * GP_FD_HPB);
    const float (*sm_acc)[GP_FD_HPB][D] =
        reinterpret_cast<const float (*)[GP_FD_HPB][D]>(smem + 2 * NGRP * GP_FD_HPB);
    for (int idx = threadIdx.x; idx < nh * D; idx += blockDim.x) {
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

// The combine of one (row, query head): out (fp16, D dims) = sum_s e^(m_s - M) acc_s / sum_s
// e^(m_s - M) l_s over the `ran` split states at part (a split every D + 2 floats: natural-unit
// max, sum, acc[D]); a state with l = 0 (an empty split) weighs nothing, and no state at all is
// zeros. The states are contiguous, so the block stages all of them into shared memory with
// 8-byte cp.async (part 8-byte aligned) and waits once: one L2 round trip at any split count,
// and no registers held for it (a walk over the splits with a few loads in flight costs an L2
// latency per few splits: at 64 splits, microseconds; loads held in registers cost the
// combine its blocks per SM where the batch is large). Then each warp takes the max over the
// staged maxima itself, thread s < ran writes split s's weight, and thread d sums dim d over
// the splits in split order. st: dynamic shared memory of decode_combine_shared_bytes floats
// (ran * (D + 2), then 128 weights); ran <= 128.
template <int D>
__device__ __forceinline__ void gp_fd_combine(unsigned short* __restrict__ out,
                                              const float* __restrict__ part, int ran,
                                              float* __restrict__ st) {
    constexpr int W = D + 2;
    const int tid = threadIdx.x, lane = tid & 31, pairs = ran * W / 2;
    const unsigned base = gp_smem(st);
    for (int i = tid; i < pairs; i += blockDim.x) gp_cp_async8(base + 8 * i, part + 2 * i);
    gp_cp_async_commit();
    gp_cp_async_wait<0>();
    __syncthreads();
    float mx = -INFINITY;
    for (int s = lane; s < ran; s += 32) mx = fmaxf(mx, st[s * W]);
    mx = gp_warp_max(mx);
    float* w_s = st + ran * W;
    for (int s = tid; s < ran; s += blockDim.x)
        w_s[s] = mx != -INFINITY && st[s * W + 1] > 0.f ? expf(st[s * W] - mx) : 0.f;
    __syncthreads();
    for (int d = tid; d < D; d += blockDim.x) {
        float l = 0.f, o = 0.f;
#pragma unroll 8
        for (int s = 0; s < ran; ++s) {
            const float w = w_s[s];
            l = fmaf(st[s * W + 1], w, l);
            o = fmaf(st[s * W + 2 + d], w, o);
        }
        out[d] = gp_f2h(l > 0.f ? o / l : 0.f);
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
    gp_fd_merge_groups<D, NGRP>(ws, nh, ws_stride_head, smem);
}


// N 16-byte chunks of key row `row` (halves off + stride * i) into dst; zeros where the row is at
// or past j1 or is `skip`, which are never addressed.
template <int N, class KV>
__device__ __forceinline__ void gp_fd_load_row(uint4 (&dst)[N], const KV& kv, int row, int j1,
                                               int skip, int off, int stride) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = make_uint4(0u, 0u, 0u, 0u);
    if (row < j1 && row != skip) {
        const unsigned short* p = kv.row(row) + off;
#pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = *reinterpret_cast<const uint4*>(p + stride * i);
    }
}

// N 16-byte chunks at p + stride * i (halves) into dst where `ok`, else zeros (never addressed).
template <int N>
__device__ __forceinline__ void gp_fd_load_at(uint4 (&dst)[N], const unsigned short* p, bool ok,
                                              int stride) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = make_uint4(0u, 0u, 0u, 0u);
    if (ok) {
#pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = *reinterpret_cast<const uint4*>(p + stride * i);
    }
}

// The TMA ring's V chunk of lane group g (and the dims 8 pi(g) .. + 8 of its O rows): g / 2 + 4 (g & 1)
__device__ __forceinline__ int gp_fd_v_chunk(int g) { return (g >> 1) | ((g & 1) << 2); }

// A warp's ring of K/V tiles in shared memory (gp_fd_split_block_mma's RING), filled one of two
// ways:
// - bulk copies (TMA false): lane l copies row l % 16 of K (l < 16) or V, 2D bytes, by a 1-D
//   bulk copy. A slot holds 16 K rows of KS bytes, then 16 V rows of VS bytes; the pad after a
//   row's 2D bytes puts the rows a fragment load reads together in different banks (K: rows g and
//   g + 1 of a quarter-warp 64 bytes apart mod 128; V: rows t .. t + 3 32 bytes apart);
// - the TMA unit (TMA true): lane 0 copies the tile as D / 64 boxes of K then of V, each 64 dims
//   x 16 rows, 128-byte swizzled, from the pool's tensor map (gp_fd_pool_map); a slot is 1 KiB
//   aligned. Chunk c of row r of a box lies at 16 (c ^ (r % 8)): lane (g, t) reads K's chunk
//   2t + (i & 1) of box i / 2 (Q the same dims) and V's chunk pi(g) = g / 2 + 4 (g & 1), so a
//   quarter-warp's rows land in 8 different 16-byte bank groups.
// The slots of warp w follow those of warps 0 .. w - 1; the mbarriers (8 bytes a slot) follow
// all slots. Slot s's i-th fill completes phase i of its mbarrier (the warp's tile i is in slot
// i % RING, parity (i / RING) & 1).
template <int D, bool TMA>
struct gp_fd_ring_shape {
    static constexpr int KS = 2 * D + 64, VS = 2 * D + 32;   // bulk: bytes a K / V row
    static constexpr int BOX = 2048;                          // TMA: 64 dims x 16 rows of fp16
    static constexpr int SLOT = TMA ? 2 * (D / 64) * BOX : 16 * (KS + VS);
};
// the ring's bytes (TMA: from a 1 KiB aligned start, up to 1 KiB past the kernel's dynamic base)
template <int D, bool TMA>
__host__ __device__ constexpr int gp_fd_ring_bytes(int warps, int ring) {
    return warps * ring * (gp_fd_ring_shape<D, TMA>::SLOT + 8) + (TMA ? 1024 : 0);
}

// Where a paged tile's TMA boxes come from: the pool's map (dims, KV heads, a block's rows,
// 2 layer + K/V, blocks; paged_attention.pool_tensor_map) and this CTA's head, layer and table.
struct gp_fd_pool_map {
    const GpTmap* map;
    const int* table;
    int shift, mask, hk, layer;
};

template <int D, int RING, bool TMA>
struct gp_fd_ring_warp {
    using shape = gp_fd_ring_shape<D, TMA>;
    static constexpr int KS = shape::KS, VS = shape::VS, SLOT = shape::SLOT, BOX = shape::BOX;
    unsigned slots, bars;   // this warp's first slot and first mbarrier
    __device__ __forceinline__ gp_fd_ring_warp(unsigned ring, int nw, int warp)
        : slots((TMA ? (ring + 1023u) & ~1023u : ring) + warp * RING * SLOT),
          bars((TMA ? (ring + 1023u) & ~1023u : ring) + nw * RING * SLOT + warp * RING * 8) {}
    // recomputed where used: one register fewer across the split's loop
    __device__ __forceinline__ static int lane_id() { return threadIdx.x & 31; }
    __device__ __forceinline__ void init() const {
        if (lane_id() < RING) gp_mbar_init(bars + 8 * lane_id());
        gp_fence_mbar_init();
        __syncwarp();
    }
    // bulk: lane's row (l % 16 of K, l < 16, or V) of the tile at n0 into slot s
    template <class KV>
    __device__ __forceinline__ void copy_row(const KV& k, const KV& v, int n0, int s) const {
        const int lane = lane_id(), r = lane & 15;
        const KV& kv = lane < 16 ? k : v;
        gp_bulk_copy(slots + s * SLOT + (lane < 16 ? r * KS : 16 * KS + r * VS),
                     kv.row(n0) + r * kv.row_step(), 2 * D, bars + 8 * s);
    }
    // TMA: the whole tile at n0 into slot s, by lane 0
    __device__ __forceinline__ void copy_tile(const gp_fd_pool_map& pm, int n0, int s) const {
        if (lane_id() != 0) return;
        const unsigned bar = bars + 8 * s, dst = slots + s * SLOT;
        const int blk = pm.table[n0 >> pm.shift], row = n0 & pm.mask;
        gp_mbar_expect(bar, 2 * (D / 64) * BOX);
#pragma unroll
        for (int b = 0; b < D / 64; ++b) {
            gp_tma_5d(dst + b * BOX, pm.map, 64 * b, pm.hk, row, 2 * pm.layer, blk, bar);
            gp_tma_5d(dst + (D / 64 + b) * BOX, pm.map, 64 * b, pm.hk, row, 2 * pm.layer + 1, blk, bar);
        }
    }
    // The tile at n0 (nothing where n0 >= j1) into slot s, all but key `skip` (-1: none), which
    // issue_late copies after the dependent-launch wait: bulk, its rows (rows from j1 on are not
    // copied); TMA, its whole tile. REFILL: the slot was read through the generic proxy, by every
    // lane: their reads come before its new bytes.
    template <class KV>
    __device__ __forceinline__ void issue(const KV& k, const KV& v, const gp_fd_pool_map& pm, int n0,
                                         int j1, int s, int skip, bool refill = false) const {
        if (n0 >= j1) return;
        if (refill) { __syncwarp(); gp_fence_proxy_async(); }
        if constexpr (TMA) {
            if (skip < n0 || skip >= n0 + 16) copy_tile(pm, n0, s);
        } else {
            const int lane = lane_id(), row = n0 + (lane & 15);
            if (lane == 0) gp_mbar_expect(bars + 8 * s, min(16, j1 - n0) * 4 * D);
            __syncwarp();   // the phase's bytes expected before any arrive
            if (row < j1 && row != skip) copy_row(k, v, n0, s);
        }
    }
    // key `late` of the tile at n0 in slot s: what issue left out
    template <class KV>
    __device__ __forceinline__ void issue_late(const KV& k, const KV& v, const gp_fd_pool_map& pm,
                                              int n0, int s, int late) const {
        if constexpr (TMA) copy_tile(pm, n0, s);
        else if (n0 + (lane_id() & 15) == late) copy_row(k, v, n0, s);
    }
    // slot s's tile at n0 (phase `parity`) into the split block's registers: the chunks each lane
    // would load from global memory (bulk), or the TMA build's dims (above); V rows from j1 on
    // are zeros (their P is 0, and 0 x stale bits may be NaN; K rows there are never used)
    __device__ __forceinline__ void fetch(uint4 (&ka)[D / 32], uint4 (&kb)[D / 32], uint4 (&vv)[4][D / 64],
                                          int s, unsigned parity, int n0, int j1) const {
        gp_mbar_wait(bars + 8 * s, parity);
        const int lane = lane_id(), g = lane >> 2, t = lane & 3;
        const unsigned base = slots + s * SLOT;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) {
            if constexpr (TMA) {
                const unsigned box = base + (i >> 1) * BOX + ((((2 * t + (i & 1)) ^ g)) << 4);
                ka[i] = gp_lds128(box + g * 128);
                kb[i] = gp_lds128(box + (g + 8) * 128);
            } else {
                ka[i] = gp_lds128(base + g * KS + 64 * i + 16 * t);
                kb[i] = gp_lds128(base + (g + 8) * KS + 64 * i + 16 * t);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = t + (r & 1) * 8 + (r >> 1) * 4;
#pragma unroll
            for (int c = 0; c < D / 64; ++c) {
                if constexpr (TMA)
                    vv[r][c] = gp_lds128(base + (D / 64 + c) * BOX + row * 128
                                         + ((gp_fd_v_chunk(g) ^ (row & 7)) << 4));
                else
                    vv[r][c] = gp_lds128(base + 16 * KS + row * VS + 128 * c + 16 * g);
            }
        }
        if (n0 + 16 > j1) {   // the row's last tile: its V rows from j1 on
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < D / 64; ++c)
                    if (n0 + t + (r & 1) * 8 + (r >> 1) * 4 >= j1) vv[r][c] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
};
// RING 0: nothing
template <int D, bool TMA>
struct gp_fd_ring_warp<D, 0, TMA> {
    __device__ __forceinline__ gp_fd_ring_warp(unsigned, int, int) {}
};

// The same split on tensor cores (head_dim D = 64 or 128): the block's 4 warps take 16-key
// tiles w, w + 4, ... of [j0, j1), each with its own online softmax, merged at the end like the
// lane groups above. Per tile, two m16n8k16 products with the keys and the head dims on the
// 16-row side and the block's heads on the 8-column side (4 used):
//   S^T (16 keys x 8 heads)  = K (16 keys x D)   . Q^T (D x 8 heads)
//   O^T (D x 8 heads)       += V^T (D x 16 keys) . P^T (16 keys x 8 heads)
// Both operands come straight from global memory in 16-byte loads, no shared staging:
// - a dot product does not depend on the order of its dims, so K and Q use one permutation:
//   lane (g, t) loads the 16-byte chunks at dims 32i + 8t (i < D / 32) of key rows g and g + 8
//   (of Q: head g), and word r of those (4i + word) is the fragment's k pair of step r / 2;
// - V's A fragment pairs two keys per register: lane (g, t) loads dims 64c + 8g .. + 8 of the
//   tile's keys t, t + 8, t + 4, t + 12 and one PRMT a register pairs them; so the PV product's
//   key k is tile row t, t + 8, t + 4, t + 12 for k = 2t, 2t + 1, 2t + 8, 2t + 9, and O^T's
//   16-row tile (c, word) holds dims 64c + 8g + 2 word (rows g) and + 1 (rows g + 8);
// - P^T's B fragment is S^T's accumulator transposed: 4 shuffles of packed fp16 pairs a tile.
// P is rounded to fp16 for the second product (as in the prefill's tiles); the sums and the
// softmax state stay fp32, scores are scaled after the product (Q is not pre-scaled).
// Keys past j1 are neither addressed nor loaded (zeros, their scores -inf, so P = 0).
//
// EARLY (a kernel launched with dependent launch that has not waited yet): each warp's first
// tile of K and V is loaded before gp_pdl_wait, all but key `fresh` (the row's newest, which the
// kernel before it, the rope + append, writes); that key and Q are read after the wait.
//
// NW: the block's warps (GP_FD_THREADS / 32, or the cluster decode's GP_FDC_WARPS); smem holds
// 2 * NW * GP_FD_HPB + NW * GP_FD_HPB * D floats. ws may be shared memory (the cluster decode).
// ROWS: a tile's 16 rows from one table lookup (KV::row_step; j0 a multiple of 16) instead of
// one a row: the same loads and bits, fewer instructions on the warp's serial chain.
// RING (> 0: ROWS, sm_90; the cluster decode's GP_FDC_RING): a warp's tiles come through RING
// slots of shared memory at `ring` (gp_fd_ring_bytes<D, TMA>(NW, RING)), so its next RING tiles
// are in flight while it works on one, without their registers (gp_fd_ring_warp): by 1-D bulk
// copies (the values the loads would bring, so the loads' bits) or, TMA (GP_FDC_TMA), by the
// TMA unit from `pm` (its own dims order, so its own bits).
// PAIR (RING even; the cluster decode's GP_FDC_PAIR): two of the warp's tiles a step, their
// S^T chains interleaved and one softmax update for both (more independent work between a
// warp's waits; the sums' order differs, so its own bits).
template <int D, bool EARLY, class KV, int NW = GP_FD_THREADS / 32, bool ROWS = GP_FD_TILE_ROWS != 0,
          int RING = 0, bool TMA = false, bool PAIR = false>
__device__ __forceinline__ void gp_fd_split_block_mma(
        float* __restrict__ ws, const unsigned short* __restrict__ q, const KV& k, const KV& v,
        int nh, int j0, int j1, float scale_log2, int ws_stride_head, float* smem, int fresh,
        unsigned ring = 0, const gp_fd_pool_map& pm = {}) {
    static_assert(D == 64 || D == 128, "tensor-core decode split: head_dim 64 or 128");
    static_assert(RING == 0 || ROWS, "a ring of tiles: a tile's rows from one lookup (ROWS)");
    static_assert(!PAIR || (RING > 0 && RING % 2 == 0), "two tiles a step: an even ring (RING)");
    constexpr int KC = D / 32, VC = D / 64, MT = D / 16;
    float (*sm_m)[GP_FD_HPB] = reinterpret_cast<float (*)[GP_FD_HPB]>(smem);
    float (*sm_l)[GP_FD_HPB] = reinterpret_cast<float (*)[GP_FD_HPB]>(smem + NW * GP_FD_HPB);
    float (*sm_acc)[GP_FD_HPB][D] = reinterpret_cast<float (*)[GP_FD_HPB][D]>(smem + 2 * NW * GP_FD_HPB);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // heads 2t, 2t + 1
    uint4 ka[KC], kb[KC], vv[4][VC];
    // The tile at n0: K rows n0 + g (ka), n0 + g + 8 (kb) and V rows n0 + t, + 8, + 4, + 12
    // (vv[0..3]); a row at or past j1 is zeros, never addressed, and so is row `skip` (-1: none).
    auto load_k = [&](uint4 (&dst)[KC], int row, int skip) { gp_fd_load_row(dst, k, row, j1, skip, 8 * t, 32); };
    auto load_v = [&](uint4 (&dst)[VC], int row, int skip) { gp_fd_load_row(dst, v, row, j1, skip, 8 * g, 64); };
    auto vrow = [&](int n0, int r) { return n0 + t + (r & 1) * 8 + (r >> 1) * 4; };
    // ROWS: one table lookup a tile (n0 is a multiple of 16: j0 is, and tiles step by 16)
    auto load = [&](int n0, int skip) {
        if constexpr (ROWS) {
            const bool any = n0 < j1;
            const unsigned short* kt = any ? k.row(n0) : k.base;
            const unsigned short* vt = any ? v.row(n0) : v.base;
            const long long step = k.row_step();
            auto ok = [&](int row) { return row < j1 && row != skip; };
            gp_fd_load_at(ka, kt + g * step + 8 * t, ok(n0 + g), 32);
            gp_fd_load_at(kb, kt + (g + 8) * step + 8 * t, ok(n0 + g + 8), 32);
#pragma unroll
            for (int r = 0; r < 4; ++r)
                gp_fd_load_at(vv[r], vt + (vrow(n0, r) - n0) * step + 8 * g, ok(vrow(n0, r)), 64);
        } else {
            load_k(ka, n0 + g, skip);
            load_k(kb, n0 + g + 8, skip);
#pragma unroll
            for (int r = 0; r < 4; ++r) load_v(vv[r], vrow(n0, r), skip);
        }
    };
    const int first = j0 + 16 * warp;
    const gp_fd_ring_warp<D, RING, TMA> rw(ring, NW, warp);
    if constexpr (RING > 0) {
        // the warp's first RING tiles, all but key `fresh` before the dependent-launch wait
        const int late = EARLY && fresh < j1 ? fresh : -1;
        rw.init();
#pragma unroll
        for (int s = 0; s < RING; ++s) rw.issue(k, v, pm, first + 16 * NW * s, j1, s, late);
        if (EARLY) {
            gp_pdl_wait();
            gp_pdl_release();
            const int d = late - first;   // the newest key's tile among the first RING
            if (late >= first && d % (16 * NW) < 16 && d / (16 * NW) < RING)
                rw.issue_late(k, v, pm, late - d % (16 * NW), d / (16 * NW), late);
        }
    } else if (EARLY) {
        const int late = fresh < j1 ? fresh : -1;  // the newest key, if this split holds it
        if (first < j1) load(first, late);
        gp_pdl_wait();  // q and key `fresh` are the previous kernel's writes
        gp_pdl_release();
        if (late >= first && late < first + 16) {  // that key's K and V rows, now written
            if (first + g == late) load_k(ka, late, -1);
            if (first + g + 8 == late) load_k(kb, late, -1);
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (vrow(first, r) == late) load_v(vv[r], late, -1);
        }
    }
    unsigned qb[2 * KC * 2];  // Q^T's B fragments: step s uses words 2s, 2s + 1
#pragma unroll
    for (int i = 0; i < KC; ++i) {
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);
        // the dims of K's chunk i (TMA: chunk 2t + (i & 1) of 64-dim box i / 2)
        const int dim = TMA ? 64 * (i >> 1) + 8 * (2 * t + (i & 1)) : 32 * i + 8 * t;
        if (g < nh) raw = *reinterpret_cast<const uint4*>(q + g * D + dim);
        qb[4 * i] = raw.x; qb[4 * i + 1] = raw.y; qb[4 * i + 2] = raw.z; qb[4 * i + 3] = raw.w;
    }
    // S^T of the tile at n0 from its K fragments: (key g, head 2t), (key g, 2t + 1),
    // (key g + 8, 2t), (key g + 8, 2t + 1), scaled; keys from j1 on are -inf
    // (GP_FD_QK_CHAINS 2: even and odd steps into two accumulators, added at the end: half the
    // chain of dependent products, another order of the sums)
    auto scores = [&](float (&s)[4], const uint4 (&xa)[KC], const uint4 (&xb)[KC], int n0) {
        float s1[4] = {0.f, 0.f, 0.f, 0.f};
        s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
        for (int st = 0; st < D / 16; ++st) {
            const uint4& x = xa[st / 2];
            const uint4& y = xb[st / 2];
            const unsigned a[4] = {st & 1 ? x.z : x.x, st & 1 ? y.z : y.x,
                                   st & 1 ? x.w : x.y, st & 1 ? y.w : y.y};
            gp_mma16816(GP_FD_QK_CHAINS == 2 && (st & 1) ? s1 : s, a, qb[2 * st], qb[2 * st + 1]);
        }
        if (GP_FD_QK_CHAINS == 2) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[e] += s1[e];
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            s[j] = n0 + g < j1 ? s[j] * scale_log2 : -INFINITY;
            s[2 + j] = n0 + g + 8 < j1 ? s[2 + j] * scale_log2 : -INFINITY;
        }
    };
    // the online softmax over one tile's scores (two false) or two tiles' (s2): m, l and the
    // accumulator rescaled once, the scores turned into P in place (`two` is a constant at
    // every call: the branches fold)
    auto softmax = [&](float (&s)[4], float (&s2)[4], bool two) {
        float corr[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float mx = fmaxf(s[j], s[2 + j]);
            if (two) mx = fmaxf(mx, fmaxf(s2[j], s2[2 + j]));
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mn = fmaxf(m[j], mx);  // finite: the first tile's key n0 < j1
            corr[j] = gp_exp2(m[j] - mn);
            s[j] = gp_exp2(s[j] - mn);
            s[2 + j] = gp_exp2(s[2 + j] - mn);
            float add = s[j] + s[2 + j];
            if (two) {
                s2[j] = gp_exp2(s2[j] - mn);
                s2[2 + j] = gp_exp2(s2[2 + j] - mn);
                add += s2[j] + s2[2 + j];
            }
            l[j] = l[j] * corr[j] + add;
            m[j] = mn;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            acc[mt][0] *= corr[0]; acc[mt][2] *= corr[0];
            acc[mt][1] *= corr[1]; acc[mt][3] *= corr[1];
        }
    };
    // O^T += V^T . P^T for one tile's P (s) and V fragments. P^T's B fragments of lane (g, t):
    // head g at keys (t, t + 8) and (t + 4, t + 12), held by lanes (t, g / 2) and (t + 4, g / 2)
    // as the packed pair of their column g % 2. P is two fp16 terms, hi = fp16(p) and lo =
    // fp16(p - hi) (p to ~22 bits: the unnormalised partial sums keep the lane-group block's f32
    // accuracy), so PV is two products.
    auto accumulate = [&](const float (&s)[4], const uint4 (&xv)[4][VC]) {
        const int src0 = 4 * t + (g >> 1), src1 = 4 * (t + 4) + (g >> 1);
        unsigned bh[2], bl[2];
        {
            const unsigned h0 = gp_pack_h2(s[0], s[2]), h1 = gp_pack_h2(s[1], s[3]);
            // a sender serves heads 2t'' and 2t'' + 1 (both columns): the receiver picks g % 2
            const unsigned xh0 = __shfl_sync(0xffffffffu, h0, src0), xh1 = __shfl_sync(0xffffffffu, h1, src0);
            const unsigned yh0 = __shfl_sync(0xffffffffu, h0, src1), yh1 = __shfl_sync(0xffffffffu, h1, src1);
            bh[0] = g & 1 ? xh1 : xh0; bh[1] = g & 1 ? yh1 : yh0;
#if GP_FD_PLO
            const unsigned l0 = gp_pack_h2(s[0] - gp_h2f_lo(h0), s[2] - gp_h2f_hi(h0));
            const unsigned l1 = gp_pack_h2(s[1] - gp_h2f_lo(h1), s[3] - gp_h2f_hi(h1));
            const unsigned xl0 = __shfl_sync(0xffffffffu, l0, src0), xl1 = __shfl_sync(0xffffffffu, l1, src0);
            const unsigned yl0 = __shfl_sync(0xffffffffu, l0, src1), yl1 = __shfl_sync(0xffffffffu, l1, src1);
            bl[0] = g & 1 ? xl1 : xl0; bl[1] = g & 1 ? yl1 : yl0;
#else
            bl[0] = bl[1] = 0u;
#endif
        }
#pragma unroll
        for (int c = 0; c < VC; ++c) {
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const unsigned* r0 = reinterpret_cast<const unsigned*>(&xv[0][c]);
                const unsigned* r1 = reinterpret_cast<const unsigned*>(&xv[1][c]);
                const unsigned* r2 = reinterpret_cast<const unsigned*>(&xv[2][c]);
                const unsigned* r3 = reinterpret_cast<const unsigned*>(&xv[3][c]);
                const unsigned a[4] = {__byte_perm(r0[w], r1[w], 0x5410), __byte_perm(r0[w], r1[w], 0x7632),
                                       __byte_perm(r2[w], r3[w], 0x5410), __byte_perm(r2[w], r3[w], 0x7632)};
                gp_mma16816(acc[4 * c + w], a, bh[0], bh[1]);
                if (GP_FD_PLO) gp_mma16816(acc[4 * c + w], a, bl[0], bl[1]);
            }
        }
    };
    // one tile: S^T, the online softmax, O^T (the tile's K and V already loaded)
    auto tile = [&](int n0) {
        float s[4];
        scores(s, ka, kb, n0);
        softmax(s, s, false);
        accumulate(s, vv);
    };
    if constexpr (RING > 0 && PAIR) {
        // two tiles an iteration (slots i % RING and i % RING + 1, one ring round: RING even):
        // their two S^T chains interleave, and the softmax's max, shuffles and rescale are paid
        // once for 32 keys (the order of the sums differs from one tile a step: its own bits)
        uint4 ka2[KC], kb2[KC], vv2[4][VC];
        int i = 0;
        for (int n0 = first; n0 < j1; n0 += 32 * NW, i += 2) {
            const int s0 = i % RING, n1 = n0 + 16 * NW;
            const unsigned parity = (i / RING) & 1;
            rw.fetch(ka, kb, vv, s0, parity, n0, j1);
            rw.issue(k, v, pm, n0 + 16 * NW * RING, j1, s0, -1, true);
            float sa[4], sb[4];
            if (n1 < j1) {
                rw.fetch(ka2, kb2, vv2, s0 + 1, parity, n1, j1);
                rw.issue(k, v, pm, n1 + 16 * NW * RING, j1, s0 + 1, -1, true);
                scores(sa, ka, kb, n0);
                scores(sb, ka2, kb2, n1);
                softmax(sa, sb, true);
                accumulate(sa, vv);
                accumulate(sb, vv2);
            } else {
                scores(sa, ka, kb, n0);
                softmax(sa, sa, false);
                accumulate(sa, vv);
            }
        }
    } else if constexpr (RING > 0) {
        int i = 0;
        for (int n0 = first; n0 < j1; n0 += 16 * NW, ++i) {
            const int s = i % RING;
            rw.fetch(ka, kb, vv, s, (i / RING) & 1, n0, j1);
            rw.issue(k, v, pm, n0 + 16 * NW * RING, j1, s, -1, true);   // the slot's next tile
            tile(n0);
        }
    } else {
        if (EARLY && first < j1) tile(first);
        for (int n0 = EARLY ? first + 16 * NW : first; n0 < j1; n0 += 16 * NW) {
            load(n0, -1);
            tile(n0);
        }
    }
    // l: this lane's keys only; the heads' sums over the tile rows (lanes of the same t)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) l[j] += __shfl_xor_sync(0xffffffffu, l[j], o);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int h = 2 * t + j;
        if (h < nh) {
            if (g == 0) { sm_m[warp][h] = m[j]; sm_l[warp][h] = l[j]; }
#pragma unroll
            for (int c = 0; c < VC; ++c)
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const int d = 64 * c + 8 * (TMA ? gp_fd_v_chunk(g) : g) + 2 * w;
                    sm_acc[warp][h][d] = acc[4 * c + w][j];
                    sm_acc[warp][h][d + 1] = acc[4 * c + w][2 + j];
                }
        }
    }
    __syncthreads();
    gp_fd_merge_groups<D, NW>(ws, nh, ws_stride_head, smem);
}

