"""fp16 attention on tensor cores: a FlashAttention-style prefill and a split-K decode.

Layouts are attention.py's, in fp16 (strides in halves): q row (b, t) at q + (b*tokens + t)*
q_row_stride, head h at + h*head_dim; key j of sequence b at k + b*kv_batch_stride +
j*kv_row_stride, KV head hk at + hk*head_dim; out (batch*tokens, heads*head_dim) contiguous fp16.
Query head h reads KV head h // (heads // kv_heads); scale defaults to 1/sqrt(head_dim). Lengths
read from device int32s, so a captured graph stays valid as they change:
  prefill  query t of sequence b sees keys [0, past_b + t] (causal) or [0, past_b + len_b) (not),
           past_b = (past ? past[b] : 0) + past_len, len_b = lens ? lens[b] : tokens. Keys
           [0, past_b) come from the KV cache, the rest are this chunk's: chunked prefill.
  decode   the query of sequence b sees keys [0, min(lens[b] + len_add, max_len)); split s of
           `splits` covers keys [s*span, (s+1)*span), span = ceil(max_len / splits), and writes
           (max, sum, unnormalised acc) in fp32 to a workspace of flash_decode_workspace_bytes
           (reference.attention_partial's state per split); the combine kernel merges the splits
           into fp16.

Prefill design (FlashAttention-2, Dao 2023). A block is 4 warps and owns 64 query rows of one
(sequence, head); each warp owns 16 rows, so the softmax state of a row never leaves its warp (no
block-wide reductions). Q lives in registers as mma A fragments (loaded once, 32 registers at
head_dim 128); K and V tiles of 64 keys are staged in shared memory by cp.async, V(n) in flight
while S = Q K(n)^T runs and K(n+1) in flight while softmax and O += P V(n) run. S and O
accumulate in fp32 through `mma.sync.m16n8k16` (fp16 in); the S accumulator's register layout is
exactly the A-fragment layout of P, so P goes to the second mma rounded to fp16 without touching
shared memory; the scores are never materialised. B fragments come from shared memory by
ldmatrix (.trans for V); each staged row is padded by 16 bytes so the 8 row addresses of an
ldmatrix land in distinct banks. Why 64 x 64 and 4 warps: O (64) + S (32) + Q (32) fp32/fp16x2
registers per thread put the kernel at 165 registers = 3 blocks (12 warps) per SM, and the two
staged tiles (34 KiB at head_dim 128) stay under the 48 KiB static shared-memory limit (the device
layer sets no dynamic-smem attribute). Measured alternatives on the H200 (docs/kernels.md): 32-key
tiles double-buffered (same smem) 5 % slower; the same forced to 4 blocks per SM (128 registers,
spills) 14 % slower. Causal blocks stop at their last row's diagonal, and the grid runs the
longest (last) row blocks first so short blocks fill the tail. Online softmax in the exp2 domain
(scale * log2 e folded into one FFMA before each ex2), row max/sum by trees, not chains.

Decode design (flash decoding). One block of 128 threads serves one KV head and up to 4 of its
query heads over one split, so each KV byte is read once per group, not once per query head.
head_dim / 8 lanes own one key (16-byte loads: a lane owns 8 dims), each lane group streams 4 keys
per step (8 independent 16-byte loads in flight per thread) and keeps its own online-softmax state
per query head in registers; the lane groups merge once at the end through shared memory. 128
registers (launch bounds) give 4 blocks per SM, and splits are sized (flash_decode_splits) for
~4 blocks per SM, i.e. one wave, as a function of max_len so graphs stay valid. The combine gives
each split's weight its own thread (splits <= 64 < 128 threads). The first version (167 registers:
1.3 waves; a combine walking the splits serially) read 0.43 of the copy bandwidth at 8k, this 0.81.

Hazards: cp.async zero-fills rows past the last visible key (P = 0 times stale NaN bits would be
NaN); every loop that shuffles is uniform across its warp. Contract: head_dim 64 or 128, K/V and
q/out 16-byte aligned, row strides multiples of 8 halves (launchers refuse anything else).
"""
from __future__ import annotations

import math

