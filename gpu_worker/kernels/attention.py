"""Grouped-query attention with f32 q and output (prefill and decode) and the KV cache append.

What models still run here: the encoder's bidirectional attention (`attention_prefill`, f32 K/V
straight from its activations), the decoder's attention at head dims the tensor-core kernels of
gpu_worker.kernels.flash_attention do not take (64 and 128 only; `tiny` has 16), whose `_kv16`
kernels read the fp16 KV cache (`attention_prefill_kv16`, `attention_decode_kv16`), and every
decoder's `kv_append_kv16`, which writes f32 K/V into the fp16 cache rounded to nearest even.
q, out and all arithmetic (dot products, softmax, P.V) stay f32. The f32-KV decode, its split-K
path and the f32-KV append had no model left once the KV cache went fp16 and decode attention at
head_dim 64/128 moved to the flash split-K kernels: they were removed (issue 12).

Layouts (f32 or fp16 K/V; strides in elements):
  q        row (b, t) at q + (b*tokens + t)*q_row_stride, head h at + h*head_dim
  k, v     key j of sequence b at k + b*kv_batch_stride + j*kv_row_stride, KV head at + hk*head_dim
           (a KV cache (batch, max_len, kv_heads, head_dim) has kv_row_stride = kv_heads*head_dim,
           kv_batch_stride = max_len*kv_row_stride; keys straight from a fused QKV buffer use its
           row stride and kv_batch_stride = tokens*row_stride)
  out      (batch*tokens, heads*head_dim), contiguous
Query head h reads KV head h // (heads // kv_heads). Scale defaults to 1/sqrt(head_dim).

Each block computes one (query row, head) with an online softmax over chunks of 256 keys held in
shared memory: no scores workspace at all, so memory does not grow with the sequence length
(a materialised (heads, seq, seq) score matrix is 3.9 GB at 32 heads x 5502 tokens). Warp per key
for the dot products (coalesced over head_dim), thread per output dimension for P.V.
head_dim <= 512.

Lengths that change between replays of a captured graph are read from device int32s:
  prefill  query t of sequence b sees keys [0, past_b + t] (causal) or [0, past_b + len_b)
           (not causal), past_b = (past ? past[b] : 0) + past_len, len_b = lens ? lens[b] : tokens
  decode   the single query of sequence b sees keys [0, min(lens[b] + len_add, max_len))
  append   writes token t of sequence b at row (pos ? pos[b] : 0) + pos_offset + t of the cache;
           rows at or past max_len are dropped instead of written out of bounds
"""
from __future__ import annotations

import math

from gpu_worker.device.backend import f32, i32, i64, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import BLOCK, KernelDef, grid_1d, make_source, require, require_sizes

MAX_HEAD_DIM = 512

