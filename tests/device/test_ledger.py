"""The ledger books committed bytes through the budget owner before the device is touched."""
from __future__ import annotations

import pytest

from gpu_worker.device.ledger import ZONES, Ledger, local_budget
from services.common.errors import InvalidArgument, ResourceExhausted


@pytest.mark.parametrize("make", [local_budget])
def test_a_refused_commit_books_nothing(make):
    led = Ledger(make(1000))
    led.commit("kv", 600)
    with pytest.raises(ResourceExhausted) as e:
        led.commit("weights", 500)
    assert (e.value.zone, e.value.asked_bytes, e.value.free_bytes) == ("weights", 500, 400)
    assert led.snapshot()["weights"] == (0, 0) and led.total_committed() == 600


def test_underflow_is_counted_clamped_and_never_negative():
    led = Ledger(local_budget(1000))
    led.commit("kv", 100)
    led.uncommit("kv", 150)
    led.remove_content("kv", 5)
    assert led.fault_underflow == 2, "releasing more than was booked must count as a fault"
    assert led.snapshot()["kv"] == (0, 0)


def test_unknown_zones_are_rejected():
    led = Ledger(local_budget(1000))
    with pytest.raises(InvalidArgument, match="zone"):
        led.commit("foreign", 1)
    assert set(led.snapshot()) == set(ZONES)


def test_report_hands_zones_and_device_truth_to_the_budget_owner():
    budget = local_budget(1000)
    led = Ledger(budget)
    led.commit("graphs", 10)
    led.add_content("graphs", 7)
    led.report(500, 400)
    zones, used, proc = budget.last_report
    assert zones["graphs"] == (10, 7) and (used, proc) == (500, 400)
