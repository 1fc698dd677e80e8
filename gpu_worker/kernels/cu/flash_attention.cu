#include "flash_device.cuh"

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
    const gp_head_block hb = gp_decode_heads(blockIdx.x, heads, kv_heads);
    const int hk = hb.hk, h0 = hb.h0, nh = hb.nh;
    const int b = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    const int nkeys = max(0, min(lens[b] + len_add, max_len));
    const int j0 = min(sp * span, nkeys), j1 = min(j0 + span, nkeys);
    const long long kv_off = (long long)b * kv_batch_stride + (long long)hk * head_dim;
    const unsigned short* qq = q + (long long)b * q_row_stride + (long long)h0 * head_dim;
    float* part = ws + (((long long)b * heads + h0) * splits + sp) * (head_dim + 2);
    const int stride = splits * (head_dim + 2);
    const float sl = scale * GP_FA_LOG2E;
    const gp_kv_rows kr{k + kv_off, kv_row_stride}, vr{v + kv_off, kv_row_stride};
    __shared__ float smem[GP_FD_SMEM];
#if GP_FD_MMA
    if (head_dim == 128)
        gp_fd_split_block_mma<128, false>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem, -1);
    else
        gp_fd_split_block_mma<64, false>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem, -1);
#else
    if (head_dim == 128)
        gp_fd_split_block<128>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
    else
        gp_fd_split_block<64>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
#endif
}

// grid (heads, batch), 128 threads: out (fp16) = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
// over the `splits` states (an empty one weighs nothing; all empty: zeros). gp_fd_combine: the states
// staged into shared memory in one round trip.
extern "C" __global__ void __launch_bounds__(128)
gp_flash_combine_f16(unsigned short* __restrict__ out, const float* __restrict__ ws, int batch,
                     int heads, int head_dim, int splits) {
    extern __shared__ float gp_fc_states[];   // decode_combine_shared_bytes
    const int h = blockIdx.x, b = blockIdx.y, width = head_dim + 2;
    const float* part = ws + ((long long)b * heads + h) * splits * width;
    unsigned short* o = out + ((long long)b * heads + h) * head_dim;
    if (head_dim == 128) gp_fd_combine<128>(o, part, splits, gp_fc_states);
    else gp_fd_combine<64>(o, part, splits, gp_fc_states);
}
