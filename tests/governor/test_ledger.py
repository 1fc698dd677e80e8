"""services.governor.ledger: admission, lending and reclaim, expiry, persistence, reconciliation."""
from __future__ import annotations

import logging

import pytest

from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from services.governor.ledger import DeviceSpec, Ledger
from tests.governor.ledgers import make

MIB = 1 << 20
GPU = DeviceSpec("GPU-test", total_bytes=2000 * MIB, free_bytes=1000 * MIB, granule_bytes=2 * MIB)


def state(ledger: Ledger) -> tuple:
    """Everything a refused call must leave untouched."""
    d = ledger.resources()[0]
    return (d.leased_bytes, tuple(z.leased_bytes for z in d.zones),
            tuple(sorted((w.worker_id, w.leased_bytes) for w in d.workers)),
            tuple(sorted(r.lease_id for r in ledger.store.leases())))


def test_device_budget_is_the_fraction_of_free_memory_rounded_down_to_the_granule(tmp_path, clock):
    ledger = make(tmp_path, clock, budget_fraction=0.9)
    reg = ledger.register("w1", GPU)
    assert reg.device_budget_bytes == 900 * MIB, "budget must be 0.9 x free at registration"
    odd = DeviceSpec("GPU-odd", 2000 * MIB, 999 * MIB + 12345, 2 * MIB)
    assert ledger.register("w2", odd).device_budget_bytes % (2 * MIB) == 0, \
        "a budget must be a whole number of granules"


def test_admission_never_lets_the_sum_of_leases_exceed_the_device_budget(tmp_path, clock):
    ledger = make(tmp_path, clock)
    ledger.register("w1", GPU)
    ledger.register("w2", GPU)
    ledger.acquire("w1", GPU.uuid, "weights", 600 * MIB)
    ledger.acquire("w2", GPU.uuid, "kv", 400 * MIB)
    before = state(ledger)
    with pytest.raises(ResourceExhausted) as info:
        ledger.acquire("w2", GPU.uuid, "kv", 1)
    err = info.value
    assert (err.asked_bytes, err.free_bytes, err.zone) == (1, 0, "kv"), \
        "a refusal must say what was asked, what is free and for which zone"
    assert err.violations and "device:GPU-test" == err.violations[0].subject
    assert {(h.worker_id, h.zone) for h in err.reclaimable} >= {("w1", "weights")}, \
        "weights are evictable and must be named as reclaimable"
    assert state(ledger) == before, "a refused acquire must change nothing"
    assert ledger.resources()[0].leased_bytes == 1000 * MIB


def test_transient_headroom_is_kept_free_for_the_transient_zone(tmp_path, clock):
    ledger = make(tmp_path, clock, transient_headroom_bytes=100 * MIB)
    ledger.register("w1", GPU)
    ledger.acquire("w1", "", "weights", 900 * MIB)
    with pytest.raises(ResourceExhausted):
        ledger.acquire("w1", "", "kv", 1 * MIB)
    ledger.acquire("w1", "", "transient", 100 * MIB)  # the headroom is there for transient
    with pytest.raises(ResourceExhausted):
        ledger.acquire("w1", "", "transient", 1 * MIB)


def test_a_zone_may_borrow_unused_budget_and_the_lender_gets_it_back_through_reclaim(
        tmp_path, clock):
    ledger = make(tmp_path, clock, zone_budgets={"kv": 500 * MIB, "weights": 500 * MIB})
    ledger.register("w1", GPU)
    ledger.register("w2", GPU)
    ledger.acquire("w1", "", "weights", 800 * MIB)  # 300 MiB borrowed from kv's unused share
    zones = {z.zone: z for z in ledger.resources()[0].zones}
    assert zones["weights"].borrowed_bytes == 300 * MIB, "borrowed bytes must be reported"
    ledger.acquire("w2", "", "kv", 200 * MIB)
    with pytest.raises(ResourceExhausted) as info:
        ledger.acquire("w2", "", "kv", 100 * MIB)  # inside kv's share, but lent out
    assert any("lent" in v.description for v in info.value.violations), \
        "a refusal inside the zone's own share must say the budget is lent"
    assert ("w1", "weights") in {(h.worker_id, h.zone) for h in info.value.reclaimable}
    beat = ledger.heartbeat("w1", "", 0, 0, {})
    assert beat.reclaim == {"weights": 100 * MIB}, "the borrower must be asked to give back"
    assert ledger.heartbeat("w1", "", 0, 0, {}).reclaim == {}, "a reclaim is asked once"


