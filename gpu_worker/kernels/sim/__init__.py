"""The sim backend's kernels: NumPy over simulated device memory, one per CUDA entry point.

Test double, not product: the sim backend runs these instead of the NVRTC image. Each takes the
CUDA kernel's exact argument list, views the bytes the CUDA kernel would touch through
`mem.view(ptr, nbytes)` (which raises IllegalAddress on an unmapped byte, so a use-after-free or an
out-of-bounds launch fails on the sim as it would on the device), and computes the result with the
reference in gpu_worker.kernels.reference. Lengths read from device int32s are read from simulated
memory at run time, so a replayed sim graph sees the current values exactly as a CUDA graph does.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from gpu_worker.device.backend import KernelArg
from gpu_worker.device.sim_kernels import SimTensorMap, register_sim_kernel, sim_tensor_map
from gpu_worker.kernels import reference
from gpu_worker.kernels.int4_batched import (
    MAX_SPLIT,
    MMA_K_ALIGN,
    MMA_MAX_ROWS,
    ROWS_MAX_ROWS,
    XA_MIN_ROWS,
    XA_NT,
    XK_BUILDS,
    rows_untiled,
    xa_tile,
    xk_rows,
)
from gpu_worker.kernels.quantize import QUANT_BLOCK, STORED_DTYPES


def _vals(args: Sequence[KernelArg]) -> list:
    return [a.value for a in args]


def _arr(mem, p: int, count: int, dtype=np.float32) -> np.ndarray:
    dt = np.dtype(dtype)
    if count <= 0:
        return np.empty(0, dt)
    return mem.view(p, count * dt.itemsize).view(dt)


def _strided(mem, p: int, shape: tuple[int, ...], strides: tuple[int, ...],
             dtype=np.float32) -> np.ndarray:
    """A view of shape `shape` with element `strides` touching only the bytes it addresses."""
    dt = np.dtype(dtype)
    if any(n <= 0 for n in shape):
        return np.empty(tuple(max(n, 0) for n in shape), dt)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    base = _arr(mem, p, span, dt)
    return as_strided(base, shape, tuple(s * dt.itemsize for s in strides))


def _opt_i32(mem, p: int, index: int) -> int:
    """An optional device int32 per sequence (0 pointer = 0)."""
    return int(_arr(mem, p + 4 * index, 1, np.int32)[0]) if p else 0


@register_sim_kernel("gp_embedding_gather")
def _embedding_gather(mem, grid, block, args) -> None:
    out, table, ids, rows, hidden, vocab, accumulate = _vals(args)
    ids_v = _arr(mem, ids, rows, np.int32)
    tab = _arr(mem, table, vocab * hidden, np.float16).reshape(vocab, hidden)
    o = _arr(mem, out, rows * hidden).reshape(rows, hidden)
    r = reference.embedding_gather(tab, ids_v)
    o[:] = o + r if accumulate else r


@register_sim_kernel("gp_rmsnorm")
def _rmsnorm(mem, grid, block, args) -> None:
    out, x, w, rows, hidden, eps = _vals(args)
    xv = _arr(mem, x, rows * hidden).reshape(rows, hidden)
    r = reference.rmsnorm(xv, _arr(mem, w, hidden), np.float32(eps))
    _arr(mem, out, rows * hidden).reshape(rows, hidden)[:] = r


@register_sim_kernel("gp_rmsnorm_f16")
def _rmsnorm_f16(mem, grid, block, args) -> None:
    out, x, w, rows, hidden, eps = _vals(args)
    xv = _arr(mem, x, rows * hidden).reshape(rows, hidden)
    r = reference.rmsnorm_f16(xv, _arr(mem, w, hidden), np.float32(eps))
    _arr(mem, out, rows * hidden, np.float16).reshape(rows, hidden)[:] = r


@register_sim_kernel("gp_layernorm")
def _layernorm(mem, grid, block, args) -> None:
    out, x, w, b, rows, hidden, eps = _vals(args)
    xv = _arr(mem, x, rows * hidden).reshape(rows, hidden)
    bias = _arr(mem, b, hidden) if b else None
    r = reference.layernorm(xv, _arr(mem, w, hidden), bias, np.float32(eps))
    _arr(mem, out, rows * hidden).reshape(rows, hidden)[:] = r


def _int4_weight(mem, packed: int, scales: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    kb = reference.int4_blocks(k)
    return (_arr(mem, packed, n * kb * 16, np.uint8).reshape(n, kb * 16),
            _arr(mem, scales, n * kb, np.float16).reshape(n, kb))


@register_sim_kernel("gp_int4_dequant")
def _int4_dequant(mem, grid, block, args) -> None:
    ws, packed, scales, n, k = _vals(args)
    pk, sc = _int4_weight(mem, packed, scales, n, k)
    _arr(mem, ws, n * k).reshape(n, k)[:] = reference.int4_dequantize(pk, sc, k)


def _store(mem, y: int, m: int, n: int, r: np.ndarray, accumulate: int) -> None:
    yv = _arr(mem, y, m * n).reshape(m, n)
    yv[:] = yv + r if accumulate else r


@register_sim_kernel("gp_int4_quantize")
def _int4_quantize(mem, grid, block, args) -> None:
    packed, scales, raw, code, blocks = _vals(args)
    dtype = next(name for name, c in STORED_DTYPES.items() if c == code)
    stored = _arr(mem, raw, blocks * QUANT_BLOCK, _STORED_NP[dtype]).reshape(blocks, QUANT_BLOCK)
    pk, sc = reference.int4_quantize_stored(stored, dtype)
    _arr(mem, packed, blocks * 16, np.uint8)[:] = pk.reshape(-1)
    _arr(mem, scales, blocks, np.float16)[:] = sc.reshape(-1)


_STORED_NP = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


@register_sim_kernel("gp_matmul_nt")
@register_sim_kernel("gp_matmul_nt_large")
def _matmul_nt(mem, grid, block, args) -> None:
    y, x, w, bias, m, n, k, accumulate = _vals(args)
    r = reference.matmul_nt(_arr(mem, x, m * k).reshape(m, k), _arr(mem, w, n * k).reshape(n, k),
                            _arr(mem, bias, n) if bias else None)
    _store(mem, y, m, n, r, accumulate)


def _int4_linear(mem, y, x, packed, scales, bias, m, n, k, accumulate) -> None:
    """Every int4 linear's contract (reference.int4_matmul) into y, + y when `accumulate`."""
    pk, sc = _int4_weight(mem, packed, scales, n, k)
    _int4_apply(mem, y, x, pk, sc, bias, m, n, k, accumulate)


