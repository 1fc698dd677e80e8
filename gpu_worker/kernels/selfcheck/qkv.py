"""Device cases for the fused QKV epilogue (qkv.py), run by the CPU tests on the sim backend and by
the GPU tests on the cuda backend, as selfcheck.CASES.

Every output byte is compared: q, and the whole KV cache or pool (so a write to a wrong slot,
layer, K/V plane or block, or a padding row's write, fails). Block tables are random permutations
(two rows never share a slot). q and K/V are fp16: one fp16 ulp (2^-11 relative) of slack covers
a rounding flip after an f32 rotation that contracts differently (fma) on the device.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.qkv import (
    QKV_ROPE_APPEND,
    QKV_ROPE_APPEND_PAGED,
    launch_qkv_rope_append,
    launch_qkv_rope_append_paged,
)
from gpu_worker.kernels.selfcheck import Case, KernelHarness, Outcome

H = np.float16
RTOL, ATOL = 1e-3, 1e-3


def _inputs(rng, rows, heads, kv_heads, head_dim, bias, table):
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rng.standard_normal((rows, width), dtype=np.float32)
    b = rng.standard_normal(width, dtype=np.float32) * np.float32(0.1) if bias else None
    inv = (rng.random(head_dim // 2) * 0.5).astype(np.float32) if table else None
    return qkv, b, inv


def qkv_rope_append_paged_case(h: KernelHarness, rng, positions, heads, kv_heads, head_dim,
                               table_rows=None, layers=2, layer=1, block_tokens=16,
                               max_blocks=4, bias=False, table=False,
                               theta=500000.0) -> Outcome:
    """Rows at `positions` (-1: padding: q zero, nothing appended) into a random pool."""
    positions = np.asarray(positions, np.int32)
    rows = positions.size
    table_rows = rows if table_rows is None else table_rows
    qkv, b, inv = _inputs(rng, rows, heads, kv_heads, head_dim, bias, table)
    capacity = table_rows * max_blocks + 2
    pool = rng.standard_normal((capacity, layers, 2, block_tokens, kv_heads, head_dim),
                               dtype=np.float32).astype(H)
    tab = rng.permutation(capacity)[:table_rows * max_blocks].reshape(table_rows, max_blocks)
    tab = tab.astype(np.int32)
    qw = heads * head_dim
    q_out, pp = h.put(np.full((rows, qw), np.nan, H)), h.put(pool)
    launch_qkv_rope_append_paged(h.device, h.function(QKV_ROPE_APPEND_PAGED), q_out, pp,
                                 h.put(qkv), h.put(b) if bias else 0, h.put(positions),
                                 h.put(tab), rows, table_rows, heads, kv_heads, head_dim, theta,
                                 layer, layers, block_tokens, max_blocks,
                                 inv_freq=h.put(inv) if table else 0)
    want_q, want_pool = ref.qkv_rope_append_paged(qkv, b, positions, tab, pool, layer, heads,
                                                  kv_heads, np.float32(theta), inv)
    got = np.concatenate([h.get(q_out, (rows, qw), H).reshape(-1),
                          h.get(pp, pool.shape, H).reshape(-1)])
    want = np.concatenate([want_q.reshape(-1), want_pool.reshape(-1)])
    return Outcome(got.astype(np.float32), want.astype(np.float32), RTOL, ATOL)


def qkv_rope_append_case(h: KernelHarness, rng, tokens, start, heads, kv_heads, head_dim,
                         max_len=64, q_half=True, bias=False, table=False,
                         theta=10000.0) -> Outcome:
    """One sequence's tokens at start.. into contiguous fp16 caches (rows past max_len dropped)."""
    qkv, b, inv = _inputs(rng, tokens, heads, kv_heads, head_dim, bias, table)
    shape = (max_len, kv_heads, head_dim)
    kc = rng.standard_normal(shape, dtype=np.float32).astype(H)
    vc = rng.standard_normal(shape, dtype=np.float32).astype(H)
    qw = heads * head_dim
    qdt = H if q_half else np.float32
    q_out, kp, vp = h.put(np.full((tokens, qw), np.nan, qdt)), h.put(kc), h.put(vc)
    launch_qkv_rope_append(h.device, h.function(QKV_ROPE_APPEND), q_out, kp, vp, h.put(qkv),
                           h.put(b) if bias else 0, h.put(np.array([start], np.int32)), tokens,
                           heads, kv_heads, head_dim, theta, max_len, q_half=q_half,
                           inv_freq=h.put(inv) if table else 0)
    want_q, want_k, want_v = ref.qkv_rope_append(qkv, b, start, kc, vc, heads, kv_heads,
                                                 np.float32(theta), inv, q_half)
    got = np.concatenate([h.get(q_out, (tokens, qw), qdt).reshape(-1).astype(np.float32),
                          h.get(kp, shape, H).reshape(-1).astype(np.float32),
                          h.get(vp, shape, H).reshape(-1).astype(np.float32)])
    want = np.concatenate([want_q.reshape(-1).astype(np.float32),
                           want_k.reshape(-1).astype(np.float32),
                           want_v.reshape(-1).astype(np.float32)])
    return Outcome(got, want, RTOL if q_half else 1e-5, ATOL if q_half else 1e-5)


def _c(kernel: str, fn, **shapes) -> Case:
    return Case(kernel, fn, shapes)


PAGED, SINGLE = "qkv_rope_append_paged", "qkv_rope_append"

# Small shapes for the sim and the GPU alike: head dims 16/64/128 (and an odd pair count), GQA
# groups 1..4, padding rows, positions on block edges, a one-row table (a prefill chunk), a bias,
# a rescaled frequency table, positions past the table (q rotated, nothing appended).
QKV_CASES: list[Case] = [
    _c(PAGED, qkv_rope_append_paged_case, positions=[0, 15, 16, 63], heads=4, kv_heads=2,
       head_dim=16),
    _c(PAGED, qkv_rope_append_paged_case, positions=[5, -1, 6, 7, 40], heads=2, kv_heads=1,
       head_dim=64, table_rows=1, block_tokens=32, max_blocks=2, bias=True),
    _c(PAGED, qkv_rope_append_paged_case, positions=[130, -1, 8191], heads=8, kv_heads=2,
       head_dim=128, block_tokens=128, layers=3, layer=0, max_blocks=2, table=True),
    _c(PAGED, qkv_rope_append_paged_case, positions=[3, 2, 1], heads=3, kv_heads=3, head_dim=10,
       bias=True, table=True),
    _c(PAGED, qkv_rope_append_paged_case, positions=[0, 511, -1, 4000, 77], heads=32, kv_heads=8,
       head_dim=128, block_tokens=16, max_blocks=256, table=True),   # Llama-3-8B: 5 head groups
    _c(SINGLE, qkv_rope_append_case, tokens=1, start=0, heads=4, kv_heads=2, head_dim=16),
    _c(SINGLE, qkv_rope_append_case, tokens=7, start=5, heads=4, kv_heads=2, head_dim=16,
       q_half=False, bias=True),
    _c(SINGLE, qkv_rope_append_case, tokens=33, start=40, heads=8, kv_heads=2, head_dim=64,
       max_len=64, table=True),       # rows past the cache: q rotated, nothing appended
    _c(SINGLE, qkv_rope_append_case, tokens=5, start=1000, heads=4, kv_heads=1, head_dim=128,
       max_len=1024, theta=500000.0, bias=True),
]
