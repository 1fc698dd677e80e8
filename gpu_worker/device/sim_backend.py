"""The `sim` backend: a host-memory TEST DOUBLE of a CUDA device, for CI and laptops.

It is not a product path. It emulates, faithfully enough that the device layer's unit tests mean
something without a GPU:
- VMM: one contiguous host buffer per VA reservation (so views span granules); a physical handle
  carries its own bytes (copied in on map, copied out on unmap, the VA then poisoned); touching an
  unmapped byte raises IllegalAddress.
- Streams: each stream's work runs in order on its own worker thread, asynchronously to the caller,
  so "unmap while a queued kernel still reads the range" really faults (recorded as a sticky fault,
  as a lost CUDA context would be) and a missing fence is observable.
- Capture: work enqueued on a capturing stream is recorded; replay re-executes it against whatever
  is mapped at replay time (as a CUDA graph that baked the address does).
- The capture invalidation table of ../shared/GPU.md (`INVALIDATES`): e.g. another thread's
  context synchronize invalidates a capture in every mode. Invalidations are counted.
- `mem_get_info` counts every simulated physical byte (handles, graph memory) plus a context
  baseline, booked or not, so a ledger that misses bytes shows up as unaccounted.
- A gate audit: when a gate is attached, every synchronizing call made without a gate section is
  counted in `ungated_calls` (tests assert it stays empty).
"""
from __future__ import annotations

import itertools
import mmap
import struct
import sys
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpu_worker.device.backend import (
    MAX_CLUSTER_CTAS,
    SIM_SM_COUNT,
    TENSOR_MAP_BYTES,
    Backend,
    CaptureInvalidated,
    DeviceError,
    DeviceInfo,
    IllegalAddress,
    KernelArg,
)
from gpu_worker.device.sim_kernels import SIM_TENSOR_MAP, lookup_sim_kernel

# Which calls on *another* thread invalidate a capture, per capture mode (GPU.md, measured on H200).
INVALIDATES: dict[str, frozenset[str]] = {
    "synchronize_context": frozenset({"global", "thread_local", "relaxed"}),
    "mem_alloc": frozenset({"global"}),
    "alloc_pinned": frozenset({"global"}),
    "free_pinned": frozenset({"global"}),
    "load_module": frozenset({"global"}),
}

# Calls that must run inside a capture-gate section (DESIGN 2.1); audited when a gate is attached.
SYNCHRONIZING = frozenset({
    "synchronize_context", "synchronize_stream", "synchronize_event", "alloc_pinned", "free_pinned",
    "load_module", "unload_module", "get_function", "destroy_stream", "destroy_event",
    "create_physical", "map", "unmap", "release_physical", "destroy_graph", "destroy_graph_exec",
})

SIM_MAX_SHARED_BYTES = 227 << 10  # an H200 block's opt-in shared memory limit
_POISON = 0xDB
# Python < 3.13 lacks the constant; 0x4000 is MAP_NORESERVE on Linux (x86-64 and arm64).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_VA_BASE = 0x7F00_0000_0000
_GRAPH_NODE_BYTES = 8 << 10  # simulated device memory a graph exec holds per node


@dataclass(eq=False)
class SimHandle:
    nbytes: int
    data: np.ndarray
    mapped_at: int | None = None
    released: bool = False


@dataclass(eq=False)
class _Reservation:
    base: int
    size: int
    buf: np.ndarray
    owners: list  # per granule: the SimHandle mapped there, or None


@dataclass(eq=False)
class SimEvent:
    done: threading.Event = field(default_factory=lambda: _set_event())
    timing: bool = False
    at: float = 0.0         # perf_counter() when the stream reached it (timing events)


def _set_event() -> threading.Event:
    ev = threading.Event()
    ev.set()  # an event never recorded counts as complete (cuEventQuery returns success)
    return ev


@dataclass(eq=False)
class _Capture:
    thread: int
    mode: str
    ops: list = field(default_factory=list)
    invalidated_by: str | None = None


