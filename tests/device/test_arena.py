"""The VMM arena: packing, fenced release, admission, unwinding, quarantine, pooling."""
from __future__ import annotations

import threading

import pytest

from gpu_worker.device.backend import DeviceError, i64, ptr
from services.common.errors import InvalidArgument, ResourceExhausted
from tests.device.conftest import GATES, GRANULE, IMAGE, make_device
from tests.polling import eventually


def _settle(d) -> None:
    d.synchronize()
    d.synchronize(d.copy_stream)
    d.arena.collect()


def test_small_allocations_share_granules_so_waste_is_at_most_one_granule(dev):
    allocs = [dev.arena.alloc(1000 + i, "scratch") for i in range(200)]
    content = sum(a.size for a in allocs)
    committed = dev.ledger.snapshot()["scratch"][0]
    assert committed - content < 2 * GRANULE, (
        f"waste {committed - content} bytes for 200 small allocations: granules are not shared")
    assert len({a.ptr for a in allocs}) == 200 and all(a.ptr % 256 == 0 for a in allocs)


def test_a_granule_stays_committed_while_any_allocation_touches_it(dev):
    a = dev.arena.alloc(1000, "scratch")
    b = dev.arena.alloc(1000, "scratch")
    dev.arena.free(a)
    _settle(dev)
    assert dev.arena.stats()["mapped"] == GRANULE, "a granule shared with a live allocation was unmapped"
    dev.to_device(b.ptr, bytes_of(1000))  # still mapped: no IllegalAddress
    dev.arena.free(b)


def test_releasing_bytes_are_the_mappings_whose_fenced_release_is_queued(dev):
    """The reclaimer counts queued releases by these bytes (not as unbounded): they must be
    exactly the mappings on their way out, and zero once the queue ran."""
    fn = dev.get_function(dev.load_module(IMAGE), "wait_then_copy")
    src = dev.arena.alloc(4 * GRANULE, "activations")
    dst = dev.arena.alloc(4 * GRANULE, "activations")
    GATES[8] = threading.Event()
    dev.launch(fn, (1,), (1,), [ptr(src.ptr), ptr(dst.ptr), i64(4 * GRANULE), i64(8)])
    assert dev.arena.releasing_bytes() == 0
    dev.arena.free(src)
    dev.arena.collect()
    assert dev.arena.releasing_bytes() == 4 * GRANULE, "the fenced release is not counted"
    GATES[8].set()
    _settle(dev)
    eventually(lambda: dev.arena.collect() >= 0 and dev.arena.releasing_bytes() == 0,
               timeout=5.0, what="the release to run and stop counting")
    dev.arena.free(dst)


def bytes_of(n: int):
    import numpy as np

    return np.arange(n, dtype=np.uint8)


def test_a_free_is_fenced_until_the_streams_have_passed_it(dev):
    fn = dev.get_function(dev.load_module(IMAGE), "wait_then_copy")
    src = dev.arena.alloc(4 * GRANULE, "activations")
    dst = dev.arena.alloc(4 * GRANULE, "activations")
    dev.to_device(src.ptr, bytes_of(4 * GRANULE))
    GATES[7] = threading.Event()
    dev.launch(fn, (1,), (1,), [ptr(src.ptr), ptr(dst.ptr), i64(4 * GRANULE), i64(7)])
    dev.arena.free(src)
    dev.arena.collect()
    assert dev.queue.pending() > 0, "the release ran while a kernel still reads the range"
    GATES[7].set()
    got = dev.from_device(dst.ptr, 4 * GRANULE)
    assert (got == bytes_of(4 * GRANULE)).all() and not dev.backend.faults, "the kernel faulted"
    # The copy synchronized only the stream it ran on; under load the kernel's own stream may
    # pass the fence a moment later, so poll instead of checking once.
    eventually(lambda: dev.arena.collect() >= 0 and dev.queue.pending() == 0, timeout=5.0,
               what="the fenced release to run after the kernel finished")
    dev.arena.free(dst)


def test_without_the_fence_the_same_free_faults_negative_control():
    dev = make_device()
    fn = dev.get_function(dev.load_module(IMAGE), "wait_then_copy")
    src = dev.arena.alloc(4 * GRANULE, "activations")
    dst = dev.arena.alloc(4 * GRANULE, "activations")
    GATES[8] = threading.Event()
    dev.launch(fn, (1,), (1,), [ptr(src.ptr), ptr(dst.ptr), i64(4 * GRANULE), i64(8)])
    dev.arena.free(src, fence_streams=[])  # no stream fenced: released at the next poll
    dev.arena.collect()
    GATES[8].set()
    with pytest.raises(Exception, match="unmapped"):
        dev.synchronize()
    assert dev.backend.faults, "an unfenced unmap under a running kernel must fault"
    dev.backend.fault = None  # the sim's "context" is lost; reset it only to tear the test down
    dev.close()


