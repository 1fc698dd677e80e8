"""The device abstraction: what the worker needs from a GPU, and nothing more.

Two backends implement it and differ only where the hardware does:
- `cuda` (gpu_worker.device.cuda_backend): the product. cuda-python driver API on the retained
  primary context, VMM for every device byte, NVRTC images loaded with cuModuleLoadData.
- `sim` (gpu_worker.device.sim_backend): a test double for CI and laptops. Host memory stands in
  for device memory; granules, stable addresses, map/unmap, streams, events, capture/replay and
  the capture-invalidation rules measured on an H200 (../shared/GPU.md) are emulated, and a
  kernel launch runs the kernel's registered NumPy implementation instead of the NVRTC image.

Callers never use a backend directly: `gpu_worker.device.Device` wraps one and routes every call
that can synchronize the device through the process-wide capture gate.

Pointers are plain ints (device virtual addresses). Kernel arguments are `KernelArg`s so both
backends can marshal them: the cuda backend into cuLaunchKernel's parameter array, the sim into
the NumPy kernel's arguments.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

ArgKind = Literal["ptr", "i32", "i64", "f32", "tmap"]
TENSOR_MAP_BYTES = 128       # a CUtensorMap kernel parameter (sm_90 TMA), opaque
PORTABLE_CLUSTER_CTAS = 8    # a cluster any sm_90 launch may use; up to 16 with the opt-in (cuda)
MAX_CLUSTER_CTAS = 16        # the non-portable limit on sm_90 (H100, H200)
SIM_SM_COUNT = 132           # the sim backend models an H200's multiprocessors


@dataclass(frozen=True)
class KernelArg:
    kind: ArgKind
    value: int | float | bytes


def ptr(v: int) -> KernelArg:
    return KernelArg("ptr", int(v))


def i32(v: int) -> KernelArg:
    return KernelArg("i32", int(v))


def i64(v: int) -> KernelArg:
    return KernelArg("i64", int(v))


def f32(v: float) -> KernelArg:
    return KernelArg("f32", float(v))


def tmap(v: bytes) -> KernelArg:
    """A tensor map (Backend.tensor_map) passed by value: a `__grid_constant__` parameter."""
    if len(v) != TENSOR_MAP_BYTES:
        raise ValueError(f"a tensor map is {TENSOR_MAP_BYTES} bytes, not {len(v)}")
    return KernelArg("tmap", bytes(v))


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    uuid: str
    name: str
    total_bytes: int
    arch: str           # "sm_90" on an H200
    granule_bytes: int  # VMM allocation granularity (2 MiB on an H200)


class DeviceError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error string."""


class CaptureInvalidated(DeviceError):
    """The stream capture was invalidated (e.g. another thread synchronized the context)."""


class IllegalAddress(DeviceError):
    """A kernel or copy touched an address with no physical memory mapped (use after unmap)."""


