"""bench/_kernel_bench.py: how the kernel microbenchmarks time a graph."""
from __future__ import annotations

import time

from bench._kernel_bench import device_clock, median_replay
from gpu_worker.device import open_device


def test_median_replay_drops_the_warm_replay_and_divides_by_reps():
    seen = iter([9.0, 3.0, 1.0, 2.0])
    calls = []

    def clock(fn):
        fn()
        return next(seen)
    assert median_replay(lambda: calls.append(1), clock, trials=3, reps=4) == 2.0 / 4
    assert len(calls) == 4   # one warm replay, then the three timed


def test_device_clock_excludes_the_hosts_wait_after_the_stop_event():
    # the host's wake-up after the work (here a slow wait_event) is not the device's time
    dev = open_device("sim")
    try:
        wait = dev.wait_event

        def slow_wait(event):
            wait(event)
            time.sleep(0.2)
        dev.wait_event = slow_wait
        started = time.perf_counter()
        seconds = device_clock(dev)(lambda: None)
        assert time.perf_counter() - started >= 0.2
        assert 0 <= seconds < 0.1
    finally:
        dev.close()
