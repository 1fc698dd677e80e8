"""Paged KV: append into, and flash attention (decode and prefill chunk) over, a block pool.

Contract (/work/briefs/i13-contract.md, docs/kernels.md "Paged KV"): the pool is one fp16 range
of blocks; block b is `block_stride = layers * 2 * plane` halves at b * block_stride, laid out
[layer][K = 0, V = 1][slot][kv_head][dim], plane = block_tokens * kv_heads * head_dim. Token p of
a sequence lives in block table[p // block_tokens], slot p % block_tokens; a block table row is
`max_blocks` int32s. A position of -1 marks a padding row: it writes no KV and gets zero output.

Hazard: the kernels read only table entries below the row's length, and clamp every length to
max_blocks * block_tokens, so a stale or zero entry past the end is never followed; an entry
inside the length must name a block of the pool (the engine owns that invariant).

Cost: the same kernels as flash_attention.py (its templates, compiled into this module with a
paged row addresser): one extra L1-resident table load per staged K/V row. The decode is split-K
(flash_decode_splits of max_context and the batch, so a captured graph stays valid as sequences
grow) and merges its splits with flash_attention's combine kernel, which writes zeros for a row
that saw no key (a padding row). block_tokens is a power of two in 16..256; head_dim 16, 64, 128.
"""
from __future__ import annotations

import math

import numpy as np

from gpu_worker.device.backend import f32, i32, ptr
from gpu_worker.kernels.common import (
    BLOCK,
    KernelDef,
    ceil_div,
    grid_1d,
    make_source,
    require,
    require_sizes,
)
from gpu_worker.kernels.flash_attention import (
    DECODE_THREADS,
    FLASH_DEVICE,
    PREFILL_ROWS,
    PREFILL_THREADS,
    attention_f16,
    attention_partial_f16,
    flash_decode_splits,
    flash_decode_workspace_bytes,
    launch_flash_attention_combine,
)

HEAD_DIMS = (16, 64, 128)
BLOCK_TOKENS = (16, 32, 64, 128, 256)

