"""The model's request lock, which knows whether another thread is waiting for it.

Hazard: a decoder's engine thread takes the model's lock for each step and takes it again at
once, still holding the GIL. A thread blocked in `acquire` (the reclaimer's cached_kv and
kv_preemption steps, an offload, an unload, a trim) is woken by the release but must be
scheduled before the engine's next acquire to win it: without a hand-off between steps it
starves. Handing the GIL over between every two steps costs too: any other busy thread (the
gRPC loop writing the step's messages) then runs first, and the engine's next step is enqueued
up to one switch interval late. So the engine yields between steps only while `waiting()` is
non-zero (gpu_worker/engines/scheduler/scheduler.py, `Scheduler._loop`).

Contract:
- The interface of `threading.Lock`: `acquire(blocking=True, timeout=-1)`, `release()`,
  `locked()`, a context manager. Not re-entrant, like the lock it replaces: a thread that takes
  it twice deadlocks. Nothing takes it nested: the scheduler's `close()` joins the engine thread
  before it takes the lock, and `_fail_all` runs after `step()` let it go. So a scheduler built
  without the model's lock (tests, benches) makes one of these as well, not an RLock: it runs
  under the same rules as the loader's.
- It lives among the engines, not in gpu_worker.core: the scheduler makes one, and the engines
  never import the core (LoadedModel.lock is one, gpu_worker/core/loaded_model.py).
- `waiting()` counts the threads inside a blocking `acquire` that did not get the lock at once:
  counted before they block, uncounted in a `finally` once `acquire` returns (the lock taken,
  a timeout, an interrupt). A non-blocking acquire is never counted. A thread that won the
  underlying lock is still counted until it runs again: a waiter seen is a hint, enough to
  decide whether to yield, never proof that someone will take the lock.
- The count has its own small lock (`+= 1` on an attribute is not atomic between threads); a
  read of `waiting()` takes none.

Cost: an uncontended acquire is one non-blocking try of the inner lock plus a Python call: a
`with` round trip measured 0.32 us against 0.18 us for a bare `threading.Lock` and 0.26 us for
an RLock (CPython 3.11, the 2-core CPU machine); `waiting()` is 24 ns. Only an acquire that must
wait pays the counter's lock, twice.
"""
from __future__ import annotations

import threading


class ContendedLock:
    """A non-re-entrant lock whose `waiting()` says how many threads are blocked on it."""

    __slots__ = ("_count_lock", "_lock", "_waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()     # guards `_waiting` only, never held while blocked
        self._waiting = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking:        # never counted; a timeout with it raises, as threading.Lock's
            return self._lock.acquire(False, timeout)
        if self._lock.acquire(False):           # uncontended: nobody waits on us
            return True
        with self._count_lock:
            self._waiting += 1
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with self._count_lock:
                self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def waiting(self) -> int:
        """Threads blocked in `acquire` now (a snapshot: it may change as soon as it is read)."""
        return self._waiting

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "locked" if self.locked() else "unlocked"
        return f"<ContendedLock {state}, {self._waiting} waiting>"
