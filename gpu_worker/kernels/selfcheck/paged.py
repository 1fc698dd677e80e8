"""Device cases for the batched-decode kernels (paged_attention.py, rotary_rows, sampling.py), run
by the CPU tests on the sim backend and by the GPU tests on the cuda backend, as selfcheck.CASES.

Block tables are random (blocks scattered over the pool, shared between sequences), so a kernel
that ignores the table or mixes up layer / K-V / slot offsets reads the wrong bytes and fails.
Attention tolerances are selfcheck.flash's (fp16 P before P.V); sampling compares token ids
exactly.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.flash_attention import DECODE_HEADS_PER_BLOCK
from gpu_worker.kernels.paged_attention import (
    CLUSTER_COUNTERS,
    FLASH_COMBINE_PAGED,
    FLASH_DECODE_SPLIT_PAGED,
    FLASH_PREFILL_PAGED,
    KV_APPEND_PAGED,
    ClusterBuild,
    cluster_decode_workspace_bytes,
    decode_cluster_build,
    launch_flash_decode_paged,
    launch_flash_decode_paged_cluster,
    launch_flash_prefill_paged,
    launch_kv_append_paged,
    paged_decode_span,
    paged_decode_splits,
    paged_decode_workspace_bytes,
)
from gpu_worker.kernels.reference import (
    flash_decode_paged,
    flash_decode_paged_partials,
    flash_prefill_paged,
    kv_append_paged,
)
from gpu_worker.kernels.rotary import ROTARY_ROWS, launch_rotary_rows
from gpu_worker.kernels.sampling import SAMPLE, launch_sample
from gpu_worker.kernels.selfcheck import Case, KernelHarness, Outcome
from gpu_worker.kernels.selfcheck.flash import ATOL, RTOL, sample_rows

H = np.float16


def _pool(rng, capacity, layers, block_tokens, kv_heads, head_dim) -> np.ndarray:
    shape = (capacity, layers, 2, block_tokens, kv_heads, head_dim)
    return rng.standard_normal(shape, dtype=np.float32).astype(H)


def _tables(rng, rows, max_blocks, capacity) -> np.ndarray:
    return rng.integers(0, capacity, (rows, max_blocks)).astype(np.int32)


def kv_append_paged_case(h: KernelHarness, rng, positions, table_rows, layers=2, layer=1,
                         block_tokens=16, kv_heads=2, head_dim=16, max_blocks=4) -> Outcome:
    """Rows at `positions` (-1: padding, no write) into a pool; every byte of the pool compared,
    so a write to a wrong slot, layer, block or a padding row's write fails."""
    positions = np.asarray(positions, np.int32)
    rows, width = positions.size, kv_heads * head_dim
    capacity = table_rows * max_blocks + 2
    pool = _pool(rng, capacity, layers, block_tokens, kv_heads, head_dim)
    # distinct blocks per (row, block index) so two rows never write the same slot
    table = rng.permutation(capacity)[:table_rows * max_blocks].reshape(table_rows, max_blocks)
    table = table.astype(np.int32)
    k = rng.standard_normal((rows, width), dtype=np.float32)
    v = rng.standard_normal((rows, width), dtype=np.float32)
    pp = h.put(pool)
    launch_kv_append_paged(h.device, h.function(KV_APPEND_PAGED), pp, h.put(k), h.put(v),
                           h.put(positions), h.put(table), rows, table_rows, layer, layers,
                           block_tokens, kv_heads, head_dim, max_blocks)
    want = kv_append_paged(pool, k, v, positions, table, layer)
    return Outcome(h.get(pp, pool.shape, H).astype(np.float32), want.astype(np.float32), 0, 0)


def _replayed(dev, launch, steps, before, result) -> Outcome:
    """`launch` captured once, then per step: `before(step)` (the device inputs), a replay, and
    `result(step)` -> (got, want); the outcome stacks every step's."""
    with dev.capture() as cap:
        launch(cap.stream)
    got, wanted = [], []
    try:
        for step in steps:
            before(step)
            dev.replay(cap.graph_exec)
            g, w = result(step)
            got.append(g)
            wanted.append(w)
    finally:
        dev.synchronize()
        dev.destroy_graph_exec(cap.graph_exec)
    return Outcome(np.stack(got), np.stack(wanted), RTOL, ATOL)


