"""cache_service.breaker: open after N consecutive failures, one half-open probe after a cool-down."""
from __future__ import annotations

from cache_service.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_n_consecutive_failures_only():
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=Clock())
    for _ in range(2):
        breaker.record_failure()
    breaker.record_success()
    for _ in range(2):
        breaker.record_failure()
    assert breaker.allow() and breaker.state == "closed", "a success must reset the failure count"
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow(), "3 consecutive failures must open it"


def test_breaker_admits_exactly_one_probe_after_the_cooldown_and_closes_on_success():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure()
    clock.now = 9.9
    assert not breaker.allow(), "open before the cool-down has elapsed"
    clock.now = 10.0
    assert breaker.state == "half-open"
    assert breaker.allow(), "the first call after the cool-down is the probe"
    assert not breaker.allow(), "only one probe may be in flight while half-open"
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow()


def test_a_failed_probe_reopens_the_breaker_for_a_full_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=5, cooldown_s=10, clock=clock)
    for _ in range(5):
        breaker.record_failure()
    clock.now = 10
    assert breaker.allow()
    breaker.record_failure()
    clock.now = 19
    assert not breaker.allow(), "a failed probe must restart the cool-down"
    clock.now = 20
    assert breaker.allow()
