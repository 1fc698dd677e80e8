"""The kernel library: CUDA C kernels compiled by NVRTC, each with a NumPy reference, a typed
launcher and (for the sim backend) a NumPy implementation over simulated device memory.

    from gpu_worker.kernels import ALL_KERNELS, RMSNORM, launch_rmsnorm
    module = compiler.load(device, RMSNORM.source)
    fn = device.get_function(module, RMSNORM.entry)
    launch_rmsnorm(device, fn, out, x, w, rows, hidden, eps, stream=device.stream)

The package by one rule: CUDA C in cu/ (one `.cu` per family, shared `.cuh` headers, every header
in the module's cache key), launchers and shape helpers in one Python module per family
(attention.py, flash_attention.py, paged_attention.py, ...), every NumPy oracle in reference.py,
the sim backend's implementations in sim/ and the device self-checks in selfcheck/.

`ALL_KERNELS` lists every KernelDef; `ALL_SOURCES` the distinct modules (one per family) for a
prefetch. Importing this package registers the sim implementations (gpu_worker.kernels.sim).
`gpu_worker.kernels.selfcheck` runs every kernel on a device against its reference.
"""
from __future__ import annotations

from gpu_worker.kernels.attention import (
    ATTENTION_DECODE_KV16,
    ATTENTION_PREFILL,
    ATTENTION_PREFILL_KV16,
    KV_APPEND_KV16,
    MAX_HEAD_DIM,
    launch_attention_decode,
    launch_attention_decode_kv16,
    launch_attention_prefill,
    launch_attention_prefill_kv16,
    launch_kv_append,
    launch_kv_append_kv16,
)
from gpu_worker.kernels.common import (
    COMMON_HEADER,
    COMMON_HEADER_NAME,
    NVRTC_OPTIONS,
    THREADS,
    KernelDef,
    KernelSource,
)
from gpu_worker.kernels.elementwise import (
    ADD,
    ADD_I32,
    BIAS_ADD,
    GELU,
    SILU_GATE,
    SILU_GATE_F16,
    launch_add,
    launch_add_i32,
    launch_bias_add,
    launch_gelu,
    launch_silu_gate,
    launch_silu_gate_f16,
)
from gpu_worker.kernels.embedding import EMBEDDING_GATHER, launch_embedding_gather
from gpu_worker.kernels.flash_attention import (
    FLASH_ATTENTION_COMBINE,
    FLASH_ATTENTION_DECODE_SPLIT,
    FLASH_ATTENTION_PREFILL,
    flash_decode_splits,
    flash_decode_workspace_bytes,
    launch_flash_attention_combine,
    launch_flash_attention_decode,
    launch_flash_attention_decode_split,
    launch_flash_attention_prefill,
)
from gpu_worker.kernels.half import (
    INT4_DEQUANT_F16,
    TO_F16,
    launch_int4_dequant_f16,
    launch_to_f16,
)
from gpu_worker.kernels.int4_batched import (
    INT4_MMA,
    INT4_MMA_ROWS,
    INT4_MMA_ROWS16,
    INT4_MMA_ROWS16_ASYNC,
    INT4_MMA_ROWS16_TILED,
    INT4_MMA_ROWS_ASYNC,
    INT4_MMA_ROWS_TILED,
    INT4_MMA_XA,
    INT4_MMA_XA_TILED,
    INT4_MMA_XK4,
    INT4_MMA_XK8,
    INT4_WGMMA,
    MMA_MAX_ROWS,
    launch_int4_mma,
    launch_int4_mma_rows,
    launch_int4_mma_rows16,
    launch_int4_mma_rows16_async,
    launch_int4_mma_rows16_tiled,
    launch_int4_mma_rows_async,
    launch_int4_mma_rows_tiled,
    launch_int4_mma_xa,
    launch_int4_mma_xa_tiled,
    launch_int4_mma_xk4,
    launch_int4_mma_xk8,
    launch_int4_wgmma,
)
from gpu_worker.kernels.linear import (
    FUSED_MAX_ROWS,
    INT4_DEQUANT,
    INT4_MATMUL,
    MATMUL_NT,
    MATMUL_NT_LARGE,
    int4_path,
    launch_int4_dequant,
    launch_int4_matmul,
    launch_matmul_nt,
    launch_matmul_nt_large,
)
from gpu_worker.kernels.norm import (
    LAYERNORM,
    RMSNORM,
    RMSNORM_F16,
    launch_layernorm,
    launch_rmsnorm,
    launch_rmsnorm_f16,
)
from gpu_worker.kernels.paged_attention import (
    FLASH_COMBINE_PAGED,
    FLASH_DECODE_SPLIT_PAGED,
    FLASH_PREFILL_PAGED,
    KV_APPEND_PAGED,
    launch_flash_combine_paged,
    launch_flash_decode_paged,
    launch_flash_decode_split_paged,
    launch_flash_prefill_paged,
    launch_kv_append_paged,
    paged_decode_span,
    paged_decode_splits,
)
from gpu_worker.kernels.qkv import (
    QKV_ROPE_APPEND,
    QKV_ROPE_APPEND_PAGED,
    launch_qkv_rope_append,
    launch_qkv_rope_append_paged,
)
from gpu_worker.kernels.reduce import ARGMAX, MEAN_POOL, launch_argmax, launch_mean_pool
from gpu_worker.kernels.rotary import ROTARY, ROTARY_ROWS, launch_rotary, launch_rotary_rows
from gpu_worker.kernels.sampling import SAMPLE, launch_sample

