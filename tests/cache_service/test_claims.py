"""ClaimTable (cross-host single flight), without a server: grants, waits, expiry, release, caps."""
from __future__ import annotations

import threading

import pytest

from cache_service.claims import ClaimTable, Outcome
from services.common.errors import InvalidArgument
from tests.polling import wait_until

E = ("default", "k1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def absent() -> None:
    return None


def test_the_first_claimant_is_granted_and_a_second_holder_is_held() -> None:
    table = ClaimTable(clock=Clock())
    first = table.claim(E, "host-a", 10.0, 0.0, absent)
    second = table.claim(E, "host-b", 10.0, 0.0, absent)
    assert first.outcome is Outcome.GRANTED and first.expires_in_s == 10.0
    assert second.outcome is Outcome.HELD and second.expires_in_s == pytest.approx(10.0), second
    assert table.stats().granted == 1 and table.stats().active == 1


def test_a_stored_key_is_found_and_no_claim_is_taken() -> None:
    table = ClaimTable(clock=Clock())
    result = table.claim(E, "host-a", 10.0, 0.0, lambda: "artifact")
    assert result.outcome is Outcome.FOUND and result.found == "artifact"
    assert table.stats().granted == 0 and table.stats().active == 0


def test_the_same_holder_claiming_again_renews_its_claim() -> None:
    clock = Clock()
    table = ClaimTable(clock=clock)
    table.claim(E, "host-a", 10.0, 0.0, absent)
    clock.now += 8
    assert table.claim(E, "host-a", 10.0, 0.0, absent).outcome is Outcome.GRANTED
    clock.now += 8  # 16 s after the first claim, 8 after the renewal: still live
    assert table.claim(E, "host-b", 10.0, 0.0, absent).outcome is Outcome.HELD
    assert table.stats().granted == 1 and table.stats().renewed == 1, table.stats()


def test_an_expired_claim_is_taken_over_and_counted_as_expired() -> None:
    clock = Clock()
    table = ClaimTable(clock=clock)
    table.claim(E, "dead-host", 2.0, 0.0, absent)
    clock.now += 2.0
    result = table.claim(E, "host-b", 10.0, 0.0, absent)
    assert result.outcome is Outcome.GRANTED and result.took_over, result
    assert table.stats().expired == 1 and table.stats().granted == 2


def test_only_the_holder_can_release_and_a_release_lets_the_next_caller_claim() -> None:
    table = ClaimTable(clock=Clock())
    table.claim(E, "host-a", 10.0, 0.0, absent)
    assert not table.release(E, "host-b"), "a claim was released by a host that did not hold it"
    assert table.claim(E, "host-b", 10.0, 0.0, absent).outcome is Outcome.HELD
    assert table.release(E, "host-a")
    granted = table.claim(E, "host-b", 10.0, 0.0, absent)
    assert granted.outcome is Outcome.GRANTED and not granted.took_over
    assert table.stats().released == 1 and table.stats().expired == 0


def test_a_waiter_wakes_on_the_holders_store_and_counts_a_wait_hit() -> None:
    table = ClaimTable()
    stored: list[str] = []
    table.claim(E, "host-a", 30.0, 0.0, absent)
    results = []
    waiter = threading.Thread(target=lambda: results.append(
        table.claim(E, "host-b", 30.0, 10.0, lambda: stored[0] if stored else None)))
    waiter.start()
    assert wait_until(lambda: table.stats().waiting == 1, 5.0), "the second claimant never waited"
    stored.append("artifact")
    table.stored(E)
    waiter.join(5.0)
    assert results and results[0].outcome is Outcome.FOUND and results[0].found == "artifact"
    s = table.stats()
    assert (s.waits, s.wait_hits, s.active, s.waiting) == (1, 1, 0, 0), s


def test_a_waiter_takes_over_when_the_holders_claim_expires() -> None:
    table = ClaimTable()
    table.claim(E, "stalled-host", 0.3, 0.0, absent)
    result = table.claim(E, "host-b", 30.0, 5.0, absent)
    assert result.outcome is Outcome.GRANTED and result.took_over, result
    assert table.stats().expired == 1 and table.stats().waits == 1


def test_a_wait_is_bounded_by_wait_s_and_by_the_servers_cap() -> None:
    table = ClaimTable(max_wait_s=0.2)
    table.claim(E, "host-a", 60.0, 0.0, absent)
    result = table.claim(E, "host-b", 60.0, 30.0, absent)  # asks for 30 s, the cap is 0.2 s
    assert result.outcome is Outcome.HELD and result.expires_in_s > 59, result


def test_callers_past_the_waiter_cap_are_told_to_retry_instead_of_taking_a_thread() -> None:
    table = ClaimTable(max_waiters=0, clock=Clock())
    table.claim(E, "host-a", 60.0, 0.0, absent)
    result = table.claim(E, "host-b", 60.0, 5.0, absent)
    assert result.outcome is Outcome.HELD and 0 < result.retry_after_s <= 0.25, result
    assert table.stats().waiting == 0


def test_reap_drops_expired_claims_and_counts_them() -> None:
    clock = Clock()
    table = ClaimTable(clock=clock)
    table.claim(E, "host-a", 1.0, 0.0, absent)
    table.claim(("default", "k2"), "host-a", 100.0, 0.0, absent)
    clock.now += 5
    assert table.reap() == 1
    assert table.stats().active == 1 and table.stats().expired == 1


@pytest.mark.parametrize("holder, ttl, wait", [("", 10.0, 0.0), ("h" * 300, 10.0, 0.0),
                                               ("h", 0.0, 0.0), ("h", 1e9, 0.0), ("h", 1.0, -1.0)])
def test_a_bad_claim_is_invalid_argument_and_changes_nothing(holder: str, ttl: float,
                                                             wait: float) -> None:
    table = ClaimTable(clock=Clock())
    with pytest.raises(InvalidArgument):
        table.claim(E, holder, ttl, wait, absent)
    assert table.stats().active == 0 and table.stats().granted == 0
