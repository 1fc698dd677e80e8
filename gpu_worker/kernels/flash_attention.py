"""fp16 attention on tensor cores: a FlashAttention-style prefill and a split-K decode.

Layouts are attention.py's, in fp16 (strides in halves): q row (b, t) at q + (b*tokens + t)*
q_row_stride, head h at + h*head_dim; key j of sequence b at k + b*kv_batch_stride +
j*kv_row_stride, KV head hk at + hk*head_dim; out (batch*tokens, heads*head_dim) contiguous fp16.
Query head h reads KV head h // (heads // kv_heads); scale defaults to 1/sqrt(head_dim). Lengths
read from device int32s, so a captured graph stays valid as they change:
  prefill  query t of sequence b sees keys [0, past_b + t] (causal) or [0, past_b + len_b) (not),
           past_b = (past ? past[b] : 0) + past_len, len_b = lens ? lens[b] : tokens. Keys
           [0, past_b) come from the KV cache, the rest are this chunk's: chunked prefill.
  decode   the query of sequence b sees keys [0, min(lens[b] + len_add, max_len)); split s of
           `splits` covers keys [s*span, (s+1)*span), span = ceil(max_len / splits), and writes
           (max, sum, unnormalised acc) in fp32 to a workspace of flash_decode_workspace_bytes
           (reference.attention_partial's state per split); the combine kernel merges the splits
           into fp16.

Prefill design (FlashAttention-2, Dao 2023). A block is 4 warps and owns 64 query rows of one
(sequence, head); each warp owns 16 rows, so the softmax state of a row never leaves its warp (no
block-wide reductions). Q lives in registers as mma A fragments (loaded once, 32 registers at
head_dim 128); K and V tiles of 64 keys are staged in shared memory by cp.async, V(n) in flight
while S = Q K(n)^T runs and K(n+1) in flight while softmax and O += P V(n) run. S and O
accumulate in fp32 through `mma.sync.m16n8k16` (fp16 in); the S accumulator's register layout is
exactly the A-fragment layout of P, so P goes to the second mma rounded to fp16 without touching
shared memory; the scores are never materialised. B fragments come from shared memory by
ldmatrix (.trans for V); each staged row is padded by 16 bytes so the 8 row addresses of an
ldmatrix land in distinct banks. Why 64 x 64 and 4 warps: O (64) + S (32) + Q (32) fp32/fp16x2
registers per thread put the kernel at 165 registers = 3 blocks (12 warps) per SM, and the two
staged tiles (34 KiB at head_dim 128) stay under the 48 KiB static shared-memory limit (the device
layer sets no dynamic-smem attribute). Measured alternatives on the H200 (docs/kernels.md): 32-key
tiles double-buffered (same smem) 5 % slower; the same forced to 4 blocks per SM (128 registers,
spills) 14 % slower. Causal blocks stop at their last row's diagonal, and the grid runs the
longest (last) row blocks first so short blocks fill the tail. Online softmax in the exp2 domain
(scale * log2 e folded into one FFMA before each ex2), row max/sum by trees, not chains.

Decode design (flash decoding). One block of 128 threads serves one KV head and up to 4 of its
query heads over one split, so each KV byte is read once per group, not once per query head.
head_dim / 8 lanes own one key (16-byte loads: a lane owns 8 dims), each lane group streams 4 keys
per step (8 independent 16-byte loads in flight per thread) and keeps its own online-softmax state
per query head in registers; the lane groups merge once at the end through shared memory. 128
registers (launch bounds) give 4 blocks per SM; the contiguous (batch-1) decode's splits are spans
of 128 keys of max_len (flash_decode_splits: 64 splits = 512 blocks at 8k, ~one wave), a function
of max_len so graphs stay valid (the paged decode splits by the actual length). The combine gives
each split's weight its own thread (splits <= 64 < 128 threads). The first version (167 registers:
1.3 waves; a combine walking the splits serially) read 0.43 of the copy bandwidth at 8k, this 0.81.

Hazards: cp.async zero-fills rows past the last visible key (P = 0 times stale NaN bits would be
NaN); every loop that shuffles is uniform across its warp. Contract: head_dim 64 or 128, K/V and
q/out 16-byte aligned, row strides multiples of 8 halves (launchers refuse anything else).
"""
from __future__ import annotations

import math

from gpu_worker.device.backend import f32, i32, i64, ptr
from gpu_worker.kernels.common import KernelDef, ceil_div, cu_source, require, require_sizes
from gpu_worker.kernels.reference import (
    attention_combine_f16,
    attention_f16,
    attention_partial_f16,
)

HEAD_DIMS = (64, 128)
PREFILL_ROWS = 64          # query rows per prefill block (16 per warp)
PREFILL_THREADS = 128
DECODE_THREADS = 128
DECODE_HEADS_PER_BLOCK = 4
FLASH_MAX_SPLITS = 64      # most splits per (sequence, head)
COMBINE_MAX_SPLITS = 128   # most split states one combine block stages (its weights array)
MIN_SPLIT_KEYS = 128       # fewest keys per split worth a block (4 steps of 32 keys)

