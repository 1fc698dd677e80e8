#include "gpuplane_common.cuh"
// The fused QKV linear's epilogue: one kernel reads each row of qkv (rows, q | k | v) f32, row
// stride (heads + 2 * kv_heads) * head_dim, adds the bias (optional), rotates q and k at the
// row's position, appends k and v to the KV cache in fp16 and writes q in the dtype attention
// reads. Replaces rotary (q), rotary (k), kv_append and to_f16: four nodes, four passes over q.
// Work items per row: (heads + kv_heads) * head_dim / 2 rotary pairs, then kv_heads * head_dim
// v elements; q heads and k heads sit back to back in the row, so pair (h, j) is column
// h * head_dim + j whichever of the two it is.

// The pair (x1, x2) = dims (j, j + head_dim / 2) rotated at position p: the float math of
// gp_rotary / gp_rotary_rows (double angle, float rotation), so the result is theirs.
__device__ __forceinline__ void gp_rope_sincos(int p, int j, int head_dim, float theta,
                                               const float* __restrict__ inv_freq, float* s,
                                               float* c) {
    const double inv = inv_freq ? (double)inv_freq[j]
                                : pow((double)theta, -((double)(2 * j) / (double)head_dim));
    double sd, cd;
    sincos((double)p * inv, &sd, &cd);
    *s = (float)sd;
    *c = (float)cd;
}

__device__ __forceinline__ void gp_rope_pair(float x1, float x2, int p, int j, int head_dim,
                                             float theta, const float* __restrict__ inv_freq,
                                             float* y1, float* y2) {
    float s, c;
    gp_rope_sincos(p, j, head_dim, theta, inv_freq, &s, &c);
    *y1 = x1 * c - x2 * s;
    *y2 = x2 * c + x1 * s;
}

// Most heads one thread of the paged kernel rotates at one (row, j): the double-precision angle
// is the costly part (pow + sincos), and every q and k head of a row shares it. The launcher
// picks rope_heads in [1, GP_ROPE_HEADS] by rows (qkv.py's rope_heads: 1 is lowest latency
// while every angle fits the GPU at once; more heads a thread compute fewer angles).
#define GP_ROPE_HEADS 8

// The paged KV pool (paged_attention.py's layout): row r at positions[r] (-1: a padding row, its
// q comes out zero and it appends nothing; past the table: q rotated, nothing appended), through
// table row (table_rows == rows ? r : 0). q out fp16 (the flash kernels' operand).
extern "C" __global__ void gp_qkv_rope_append_paged(
        unsigned short* __restrict__ q_out, unsigned short* __restrict__ pool,
        const float* __restrict__ qkv, const float* __restrict__ bias,
        const int* __restrict__ positions, const int* __restrict__ table, int rows,
        int table_rows, int heads, int kv_heads, int head_dim, float theta,
        const float* __restrict__ inv_freq, int layer, int layers, int block_tokens,
        int max_blocks, int rope_heads) {
    GP_PDL_ENTRY();
    const int half = head_dim >> 1, nh = heads + kv_heads;
    const int qw = heads * head_dim, kvw = kv_heads * head_dim, stride = qw + 2 * kvw;
    const int pairs = (nh + rope_heads - 1) / rope_heads * half, per_row = pairs + kvw;
    const long long plane = (long long)block_tokens * kvw;
    const long long capacity = (long long)max_blocks * block_tokens;
    GP_GRID_STRIDE(i, (long long)rows * per_row) {
        const int r = (int)(i / per_row), e = (int)(i % per_row);
        const int p = positions[r];
        const float* src = qkv + (size_t)r * stride;
        unsigned short* kv = nullptr;   // this row's K slot in the pool (V is one plane on)
        if (p >= 0 && p < capacity) {
            const int* trow = table + (long long)(table_rows == rows ? r : 0) * max_blocks;
            const long long blk = trow[p / block_tokens];
            kv = pool + blk * layers * 2 * plane + 2 * layer * plane
                 + (long long)(p % block_tokens) * kvw;
        }
        if (e < pairs) {   // pair j of heads h0 .. h0 + rope_heads (q heads, then k heads)
            const int j = e % half, h0 = e / half * rope_heads;
            float s = 0.f, c = 1.f;
            if (p >= 0) gp_rope_sincos(p, j, head_dim, theta, inv_freq, &s, &c);
            float x1[GP_ROPE_HEADS], x2[GP_ROPE_HEADS];
#pragma unroll
            for (int u = 0; u < GP_ROPE_HEADS; ++u) {
                const int col = (h0 + u) * head_dim + j;
                if (u >= rope_heads || h0 + u >= nh) break;
                x1[u] = src[col];
                x2[u] = src[col + half];
                if (bias) { x1[u] += bias[col]; x2[u] += bias[col + half]; }
            }
#pragma unroll
            for (int u = 0; u < GP_ROPE_HEADS; ++u) {
                const int h = h0 + u, col = h * head_dim + j;
                if (u >= rope_heads || h >= nh) break;
                const float y1 = x1[u] * c - x2[u] * s, y2 = x2[u] * c + x1[u] * s;
                if (h < heads) {
                    unsigned short* qo = q_out + (size_t)r * qw + col;
                    qo[0] = p < 0 ? (unsigned short)0 : gp_float_to_half(y1);
                    qo[half] = p < 0 ? (unsigned short)0 : gp_float_to_half(y2);
                } else if (kv) {
                    kv[col - qw] = gp_float_to_half(y1);
                    kv[col - qw + half] = gp_float_to_half(y2);
                }
            }
        } else if (kv) {
            const int c = e - pairs;
            float x = src[qw + kvw + c];
            if (bias) x += bias[qw + kvw + c];
            kv[plane + c] = gp_float_to_half(x);
        }
    }
}