def test_without_lending_a_zone_budget_is_a_hard_cap(tmp_path, clock):
    ledger = make(tmp_path, clock, zone_budgets={"kv": 100 * MIB}, lending=False)
    ledger.register("w1", GPU)
    ledger.acquire("w1", "", "kv", 100 * MIB)
    with pytest.raises(ResourceExhausted) as info:
        ledger.acquire("w1", "", "kv", 1)
    assert any(v.subject.endswith("zone:kv") for v in info.value.violations)
    ledger.acquire("w1", "", "weights", 500 * MIB)  # other zones are not capped by kv's budget


@pytest.mark.parametrize("zone,nbytes", [("kv", 0), ("kv", -5), ("", 10), ("foreign", 10),
                                         ("nonsense", 10)])
def test_bad_acquire_arguments_are_invalid_and_change_nothing(tmp_path, clock, zone, nbytes):
    ledger = make(tmp_path, clock)
    ledger.register("w1", GPU)
    before = state(ledger)
    with pytest.raises(InvalidArgument):
        ledger.acquire("w1", "", zone, nbytes)
    assert state(ledger) == before


def test_unknown_workers_and_leases_are_not_found_and_other_workers_leases_are_denied(
        tmp_path, clock):
    ledger = make(tmp_path, clock)
    ledger.register("w1", GPU)
    ledger.register("w2", GPU)
    lease = ledger.acquire("w1", "", "kv", 10 * MIB)
    with pytest.raises(NotFound):
        ledger.acquire("ghost", GPU.uuid, "kv", 1)
    with pytest.raises(NotFound):
        ledger.release("w1", "l-nope")
    before = state(ledger)
    with pytest.raises(PermissionDenied):
        ledger.release("w2", lease.lease_id)
    with pytest.raises(PermissionDenied):
        ledger.resize("w2", lease.lease_id, 1)
    with pytest.raises(FailedPrecondition):
        ledger.acquire("w1", "GPU-other", "kv", 1)
    assert state(ledger) == before, "refused calls must change nothing"


def test_resize_grows_through_admission_and_shrinks_always(tmp_path, clock):
    ledger = make(tmp_path, clock)
    ledger.register("w1", GPU)
    lease = ledger.acquire("w1", "", "kv", 500 * MIB)
    ledger.acquire("w1", "", "weights", 400 * MIB)
    with pytest.raises(ResourceExhausted):
        ledger.resize("w1", lease.lease_id, 700 * MIB)
    assert ledger.resize("w1", lease.lease_id, 600 * MIB).bytes == 600 * MIB
    assert ledger.resize("w1", lease.lease_id, 100 * MIB).bytes == 100 * MIB
    assert ledger.resources()[0].leased_bytes == 500 * MIB


def test_a_silent_worker_loses_its_leases_after_the_ttl_and_a_heartbeat_keeps_them(
        tmp_path, clock):
    ledger = make(tmp_path, clock, lease_ttl_s=10)
    ledger.register("alive", GPU)
    ledger.register("dead", GPU)
    ledger.acquire("alive", "", "kv", 300 * MIB)
    ledger.acquire("dead", "", "kv", 700 * MIB)
    for _ in range(3):
        clock.now += 6
        assert ledger.heartbeat("alive", "", 0, 0, {}).reregister is False
    assert ledger.expire() == [], "expiry runs before heartbeats too; dead is already gone"
    d = ledger.resources()[0]
    assert [w.worker_id for w in d.workers] == ["alive"], "the silent worker must expire"
    assert d.leased_bytes == 300 * MIB, "the expired worker's memory must return to the pool"
    assert ledger.heartbeat("dead", "", 0, 0, {}).reregister, "an expired worker must re-register"
    ledger.acquire("alive", "", "weights", 700 * MIB)