# CUDA C: cu/flash_attention.cu; its device helpers and templates (cu/flash_device.cuh) are shared
# with the paged kernels (paged_attention.py), which compile them into their own module.

SOURCE = cu_source("gp_flash_attention", "flash_attention.cu")


# -- launchers -------------------------------------------------------------------------------
def _scale(head_dim: int, scale: float | None) -> float:
    """1/sqrt(head_dim) unless given; positive (the kernels take maxima of unscaled scores)."""
    value = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    require(math.isfinite(value) and value > 0, f"attention scale={scale!r} must be finite and > 0")
    return value


def _check_common(kernel: str, heads: int, kv_heads: int, head_dim: int) -> None:
    require(heads > 0 and kv_heads > 0 and heads % kv_heads == 0,
            f"{kernel}: heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    require(head_dim in HEAD_DIMS, f"{kernel}: head_dim={head_dim} must be one of {HEAD_DIMS}")


def _check_aligned(kernel: str, pointers: dict[str, int], strides: dict[str, int]) -> None:
    for name, p in pointers.items():
        require(p % 16 == 0, f"{kernel}: {name}=0x{p:x} must be 16-byte aligned (16-byte loads)")
    for name, s in strides.items():
        require(s % 8 == 0, f"{kernel}: {name}={s} must be a multiple of 8 halves (16 bytes)")


def launch_flash_attention_prefill(device, function, out: int, q: int, k: int, v: int, lens: int,
                                   past: int, batch: int, tokens: int, heads: int, kv_heads: int,
                                   head_dim: int, q_row_stride: int, kv_row_stride: int,
                                   kv_batch_stride: int, past_len: int = 0, causal: bool = True,
                                   scale: float | None = None, stream=None) -> None:
    """launch_attention_prefill's arguments over fp16 q/k/v/out (strides in halves)."""
    kernel = "flash_attention_prefill"
    require_sizes(kernel, batch=batch, tokens=tokens, q_row_stride=q_row_stride,
                  kv_row_stride=kv_row_stride, past_len=past_len)
    require(isinstance(kv_batch_stride, int) and 0 <= kv_batch_stride < 2**62,
            f"{kernel}: kv_batch_stride={kv_batch_stride!r} must be a non-negative int")
    _check_common(kernel, heads, kv_heads, head_dim)
    require(heads < 65536 and batch < 65536, f"{kernel}: heads={heads} and batch={batch} must be < 65536")
    _check_aligned(kernel, {"out": out, "q": q, "k": k, "v": v},
                   {"q_row_stride": q_row_stride, "kv_row_stride": kv_row_stride,
                    "kv_batch_stride": kv_batch_stride})
    if batch == 0 or tokens == 0:
        return
    device.launch(function, (ceil_div(tokens, PREFILL_ROWS), heads, batch), (PREFILL_THREADS, 1, 1),
                  [ptr(out), ptr(q), ptr(k), ptr(v), ptr(lens), ptr(past), i32(batch),
                   i32(tokens), i32(heads), i32(kv_heads), i32(head_dim), i32(q_row_stride),
                   i32(kv_row_stride), i64(kv_batch_stride), i32(past_len), i32(1 if causal else 0),
                   f32(_scale(head_dim, scale))], stream=stream)


def flash_decode_splits(max_len: int, batch: int = 1, heads: int = 32, kv_heads: int = 8) -> int:
    """Splits of the contiguous decode: spans of >= MIN_SPLIT_KEYS keys of max_len, at most
    FLASH_MAX_SPLITS. A function of max_len (not of the current length), so a captured graph
    stays valid; a split past the current length leaves an empty state (weight 0 in the combine).
    `batch`, `heads` and `kv_heads` are accepted for the callers' symmetry with the paged decode,
    whose split is by the actual length (paged_attention.py)."""
    del batch, heads, kv_heads
    return max(1, min(FLASH_MAX_SPLITS, max_len // MIN_SPLIT_KEYS))


def flash_decode_workspace_bytes(*, batch: int, heads: int, head_dim: int, splits: int = 1,
                                 **_: int) -> int:
    """fp32 (max, sum, acc[head_dim]) per (sequence, query head, split)."""
    return 4 * batch * heads * splits * (head_dim + 2)


def launch_flash_attention_decode_split(device, function, workspace: int, q: int, k_cache: int,
                                        v_cache: int, lens: int, batch: int, heads: int,
                                        kv_heads: int, head_dim: int, q_row_stride: int,
                                        kv_row_stride: int, kv_batch_stride: int, len_add: int,
                                        max_len: int, splits: int, scale: float | None = None,
                                        stream=None) -> None:
    """Split s of `splits` of the fp16 decode: its partial state into `workspace`."""
    kernel = "flash_attention_decode_split"
    require_sizes(kernel, batch=batch, q_row_stride=q_row_stride, kv_row_stride=kv_row_stride,
                  max_len=max_len, splits=splits)
    require(isinstance(kv_batch_stride, int) and 0 <= kv_batch_stride < 2**62,
            f"{kernel}: kv_batch_stride={kv_batch_stride!r} must be a non-negative int")
    _check_common(kernel, heads, kv_heads, head_dim)
    require(1 <= splits <= FLASH_MAX_SPLITS, f"{kernel}: splits={splits} must be in 1..{FLASH_MAX_SPLITS}")
    require(lens != 0 and workspace != 0, f"{kernel}: needs lens (device int32 per sequence) and a workspace")
    require(workspace % 4 == 0, f"{kernel}: workspace=0x{workspace:x} must be 4-byte aligned")
    require(batch < 65536, f"{kernel}: batch={batch} must be < 65536")
    _check_aligned(kernel, {"q": q, "k_cache": k_cache, "v_cache": v_cache},
                   {"q_row_stride": q_row_stride, "kv_row_stride": kv_row_stride,
                    "kv_batch_stride": kv_batch_stride})
    if batch == 0:
        return
    hgroups = ceil_div(heads // kv_heads, DECODE_HEADS_PER_BLOCK)
    device.launch(function, (kv_heads * hgroups, batch, splits), (DECODE_THREADS, 1, 1),
                  [ptr(workspace), ptr(q), ptr(k_cache), ptr(v_cache), ptr(lens), i32(batch),
                   i32(heads), i32(kv_heads), i32(head_dim), i32(q_row_stride),
                   i32(kv_row_stride), i64(kv_batch_stride), i32(len_add), i32(max_len),
                   i32(ceil_div(max_len, splits)), f32(_scale(head_dim, scale))], stream=stream)


def decode_combine_shared_bytes(splits: int, head_dim: int) -> int:
    """Dynamic shared memory of one combine block (gp_fd_combine, flash_device.cuh): the
    `splits` states of its (row, head), fp32 (max, sum, acc[head_dim]) each, then a weight a
    split (COMBINE_MAX_SPLITS)."""
    return 4 * (splits * (head_dim + 2) + COMBINE_MAX_SPLITS)


def launch_flash_attention_combine(device, function, out: int, workspace: int, batch: int,
                                   heads: int, head_dim: int, splits: int, stream=None) -> None:
    """Merge the per-split states into fp16 out (batch, heads*head_dim)."""
    kernel = "flash_attention_combine"
    require_sizes(kernel, batch=batch, heads=heads, head_dim=head_dim, splits=splits)
    require(batch < 65536 and heads < 2**31 and 1 <= splits <= FLASH_MAX_SPLITS,
            f"{kernel}: batch < 65536 and splits in 1..{FLASH_MAX_SPLITS}")
    require(workspace != 0 and workspace % 8 == 0,
            f"{kernel}: needs an 8-byte aligned workspace (8-byte copies of the states)")
    require(out % 2 == 0, f"{kernel}: out=0x{out:x} must be 2-byte aligned")
    if batch == 0 or heads == 0:
        return
    device.launch(function, (heads, batch, 1), (DECODE_THREADS, 1, 1),
                  [ptr(out), ptr(workspace), i32(batch), i32(heads), i32(head_dim), i32(splits)],
                  stream=stream, shared_bytes=decode_combine_shared_bytes(splits, head_dim))


def launch_flash_attention_decode(device, split_function, combine_function, out: int,
                                  workspace: int, q: int, k_cache: int, v_cache: int, lens: int,
                                  batch: int, heads: int, kv_heads: int, head_dim: int,
                                  q_row_stride: int, kv_row_stride: int, kv_batch_stride: int,
                                  len_add: int, max_len: int, splits: int,
                                  scale: float | None = None, stream=None) -> None:
    """Both halves of the fp16 split-K decode: split kernel, then combine, through `workspace`
    (flash_decode_workspace_bytes(...) bytes)."""
    launch_flash_attention_decode_split(device, split_function, workspace, q, k_cache, v_cache,
                                        lens, batch, heads, kv_heads, head_dim, q_row_stride,
                                        kv_row_stride, kv_batch_stride, len_add, max_len, splits,
                                        scale, stream)
    launch_flash_attention_combine(device, combine_function, out, workspace, batch, heads,
                                   head_dim, splits, stream)


FLASH_ATTENTION_PREFILL = KernelDef("flash_attention_prefill", "gp_flash_prefill_f16", SOURCE,
                                    attention_f16, launch_flash_attention_prefill)
FLASH_ATTENTION_DECODE_SPLIT = KernelDef("flash_attention_decode_split",
                                         "gp_flash_decode_split_f16", SOURCE,
                                         attention_partial_f16, launch_flash_attention_decode_split,
                                         workspace=flash_decode_workspace_bytes)
FLASH_ATTENTION_COMBINE = KernelDef("flash_attention_combine", "gp_flash_combine_f16", SOURCE,
                                    attention_combine_f16, launch_flash_attention_combine)

KERNELS = [FLASH_ATTENTION_PREFILL, FLASH_ATTENTION_DECODE_SPLIT, FLASH_ATTENTION_COMBINE]
