"""The sim backend's kernels for batched decoding: paged KV (paged_attention.py), rotary per row
(rotary.py) and sampling (sampling.py), with the CUDA kernels' exact argument lists.

Test double, not product (see gpu_worker.kernels.sim): each views only the bytes its CUDA kernel
touches (the pool one block at a time, through the table entries below the row's length), reads
positions, lengths and tables from simulated device memory at run time (so replayed sim graphs see
the current values) and computes with the NumPy references.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.device.sim_kernels import register_sim_kernel, sim_tensor_map
from gpu_worker.kernels import reference
from gpu_worker.kernels.flash_attention import DECODE_HEADS_PER_BLOCK
from gpu_worker.kernels.paged_attention import CLUSTER_COUNTERS, CLUSTER_SLOT_FLOATS
from gpu_worker.kernels.sim import _arr, _strided, _vals

H = np.float16
HB = 2


class _Pool:
    """The pool's blocks as (layers, 2, block_tokens, kv_heads, head_dim) fp16 views."""

    def __init__(self, mem, base: int, layers: int, block_tokens: int, kv_heads: int,
                 head_dim: int) -> None:
        self.mem, self.base = mem, base
        self.shape = (layers, 2, block_tokens, kv_heads, head_dim)
        self.halves = layers * 2 * block_tokens * kv_heads * head_dim

    def block(self, b: int) -> np.ndarray:
        return _arr(self.mem, self.base + HB * b * self.halves, self.halves, H).reshape(self.shape)

    def gather(self, table_row: np.ndarray, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V (n, kv_heads, head_dim) of positions [0, n)."""
        bt = self.shape[2]
        k = np.empty((n, *self.shape[3:]), H)
        v = np.empty_like(k)
        for i in range(-(-n // bt)):
            blk = self.block(int(table_row[i]))
            m = min(bt, n - i * bt)
            k[i * bt:i * bt + m] = blk[layer, 0, :m]
            v[i * bt:i * bt + m] = blk[layer, 1, :m]
        return k, v


@register_sim_kernel("gp_kv_append_paged")
def _kv_append_paged(mem, grid, block, args) -> None:
    (pool, k, v, positions, table, rows, table_rows, layer, layers, block_tokens, kv_heads,
     head_dim, max_blocks) = _vals(args)
    width = kv_heads * head_dim
    pos = _arr(mem, positions, rows, np.int32)
    tab = _arr(mem, table, table_rows * max_blocks, np.int32).reshape(table_rows, max_blocks)
    kv = _arr(mem, k, rows * width).reshape(rows, width), _arr(mem, v, rows * width).reshape(rows, width)
    p = _Pool(mem, pool, layers, block_tokens, kv_heads, head_dim)
    for r in range(rows):
        position = int(pos[r])
        if position < 0 or position >= max_blocks * block_tokens:
            continue
        blk = p.block(int(tab[r if table_rows == rows else 0, position // block_tokens]))
        with np.errstate(over="ignore"):
            for i, src in enumerate(kv):
                blk[layer, i, position % block_tokens] = src[r].reshape(kv_heads, head_dim).astype(H)


@register_sim_kernel("gp_flash_decode_split_paged")
def _flash_decode_split_paged(mem, grid, block, args) -> None:
    """Writes the slots of the splits that hold a key of their row, and nothing else (as the
    CUDA kernel, whose blocks past a row's length exit at once)."""
    (ws, q, pool, positions, table, batch, heads, kv_heads, head_dim, layer, layers,
     block_tokens, max_blocks, span, scale) = _vals(args)
    splits, width = grid[2], head_dim + 2
    pos = _arr(mem, positions, batch, np.int32)
    tab = _arr(mem, table, batch * max_blocks, np.int32).reshape(batch, max_blocks)
    p = _Pool(mem, pool, layers, block_tokens, kv_heads, head_dim)
    for b, nkeys in enumerate(reference.paged_decode_nkeys(pos, max_blocks * block_tokens)):
        kb, vb = p.gather(tab[b], layer, int(nkeys))
        qb = _arr(mem, q + HB * b * heads * head_dim, heads * head_dim, H).reshape(heads, head_dim)
        part = _strided(mem, ws + 4 * b * heads * splits * width, (splits, heads, width),
                        (width, splits * width, 1))
        for sp in range(-(-int(nkeys) // span)):
            j0, j1 = sp * span, min((sp + 1) * span, int(nkeys))
            part[sp] = reference.attention_partial_f16(qb, kb[j0:j1], vb[j0:j1], scale)


@register_sim_kernel("gp_flash_combine_paged")
def _flash_combine_paged(mem, grid, block, args) -> None:
    """Reads only the slots of the splits that ran (a slot past a row's length is never viewed)."""
    out, ws, positions, batch, heads, head_dim, capacity, span, splits = _vals(args)
    width = head_dim + 2
    pos = _arr(mem, positions, batch, np.int32)
    for b, nkeys in enumerate(reference.paged_decode_nkeys(pos, capacity)):
        ran = min(splits, -(-int(nkeys) // span))
        o = _arr(mem, out + HB * b * heads * head_dim, heads * head_dim, H)
        if ran == 0:
            o[:] = 0
            continue
        part = _strided(mem, ws + 4 * b * heads * splits * width, (ran, heads, width),
                        (width, splits * width, 1))
        o[:] = reference.attention_combine_f16(np.array(part)).reshape(-1)


@register_sim_kernel("gp_flash_decode_paged_cluster")
def _flash_decode_paged_cluster(mem, grid, block, args) -> None:
    """The whole decode in one kernel: each row over its actual keys, split into grid[0] CTAs
    times the parts it runs in (`parts`, or where part_keys > 0 min(parts, ceil(keys /
    part_keys)), as the CUDA kernel's CTAs), merged like the combine; a row with no key is
    zeros. In more than one part, the counters of the workspace decide as on the device: a
    (row, head block, rank) whose counter is not zero gets no merge, so its outputs are left
    unwritten and its counter goes up by the parts that ran."""
    (out, ws, q, pool, positions, table, batch, heads, kv_heads, head_dim, layer, layers,
     block_tokens, max_blocks, parts, part_keys, scale) = _vals(args[:17])
    if len(args) > 17:   # a TMA build (GP_FDC_TMA): the pool's map must describe this pool
        m = sim_tensor_map(args[17].value)
        row = kv_heads * head_dim * 2
        assert (m.address, m.sizes[:4], m.strides, m.box) == (
            pool, (head_dim, kv_heads, block_tokens, 2 * layers),
            (head_dim * 2, row, block_tokens * row, 2 * layers * block_tokens * row), (64, 1, 16, 1, 1)), m
    ctas = grid[0]
    pos = _arr(mem, positions, batch, np.int32)
    tab = _arr(mem, table, batch * max_blocks, np.int32).reshape(batch, max_blocks)
    if len(args) > 17:   # every block the table names inside the map (the TMA unit reads zeros past it)
        assert batch == 0 or int(tab.max()) < sim_tensor_map(args[17].value).sizes[4], "block past the map"
    p = _Pool(mem, pool, layers, block_tokens, kv_heads, head_dim)
    hblocks = grid[1] // parts
    group = heads // kv_heads
    hgroups = -(-group // DECODE_HEADS_PER_BLOCK)
    counters = None
    if parts > 1:   # the counters and the slots (scratch) the kernel touches
        units = batch * hblocks
        counters = _arr(mem, ws, units * CLUSTER_COUNTERS, np.uint32).reshape(units, CLUSTER_COUNTERS)
        _arr(mem, ws + 4 * units * CLUSTER_COUNTERS, units * parts * CLUSTER_SLOT_FLOATS)
    for b, nkeys in enumerate(reference.paged_decode_nkeys(pos, max_blocks * block_tokens)):
        o = _arr(mem, out + HB * b * heads * head_dim, heads * head_dim, H)
        n = int(nkeys)
        # the parts this row runs in (part_keys > 0: fewer for a short row; the rest leave)
        runs = min(parts, max(1, -(-n // part_keys))) if part_keys > 0 else parts
        if n == 0:
            result = np.zeros(heads * head_dim, H)
        else:
            kb, vb = p.gather(tab[b], layer, n)
            qb = _arr(mem, q + HB * b * heads * head_dim, heads * head_dim, H).reshape(heads, head_dim)
            per = -(-n // (ctas * runs))        # keys a CTA, rounded up to whole 16-key tiles
            span = -(-per // 16) * 16
            pieces = [reference.attention_partial_f16(qb, kb[j0:j0 + span], vb[j0:j0 + span], scale)
                      for j0 in range(0, n, span)]
            result = reference.attention_combine_f16(np.array(pieces)).reshape(-1)
        if counters is None or runs == 1:   # one part merges in its cluster alone
            o[:] = result
            continue
        for hb in range(hblocks):
            h0 = (hb // hgroups) * group + (hb % hgroups) * DECODE_HEADS_PER_BLOCK
            total = min(DECODE_HEADS_PER_BLOCK, group - (hb % hgroups) * DECODE_HEADS_PER_BLOCK) * head_dim
            unit = counters[b * hblocks + hb]
            for rank in range(ctas):
                lo, hi = h0 * head_dim + total * rank // ctas, h0 * head_dim + total * (rank + 1) // ctas
                if unit[rank] == 0:
                    o[lo:hi] = result[lo:hi]
                else:
                    unit[rank] += runs


@register_sim_kernel("gp_flash_prefill_paged")
def _flash_prefill_paged(mem, grid, block, args) -> None:
    (out, q, pool, start, chunk_len, table, tokens, heads, kv_heads, head_dim, layer, layers,
     block_tokens, max_blocks, scale) = _vals(args)
    s0 = int(_arr(mem, start, 1, np.int32)[0])
    n = int(_arr(mem, chunk_len, 1, np.int32)[0])
    rows = 0 if s0 < 0 else max(0, min(n, tokens))
    width = heads * head_dim
    o = _arr(mem, out, tokens * width, H).reshape(tokens, width)
    o[:] = 0
    valid = min(max(s0, 0) + rows, max_blocks * block_tokens)
    if rows == 0:
        return
    tab = _arr(mem, table, max_blocks, np.int32)
    kb, vb = _Pool(mem, pool, layers, block_tokens, kv_heads, head_dim).gather(tab, layer, valid)
    qq = _arr(mem, q, tokens * width, H).reshape(tokens, heads, head_dim)[:rows]
    o[:rows] = reference.attention_f16(qq, kb, vb, s0 + np.arange(rows), True, n_valid=valid,
                                scale=scale).reshape(rows, width)


@register_sim_kernel("gp_rotary_rows")
def _rotary_rows(mem, grid, block, args) -> None:
    x, positions, rows, heads, head_dim, row_stride, theta, inv_freq = _vals(args)
    table = _arr(mem, inv_freq, head_dim // 2) if inv_freq else None
    pos = _arr(mem, positions, rows, np.int32)
    xv = _strided(mem, x, (rows, heads, head_dim), (row_stride, head_dim, 1))
    xv[:] = reference.rotary_rows(np.array(xv), np.array(pos), np.float32(theta), table)


@register_sim_kernel("gp_sample")
def _sample(mem, grid, block, args) -> None:
    out, logits, positions, temperature, top_p, top_k, seed, rows, vocab = _vals(args)
    r = reference.sample(_arr(mem, logits, rows * vocab).reshape(rows, vocab),
                        _arr(mem, positions, rows, np.int32), _arr(mem, temperature, rows),
                        _arr(mem, top_p, rows), _arr(mem, top_k, rows, np.int32),
                        _arr(mem, seed, rows, np.int32))
    _arr(mem, out, rows, np.int32)[:] = r
