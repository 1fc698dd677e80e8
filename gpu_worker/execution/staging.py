"""Pinned host staging for steps that overlap: inputs go up and tokens come back without a
synchronize.

Hazard: an asynchronous copy reads (H2D) or writes (D2H) its host buffer when the stream reaches
it, not when it is enqueued. A host that rewrites a staging buffer for step n+1 while step n's
copy is still queued sends step n+1's inputs to step n; one that reads a readback buffer before
its copy ran reads the previous step's tokens. A pageable buffer is no way out: the driver then
copies synchronously, which is the per-step stall this module removes.
Contract: two halves, one per step parity. A step takes its regions from its half with `take`
(bump allocation) and ends with `end(event)`, an event recorded after the step's last copy. A
half is reused two steps later, only after that event completed (`begin` waits for it; the
engine has normally read that step back already, so the wait costs nothing). A step that needs
more than its half holds allocates a larger pinned buffer; the old one stays alive until the
half's next `begin` (its regions may still be queued).
Cost: one cuMemHostAlloc per growth (a few per model lifetime), none per step.
"""
from __future__ import annotations

import numpy as np

ALIGN = 256
INITIAL_BYTES = 256 << 10


class _Half:
    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.offset = 0
        self.event: object | None = None
        self.retired: list[np.ndarray] = []


class StepStaging:
    """Two pinned halves on `device` (alloc_pinned / wait_event); see the module note."""

    def __init__(self, device, initial_bytes: int = INITIAL_BYTES) -> None:
        self.device = device
        self.initial_bytes = initial_bytes
        self._halves = (_Half(), _Half())
        self._current: _Half | None = None
        self.grows = 0

    def begin(self, parity: int) -> None:
        half = self._halves[parity & 1]
        if half.event is not None:
            self.device.wait_event(half.event)   # step n-2's copies are done (normally at once)
            half.event = None
        for buf in half.retired:
            self.device.free_pinned(buf)
        half.retired.clear()
        half.offset = 0
        self._current = half

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` of pinned memory valid until this half's next `begin`."""
        half = self._current
        assert half is not None, "take() outside begin()/end(): the region would have no fence"
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if half.buf is None or half.offset + size > half.buf.nbytes:
            if half.buf is not None:
                half.retired.append(half.buf)    # regions taken from it may still be queued
            want = max(self.initial_bytes, 2 * (half.buf.nbytes if half.buf is not None else 0),
                       size)
            half.buf = self.device.alloc_pinned(want)
            half.offset = 0
            self.grows += 1
        view = half.buf[half.offset:half.offset + nbytes]
        half.offset += size
        return view

    def end(self, event: object) -> None:
        """`event` is recorded after every copy that uses this half's regions."""
        assert self._current is not None, "end() without begin()"
        self._current.event = event
        self._current = None

    def close(self) -> None:
        """Free the buffers; the caller synchronized the stream first."""
        for half in self._halves:
            for buf in [*half.retired, *([half.buf] if half.buf is not None else [])]:
                self.device.free_pinned(buf)
            half.retired.clear()
            half.buf, half.event = None, None
