"""The loader's int4 quantizer on the device: stored rows up, int4 blocks back.

Hazard: the host quantizer converts ~0.8 GB/s of bf16 a core, so an 8B load (16 GB of bf16)
is bound by the host's free cores: on a node whose other tenants take half of them, or under a
container's CPU limit, the load ran at 1.7-3.4x its floor (DESIGN amendment 46).
Contract: `DeviceQuantizer.__call__` is `quantize_rows`: the same bytes for every input (the
kernel's contract, gpu_worker/kernels/quantize.py), so a checkpoint loads to the same weights
either way (tests/checkpoints/test_device_quantizer.py). Each loader thread stages its chunk's
stored bytes in pinned memory of its own (`staging`: the loader copies them there straight out of
the mmap) and takes one of DEVICE_SETS device buffer sets (booked in the `transient` zone, each
with a stream and an event): one H2D copy, one kernel, one D2H copy of the int4 bytes into the
thread's pinned memory, waited for on the set's event (gated like a stream sync), then copied
into the caller's arrays. Chunks are CHUNK_SCALE times the host's (`chunk_scale`, read by the
loader). `close()` waits for every set and frees everything.
Where the device has no room for a set's buffers (RESOURCE_EXHAUSTED after the reclaimer), that
chunk is quantized on the host instead: a full device slows a load, it does not fail it.
Cost: the stored bytes cross PCIe once (16 GB at 8B, ~0.3 s at 55 GB/s) and the host copies
the int4 bytes once more (0.28 of the stored bytes); the kernel takes microseconds a chunk.
Memory: DEVICE_SETS x ~21 MiB of device memory for 16 MiB chunks of bf16 (~84 MiB), and ~21 MiB
of pinned host memory a loader thread, until `close()`.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Self

import numpy as np

from gpu_worker.checkpoints.quantize import quantize_rows
from gpu_worker.kernels.quantize import (
    INT4_QUANTIZE,
    QUANT_BLOCK,
    STORED_DTYPES,
    launch_int4_quantize,
    quantized_bytes,
)
from services.common.errors import ResourceExhausted

_log = logging.getLogger(__name__)

ZONE = "transient"       # a load's staging: gone when the load ends
GROW = 1 << 20           # buffers grow in whole MiB (chunks vary by a tensor's last rows)
# Chunks this many times the host quantizer's (16 MiB of bf16): a chunk costs each loader thread
# ~10 Python-level calls, each a GIL hand-off that queues behind 14 other threads; at 4 MiB
# chunks 15 threads moved 12 GB/s through the device, at 16 MiB 29 GB/s (H100 host, quiet).
CHUNK_SCALE = 4
# Device buffer sets (a chunk, its int4 bytes, a stream, an event) the loader's threads share:
# 4 threads already moved 13 GB/s (against 12 for 15), so more would only hold device memory.
DEVICE_SETS = 4


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(eq=False)
class _Staging:
    """One loader thread's pinned buffers: its chunk's stored bytes, the int4 bytes back."""
    chunk: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint8))
    out: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint8))


@dataclasses.dataclass(eq=False)
class _DeviceSet:
    """Device buffers [chunk | packed | scales] with the stream and event that use them."""
    stream: object
    event: object
    buffers: object = None      # an arena Allocation
    in_capacity: int = 0


class DeviceQuantizer:
    """quantize_rows on `device` (a gpu_worker.device.Device), for Checkpoint.open(quantizer=).

        with DeviceQuantizer(device, compiler) as quantizer, \\
                Checkpoint.open(directory, 8192, quantizer=quantizer) as ckpt:
            weights = dict(ckpt.weights())
    """

    chunk_scale = CHUNK_SCALE

    def __init__(self, device, compiler, device_sets: int = DEVICE_SETS) -> None:
        """Nothing is touched until the first chunk: then the kernel's module is loaded through
        `compiler` (the worker's NVRTC cache), once; a GPTQ or fp16 load never loads it."""
        self.device, self._compiler = device, compiler
        self._module: object = None
        self._function: object = None
        self._staging: dict[int, _Staging] = {}   # thread ident -> its pinned buffers
        self._sets: list[_DeviceSet] = []
        self._idle: queue.SimpleQueue[_DeviceSet] = queue.SimpleQueue()
        self._max_sets = max(1, device_sets)
        self._lock = threading.Lock()
        self._closed = False
        self.chunks = 0           # chunks quantized on the device
        self.stored_bytes = 0     # their stored bytes
        self.host_chunks = 0      # chunks the device had no room for (quantized on the host)

    def _kernel(self) -> object:
        with self._lock:
            if self._function is None:
                self._module = self._compiler.load(self.device, INT4_QUANTIZE.source)
                self._function = self.device.get_function(self._module, INT4_QUANTIZE.entry)
            return self._function

    # -- RowQuantizer ----------------------------------------------------------------------------
    def staging(self, nbytes: int) -> np.ndarray:
        mine = self._mine()
        if mine.chunk.nbytes < nbytes:
            mine.chunk = self._repin(mine.chunk, nbytes)
        return mine.chunk

    def __call__(self, raw: np.ndarray, dtype: str, packed: np.ndarray,
                 scales: np.ndarray) -> None:
        rows, in_dim = raw.shape
        if dtype not in STORED_DTYPES or in_dim % QUANT_BLOCK or rows == 0:
            quantize_rows(raw, dtype, packed, scales)   # its errors and its empty case
            return
        mine = self._mine()
        src = self.staging(raw.nbytes)[:raw.nbytes]
        if raw.ctypes.data != src.ctypes.data or not raw.flags.c_contiguous:
            np.copyto(src.view(raw.dtype).reshape(raw.shape), raw)   # not staged by the loader
        packed_bytes, scale_bytes = quantized_bytes(rows, in_dim)
        out_bytes = packed_bytes + scale_bytes
        if mine.out.nbytes < out_bytes:
            mine.out = self._repin(mine.out, out_bytes)
        out = mine.out[:out_bytes]
        dset = self._take()
        try:   # whatever happens, the set goes back: other threads wait for it
            try:
                self._reserve(dset, raw.nbytes, out_bytes)
            except ResourceExhausted:   # a full device: this chunk converts on the host instead
                on_device = False
            else:
                on_device = True
                self._quantize(dset, src, dtype, rows, in_dim, packed_bytes, out)
        finally:
            self._idle.put(dset)
        if not on_device:
            quantize_rows(src.view(raw.dtype).reshape(raw.shape), dtype, packed, scales)
            with self._lock:
                self.host_chunks += 1
            return
        np.copyto(packed, out[:packed_bytes].reshape(packed.shape))
        np.copyto(scales, out[packed_bytes:].view(np.float16).reshape(scales.shape))
        with self._lock:
            self.chunks += 1
            self.stored_bytes += raw.nbytes

    def _quantize(self, dset: _DeviceSet, src: np.ndarray, dtype: str, rows: int, in_dim: int,
                  packed_bytes: int, out: np.ndarray) -> None:
        """One chunk through `dset`: up, the kernel, the int4 bytes back into `out`, waited for."""
        device, stream = self.device, dset.stream
        chunk = dset.buffers.ptr
        d_packed = chunk + dset.in_capacity
        d_scales = d_packed + packed_bytes          # 16-byte aligned: in_dim / 2 % 16 == 0
        device.copy_to_device_async(chunk, src, stream)
        launch_int4_quantize(device, self._kernel(), d_packed, d_scales, chunk, dtype, rows,
                             in_dim, stream=stream)
        device.copy_from_device_async(out, d_packed, stream)
        device.record_event(dset.event, stream)
        device.wait_event(dset.event)

    # -- buffers ---------------------------------------------------------------------------------
    def _mine(self) -> _Staging:
        me = threading.get_ident()
        with self._lock:
            if self._closed:
                raise RuntimeError("DeviceQuantizer is closed")
            return self._staging.setdefault(me, _Staging())

    def _take(self) -> _DeviceSet:
        """An idle device set; a new one while fewer than the maximum exist, else wait."""
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = len(self._sets) < self._max_sets
            if make:
                # a blocking event: threads waiting at once must not spin the cores the
                # loader's consumer needs for its pinned copies
                dset = _DeviceSet(self.device.create_stream(),
                                  self.device.create_event(blocking=True))
                self._sets.append(dset)
        return dset if make else self._idle.get()

    def _repin(self, old: np.ndarray, nbytes: int) -> np.ndarray:
        if old.nbytes:
            self.device.free_pinned(old)    # the thread's work on it was waited for
        return self.device.alloc_pinned(_round_up(nbytes, GROW))

    def _reserve(self, dset: _DeviceSet, in_bytes: int, out_bytes: int) -> None:
        """Device room for a chunk of `in_bytes` and its int4 bytes (the set's earlier work
        was waited for, so an outgrown allocation can go at once)."""
        have = dset.buffers.size - dset.in_capacity if dset.buffers is not None else -1
        if dset.in_capacity >= in_bytes and have >= out_bytes:
            return
        in_capacity = _round_up(max(in_bytes, dset.in_capacity), GROW)
        out_capacity = _round_up(max(out_bytes, have), GROW)
        if dset.buffers is not None:
            self._free(dset.buffers)
            dset.buffers, dset.in_capacity = None, 0
        dset.buffers = self.device.arena.alloc(in_capacity + out_capacity, ZONE)
        dset.in_capacity = in_capacity

    def _free(self, buffers: object) -> None:
        """Device buffers back to the device at once: their work was waited for, so no stream
        fences them, and a load's staging is not kept in the handle pool."""
        self.device.arena.free(buffers, fence_streams=[], retain=False)

    def device_bytes(self) -> int:
        """Device memory the sets hold now."""
        with self._lock:
            return sum(d.buffers.size for d in self._sets if d.buffers is not None)

    def close(self) -> None:
        """Wait for every set's work, free the buffers, streams and events, and unload the
        kernel's module. Idempotent; the loader's threads are done (Checkpoint.close first)."""
        with self._lock:
            sets, self._sets, self._closed = self._sets, [], True
            staging, self._staging = list(self._staging.values()), {}
            module, self._module, self._function = self._module, None, None
        device = self.device
        for dset in sets:
            device.synchronize(dset.stream)
            if dset.buffers is not None:
                self._free(dset.buffers)
            device.destroy_event(dset.event)
            device.destroy_stream(dset.stream)
        for mine in staging:
            for buf in (mine.chunk, mine.out):
                if buf.nbytes:
                    device.free_pinned(buf)
        if module is not None:
            device.unload_module(module)
        device.queue.poll()     # the frees above need no fence: run them now
        if self.host_chunks:
            _log.warning("the device had no room for the checkpoint quantizer's buffers: %d of "
                         "%d chunks were quantized on the host (a slower load); free device "
                         "memory before loading, or load with --checkpoint-quantizer host",
                         self.host_chunks, self.host_chunks + self.chunks)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
