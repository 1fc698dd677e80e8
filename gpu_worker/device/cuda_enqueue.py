"""Driver calls that only enqueue work or read a flag, made without handing over the GIL.

Hazard: cuda-python releases the GIL around every driver call. That is right for a call that
may wait (a synchronize), and costly for one that returns in microseconds: when another thread
wants the GIL (the worker's event loop writing a step's tokens), the calling thread gets it back
only when that thread blocks or its switch interval runs out (0.2 ms in the worker). A decode
step made 8 such calls, so the engine thread could wait out up to 8 switch intervals a step
while the loop was busy (docs/worker.md, "The GIL between the engine and the edge").

Contract: `EnqueueCalls` binds the few calls the engine's step makes that never wait, through
`ctypes.PyDLL`, which keeps the GIL for the call's length:
- cuEventRecord, cuGraphLaunch, cuEventQuery, cuEventElapsedTime: never wait on the device;
- cuMemcpyHtoDAsync / cuMemcpyDtoHAsync: asynchronous only for page-locked host memory, so
  the backend uses them here only for host ranges it allocated pinned (a pageable copy is
  staged by the driver and may wait: it keeps cuda-python's GIL-releasing call).
Each returns the raw CUresult; the backend maps a failure through the same `check()` as every
other call, so errors read the same either way.

Cost: one ctypes call (~1 us) in place of cuda-python's; the GIL is held for the few
microseconds the driver takes to enqueue. A call that blocked here would stall every Python
thread of the process, which is why nothing that can wait is bound.
"""
from __future__ import annotations

import bisect
import ctypes
from typing import Any

_LIB = "libcuda.so.1"
_u64, _int, _size = ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t


def handle(h: Any) -> int:
    """A cuda-python handle (CUstream, CUevent, CUgraphExec) or None as the driver's integer."""
    return 0 if h is None else int(h)


class EnqueueCalls:
    """The GIL-keeping bindings of one process's libcuda (loaded once, already initialised by
    cuda-python: these calls run in a context made current the usual way)."""

    def __init__(self, lib: str = _LIB) -> None:
        cu = ctypes.PyDLL(lib)   # PyDLL: the GIL stays held across the foreign call

        def bind(names: tuple[str, ...], *argtypes: Any) -> Any:
            for name in names:   # the newest exported name first
                fn = getattr(cu, name, None)
                if fn is not None:
                    fn.argtypes, fn.restype = list(argtypes), _int
                    return fn
            raise OSError(f"{lib} exports none of {', '.join(names)}")

        self.event_record = bind(("cuEventRecord",), _u64, _u64)
        self.graph_launch = bind(("cuGraphLaunch",), _u64, _u64)
        self.event_query = bind(("cuEventQuery",), _u64)
        self._elapsed = bind(("cuEventElapsedTime_v2", "cuEventElapsedTime"),
                             ctypes.POINTER(ctypes.c_float), _u64, _u64)
        self.memcpy_htod = bind(("cuMemcpyHtoDAsync_v2",), _u64, ctypes.c_void_p, _size, _u64)
        self.memcpy_dtoh = bind(("cuMemcpyDtoHAsync_v2",), ctypes.c_void_p, _u64, _size, _u64)

    def event_elapsed(self, start: int, end: int) -> tuple[int, float]:
        """(CUresult, milliseconds between two recorded events)."""
        ms = ctypes.c_float()
        return self._elapsed(ctypes.byref(ms), start, end), ms.value


class PinnedSpans:
    """The host ranges alloc_pinned gave, to tell a copy that cannot wait from one that may."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []   # sorted, disjoint (start, end)

    def add(self, start: int, nbytes: int) -> None:
        bisect.insort(self._spans, (start, start + max(1, nbytes)))

    def remove(self, start: int) -> None:
        i = bisect.bisect_left(self._spans, (start,))
        if i == len(self._spans) or self._spans[i][0] != start:
            raise KeyError(f"no pinned range starts at {start:#x}")
        del self._spans[i]

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies inside one range."""
        i = bisect.bisect_right(self._spans, (address, float("inf"))) - 1
        return i >= 0 and address + nbytes <= self._spans[i][1]

    def __len__(self) -> int:
        return len(self._spans)
