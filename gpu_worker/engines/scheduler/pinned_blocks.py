"""One-block pinned host buffers, pinned ahead of need off the engine thread (the host KV tier's
supply for cached-prefix demotions: kv_demote.py, through kv_swap.KVSwap).

Hazard: pinning host memory is slow: cuMemHostAlloc locks every page (~1 ms per 2 MiB block on
the H200 host), and cuMemFreeHost synchronizes the context. A demotion copies one block out each
time the pool evicts a cached block, so under pool pressure (hundreds per second) an allocation
per demotion on the engine thread put the host on the step path: kv_swap_bench on the H200
(2026-12-02) measured ~0.6-1 ms of engine-thread time per demoted block and 0.86x the recompute
side's tokens/s, 0.94x with demotion off.
Contract:
- `take` hands out a ready buffer at once, or None (never allocates on the caller's thread), and
  wakes the refill thread, which pins buffers until `keep` are ready again: a demotion that
  finds none ready is declined (the block is dropped, as without the tier), never delayed.
- Every ready buffer is booked in the HostKVBudget from before its allocation until it is freed
  or handed out; a handed-out buffer stays booked (its owner, KVSwap, counts it from then on). The
  refill stops when the budget refuses a block, until the next `take`.
- `give` takes back a buffer whose copies ran (booked): kept ready up to `cap`, else refused
  (the caller frees it). `trim(n)` frees ready buffers down to n and gives their bytes back
  (idle keeps `keep`: no free-then-pin churn between bursts); `free_all` frees every one (close,
  or a larger copy out that needs the booked bytes); `close` stops the thread first.
- The thread starts at `start` (KVSwap: at the decoder's load, when it demotes) or the first
  `take`; the host tier of a decoder that does not demote makes none.
Cost: per `take` a lock and a notify; the pinning runs on a thread of its own (cuda-python
drops the GIL around driver calls), at most `keep` blocks ahead.
"""
from __future__ import annotations

import threading

import numpy as np

from gpu_worker.device.backend import DeviceError


class PinnedBlocks:
    """Ready one-block pinned buffers of `block_bytes`, booked in `budget`."""

    def __init__(self, device, block_bytes: int, budget, keep: int = 32, cap: int = 64) -> None:
        if not 0 <= keep <= cap:
            raise ValueError(f"PinnedBlocks: need 0 <= keep ({keep}) <= cap ({cap})")
        self.device, self.block_bytes, self.budget = device, block_bytes, budget
        self.keep, self.cap = keep, cap
        self._ready: list[np.ndarray] = []
        self._cond = threading.Condition()
        self._want = False              # a take since the last time the budget refused a block
        self._closing = False
        self._thread: threading.Thread | None = None
        self.allocated = 0              # buffers the refill pinned
        self.misses = 0                 # takes that found none ready
        self.failures = 0               # allocations the device refused

    @property
    def ready(self) -> int:
        with self._cond:
            return len(self._ready)

    @property
    def nbytes(self) -> int:
        """Booked bytes of the ready buffers."""
        return self.ready * self.block_bytes

    def start(self) -> None:
        """Pin `keep` buffers from now on, before the first `take` asks."""
        with self._cond:
            self._want = True
            self._start_locked()
            self._cond.notify()

    def take(self) -> np.ndarray | None:
        """A ready buffer (booked: the caller owns the booking now), or None; wakes the refill."""
        with self._cond:
            if self._closing:
                return None
            host = self._ready.pop() if self._ready else None
            self.misses += host is None
            self._want = True
            self._start_locked()
            self._cond.notify()
        return host

    def _start_locked(self) -> None:
        if self._thread is None and self.keep > 0 and not self._closing:
            self._thread = threading.Thread(target=self._refill, daemon=True,
                                            name="gpuplane-pinned-blocks")
            self._thread.start()

    def give(self, host: np.ndarray) -> bool:
        """Keep a buffer whose copies ran (still booked) ready; False when `cap` are ready (the
        caller frees it and gives its bytes back)."""
        with self._cond:
            if self._closing or len(self._ready) >= self.cap:
                return False
            self._ready.append(host)
            return True

    def free_all(self) -> int:
        """Free every ready buffer and give its bytes back; returns the bytes."""
        return self.trim(0)

    def trim(self, keep: int) -> int:
        """Free ready buffers until at most `keep` are left, giving their bytes back; returns
        the bytes."""
        freed = 0
        while True:
            with self._cond:
                if len(self._ready) <= keep:
                    return freed
                host = self._ready.pop()
            try:
                self.device.free_pinned(host)
            except DeviceError:
                with self._cond:
                    self._ready.append(host)
                raise
            self.budget.give(self.block_bytes)
            freed += self.block_bytes

    def wait_ready(self, n: int, timeout_s: float) -> bool:
        """Block until `n` buffers are ready (tests, a warm-up); whether they are."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._ready) >= n or self._closing,
                                       timeout_s) and len(self._ready) >= n

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self.free_all()

    def _refill(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or (
                    self._want and len(self._ready) < self.keep))
                if self._closing:
                    return
            if not self.budget.take(self.block_bytes):
                with self._cond:
                    self._want = False      # full: wait for the next take
                continue
            try:
                host = self.device.alloc_pinned(self.block_bytes)
            except DeviceError:
                self.budget.give(self.block_bytes)
                with self._cond:
                    self.failures += 1
                    self._want = False
                continue
            with self._cond:
                self._ready.append(host)
                self.allocated += 1
                self._cond.notify_all()
