"""The loader's int4 quantizer: `models.weights.quantize`, bit for bit, in pieces with reused scratch.

Hazard: `gpu_worker/models/weights.py::quantize` defines our int4 block format; a checkpoint load
quantizes 16 GB of bf16 with it, and the NumPy spelling there makes ~12 passes over fresh 4-byte
temporaries per element (each a new allocation the kernel zero-fills on first touch).
Contract: `quantize_rows(raw, dtype, packed, scales)` writes into `packed`/`scales` exactly what
`quantize(to_float32(raw, dtype))` returns, for every input including zeros, subnormal scales,
values past fp16's range, inf and NaN (tests/checkpoints/test_fast_quantize.py), over pieces of
`PIECE_ELEMS` elements in per-thread scratch buffers allocated once. A piece takes the fast
spelling (`_piece`: block maxima from the stored bits, rint + 8 + the nibble in one add), exact
wherever every block's scale is a normal fp16 or zero; rows holding any other scale are redone
by `_piece_exact`, quantize()'s operations in its order. Cost: ~15 NumPy calls a piece, ~8 passes
over it; 0.80 GB/s of bf16 on one H100-host core (the exact spelling 0.71). NumPy releases the
GIL inside each call, so the loader's threads quantize in parallel as long as pieces are large
(below).
"""
from __future__ import annotations

import sys
import threading
from typing import Protocol

import numpy as np

from gpu_worker.models.configs import QUANT_BLOCK

# 4 MiB of float32. Each NumPy call takes the GIL for its setup (under contention a futex
# hand-off, microseconds); a piece is ~20 calls, so pieces must be big enough that 16 threads do
# not queue on the GIL: with 64K-element pieces they did on the H200 machine (16 threads,
# 458 thread-seconds to convert 16 GB, 0.6 GB/s). Bigger pieces leave the L2 (~13 MiB of scratch
# a thread) but memory bandwidth is not the limit at this rate.
PIECE_ELEMS = 1 << 20