def _int4_linear_tiled(mem, y, x, packed, scales, bias, m, n, k, accumulate) -> None:
    """_int4_linear over weights in int4_batched.rows_tiled's layout (whole 16-row tiles,
    padding rows included)."""
    pk, sc = _int4_weight(mem, packed, scales, -(-n // 16) * 16, k)
    pk, sc = rows_untiled(pk.reshape(-1), sc.reshape(-1), n, k)
    _int4_apply(mem, y, x, pk, sc, bias, m, n, k, accumulate)


def _int4_apply(mem, y, x, pk: np.ndarray, sc: np.ndarray, bias, m, n, k, accumulate) -> None:
    r = reference.int4_matmul(_arr(mem, x, m * k, np.float16).reshape(m, k), pk, sc,
                              _arr(mem, bias, n) if bias else None)
    _store(mem, y, m, n, r, accumulate)


@register_sim_kernel("gp_int4_matmul")
def _int4_matmul(mem, grid, block, args) -> None:
    y, x, packed, scales, bias, m, n, k, accumulate = _vals(args)
    _int4_linear(mem, y, x, packed, scales, bias, m, n, k, accumulate)


@register_sim_kernel("gp_int4_mma")
def _int4_mma(mem, grid, block, args) -> None:
    y, x, packed, scales, bias, m, n, k, accumulate, mt = _vals(args)
    # the CUDA grid covers 16 * mt weight rows per block: a short grid leaves rows unwritten
    assert grid[0] * 16 * mt >= n and mt in (1, 2, 4) and block[0] == 256, (grid, block, mt)
    _int4_linear(mem, y, x, packed, scales, bias, m, n, k, accumulate)


def _int4_mma_xa(tiled: bool):
    def run(mem, grid, block, args) -> None:
        y, x, packed, scales, bias, m, n, k, accumulate, nt = _vals(args)
        # the CUDA grid is (split, tiles of xa_tile rows): a short grid leaves rows unwritten
        assert grid[1] * xa_tile(m, nt)[0] >= n and nt in XA_NT and block[0] == 256, (grid, block,
                                                                                      nt)
        assert 1 <= grid[0] <= min(MAX_SPLIT, k // MMA_K_ALIGN), grid
        assert 1 <= m <= MMA_MAX_ROWS, m
        if tiled:
            _int4_linear_tiled(mem, y, x, packed, scales, bias, m, n, k, accumulate)
        else:
            _int4_linear(mem, y, x, packed, scales, bias, m, n, k, accumulate)
    return run


register_sim_kernel("gp_int4_mma_xa")(_int4_mma_xa(False))
register_sim_kernel("gp_int4_mma_xa_tiled")(_int4_mma_xa(True))


def _int4_mma_xk(nt: int):
    def run(mem, grid, block, args) -> None:
        y, x, packed, scales, bias, m, n, k, accumulate, wk = _vals(args)
        # the CUDA grid is (split, tiles of xk_rows): a short grid leaves rows unwritten
        assert (nt, wk) in XK_BUILDS, (nt, wk)
        assert grid[1] * xk_rows(nt, wk) >= n and block[0] == 256, (grid, block, nt, wk)
        assert 1 <= grid[0] <= min(MAX_SPLIT, k // MMA_K_ALIGN), grid
        assert XA_MIN_ROWS <= m <= MMA_MAX_ROWS, m
        _int4_linear(mem, y, x, packed, scales, bias, m, n, k, accumulate)
    return run


register_sim_kernel("gp_int4_mma_xk4")(_int4_mma_xk(4))
register_sim_kernel("gp_int4_mma_xk8")(_int4_mma_xk(8))


def _int4_wgmma(tiled: bool):
    def run(mem, grid, block, args) -> None:
        y, x, packed, scales, bias, m, n, k, accumulate, xmap, *wmaps = _vals(args)
        # the CUDA grid covers 64 weight rows per warpgroup: a short grid leaves rows unwritten
        assert grid[1] * block[0] // 2 >= n and m <= MMA_MAX_ROWS and block[0] % 128 == 0, \
            (grid, block, m)
        # x is read through its tensor map: boxes of 64 k x 64 rows of x's m rows of k
        x_rows = sim_tensor_map(xmap).box[1]   # the build's GP_WG_N
        assert m <= x_rows and sim_tensor_map(xmap) == SimTensorMap(
            x, (k, m), (2 * k,), (64, x_rows), 2, 128), (sim_tensor_map(xmap), x, m, k)
        if wmaps:   # GP_WG_WTMA: the tiles' weights and scales too, a tile's K a row of u64
            kg, tiles = k // 128, block[0] // 128 * 4
            assert tiled and [sim_tensor_map(w) for w in wmaps] == [
                SimTensorMap(packed, (kg * 128, n // 16), (kg * 1024,), (128, tiles), 8, 0),
                SimTensorMap(scales, (kg * 16, n // 16), (kg * 128,), (16, tiles), 8, 0)], wmaps
        (_int4_linear_tiled if tiled else _int4_linear)(mem, y, x, packed, scales, bias, m, n, k,
                                                         accumulate)
    return run


register_sim_kernel("gp_int4_wgmma")(_int4_wgmma(False))
register_sim_kernel("gp_int4_wgmma_tiled")(_int4_wgmma(True))


def _int4_rows(mem, grid, block, args, max_rows: int, persistent: bool = False,
               tiled: bool = False) -> None:
    y, x, packed, scales, bias, m, n, k, accumulate = _vals(args)
    # the CUDA grid covers 16 weight rows per block: a short grid leaves rows unwritten (a
    # persistent grid's blocks loop over the tiles: at most one block per tile)
    tiles = -(-n // 16)
    covered = 1 <= grid[0] <= tiles if persistent else grid[0] * 16 >= n
    assert covered and m <= max_rows and block[0] in (128, 256, 512), (grid, block, m)
    (_int4_linear_tiled if tiled else _int4_linear)(mem, y, x, packed, scales, bias, m, n, k,
                                                     accumulate)


# the rows entries: (entry, rows it takes, a persistent grid, weights in the 16-row tile layout)
for _entry, _max_rows, _persistent, _tiled in (
        ("gp_int4_mma_rows", 8, False, False), ("gp_int4_mma_rows16", ROWS_MAX_ROWS, False, False),
        ("gp_int4_mma_rows_tiled", 8, False, True),
        ("gp_int4_mma_rows16_tiled", ROWS_MAX_ROWS, False, True),
        ("gp_int4_mma_rows_async", 8, True, False),
        ("gp_int4_mma_rows16_async", ROWS_MAX_ROWS, True, False)):
    register_sim_kernel(_entry)(functools.partial(_int4_rows, max_rows=_max_rows,
                                                  persistent=_persistent, tiled=_tiled))


@register_sim_kernel("gp_rotary")
def _rotary(mem, grid, block, args) -> None:
    x, pos, batch, tokens, heads, head_dim, row_stride, pos_offset, theta, inv_freq = _vals(args)
    table = _arr(mem, inv_freq, head_dim // 2) if inv_freq else None
    for b in range(batch):
        xb = _strided(mem, x + 4 * b * tokens * row_stride, (tokens, heads, head_dim),
                      (row_stride, head_dim, 1))
        start = _opt_i32(mem, pos, b) + pos_offset
        xb[:] = reference.rotary(np.array(xb), np.arange(start, start + tokens), np.float32(theta),
                                  table)


def _kv_view(mem, p: int, shape, strides, kvt) -> np.ndarray:
    """K/V rows as float32 (an fp16 cache is upcast, as the kernels' gp_ld does)."""
    return np.asarray(_strided(mem, p, shape, strides, kvt), np.float32)


def _attention_prefill(mem, grid, block, args, kvt=np.float32) -> None:
    (out, q, k, v, lens, past, batch, tokens, heads, kv_heads, head_dim, q_row_stride,
     kv_row_stride, kv_batch_stride, past_len, causal, scale) = _vals(args)
    isz = np.dtype(kvt).itemsize
    for b in range(batch):
        p = _opt_i32(mem, past, b) + past_len
        valid = (_opt_i32(mem, lens, b) if lens else tokens) + p
        nkeys = max(0, min(p + tokens, valid) if causal else valid)
        qb = _strided(mem, q + 4 * b * tokens * q_row_stride, (tokens, heads, head_dim),
                      (q_row_stride, head_dim, 1))
        kv_shape, kv_strides = (nkeys, kv_heads, head_dim), (kv_row_stride, head_dim, 1)
        kb = _kv_view(mem, k + isz * b * kv_batch_stride, kv_shape, kv_strides, kvt)
        vb = _kv_view(mem, v + isz * b * kv_batch_stride, kv_shape, kv_strides, kvt)
        r = reference.attention(qb, kb, vb, p + np.arange(tokens), bool(causal), n_valid=valid,
                                scale=scale)
        ob = _arr(mem, out + 4 * b * tokens * heads * head_dim, tokens * heads * head_dim)
        ob[:] = r.reshape(-1)


def _attention_decode(mem, grid, block, args, kvt=np.float32) -> None:
    (out, q, k, v, lens, batch, heads, kv_heads, head_dim, q_row_stride, kv_row_stride,
     kv_batch_stride, len_add, max_len, scale) = _vals(args)
    isz = np.dtype(kvt).itemsize
    for b in range(batch):
        nkeys = max(0, min(_opt_i32(mem, lens, b) + len_add, max_len))
        qb = _arr(mem, q + 4 * b * q_row_stride, heads * head_dim).reshape(1, heads, head_dim)
        kv_shape, kv_strides = (nkeys, kv_heads, head_dim), (kv_row_stride, head_dim, 1)
        kb = _kv_view(mem, k + isz * b * kv_batch_stride, kv_shape, kv_strides, kvt)
        vb = _kv_view(mem, v + isz * b * kv_batch_stride, kv_shape, kv_strides, kvt)
        r = reference.attention(qb, kb, vb, np.array([nkeys - 1]), False, scale=scale)
        _arr(mem, out + 4 * b * heads * head_dim, heads * head_dim)[:] = r.reshape(-1)


def _kv_append(mem, grid, block, args, kvt=np.float32) -> None:
    (k_cache, v_cache, k, v, pos, batch, tokens, kv_heads, head_dim, src_row_stride,
     kv_row_stride, kv_batch_stride, pos_offset, max_len) = _vals(args)
    isz = np.dtype(kvt).itemsize
    width = kv_heads * head_dim
    for b in range(batch):
        start = _opt_i32(mem, pos, b) + pos_offset
        t0, t1 = max(0, -start), min(tokens, max_len - start)  # rows inside [0, max_len)
        if t1 <= t0:
            continue
        shape = (t1 - t0, width)
        for cache, src in ((k_cache, k), (v_cache, v)):
            s = _strided(mem, src + 4 * (b * tokens + t0) * src_row_stride, shape, (src_row_stride, 1))
            d = _strided(mem, cache + isz * (b * kv_batch_stride + (start + t0) * kv_row_stride),
                         shape, (kv_row_stride, 1), kvt)
            with np.errstate(over="ignore"):
                d[:] = s.astype(kvt)    # round to nearest even, as cvt.rn.f16.f32


register_sim_kernel("gp_attention_prefill")(_attention_prefill)   # f32 K/V: the encoder
for _entry, _fn in (("gp_attention_prefill", _attention_prefill),
                    ("gp_attention_decode", _attention_decode),
                    ("gp_kv_append", _kv_append)):
    register_sim_kernel(_entry + "_kv16")(
        lambda mem, grid, block, args, _fn=_fn: _fn(mem, grid, block, args, np.float16))


@register_sim_kernel("gp_silu_gate")
def _silu_gate(mem, grid, block, args) -> None:
    out, gate, up, rows, cols, gate_stride, up_stride = _vals(args)
    g = _strided(mem, gate, (rows, cols), (gate_stride, 1))
    u = _strided(mem, up, (rows, cols), (up_stride, 1))
    _arr(mem, out, rows * cols).reshape(rows, cols)[:] = reference.silu_gate(g, u)


@register_sim_kernel("gp_silu_gate_f16")
def _silu_gate_f16(mem, grid, block, args) -> None:
    out, gate, up, rows, cols, gate_stride, up_stride = _vals(args)
    g = _strided(mem, gate, (rows, cols), (gate_stride, 1))
    u = _strided(mem, up, (rows, cols), (up_stride, 1))
    r = reference.silu_gate_f16(g, u)
    _arr(mem, out, rows * cols, np.float16).reshape(rows, cols)[:] = r


@register_sim_kernel("gp_gelu")
def _gelu(mem, grid, block, args) -> None:
    out, x, n, exact = _vals(args)
    _arr(mem, out, n)[:] = reference.gelu(_arr(mem, x, n), bool(exact))


@register_sim_kernel("gp_add")
def _add(mem, grid, block, args) -> None:
    out, a, b, n = _vals(args)
    _arr(mem, out, n)[:] = reference.add(_arr(mem, a, n), _arr(mem, b, n))


@register_sim_kernel("gp_bias_add")
def _bias_add(mem, grid, block, args) -> None:
    out, x, bias, rows, cols = _vals(args)
    r = reference.bias_add(_arr(mem, x, rows * cols).reshape(rows, cols), _arr(mem, bias, cols))
    _arr(mem, out, rows * cols).reshape(rows, cols)[:] = r


@register_sim_kernel("gp_add_i32")
def _add_i32(mem, grid, block, args) -> None:
    p, delta, n = _vals(args)
    v = _arr(mem, p, n, np.int32)
    v[:] = v + np.int32(delta)


@register_sim_kernel("gp_argmax")
def _argmax(mem, grid, block, args) -> None:
    out, x, rows, cols = _vals(args)
    r = reference.argmax(_arr(mem, x, rows * cols).reshape(rows, cols))
    _arr(mem, out, rows, np.int32)[:] = r


@register_sim_kernel("gp_mean_pool")
def _mean_pool(mem, grid, block, args) -> None:
    out, x, lens, batch, seq, hidden = _vals(args)
    lv = _arr(mem, lens, batch, np.int32) if lens else None
    r = reference.mean_pool(_arr(mem, x, batch * seq * hidden).reshape(batch, seq, hidden), lv)
    _arr(mem, out, batch * hidden).reshape(batch, hidden)[:] = r


@register_sim_kernel("gp_int4_dequant_f16")
def _int4_dequant_f16(mem, grid, block, args) -> None:
    w16, packed, scales, row0, rows, k = _vals(args)
    kb = reference.int4_blocks(k)
    pk = _arr(mem, packed + row0 * kb * 16, rows * kb * 16, np.uint8).reshape(rows, kb * 16)
    sc = _arr(mem, scales + row0 * kb * 2, rows * kb, np.float16).reshape(rows, kb)
    _arr(mem, w16, rows * k, np.float16).reshape(rows, k)[:] = reference.int4_dequantize_f16(pk, sc, k)


@register_sim_kernel("gp_int4_dequant_f16_tiled")
def _int4_dequant_f16_tiled(mem, grid, block, args) -> None:
    w16, packed, scales, row0, rows, k = _vals(args)
    # rows [row0, row0 + rows) start a tile; their whole tiles are the reference layout's bytes
    # of the same rows, permuted within
    kb, rows16 = k // 32, -(-rows // 16) * 16
    pk = _arr(mem, packed + row0 * kb * 16, rows16 * kb * 16, np.uint8)
    sc = _arr(mem, scales + row0 * kb * 2, rows16 * kb, np.float16)
    pk, sc = rows_untiled(pk, sc, rows, k)
    _arr(mem, w16, rows * k, np.float16).reshape(rows, k)[:] = reference.int4_dequantize_f16(pk, sc, k)


@register_sim_kernel("gp_to_f16")
def _to_f16(mem, grid, block, args) -> None:
    out, x, n = _vals(args)
    _arr(mem, out, n, np.float16)[:] = reference.to_f16(_arr(mem, x, n))


# The families' sim kernels register themselves on import (they use the helpers above).
from gpu_worker.kernels.sim import flash as _flash  # noqa: F401
from gpu_worker.kernels.sim import paged as _paged  # noqa: F401
from gpu_worker.kernels.sim import qkv as _qkv  # noqa: F401