// One sequence's contiguous fp16 cache, k_cache / v_cache (max_len, kv_heads, head_dim): token t
// at position start[0] + t (rows outside [0, max_len) append nothing). q out (tokens, heads *
// head_dim): fp16 when q_half (the flash kernels), else f32 (the _kv16 kernels' other head dims).
extern "C" __global__ void gp_qkv_rope_append(
        void* __restrict__ q_out, unsigned short* __restrict__ k_cache,
        unsigned short* __restrict__ v_cache, const float* __restrict__ qkv,
        const float* __restrict__ bias, const int* __restrict__ start, int tokens, int heads,
        int kv_heads, int head_dim, float theta, const float* __restrict__ inv_freq,
        int max_len, int q_half) {
    const int half = head_dim >> 1;
    const int qw = heads * head_dim, kvw = kv_heads * head_dim, stride = qw + 2 * kvw;
    const int pairs = (heads + kv_heads) * half, per_row = pairs + kvw;
    const int p0 = start[0];
    GP_GRID_STRIDE(i, (long long)tokens * per_row) {
        const int t = (int)(i / per_row), e = (int)(i % per_row);
        const int p = p0 + t;
        const float* src = qkv + (size_t)t * stride;
        const bool append = p >= 0 && p < max_len;
        const size_t slot = (size_t)p * kvw;
        if (e < pairs) {
            const int h = e / half, j = e % half, col = h * head_dim + j;
            float x1 = src[col], x2 = src[col + half];
            if (bias) { x1 += bias[col]; x2 += bias[col + half]; }
            if (h >= heads && !append) continue;
            float y1, y2;
            gp_rope_pair(x1, x2, p, j, head_dim, theta, inv_freq, &y1, &y2);
            if (h < heads) {
                const size_t o = (size_t)t * qw + col;
                if (q_half) {
                    unsigned short* qo = static_cast<unsigned short*>(q_out) + o;
                    qo[0] = gp_float_to_half(y1);
                    qo[half] = gp_float_to_half(y2);
                } else {
                    float* qo = static_cast<float*>(q_out) + o;
                    qo[0] = y1;
                    qo[half] = y2;
                }
            } else {
                k_cache[slot + col - qw] = gp_float_to_half(y1);
                k_cache[slot + col - qw + half] = gp_float_to_half(y2);
            }
        } else if (append) {
            const int c = e - pairs;
            float x = src[qw + kvw + c];
            if (bias) x += bias[qw + kvw + c];
            v_cache[slot + c] = gp_float_to_half(x);
        }
    }
}