def test_an_out_of_budget_allocation_names_zone_asked_free_and_maps_nothing():
    from gpu_worker.device.ledger import local_budget

    d = make_device(budget=local_budget((16 << 20) + 8 * GRANULE))  # context (16 MiB) + 8 granules
    try:
        calls = d.backend.calls["map"]
        before = d.ledger.snapshot()
        with pytest.raises(ResourceExhausted) as e:
            d.arena.alloc(20 * GRANULE, "kv", role="kv")
        assert e.value.zone == "kv" and e.value.asked_bytes == 20 * GRANULE and e.value.free_bytes \
            == 8 * GRANULE, f"refusal lacks zone/asked/free: {e.value.details}"
        assert "kv" in str(e.value) and d.backend.calls["map"] == calls, "a refused allocation mapped"
        assert d.ledger.snapshot() == before and d.arena.stats()["live_allocations"] == 0
        d.arena.alloc(8 * GRANULE, "kv", role="kv")  # the carve was given back: this fits
    finally:
        d.close()


def test_a_driver_failure_mid_commit_unwinds_every_handle_and_the_booking(dev):
    free0, _ = dev.backend.mem_get_info()
    dev.backend.fail_next("map", None)
    before = dev.ledger.snapshot()
    with pytest.raises(DeviceError):
        dev.arena.alloc(3 * GRANULE + 5, "workspace")
    assert dev.backend.mem_get_info()[0] == free0, "a failed commit left physical memory behind"
    assert dev.ledger.snapshot() == before, "a failed commit left bytes booked"


def test_a_release_that_fails_is_quarantined_and_its_range_never_reused(dev):
    a = dev.arena.alloc(2 * GRANULE, "scratch", role="kv")
    dev.backend.fail_next("unmap", None)
    dev.arena.free(a)
    _settle(dev)
    assert dev.queue.stats.quarantined == 1 and dev.arena.counters["quarantined"] == 1
    for _ in range(20):
        b = dev.arena.alloc(2 * GRANULE, "scratch", role="kv")
        assert not (b.ptr < a.ptr + a.size and a.ptr < b.ptr + b.size), "quarantined range reused"


def test_a_commit_resurrects_a_range_whose_release_is_still_queued(dev):
    fn = dev.get_function(dev.load_module(IMAGE), "wait_then_copy")
    other = dev.arena.alloc(GRANULE, "activations")
    a = dev.arena.alloc(4 * GRANULE, "weights", role="weights")
    GATES[9] = threading.Event()
    dev.launch(fn, (1,), (1,), [ptr(other.ptr), ptr(other.ptr), i64(1), i64(9)])  # holds the fence
    dev.arena.decommit(a.ptr, a.size, "weights")
    creates = dev.backend.calls["create_physical"]
    dev.arena.commit(a.ptr, a.size, "weights")
    assert dev.arena.counters["resurrected"] >= 1, "the queued release was not cancelled"
    assert dev.backend.calls["create_physical"] == creates, "a resurrected range was re-created"
    GATES[9].set()
    _settle(dev)
    dev.to_device(a.ptr, bytes_of(16))  # still mapped: the cancelled release did not unmap it
    dev.arena.free(a)
    dev.arena.free(other)


def test_weights_get_one_large_handle_and_small_roles_granule_handles(dev):
    creates = dev.backend.calls["create_physical"]
    dev.arena.alloc(16 * GRANULE, "weights", role="weights")
    assert dev.backend.calls["create_physical"] - creates == 1, "weights split into many handles"
    creates = dev.backend.calls["create_physical"]
    dev.arena.alloc(4 * GRANULE, "scratch")
    assert dev.backend.calls["create_physical"] - creates == 4


def test_the_handle_pool_is_bounded_and_reused(dev):
    dev.arena._pool_limit = 3 * GRANULE
    allocs = [dev.arena.alloc(GRANULE, "scratch") for _ in range(6)]
    for a in allocs:
        dev.arena.free(a)
    _settle(dev)
    assert dev.arena.counters["pooled_bytes"] == 3 * GRANULE, "the pool grew past its bound"
    creates = dev.backend.calls["create_physical"]
    dev.arena.alloc(2 * GRANULE, "scratch")
    assert dev.backend.calls["create_physical"] == creates and dev.arena.counters["handles_reused"] >= 2
    assert dev.unaccounted_bytes() == 0, "pooled handles escaped the ledger"


@pytest.mark.parametrize("call", [
    lambda a: a.alloc(0, "scratch"),
    lambda a: a.alloc(-5, "scratch"),
    lambda a: a.alloc(100, "nonsense"),
    lambda a: a.free(type("X", (), {"ptr": 1234, "size": 1, "zone": "kv"})()),
])
def test_bad_input_is_rejected_and_changes_nothing(dev, call):
    before = (dev.ledger.snapshot(), dev.arena.stats()["committed"], dev.backend.calls["map"])
    with pytest.raises(InvalidArgument):
        call(dev.arena)
    assert (dev.ledger.snapshot(), dev.arena.stats()["committed"], dev.backend.calls["map"]) == before


def test_a_double_free_is_rejected(dev):
    a = dev.arena.alloc(100, "scratch")
    dev.arena.free(a)
    with pytest.raises(InvalidArgument, match="double free"):
        dev.arena.free(a)
    assert dev.arena.counters["fault_underflow"] == 0
