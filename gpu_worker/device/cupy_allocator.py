"""Route CuPy's allocator through the arena (cuda backend only).

Hazard: CuPy's default memory pool is a second allocator: its bytes escape the ledger (the
"second ledger" of DESIGN 1.5), and a pool that grows during a capture calls cudaMalloc on the
capturing thread, which fails and invalidates the capture. With `install(device)` every CuPy array
is an arena allocation, booked in `zone`; freeing is fenced on the device's streams plus the CuPy
stream current at free time (CuPy work may run on its own stream). A free that fails (the arena
refuses it, or CuPy is already torn down at interpreter exit) cannot raise out of `__del__`: it is
logged and counted (gpuplane_worker_survived_errors_total{site="cupy_free"}), and the allocation
stays booked in the ledger rather than reused.

Cost: one arena alloc per CuPy allocation (a carve plus, when a granule is new, a VMM map); small
arrays share granules, so most allocations touch the driver not at all.
"""
from __future__ import annotations

from typing import Any

from gpu_worker.device import Device
from gpu_worker.telemetry.survived import survived


class _Owner:
    """Kept alive by CuPy's UnownedMemory; frees the arena allocation when CuPy drops it."""

    def __init__(self, device: Device, allocation: Any) -> None:
        self.device = device
        self.allocation = allocation

    def __del__(self) -> None:
        try:
            import cupy
            from cuda.bindings import driver

            streams = list(self.device._streams)
            cur = cupy.cuda.get_current_stream().ptr
            streams.append(driver.CUstream(cur))
            self.device.arena.free(self.allocation, fence_streams=streams)
        except Exception as exc:  # noqa: BLE001 - __del__ must not raise
            try:
                survived("cupy_free", exc, "a CuPy array's arena free failed; its bytes stay "
                         "booked", ptr=f"{self.allocation.ptr:#x}", nbytes=self.allocation.size)
            except Exception:  # noqa: BLE001, S110 - interpreter exit: logging itself is gone
                pass


class ArenaAllocator:
    def __init__(self, device: Device, zone: str = "scratch") -> None:
        if device.backend.name != "cuda":
            raise RuntimeError("the CuPy allocator needs the cuda backend")
        self.device = device
        self.zone = zone

    def malloc(self, nbytes: int) -> Any:
        import cupy

        a = self.device.arena.alloc(max(1, nbytes), self.zone, role="default")
        mem = cupy.cuda.UnownedMemory(a.ptr, a.size, _Owner(self.device, a), self.device.info.ordinal)
        return cupy.cuda.MemoryPointer(mem, 0)


def install(device: Device, zone: str = "scratch") -> ArenaAllocator:
    """Make every CuPy allocation in this process come from `device`'s arena."""
    import cupy

    alloc = ArenaAllocator(device, zone)
    cupy.cuda.set_allocator(alloc.malloc)
    return alloc


def uninstall() -> None:
    import cupy

    cupy.cuda.set_allocator(None)
