"""Device cases for the fp16 attention kernels (gpu_worker.kernels.flash_attention), run by the
CPU tests on the sim backend and by the GPU tests on the cuda backend, as selfcheck.CASES are.

fp16 in, fp32 accumulation, fp16 out: the kernels round P to fp16 before P.V (FlashAttention-2
does the same), so results are compared with rtol 1e-2 / atol 2e-3 against the fp32 reference of
the same fp16 inputs, rounded to fp16. That tolerance still fails an off-by-one in the causal
mask (tests/kernels/test_flash_attention.py proves it).
"""
from __future__ import annotations

import numpy as np

from gpu_worker.kernels.flash_attention import (
    FLASH_ATTENTION_COMBINE,
    FLASH_ATTENTION_DECODE_SPLIT,
    FLASH_ATTENTION_PREFILL,
    attention_f16,
    flash_decode_workspace_bytes,
    launch_flash_attention_decode,
    launch_flash_attention_prefill,
)
from gpu_worker.kernels.selfcheck import Case, KernelHarness, Outcome

RTOL, ATOL = 1e-2, 2e-3
H = np.float16


def _f16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(H)


def sample_rows(tokens: int, rows: int | None, rng: np.random.Generator) -> np.ndarray:
    """All rows, or `rows` of them: the first and last 8 (mask edges) and a random middle."""
    if rows is None or rows >= tokens:
        return np.arange(tokens)
    middle = rng.choice(np.arange(8, tokens - 8), rows - 16, replace=False)
    return np.unique(np.concatenate([np.arange(8), middle, np.arange(tokens - 8, tokens)]))


def flash_prefill_case(h: KernelHarness, rng, batch, tokens, heads, kv_heads, head_dim,
                       causal=True, past=0, past_arg=0, lens=None, rows=None) -> Outcome:
    """q from a padded buffer; K/V in cache layout (batch, max_len, kv_heads, head_dim) holding
    `past + past_arg` earlier rows (device past[] + past_len), then this chunk's rows. With
    `rows`, only that many query rows per sequence are checked (the reference is O(rows x keys))."""
    p = past + past_arg
    max_len = p + tokens + 3
    q_stride = heads * head_dim + 8
    kv_row = kv_heads * head_dim
    q = _f16(rng, batch * tokens, q_stride)
    kc, vc = _f16(rng, batch, max_len, kv_heads, head_dim), _f16(rng, batch, max_len, kv_heads, head_dim)
    out = h.put(np.full((batch * tokens, heads * head_dim), np.nan, H))
    launch_flash_attention_prefill(
        h.device, h.function(FLASH_ATTENTION_PREFILL), out, h.put(q), h.put(kc), h.put(vc),
        h.put(np.asarray(lens, np.int32)) if lens is not None else 0,
        h.put(np.full(batch, past, np.int32)) if past else 0, batch, tokens, heads, kv_heads,
        head_dim, q_stride, kv_row, max_len * kv_row, p - past, causal)
    got = h.get(out, (batch, tokens, heads * head_dim), H)
    picked = sample_rows(tokens, rows, rng)
    want = np.zeros((batch, picked.size, heads * head_dim), H)
    for b in range(batch):
        qb = q[b * tokens:(b + 1) * tokens, :heads * head_dim].reshape(tokens, heads, head_dim)
        valid = (tokens if lens is None else int(lens[b])) + p
        r = attention_f16(qb[picked], kc[b, :valid], vc[b, :valid], p + picked, causal)
        want[b] = r.reshape(picked.size, -1)
    return Outcome(got[:, picked].astype(np.float32), want.astype(np.float32), RTOL, ATOL)


def _decode_reference(q, kc, vc, lengths, len_add, max_len, heads, head_dim) -> np.ndarray:
    want = np.zeros((len(lengths), heads * head_dim), H)
    for b, length in enumerate(lengths):
        n = max(0, min(int(length) + len_add, max_len))
        want[b] = attention_f16(q[b, :heads * head_dim].reshape(1, heads, head_dim), kc[b, :n],
                                vc[b, :n], np.array([n - 1]), False).reshape(-1)
    return want