class Backend(ABC):
    """Raw device operations. Opaque handle types (stream, event, module, ...) are backend-owned."""

    name: str
    info: DeviceInfo

    # -- truth ---------------------------------------------------------------------------------
    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes as the device reports them (cuMemGetInfo)."""

    @abstractmethod
    def process_used_bytes(self) -> int:
        """This process's device bytes per NVML, or 0 where NVML is unavailable."""

    def others_used_bytes(self) -> int:
        """Device bytes of the *other* processes on this device (NVML), 0 if none or unknown."""
        return 0

    # -- virtual memory management -------------------------------------------------------------
    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserve `nbytes` of virtual address space (granule multiple); returns the base."""

    @abstractmethod
    def create_physical(self, nbytes: int) -> object:
        """Create a physical allocation handle of `nbytes` (granule multiple)."""

    @abstractmethod
    def map(self, va: int, handle: object, nbytes: int) -> None:
        """Map the whole handle at `va` and grant read/write access to this device."""

    @abstractmethod
    def unmap(self, va: int, nbytes: int) -> None:
        """Unmap [va, va+nbytes). Does NOT wait for kernels still reading it: fence first."""

    @abstractmethod
    def release_physical(self, handle: object) -> None: ...

    # -- streams and events --------------------------------------------------------------------
    @abstractmethod
    def create_stream(self) -> object:
        """A non-blocking stream (never synchronizes with the legacy default stream)."""

    @abstractmethod
    def destroy_stream(self, stream: object) -> None: ...

    @abstractmethod
    def create_event(self, timing: bool = False, blocking: bool = False) -> object:
        """An event; `timing`: it records a timestamp (event_elapsed_ms), slightly costlier.
        `blocking`: synchronize_event sleeps until it completes instead of spinning on a core
        (CU_EVENT_BLOCKING_SYNC: for many host threads waiting at once)."""

    @abstractmethod
    def event_elapsed_ms(self, start: object, end: object) -> float:
        """Milliseconds between two completed timing events recorded on one stream."""

    @abstractmethod
    def destroy_event(self, event: object) -> None: ...

    @abstractmethod
    def record_event(self, event: object, stream: object) -> None: ...

    @abstractmethod
    def stream_wait_event(self, stream: object, event: object) -> None: ...

    @abstractmethod
    def event_done(self, event: object) -> bool: ...

    @abstractmethod
    def synchronize_event(self, event: object) -> None: ...

    @abstractmethod
    def synchronize_stream(self, stream: object) -> None: ...

    @abstractmethod
    def synchronize_context(self) -> None:
        """Device-wide sync. Invalidates any capture in flight on another thread (GPU.md)."""

    # -- host memory and copies ----------------------------------------------------------------
    @abstractmethod
    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory as a writable uint8 array."""

    @abstractmethod
    def free_pinned(self, buf: np.ndarray) -> None: ...

    @abstractmethod
    def copy_h2d_async(self, dst: int, src: np.ndarray, stream: object) -> None: ...

    @abstractmethod
    def copy_d2h_async(self, dst: np.ndarray, src: int, stream: object) -> None: ...

    @abstractmethod
    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: object) -> None: ...

    @abstractmethod
    def memset_async(self, dst: int, byte: int, nbytes: int, stream: object) -> None: ...

    # -- modules and launches ------------------------------------------------------------------
    @abstractmethod
    def load_module(self, image: bytes) -> object:
        """Load a PTX (NUL-terminated text) or CUBIN image; raises DeviceError if it cannot."""

    @abstractmethod
    def unload_module(self, module: object) -> None: ...

    @abstractmethod
    def get_function(self, module: object, name: str) -> object: ...

    @abstractmethod
    def launch(
        self,
        function: object,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        stream: object,
        shared_bytes: int = 0,
        cluster: tuple[int, int, int] | None = None,
        pdl: bool = False,
    ) -> None:
        """Above 48 KiB of `shared_bytes` the backend raises the function's dynamic shared
        memory limit first; `cluster` launches thread-block clusters of those dims; `pdl`: a
        programmatic dependent launch (the kernel may start before the previous one on the
        stream ends, and waits for it with griddepcontrol.wait)."""

    def max_active_clusters(self, function: object, threads: int, ctas: int,
                            shared_bytes: int = 0) -> int:
        """How many clusters of `ctas` CTAs of `threads` threads each (its static shared memory,
        `shared_bytes` of dynamic, and its registers) the device holds at once: what one wave of
        a cluster launch can be."""
        raise NotImplementedError(f"{type(self).__name__}: max_active_clusters")

    def tensor_map(self, address: int, sizes: tuple[int, ...], strides: tuple[int, ...],
                   box: tuple[int, ...], element_bytes: int = 2, swizzle: int = 128) -> bytes:
        """The TMA tensor map of a strided array at `address`: `sizes` elements a dimension,
        innermost (contiguous) first, rank 2..5; `strides` the bytes between consecutive indices of
        dimensions 1.. (multiples of 16); elements fp16 where `element_bytes` is 2, u64 where 8. A
        copy moves a `box` (elements a dimension) 128-byte swizzled (`swizzle` 128) or as it lies
        (0); elements past the array read zero. 128 opaque bytes (tmap())."""
        raise NotImplementedError(f"{type(self).__name__}: tensor_map")

    def tensor_map_2d(self, address: int, inner: int, outer: int, row_bytes: int,
                      box: tuple[int, int], element_bytes: int = 2, swizzle: int = 128) -> bytes:
        """tensor_map of a row-major matrix: `outer` rows of `inner` elements, `row_bytes` apart."""
        return self.tensor_map(address, (inner, outer), (row_bytes,), box, element_bytes, swizzle)

    def set_shared_carveout(self, function: object, percent: int) -> None:
        """The share of the SM's unified L1 / shared memory `function` prefers, in percent of
        the most shared memory (-1: no preference, the default; a hint the driver may
        override). Kernels that run side by side (dependent launch) fit one SM only in one
        configuration. The sim has no L1: nothing to set."""

    # -- graphs --------------------------------------------------------------------------------
    @abstractmethod
    def begin_capture(self, stream: object) -> None:
        """Begin capture in THREAD_LOCAL mode (always: see DESIGN 2.1)."""

    @abstractmethod
    def end_capture(self, stream: object) -> object:
        """End capture; returns the graph or raises CaptureInvalidated. Always ends the capture."""

    @abstractmethod
    def instantiate(self, graph: object) -> object: ...

    @abstractmethod
    def launch_graph(self, graph_exec: object, stream: object) -> None: ...

    @abstractmethod
    def destroy_graph(self, graph: object) -> None: ...

    @abstractmethod
    def destroy_graph_exec(self, graph_exec: object) -> None: ...

    def close(self) -> None:
        """Release what the backend holds. The primary context stays retained (DESIGN 2.1)."""