import numpy as np

from gpu_worker.device.backend import f32, i32, i64, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import KernelDef, ceil_div, make_source, require, require_sizes

HEAD_DIMS = (64, 128)
PREFILL_ROWS = 64          # query rows per prefill block (16 per warp)
PREFILL_THREADS = 128
DECODE_THREADS = 128
DECODE_HEADS_PER_BLOCK = 4
FLASH_MAX_SPLITS = 64      # most splits per (sequence, head): the combine gives each a thread
SM_COUNT = 132             # H200
MIN_SPLIT_KEYS = 128       # fewest keys per split worth a block (4 steps of 32 keys)

# Device helpers and templates, shared with the paged kernels (gpu_worker.kernels.paged_attention),
# which compile them into their own module with their own entry points.
FLASH_DEVICE = r"""
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

"""

SOURCE = make_source("gp_flash_attention", FLASH_DEVICE + r"""
// grid (ceil(tokens / 64), heads, batch), 128 threads. Row block ceil-1 first: with a causal
// mask it is the longest, so the short ones fill the tail of the grid.
extern "C" __global__ void __launch_bounds__(128, GP_FA_MINB)
gp_flash_prefill_f16(unsigned short* out, const unsigned short* __restrict__ q,
                     const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
                     const int* __restrict__ lens, const int* __restrict__ past, int batch,
                     int tokens, int heads, int kv_heads, int head_dim, int q_row_stride,
                     int kv_row_stride, long long kv_batch_stride, int past_len, int causal,
                     float scale) {
    __shared__ __align__(16) unsigned short k_s[GP_FA_BN * (128 + GP_FA_PAD)];
    __shared__ __align__(16) unsigned short v_s[GP_FA_BN * (128 + GP_FA_PAD)];
    const int t0 = (gridDim.x - 1 - blockIdx.x) * GP_FA_BM, h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (heads / kv_heads);
    const int p = (past ? past[b] : 0) + past_len;
    const int valid = (lens ? lens[b] : tokens) + p;
    const long long row0 = (long long)b * tokens;
    const long long kv_off = (long long)b * kv_batch_stride + (long long)hk * head_dim;
    unsigned short* o = out + row0 * heads * head_dim + (long long)h * head_dim;
    const unsigned short* qq = q + row0 * q_row_stride + (long long)h * head_dim;
    const float sl = scale * GP_FA_LOG2E;
    const gp_kv_rows kr{k + kv_off, kv_row_stride}, vr{v + kv_off, kv_row_stride};
    if (head_dim == 128)
        gp_fa_prefill_block<128>(o, qq, kr, vr, k_s, v_s, tokens, tokens, t0, p, valid, causal,
                                 q_row_stride, (long long)heads * head_dim, sl);
    else
        gp_fa_prefill_block<64>(o, qq, kr, vr, k_s, v_s, tokens, tokens, t0, p, valid, causal,
                                q_row_stride, (long long)heads * head_dim, sl);
}

// grid (kv_heads * ceil(group / 4), batch, splits), 128 threads; group = heads / kv_heads.
// Partial state of (b, h, split s) at ws[((b*heads + h)*splits + s)*(head_dim + 2)]: max score
// (natural units, scaled), sum of e^(score - max), unnormalised acc (reference.attention_partial).
extern "C" __global__ void __launch_bounds__(128, 4)
gp_flash_decode_split_f16(float* __restrict__ ws, const unsigned short* __restrict__ q,
                          const unsigned short* __restrict__ k,
                          const unsigned short* __restrict__ v, const int* __restrict__ lens,
                          int batch, int heads, int kv_heads, int head_dim, int q_row_stride,
                          int kv_row_stride, long long kv_batch_stride, int len_add, int max_len,
                          int span, float scale) {
    const int group = heads / kv_heads, hgroups = (group + GP_FD_HPB - 1) / GP_FD_HPB;
    const int hk = blockIdx.x / hgroups, hg = blockIdx.x % hgroups;
    const int b = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    const int h0 = hk * group + hg * GP_FD_HPB, nh = min(GP_FD_HPB, group - hg * GP_FD_HPB);
    const int nkeys = max(0, min(lens[b] + len_add, max_len));
    const int j0 = min(sp * span, nkeys), j1 = min(j0 + span, nkeys);
    const long long kv_off = (long long)b * kv_batch_stride + (long long)hk * head_dim;
    const unsigned short* qq = q + (long long)b * q_row_stride + (long long)h0 * head_dim;
    float* part = ws + (((long long)b * heads + h0) * splits + sp) * (head_dim + 2);
    const int stride = splits * (head_dim + 2);
    const float sl = scale * GP_FA_LOG2E;
    const gp_kv_rows kr{k + kv_off, kv_row_stride}, vr{v + kv_off, kv_row_stride};
    __shared__ float smem[GP_FD_SMEM];
    if (head_dim == 128)
        gp_fd_split_block<128>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
    else
        gp_fd_split_block<64>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
}

// grid (heads, batch), 128 threads: out (fp16) = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
// Thread s owns split s's weight (splits <= 64 < 128), so the split loop over dims is free of
// dependent loads: at 64 splits a serial walk over (m, l) costs microseconds of L2 latency.
extern "C" __global__ void __launch_bounds__(128)
gp_flash_combine_f16(unsigned short* __restrict__ out, const float* __restrict__ ws, int batch,
                     int heads, int head_dim, int splits) {
    __shared__ float w_s[GP_FD_THREADS];
    __shared__ float scratch[33];
    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, width = head_dim + 2;
    const float* part = ws + ((long long)b * heads + h) * splits * width;
    const float ms = tid < splits ? part[tid * width] : -INFINITY;
    const float ls = tid < splits ? part[tid * width + 1] : 0.f;
    const float mx = gp_block_max(ms, scratch);
    const float w = (mx != -INFINITY && ls > 0.f) ? expf(ms - mx) : 0.f;  // all empty: zeros
    const float l = gp_block_sum(ls * w, scratch);
    w_s[tid] = w;
    __syncthreads();
    const float inv = l > 0.f ? 1.f / l : 0.f;
    unsigned short* o = out + ((long long)b * heads + h) * head_dim;
    for (int d = tid; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < splits; ++s) acc = fmaf(part[s * width + 2 + d], w_s[s], acc);
        o[d] = gp_f2h(acc * inv);
    }
}
""")