SOURCE = make_source("gp_attention", r"""
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
""")


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _check_heads(kernel: str, heads: int, kv_heads: int, head_dim: int) -> None:
    require(heads > 0 and kv_heads > 0 and heads % kv_heads == 0,
            f"{kernel}: heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    require(0 < head_dim <= MAX_HEAD_DIM, f"{kernel}: head_dim={head_dim} must be in 1..{MAX_HEAD_DIM}")


def launch_attention_prefill(device, function, out: int, q: int, k: int, v: int, lens: int,
                             past: int, batch: int, tokens: int, heads: int, kv_heads: int,
                             head_dim: int, q_row_stride: int, kv_row_stride: int,
                             kv_batch_stride: int, past_len: int = 0, causal: bool = True,
                             scale: float | None = None, stream=None) -> None:
    require_sizes("attention_prefill", batch=batch, tokens=tokens, q_row_stride=q_row_stride,
                  kv_row_stride=kv_row_stride, past_len=past_len)
    _check_heads("attention_prefill", heads, kv_heads, head_dim)
    require(heads < 2**31 and tokens < 65536 and batch < 65536,
            f"attention_prefill: tokens={tokens} and batch={batch} must be < 65536")
    if batch == 0 or tokens == 0:
        return
    device.launch(function, (heads, tokens, batch), BLOCK,
                  [ptr(out), ptr(q), ptr(k), ptr(v), ptr(lens), ptr(past), i32(batch),
                   i32(tokens), i32(heads), i32(kv_heads), i32(head_dim), i32(q_row_stride),
                   i32(kv_row_stride), i64(kv_batch_stride), i32(past_len), i32(1 if causal else 0),
                   f32(_scale(head_dim, scale))], stream=stream)


def launch_attention_decode(device, function, out: int, q: int, k_cache: int, v_cache: int,
                            lens: int, batch: int, heads: int, kv_heads: int, head_dim: int,
                            q_row_stride: int, kv_row_stride: int, kv_batch_stride: int,
                            len_add: int, max_len: int, scale: float | None = None,
                            stream=None) -> None:
    """One query per sequence against its (fp16) KV cache, one block per (head, sequence)."""
    require_sizes("attention_decode", batch=batch, q_row_stride=q_row_stride,
                  kv_row_stride=kv_row_stride, max_len=max_len)
    _check_heads("attention_decode", heads, kv_heads, head_dim)
    require(lens != 0, "attention_decode: lens must point at a device int32 per sequence")
    require(batch < 65536, f"attention_decode: batch={batch} must be < 65536")
    if batch == 0:
        return
    device.launch(function, (heads, batch, 1), BLOCK,
                  [ptr(out), ptr(q), ptr(k_cache), ptr(v_cache), ptr(lens), i32(batch),
                   i32(heads), i32(kv_heads), i32(head_dim), i32(q_row_stride),
                   i32(kv_row_stride), i64(kv_batch_stride), i32(len_add), i32(max_len),
                   f32(_scale(head_dim, scale))], stream=stream)


def launch_kv_append(device, function, k_cache: int, v_cache: int, k: int, v: int, pos: int,
                     batch: int, tokens: int, kv_heads: int, head_dim: int, src_row_stride: int,
                     kv_row_stride: int, kv_batch_stride: int, pos_offset: int, max_len: int,
                     stream=None) -> None:
    require_sizes("kv_append", batch=batch, tokens=tokens, kv_heads=kv_heads, head_dim=head_dim,
                  src_row_stride=src_row_stride, kv_row_stride=kv_row_stride, max_len=max_len,
                  elements=batch * tokens * kv_heads * head_dim)
    total = batch * tokens * kv_heads * head_dim
    if total == 0:
        return
    device.launch(function, grid_1d(total), BLOCK,
                  [ptr(k_cache), ptr(v_cache), ptr(k), ptr(v), ptr(pos), i32(batch), i32(tokens),
                   i32(kv_heads), i32(head_dim), i32(src_row_stride), i32(kv_row_stride),
                   i64(kv_batch_stride), i32(pos_offset), i32(max_len)], stream=stream)


ATTENTION_PREFILL = KernelDef("attention_prefill", "gp_attention_prefill", SOURCE,
                              reference.attention, launch_attention_prefill)


# The same kernels over an fp16 KV cache: the same arguments (pointers to fp16 K/V; strides in
# elements), so the launchers are shared.
def launch_attention_prefill_kv16(*args, **kwargs) -> None:
    """launch_attention_prefill with k and v in an fp16 cache."""
    launch_attention_prefill(*args, **kwargs)


def launch_attention_decode_kv16(*args, **kwargs) -> None:
    """launch_attention_decode with an fp16 KV cache."""
    launch_attention_decode(*args, **kwargs)


def launch_kv_append_kv16(*args, **kwargs) -> None:
    """launch_kv_append into an fp16 cache (k and v in: f32)."""
    launch_kv_append(*args, **kwargs)


ATTENTION_PREFILL_KV16 = KernelDef("attention_prefill_kv16", "gp_attention_prefill_kv16", SOURCE,
                                   reference.attention, launch_attention_prefill_kv16)
ATTENTION_DECODE_KV16 = KernelDef("attention_decode_kv16", "gp_attention_decode_kv16", SOURCE,
                                  reference.attention, launch_attention_decode_kv16)
KV_APPEND_KV16 = KernelDef("kv_append_kv16", "gp_kv_append_kv16", SOURCE, reference.kv_append,
                           launch_kv_append_kv16)

KERNELS = [ATTENTION_PREFILL, ATTENTION_PREFILL_KV16, ATTENTION_DECODE_KV16, KV_APPEND_KV16]