SOURCE = make_source("gp_paged_attention", FLASH_DEVICE + r"""
// The K (kv = 0) or V (kv = 1) rows of KV head hk of one layer, addressed through a table row.
__device__ __forceinline__ gp_kv_paged gp_paged_rows(const unsigned short* pool, const int* table,
                                                     int layer, int layers, int kv, int hk,
                                                     int block_tokens, int kv_heads, int head_dim) {
    const long long plane = (long long)block_tokens * kv_heads * head_dim;
    gp_kv_paged r;
    r.base = pool + (2 * layer + kv) * plane + (long long)hk * head_dim;
    r.table = table;
    r.block_stride = (long long)layers * 2 * plane;
    r.shift = __ffs(block_tokens) - 1;
    r.mask = block_tokens - 1;
    r.slot_stride = kv_heads * head_dim;
    return r;
}

// grid-stride over rows * kv_heads * head_dim: row r's K and V (f32) into the slot of position
// positions[r] of table row (table_rows == rows ? r : 0), rounded to fp16 (nearest even).
extern "C" __global__ void gp_kv_append_paged(unsigned short* __restrict__ pool,
                                              const float* __restrict__ k,
                                              const float* __restrict__ v,
                                              const int* __restrict__ positions,
                                              const int* __restrict__ table, int rows,
                                              int table_rows, int layer, int layers,
                                              int block_tokens, int kv_heads, int head_dim,
                                              int max_blocks) {
    const int width = kv_heads * head_dim;
    const long long plane = (long long)block_tokens * width;
    const long long capacity = (long long)max_blocks * block_tokens;
    GP_GRID_STRIDE(i, (long long)rows * width) {
        const int r = (int)(i / width), c = (int)(i % width);
        const int p = positions[r];
        if (p < 0 || p >= capacity) continue;  // padding row (or past the table): no write
        const int* trow = table + (long long)(table_rows == rows ? r : 0) * max_blocks;
        const long long blk = trow[p / block_tokens];
        unsigned short* dst = pool + blk * layers * 2 * plane + 2 * layer * plane
                              + (long long)(p % block_tokens) * width + c;
        dst[0] = gp_f2h(k[i]);
        dst[plane] = gp_f2h(v[i]);
    }
}

// grid (kv_heads * ceil(group / 4), batch, splits), 128 threads: flash decode's split kernel
// over paged K/V. Row b sees positions [0, positions[b]] (none when positions[b] < 0).
extern "C" __global__ void __launch_bounds__(128, 4)
gp_flash_decode_split_paged(float* __restrict__ ws, const unsigned short* __restrict__ q,
                            const unsigned short* __restrict__ pool,
                            const int* __restrict__ positions, const int* __restrict__ table,
                            int batch, int heads, int kv_heads, int head_dim, int layer,
                            int layers, int block_tokens, int max_blocks, int span, float scale) {
    const int group = heads / kv_heads, hgroups = (group + GP_FD_HPB - 1) / GP_FD_HPB;
    const int hk = blockIdx.x / hgroups, hg = blockIdx.x % hgroups;
    const int b = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    const int h0 = hk * group + hg * GP_FD_HPB, nh = min(GP_FD_HPB, group - hg * GP_FD_HPB);
    const int nkeys = max(0, min(positions[b] + 1, max_blocks * block_tokens));
    const int j0 = min(sp * span, nkeys), j1 = min(j0 + span, nkeys);
    const int* trow = table + (long long)b * max_blocks;
    const gp_kv_paged kr = gp_paged_rows(pool, trow, layer, layers, 0, hk, block_tokens, kv_heads, head_dim);
    const gp_kv_paged vr = gp_paged_rows(pool, trow, layer, layers, 1, hk, block_tokens, kv_heads, head_dim);
    const unsigned short* qq = q + (long long)b * heads * head_dim + (long long)h0 * head_dim;
    float* part = ws + (((long long)b * heads + h0) * splits + sp) * (head_dim + 2);
    const int stride = splits * (head_dim + 2);
    const float sl = scale * GP_FA_LOG2E;
    __shared__ float smem[GP_FD_SMEM];
    if (head_dim == 128)
        gp_fd_split_block<128>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
    else if (head_dim == 64)
        gp_fd_split_block<64>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
    else
        gp_fd_split_block<16>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
}

// grid (ceil(tokens / 64), heads), 128 threads: one prefill chunk of one sequence. Token t <
// chunk_len (position start + t) sees positions [0, start + t]; rows t >= chunk_len are zero.
extern "C" __global__ void __launch_bounds__(128, GP_FA_MINB)
gp_flash_prefill_paged(unsigned short* out, const unsigned short* __restrict__ q,
                       const unsigned short* __restrict__ pool, const int* __restrict__ start,
                       const int* __restrict__ chunk_len, const int* __restrict__ table,
                       int tokens, int heads, int kv_heads, int head_dim, int layer, int layers,
                       int block_tokens, int max_blocks, float scale) {
    __shared__ __align__(16) unsigned short k_s[GP_FA_BN * (128 + GP_FA_PAD)];
    __shared__ __align__(16) unsigned short v_s[GP_FA_BN * (128 + GP_FA_PAD)];
    const int t0 = (gridDim.x - 1 - blockIdx.x) * GP_FA_BM, h = blockIdx.y;
    const int hk = h / (heads / kv_heads);
    const int p = start[0];
    // A negative start (a padding chunk) or an empty chunk: every row is zero.
    const int rows_valid = p < 0 ? 0 : max(0, min(chunk_len[0], tokens));
    const int valid = min(max(p, 0) + rows_valid, max_blocks * block_tokens);
    const gp_kv_paged kr = gp_paged_rows(pool, table, layer, layers, 0, hk, block_tokens, kv_heads, head_dim);
    const gp_kv_paged vr = gp_paged_rows(pool, table, layer, layers, 1, hk, block_tokens, kv_heads, head_dim);
    const long long width = (long long)heads * head_dim;
    unsigned short* o = out + (long long)h * head_dim;
    const unsigned short* qq = q + (long long)h * head_dim;
    const float sl = scale * GP_FA_LOG2E;
    if (head_dim == 128)
        gp_fa_prefill_block<128>(o, qq, kr, vr, k_s, v_s, tokens, rows_valid, t0, max(p, 0), valid,
                                 1, width, width, sl);
    else if (head_dim == 64)
        gp_fa_prefill_block<64>(o, qq, kr, vr, k_s, v_s, tokens, rows_valid, t0, max(p, 0), valid,
                                1, width, width, sl);
    else
        gp_fa_prefill_block<16>(o, qq, kr, vr, k_s, v_s, tokens, rows_valid, t0, max(p, 0), valid,
                                1, width, width, sl);
}
""")


