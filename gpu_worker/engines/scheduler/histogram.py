"""A cumulative latency histogram (Prometheus buckets), filled by the engine thread, read by scrapes."""
from __future__ import annotations

import bisect
import threading

# seconds: 1 ms .. 60 s, roughly x2.5 apart
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)


# seconds: engine steps, 0.25 ms .. 2.5 s (a decode step is ~1-50 ms)
STEP_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)   # last: +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) pairs ending with "+Inf", and the sum."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, running))
        return out, total

    def merge(self, other: Histogram) -> None:
        """Add `other`'s observations (for summing over models)."""
        with other._lock:
            counts, total = list(other._counts), other._sum
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
            self._sum += total

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)