# -- references (fp16 in, fp32 math, fp16 out) -----------------------------------------------
def attention_f16(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, causal: bool,
                  n_valid: int | None = None, scale: float | None = None) -> np.ndarray:
    """reference.attention over fp16 inputs (exact in fp32), rounded to fp16."""
    f = np.float32
    return reference.attention(q.astype(f), k.astype(f), v.astype(f), q_pos, causal,
                               n_valid=n_valid, scale=scale).astype(np.float16)


def attention_partial_f16(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          scale: float | None = None) -> np.ndarray:
    """reference.attention_partial over fp16 inputs: the fp32 workspace state of one split."""
    f = np.float32
    return reference.attention_partial(q.astype(f), k.astype(f), v.astype(f), scale)


def attention_combine_f16(partials: np.ndarray) -> np.ndarray:
    return reference.attention_combine(partials).astype(np.float16)


# -- launchers -------------------------------------------------------------------------------
def _scale(head_dim: int, scale: float | None) -> float:
    """1/sqrt(head_dim) unless given; positive (the kernels take maxima of unscaled scores)."""
    value = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    require(math.isfinite(value) and value > 0, f"attention scale={scale!r} must be finite and > 0")
    return value


def _check_common(kernel: str, heads: int, kv_heads: int, head_dim: int) -> None:
    require(heads > 0 and kv_heads > 0 and heads % kv_heads == 0,
            f"{kernel}: heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    require(head_dim in HEAD_DIMS, f"{kernel}: head_dim={head_dim} must be one of {HEAD_DIMS}")


def _check_aligned(kernel: str, pointers: dict[str, int], strides: dict[str, int]) -> None:
    for name, p in pointers.items():
        require(p % 16 == 0, f"{kernel}: {name}=0x{p:x} must be 16-byte aligned (16-byte loads)")
    for name, s in strides.items():
        require(s % 8 == 0, f"{kernel}: {name}={s} must be a multiple of 8 halves (16 bytes)")


def launch_flash_attention_prefill(device, function, out: int, q: int, k: int, v: int, lens: int,
                                   past: int, batch: int, tokens: int, heads: int, kv_heads: int,
                                   head_dim: int, q_row_stride: int, kv_row_stride: int,
                                   kv_batch_stride: int, past_len: int = 0, causal: bool = True,
                                   scale: float | None = None, stream=None) -> None:
    """launch_attention_prefill's arguments over fp16 q/k/v/out (strides in halves)."""
    kernel = "flash_attention_prefill"
    require_sizes(kernel, batch=batch, tokens=tokens, q_row_stride=q_row_stride,
                  kv_row_stride=kv_row_stride, past_len=past_len)
    require(isinstance(kv_batch_stride, int) and 0 <= kv_batch_stride < 2**62,
            f"{kernel}: kv_batch_stride={kv_batch_stride!r} must be a non-negative int")
    _check_common(kernel, heads, kv_heads, head_dim)
    require(heads < 65536 and batch < 65536, f"{kernel}: heads={heads} and batch={batch} must be < 65536")
    _check_aligned(kernel, {"out": out, "q": q, "k": k, "v": v},
                   {"q_row_stride": q_row_stride, "kv_row_stride": kv_row_stride,
                    "kv_batch_stride": kv_batch_stride})
    if batch == 0 or tokens == 0:
        return
    device.launch(function, (ceil_div(tokens, PREFILL_ROWS), heads, batch), (PREFILL_THREADS, 1, 1),
                  [ptr(out), ptr(q), ptr(k), ptr(v), ptr(lens), ptr(past), i32(batch),
                   i32(tokens), i32(heads), i32(kv_heads), i32(head_dim), i32(q_row_stride),
                   i32(kv_row_stride), i64(kv_batch_stride), i32(past_len), i32(1 if causal else 0),
                   f32(_scale(head_dim, scale))], stream=stream)


def flash_decode_splits(max_len: int, batch: int = 1, heads: int = 32, kv_heads: int = 8) -> int:
    """Splits for ~4 decode blocks per H200 SM, each over >= MIN_SPLIT_KEYS keys of max_len.
    A function of max_len (not of the current length), so a captured graph stays valid."""
    blocks = max(1, batch * kv_heads * ceil_div(max(1, heads // max(1, kv_heads)),
                                                 DECODE_HEADS_PER_BLOCK))
    want = ceil_div(4 * SM_COUNT, blocks)
    return max(1, min(FLASH_MAX_SPLITS, want, max_len // MIN_SPLIT_KEYS))


def flash_decode_workspace_bytes(*, batch: int, heads: int, head_dim: int, splits: int = 1,
                                 **_: int) -> int:
    """fp32 (max, sum, acc[head_dim]) per (sequence, query head, split)."""
    return 4 * batch * heads * splits * (head_dim + 2)


def launch_flash_attention_decode_split(device, function, workspace: int, q: int, k_cache: int,
                                        v_cache: int, lens: int, batch: int, heads: int,
                                        kv_heads: int, head_dim: int, q_row_stride: int,
                                        kv_row_stride: int, kv_batch_stride: int, len_add: int,
                                        max_len: int, splits: int, scale: float | None = None,
                                        stream=None) -> None:
    """Split s of `splits` of the fp16 decode: its partial state into `workspace`."""
    kernel = "flash_attention_decode_split"
    require_sizes(kernel, batch=batch, q_row_stride=q_row_stride, kv_row_stride=kv_row_stride,
                  max_len=max_len, splits=splits)
    require(isinstance(kv_batch_stride, int) and 0 <= kv_batch_stride < 2**62,
            f"{kernel}: kv_batch_stride={kv_batch_stride!r} must be a non-negative int")
    _check_common(kernel, heads, kv_heads, head_dim)
    require(1 <= splits <= FLASH_MAX_SPLITS, f"{kernel}: splits={splits} must be in 1..{FLASH_MAX_SPLITS}")
    require(lens != 0 and workspace != 0, f"{kernel}: needs lens (device int32 per sequence) and a workspace")
    require(workspace % 4 == 0, f"{kernel}: workspace=0x{workspace:x} must be 4-byte aligned")
    require(batch < 65536, f"{kernel}: batch={batch} must be < 65536")
    _check_aligned(kernel, {"q": q, "k_cache": k_cache, "v_cache": v_cache},
                   {"q_row_stride": q_row_stride, "kv_row_stride": kv_row_stride,
                    "kv_batch_stride": kv_batch_stride})
    if batch == 0:
        return
    hgroups = ceil_div(heads // kv_heads, DECODE_HEADS_PER_BLOCK)
    device.launch(function, (kv_heads * hgroups, batch, splits), (DECODE_THREADS, 1, 1),
                  [ptr(workspace), ptr(q), ptr(k_cache), ptr(v_cache), ptr(lens), i32(batch),
                   i32(heads), i32(kv_heads), i32(head_dim), i32(q_row_stride),
                   i32(kv_row_stride), i64(kv_batch_stride), i32(len_add), i32(max_len),
                   i32(ceil_div(max_len, splits)), f32(_scale(head_dim, scale))], stream=stream)


def launch_flash_attention_combine(device, function, out: int, workspace: int, batch: int,
                                   heads: int, head_dim: int, splits: int, stream=None) -> None:
    """Merge the per-split states into fp16 out (batch, heads*head_dim)."""
    kernel = "flash_attention_combine"
    require_sizes(kernel, batch=batch, heads=heads, head_dim=head_dim, splits=splits)
    require(batch < 65536 and heads < 2**31 and 1 <= splits <= FLASH_MAX_SPLITS,
            f"{kernel}: batch < 65536 and splits in 1..{FLASH_MAX_SPLITS}")
    require(workspace != 0 and workspace % 4 == 0, f"{kernel}: needs a 4-byte aligned workspace")
    require(out % 2 == 0, f"{kernel}: out=0x{out:x} must be 2-byte aligned")
    if batch == 0 or heads == 0:
        return
    device.launch(function, (heads, batch, 1), (DECODE_THREADS, 1, 1),
                  [ptr(out), ptr(workspace), i32(batch), i32(heads), i32(head_dim), i32(splits)],
                  stream=stream)


def launch_flash_attention_decode(device, split_function, combine_function, out: int,
                                  workspace: int, q: int, k_cache: int, v_cache: int, lens: int,
                                  batch: int, heads: int, kv_heads: int, head_dim: int,
                                  q_row_stride: int, kv_row_stride: int, kv_batch_stride: int,
                                  len_add: int, max_len: int, splits: int,
                                  scale: float | None = None, stream=None) -> None:
    """Both halves of the fp16 split-K decode: split kernel, then combine, through `workspace`
    (flash_decode_workspace_bytes(...) bytes)."""
    launch_flash_attention_decode_split(device, split_function, workspace, q, k_cache, v_cache,
                                        lens, batch, heads, kv_heads, head_dim, q_row_stride,
                                        kv_row_stride, kv_batch_stride, len_add, max_len, splits,
                                        scale, stream)
    launch_flash_attention_combine(device, combine_function, out, workspace, batch, heads,
                                   head_dim, splits, stream)


FLASH_ATTENTION_PREFILL = KernelDef("flash_attention_prefill", "gp_flash_prefill_f16", SOURCE,
                                    attention_f16, launch_flash_attention_prefill)
FLASH_ATTENTION_DECODE_SPLIT = KernelDef("flash_attention_decode_split",
                                         "gp_flash_decode_split_f16", SOURCE,
                                         attention_partial_f16, launch_flash_attention_decode_split,
                                         workspace=flash_decode_workspace_bytes)
FLASH_ATTENTION_COMBINE = KernelDef("flash_attention_combine", "gp_flash_combine_f16", SOURCE,
                                    attention_combine_f16, launch_flash_attention_combine)

KERNELS = [FLASH_ATTENTION_PREFILL, FLASH_ATTENTION_DECODE_SPLIT, FLASH_ATTENTION_COMBINE]
