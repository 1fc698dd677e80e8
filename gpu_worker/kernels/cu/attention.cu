#include "gpuplane_common.cuh"
#define GP_ATT_CHUNK 256
#define GP_MAX_HEAD_DIM 512

// One block: one query row against keys [0, nkeys). Must be called by every thread of the block.
// KV: float or gp_h (an fp16 KV cache); q, out and all arithmetic stay float.
template <typename KV>
__device__ void gp_attend_row(float* __restrict__ out, const float* __restrict__ q,
                              const KV* __restrict__ k, const KV* __restrict__ v, int nkeys,
                              long long kv_row_stride, int head_dim, float scale) {
    __shared__ float q_s[GP_MAX_HEAD_DIM];
    __shared__ float p_s[GP_ATT_CHUNK];
    __shared__ float scratch[33];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    __syncthreads();  // a previous row's readers of q_s / p_s are done
    for (int d = tid; d < head_dim; d += blockDim.x) q_s[d] = q[d];
    __syncthreads();
    const int d0 = tid, d1 = tid + blockDim.x;
    float acc0 = 0.f, acc1 = 0.f, m = -INFINITY, l = 0.f;
    for (int c0 = 0; c0 < nkeys; c0 += GP_ATT_CHUNK) {
        const int n = min(GP_ATT_CHUNK, nkeys - c0);
        for (int j = warp; j < n; j += nwarps) {
            const KV* kr = k + (long long)(c0 + j) * kv_row_stride;
            float s = 0.f;
            for (int d = lane; d < head_dim; d += 32) s = fmaf(q_s[d], gp_ld(kr + d), s);
            s = gp_warp_sum(s);
            if (lane == 0) p_s[j] = s * scale;
        }
        __syncthreads();
        float cmax = -INFINITY;
        for (int j = tid; j < n; j += blockDim.x) cmax = fmaxf(cmax, p_s[j]);
        const float m_new = fmaxf(m, gp_block_max(cmax, scratch));
        float csum = 0.f;
        for (int j = tid; j < n; j += blockDim.x) {
            const float p = expf(p_s[j] - m_new);
            p_s[j] = p;
            csum += p;
        }
        csum = gp_block_sum(csum, scratch);  // its barriers also publish p_s
        const float corr = expf(m - m_new);  // 0 on the first chunk (m = -inf)
        l = l * corr + csum;
        acc0 *= corr;
        acc1 *= corr;
        const KV* vc = v + (long long)c0 * kv_row_stride;
        if (d0 < head_dim)
            for (int j = 0; j < n; ++j) acc0 = fmaf(p_s[j], gp_ld(vc + (long long)j * kv_row_stride + d0), acc0);
        if (d1 < head_dim)
            for (int j = 0; j < n; ++j) acc1 = fmaf(p_s[j], gp_ld(vc + (long long)j * kv_row_stride + d1), acc1);
        m = m_new;
        __syncthreads();  // p_s is rewritten by the next chunk
    }
    const float inv = l > 0.f ? 1.0f / l : 0.f;
    if (d0 < head_dim) out[d0] = acc0 * inv;
    if (d1 < head_dim) out[d1] = acc1 * inv;
}

// grid (heads, tokens, batch)
template <typename KV>
__device__ __forceinline__ void
gp_attention_prefill_t(float* out, const float* __restrict__ q, const KV* __restrict__ k,
                       const KV* __restrict__ v, const int* __restrict__ lens,
                       const int* __restrict__ past, int batch, int tokens, int heads, int kv_heads,
                       int head_dim, int q_row_stride, int kv_row_stride, long long kv_batch_stride,
                       int past_len, int causal, float scale) {
    const int h = blockIdx.x, t = blockIdx.y, b = blockIdx.z;
    const int hk = h / (heads / kv_heads);
    const int p = (past ? past[b] : 0) + past_len;
    const int valid = (lens ? lens[b] : tokens) + p;
    const int nkeys = max(0, causal ? min(p + t + 1, valid) : valid);
    const long long row = (long long)b * tokens + t;
    const long long kv_off = (long long)b * kv_batch_stride + (long long)hk * head_dim;
    gp_attend_row(out + row * heads * head_dim + (long long)h * head_dim,
                  q + row * q_row_stride + (long long)h * head_dim, k + kv_off, v + kv_off, nkeys,
                  kv_row_stride, head_dim, scale);
}

