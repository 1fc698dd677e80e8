"""Paged KV: append into, and flash attention (decode and prefill chunk) over, a block pool.

Contract (/work/briefs/i13-contract.md, docs/kernels.md "Paged KV"): the pool is one fp16 range
of blocks; block b is `block_stride = layers * 2 * plane` halves at b * block_stride, laid out
[layer][K = 0, V = 1][slot][kv_head][dim], plane = block_tokens * kv_heads * head_dim. Token p of
a sequence lives in block table[p // block_tokens], slot p % block_tokens; a block table row is
`max_blocks` int32s. A position of -1 marks a padding row: it writes no KV and gets zero output.

Hazard: the kernels read only table entries below the row's length, and clamp every length to
max_blocks * block_tokens, so a stale or zero entry past the end is never followed; an entry
inside the length must name a block of the pool (the engine owns that invariant).

Cost: the same kernels as flash_attention.py (its templates, from flash_device.cuh, compiled
into this module with a paged row addresser): one extra L1-resident table load per staged K/V row.
block_tokens is a power of two in 16..256; head_dim 16, 64, 128.

Decode splits by the actual length (DESIGN 6.2): a split is a fixed span of keys (DECODE_SPAN,
paged_decode_span), so a row of n keys has ceil(n / span) splits wherever it sits in the batch,
and a batch of 64 short rows gets as much split-K as one long row. The grid and the workspace are
sized for the longest row the table holds (a function of the graph's shape: a captured graph stays
valid as rows grow); a split block past its row's length exits before reading anything, and the
combine (gp_flash_combine_paged) reads only the splits that ran, so a stale slot is never merged.
A row with no key (a padding row) comes out zero. What the empty blocks of short rows cost
(the grid is sized for the longest) is measured in docs/kernels.md.

Where the batch is small (cluster_decode: Llama-3-8B at batch 1), the decode is one kernel
instead (gp_flash_decode_paged_cluster): a cluster of up to CLUSTER_DECODE_CTAS CTAs splits each
row's actual keys and merges the parts through distributed shared memory, so there is no
hand-over from the split kernel to the combine (docs/kernels.md, "One-kernel decode at batch
1"). Where one wave holds more clusters than a row has head blocks, each (row, head block) takes
several clusters ("parts", cluster_decode_shape), and the last part to finish merges them from a
small workspace whose counters start at zero and are left at zero.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from gpu_worker.device.backend import MAX_CLUSTER_CTAS, f32, i32, ptr, tmap
from gpu_worker.kernels.common import (
    BLOCK,
    KernelDef,
    ceil_div,
    cu_source,
    grid_1d,
    require,
    require_sizes,
    sm_count,
)
from gpu_worker.kernels.flash_attention import (
    COMBINE_MAX_SPLITS,
    DECODE_HEADS_PER_BLOCK,
    DECODE_THREADS,
    PREFILL_ROWS,
    PREFILL_THREADS,
    decode_combine_shared_bytes,
)
from gpu_worker.kernels.reference import (  # noqa: F401  (re-exported: the oracles' old home)
    attention_f16,
    flash_decode_paged,
    flash_decode_paged_combine,
    flash_decode_paged_partials,
    flash_prefill_paged,
    kv_append_paged,
    paged_kv,
)

HEAD_DIMS = (16, 64, 128)
BLOCK_TOKENS = (16, 32, 64, 128, 256)
# keys per decode split by the blocks of one split slice (batch * kv_heads * head groups), measured
# on the H200 (docs/kernels.md "Decode split by length"): (fewer blocks than, span), last: the rest
DECODE_SPANS: tuple[tuple[int | None, int], ...] = ((48, 128), (192, 256), (384, 512), (None, 1024))
MAX_DECODE_SPLITS = COMBINE_MAX_SPLITS    # workspace slots per row: what one combine block stages
# the one-kernel decode of a small batch (gp_flash_decode_paged_cluster): CTAs a cluster (a row's
# keys in that many parts, the portable cluster size) and threads a CTA (GP_FDC_WARPS warps)
CLUSTER_DECODE_CTAS = 8
CLUSTER_DECODE_THREADS = 256
CLUSTER_DECODE_HEAD_DIMS = (64, 128)
# clusters a (row, head block) at most, and the cluster decode's workspace: a counter per (row,
# head block, rank), then a part's slot of (max, sum, acc) per (head, dim) of a head block
MAX_DECODE_PARTS = 4
CLUSTER_DECODE_PARTS = 1   # the library's most parts: one until measured faster (GP_FDC_PARTS)
# keys a part at least: a row of fewer runs in fewer parts (GP_FDC_PART_KEYS, a launch argument;
# 0: every part runs whatever the row's length)
CLUSTER_PART_KEYS = 0
CLUSTER_SLOT_FLOATS = 3 * DECODE_HEADS_PER_BLOCK * 128     # GP_FDC_SLOT
CLUSTER_COUNTERS = MAX_CLUSTER_CTAS                         # GP_FDC_COUNTERS
CLUSTER_DECODE_SMS = 192   # the most SMs cluster_decode_may_run plans the workspace for
# tiles a warp of the cluster decode keeps in flight in shared memory by bulk copies
# (GP_FDC_RING; 0: its loads from global memory), and the ring's bytes a tile (gp_fd_ring_shape)
CLUSTER_DECODE_RING = 2
CLUSTER_DECODE_TMA = True   # GP_FDC_TMA: the ring filled by the TMA unit (pool_tensor_map)
MAX_DECODE_RING = 4
RING_SHARED_BYTES = 180 << 10   # a ring's most: the H100's 227 KiB a block less the kernel's static 35 KiB


def cluster_decode_ring_bytes(warps: int, ring: int, head_dim: int, tma: bool = False) -> int:
    """Dynamic shared memory of a cluster-decode CTA of `warps` warps with `ring` tiles a warp in
    flight (gp_fd_ring_bytes), an 8-byte mbarrier a slot. A slot filled by bulk copies: 16 K rows
    of 2 head_dim + 64 bytes and 16 V rows of 2 head_dim + 32 (the pads keep a fragment load's
    rows in different banks); by the TMA unit (`tma`): the tile's K and V as they are (swizzled),
    from a 1 KiB aligned start."""
    if not ring:
        return 0
    slot = 4 * 16 * head_dim if tma else 16 * ((2 * head_dim + 64) + (2 * head_dim + 32))
    return warps * ring * (slot + 8) + (1024 if tma else 0)


def pool_tensor_map(device, pool: int, *, blocks: int, layers: int, block_tokens: int,
                    kv_heads: int, head_dim: int) -> bytes:
    """The TMA map of a paged KV pool of `blocks` blocks (docs/execution.md's layout: a block's
    layers, each K then V, each block_tokens rows of kv_heads x head_dim fp16) as five
    dimensions, innermost first: head dims, KV heads, a block's rows, 2 layer + (K 0, V 1),
    blocks. A box is 64 dims of one head and 16 rows of one block, 128-byte swizzled: the TMA
    ring's (GP_FDC_TMA) copy of half a 16-key tile of K or V at head_dim 128."""
    row = kv_heads * head_dim * 2
    plane = block_tokens * row
    return device.tensor_map(pool, (head_dim, kv_heads, block_tokens, 2 * layers, blocks),
                             (head_dim * 2, row, plane, 2 * layers * plane), (64, 1, 16, 1, 1))