# -- references (the pool as a NumPy array (capacity, layers, 2, block_tokens, kv_heads, d)) --
def paged_kv(pool: np.ndarray, table_row: np.ndarray, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V (n, kv_heads, head_dim) of positions [0, n) of one sequence, gathered."""
    bt = pool.shape[3]
    pos = np.arange(n)
    blocks = np.asarray(table_row, np.int64)[pos // bt]
    return pool[blocks, layer, 0, pos % bt], pool[blocks, layer, 1, pos % bt]


def kv_append_paged(pool: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                    table: np.ndarray, layer: int) -> np.ndarray:
    """The pool after appending rows of k/v (R, kv_heads * head_dim) f32 at `positions` through
    `table` (row r uses table row r when it has R rows, else row 0); -1 rows write nothing."""
    out = pool.copy()
    bt, kvh, d = pool.shape[3:]
    rows = k.shape[0]
    for r in range(rows):
        p = int(positions[r])
        if p < 0 or p >= table.shape[1] * bt:
            continue
        blk = int(table[r if table.shape[0] == rows else 0, p // bt])
        with np.errstate(over="ignore"):
            out[blk, layer, 0, p % bt] = k[r].reshape(kvh, d).astype(np.float16)
            out[blk, layer, 1, p % bt] = v[r].reshape(kvh, d).astype(np.float16)
    return out


def flash_decode_paged(q: np.ndarray, pool: np.ndarray, positions: np.ndarray, table: np.ndarray,
                       layer: int, heads: int) -> np.ndarray:
    """fp16 (B, heads * d): row r attends to positions [0, positions[r]]; -1 rows are zero."""
    d = pool.shape[5]
    out = np.zeros((q.shape[0], heads * d), np.float16)
    for r, p in enumerate(np.asarray(positions, np.int64)):
        if p < 0:
            continue
        k, v = paged_kv(pool, table[r], layer, int(p) + 1)
        out[r] = attention_f16(q[r].reshape(1, heads, d), k, v, np.array([p]), False).reshape(-1)
    return out


def flash_prefill_paged(q: np.ndarray, pool: np.ndarray, start: int, chunk_len: int,
                        table_row: np.ndarray, layer: int, heads: int) -> np.ndarray:
    """fp16 (S, heads * d): token t < chunk_len sees positions [0, start + t]; other rows zero."""
    s, d = q.shape[0], pool.shape[5]
    out = np.zeros((s, heads * d), np.float16)
    n = min(max(chunk_len, 0), s) if start >= 0 else 0
    if n == 0:
        return out
    k, v = paged_kv(pool, table_row, layer, start + n)
    qq = q[:n].reshape(n, heads, d)
    out[:n] = attention_f16(qq, k, v, start + np.arange(n), True).reshape(n, -1)
    return out


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
    device.launch(function, grid_1d(rows * kv_heads * head_dim), BLOCK,
                  [ptr(pool), ptr(k), ptr(v), ptr(positions), ptr(table), i32(rows),
                   i32(table_rows), i32(layer), i32(layers), i32(block_tokens), i32(kv_heads),
                   i32(head_dim), i32(max_blocks)], stream=stream)


def paged_decode_splits(max_blocks: int, block_tokens: int, batch: int, heads: int,
                        kv_heads: int) -> int:
    """Splits of the paged decode: a function of the graph's shape (max context, batch), never of
    the current lengths, so a captured decode graph stays valid."""
    return flash_decode_splits(max_blocks * block_tokens, batch, heads, kv_heads)


def paged_decode_workspace_bytes(*, batch: int, heads: int, head_dim: int, splits: int = 1,
                                 **_: int) -> int:
    return flash_decode_workspace_bytes(batch=batch, heads=heads, head_dim=head_dim, splits=splits)


def launch_flash_decode_split_paged(device, function, workspace: int, q: int, pool: int,
                                    positions: int, table: int, batch: int, heads: int,
                                    kv_heads: int, head_dim: int, layer: int, layers: int,
                                    block_tokens: int, max_blocks: int, splits: int,
                                    scale: float | None = None, stream=None) -> None:
    """The split half of the paged decode: partial states into `workspace`."""
    kernel = "flash_decode_split_paged"
    _check_paged(kernel, heads, kv_heads, head_dim, layer, layers, block_tokens, max_blocks)
    require_sizes(kernel, batch=batch, splits=splits)
    require(1 <= splits <= 64, f"{kernel}: splits={splits} must be in 1..64")
    require(batch < 65536, f"{kernel}: batch={batch} must be < 65536")
    require(workspace and workspace % 4 == 0 and positions and table,
            f"{kernel}: needs a 4-byte aligned workspace, positions and a table")
    for name, p in (("q", q), ("pool", pool)):
        require(p % 16 == 0, f"{kernel}: {name}=0x{p:x} must be 16-byte aligned (16-byte loads)")
    if batch == 0:
        return
    hgroups = ceil_div(heads // kv_heads, 4)
    device.launch(function, (kv_heads * hgroups, batch, splits), (DECODE_THREADS, 1, 1),
                  [ptr(workspace), ptr(q), ptr(pool), ptr(positions), ptr(table), i32(batch),
                   i32(heads), i32(kv_heads), i32(head_dim), i32(layer), i32(layers),
                   i32(block_tokens), i32(max_blocks),
                   i32(ceil_div(max_blocks * block_tokens, splits)), f32(_scale(head_dim, scale))],
                  stream=stream)


def launch_flash_decode_paged(device, split_function, combine_function, out: int, workspace: int,
                              q: int, pool: int, positions: int, table: int, batch: int,
                              heads: int, kv_heads: int, head_dim: int, layer: int, layers: int,
                              block_tokens: int, max_blocks: int, splits: int,
                              scale: float | None = None, stream=None) -> None:
    """Paged split-K decode: split kernel, then flash_attention's combine into fp16 out."""
    launch_flash_decode_split_paged(device, split_function, workspace, q, pool, positions, table,
                                    batch, heads, kv_heads, head_dim, layer, layers, block_tokens,
                                    max_blocks, splits, scale, stream)
    launch_flash_attention_combine(device, combine_function, out, workspace, batch, heads,
                                   head_dim, splits, stream)


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
                  stream=stream)


KV_APPEND_PAGED = KernelDef("kv_append_paged", "gp_kv_append_paged", SOURCE, kv_append_paged,
                            launch_kv_append_paged)
FLASH_DECODE_SPLIT_PAGED = KernelDef("flash_decode_split_paged", "gp_flash_decode_split_paged",
                                     SOURCE, attention_partial_f16, launch_flash_decode_split_paged,
                                     workspace=paged_decode_workspace_bytes)
FLASH_PREFILL_PAGED = KernelDef("flash_prefill_paged", "gp_flash_prefill_paged", SOURCE,
                                flash_prefill_paged, launch_flash_prefill_paged)

KERNELS = [KV_APPEND_PAGED, FLASH_DECODE_SPLIT_PAGED, FLASH_PREFILL_PAGED]
