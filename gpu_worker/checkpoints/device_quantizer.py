"""The loader's int4 quantizer on the device: stored rows up, int4 blocks back.

Hazard: the host quantizer converts ~0.8 GB/s of bf16 a core, so an 8B load (16 GB of bf16)
is bound by the host's free cores: on a node whose other tenants take half of them, or under a
container's CPU limit, the load ran at 1.7-3.4x its floor (DESIGN amendment 46).
Contract: `DeviceQuantizer.__call__` is `quantize_rows`: the same bytes for every input (the
kernel's contract, gpu_worker/kernels/quantize.py), so a checkpoint loads to the same weights
either way (tests/checkpoints/test_device_quantizer.py). Each loader thread gets a lane of its
own, made on its first chunk: pinned staging that the loader copies a chunk's stored bytes into
straight out of the mmap (`staging`), device buffers for the chunk and its int4 bytes (booked in
the `transient` zone), a stream and an event. A chunk is one H2D copy, one kernel and one D2H
copy of the int4 bytes into pinned memory, waited for on the lane's event (gated like a stream
sync), then copied into the caller's arrays. `close()` waits for every lane and frees them.
Where the device has no room for a lane's buffers (RESOURCE_EXHAUSTED after the reclaimer), that
chunk is quantized on the host instead: a full device slows a load, it does not fail it.
Cost: the stored bytes cross PCIe once (16 GB at 8B, ~0.3 s at 55 GB/s) and the host copies
the int4 bytes once more (0.28 of the stored bytes); the kernel takes microseconds a chunk.
Device memory: a lane holds its largest chunk and that chunk's int4 bytes, ~6 MiB for the
loader's 4 MB bf16 chunks (~90 MiB for 15 threads), until `close()`.
"""
from __future__ import annotations

import dataclasses
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

ZONE = "transient"       # a load's staging: gone when the load ends
GROW = 1 << 20           # buffers grow in whole MiB (chunks vary by a tensor's last rows)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(eq=False)
class _Lane:
    """One loader thread's buffers, stream and event."""
    stream: object
    event: object
    pinned_in: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint8))
    pinned_out: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint8))
    buffers: object = None      # an arena Allocation: [chunk | packed | scales]
    in_capacity: int = 0