SOURCE = cu_source("gp_paged_attention", "paged_attention.cu")
_BUILD_MACRO = re.compile(r"GP_FDC?_[A-Z0-9_]+")   # the macros a tuning build may set


# -- launchers -------------------------------------------------------------------------------
def _check_paged(kernel: str, heads: int, kv_heads: int, head_dim: int, layer: int, layers: int,
                 block_tokens: int, max_blocks: int) -> None:
    require_sizes(kernel, heads=heads, kv_heads=kv_heads, head_dim=head_dim, layer=layer,
                  layers=layers, max_blocks=max_blocks)
    require(heads > 0 and kv_heads > 0 and heads % kv_heads == 0,
            f"{kernel}: heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    require(head_dim in HEAD_DIMS, f"{kernel}: head_dim={head_dim} must be one of {HEAD_DIMS}")
    require(block_tokens in BLOCK_TOKENS,
            f"{kernel}: block_tokens={block_tokens} must be one of {BLOCK_TOKENS}")
    require(0 <= layer < layers, f"{kernel}: layer={layer} must be in [0, layers={layers})")
    require(max_blocks >= 1 and max_blocks * block_tokens < 2**31,
            f"{kernel}: max_blocks={max_blocks} must be >= 1 with max_blocks*block_tokens < 2**31")


def _scale(head_dim: int, scale: float | None) -> float:
    value = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    require(math.isfinite(value) and value > 0, f"attention scale={scale!r} must be finite and > 0")
    return value


def launch_kv_append_paged(device, function, pool: int, k: int, v: int, positions: int,
                           table: int, rows: int, table_rows: int, layer: int, layers: int,
                           block_tokens: int, kv_heads: int, head_dim: int, max_blocks: int,
                           stream=None) -> None:
    """Rows of k/v (rows, kv_heads * head_dim) f32 into the pool at `positions` (-1: skipped)."""
    kernel = "kv_append_paged"
    _check_paged(kernel, kv_heads, kv_heads, head_dim, layer, layers, block_tokens, max_blocks)
    require_sizes(kernel, rows=rows, table_rows=table_rows, items=rows * kv_heads * head_dim)
    require(table_rows in (1, rows), f"{kernel}: table_rows={table_rows} must be 1 or rows={rows}")
    require(pool % 2 == 0 and positions and table, f"{kernel}: needs a pool, positions and a table")
    if rows == 0:
        return
    device.launch(function, grid_1d(device, rows * kv_heads * head_dim), BLOCK,
                  [ptr(pool), ptr(k), ptr(v), ptr(positions), ptr(table), i32(rows),
                   i32(table_rows), i32(layer), i32(layers), i32(block_tokens), i32(kv_heads),
                   i32(head_dim), i32(max_blocks)], stream=stream)


def paged_decode_span(max_blocks: int, block_tokens: int, batch: int = 1, heads: int = 32,
                      kv_heads: int = 8) -> int:
    """Keys per split of the paged decode, a function of the graph's shape only (so a captured
    graph stays valid): the DECODE_SPANS entry for the blocks one split slice of the batch
    launches (few blocks: short spans so even short rows fill the SMs; many: long spans, fewer
    partial states), doubled until the longest row the table holds needs at most
    MAX_DECODE_SPLITS splits."""
    blocks = max(1, batch) * kv_heads * ceil_div(max(1, heads // max(1, kv_heads)),
                                                  DECODE_HEADS_PER_BLOCK)
    span = next(sp for below, sp in DECODE_SPANS if below is None or blocks < below)
    while ceil_div(max_blocks * block_tokens, span) > MAX_DECODE_SPLITS:
        span *= 2
    return span


def paged_decode_splits(max_blocks: int, block_tokens: int, span: int) -> int:
    """Workspace slots per (row, query head): the splits of the longest row the table holds."""
    return ceil_div(max_blocks * block_tokens, span)


def paged_decode_workspace_bytes(*, batch: int, heads: int, head_dim: int, splits: int = 1,
                                 **_: int) -> int:
    """fp32 (max, sum, acc[head_dim]) per (row, query head, split slot)."""
    return 4 * batch * heads * splits * (head_dim + 2)


def _check_decode(kernel: str, batch: int, span: int, splits: int) -> None:
    require_sizes(kernel, batch=batch, span=span, splits=splits)
    require(span >= 16 and span % 16 == 0, f"{kernel}: span={span} must be a multiple of 16")
    require(1 <= splits <= MAX_DECODE_SPLITS,
            f"{kernel}: splits={splits} must be in 1..{MAX_DECODE_SPLITS} (a longer span "
            f"covers the table in fewer splits: paged_decode_span)")
    require(batch < 65536, f"{kernel}: batch={batch} must be < 65536")


def launch_flash_decode_split_paged(device, function, workspace: int, q: int, pool: int,
                                    positions: int, table: int, batch: int, heads: int,
                                    kv_heads: int, head_dim: int, layer: int, layers: int,
                                    block_tokens: int, max_blocks: int, *, span: int,
                                    scale: float | None = None, stream=None) -> None:
    """The split half of the paged decode: the partial state of each split of `span` keys that
    holds a key of its row into `workspace` (paged_decode_splits slots per row and head)."""
    kernel = "flash_decode_split_paged"
    _check_paged(kernel, heads, kv_heads, head_dim, layer, layers, block_tokens, max_blocks)
    splits = ceil_div(max_blocks * block_tokens, span) if span > 0 else 0
    _check_decode(kernel, batch, span, splits)
    require(workspace and workspace % 4 == 0 and positions and table,
            f"{kernel}: needs a 4-byte aligned workspace, positions and a table")
    for name, p in (("q", q), ("pool", pool)):
        require(p % 16 == 0, f"{kernel}: {name}=0x{p:x} must be 16-byte aligned (16-byte loads)")
    if batch == 0:
        return
    hgroups = ceil_div(heads // kv_heads, DECODE_HEADS_PER_BLOCK)
    device.launch(function, (kv_heads * hgroups, batch, splits), (DECODE_THREADS, 1, 1),
                  [ptr(workspace), ptr(q), ptr(pool), ptr(positions), ptr(table), i32(batch),
                   i32(heads), i32(kv_heads), i32(head_dim), i32(layer), i32(layers),
                   i32(block_tokens), i32(max_blocks), i32(span), f32(_scale(head_dim, scale))],
                  stream=stream, pdl=True)


def launch_flash_combine_paged(device, function, out: int, workspace: int, positions: int,
                               batch: int, heads: int, head_dim: int, block_tokens: int,
                               max_blocks: int, *, span: int, stream=None) -> None:
    """Merge the splits that ran for each row (ceil(nkeys / span)) into fp16 out."""
    kernel = "flash_combine_paged"
    require_sizes(kernel, heads=heads, head_dim=head_dim, max_blocks=max_blocks,
                  block_tokens=block_tokens)
    splits = ceil_div(max_blocks * block_tokens, span) if span > 0 else 0
    _check_decode(kernel, batch, span, splits)
    require(workspace and workspace % 8 == 0 and positions,
            f"{kernel}: needs an 8-byte aligned workspace (8-byte copies of the states) and positions")
    require(out % 2 == 0 and heads < 65536, f"{kernel}: out 2-byte aligned, heads < 65536")
    if batch == 0:
        return
    device.launch(function, (heads, batch, 1), (DECODE_THREADS, 1, 1),
                  [ptr(out), ptr(workspace), ptr(positions), i32(batch), i32(heads),
                   i32(head_dim), i32(max_blocks * block_tokens), i32(span), i32(splits)],
                  stream=stream, pdl=True, shared_bytes=decode_combine_shared_bytes(splits, head_dim))


def cluster_decode_may_run(batch: int, heads: int, kv_heads: int) -> bool:
    """Whether cluster_decode may hold for this batch on some device (up to CLUSTER_DECODE_SMS
    multiprocessors): where the graph gives the decode a cluster workspace, without knowing the
    device. A device with more SMs than that runs such a batch in one part."""
    return 2 * _head_blocks(batch, heads, kv_heads) * CLUSTER_DECODE_CTAS <= CLUSTER_DECODE_SMS


def cluster_decode(batch: int, heads: int, kv_heads: int, head_dim: int, sms: int) -> bool:
    """Whether the paged decode runs as one kernel of clusters (gp_flash_decode_paged_cluster):
    where its CTAs (one of CLUSTER_DECODE_THREADS an SM, CLUSTER_DECODE_CTAS a (row, KV head,
    head block)) take at most half the SMs, at head_dim 64 or 128. Measured (docs/kernels.md,
    "One-kernel decode at batch 1"): Llama-3-8B's batch 1 (64 CTAs) is up to 11 % faster than
    the split and combine kernels, batch 2 (128 CTAs, every one resident) slower at every
    length. A function of the graph's shape only."""
    blocks = _head_blocks(batch, heads, kv_heads)
    return (head_dim in CLUSTER_DECODE_HEAD_DIMS and batch >= 1
            and 2 * blocks * CLUSTER_DECODE_CTAS <= sms)


def _head_blocks(batch: int, heads: int, kv_heads: int) -> int:
    """(row, KV head, head block) units of a decode: a block is up to 4 query heads of a group."""
    return batch * kv_heads * ceil_div(max(1, heads // max(1, kv_heads)), DECODE_HEADS_PER_BLOCK)


def cluster_decode_workspace_bytes(*, batch: int, heads: int, kv_heads: int,
                                   parts: int = MAX_DECODE_PARTS, **_: int) -> int:
    """The cluster decode's workspace at up to `parts` parts: the counters, which must be zero
    before the first launch (every launch leaves them zero), then the parts' slots."""
    units = _head_blocks(batch, heads, kv_heads)
    return 4 * units * (parts * CLUSTER_SLOT_FLOATS + CLUSTER_COUNTERS)


def cluster_decode_shape(blocks: int, fits: Callable[[int], int], ctas: int = CLUSTER_DECODE_CTAS,
                         parts: int = MAX_DECODE_PARTS) -> tuple[int, int]:
    """(CTAs a cluster, parts a (row, head block)) for `blocks` (row, head block) units: the
    most CTAs in one wave, where `fits(s)` is how many clusters of s CTAs one wave holds
    (Device.max_active_clusters), at most `ctas` a cluster and `parts` parts; on a tie the
    bigger cluster (fewer parts to merge); (ctas, 1), the one-part decode, where nothing fits
    (docs/kernels.md, "A row's keys over more than one cluster")."""
    best = None
    for s in range(ctas, 0, -1):
        p = min(parts, fits(s) // max(1, blocks))
        if p >= 1 and (best is None or s * p > best[0] * best[1]):
            best = (s, p)
    return best or (ctas, 1)


def launch_flash_decode_paged_cluster(device, function, out: int, q: int, pool: int,
                                      positions: int, table: int, batch: int, heads: int,
                                      kv_heads: int, head_dim: int, layer: int, layers: int,
                                      block_tokens: int, max_blocks: int,
                                      scale: float | None = None, stream=None,
                                      threads: int = CLUSTER_DECODE_THREADS,
                                      ctas: int = CLUSTER_DECODE_CTAS, parts: int = 1,
                                      workspace: int = 0, ring: int = CLUSTER_DECODE_RING,
                                      tma: bool = CLUSTER_DECODE_TMA, pool_blocks: int = 0,
                                      part_keys: int = CLUSTER_PART_KEYS) -> None:
    """The whole paged decode of a small batch in one kernel: fp16 out from q and the pool,
    each row split by its actual length over `parts` clusters of `ctas` CTAs of `threads` each
    (`part_keys` > 0: over min(parts, ceil(keys / part_keys)) of them, at least one, the rest
    leaving at once). head_dim 64 or 128. parts > 1 needs `workspace`
    (cluster_decode_workspace_bytes at least `parts`, its counters zero). Another build's threads, ctas, ring (the shared memory it is
    launched with) and tma (the pool's tensor map, which needs the pool's `pool_blocks`):
    decode_cluster_build."""
    kernel = "flash_decode_paged_cluster"
    _check_paged(kernel, heads, kv_heads, head_dim, layer, layers, block_tokens, max_blocks)
    require(head_dim in CLUSTER_DECODE_HEAD_DIMS,
            f"{kernel}: head_dim={head_dim} must be one of {CLUSTER_DECODE_HEAD_DIMS} "
            f"(others run the split and combine kernels)")
    require(batch < 65536, f"{kernel}: batch={batch} must be < 65536")
    require(positions and table, f"{kernel}: needs positions and a table")
    require(1 <= parts <= MAX_DECODE_PARTS, f"{kernel}: parts={parts} must be 1..{MAX_DECODE_PARTS}")
    require(1 <= ctas <= MAX_CLUSTER_CTAS, f"{kernel}: ctas={ctas} must be 1..{MAX_CLUSTER_CTAS}")
    require(0 <= part_keys < 1 << 30, f"{kernel}: part_keys={part_keys} must be >= 0 (0: every "
            f"part runs)")
    require(0 <= ring <= MAX_DECODE_RING, f"{kernel}: ring={ring} must be 0..{MAX_DECODE_RING}")
    require(not tma or (ring and pool_blocks > 0),
            f"{kernel}: a TMA build needs a ring and the pool's blocks (pool_blocks={pool_blocks})")
    require(parts == 1 or (workspace and workspace % 4 == 0),
            f"{kernel}: parts={parts} needs a 4-byte aligned workspace "
            f"(cluster_decode_workspace_bytes, counters zero)")
    for name, p in (("out", out), ("q", q), ("pool", pool)):
        require(p % 16 == 0, f"{kernel}: {name}=0x{p:x} must be 16-byte aligned (16-byte loads)")
    if batch == 0:
        return
    hgroups = ceil_div(heads // kv_heads, DECODE_HEADS_PER_BLOCK)
    device.launch(function, (ctas, kv_heads * hgroups * parts, batch),
                  (threads, 1, 1),
                  [ptr(out), ptr(workspace if parts > 1 else 0), ptr(q), ptr(pool), ptr(positions),
                   ptr(table), i32(batch), i32(heads), i32(kv_heads), i32(head_dim), i32(layer),
                   i32(layers), i32(block_tokens), i32(max_blocks), i32(parts), i32(part_keys),
                   f32(_scale(head_dim, scale))]
                  + ([tmap(pool_tensor_map(device, pool, blocks=pool_blocks, layers=layers,
                                           block_tokens=block_tokens, kv_heads=kv_heads,
                                           head_dim=head_dim))] if tma else []),
                  stream=stream, pdl=True, cluster=(ctas, 1, 1),
                  shared_bytes=cluster_decode_ring_bytes(threads // 32, ring, head_dim, tma))


def launch_flash_decode_paged(device, split_function, combine_function, out: int, workspace: int,
                              q: int, pool: int, positions: int, table: int, batch: int,
                              heads: int, kv_heads: int, head_dim: int, layer: int, layers: int,
                              block_tokens: int, max_blocks: int, *, span: int | None = None,
                              scale: float | None = None, stream=None,
                              cluster_function=None,
                              cluster_launch: ClusterBuild | None = None,
                              cluster_workspace: int = 0, pool_blocks: int = 0) -> None:
    """Paged split-K decode split by the rows' actual lengths: split kernel, then the combine
    of the splits that ran, into fp16 out. `workspace`: paged_decode_workspace_bytes with
    paged_decode_splits(max_blocks, block_tokens, span) slots. With `cluster_function`, a
    batch cluster_decode takes runs as that one kernel instead, in the shape
    cluster_decode_shape picks within `cluster_launch`'s threads, CTAs and parts where given
    (a decode_cluster_build); in one part unless `cluster_workspace` is given
    (cluster_decode_workspace_bytes, zero when first allocated). A TMA build needs the pool's
    `pool_blocks`."""
    if cluster_function is not None and cluster_decode(batch, heads, kv_heads, head_dim,
                                                       sm_count(device)):
        build = cluster_launch or ClusterBuild(FLASH_DECODE_PAGED_CLUSTER)
        ctas, parts = build.ctas, 1   # one part: no occupancy to ask
        if build.parts > 1 and cluster_workspace:
            ctas, parts = cluster_decode_shape(
                _head_blocks(batch, heads, kv_heads),
                lambda s: device.max_active_clusters(
                    cluster_function, build.threads, s,
                    cluster_decode_ring_bytes(build.threads // 32, build.ring, head_dim, build.tma)),
                build.ctas, build.parts)
        launch_flash_decode_paged_cluster(device, cluster_function, out, q, pool, positions,
                                          table, batch, heads, kv_heads, head_dim, layer, layers,
                                          block_tokens, max_blocks, scale=scale, stream=stream,
                                          threads=build.threads, ctas=ctas, parts=parts,
                                          workspace=cluster_workspace, ring=build.ring,
                                          tma=build.tma, pool_blocks=pool_blocks,
                                          part_keys=build.part_keys)
        return
    span = span or paged_decode_span(max_blocks, block_tokens, batch, heads, kv_heads)
    launch_flash_decode_split_paged(device, split_function, workspace, q, pool, positions, table,
                                    batch, heads, kv_heads, head_dim, layer, layers, block_tokens,
                                    max_blocks, span=span, scale=scale, stream=stream)
    launch_flash_combine_paged(device, combine_function, out, workspace, positions, batch, heads,
                               head_dim, block_tokens, max_blocks, span=span, stream=stream)


def launch_flash_prefill_paged(device, function, out: int, q: int, pool: int, start: int,
                               chunk_len: int, table: int, tokens: int, heads: int, kv_heads: int,
                               head_dim: int, layer: int, layers: int, block_tokens: int,
                               max_blocks: int, scale: float | None = None, stream=None) -> None:
    """One prefill chunk (tokens rows of q, fp16) against the paged pool; fp16 out."""
    kernel = "flash_prefill_paged"
    _check_paged(kernel, heads, kv_heads, head_dim, layer, layers, block_tokens, max_blocks)
    require_sizes(kernel, tokens=tokens)
    require(heads < 65536, f"{kernel}: heads={heads} must be < 65536")
    require(start and chunk_len and table, f"{kernel}: needs start, chunk_len and a table")
    for name, p in (("out", out), ("q", q), ("pool", pool)):
        require(p % 16 == 0, f"{kernel}: {name}=0x{p:x} must be 16-byte aligned (16-byte loads)")
    if tokens == 0:
        return
    device.launch(function, (ceil_div(tokens, PREFILL_ROWS), heads, 1), (PREFILL_THREADS, 1, 1),
                  [ptr(out), ptr(q), ptr(pool), ptr(start), ptr(chunk_len), ptr(table),
                   i32(tokens), i32(heads), i32(kv_heads), i32(head_dim), i32(layer), i32(layers),
                   i32(block_tokens), i32(max_blocks), f32(_scale(head_dim, scale))],
                  stream=stream, pdl=True)


KV_APPEND_PAGED = KernelDef("kv_append_paged", "gp_kv_append_paged", SOURCE, kv_append_paged,
                            launch_kv_append_paged)
FLASH_DECODE_SPLIT_PAGED = KernelDef("flash_decode_split_paged", "gp_flash_decode_split_paged",
                                     SOURCE, flash_decode_paged_partials,
                                     launch_flash_decode_split_paged,
                                     workspace=paged_decode_workspace_bytes)
FLASH_COMBINE_PAGED = KernelDef("flash_combine_paged", "gp_flash_combine_paged", SOURCE,
                                flash_decode_paged_combine, launch_flash_combine_paged)
FLASH_DECODE_PAGED_CLUSTER = KernelDef("flash_decode_paged_cluster",
                                       "gp_flash_decode_paged_cluster", SOURCE, flash_decode_paged,
                                       launch_flash_decode_paged_cluster)
FLASH_PREFILL_PAGED = KernelDef("flash_prefill_paged", "gp_flash_prefill_paged", SOURCE,
                                flash_prefill_paged, launch_flash_prefill_paged)



def _build_source(kernel: str, defines: dict[str, int]):
    """SOURCE compiled with the given GP_FD_* / GP_FDC_* macros, as a module of its own."""
    for name, value in defines.items():
        require(_BUILD_MACRO.fullmatch(name) is not None and isinstance(value, int),
                f"{kernel}: build macro {name}={value!r} must be GP_FD_<NAME>=int or "
                f"GP_FDC_<NAME>=int")
    tag = "_".join(f"{name[3:].lower()}{value}" for name, value in sorted(defines.items()))
    return dataclasses.replace(
        SOURCE, module_name=f"{SOURCE.module_name}_{tag}",
        options=(*SOURCE.options, *(f"-D{name}={value}" for name, value in sorted(defines.items()))))


def decode_split_build(**defines: int) -> KernelDef:
    """gp_flash_decode_split_paged built with the given GP_FD_* macros (flash_device.cuh, e.g.
    GP_FD_MMA=0: the lane-group block at every head_dim); none: the library's build.
    decode_attention_bench --cuda-core and --build time such builds beside it."""
    if not defines:
        return FLASH_DECODE_SPLIT_PAGED
    return dataclasses.replace(FLASH_DECODE_SPLIT_PAGED,
                               source=_build_source("flash_decode_split_paged", defines))


@dataclasses.dataclass(frozen=True)
class ClusterBuild:
    """A build of gp_flash_decode_paged_cluster and the launch it needs: `threads` a CTA
    (GP_FDC_WARPS * 32), at most `ctas` a cluster (GP_FDC_CTAS; above 8, a non-portable
    cluster), at most `parts` clusters a (row, head block) (GP_FDC_PARTS), `part_keys` keys a
    part at least (GP_FDC_PART_KEYS) and `ring` tiles a warp in flight in shared memory
    (GP_FDC_RING)."""

    kernel: KernelDef
    threads: int = CLUSTER_DECODE_THREADS
    ctas: int = CLUSTER_DECODE_CTAS
    parts: int = CLUSTER_DECODE_PARTS
    ring: int = CLUSTER_DECODE_RING
    tma: bool = CLUSTER_DECODE_TMA   # GP_FDC_TMA: the ring filled from the pool's tensor map
    part_keys: int = CLUSTER_PART_KEYS


def decode_cluster_build(**defines: int) -> ClusterBuild:
    """gp_flash_decode_paged_cluster built with the given GP_FDC_* (and GP_FD_*) macros
    (paged_attention.cu: GP_FDC_WARPS, GP_FDC_CTAS; GP_FDC_PARTS bounds the launch's parts
    and GP_FDC_PART_KEYS is its part_keys, neither a macro); none: the library's build.
    decode_attention_bench --build times such builds."""
    kernel = "flash_decode_paged_cluster"
    warps = defines.get("GP_FDC_WARPS", CLUSTER_DECODE_THREADS // 32)
    ctas = defines.get("GP_FDC_CTAS", CLUSTER_DECODE_CTAS)
    parts = defines.get("GP_FDC_PARTS", CLUSTER_DECODE_PARTS)
    ring = defines.get("GP_FDC_RING", CLUSTER_DECODE_RING)
    part_keys = defines.get("GP_FDC_PART_KEYS", CLUSTER_PART_KEYS)
    require(isinstance(part_keys, int) and part_keys >= 0,
            f"{kernel}: GP_FDC_PART_KEYS={part_keys!r} must be >= 0 (0: every part runs)")
    require(isinstance(warps, int) and 1 <= warps <= 32, f"{kernel}: GP_FDC_WARPS={warps!r} must be 1..32")
    require(isinstance(ctas, int) and 1 <= ctas <= MAX_CLUSTER_CTAS,
            f"{kernel}: GP_FDC_CTAS={ctas!r} must be 1..{MAX_CLUSTER_CTAS}")
    require(isinstance(parts, int) and 1 <= parts <= MAX_DECODE_PARTS,
            f"{kernel}: GP_FDC_PARTS={parts!r} must be 1..{MAX_DECODE_PARTS}")
    tma = defines.get("GP_FDC_TMA", int(CLUSTER_DECODE_TMA))
    require(tma in (0, 1) and (not tma or ring), f"{kernel}: GP_FDC_TMA={tma!r} must be 0 or 1, "
            f"and 1 needs GP_FDC_RING >= 1 (the ring it fills)")
    require(not ring or defines.get("GP_FDC_TILE_ROWS", 1),
            f"{kernel}: GP_FDC_RING={ring!r} reads a tile's rows from one lookup: GP_FDC_TILE_ROWS=0 "
            f"needs GP_FDC_RING=0 and GP_FDC_TMA=0")
    require(isinstance(ring, int) and 0 <= ring <= MAX_DECODE_RING
            and cluster_decode_ring_bytes(warps, ring, 128, bool(tma)) <= RING_SHARED_BYTES,
            f"{kernel}: GP_FDC_RING={ring!r} must be 0..{MAX_DECODE_RING} with "
            f"{warps} warps' slots within {RING_SHARED_BYTES} bytes of shared memory "
            f"(cluster_decode_ring_bytes; fewer warps or a shorter ring)")
    pair = defines.get("GP_FDC_PAIR", 0)
    require(pair in (0, 1) and (not pair or (ring and ring % 2 == 0)),
            f"{kernel}: GP_FDC_PAIR={pair!r} must be 0 or 1, and 1 takes a tile pair from an even "
            f"ring: GP_FDC_RING 2 or 4")
    if not defines:
        return ClusterBuild(FLASH_DECODE_PAGED_CLUSTER)
    macros = {k: v for k, v in defines.items() if k not in ("GP_FDC_PARTS", "GP_FDC_PART_KEYS")}
    kdef = (FLASH_DECODE_PAGED_CLUSTER if not macros else dataclasses.replace(
        FLASH_DECODE_PAGED_CLUSTER, source=_build_source(kernel, macros)))
    return ClusterBuild(kdef, 32 * warps, ctas, parts, ring, bool(tma), part_keys)


KERNELS = [KV_APPEND_PAGED, FLASH_DECODE_SPLIT_PAGED, FLASH_COMBINE_PAGED,
           FLASH_DECODE_PAGED_CLUSTER, FLASH_PREFILL_PAGED]