ALL_KERNELS: list[KernelDef] = [
    EMBEDDING_GATHER, RMSNORM, LAYERNORM, INT4_DEQUANT, MATMUL_NT, MATMUL_NT_LARGE, INT4_MATMUL,
    INT4_DEQUANT_F16, TO_F16, ROTARY,
    ATTENTION_PREFILL, ATTENTION_PREFILL_KV16, ATTENTION_DECODE_KV16, KV_APPEND_KV16,
    SILU_GATE, GELU, ADD, BIAS_ADD, ADD_I32,
    ARGMAX, MEAN_POOL,
    FLASH_ATTENTION_PREFILL, FLASH_ATTENTION_DECODE_SPLIT, FLASH_ATTENTION_COMBINE,
    INT4_MMA, INT4_MMA_XA, INT4_MMA_XA_TILED, INT4_MMA_ROWS, INT4_MMA_ROWS16, INT4_MMA_ROWS_TILED,
    INT4_MMA_ROWS16_TILED, INT4_MMA_ROWS_ASYNC, INT4_MMA_ROWS16_ASYNC, INT4_MMA_XK4, INT4_MMA_XK8, INT4_WGMMA,
    ROTARY_ROWS, KV_APPEND_PAGED, FLASH_DECODE_SPLIT_PAGED, FLASH_COMBINE_PAGED,
    FLASH_PREFILL_PAGED,
    SAMPLE,
    RMSNORM_F16, SILU_GATE_F16, QKV_ROPE_APPEND_PAGED, QKV_ROPE_APPEND,
]
KERNELS_BY_NAME: dict[str, KernelDef] = {k.name: k for k in ALL_KERNELS}

# One entry per NVRTC module, in first-use order (several defs share a module).
ALL_SOURCES: list[KernelSource] = list({id(k.source): k.source for k in ALL_KERNELS}.values())

# Registers the sim backend's NumPy kernels (entry name -> implementation) as a side effect.
from gpu_worker.kernels import sim as _sim  # noqa: F401  (sim/: core, flash, paged)