class _Scratch(threading.local):
    """One thread's reusable buffers (threading.local: each loader thread gets its own)."""

    elems = 0

    def ensure(self, elems: int) -> _Scratch:
        if self.elems < elems:   # once per thread (or when PIECE_ELEMS grows)
            self.f32 = np.empty(elems, np.float32)
            self.abs = np.empty(elems, np.float32)
            self.half = np.empty(elems // 2, np.float32)      # the max tree's levels
            self.quarter = np.empty(elems // 4, np.float32)
            self.i8 = np.empty(elems, np.int8)
            self.u16 = np.empty(elems // 2, np.uint16)
            self.mag = np.empty(4 * elems, np.uint8)      # |x|'s stored bits, then their tree
            self.mag_half = np.empty(2 * elems, np.uint8)
            self.mag_quarter = np.empty(elems, np.uint8)
            self.hi = np.empty(elems // 2, np.uint8)
            self.amax = np.empty(elems // QUANT_BLOCK, np.float32)
            self.safe = np.empty(elems // QUANT_BLOCK, np.float32)
            self.elems = elems
        return self


_scratch = _Scratch()


def piece_rows(in_dim: int) -> int:
    """Rows per piece: as many as fit PIECE_ELEMS (at least one)."""
    return max(1, PIECE_ELEMS // in_dim)


def quantize_rows(raw: np.ndarray, dtype: str, packed: np.ndarray, scales: np.ndarray) -> None:
    """Quantize the rows `raw` (stored dtype: BF16 as uint16, F16 or F32) into `packed` (uint8,
    rows x in/2) and `scales` (float16, rows x in/32)."""
    rows, in_dim = raw.shape
    if in_dim % QUANT_BLOCK:
        raise ValueError(f"input dimension {in_dim} is not a multiple of {QUANT_BLOCK}")
    with np.errstate(all="ignore"):   # inf/NaN inputs quantize as in quantize(), silently
        if in_dim > PIECE_ELEMS:   # one row would overflow a piece: the plain spelling
            from gpu_worker.checkpoints.safetensors import to_float32
            from gpu_worker.models.weights import quantize
            q = quantize(to_float32(raw, dtype))
            packed[...], scales[...] = q.packed, q.scales
            return
        step = piece_rows(in_dim)
        for r in range(0, rows, step):
            _piece(raw[r:r + step], dtype, packed[r:r + step], scales[r:r + step])


class RowQuantizer(Protocol):
    """What the loader quantizes a chunk with: the host's (HOST_QUANTIZER, quantize_rows on the
    loader's threads) or the device's (device_quantizer.DeviceQuantizer). Both write the same
    bytes; a chunk's stored bytes are staged in the quantizer's own buffer first."""

    chunk_scale: int   # the loader's chunks times this (a device round trip wants bigger ones)

    def staging(self, nbytes: int) -> np.ndarray:
        """The calling thread's buffer for one chunk's stored bytes (uint8, at least nbytes),
        reused by its next chunk."""
        ...

    def __call__(self, raw: np.ndarray, dtype: str, packed: np.ndarray,
                 scales: np.ndarray) -> None:
        """quantize_rows' contract."""
        ...


class _HostStaging(threading.local):
    buf = np.empty(0, np.uint8)


class HostQuantizer:
    """quantize_rows on the loader's threads, each staging into a plain array of its own."""

    chunk_scale = 1

    def __init__(self) -> None:
        self._staging = _HostStaging()

    def staging(self, nbytes: int) -> np.ndarray:
        if self._staging.buf.nbytes < nbytes:
            self._staging.buf = np.empty(nbytes, np.uint8)
        return self._staging.buf

    def __call__(self, raw: np.ndarray, dtype: str, packed: np.ndarray,
                 scales: np.ndarray) -> None:
        quantize_rows(raw, dtype, packed, scales)


HOST_QUANTIZER = HostQuantizer()


# The stored bits of |x| by dtype: for every x but NaN, |x| orders as these unsigned integers.
_BITS = {"BF16": (np.uint16, 0x7FFF), "F16": (np.uint16, 0x7FFF), "F32": (np.uint32, 0x7FFFFFFF)}
# y + RINT_MAGIC rounds y to an integer, ties to even, for |y| < 2 ** 22 (the sum lies where f32's
# spacing is 1; RINT_MAGIC is even, so the tie goes as rint's), and adds 8: the float's low
# mantissa bits are then 0x...08 + rint(y), so its low byte is the nibble rint(y) + 8.
RINT_MAGIC = np.float32(3 * 2 ** 22 + 8)
_LOW_BYTE = 0 if sys.byteorder == "little" else 3
FP16_EXPONENT = 0x7C00


def _piece(raw: np.ndarray, dtype: str, packed: np.ndarray, scales: np.ndarray) -> None:
    """The fast spelling, ~8 passes: block maxima from the stored bits, x / scale, then rint,
    + 8 and the nibble in one add (RINT_MAGIC). It needs no clip where a block's scale is a
    normal fp16 or zero (|x / scale| <= 7.004, or x / 1 < 1e-6): rows holding any other block
    (subnormal, inf or NaN scales: tiny blocks, overflow, inf and NaN inputs) are done again by
    `_piece_exact`, quantize()'s own sequence."""
    n, in_dim = raw.shape
    s = _scratch.ensure(n * in_dim)
    nb, size = in_dim // QUANT_BLOCK, n * in_dim
    uint, signless = _BITS[dtype]
    width = np.dtype(uint).itemsize
    mag = np.bitwise_and(raw.reshape(-1).view(uint), uint(signless),
                         out=s.mag[:size * width].view(uint))
    ping, pong = s.mag_half.view(uint), s.mag_quarter.view(uint)
    top = _block_max(mag, ping, pong, ping)                # n * nb stored bits of the maxima
    amax = s.amax[:n * nb]
    if dtype == "BF16":
        np.left_shift(top, 16, out=amax.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(amax, top.view(np.float16 if dtype == "F16" else np.float32))
    np.divide(amax, np.float32(7.0), out=amax)
    np.copyto(scales, amax.reshape(n, nb), casting="same_kind")
    safe = s.safe[:n * nb]
    np.copyto(safe, scales.reshape(-1))
    np.add(safe, safe == 0, out=safe)
    f = s.f32[:size].reshape(n, in_dim)
    if dtype == "BF16":
        np.left_shift(raw, 16, out=f.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(f, raw)
    blocks = f.reshape(-1, QUANT_BLOCK)
    np.divide(blocks, safe[:, None], out=blocks)
    np.add(blocks, RINT_MAGIC, out=blocks)
    nibbles = f.view(np.uint8).reshape(n, 4 * in_dim)[:, _LOW_BYTE::4]
    hi = s.hi[:size // 2].reshape(n, in_dim // 2)
    np.left_shift(nibbles[:, 1::2], 4, out=hi)
    np.bitwise_or(nibbles[:, 0::2], hi, out=packed)
    exponent = np.bitwise_and(scales.view(np.uint16), FP16_EXPONENT)
    odd = ((exponent == 0) & (scales != 0)) | (exponent == FP16_EXPONENT)
    rows = np.flatnonzero(odd.any(axis=1))
    if rows.size:
        pk, sc = packed[rows], scales[rows]
        _piece_exact(raw[rows], dtype, pk, sc)
        packed[rows], scales[rows] = pk, sc


def _block_max(a: np.ndarray, ping: np.ndarray, pong: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Max of every aligned run of 32 in `a` (flat), as a pairwise tree through the scratch
    arrays `ping` and `pong` (a's dtype) into `out`: five stride-2 passes run ~3x faster than
    NumPy's reduction along a short last axis. Same value as `max(axis=...)` (a NaN propagates;
    with several NaNs in a block its payload may differ)."""
    m = a
    for buf in (ping, pong, ping, pong):
        m = np.maximum(m[0::2], m[1::2], out=buf[:m.size // 2])
    return np.maximum(m[0::2], m[1::2], out=out[:m.size // 2])


def _piece_exact(raw: np.ndarray, dtype: str, packed: np.ndarray, scales: np.ndarray) -> None:
    """quantize()'s operations in its order, into scratch."""
    n, in_dim = raw.shape
    s = _scratch.ensure(n * in_dim)
    nb = in_dim // QUANT_BLOCK
    f = s.f32[:n * in_dim].reshape(n, in_dim)
    if dtype == "BF16":   # bf16 is the top half of an f32 (as to_float32 widens it)
        np.left_shift(raw, 16, out=f.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(f, raw)
    blocks = f.reshape(n, nb, QUANT_BLOCK)
    # scales = (|blocks|.max / 7) rounded to fp16, as quantize() does
    size = n * in_dim
    a = np.abs(f.reshape(-1), out=s.abs[:size])
    amax = _block_max(a, s.half, s.quarter, s.amax)
    np.divide(amax, np.float32(7.0), out=amax)
    np.copyto(scales, amax.reshape(n, nb), casting="same_kind")
    # safe = scales in f32 with 0 -> 1 (scales are >= 0 or NaN); q = clip(rint(blocks / safe), -8, 7)
    safe = s.safe[:n * nb]
    np.copyto(safe, scales.reshape(-1))
    np.add(safe, safe == 0, out=safe)
    np.divide(blocks.reshape(-1, QUANT_BLOCK), safe[:, None], out=blocks.reshape(-1, QUANT_BLOCK))
    np.rint(blocks, out=blocks)
    np.maximum(blocks, -8, out=blocks)   # np.clip's value (NaN kept), without its Python wrapper
    np.minimum(blocks, 7, out=blocks)
    # nibble = q + 8; byte j = nibble(2j) | nibble(2j+1) << 4: read the int8 pairs as little-endian
    # uint16 v = lo | hi << 8, so (v | v >> 4) has lo | hi << 4 in its low byte
    q8 = s.i8[:n * in_dim].reshape(n, in_dim)
    np.copyto(q8, f, casting="unsafe")
    np.add(q8, 8, out=q8)
    v = q8.view(np.uint16)
    w = s.u16[:n * in_dim // 2].reshape(n, in_dim // 2)
    np.right_shift(v, 4, out=w)
    np.bitwise_or(w, v, out=w)
    np.copyto(packed, w, casting="unsafe")   # keeps the low byte
