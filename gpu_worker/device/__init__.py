"""The worker's device: one Backend behind the process-wide capture gate, the VMM arena, weight
slots and the ledger. Nothing else in the code base calls a Backend directly.

    from gpu_worker.device import open_device, Device
    dev = open_device("auto")          # cuda when a device exists, else the sim test double
    a = dev.arena.alloc(1 << 20, "workspace")
    with dev.capture() as cap:
        dev.launch(fn, (1, 1, 1), (128, 1, 1), [ptr(a.ptr), i32(n)])
    dev.replay(cap.graph_exec)

Every call that can synchronize the device or change what a capture sees runs inside a shared
gate section (DESIGN 2.1); `capture()` holds the exclusive side from begin to end, always ends the
capture (even on error) and books the graph memory it measured (cuMemGetInfo around capture and
instantiate, while nothing else can allocate) in the `graphs` zone.

Streams: `stream` is the one compute stream every model shares, `copy_stream` the page-in
stream. A capture of the shared stream records on `capture_stream` instead, and every call the
capturing thread makes for the shared stream (launches, copies, events, BLAS) goes there until
the capture ends (`stream_for`). Hazard it closes: the gate holds back synchronizing calls
during a capture, not launches, so a capture on the shared stream would record another model's
step, launched by another thread meanwhile, into its graph instead of running it. Cost: one
stream per device; a captured graph replays on whatever stream it is launched on.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from gpu_worker.device.arena import Allocation, Arena
from gpu_worker.device.backend import (
    Backend,
    CaptureInvalidated,
    DeviceError,
    DeviceInfo,
    KernelArg,
)
from gpu_worker.device.gate import CaptureGate, process_gate
from gpu_worker.device.ledger import BudgetOwner, Ledger, local_budget
from gpu_worker.device.release_queue import ReleaseQueue
from gpu_worker.device.weights import WeightSlot, WeightSlots
from services.common.errors import FailedPrecondition, InvalidArgument

_log = logging.getLogger(__name__)

__all__ = ["Allocation", "Capture", "Device", "DeviceInfo", "WeightSlot", "open_backend", "open_device"]


@dataclass(eq=False)
class Capture:
    stream: object
    graph_exec: object = None
    graph_bytes: int = 0


class Device:
    def __init__(
        self,
        backend: Backend,
        budget: BudgetOwner | None = None,
        reserve_bytes: int | None = None,
        gate: CaptureGate | None = None,
        weight_budget_bytes: int | None = None,
        report_interval_s: float | None = None,
    ) -> None:
        """`report_interval_s`: how often the zones and the device truth go to the budget owner
        (its next heartbeat carries them); default 2 s when a budget owner is given, else off."""
        self.backend = backend
        self.info = backend.info
        self.gate = gate or process_gate()
        if hasattr(backend, "attach_gate"):
            backend.attach_gate(self.gate)
        self.stream = backend.create_stream()
        self.copy_stream = backend.create_stream()
        self.capture_stream = backend.create_stream()
        self._capturer: int | None = None   # thread ident while it captures the shared stream
        # Programmatic dependent launch (sm_90 on): launch(..., pdl=True) lets a kernel start
        # while the previous one runs. Off, every launch waits for the one before it (the
        # benchmarks' --no-pdl measures the difference).
        self.dependent_launch = int(self.info.arch.removeprefix("sm_").rstrip("a")) >= 90
        free, total = backend.mem_get_info()
        self.ledger = Ledger(budget or local_budget(max(1, int(free * 0.9)) + (total - free)))
        # The context baseline (streams included) is device memory this process pays for: booked,
        # not ignored. It is measured the way reconciliation measures the device (cuMemGetInfo),
        # less what NVML attributes to other processes: NVML's own per-process figure leaves out
        # ~9 MiB per context that cuMemGetInfo counts (H200, driver 580: 518.0 vs 526.8 MiB), and
        # booking it would leave that much unaccounted for ever.
        self._context_bytes = max(0, self.own_used_bytes())
        self.ledger.adopt("context", self._context_bytes)
        self.ledger.add_content("context", self._context_bytes)
        # The streams work runs on, which releases fence on; never the capture stream, which only
        # records (nothing enqueued on it ever executes).
        self._streams = [self.stream, self.copy_stream]
        self.queue = ReleaseQueue(backend, self.gate)
        reserve = reserve_bytes or 2 * total
        self.arena = Arena(backend, self.gate, self.ledger, self.queue, lambda: list(self._streams),
                           reserve)
        self.weights = WeightSlots(backend, self.gate, self.arena, self.queue, self.stream,
                                   self.copy_stream, weight_budget_bytes)
        self._graphs: dict[int, int] = {}  # id(graph_exec) -> booked graph bytes
        # Captures whose end-capture the driver refused as invalidated (both backends count it
        # here, where it surfaces; the sim additionally records which call caused it).
        self.capture_invalidations = 0
        self._modules: dict[int, int] = {}  # id(module) -> booked module bytes
        self._lock = threading.Lock()
        self._blas = None       # gpu_worker.device.blas.Blas, opened on first use
        self._blas_users = 0    # models holding it (acquire_blas); at 0 release_blas closes it
        self._blas_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        interval = report_interval_s if report_interval_s is not None else (2.0 if budget else None)
        if interval:
            self._reporter = threading.Thread(target=self._report_loop, args=(interval,),
                                              name="device-report", daemon=True)
            self._reporter.start()

    def _report_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                with self.gate.shared():  # cuMemGetInfo is harmless, but never probe mid-capture
                    used, proc = self.truth()
                self.ledger.report(used, proc)
            except Exception:  # noqa: BLE001 - reporting is best effort; the next tick retries
                _log.warning("device truth report failed", exc_info=True)

    @property
    def blas(self):
        """The device's GEMM library (cuBLAS on cuda), opened on first use, outside capture."""
        with self._blas_lock:
            if self._blas is None:
                from gpu_worker.device.blas import open_blas

                self._blas = open_blas(self)
            return self._blas

    def blas_stats(self) -> dict[str, int]:
        """The BLAS's counters (zeros while it is not open); opens nothing."""
        with self._blas_lock:
            blas = self._blas
        if blas is None:
            return {"calls": 0, "library_bytes": 0, "workspace_bytes": 0, "warm_shapes": 0}
        return blas.stats()

    def acquire_blas(self):
        """`blas`, held by a model until release_blas: its handle and workspace stay booked
        while any model holds it, and are given back when the last one lets go."""
        blas = self.blas
        with self._blas_lock:
            self._blas_users += 1
        return blas

    def release_blas(self) -> None:
        with self._blas_lock:
            self._blas_users = max(0, self._blas_users - 1)
            blas = self._blas if self._blas_users == 0 else None
            self._blas = None if blas is not None else self._blas
        if blas is not None:
            blas.close()

    # -- modules and launches ------------------------------------------------------------------
    def load_module(self, image: bytes) -> object:
        """Load a PTX/CUBIN image and book the device memory the driver takes for it.

        cuModuleLoadData allocates outside the arena (code, constants; with eager module loading,
        set by the cuda backend, at load time rather than at first launch): 12.8 MiB for the
        kernel library on an H200 that the ledger used to miss. The drop in free memory across
        the load is booked in `context` (adopted: it is already spent). The exclusive side of the
        gate keeps this process's other threads from committing memory while it is measured, as
        for graph capture; other processes' allocations meanwhile are left out (own_used_bytes).
        """
        if self.gate.is_capturing_thread():  # measured by the capture around us, if anything
            return self.backend.load_module(image)
        with self.gate.exclusive():
            own0 = self.own_used_bytes()
            module = self.backend.load_module(image)
            own1 = self.own_used_bytes()
        grown = max(0, own1 - own0)
        if grown:
            self.ledger.adopt("context", grown)
            self.ledger.add_content("context", grown)
            with self._lock:
                self._modules[id(module)] = grown
        return module

    def unload_module(self, module: object) -> None:
        with self.gate.shared():
            self.backend.unload_module(module)
        with self._lock:
            grown = self._modules.pop(id(module), 0)
        if grown:
            self.ledger.uncommit("context", grown)
            self.ledger.remove_content("context", grown)

    def get_function(self, module: object, name: str) -> object:
        with self.gate.shared():
            return self.backend.get_function(module, name)

    def launch(self, function: object, grid: Sequence[int], block: Sequence[int],
               args: list[KernelArg], stream: object = None, shared_bytes: int = 0,
               cluster: Sequence[int] | None = None, pdl: bool = False) -> None:
        """Launch `function`; `shared_bytes` of dynamic shared memory (above the 48 KiB default
        the function's limit is raised first), `cluster` thread-block cluster dims (sm_90).
        `pdl`: the kernel waits for the previous one itself (gp_pdl_wait, gpuplane_common.cuh),
        so it may be launched while that one runs; honoured while `dependent_launch` is on."""
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        c = None if cluster is None else _dim3(cluster, "cluster")
        if c is not None and any(gi % ci for gi, ci in zip(g, c)):
            raise ValueError(f"launch: grid {g} is not a whole number of clusters {c}")
        self.backend.launch(function, g, b, args, self.stream_for(stream), shared_bytes, c,
                            pdl and self.dependent_launch)

    def tensor_map(self, address: int, sizes: tuple[int, ...], strides: tuple[int, ...],
                   box: tuple[int, ...], element_bytes: int = 2, swizzle: int = 128) -> bytes:
        """The TMA tensor map of a strided array (Backend.tensor_map: sizes innermost first,
        byte strides of dimensions 1..): host-side encoding, no stream operation; pass it with
        backend.tmap()."""
        if element_bytes not in (2, 8) or swizzle not in (0, 128):
            raise ValueError(f"tensor_map: element_bytes {element_bytes} (2 or 8), swizzle "
                             f"{swizzle} (0 or 128)")
        return self.backend.tensor_map(address, tuple(sizes), tuple(strides), tuple(box),
                                       element_bytes, swizzle)

    def tensor_map_2d(self, address: int, inner: int, outer: int, row_bytes: int,
                      box: tuple[int, int], element_bytes: int = 2, swizzle: int = 128) -> bytes:
        """tensor_map of a row-major matrix: `outer` rows of `inner` elements, `row_bytes` apart."""
        return self.tensor_map(address, (inner, outer), (row_bytes,), box, element_bytes, swizzle)

    def max_active_clusters(self, function: object, threads: int, ctas: int,
                            shared_bytes: int = 0) -> int:
        """Clusters of `ctas` CTAs of `threads` threads of `function` (and `shared_bytes` of
        dynamic shared memory each) the device holds at once (cuOccupancyMaxActiveClusters; asked
        once a function and shape, not a stream operation)."""
        with self.gate.shared():
            return self.backend.max_active_clusters(function, threads, ctas, shared_bytes)

    def set_shared_carveout(self, function: object, percent: int) -> None:
        """`function`'s preferred L1 / shared memory split (Backend.set_shared_carveout): -1
        (no preference) or 0..100 percent of the most shared memory."""
        if not (percent == -1 or 0 <= percent <= 100):
            raise InvalidArgument(f"shared carveout {percent}: want -1 (no preference) or 0..100")
        with self.gate.shared():
            self.backend.set_shared_carveout(function, percent)

    def stream_for(self, stream: object = None) -> object:
        """The stream work asked for on `stream` (None: the shared stream) really goes to: the
        capture stream while this thread captures the shared stream, else `stream` itself."""
        s = self.stream if stream is None else stream
        if s is self.stream and self._capturer == threading.get_ident():
            return self.capture_stream
        return s

    # -- graphs --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, stream: object = None) -> Iterator[Capture]:
        """Capture work on `stream` (THREAD_LOCAL) into a graph exec; see the module note. A
        capture of the shared stream (the default) records on `capture_stream`; `cap.stream`
        names the stream being recorded."""
        guard = self.gate.exclusive()
        shared = stream is None or stream is self.stream
        stream = self.capture_stream if shared else stream
        cap = Capture(stream)
        graph = None
        try:
            if shared:
                self._capturer = threading.get_ident()
            own0 = self.own_used_bytes()
            self.backend.begin_capture(stream)
            try:
                yield cap
            except BaseException:
                with contextlib.suppress(DeviceError):  # the body's error is the one to report
                    graph = self._end_capture(stream)  # always ended, even on error
                raise
            graph = self._end_capture(stream)
            cap.graph_exec = self.backend.instantiate(graph)
            cap.graph_bytes = max(0, self.own_used_bytes() - own0)
            try:
                self.ledger.commit("graphs", cap.graph_bytes)
            except BaseException:
                self.backend.destroy_graph_exec(cap.graph_exec)
                cap.graph_exec = None
                raise
            self.ledger.add_content("graphs", cap.graph_bytes)
            with self._lock:
                self._graphs[id(cap.graph_exec)] = cap.graph_bytes
        finally:
            if shared:
                self._capturer = None
            if graph is not None:
                self.backend.destroy_graph(graph)
            guard.release()
            self.queue.fence_parked()

    def _end_capture(self, stream: object) -> object:
        try:
            return self.backend.end_capture(stream)
        except CaptureInvalidated:
            with self._lock:
                self.capture_invalidations += 1
            raise

    def replay(self, graph_exec: object, stream: object = None) -> None:
        self.backend.launch_graph(graph_exec, self.stream_for(stream))

    def destroy_graph_exec(self, graph_exec: object) -> None:
        with self._lock:
            nbytes = self._graphs.pop(id(graph_exec), None)
        if nbytes is None:
            raise InvalidArgument("destroy_graph_exec: not a graph exec of this device")
        with self.gate.shared():
            self.backend.destroy_graph_exec(graph_exec)
        self.ledger.uncommit("graphs", nbytes)
        self.ledger.remove_content("graphs", nbytes)

    # -- private streams -----------------------------------------------------------------------
    def create_stream(self) -> object:
        """A stream of the caller's own, for work that must not queue behind the shared ones
        (the checkpoint loader's quantizer: checkpoints/device_quantizer.py). The arena fences
        releases on the shared streams only: wait for this stream's work before freeing memory
        it touches, and end it with destroy_stream."""
        return self.backend.create_stream()

    def destroy_stream(self, stream: object) -> None:
        with self.gate.shared():
            self.backend.destroy_stream(stream)

    # -- synchronization and copies ------------------------------------------------------------
    def synchronize(self, stream: object = None) -> None:
        with self.gate.shared():
            self.backend.synchronize_stream(self.stream if stream is None else stream)
        self.queue.poll()

    def create_event(self, timing: bool = False, blocking: bool = False) -> object:
        """`blocking`: a wait on it sleeps rather than spins (Backend.create_event)."""
        return self.backend.create_event(timing, blocking)

    def event_elapsed_s(self, start: object, end: object) -> float:
        """Seconds between two completed timing events (cuEventElapsedTime on cuda)."""
        return self.backend.event_elapsed_ms(start, end) / 1e3

    def event_done(self, event: object) -> bool:
        return self.backend.event_done(event)

    def destroy_event(self, event: object) -> None:
        self.backend.destroy_event(event)

    def record_event(self, event: object, stream: object = None) -> None:
        self.backend.record_event(event, self.stream_for(stream))

    def wait_event(self, event: object) -> None:
        """Block the host until `event` completed (gated like a stream sync), then run the
        releases whose fences passed."""
        with self.gate.shared():
            self.backend.synchronize_event(event)
        self.queue.poll()

    def synchronize_device(self) -> None:
        """Device-wide sync (gated: it would invalidate another thread's capture)."""
        with self.gate.shared():
            self.backend.synchronize_context()
        self.queue.poll()

    def to_device(self, dst_ptr: int, host: np.ndarray, stream: object = None) -> None:
        data = np.ascontiguousarray(host).reshape(-1).view(np.uint8).copy()
        s = self.stream if stream is None else stream
        with self.gate.shared():
            self.backend.copy_h2d_async(dst_ptr, data, s)
            self.backend.synchronize_stream(s)  # pageable source: the copy is synchronous

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory (a uint8 array) for copies that must not synchronize. Gated:
        cuMemHostAlloc invalidates a global-mode capture elsewhere."""
        with self.gate.shared():
            return self.backend.alloc_pinned(nbytes)

    def free_pinned(self, buf: np.ndarray) -> None:
        with self.gate.shared():
            self.backend.free_pinned(buf)

    def copy_to_device_async(self, dst_ptr: int, pinned: np.ndarray, stream: object = None) -> None:
        """Stream-ordered copy from `pinned` (from alloc_pinned): no synchronization. The host
        must not rewrite `pinned` until an event recorded after this copy has completed."""
        self.backend.copy_h2d_async(dst_ptr, pinned, self.stream_for(stream))

    def copy_from_device_async(self, pinned: np.ndarray, src_ptr: int, stream: object = None) -> None:
        """Stream-ordered copy into `pinned`; read it only after an event recorded after it."""
        self.backend.copy_d2h_async(pinned, src_ptr, self.stream_for(stream))

    def copy_device_async(self, dst_ptr: int, src_ptr: int, nbytes: int, stream: object = None) -> None:
        self.backend.copy_d2d_async(dst_ptr, src_ptr, nbytes, self.stream_for(stream))

    def from_device(self, ptr: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        with self.gate.shared():
            self.backend.copy_d2h_async(out, ptr, self.stream)
            self.backend.synchronize_stream(self.stream)
        return out

    def memset(self, dst_ptr: int, byte: int, nbytes: int, stream: object = None) -> None:
        self.backend.memset_async(dst_ptr, byte, nbytes, self.stream_for(stream))

    # -- truth ---------------------------------------------------------------------------------
    def truth(self) -> tuple[int, int]:
        """(device_used_bytes, process_used_bytes) as the device and NVML report them."""
        free, total = self.backend.mem_get_info()
        return total - free, self.backend.process_used_bytes()

    def used_and_others(self, attempts: int = 4) -> tuple[int, int]:
        """(device-used bytes, other processes' bytes) as one snapshot. Hazard: the two come from
        two calls (cuMemGetInfo, then NVML), so a process that allocates or frees between them
        shows up in one and not the other, and this process looks off by that much (seen with
        GPU tests in parallel processes). Contract: NVML is read before and after the device
        and the pair is taken once both reads agree, else retried; after `attempts` the last
        pair is returned. Cost: one NVML query more a reading, more only while others move."""
        others = self.backend.others_used_bytes()
        for _ in range(attempts):
            free, total = self.backend.mem_get_info()
            used = total - free
            after = self.backend.others_used_bytes()
            if after == others:
                break
            others = after
        return used, others

    def unaccounted_bytes(self) -> int:
        """Device-used bytes the ledger does not explain (0 when every byte is booked): the
        device's use less what NVML attributes to other processes, less this ledger."""
        used, others = self.used_and_others()
        return used - others - self.ledger.total_committed()

    def own_used_bytes(self) -> int:
        """This process's share of the device's use (device-used less other processes' bytes,
        one settled snapshot): what a call allocated is the change in it across the call, with
        other processes' allocations meanwhile left out (module loads, captures, cuBLAS)."""
        used, others = self.used_and_others()
        return used - others

    def unaccounted_tolerance(self) -> int:
        """How far unaccounted may drift before it is a fault: 1 % of device use or one granule
        (the driver rounds some of its own allocations to granules we cannot see)."""
        used, _ = self.truth()
        return max(self.info.granule_bytes, used // 100)

    def bookkeeping_faults(self) -> int:
        """Ledger and arena underflows, plus one while unaccounted is beyond its tolerance."""
        underflows = self.ledger.fault_underflow + self.arena.counters["fault_underflow"]
        return underflows + int(abs(self.unaccounted_bytes()) > self.unaccounted_tolerance())

    def report(self) -> None:
        used, proc = self.truth()
        self.ledger.report(used, proc)

    def stats(self) -> dict:
        return {"arena": self.arena.stats(), "weights": self.weights.stats(),
                "ledger": self.ledger.snapshot(), "release_queue": vars(self.queue.stats),
                "gate": vars(self.gate.stats), "fault_underflow": self.ledger.fault_underflow
                + self.arena.counters["fault_underflow"],
                "fault_unaccounted": self.unaccounted_bytes()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._reporter is not None:
            self._reporter.join(timeout=10)
        self.synchronize(self.stream)
        self.synchronize(self.copy_stream)
        if self._blas is not None:
            self._blas.close()
            self._blas = None
        self.weights.close()
        self.arena.close()
        self.queue.close()
        with self.gate.shared():
            for s in [*self._streams, self.capture_stream]:
                self.backend.destroy_stream(s)
        self.ledger.uncommit("context", self._context_bytes)
        self.ledger.remove_content("context", self._context_bytes)
        with self.gate.shared():  # frees the VA reservation: a VMM call
            self.backend.close()


def _dim3(v: Sequence[int], what: str) -> tuple[int, int, int]:
    t = tuple(int(x) for x in v) + (1, 1, 1)
    t = t[:3]
    if len(tuple(v)) > 3 or any(x <= 0 for x in t):
        raise InvalidArgument(f"{what} must be 1 to 3 positive ints, got {tuple(v)}")
    return t  # type: ignore[return-value]


def open_backend(backend: str = "auto", ordinal: int = 0, keep_gil: bool = False) -> Backend:
    """The raw backend: "auto" = cuda when a CUDA device exists, else the sim test double;
    `keep_gil`: cuda's enqueue-only driver calls keep the GIL (device/cuda_enqueue.py).

    Separate from open_device for callers that must describe the device (to a governor) before
    the Device books its context baseline through that governor.
    """
    if backend not in ("auto", "cuda", "sim"):
        raise InvalidArgument(f"backend must be auto, cuda or sim, got {backend!r}")
    if backend in ("auto", "cuda"):
        from gpu_worker.device.cuda_backend import CudaBackend, cuda_device_count

        if cuda_device_count() > ordinal:
            return CudaBackend(ordinal, keep_gil=keep_gil)
        if backend == "cuda":
            raise FailedPrecondition(f"backend cuda asked for, but there is no CUDA device {ordinal}")
    from gpu_worker.device.sim_backend import SimBackend

    return SimBackend(ordinal=ordinal)


def open_device(backend: str = "auto", budget: BudgetOwner | None = None, ordinal: int = 0,
                reserve_bytes: int | None = None) -> Device:
    """Open the device on the backend open_backend picks."""
    return Device(open_backend(backend, ordinal), budget, reserve_bytes)
