"""The fused QKV linear's epilogue: bias, rotary on q and k, KV append and the query's cast in one
kernel (DESIGN 6.2: a step of a few hundred nodes, not 19 kernels a layer).

The decoder's q, k and v projections are one linear (`wqkv`, concatenated at load:
gpu_worker.models.weights.fuse_linears), whose output rows are q | k | v, f32, row stride
(heads + 2 * kv_heads) * head_dim. One kernel then reads each row once:
- adds the bias (Qwen2's q/k/v biases, concatenated like the weights; 0: none),
- rotates q and k at the row's position ("rotate half", the angles of gp_rotary: double angle,
  float rotation; `inv_freq` replaces theta's frequencies when given),
- appends k and v to the KV cache in fp16 (round to nearest even),
- writes q in the dtype attention reads: fp16 for the flash kernels, f32 for the `_kv16` ones.
It replaces four nodes (rotary q, rotary k, kv_append, to_f16) and their passes over q and k.
The result is exactly theirs: the same float operations in the same order.

Two entries, one per KV layout:
- `qkv_rope_append_paged`: the paged pool (paged_attention.py's layout and its hazard: only the
  table entry of the row's own position is read); row r at positions[r], -1 a padding row (q
  zero, nothing appended), table row r (or row 0 when the table has one row: a prefill chunk).
- `qkv_rope_append`: one sequence's contiguous fp16 cache (max_len, kv_heads, head_dim); token t
  at position start[0] + t read on the device (so a captured decode graph replays every step),
  rows outside [0, max_len) append nothing.
Cost: one grid-stride pass over rows * ((heads + kv_heads) * head_dim / 2 + kv_heads * head_dim)
items; bytes moved are the qkv rows once, q once and K/V once.
"""
from __future__ import annotations

from gpu_worker.device.backend import f32, i32, ptr
from gpu_worker.kernels import common, reference
from gpu_worker.kernels.common import BLOCK, KernelDef, cu_source, grid_1d, require, require_sizes

SOURCE = cu_source("gp_qkv", "qkv.cu")


ROPE_HEADS = 8   # the most heads the paged kernel rotates a thread at one (row, j) (GP_ROPE_HEADS)
ROPE_ITEMS_PER_SM = 256   # rotary items an SM takes before sharing angles pays (see rope_heads)