class DeviceQuantizer:
    """quantize_rows on `device` (a gpu_worker.device.Device), for Checkpoint.open(quantizer=).

        with DeviceQuantizer(device, compiler) as quantizer, \\
                Checkpoint.open(directory, 8192, quantizer=quantizer) as ckpt:
            weights = dict(ckpt.weights())
    """

    def __init__(self, device, compiler) -> None:
        """Nothing is touched until the first chunk: then the kernel's module is loaded through
        `compiler` (the worker's NVRTC cache), once; a GPTQ or fp16 load never loads it."""
        self.device, self._compiler = device, compiler
        self._module: object = None
        self._function: object = None
        self._lanes: dict[int, _Lane] = {}
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
        lane = self._lane()
        if lane.pinned_in.nbytes < nbytes:
            lane.pinned_in = self._repin(lane.pinned_in, nbytes)
        return lane.pinned_in

    def __call__(self, raw: np.ndarray, dtype: str, packed: np.ndarray,
                 scales: np.ndarray) -> None:
        rows, in_dim = raw.shape
        if dtype not in STORED_DTYPES or in_dim % QUANT_BLOCK or rows == 0:
            quantize_rows(raw, dtype, packed, scales)   # its errors and its empty case
            return
        lane = self._lane()
        src = self.staging(raw.nbytes)[:raw.nbytes]
        if raw.ctypes.data != src.ctypes.data or not raw.flags.c_contiguous:
            np.copyto(src.view(raw.dtype).reshape(raw.shape), raw)   # not staged by the loader
        packed_bytes, scale_bytes = quantized_bytes(rows, in_dim)
        out_bytes = packed_bytes + scale_bytes
        try:
            self._reserve(lane, raw.nbytes, out_bytes)
        except ResourceExhausted:   # a full device: this chunk converts on the host instead
            quantize_rows(src.view(raw.dtype).reshape(raw.shape), dtype, packed, scales)
            with self._lock:
                self.host_chunks += 1
            return
        if lane.pinned_out.nbytes < out_bytes:
            lane.pinned_out = self._repin(lane.pinned_out, out_bytes)
        device, stream = self.device, lane.stream
        chunk = lane.buffers.ptr
        d_packed = chunk + lane.in_capacity
        d_scales = d_packed + packed_bytes          # 16-byte aligned: in_dim / 2 % 16 == 0
        out = lane.pinned_out[:out_bytes]
        device.copy_to_device_async(chunk, src, stream)
        launch_int4_quantize(device, self._kernel(), d_packed, d_scales, chunk, dtype, rows,
                             in_dim, stream=stream)
        device.copy_from_device_async(out, d_packed, stream)
        device.record_event(lane.event, stream)
        device.wait_event(lane.event)
        np.copyto(packed, out[:packed_bytes].reshape(packed.shape))
        np.copyto(scales, out[packed_bytes:].view(np.float16).reshape(scales.shape))
        with self._lock:
            self.chunks += 1
            self.stored_bytes += raw.nbytes

    # -- lanes -----------------------------------------------------------------------------------
    def _lane(self) -> _Lane:
        me = threading.get_ident()
        with self._lock:
            if self._closed:
                raise RuntimeError("DeviceQuantizer is closed")
            lane = self._lanes.get(me)
        if lane is None:
            # a blocking event: 15 lanes waiting at once must not spin 15 cores the loader's
            # consumer needs for its pinned copies
            lane = _Lane(self.device.create_stream(), self.device.create_event(blocking=True))
            with self._lock:
                self._lanes[me] = lane
        return lane

    def _repin(self, old: np.ndarray, nbytes: int) -> np.ndarray:
        if old.nbytes:
            self.device.free_pinned(old)    # the lane's work on it was waited for
        return self.device.alloc_pinned(_round_up(nbytes, GROW))

    def _reserve(self, lane: _Lane, in_bytes: int, out_bytes: int) -> None:
        """Device room for a chunk of `in_bytes` and its int4 bytes (the lane's earlier work
        was waited for, so an outgrown allocation can go at once)."""
        have = lane.buffers.size - lane.in_capacity if lane.buffers is not None else -1
        if lane.in_capacity >= in_bytes and have >= out_bytes:
            return
        in_capacity = _round_up(max(in_bytes, lane.in_capacity), GROW)
        out_capacity = _round_up(max(out_bytes, have), GROW)
        if lane.buffers is not None:
            self._free(lane.buffers)
            lane.buffers = None
        lane.buffers = self.device.arena.alloc(in_capacity + out_capacity, ZONE)
        lane.in_capacity = in_capacity

    def device_bytes(self) -> int:
        """Device memory the lanes hold now."""
        with self._lock:
            return sum(lane.buffers.size for lane in self._lanes.values() if lane.buffers)

    def close(self) -> None:
        """Wait for every lane's work, then free its buffers, stream and event, and unload the
        kernel's module. Idempotent."""
        with self._lock:
            lanes, self._lanes, self._closed = list(self._lanes.values()), {}, True
            module, self._module, self._function = self._module, None, None
        device = self.device
        for lane in lanes:
            device.synchronize(lane.stream)
            if lane.buffers is not None:
                self._free(lane.buffers)
            for buf in (lane.pinned_in, lane.pinned_out):
                if buf.nbytes:
                    device.free_pinned(buf)
            device.destroy_event(lane.event)
            device.destroy_stream(lane.stream)
        if module is not None:
            device.unload_module(module)
        device.queue.poll()     # the frees above need no fence: run them now

    def _free(self, buffers: object) -> None:
        """A lane's buffers back to the device at once: the lane's work was waited for, so no
        stream fences them, and a load's staging is not kept in the handle pool."""
        self.device.arena.free(buffers, fence_streams=[], retain=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
