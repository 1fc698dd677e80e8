"""Stored floats -> int4 blocks on the device: the checkpoint loader's quantizer.

`int4_quantize` makes our int4 layout (gpu_worker.kernels.reference's header: block 32 along a
row, fp16 scale absmax / 7, nibble q + 8) out of a checkpoint's stored rows (BF16, F16 or F32
bits), bit for bit what `reference.int4_quantize_stored` and `models.weights.quantize` make of
them, for every input (zeros, subnormals, overflowing scales, inf, NaN: cu/quantize.cu says how).
A thread takes one block of 32 (64 or 128 bytes in, 16 bytes and a scale out).

Why on the device: a load converts 16 GB of bf16 at 8B; the host's quantizer does ~0.8 GB/s a
core, so the load is bound by the host's free cores (DESIGN amendment 46), and this kernel does
it in milliseconds. Its caller is gpu_worker.checkpoints.device_quantizer.

Layout: `raw` is rows x in_dim stored values, in_dim a multiple of 32, 16-byte aligned; `packed`
rows x in_dim / 2 bytes, `scales` rows x in_dim / 32 fp16, both contiguous.
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, i64, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import BLOCK, KernelDef, cu_source, grid_1d, require

# a checkpoint's stored float dtype -> the kernel's dtype code (GP_Q_* in cu/quantize.cu)
STORED_DTYPES = {"BF16": 0, "F16": 1, "F32": 2}
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
QUANT_BLOCK = reference.QUANT_BLOCK

SOURCE = cu_source("gp_quantize", "quantize.cu")


def quantized_bytes(rows: int, in_dim: int) -> tuple[int, int]:
    """(packed, scales) bytes of `rows` quantized rows of `in_dim` values."""
    return rows * in_dim // 2, rows * (in_dim // QUANT_BLOCK) * 2


def launch_int4_quantize(device, function, packed: int, scales: int, raw: int, dtype: str,
                         rows: int, in_dim: int, stream=None) -> None:
    """Quantize `rows` stored rows of `in_dim` values at `raw` into `packed` and `scales`."""
    kernel = "int4_quantize"
    require(dtype in STORED_DTYPES,
            f"{kernel}: dtype {dtype!r} must be one of {sorted(STORED_DTYPES)}")
    require(isinstance(rows, int) and isinstance(in_dim, int) and rows >= 0 and in_dim >= 0,
            f"{kernel}: rows={rows!r}, in_dim={in_dim!r} must be non-negative ints")
    require(in_dim % QUANT_BLOCK == 0,
            f"{kernel}: in_dim={in_dim} must be a multiple of {QUANT_BLOCK} (whole blocks)")
    require(raw % 16 == 0 and packed % 16 == 0 and scales % 2 == 0,
            f"{kernel}: raw and packed 16-byte aligned, scales 2-byte aligned")
    blocks = rows * (in_dim // QUANT_BLOCK)
    if blocks == 0:
        return
    device.launch(function, grid_1d(device, blocks), BLOCK,
                  [ptr(packed), ptr(scales), ptr(raw), i32(STORED_DTYPES[dtype]), i64(blocks)],
                  stream=stream)


INT4_QUANTIZE = KernelDef("int4_quantize", "gp_int4_quantize", SOURCE,
                          reference.int4_quantize_stored, launch_int4_quantize)

KERNELS = [INT4_QUANTIZE]
