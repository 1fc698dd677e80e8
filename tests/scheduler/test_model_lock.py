"""The model's request lock (gpu_worker/engines/model_lock.py) and the engine's yield between
steps: a thread blocked on the lock is counted exactly while it waits, it is not starved by an
engine stepping back to back, and the engine hands the GIL over between steps only while
someone waits (real threads, a scheduler on the sim arena with the token-pool runner)."""
from __future__ import annotations

import threading
import time

import pytest

import gpu_worker.engines.scheduler.scheduler as scheduler_module
from gpu_worker.engines.model_lock import ContendedLock
from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.scheduler import Scheduler
from tests.device.conftest import make_device
from tests.polling import eventually
from tests.scheduler.runners import VOCAB, TokenPoolRunner

# a context long enough that one stream keeps the engine stepping for the whole test
GEO = KVGeometry(layers=1, kv_heads=1, head_dim=8, block_tokens=16, max_context=1 << 14)
WAIT_S = 30.0      # generous: a loaded 2-core CI machine


class CheapRunner(TokenPoolRunner):
    """The token-pool runner, next token from the last position only: steps stay short at any
    context length, so the engine steps back to back."""

    def _next(self, table, upto, sampling):
        bt = self.geometry.block_tokens
        last = int(self.pool[table[upto // bt], upto % bt])
        assert last != -1, "read a position that was never written"
        return (last * 31 + upto) % VOCAB


class Yields:
    """Stands in for the scheduler module's `time`: counts the engine's `sleep(0)` calls."""

    def __init__(self) -> None:
        self.count = 0

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if seconds == 0:
            self.count += 1         # only the engine thread sleeps in that module
        time.sleep(seconds)


class Waited(ContendedLock):
    """A model lock that reports one extra waiter while `pretend` is set."""

    __slots__ = ("pretend",)

    def __init__(self) -> None:
        super().__init__()
        self.pretend = False

    def waiting(self) -> int:
        return super().waiting() + int(self.pretend)


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


@pytest.fixture
def yields(monkeypatch):
    y = Yields()
    monkeypatch.setattr(scheduler_module, "time", y)
    return y


def busy_engine(dev, lock):
    """A threaded scheduler on `lock` with one stream generating for far longer than a test."""
    capacity = GEO.max_blocks + 4
    pool = KVBlockPool(dev.arena, GEO, capacity)
    sched = Scheduler(CheapRunner(GEO, capacity, 32), pool, thread=True, model_lock=lock)
    seq = sched.submit([1, 2, 3, 4, 5], GEO.max_context - 8)
    eventually(lambda: sched.counters["steps"] >= 3, WAIT_S, "the engine's first steps")
    return sched, seq


def steps_later(sched: Scheduler, n: int) -> None:
    target = sched.counters["steps"] + n
    eventually(lambda: sched.counters["steps"] >= target, WAIT_S, f"{n} more engine steps")


# -- the count --------------------------------------------------------------------------------
def test_a_thread_blocked_in_acquire_is_counted_until_it_holds_the_lock():
    lock = ContendedLock()
    assert lock.acquire() and lock.locked()
    assert lock.waiting() == 0, "an uncontended acquire was counted"
    holds, leave = threading.Event(), threading.Event()

    def taker():
        with lock:
            holds.set()
            leave.wait(WAIT_S)
    t = threading.Thread(target=taker)
    t.start()
    try:
        eventually(lambda: lock.waiting() == 1, WAIT_S, "the blocked taker to be counted")
        assert not holds.is_set()
        lock.release()
        assert holds.wait(WAIT_S), "the taker never got the released lock"
        # uncounted before its acquire returned, so before it set `holds`
        assert lock.waiting() == 0 and lock.locked()
    finally:
        leave.set()
        t.join(WAIT_S)
    assert not lock.locked() and lock.waiting() == 0


def test_timeouts_and_refused_tries_leave_no_waiter_counted():
    lock = ContendedLock()
    lock.acquire()
    assert lock.acquire(blocking=False) is False
    assert lock.acquire(timeout=0) is False
    assert lock.acquire(timeout=0.01) is False
    assert lock.waiting() == 0
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(lock.acquire(timeout=0.05)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert results == [False] * 8
    assert lock.waiting() == 0, "a timed-out acquire stayed counted"
    with pytest.raises(ValueError):     # as threading.Lock: no timeout on a non-blocking try
        lock.acquire(False, 1.0)
    lock.release()
    with pytest.raises(RuntimeError):   # as threading.Lock: releasing an unlocked lock
        lock.release()


def test_the_count_returns_to_zero_after_heavy_contention():
    lock, total, rounds = ContendedLock(), [0], 2000

    def worker():
        for _ in range(rounds):
            with lock:
                total[0] += 1
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert total[0] == 8 * rounds, "the lock let two holders in"
    assert lock.waiting() == 0, "the waiter count lost an update"
    assert not lock.locked()


# -- the engine -------------------------------------------------------------------------------
def test_a_thread_waiting_for_the_model_lock_is_not_starved_by_a_busy_engine(dev):
    lock = ContendedLock()
    sched, seq = busy_engine(dev, lock)
    try:
        for _ in range(5):      # each time, in the gap between two steps of a running stream
            with lock:
                assert seq.state == "running", "the lock came only once the stream had ended"
                made = sched.counters["steps"]
            steps_later(sched, 2)
            assert sched.counters["steps"] > made
    finally:
        sched.close()


def test_the_engine_yields_between_steps_only_while_a_thread_waits_for_the_lock(dev, yields):
    lock = Waited()
    sched, seq = busy_engine(dev, lock)
    try:
        before = yields.count
        steps_later(sched, 50)
        assert yields.count == before, "the engine yielded with nobody waiting for its lock"
        lock.pretend = True
        eventually(lambda: yields.count >= before + 3, WAIT_S, "the engine to yield")
        lock.pretend = False
        steps_later(sched, 1)       # a step begun after the waiter left
        before = yields.count
        steps_later(sched, 50)
        assert yields.count == before, "the engine kept yielding once nobody waited"
        assert seq.state == "running"
    finally:
        sched.close()


def test_a_plain_lock_from_a_caller_still_gets_a_yield_every_step(dev, yields):
    sched, _ = busy_engine(dev, threading.Lock())      # no waiting(): it cannot tell
    try:
        before = yields.count
        steps_later(sched, 20)
        assert yields.count >= before + 19
    finally:
        sched.close()
