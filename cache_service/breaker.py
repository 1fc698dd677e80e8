"""A circuit breaker: stop calling a peer that keeps failing, probe it again after a cool-down.

closed --N consecutive failures--> open --cool-down elapsed--> half-open (one trial call)
half-open --success--> closed ; half-open --failure--> open (cool-down restarts)
While open, `allow()` is False and the caller answers at once (a miss) instead of waiting out
a deadline per call. Thread-safe; the clock is injectable for tests.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # consecutive, reset by any success
        self._opened_at: float | None = None  # None = closed
        self._trial_in_flight = False  # half-open admits exactly one probe

    @property
    def state(self) -> str:
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "half-open" if self._clock() - self._opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        with self._lock:
            if self._opened_at is None:
                return True
            if self._clock() - self._opened_at < self.cooldown_s or self._trial_in_flight:
                return False
            self._trial_in_flight = True
            return True

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._trial_in_flight = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._trial_in_flight or self._failures >= self.failure_threshold:
                self._opened_at = self._clock()
            self._trial_in_flight = False