@dataclass(eq=False)
class SimGraph:
    ops: list


@dataclass(eq=False)
class SimGraphExec:
    ops: list
    nbytes: int


@dataclass(eq=False)
class SimModule:
    image: bytes


@dataclass(eq=False)
class SimFunction:
    name: str
    fn: Callable


Op = tuple[str, Callable[[], Callable[[], None]]]  # (kind, builder returning the runnable)


class SimStream:
    """In-order work queue run by one worker thread. 'signal' ops run even after a fault."""

    _ids = itertools.count(1)

    def __init__(self, backend: SimBackend) -> None:
        self.id = next(self._ids)
        self.capture: _Capture | None = None
        self._backend = backend
        self._q: deque[tuple[str, Callable[[], None]]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"sim-stream-{self.id}", daemon=True)
        self._thread.start()

    def submit(self, kind: str, fn: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                raise DeviceError("sim: work submitted to a destroyed stream")
            self._q.append((kind, fn))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    return
                kind, fn = self._q.popleft()
            if kind == "work" and self._backend.fault is not None:
                continue  # context lost: later work does not run
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - recorded as the device's sticky error
                self._backend._record_fault(exc)


class SimBackend(Backend):
    """Host-memory stand-in for one device. See the module note; this is a test double."""

    name = "sim"

    def __init__(
        self,
        total_bytes: int = 4 << 30,
        granule_bytes: int = 2 << 20,
        context_bytes: int = 256 << 20,
        ordinal: int = 0,
    ) -> None:
        self.info = DeviceInfo(
            ordinal=ordinal,
            uuid=f"GPU-sim-{uuidlib.uuid4()}",
            name="sim (host-memory test double)",
            total_bytes=total_bytes,
            arch="sm_90",
            granule_bytes=granule_bytes,
        )
        self.context_bytes = context_bytes
        self._lock = threading.RLock()
        self._reservations: list[_Reservation] = []
        self._next_va = _VA_BASE
        self._physical = 0
        self._graph_bytes = 0
        self._streams: list[SimStream] = []
        self.fault: BaseException | None = None
        self.faults: list[BaseException] = []
        self.invalidations = 0
        self.invalidation_causes: Counter[str] = Counter()
        self.ungated_calls: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._gate = None
        self._inject: dict[str, list[BaseException]] = {}

    # -- test hooks ----------------------------------------------------------------------------
    def attach_gate(self, gate: object) -> None:
        """Audit synchronizing calls against `gate` (a CaptureGate)."""
        self._gate = gate

    def fail_next(self, call: str, exc: BaseException | None = None) -> None:
        """Make the next `call` raise `exc` (fault injection for tests)."""
        self._inject.setdefault(call, []).append(exc or DeviceError(f"sim: injected failure of {call}"))

    def _enter(self, call: str) -> None:
        self.calls[call] += 1
        pending = self._inject.get(call)
        if pending:
            raise pending.pop(0)
        if call in SYNCHRONIZING and self._gate is not None and not self._gate.holds_section():
            self.ungated_calls[call] += 1

    def _hazard(self, call: str) -> None:
        """Apply the invalidation table: this call, on this thread, against captures elsewhere."""
        modes = INVALIDATES.get(call, frozenset())
        me = threading.get_ident()
        hit = False
        with self._lock:
            for s in self._streams:
                cap = s.capture
                if cap is None or cap.invalidated_by is not None:
                    continue
                if cap.thread == me and call == "synchronize_context":
                    cap.invalidated_by = call
                    self._count_invalidation(call)
                    raise DeviceError(
                        "cuCtxSynchronize: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (this thread captures)"
                    )
                if cap.thread != me and cap.mode in modes:
                    cap.invalidated_by = call
                    self._count_invalidation(call)
                    hit = True
        if call == "synchronize_context" and hit:
            # Measured on the H200 (docs/device.md): the sync itself fails too, under memcheck
            # as CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, after invalidating the capture.
            raise DeviceError("cuCtxSynchronize: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED "
                              "(another thread captures)")

    def _count_invalidation(self, call: str) -> None:
        self.invalidations += 1
        self.invalidation_causes[call] += 1

    def _record_fault(self, exc: BaseException) -> None:
        with self._lock:
            self.faults.append(exc)
            if self.fault is None:
                self.fault = exc

    def _raise_fault(self) -> None:
        if self.fault is not None:
            f = self.fault
            raise type(f)(f"sim: device fault (context lost): {f}") if isinstance(f, DeviceError) \
                else DeviceError(f"sim: device fault (context lost): {f!r}")

    # -- memory view used by sim kernels and copies ----------------------------------------------
    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """Writable uint8 view of [ptr, ptr+nbytes); IllegalAddress if any byte is unmapped."""
        if nbytes <= 0:
            return np.empty(0, dtype=np.uint8)
        res = self._find(ptr, nbytes)
        g = self.info.granule_bytes
        off = ptr - res.base
        for gi in range(off // g, (off + nbytes - 1) // g + 1):
            if res.owners[gi] is None:
                raise IllegalAddress(f"sim: access to unmapped device memory at {res.base + gi * g:#x}"
                                     f" (range {ptr:#x}+{nbytes})")
        return res.buf[off:off + nbytes]

    def _find(self, ptr: int, nbytes: int) -> _Reservation:
        for res in self._reservations:
            if res.base <= ptr and ptr + nbytes <= res.base + res.size:
                return res
        raise IllegalAddress(f"sim: {ptr:#x}+{nbytes} is outside every VA reservation")

    # -- truth ---------------------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            used = self.context_bytes + self._physical + self._graph_bytes
        return self.info.total_bytes - used, self.info.total_bytes

    def process_used_bytes(self) -> int:
        free, total = self.mem_get_info()
        return total - free

    # -- VMM -----------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        g = self.info.granule_bytes
        if nbytes <= 0 or nbytes % g:
            raise DeviceError(f"cuMemAddressReserve: CUDA_ERROR_INVALID_VALUE ({nbytes} not a granule multiple)")
        with self._lock:
            base = self._next_va
            self._next_va += nbytes + g  # a gap: separate reservations are never contiguous
            # Anonymous NORESERVE mapping: pages cost host memory only once touched, so a
            # reservation several times "VRAM" is free on a small CI box (as VA is on a GPU).
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
            buf = np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)
            self._reservations.append(_Reservation(base, nbytes, buf, [None] * (nbytes // g)))
        return base

    def create_physical(self, nbytes: int) -> SimHandle:
        self._enter("create_physical")
        g = self.info.granule_bytes
        if nbytes <= 0 or nbytes % g:
            raise DeviceError(f"cuMemCreate: CUDA_ERROR_INVALID_VALUE ({nbytes} not a granule multiple)")
        with self._lock:
            free, _ = self.mem_get_info()
            if nbytes > free:
                raise DeviceError(f"cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (asked {nbytes}, free {free})")
            self._physical += nbytes
        return SimHandle(nbytes, np.zeros(nbytes, dtype=np.uint8))

    def map(self, va: int, handle: SimHandle, nbytes: int) -> None:
        self._enter("map")
        g = self.info.granule_bytes
        with self._lock:
            if handle.released or handle.mapped_at is not None or nbytes != handle.nbytes or va % g:
                raise DeviceError(f"cuMemMap: CUDA_ERROR_INVALID_VALUE at {va:#x}+{nbytes}")
            res = self._find(va, nbytes)
            first = (va - res.base) // g
            idx = range(first, first + nbytes // g)
            if any(res.owners[i] is not None for i in idx):
                raise DeviceError(f"cuMemMap: CUDA_ERROR_INVALID_VALUE ({va:#x} already mapped)")
            off = va - res.base
            res.buf[off:off + nbytes] = handle.data
            for i in idx:
                res.owners[i] = handle
            handle.mapped_at = va

    def unmap(self, va: int, nbytes: int) -> None:
        self._enter("unmap")
        g = self.info.granule_bytes
        with self._lock:
            res = self._find(va, nbytes)
            first = (va - res.base) // g
            owners = [res.owners[i] for i in range(first, first + nbytes // g)]
            if va % g or nbytes % g or any(o is None for o in owners):
                raise DeviceError(f"cuMemUnmap: CUDA_ERROR_INVALID_VALUE at {va:#x}+{nbytes}")
            for h in dict.fromkeys(owners):
                if h.mapped_at < va or h.mapped_at + h.nbytes > va + nbytes:
                    raise DeviceError(f"cuMemUnmap: CUDA_ERROR_INVALID_VALUE (splits a mapping at {va:#x})")
            for h in dict.fromkeys(owners):
                off = h.mapped_at - res.base
                h.data[:] = res.buf[off:off + h.nbytes]
                h.mapped_at = None
            off = va - res.base
            res.buf[off:off + nbytes] = _POISON
            for i in range(first, first + nbytes // g):
                res.owners[i] = None

    def release_physical(self, handle: SimHandle) -> None:
        self._enter("release_physical")
        with self._lock:
            if handle.released or handle.mapped_at is not None:
                raise DeviceError("cuMemRelease: CUDA_ERROR_INVALID_VALUE (released twice or still mapped)")
            handle.released = True
            self._physical -= handle.nbytes

    # -- streams and events --------------------------------------------------------------------
    def create_stream(self) -> SimStream:
        s = SimStream(self)
        with self._lock:
            self._streams.append(s)
        return s

    def destroy_stream(self, stream: SimStream) -> None:
        self._enter("destroy_stream")
        self._wait(stream)
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)
        stream.close()

    def create_event(self, timing: bool = False, blocking: bool = False) -> SimEvent:
        return SimEvent(timing=timing)   # a sim wait always sleeps (threading.Event)

    def event_elapsed_ms(self, start: SimEvent, end: SimEvent) -> float:
        if not (start.timing and end.timing):
            raise DeviceError("cuEventElapsedTime: CUDA_ERROR_INVALID_HANDLE (not timing events)")
        if not (start.done.is_set() and end.done.is_set()):
            raise DeviceError("cuEventElapsedTime: CUDA_ERROR_NOT_READY")
        return (end.at - start.at) * 1e3

    def destroy_event(self, event: SimEvent) -> None:
        self._enter("destroy_event")

    def _submit(self, stream: SimStream, kind: str, builder: Callable[[], Callable[[], None]]) -> None:
        cap = stream.capture
        if cap is not None:
            cap.ops.append((kind, builder))
        else:
            stream.submit(kind, builder())

    def record_event(self, event: SimEvent, stream: SimStream) -> None:
        def build() -> Callable[[], None]:
            flag = threading.Event()
            event.done = flag

            def reached() -> None:
                event.at = time.perf_counter()
                flag.set()
            return reached if event.timing else flag.set
        self._submit(stream, "signal", build)

    def stream_wait_event(self, stream: SimStream, event: SimEvent) -> None:
        def build() -> Callable[[], None]:
            flag = event.done
            return lambda: flag.wait()
        self._submit(stream, "signal", build)

    def event_done(self, event: SimEvent) -> bool:
        return event.done.is_set()

    def synchronize_event(self, event: SimEvent) -> None:
        self._enter("synchronize_event")
        event.done.wait()
        self._raise_fault()

    def _wait(self, stream: SimStream) -> None:
        flag = threading.Event()
        stream.submit("signal", flag.set)
        flag.wait()

    def synchronize_stream(self, stream: SimStream) -> None:
        self._enter("synchronize_stream")
        cap = stream.capture
        if cap is not None:
            cap.invalidated_by = cap.invalidated_by or "synchronize_stream"
            self._count_invalidation("synchronize_stream")
            raise DeviceError("cuStreamSynchronize: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (stream captures)")
        self._wait(stream)
        self._raise_fault()

    def synchronize_context(self) -> None:
        self._enter("synchronize_context")
        self._hazard("synchronize_context")
        with self._lock:
            streams = [s for s in self._streams if s.capture is None]
        for s in streams:
            self._wait(s)
        self._raise_fault()

    # -- host memory and copies ----------------------------------------------------------------
    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        self._enter("alloc_pinned")
        self._hazard("alloc_pinned")
        return np.zeros(nbytes, dtype=np.uint8)

    def free_pinned(self, buf: np.ndarray) -> None:
        self._enter("free_pinned")
        self._hazard("free_pinned")

    def copy_h2d_async(self, dst: int, src: np.ndarray, stream: SimStream) -> None:
        self._enter("copy_h2d_async")
        data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)

        def run() -> None:
            self.view(dst, data.nbytes)[:] = data
        self._submit(stream, "work", lambda: run)

    def copy_d2h_async(self, dst: np.ndarray, src: int, stream: SimStream) -> None:
        self._enter("copy_d2h_async")
        out = dst.reshape(-1).view(np.uint8)

        def run() -> None:
            out[:] = self.view(src, out.nbytes)
        self._submit(stream, "work", lambda: run)

    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: SimStream) -> None:
        self._enter("copy_d2d_async")

        def run() -> None:
            self.view(dst, nbytes)[:] = self.view(src, nbytes)
        self._submit(stream, "work", lambda: run)

    def memset_async(self, dst: int, byte: int, nbytes: int, stream: SimStream) -> None:
        self._enter("memset_async")

        def run() -> None:
            self.view(dst, nbytes)[:] = byte & 0xFF
        self._submit(stream, "work", lambda: run)

    # -- modules and launches ------------------------------------------------------------------
    def load_module(self, image: bytes) -> SimModule:
        self._enter("load_module")
        self._hazard("load_module")
        if not image:
            raise DeviceError("cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (empty image)")
        return SimModule(bytes(image))

    def unload_module(self, module: SimModule) -> None:
        self._enter("unload_module")

    def get_function(self, module: SimModule, name: str) -> SimFunction:
        self._enter("get_function")
        fn = lookup_sim_kernel(name)
        if name.encode() not in module.image or fn is None:
            raise DeviceError(f"cuModuleGetFunction: CUDA_ERROR_NOT_FOUND ({name!r}: not in the image "
                              "or no sim kernel registered with register_sim_kernel)")
        return SimFunction(name, fn)

    def launch(
        self,
        function: SimFunction,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        stream: SimStream,
        shared_bytes: int = 0,
        cluster: tuple[int, int, int] | None = None,
        pdl: bool = False,
    ) -> None:
        # pdl changes nothing here: sim kernels run one after another, each whole.
        self._enter("launch")
        if shared_bytes > SIM_MAX_SHARED_BYTES:
            raise DeviceError(f"cuLaunchKernel: CUDA_ERROR_INVALID_VALUE ({shared_bytes} bytes of "
                              f"shared memory > {SIM_MAX_SHARED_BYTES})")
        if cluster is not None and cluster[0] * cluster[1] * cluster[2] > MAX_CLUSTER_CTAS:
            raise DeviceError(f"cuLaunchKernelEx: CUDA_ERROR_CLUSTER_OUT_OF_RESOURCES (cluster {cluster})")
        args = list(args)

        def run() -> None:
            function.fn(self, tuple(grid), tuple(block), args)
        self._submit(stream, "work", lambda: run)

    def tensor_map(self, address: int, sizes: tuple[int, ...], strides: tuple[int, ...],
                   box: tuple[int, ...], element_bytes: int = 2, swizzle: int = 128) -> bytes:
        """The sim's tensor map: its fields in the clear (sim_tensor_map reads them back), checked
        as cuTensorMapEncodeTiled checks them (and the innermost dimension within its stride)."""
        self._enter("tensor_map")
        rank = len(sizes)
        if (not 2 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank or address % 16
                or any(b % 16 or not 0 < b < 1 << 40 for b in strides)
                or not all(0 < n <= 1 << 32 for n in sizes) or sizes[0] * element_bytes > strides[0]):
            raise DeviceError(f"cuTensorMapEncodeTiled: CUDA_ERROR_INVALID_VALUE (address {address:#x}, "
                              f"sizes {tuple(sizes)}, strides {tuple(strides)} bytes)")
        if (not all(0 < b <= 256 for b in box) or box[0] * element_bytes % 16
                or (swizzle and box[0] * element_bytes > swizzle)):
            raise DeviceError(f"cuTensorMapEncodeTiled: CUDA_ERROR_INVALID_VALUE (box {tuple(box)} of "
                              f"{element_bytes}-byte elements, swizzle {swizzle})")
        pad = 5 - rank
        return struct.pack(SIM_TENSOR_MAP, address, rank, element_bytes, swizzle,
                           *sizes, *(0,) * pad, *strides, *(0,) * pad, *box, *(0,) * pad
                           ).ljust(TENSOR_MAP_BYTES, b"\0")

    def max_active_clusters(self, function: SimFunction, threads: int, ctas: int,
                            shared_bytes: int = 0) -> int:
        """The sim's model: one CTA an SM, every SM free, no GPC boundary (an H100 holds
        fewer: 15 clusters of 8 CTAs of 512 threads, not 16)."""
        self._enter("max_active_clusters")
        if not 1 <= ctas <= MAX_CLUSTER_CTAS:
            raise DeviceError(f"cuOccupancyMaxActiveClusters: CUDA_ERROR_INVALID_CLUSTER_SIZE ({ctas})")
        return SIM_SM_COUNT // ctas

    # -- graphs --------------------------------------------------------------------------------
    def begin_capture(self, stream: SimStream, mode: str = "thread_local") -> None:
        self._enter("begin_capture")
        if stream.capture is not None:
            raise DeviceError("cuStreamBeginCapture: CUDA_ERROR_ILLEGAL_STATE (already capturing)")
        stream.capture = _Capture(threading.get_ident(), mode)

    def end_capture(self, stream: SimStream) -> SimGraph:
        self._enter("end_capture")
        cap = stream.capture
        if cap is None:
            raise DeviceError("cuStreamEndCapture: CUDA_ERROR_ILLEGAL_STATE (not capturing)")
        stream.capture = None  # always ended, invalidated or not
        if cap.invalidated_by is not None:
            raise CaptureInvalidated(
                f"cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (by {cap.invalidated_by})")
        return SimGraph(list(cap.ops))

    def is_capturing(self, stream: SimStream) -> bool:
        return stream.capture is not None

    def instantiate(self, graph: SimGraph) -> SimGraphExec:
        self._enter("instantiate")
        g = self.info.granule_bytes
        nbytes = -(-max(1, len(graph.ops)) * _GRAPH_NODE_BYTES // g) * g
        with self._lock:
            self._graph_bytes += nbytes
        return SimGraphExec(list(graph.ops), nbytes)

    def launch_graph(self, graph_exec: SimGraphExec, stream: SimStream) -> None:
        self._enter("launch_graph")
        for kind, builder in graph_exec.ops:
            self._submit(stream, kind, builder)

    def destroy_graph(self, graph: SimGraph) -> None:
        self._enter("destroy_graph")

    def destroy_graph_exec(self, graph_exec: SimGraphExec) -> None:
        self._enter("destroy_graph_exec")
        with self._lock:
            self._graph_bytes -= graph_exec.nbytes
            graph_exec.nbytes = 0

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams)
            self._streams.clear()
        for s in streams:
            s.close()
