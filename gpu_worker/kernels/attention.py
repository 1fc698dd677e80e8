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
from gpu_worker.kernels.common import BLOCK, KernelDef, cu_source, grid_1d, require, require_sizes

MAX_HEAD_DIM = 512

SOURCE = cu_source("gp_attention", "attention.cu")


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
    device.launch(function, grid_1d(device, total), BLOCK,
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
