"""The sim backend's fp16 attention kernels (gpu_worker.kernels.flash_attention): NumPy over
simulated device memory, with the CUDA kernels' exact argument lists.

Test double, not product (see gpu_worker.kernels.sim): each views only the bytes its CUDA kernel
touches (an unmapped byte raises IllegalAddress), reads lengths from simulated device int32s at run
time (so replayed sim graphs see current values) and computes with the fp16 references.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.device.sim_kernels import register_sim_kernel
from gpu_worker.kernels import flash_attention as fa
from gpu_worker.kernels.sim import _arr, _opt_i32, _strided, _vals

H = np.float16
HB = 2  # bytes per fp16 element


@register_sim_kernel("gp_flash_prefill_f16")
def _flash_prefill(mem, grid, block, args) -> None:
    (out, q, k, v, lens, past, batch, tokens, heads, kv_heads, head_dim, q_row_stride,
     kv_row_stride, kv_batch_stride, past_len, causal, scale) = _vals(args)
    for b in range(batch):
        p = _opt_i32(mem, past, b) + past_len
        valid = (_opt_i32(mem, lens, b) if lens else tokens) + p
        nkeys = max(0, min(p + tokens, valid) if causal else valid)
        qb = _strided(mem, q + HB * b * tokens * q_row_stride, (tokens, heads, head_dim),
                      (q_row_stride, head_dim, 1), H)
        kv_shape, kv_strides = (nkeys, kv_heads, head_dim), (kv_row_stride, head_dim, 1)
        kb = _strided(mem, k + HB * b * kv_batch_stride, kv_shape, kv_strides, H)
        vb = _strided(mem, v + HB * b * kv_batch_stride, kv_shape, kv_strides, H)
        r = fa.attention_f16(qb, kb, vb, p + np.arange(tokens), bool(causal), n_valid=valid,
                             scale=scale)
        _arr(mem, out + HB * b * tokens * heads * head_dim, tokens * heads * head_dim, H)[:] = \
            r.reshape(-1)


@register_sim_kernel("gp_flash_decode_split_f16")
def _flash_decode_split(mem, grid, block, args) -> None:
    (ws, q, k, v, lens, batch, heads, kv_heads, head_dim, q_row_stride, kv_row_stride,
     kv_batch_stride, len_add, max_len, span, scale) = _vals(args)
    splits = grid[2]
    width = head_dim + 2
    for b in range(batch):
        nkeys = max(0, min(_opt_i32(mem, lens, b) + len_add, max_len))
        qb = _arr(mem, q + HB * b * q_row_stride, heads * head_dim, H).reshape(heads, head_dim)
        part = _strided(mem, ws + 4 * b * heads * splits * width, (splits, heads, width),
                        (width, splits * width, 1))
        for sp in range(splits):
            j0 = min(sp * span, nkeys)
            j1 = min(j0 + span, nkeys)
            kv_shape, kv_strides = (j1 - j0, kv_heads, head_dim), (kv_row_stride, head_dim, 1)
            off = HB * (b * kv_batch_stride + j0 * kv_row_stride)
            part[sp] = fa.attention_partial_f16(qb, _strided(mem, k + off, kv_shape, kv_strides, H),
                                                _strided(mem, v + off, kv_shape, kv_strides, H),
                                                scale)


@register_sim_kernel("gp_flash_combine_f16")
def _flash_combine(mem, grid, block, args) -> None:
    out, ws, batch, heads, head_dim, splits = _vals(args)
    width = head_dim + 2
    for b in range(batch):
        part = _strided(mem, ws + 4 * b * heads * splits * width, (splits, heads, width),
                        (width, splits * width, 1))
        r = fa.attention_combine_f16(np.array(part))
        _arr(mem, out + HB * b * heads * head_dim, heads * head_dim, H)[:] = r.reshape(-1)