// grid (heads, batch)
template <typename KV>
__device__ __forceinline__ void
gp_attention_decode_t(float* out, const float* __restrict__ q, const KV* __restrict__ k,
                      const KV* __restrict__ v, const int* __restrict__ lens, int batch, int heads,
                      int kv_heads, int head_dim, int q_row_stride, int kv_row_stride,
                      long long kv_batch_stride, int len_add, int max_len, float scale) {
    const int h = blockIdx.x, b = blockIdx.y;
    const int hk = h / (heads / kv_heads);
    const int nkeys = max(0, min(lens[b] + len_add, max_len));
    const long long kv_off = (long long)b * kv_batch_stride + (long long)hk * head_dim;
    gp_attend_row(out + ((long long)b * heads + h) * head_dim,
                  q + (long long)b * q_row_stride + (long long)h * head_dim, k + kv_off, v + kv_off,
                  nkeys, kv_row_stride, head_dim, scale);
}

template <typename KV>
__device__ __forceinline__ void
gp_kv_append_t(KV* k_cache, KV* v_cache, const float* __restrict__ k, const float* __restrict__ v,
               const int* __restrict__ pos, int batch, int tokens, int kv_heads, int head_dim,
               int src_row_stride, int kv_row_stride, long long kv_batch_stride, int pos_offset,
               int max_len) {
    const int width = kv_heads * head_dim;
    GP_GRID_STRIDE(i, (long long)batch * tokens * width) {
        const int d = (int)(i % width);
        const long long bt = i / width;
        const int t = (int)(bt % tokens), b = (int)(bt / tokens);
        const int dst = (pos ? pos[b] : 0) + pos_offset + t;
        if (dst < 0 || dst >= max_len) continue;
        const long long s = bt * src_row_stride + d;
        const long long o = (long long)b * kv_batch_stride + (long long)dst * kv_row_stride + d;
        gp_st(k_cache + o, k[s]);
        gp_st(v_cache + o, v[s]);
    }
}

// Entry points: gp_attention_prefill over a float KV, <name>_kv16 over an fp16 KV cache (q, out:
// float).
#define GP_PREFILL_ARGS(KV) float* out, const float* __restrict__ q, const KV* __restrict__ k, \
    const KV* __restrict__ v, const int* __restrict__ lens, const int* __restrict__ past, int batch, \
    int tokens, int heads, int kv_heads, int head_dim, int q_row_stride, int kv_row_stride, \
    long long kv_batch_stride, int past_len, int causal, float scale
#define GP_PREFILL_PASS out, q, k, v, lens, past, batch, tokens, heads, kv_heads, head_dim, \
    q_row_stride, kv_row_stride, kv_batch_stride, past_len, causal, scale
extern "C" __global__ void __launch_bounds__(256) gp_attention_prefill(GP_PREFILL_ARGS(float)) {
    gp_attention_prefill_t(GP_PREFILL_PASS);
}
extern "C" __global__ void __launch_bounds__(256) gp_attention_prefill_kv16(GP_PREFILL_ARGS(gp_h)) {
    gp_attention_prefill_t(GP_PREFILL_PASS);
}

#define GP_DECODE_ARGS(KV) float* out, const float* __restrict__ q, const KV* __restrict__ k, \
    const KV* __restrict__ v, const int* __restrict__ lens, int batch, int heads, int kv_heads, \
    int head_dim, int q_row_stride, int kv_row_stride, long long kv_batch_stride, int len_add, \
    int max_len, float scale
#define GP_DECODE_PASS out, q, k, v, lens, batch, heads, kv_heads, head_dim, q_row_stride, \
    kv_row_stride, kv_batch_stride, len_add, max_len, scale
extern "C" __global__ void __launch_bounds__(256) gp_attention_decode_kv16(GP_DECODE_ARGS(gp_h)) {
    gp_attention_decode_t(GP_DECODE_PASS);
}

#define GP_APPEND_ARGS(KV) KV* k_cache, KV* v_cache, const float* __restrict__ k, \
    const float* __restrict__ v, const int* __restrict__ pos, int batch, int tokens, int kv_heads, \
    int head_dim, int src_row_stride, int kv_row_stride, long long kv_batch_stride, \
    int pos_offset, int max_len
#define GP_APPEND_PASS k_cache, v_cache, k, v, pos, batch, tokens, kv_heads, head_dim, \
    src_row_stride, kv_row_stride, kv_batch_stride, pos_offset, max_len
extern "C" __global__ void gp_kv_append_kv16(GP_APPEND_ARGS(gp_h)) { gp_kv_append_t(GP_APPEND_PASS); }