def paged_decode_case(h: KernelHarness, rng, heads, kv_heads, head_dim, positions,
                      block_tokens=16, layers=2, layer=1, max_blocks=None, capacity=None,
                      span=None, replay_positions=None) -> Outcome:
    """Split-K paged decode (split kernel + combine), split by each row's actual length, for a
    batch at per-row positions (-1 rows must come out zero). The workspace starts as NaN and is
    compared too: the slot of every split that holds a key must carry its partial state, every
    other slot must still be NaN (a block past its row's length wrote nothing) and the output
    shows the combine read no such slot. With `replay_positions`, the launches are captured once
    and replayed after each change of the device positions (the graph must not bake them)."""
    steps = [np.asarray(positions, np.int32)] + [np.asarray(x, np.int32) for x in (replay_positions or [])]
    batch = steps[0].size
    need = max(int(s.max()) for s in steps) + 1
    max_blocks = max_blocks or -(-need // block_tokens) + 1
    capacity = capacity or max(4, min(batch * max_blocks, 4096))
    span = span or paged_decode_span(max_blocks, block_tokens, batch, heads, kv_heads)
    splits = paged_decode_splits(max_blocks, block_tokens, span)
    pool = _pool(rng, capacity, layers, block_tokens, kv_heads, head_dim)
    table = _tables(rng, batch, max_blocks, capacity)
    q = rng.standard_normal((batch, heads * head_dim), dtype=np.float32).astype(H)
    out = h.put(np.full((batch, heads * head_dim), np.nan, H))
    ws_bytes = paged_decode_workspace_bytes(batch=batch, heads=heads, head_dim=head_dim, splits=splits)
    nan_ws = np.full(ws_bytes // 4, np.nan, np.float32)
    ws = h.put(nan_ws)
    pos = h.put(steps[0])
    qp, pp, tp = h.put(q), h.put(pool), h.put(table)
    dev = h.device
    fs, fc = h.function(FLASH_DECODE_SPLIT_PAGED), h.function(FLASH_COMBINE_PAGED)

    def launch(stream=None) -> None:
        launch_flash_decode_paged(dev, fs, fc, out, ws, qp, pp, pos, tp, batch, heads, kv_heads,
                                  head_dim, layer, layers, block_tokens, max_blocks, span=span,
                                  stream=stream)

    def want(step) -> np.ndarray:
        return flash_decode_paged(q, pool, step, table, layer, heads).astype(np.float32)

    def got_out() -> np.ndarray:
        return h.get(out, (batch, heads * head_dim), H).astype(np.float32)

    if replay_positions is None:
        launch()
        wp = flash_decode_paged_partials(q, pool, steps[0], table, layer, heads, span, splits)
        gp = h.get(ws, (batch, heads, splits, head_dim + 2))
        ran = ~np.isnan(wp)
        # an unrun slot compares as 1 (still NaN) against 1; a run slot by value
        got = np.concatenate([got_out().reshape(-1),
                              np.where(ran, gp, np.isnan(gp)).reshape(-1)])
        wanted = np.concatenate([want(steps[0]).reshape(-1), np.where(ran, wp, 1.0).reshape(-1)])
        return Outcome(got.astype(np.float32), wanted.astype(np.float32), RTOL, ATOL)
    def before(step) -> None:
        dev.to_device(pos, step)
        dev.to_device(ws, nan_ws)   # stale slots from a longer step would hide a bad read

    return _replayed(dev, launch, steps, before, lambda step: (got_out(), want(step)))


def paged_decode_cluster_case(h: KernelHarness, rng, heads, kv_heads, head_dim, positions,
                              block_tokens=16, layers=2, layer=1, replay_positions=None,
                              build: ClusterBuild | None = None, parts: int = 1,
                              part_keys: int | None = None) -> Outcome:
    """The one-kernel paged decode (gp_flash_decode_paged_cluster) against the oracle: rows at
    per-row positions (-1 rows zero), each split over `parts` clusters of CTAs by its actual
    length; with parts > 1 the workspace's counters (zero before) must be zero after every
    launch. With `replay_positions` the launch is captured once and replayed after each change
    of the device positions (the split is read from them on the device, never baked into the
    graph). `build`: another build of the kernel (decode_cluster_build), launched as it needs;
    `part_keys`: the launch's keys a part at least (else the build's)."""
    build = build or decode_cluster_build()
    if part_keys is not None:
        build = dataclasses.replace(build, part_keys=part_keys)
    steps = [np.asarray(positions, np.int32)] + [np.asarray(x, np.int32) for x in (replay_positions or [])]
    batch = steps[0].size
    need = max(int(s.max()) for s in steps) + 1
    max_blocks = -(-need // block_tokens) + 1
    capacity = max(4, min(batch * max_blocks, 4096))
    pool = _pool(rng, capacity, layers, block_tokens, kv_heads, head_dim)
    table = _tables(rng, batch, max_blocks, capacity)
    q = rng.standard_normal((batch, heads * head_dim), dtype=np.float32).astype(H)
    out = h.put(np.full((batch, heads * head_dim), np.nan, H))
    pos, qp, pp, tp = h.put(steps[0]), h.put(q), h.put(pool), h.put(table)
    dev, fn = h.device, h.function(build.kernel)
    ws_bytes = cluster_decode_workspace_bytes(batch=batch, heads=heads, kv_heads=kv_heads, parts=parts)
    ws = h.put(np.zeros(ws_bytes // 4, np.uint32))   # the counters first: zero, as allocated
    counters = batch * kv_heads * -(-(heads // kv_heads) // DECODE_HEADS_PER_BLOCK) * CLUSTER_COUNTERS

    def launch(stream=None) -> None:
        launch_flash_decode_paged_cluster(dev, fn, out, qp, pp, pos, tp, batch, heads, kv_heads,
                                          head_dim, layer, layers, block_tokens, max_blocks,
                                          stream=stream, threads=build.threads, ctas=build.ctas,
                                          parts=parts, workspace=ws, ring=build.ring, tma=build.tma,
                                          pool_blocks=capacity, part_keys=build.part_keys)

    def run(step) -> tuple[np.ndarray, np.ndarray]:
        got = h.get(out, (batch, heads * head_dim), H).astype(np.float32)
        want = flash_decode_paged(q, pool, step, table, layer, heads).astype(np.float32)
        if parts > 1:   # every counter back at zero: compared exactly, beside the output
            left = h.get(ws, (counters,), np.uint32).astype(np.float32)
            got, want = np.concatenate([got.reshape(-1), left]), np.concatenate([want.reshape(-1), 0 * left])
        return got, want

    if replay_positions is None:
        launch()
        return Outcome(*run(steps[0]), RTOL, ATOL)
    return _replayed(dev, launch, steps, lambda step: dev.to_device(pos, step), run)


def paged_prefill_case(h: KernelHarness, rng, tokens, heads, kv_heads, head_dim, start,
                       chunk_len, block_tokens=16, layers=2, layer=1, max_blocks=None,
                       rows=None) -> Outcome:
    """One prefill chunk: `tokens` rows of q, the first chunk_len at positions start.. against
    the paged pool (which already holds the chunk's own K/V); rows >= chunk_len must be zero.
    With `rows`, only that many query rows are compared (the reference is O(rows x keys))."""
    need = max(start, 0) + max(chunk_len, 0)
    max_blocks = max_blocks or -(-max(need, 1) // block_tokens) + 1
    capacity = max_blocks + 3
    pool = _pool(rng, capacity, layers, block_tokens, kv_heads, head_dim)
    table = rng.permutation(capacity)[:max_blocks].astype(np.int32).reshape(1, max_blocks)
    q = rng.standard_normal((tokens, heads * head_dim), dtype=np.float32).astype(H)
    out = h.put(np.full((tokens, heads * head_dim), np.nan, H))
    launch_flash_prefill_paged(h.device, h.function(FLASH_PREFILL_PAGED), out, h.put(q),
                               h.put(pool), h.put(np.array([start], np.int32)),
                               h.put(np.array([chunk_len], np.int32)), h.put(table), tokens,
                               heads, kv_heads, head_dim, layer, layers, block_tokens, max_blocks)
    got = h.get(out, (tokens, heads * head_dim), H)
    picked = sample_rows(tokens, rows, rng)
    if rows is not None and 0 < chunk_len < tokens:  # keep a padding row in the sample
        picked = np.unique(np.concatenate([picked, [chunk_len]]))
    n = min(max(chunk_len, 0), tokens) if start >= 0 else 0
    live = picked[picked < n]
    want = np.zeros((picked.size, heads * head_dim), H)
    if live.size:
        full = flash_prefill_paged(q[:live.max() + 1], pool, start, int(live.max()) + 1,
                                   table[0], layer, heads)
        want[:live.size] = full[live]
    return Outcome(got[picked].astype(np.float32), want.astype(np.float32), RTOL, ATOL)


def rotary_rows_case(h: KernelHarness, rng, positions, heads, head_dim, extra=0,
                     table=False) -> Outcome:
    """Rows of x (row stride heads*head_dim + extra) at per-row positions; -1 rows become 0."""
    positions = np.asarray(positions, np.int32)
    rows, stride = positions.size, heads * head_dim + extra
    x = rng.standard_normal((rows, stride), dtype=np.float32)
    inv = (rng.random(head_dim // 2) * 0.5).astype(np.float32) if table else None
    xp = h.put(x)
    launch_rotary_rows(h.device, h.function(ROTARY_ROWS), xp, h.put(positions), rows, heads,
                       head_dim, stride, 500000.0, inv_freq=h.put(inv) if table else 0)
    want = x.copy()
    want[:, :heads * head_dim] = ref.rotary_rows(
        x[:, :heads * head_dim].reshape(rows, heads, head_dim), positions, np.float32(500000.0),
        inv).reshape(rows, -1)
    return Outcome(h.get(xp, (rows, stride)), want, 1e-5, 1e-5)


def sample_case(h: KernelHarness, rng, vocab, params, scale=3.0) -> Outcome:
    """Rows of logits each with its (position, temperature, top_p, top_k, seed); token ids are
    compared exactly with the reference."""
    rows = len(params)
    logits = (rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(scale))
    cols = [np.array([p[i] for p in params], dt)
            for i, dt in enumerate((np.int32, np.float32, np.float32, np.int32, np.int32))]
    out = h.put(np.full(rows, -7, np.int32))
    launch_sample(h.device, h.function(SAMPLE), out, h.put(logits), *(h.put(c) for c in cols),
                  rows, vocab)
    return Outcome(h.get(out, (rows,), np.int32), ref.sample(logits, *cols), 0, 0)


def _c(kernel: str, fn, covers: tuple[str, ...] = (), **shapes) -> Case:
    return Case(kernel, fn, shapes, covers)


APPEND, DECODE, PREFILL = "kv_append_paged", "flash_decode_split_paged", "flash_prefill_paged"
COMBINE = ("flash_combine_paged",)
CLUSTER = "flash_decode_paged_cluster"

# (position, temperature, top_p, top_k, seed): greedy, plain temperature, top-k, top-p, both,
# a padding row, top_k = 1 (greedy by another road), top_p tiny (the top token only).
SAMPLE_PARAMS = [(0, 0.0, 1.0, 0, 1), (5, 0.8, 1.0, 0, 7), (9, 1.0, 1.0, 40, 3),
                 (17, 0.7, 0.9, 0, 11), (3, 1.3, 0.8, 50, 5), (-1, 1.0, 1.0, 0, 2),
                 (100, 1.0, 1.0, 1, 9), (4, 1.0, 1e-6, 0, 4)]

# Small shapes for the sim and the GPU alike: head dims 16/64/128, block sizes 16..256, GQA,
# padding rows, positions straddling block edges, layer offsets, a captured-then-replayed decode.
PAGED_CASES: list[Case] = [
    _c(APPEND, kv_append_paged_case, positions=[0, 15, 16, 63], table_rows=4),
    _c(APPEND, kv_append_paged_case, positions=[5, -1, 6, 7, 40], table_rows=1, head_dim=64,
       kv_heads=1, block_tokens=32, max_blocks=2),
    _c(APPEND, kv_append_paged_case, positions=[130, -1], table_rows=2, head_dim=128,
       block_tokens=128, layers=3, layer=0, max_blocks=2),
    _c(DECODE, paged_decode_case, COMBINE, heads=4, kv_heads=2, head_dim=16, positions=[0, 17, -1, 40]),
    # spans of 16 / 32 keys: rows of 1..7 splits in one batch, slots past each row left unwritten
    _c(DECODE, paged_decode_case, COMBINE, heads=4, kv_heads=2, head_dim=16,
       positions=[0, 17, -1, 40, 111, 15, 16], span=16),
    _c(DECODE, paged_decode_case, COMBINE, heads=8, kv_heads=2, head_dim=64, positions=[100, 3],
       block_tokens=32, span=32),
    _c(DECODE, paged_decode_case, COMBINE, heads=8, kv_heads=1, head_dim=128,
       positions=[300, -1, 64, 31], block_tokens=64, span=32),
    _c(DECODE, paged_decode_case, COMBINE, heads=4, kv_heads=4, head_dim=64, positions=[255],
       block_tokens=256, layers=1, layer=0),
    # GQA group of 6 (two head groups per KV head), odd lengths
    _c(DECODE, paged_decode_case, COMBINE, heads=12, kv_heads=2, head_dim=64, positions=[76, 0, 33],
       span=16),
    _c(DECODE, paged_decode_case, COMBINE, heads=4, kv_heads=1, head_dim=16, positions=[20, 5],
       span=16, replay_positions=[[21, -1], [90, 6], [3, 70]]),
    # the one-kernel decode: lengths 1, a tile, a tile + 1, under and over 8 tiles (CTAs with no
    # key), a padding row, GQA groups of 4 and 6 (two head blocks), a captured graph replayed
    _c(CLUSTER, paged_decode_cluster_case, heads=8, kv_heads=2, head_dim=128,
       positions=[0, 15, 16, -1, 300]),
    _c(CLUSTER, paged_decode_cluster_case, heads=12, kv_heads=2, head_dim=64,
       positions=[1000, 127, 129], block_tokens=32),
    _c(CLUSTER, paged_decode_cluster_case, heads=4, kv_heads=1, head_dim=128, positions=[40],
       replay_positions=[[-1], [700], [3]]),
    # a row and head block over 2-4 clusters: the last part merges, the counters go back to 0
    _c(CLUSTER, paged_decode_cluster_case, heads=8, kv_heads=2, head_dim=128,
       positions=[0, 15, 16, -1, 300, 4100], parts=2),
    _c(CLUSTER, paged_decode_cluster_case, heads=12, kv_heads=2, head_dim=64,
       positions=[1000, 127, 129], block_tokens=32, parts=3),
    _c(CLUSTER, paged_decode_cluster_case, heads=4, kv_heads=1, head_dim=128, positions=[40],
       replay_positions=[[-1], [700], [3], [9000]], parts=4),
    # parts by the row's length (part_keys 256): rows of 1..301 keys in one part, longer in
    # two to four; the parts a row does not run leave, and no counter moves for a one-part row
    _c(CLUSTER, paged_decode_cluster_case, heads=8, kv_heads=2, head_dim=128,
       positions=[0, 15, 16, -1, 200, 300, 4100], parts=2, part_keys=256),
    _c(CLUSTER, paged_decode_cluster_case, heads=4, kv_heads=1, head_dim=128, positions=[40],
       replay_positions=[[-1], [700], [3], [9000]], parts=4, part_keys=256),
    _c(PREFILL, paged_prefill_case, tokens=1, heads=2, kv_heads=1, head_dim=16, start=0, chunk_len=1),
    _c(PREFILL, paged_prefill_case, tokens=40, heads=4, kv_heads=2, head_dim=16, start=0, chunk_len=33),
    _c(PREFILL, paged_prefill_case, tokens=70, heads=8, kv_heads=2, head_dim=64, start=37,
       chunk_len=70, block_tokens=32),
    _c(PREFILL, paged_prefill_case, tokens=130, heads=4, kv_heads=1, head_dim=128, start=200,
       chunk_len=100, block_tokens=64),
    _c(PREFILL, paged_prefill_case, tokens=16, heads=2, kv_heads=2, head_dim=16, start=-1,
       chunk_len=16),
    _c("rotary_rows", rotary_rows_case, positions=[0, 7, -1, 1000], heads=2, head_dim=16),
    _c("rotary_rows", rotary_rows_case, positions=[8191, 3, -1], heads=4, head_dim=128, extra=64,
       table=True),
    _c("sample", sample_case, vocab=1000, params=SAMPLE_PARAMS),
    _c("sample", sample_case, vocab=77, params=SAMPLE_PARAMS[:5], scale=0.5),
]