def flash_decode_case(h: KernelHarness, rng, batch, heads, kv_heads, head_dim, lengths, len_add=0,
                      max_len=None, splits=1, replay_lengths=None) -> Outcome:
    """Split-K decode (split kernel + combine) over an fp16 cache. With `replay_lengths`, the two
    launches are captured once and replayed after each change of the device lengths: the graph
    must not bake the length."""
    lengths = np.asarray(lengths, np.int32)
    steps = [lengths] + [np.asarray(x, np.int32) for x in (replay_lengths or [])]
    max_len = int(max(s.max() for s in steps)) + len_add + 2 if max_len is None else max_len
    q_stride = heads * head_dim + 8
    q = _f16(rng, batch, q_stride)
    kc, vc = _f16(rng, batch, max_len, kv_heads, head_dim), _f16(rng, batch, max_len, kv_heads, head_dim)
    kv_row = kv_heads * head_dim
    out = h.put(np.full((batch, heads * head_dim), np.nan, H))
    ws_bytes = flash_decode_workspace_bytes(batch=batch, heads=heads, head_dim=head_dim, splits=splits)
    ws = h.put(np.full(ws_bytes // 4, np.nan, np.float32))
    lens = h.put(lengths)
    qp, kp, vp = h.put(q), h.put(kc), h.put(vc)
    dev = h.device

    def launch(stream=None) -> None:
        launch_flash_attention_decode(
            dev, h.function(FLASH_ATTENTION_DECODE_SPLIT), h.function(FLASH_ATTENTION_COMBINE),
            out, ws, qp, kp, vp, lens, batch, heads, kv_heads, head_dim, q_stride, kv_row,
            max_len * kv_row, len_add, max_len, splits, stream=stream)

    if replay_lengths is None:
        launch()
        got = h.get(out, (batch, heads * head_dim), H)
        want = _decode_reference(q, kc, vc, lengths, len_add, max_len, heads, head_dim)
        return Outcome(got.astype(np.float32), want.astype(np.float32), RTOL, ATOL)
    with dev.capture() as cap:
        launch(cap.stream)
    got, want = [], []
    try:
        for step in steps:
            dev.to_device(lens, step)
            dev.replay(cap.graph_exec)
            got.append(h.get(out, (batch, heads * head_dim), H))
            want.append(_decode_reference(q, kc, vc, step, len_add, max_len, heads, head_dim))
    finally:
        dev.synchronize()
        dev.destroy_graph_exec(cap.graph_exec)
    return Outcome(np.stack(got).astype(np.float32), np.stack(want).astype(np.float32), RTOL, ATOL)


def _c(kernel: str, fn, covers: tuple[str, ...] = (), **shapes) -> Case:
    return Case(kernel, fn, shapes, covers)


PREFILL, SPLIT, COMBINE = ("flash_attention_prefill", "flash_attention_decode_split",
                           ("flash_attention_combine",))

# Small shapes for the sim and the GPU alike: rows not a multiple of the 64-row block, keys past
# one 64-key tile, GQA groups 1/2/4/8, a KV-cache prefix (chunked prefill), per-sequence lengths.
FLASH_CASES: list[Case] = [
    _c(PREFILL, flash_prefill_case, batch=1, tokens=1, heads=2, kv_heads=1, head_dim=64),
    _c(PREFILL, flash_prefill_case, batch=1, tokens=33, heads=4, kv_heads=2, head_dim=64),
    _c(PREFILL, flash_prefill_case, batch=1, tokens=130, heads=8, kv_heads=2, head_dim=128),
    _c(PREFILL, flash_prefill_case, batch=1, tokens=70, heads=8, kv_heads=1, head_dim=128,
       past=100, past_arg=7),
    _c(PREFILL, flash_prefill_case, batch=2, tokens=77, heads=4, kv_heads=4, head_dim=64,
       causal=False, lens=[77, 30]),
    _c(PREFILL, flash_prefill_case, batch=2, tokens=65, heads=4, kv_heads=2, head_dim=128,
       past=3, lens=[65, 1]),
    _c(SPLIT, flash_decode_case, COMBINE, batch=1, heads=4, kv_heads=2, head_dim=64, lengths=[1]),
    _c(SPLIT, flash_decode_case, COMBINE, batch=2, heads=8, kv_heads=2, head_dim=128,
       lengths=[7, 600], len_add=1),
    _c(SPLIT, flash_decode_case, COMBINE, batch=2, heads=6, kv_heads=1, head_dim=64,
       lengths=[700, 3], len_add=1, max_len=1000, splits=5),
    _c(SPLIT, flash_decode_case, COMBINE, batch=1, heads=4, kv_heads=4, head_dim=128,
       lengths=[0], max_len=64, splits=3),
    _c(SPLIT, flash_decode_case, COMBINE, batch=1, heads=4, kv_heads=1, head_dim=128,
       lengths=[300], max_len=600, splits=4, replay_lengths=[[301], [555]]),
]
