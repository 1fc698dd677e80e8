"""The process-wide capture gate.

Hazard: a device-wide synchronization (cuCtxSynchronize) on any thread invalidates a stream capture
in flight on another thread, in every capture mode (measured on an H200, ../shared/GPU.md). The
failure surfaces far from its cause: the capturing thread gets CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
from cuStreamEndCapture, long after the other thread's innocent sync returned. THREAD_LOCAL mode is
not a cure (it only stops *this* thread's unsafe calls from invalidating other captures).

Contract:
- One gate per process (`process_gate()`), not per stream, graph or runtime: each of those would
  admit a second, unsynchronized instance.
- A capture holds the exclusive side for its whole duration; every call that can synchronize the
  device or change what a capture sees holds a shared section (Device does this for its callers).
- The capturing thread bypasses the gate: capturing a step may allocate from the arena.
- Writer preference: a waiting capture blocks new shared sections, so a busy allocator cannot
  starve it. Shared sections are re-entrant per thread (a nested section never queues, otherwise a
  thread holding one would deadlock behind the waiting writer).
- Taking the exclusive side sets aside the shared sections the calling thread holds (restored on
  release); otherwise two threads that each hold a section and both start capturing deadlock.
- Guards are plain objects: they can be held across begin/end capture and released from another
  function; releasing twice is a no-op.
- `run_or_defer(fn)` runs work now, or after the capture in progress when it may not block.

Why not threading's primitives or a stock rwlock: none offers writer preference together with
per-thread re-entrancy, set-aside and a writer bypass.

Cost: one uncontended shared section is a lock round trip (~1 us in CPython); a capture waits for
the shared sections in flight (allocator calls, tens of microseconds).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self


class _Guard:
    """Base for gate guards: a context manager that can also be released explicitly, once."""

    def __init__(self, gate: CaptureGate) -> None:
        self._gate = gate
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._do_release()

    def _do_release(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SharedGuard(_Guard):
    def __init__(self, gate: CaptureGate, tid: int, counted: bool) -> None:
        super().__init__(gate)
        self._tid = tid
        self._counted = counted  # False for the capturing thread's bypass and a disabled gate

    def _do_release(self) -> None:
        if self._counted:
            self._gate._release_shared(self._tid)


class ExclusiveGuard(_Guard):
    def __init__(self, gate: CaptureGate, tid: int, set_aside: int) -> None:
        super().__init__(gate)
        self._tid = tid
        self._set_aside = set_aside  # shared depth this thread held, restored on release

    def _do_release(self) -> None:
        self._gate._release_exclusive(self._tid, self._set_aside)


@dataclass
class GateStats:
    captures: int = 0
    shared_sections: int = 0
    bypassed: int = 0          # shared sections taken by the capturing thread itself
    set_asides: int = 0        # captures that set aside their own shared sections
    writer_waits: int = 0      # captures that had to wait for shared sections to drain


class CaptureGate:
    """Reader/writer gate: captures exclusive, synchronizing calls shared (see module note)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False only for negative-control tests: proves the gate is needed
        self._cond = threading.Condition(threading.Lock())
        # why: re-entrancy and set-aside need per-thread depth, not a bare count
        self._readers: dict[int, int] = {}
        # why: the bypass and "only one capture at a time" both key on the capturing thread
        self._writer: int | None = None
        # why: writer preference - new shared sections wait while a capture is queued
        self._writers_waiting = 0
        self._deferred: list[Callable[[], None]] = []  # run_or_defer work held until a capture ends
        self._readers_waiting = 0  # introspection only: lets tests prove "blocked" without sleeping
        self.stats = GateStats()

    # -- shared side ---------------------------------------------------------------------------
    def shared(self) -> SharedGuard:
        """Enter a synchronizing section; blocks while a capture runs or waits (other threads)."""
        tid = threading.get_ident()
        if not self.enabled:
            return SharedGuard(self, tid, counted=False)
        with self._cond:
            if self._writer == tid:
                self.stats.bypassed += 1
                return SharedGuard(self, tid, counted=False)
            depth = self._readers.get(tid, 0)
            if depth == 0 and (self._writer is not None or self._writers_waiting):
                self._readers_waiting += 1
                try:
                    while self._writer is not None or self._writers_waiting:
                        self._cond.wait()
                finally:
                    self._readers_waiting -= 1
            self._readers[tid] = depth + 1
            self.stats.shared_sections += 1
            return SharedGuard(self, tid, counted=True)

    def _release_shared(self, tid: int) -> None:
        with self._cond:
            depth = self._readers.get(tid, 0)
            assert depth > 0, "capture gate: shared section released more often than entered"
            if depth == 1:
                del self._readers[tid]
                self._cond.notify_all()
            else:
                self._readers[tid] = depth - 1

    # -- exclusive side ------------------------------------------------------------------------
    def exclusive(self) -> ExclusiveGuard:
        """Take the gate for a capture; sets aside this thread's own shared sections."""
        tid = threading.get_ident()
        with self._cond:
            if self._writer == tid:
                raise RuntimeError("capture gate: this thread is already capturing (no nesting)")
            set_aside = self._readers.pop(tid, 0)
            if set_aside:
                self.stats.set_asides += 1
                self._cond.notify_all()
            if not self.enabled:
                self._writer = None
                self.stats.captures += 1
                return ExclusiveGuard(self, tid, set_aside)
            self._writers_waiting += 1
            try:
                if self._writer is not None or self._readers:
                    self.stats.writer_waits += 1
                while self._writer is not None or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = tid
            self.stats.captures += 1
            return ExclusiveGuard(self, tid, set_aside)

    def _release_exclusive(self, tid: int, set_aside: int) -> None:
        with self._cond:
            if self.enabled:
                assert self._writer == tid, "capture gate: exclusive released by a non-owner"
                self._writer = None
            if set_aside:
                self._readers[tid] = self._readers.get(tid, 0) + set_aside
            deferred, self._deferred = self._deferred, []
            self._cond.notify_all()
        for fn in deferred:
            self.run_or_defer(fn)

    def run_or_defer(self, fn: Callable[[], None]) -> bool:
        """Run `fn` in a shared section now, or, while a capture runs or waits (on another
        thread), queue it to run when that capture ends. For work that must not block a caller
        during a capture (e.g. a cleanup on a latency-critical path). True when it ran now."""
        tid = threading.get_ident()
        with self._cond:
            busy = self.enabled and self._writer is not None and self._writer != tid
            if busy or (self.enabled and self._writers_waiting and not self._readers.get(tid)):
                self._deferred.append(fn)
                return False
        with self.shared():
            fn()
        return True

    # -- introspection -------------------------------------------------------------------------
    def capturing_thread(self) -> int | None:
        return self._writer

    def is_capturing_thread(self) -> bool:
        return self._writer == threading.get_ident()

    def holds_section(self) -> bool:
        """True when this thread may make a synchronizing call (shared held, or it captures)."""
        tid = threading.get_ident()
        return (not self.enabled) or self._writer == tid or self._readers.get(tid, 0) > 0

    def waiting_writers(self) -> int:
        return self._writers_waiting

    def waiting_readers(self) -> int:
        return self._readers_waiting


_PROCESS_GATE = CaptureGate()


def process_gate() -> CaptureGate:
    """The one gate of this process (DESIGN 2.1: one per process, not per stream or runtime)."""
    return _PROCESS_GATE
