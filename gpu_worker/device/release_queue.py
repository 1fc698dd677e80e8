"""Fenced, deferred release of device memory.

Hazard: cuMemUnmap does not wait for kernels still reading the range; it returns at once and the
kernel then faults with an illegal address, losing the context (measured, ../shared/GPU.md). A
device-wide sync before each unmap would be safe but invalidates any capture in flight and stalls
every stream.

Contract: `defer(streams, action)` records one event on each stream that may touch the range and
queues `action`; `poll()` runs an action only once all its events have completed (cuEventQuery,
which never blocks or synchronizes). An action that raises is quarantined: its range is never
reused, the failure is counted (stats and gpuplane_worker_survived_errors_total{site=
"release_quarantined"}) and logged with what was being released. A release requested by the capturing thread is parked until the
capture ends (an event recorded on a capturing stream would become a graph node). Event recording
and actions hold a capture-gate section: an event recorded on a stream another thread is capturing
would join that capture.

Cost: one cuEventRecord per stream per release (~2 us), events pooled; no host blocking.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_worker.device.backend import Backend
from gpu_worker.device.gate import CaptureGate
from gpu_worker.telemetry.survived import survived


@dataclass(eq=False)
class _Entry:
    events: list
    action: Callable[[], None]
    what: str


@dataclass
class Quarantined:
    what: str
    error: str


@dataclass
class ReleaseStats:
    deferred: int = 0
    completed: int = 0
    parked: int = 0
    quarantined: int = 0
    quarantine: list[Quarantined] = field(default_factory=list)


class ReleaseQueue:
    def __init__(self, backend: Backend, gate: CaptureGate, event_pool: int = 64) -> None:
        self._backend = backend
        self._gate = gate
        self._lock = threading.Lock()
        self._pending: deque[_Entry] = deque()
        self._parked: list[tuple[list, Callable[[], None], str]] = []
        self._events: list = []
        self._event_pool = event_pool
        self.stats = ReleaseStats()

    def defer(self, streams: list, action: Callable[[], None], what: str) -> None:
        """Run `action` once all work queued so far on `streams` has completed."""
        if self._gate.is_capturing_thread():
            with self._lock:
                self._parked.append((list(streams), action, what))
                self.stats.parked += 1
            return
        with self._gate.shared():
            events = []
            for s in streams:
                ev = self._take_event()
                self._backend.record_event(ev, s)
                events.append(ev)
            with self._lock:
                self._pending.append(_Entry(events, action, what))
                self.stats.deferred += 1

    def fence_parked(self) -> None:
        """Fence the releases parked during a capture; call after the capture has ended."""
        with self._lock:
            parked, self._parked = self._parked, []
        for streams, action, what in parked:
            self.defer(streams, action, what)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._parked)

    def poll(self) -> int:
        """Run every action whose fences completed; returns how many ran (never blocks on a fence)."""
        if self._gate.is_capturing_thread():
            return 0  # never unmap inside a capture
        with self._lock:
            ready = [e for e in self._pending if all(self._backend.event_done(ev) for ev in e.events)]
            for e in ready:
                self._pending.remove(e)
        for e in ready:
            self._run(e)
        return len(ready)

    def drain(self) -> int:
        """Wait for every pending fence (per event, never device-wide) and run the actions."""
        self.fence_parked()
        ran = 0
        while True:
            with self._lock:
                if not self._pending:
                    return ran
                e = self._pending.popleft()
            with self._gate.shared():
                for ev in e.events:
                    self._backend.synchronize_event(ev)
            self._run(e)
            ran += 1

    def _run(self, e: _Entry) -> None:
        try:
            with self._gate.shared():
                e.action()
            self.stats.completed += 1
        except Exception as exc:  # noqa: BLE001 - a failed release is quarantined, never retried
            with self._lock:
                self.stats.quarantined += 1
                self.stats.quarantine.append(Quarantined(e.what, f"{type(exc).__name__}: {exc}"))
            # Each quarantine leaks device memory or host pinned memory for the process's life.
            survived("release_quarantined", exc, "a deferred release failed; its range is "
                     "quarantined (never reused, still booked)", every=True, what=e.what)
        finally:
            self._give_events(e.events)

    def _take_event(self) -> object:
        with self._lock:
            if self._events:
                return self._events.pop()
        return self._backend.create_event()

    def _give_events(self, events: list) -> None:
        extra = []
        with self._lock:
            for ev in events:
                if len(self._events) < self._event_pool:
                    self._events.append(ev)
                else:
                    extra.append(ev)
        if extra:
            with self._gate.shared():
                for ev in extra:
                    self._backend.destroy_event(ev)

    def close(self) -> None:
        self.drain()
        with self._lock:
            events, self._events = self._events, []
        with self._gate.shared():
            for ev in events:
                self._backend.destroy_event(ev)