__all__ = [
    "ADD",
    "ADD_I32",
    "ALL_KERNELS",
    "ALL_SOURCES",
    "ARGMAX",
    "ATTENTION_DECODE_KV16",
    "ATTENTION_PREFILL",
    "ATTENTION_PREFILL_KV16",
    "BIAS_ADD",
    "COMMON_HEADER",
    "COMMON_HEADER_NAME",
    "EMBEDDING_GATHER",
    "FLASH_ATTENTION_COMBINE",
    "FLASH_ATTENTION_DECODE_SPLIT",
    "FLASH_ATTENTION_PREFILL",
    "FLASH_COMBINE_PAGED",
    "FLASH_DECODE_SPLIT_PAGED",
    "FLASH_PREFILL_PAGED",
    "FUSED_MAX_ROWS",
    "GELU",
    "INT4_DEQUANT",
    "INT4_DEQUANT_F16",
    "INT4_MATMUL",
    "INT4_MMA",
    "INT4_MMA_ROWS",
    "INT4_MMA_ROWS16",
    "INT4_MMA_ROWS16_ASYNC",
    "INT4_MMA_ROWS16_TILED",
    "INT4_MMA_ROWS_ASYNC",
    "INT4_MMA_ROWS_TILED",
    "INT4_MMA_XA",
    "INT4_MMA_XA_TILED",
    "INT4_MMA_XK4",
    "INT4_MMA_XK8",
    "INT4_WGMMA",
    "KERNELS_BY_NAME",
    "KV_APPEND_KV16",
    "KV_APPEND_PAGED",
    "LAYERNORM",
    "MATMUL_NT",
    "MATMUL_NT_LARGE",
    "MAX_HEAD_DIM",
    "MEAN_POOL",
    "MMA_MAX_ROWS",
    "NVRTC_OPTIONS",
    "QKV_ROPE_APPEND",
    "QKV_ROPE_APPEND_PAGED",
    "RMSNORM",
    "RMSNORM_F16",
    "ROTARY",
    "ROTARY_ROWS",
    "SAMPLE",
    "SILU_GATE",
    "SILU_GATE_F16",
    "THREADS",
    "TO_F16",
    "KernelDef",
    "KernelSource",
    "flash_decode_splits",
    "flash_decode_workspace_bytes",
    "int4_path",
    "launch_add",
    "launch_add_i32",
    "launch_argmax",
    "launch_attention_decode",
    "launch_attention_decode_kv16",
    "launch_attention_prefill",
    "launch_attention_prefill_kv16",
    "launch_bias_add",
    "launch_embedding_gather",
    "launch_flash_attention_combine",
    "launch_flash_attention_decode",
    "launch_flash_attention_decode_split",
    "launch_flash_attention_prefill",
    "launch_flash_combine_paged",
    "launch_flash_decode_paged",
    "launch_flash_decode_split_paged",
    "launch_flash_prefill_paged",
    "launch_gelu",
    "launch_int4_dequant",
    "launch_int4_dequant_f16",
    "launch_int4_matmul",
    "launch_int4_mma",
    "launch_int4_mma_rows",
    "launch_int4_mma_rows16",
    "launch_int4_mma_rows16_async",
    "launch_int4_mma_rows16_tiled",
    "launch_int4_mma_rows_async",
    "launch_int4_mma_rows_tiled",
    "launch_int4_mma_xa",
    "launch_int4_mma_xa_tiled",
    "launch_int4_mma_xk4",
    "launch_int4_mma_xk8",
    "launch_int4_wgmma",
    "launch_kv_append",
    "launch_kv_append_kv16",
    "launch_kv_append_paged",
    "launch_layernorm",
    "launch_matmul_nt",
    "launch_matmul_nt_large",
    "launch_mean_pool",
    "launch_qkv_rope_append",
    "launch_qkv_rope_append_paged",
    "launch_rmsnorm",
    "launch_rmsnorm_f16",
    "launch_rotary",
    "launch_rotary_rows",
    "launch_sample",
    "launch_silu_gate",
    "launch_silu_gate_f16",
    "launch_to_f16",
    "paged_decode_span",
    "paged_decode_splits",
]
