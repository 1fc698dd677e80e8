"""PinnedBlocks (pinned_blocks.py): one-block pinned buffers pinned ahead on a thread of its
own, every ready byte booked, the refill bounded by `keep` and the budget, nothing left at close.
Sim backend (its pinned memory is host memory; the threading and the booking are the product's)."""
from __future__ import annotations

import threading

import pytest

from gpu_worker.device.backend import DeviceError
from gpu_worker.engines.scheduler.kv_swap import HostKVBudget
from gpu_worker.engines.scheduler.pinned_blocks import PinnedBlocks
from tests.device.conftest import make_device

BLOCK = 4096


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


def watch_allocs(dev) -> list[int]:
    """Thread ids of every pinned allocation."""
    seen: list[int] = []
    alloc = dev.alloc_pinned
    dev.alloc_pinned = lambda n: (seen.append(threading.get_ident()), alloc(n))[1]
    return seen


def test_take_never_pins_on_the_callers_thread_and_the_refill_books_what_it_pins(dev):
    budget = HostKVBudget(64 * BLOCK)
    blocks = PinnedBlocks(dev, BLOCK, budget, keep=4, cap=8)
    threads = watch_allocs(dev)
    try:
        assert blocks.take() is None, "nothing was pinned ahead yet: a miss, at once"
        assert blocks.wait_ready(4, timeout_s=10), "the refill did not pin keep buffers"
        assert threading.get_ident() not in threads, "a buffer was pinned on the caller's thread"
        assert budget.in_use == blocks.nbytes == 4 * BLOCK, "a ready buffer is not booked"
        host = blocks.take()
        assert host is not None and host.nbytes == BLOCK
        assert blocks.wait_ready(4, timeout_s=10), "a taken buffer was not replaced"
        assert budget.in_use == 5 * BLOCK, "the taken buffer must stay booked (its owner's now)"
        assert blocks.give(host)
        assert blocks.ready == 5 and budget.in_use == 5 * BLOCK
    finally:
        blocks.close()
    assert budget.in_use == 0 and blocks.ready == 0, "close left pinned bytes booked"


def test_the_refill_stops_at_the_budget_and_at_keep_and_give_stops_at_cap(dev):
    budget = HostKVBudget(3 * BLOCK)
    blocks = PinnedBlocks(dev, BLOCK, budget, keep=8, cap=8)
    try:
        blocks.take()
        assert not blocks.wait_ready(4, timeout_s=0.5), "pinned past the budget"
        assert blocks.ready == 3 and budget.in_use == 3 * BLOCK and blocks.allocated == 3
    finally:
        blocks.close()
    assert budget.in_use == 0
    spares = PinnedBlocks(dev, BLOCK, budget, keep=0, cap=1)
    assert spares.give(dev.alloc_pinned(BLOCK)) and budget.take(BLOCK)
    extra = dev.alloc_pinned(BLOCK)
    assert not spares.give(extra), "kept more than cap ready"
    dev.free_pinned(extra)
    spares.close()
    assert budget.in_use == 0


def test_a_refused_allocation_gives_its_booking_back(dev):
    budget = HostKVBudget(8 * BLOCK)
    blocks = PinnedBlocks(dev, BLOCK, budget, keep=2, cap=2)

    def refuse(n):
        raise DeviceError("cuMemHostAlloc: out of memory (injected)")
    dev.alloc_pinned = refuse
    try:
        blocks.take()
        for _ in range(200):
            if blocks.failures:
                break
            threading.Event().wait(0.01)
        assert blocks.failures >= 1 and blocks.ready == 0 and budget.in_use == 0
    finally:
        blocks.close()


def test_keep_zero_starts_no_thread_and_bad_bounds_are_refused(dev):
    budget = HostKVBudget(8 * BLOCK)
    blocks = PinnedBlocks(dev, BLOCK, budget, keep=0, cap=2)
    before = threading.active_count()
    assert blocks.take() is None and threading.active_count() == before
    blocks.close()
    with pytest.raises(ValueError, match="keep"):
        PinnedBlocks(dev, BLOCK, budget, keep=3, cap=2)


def test_start_pins_ahead_before_any_take(dev):
    """KVSwap starts the refill at the decoder's load: the first demotion finds buffers ready."""
    budget = HostKVBudget(64 * BLOCK)
    blocks = PinnedBlocks(dev, BLOCK, budget, keep=3, cap=3)
    blocks.start()
    try:
        assert blocks.wait_ready(3, timeout_s=10) and blocks.misses == 0
        taken = blocks.take()
        assert taken is not None
    finally:
        blocks.close()
    assert budget.in_use == BLOCK, "the taken buffer is its taker's to give back"
    dev.free_pinned(taken)
    budget.give(BLOCK)