def test_expiry_without_a_scan_drops_exactly_the_workers_a_full_scan_would(tmp_path, clock):
    """Admission skips the scan of every worker until the oldest one could have expired; the
    skip must never keep a silent worker, even when the clock steps back (NTP) between calls."""
    import random

    rng = random.Random(16)
    ledger = make(tmp_path, clock, lease_ttl_s=10)
    seen: dict[str, float] = {}  # the reference: last time each live worker was heard from
    for step in range(400):
        clock.now += rng.choice([-7.0, 0.5, 1.0, 3.0, 6.0, 11.0])
        deadline = clock.now - 10
        expected = sorted(w for w, t in seen.items() if t < deadline)
        assert sorted(ledger.expire()) == expected, f"step {step}"
        for w in expected:
            del seen[w]
        worker = f"w{rng.randrange(6)}"
        if worker in seen:
            ledger.heartbeat(worker, "", 0, 0, {})
        else:
            ledger.register(worker, GPU)
        seen[worker] = clock.now
    assert sorted(w.worker_id for w in ledger.resources()[0].workers) == sorted(seen)


def test_leases_survive_a_reopen_and_are_never_granted_twice(tmp_path, clock):
    ledger = make(tmp_path, clock)
    first = ledger.register("w1", GPU)
    kept = ledger.acquire("w1", "", "weights", 600 * MIB)
    gone = ledger.acquire("w1", "", "kv", 100 * MIB)
    ledger.release("w1", gone.lease_id)
    # No close: the first process "dies"; a second opens the same file.
    reopened = make(tmp_path, clock)
    assert [lease.lease_id for lease in reopened.leases_of("w1")] == [kept.lease_id]
    with pytest.raises(ResourceExhausted):
        reopened.acquire("w1", "", "kv", 401 * MIB)
    reg = reopened.register("w1", GPU, incarnation=first.incarnation)
    assert reg.incarnation == first.incarnation, "the incarnation must survive the restart"
    assert [lease.lease_id for lease in reg.leases] == [kept.lease_id], \
        "re-registration must keep the worker's leases"
    assert reg.device_budget_bytes == 1000 * MIB, "the device budget must survive the restart"


def test_registering_on_another_device_while_holding_leases_is_a_failed_precondition(
        tmp_path, clock):
    ledger = make(tmp_path, clock)
    token = ledger.register("w1", GPU).incarnation
    ledger.acquire("w1", "", "kv", MIB)
    with pytest.raises(FailedPrecondition):
        ledger.register("w1", DeviceSpec("GPU-2", 100 * MIB, 100 * MIB), incarnation=token)
    with pytest.raises(InvalidArgument):
        ledger.register("w1", DeviceSpec("GPU-3", 100 * MIB, 200 * MIB))


def test_unaccounted_is_device_truth_minus_reported_committed_context_included(tmp_path, clock):
    ledger = make(tmp_path, clock)
    ledger.register("w1", GPU)
    ledger.heartbeat("w1", "", 900 * MIB, 0,
                     {"context": (500 * MIB, 500 * MIB), "weights": (300 * MIB, 290 * MIB)})
    d = ledger.resources()[0]
    assert d.ledger_bytes == 800 * MIB, "the ledger must include the context zone"
    assert d.unaccounted_bytes == 100 * MIB
    assert {z.zone: z.committed_bytes for z in d.zones}["foreign"] == 100 * MIB


def test_a_growing_unaccounted_figure_raises_the_alert_and_a_spike_does_not(
        tmp_path, clock, caplog):
    ledger = make(tmp_path, clock, unaccounted_alert_bytes=100 * MIB)
    ledger.register("w1", GPU)
    report = {"context": (500 * MIB, 500 * MIB)}
    for used in (500, 500, 900, 500, 500):  # one spike: a race, not a leak
        clock.now += 1
        ledger.heartbeat("w1", "", used * MIB, 0, report)
    assert not ledger.resources()[0].unaccounted_alert, "a single spike must not alert"
    with caplog.at_level(logging.WARNING):
        for used in (650, 700, 750):
            clock.now += 1
            ledger.heartbeat("w1", "", used * MIB, 0, report)
    assert ledger.resources()[0].unaccounted_alert, "a sustained rise must raise the alert"
    assert ledger.counters["unaccounted_alerts"] == 1
    assert any("unaccounted" in r.getMessage() for r in caplog.records), "the alert must be logged"
