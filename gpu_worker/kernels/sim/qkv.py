"""The sim backend's kernels for the fused QKV epilogue (qkv.py), with the CUDA kernels' exact
argument lists.

Test double, not product (see gpu_worker.kernels.sim): each views only the bytes its CUDA kernel
touches (the qkv rows, q, the pool one block at a time through the table entry of each row's own
position, or the cache rows of the sequence's positions), reads positions and the start from
simulated device memory at run time and computes with the NumPy references.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.device.sim_kernels import register_sim_kernel
from gpu_worker.kernels import reference
from gpu_worker.kernels.sim import _arr, _vals
from gpu_worker.kernels.sim.paged import _Pool

H = np.float16


def _rows(mem, qkv: int, bias: int, rows: int, width: int) -> tuple[np.ndarray, np.ndarray | None]:
    x = np.array(_arr(mem, qkv, rows * width).reshape(rows, width))
    return x, (np.array(_arr(mem, bias, width)) if bias else None)


@register_sim_kernel("gp_qkv_rope_append_paged")
def _qkv_rope_append_paged(mem, grid, block, args) -> None:
    (q_out, pool, qkv, bias, positions, table, rows, table_rows, heads, kv_heads, head_dim,
     theta, inv_freq, layer, layers, block_tokens, max_blocks, rope_heads) = _vals(args)
    if not 1 <= rope_heads <= 8:   # GP_ROPE_HEADS: the CUDA kernel's register arrays
        raise ValueError(f"gp_qkv_rope_append_paged: rope_heads={rope_heads} not in [1, 8]")
    qw, kvw = heads * head_dim, kv_heads * head_dim
    x, b = _rows(mem, qkv, bias, rows, qw + 2 * kvw)
    pos = np.array(_arr(mem, positions, rows, np.int32))
    tab = _arr(mem, table, table_rows * max_blocks, np.int32).reshape(table_rows, max_blocks)
    inv = np.array(_arr(mem, inv_freq, head_dim // 2)) if inv_freq else None
    p = _Pool(mem, pool, layers, block_tokens, kv_heads, head_dim)
    # The reference appends into a pool of just the blocks the rows' own positions name (the
    # kernel reads no other table entry), with the table renumbered onto it, then put back.
    live = [r for r in range(rows) if 0 <= pos[r] < max_blocks * block_tokens]
    entry = {r: (r if table_rows == rows else 0, int(pos[r]) // block_tokens) for r in live}
    blocks = sorted({int(tab[e]) for e in entry.values()})
    local = {blk: i for i, blk in enumerate(blocks)}
    sub = np.stack([np.array(p.block(blk)) for blk in blocks]) if blocks else np.zeros((0, *p.shape), H)
    sub_table = np.zeros((table_rows, max_blocks), np.int32)
    for e in entry.values():
        sub_table[e] = local[int(tab[e])]
    q, sub = reference.qkv_rope_append_paged(x, b, pos, sub_table, sub, layer, heads, kv_heads,
                                             np.float32(theta), inv)
    _arr(mem, q_out, rows * qw, H).reshape(rows, qw)[:] = q
    for blk, i in local.items():
        p.block(blk)[:] = sub[i]


@register_sim_kernel("gp_qkv_rope_append")
def _qkv_rope_append(mem, grid, block, args) -> None:
    (q_out, k_cache, v_cache, qkv, bias, start, tokens, heads, kv_heads, head_dim, theta,
     inv_freq, max_len, q_half) = _vals(args)
    qw, kvw = heads * head_dim, kv_heads * head_dim
    x, b = _rows(mem, qkv, bias, tokens, qw + 2 * kvw)
    s0 = int(_arr(mem, start, 1, np.int32)[0])
    inv = np.array(_arr(mem, inv_freq, head_dim // 2)) if inv_freq else None
    lo, hi = max(0, s0), max(0, min(max_len, s0 + tokens))    # the cache rows written
    # the reference over blank caches of rows [0, hi): only rows lo..hi are written, and only
    # those are viewed in the device's caches
    blank = np.zeros((hi, kv_heads, head_dim), H)
    q, k_new, v_new = reference.qkv_rope_append(x, b, s0, blank, blank.copy(), heads, kv_heads,
                                                np.float32(theta), inv, bool(q_half))
    _arr(mem, q_out, tokens * qw, H if q_half else np.float32).reshape(tokens, qw)[:] = q
    if hi > lo:
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            rows = _arr(mem, cache + 2 * lo * kvw, (hi - lo) * kvw, H)
            rows[:] = new[lo:hi].reshape(-1)
