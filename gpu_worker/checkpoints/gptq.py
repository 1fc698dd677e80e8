"""Symmetric 4-bit GPTQ tensors -> our int4 blocks, bit for bit (no requantization).

GPTQ (AutoGPTQ / GPTQModel) stores a linear of shape (out, in) as
  qweight int32 (in/8, out)       8 nibbles per word along the input, lowest bits first
  qzeros  int32 (in/g, out/8)     zero points packed along the output (v1 stores zero - 1)
  scales  fp16  (in/g, out)       w[o, i] = (q[i, o] - zero) * scales[i // g, o]
  g_idx   int32 (in,)             group of each input row; i // g without act-order
With symmetric quantization the zero is 8, which is exactly our nibble convention (n stands for
n - 8), and a group of g = k x 32 inputs is k of our blocks sharing one scale. So the nibbles are
transposed and repacked, the scales transposed and repeated; nothing is rounded.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.models.configs import QUANT_BLOCK


def unpack_input_major(qweight: np.ndarray) -> np.ndarray:
    """uint8 (out, in) nibbles of an int32 (in/8, out) qweight."""
    words = np.ascontiguousarray(qweight).view(np.uint32)
    in8, out = words.shape
    nib = np.empty((out, in8 * 8), np.uint8)
    for j in range(8):
        nib[:, j::8] = ((words >> np.uint32(4 * j)) & np.uint32(0xF)).T
    return nib


def zeros(qzeros: np.ndarray, v2: bool) -> np.ndarray:
    """int (in/g, out) zero points of an int32 (in/g, out/8) qzeros (v1: stored + 1)."""
    words = np.ascontiguousarray(qzeros).view(np.uint32)
    z = np.stack([(words >> np.uint32(4 * j)) & np.uint32(0xF) for j in range(8)], axis=-1)
    return z.reshape(words.shape[0], -1).astype(np.int32) + (0 if v2 else 1)


def to_blocks(qweight: np.ndarray, scales: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed uint8 (out, in/2), scales fp16 (out, in/32)) in our layout."""
    nib = unpack_input_major(qweight)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    in_dim = nib.shape[1]
    per_group = (in_dim if group == -1 else group) // QUANT_BLOCK
    ours = np.repeat(np.ascontiguousarray(scales.T).astype(np.float16), per_group, axis=1)
    return packed, ours