def rope_heads(device, rows: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Heads one thread of the paged kernel rotates at one (row, j): the fewest (1, 2, 4, then
    ROPE_HEADS) whose rotary items fit ROPE_ITEMS_PER_SM a multiprocessor. Each item computes
    one double-precision angle (pow + sincos, the kernel's cost): at decode batch 1 every angle
    in parallel is quickest (1 head: 99 us a Llama-3-8B step on the H200, 8 heads: 123 us), at 64
    rows computing an eighth of the angles is (8 heads: 156 us, 1 head: 218 us)."""
    budget = ROPE_ITEMS_PER_SM * common.sm_count(device)
    for h in (1, 2, 4):
        if rows * -(-(heads + kv_heads) // h) * (head_dim // 2) <= budget:
            return h
    return ROPE_HEADS


def _items(rows: int, heads: int, kv_heads: int, head_dim: int, rope_heads: int = 1) -> int:
    """Threads a kernel wants: per row, a rotary item per pair j of `rope_heads` heads, then
    one per v element."""
    groups = -(-(heads + kv_heads) // rope_heads)
    return rows * (groups * (head_dim // 2) + kv_heads * head_dim)


def _check(kernel: str, rows: int, heads: int, kv_heads: int, head_dim: int) -> None:
    require_sizes(kernel, rows=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  elements=rows * (heads + 2 * kv_heads) * head_dim)
    require(head_dim % 2 == 0 and head_dim > 0, f"{kernel}: head_dim={head_dim} must be even")
    require(heads > 0 and kv_heads > 0 and heads % kv_heads == 0,
            f"{kernel}: heads={heads} must be a positive multiple of kv_heads={kv_heads}")


def launch_qkv_rope_append_paged(device, function, q_out: int, pool: int, qkv: int, bias: int,
                                 positions: int, table: int, rows: int, table_rows: int,
                                 heads: int, kv_heads: int, head_dim: int, theta: float,
                                 layer: int, layers: int, block_tokens: int, max_blocks: int,
                                 stream=None, inv_freq: int = 0) -> None:
    """q_out (rows, heads * head_dim) fp16 and the pool's K/V of `layer` from qkv (rows,
    (heads + 2 * kv_heads) * head_dim) f32 at `positions` (-1: padding) through `table`."""
    kernel = "qkv_rope_append_paged"
    _check(kernel, rows, heads, kv_heads, head_dim)
    require_sizes(kernel, table_rows=table_rows, layer=layer, layers=layers,
                  block_tokens=block_tokens, max_blocks=max_blocks)
    require(table_rows in (1, rows), f"{kernel}: table_rows={table_rows} must be 1 or rows={rows}")
    require(0 <= layer < layers, f"{kernel}: layer={layer} must be in [0, layers={layers})")
    require(block_tokens > 0 and max_blocks > 0 and max_blocks * block_tokens < 2**31,
            f"{kernel}: block_tokens={block_tokens} and max_blocks={max_blocks} must be > 0")
    require(pool % 2 == 0 and q_out % 2 == 0 and positions and table,
            f"{kernel}: needs a 2-byte aligned pool and q, positions and a table")
    if rows == 0:
        return
    per = rope_heads(device, rows, heads, kv_heads, head_dim)
    device.launch(function, grid_1d(device, _items(rows, heads, kv_heads, head_dim, per)), BLOCK,
                  [ptr(q_out), ptr(pool), ptr(qkv), ptr(bias), ptr(positions), ptr(table),
                   i32(rows), i32(table_rows), i32(heads), i32(kv_heads), i32(head_dim),
                   f32(theta), ptr(inv_freq), i32(layer), i32(layers), i32(block_tokens),
                   i32(max_blocks), i32(per)], stream=stream, pdl=True)


def launch_qkv_rope_append(device, function, q_out: int, k_cache: int, v_cache: int, qkv: int,
                           bias: int, start: int, tokens: int, heads: int, kv_heads: int,
                           head_dim: int, theta: float, max_len: int, q_half: bool = True,
                           stream=None, inv_freq: int = 0) -> None:
    """q_out (tokens, heads * head_dim), fp16 when `q_half` else f32, and rows start[0].. of the
    fp16 caches (max_len, kv_heads * head_dim) from qkv (tokens, (heads + 2 * kv_heads) *
    head_dim) f32."""
    kernel = "qkv_rope_append"
    _check(kernel, tokens, heads, kv_heads, head_dim)
    require_sizes(kernel, max_len=max_len)
    require(start != 0, f"{kernel}: needs start (a device int32)")
    require(k_cache % 2 == 0 and v_cache % 2 == 0, f"{kernel}: caches must be 2-byte aligned")
    if tokens == 0:
        return
    device.launch(function, grid_1d(device, _items(tokens, heads, kv_heads, head_dim)), BLOCK,
                  [ptr(q_out), ptr(k_cache), ptr(v_cache), ptr(qkv), ptr(bias), ptr(start),
                   i32(tokens), i32(heads), i32(kv_heads), i32(head_dim), f32(theta),
                   ptr(inv_freq), i32(max_len), i32(1 if q_half else 0)], stream=stream)


QKV_ROPE_APPEND_PAGED = KernelDef("qkv_rope_append_paged", "gp_qkv_rope_append_paged", SOURCE,
                                  reference.qkv_rope_append_paged, launch_qkv_rope_append_paged)
QKV_ROPE_APPEND = KernelDef("qkv_rope_append", "gp_qkv_rope_append", SOURCE,
                            reference.qkv_rope_append, launch_qkv_rope_append)

KERNELS = [QKV_ROPE_APPEND_PAGED, QKV_ROPE_APPEND]
