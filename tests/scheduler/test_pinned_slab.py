"""PinnedSlab (pinned_slab.py): the host KV tier's pinned chunks carved into block slots. A slot is
never handed out twice, a given-back slot is handed out again without pinning, the slab never
books more than the budget and books every byte it pins, a take the budget cannot hold is
refused with nothing booked, chunks go only when no slot of theirs is out. Sim backend (its
pinned memory is host memory; the free list, the booking and the threading are the product's)."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from gpu_worker.device.backend import DeviceError
from gpu_worker.engines.scheduler.kv_swap import HostKVBudget
from gpu_worker.engines.scheduler.pinned_slab import PinnedSlab
from tests.device.conftest import make_device

SLOT = 4096


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


def watch(dev) -> tuple[list[tuple[int, int]], list[int]]:
    """(thread id, bytes) of every pinned allocation, and the bytes of every free."""
    allocs: list[tuple[int, int]] = []
    frees: list[int] = []
    alloc, free = dev.alloc_pinned, dev.free_pinned
    dev.alloc_pinned = lambda n: (allocs.append((threading.get_ident(), n)), alloc(n))[1]
    dev.free_pinned = lambda buf: (frees.append(buf.nbytes), free(buf))[1]
    return allocs, frees


def test_a_slot_is_never_handed_out_twice_through_a_random_churn(dev):
    budget = HostKVBudget(40 * SLOT)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=8)
    rng = random.Random(26)
    out: list[list[int]] = []
    for _ in range(2000):
        if out and rng.random() < 0.45:
            slab.give(out.pop(rng.randrange(len(out))))
        else:
            got = slab.take(rng.randrange(1, 7))
            if got is not None:
                out.append(got)
        held = [s for slots in out for s in slots]
        assert len(held) == len(set(held)), f"a slot is out twice: {sorted(held)}"
        assert slab.free_slots + len(held) == slab.slots, "a slot is neither free nor out"
        assert budget.in_use == slab.nbytes <= budget.limit_bytes, \
            "the slab's chunks are not exactly what it books"
    for slots in out:
        slab.give(slots)
    assert slab.close() > 0 and budget.in_use == slab.nbytes == 0


def test_a_given_back_slot_is_handed_out_again_without_pinning_or_freeing(dev):
    budget = HostKVBudget(64 * SLOT)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=16)
    allocs, frees = watch(dev)
    first = slab.take(10)
    assert first == list(range(10)), "a fresh slab hands out its lowest slots, one run"
    assert [n for _, n in allocs] == [16 * SLOT], "one chunk pinned for the first take"
    for _ in range(50):         # a busy decoder's swaps: out and back, no driver call
        slab.give(first)
        first = slab.take(10)
    assert first == list(range(10)), "given-back slots come back lowest first"
    assert len(allocs) == 1 and frees == [], "the churn pinned or freed host memory"
    with pytest.raises(ValueError, match="not out"):
        slab.give([12])                         # free already
    with pytest.raises(ValueError, match="not out"):
        slab.give([999])                        # no chunk holds it
    slab.give(first)
    slab.close()
    assert budget.in_use == 0


def test_slots_keep_their_bytes_and_views_never_overlap(dev):
    budget = HostKVBudget(32 * SLOT)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=4)
    slots = slab.take(10)
    assert slots is not None
    for s in slots:
        slab.view(s, 1)[:] = s % 251
    run = slab.view(slots[0], 4)                # a whole chunk is one view
    assert run.nbytes == 4 * SLOT and slab.same_chunk(slots[0], slots[3])
    assert not slab.same_chunk(slots[3], slots[4]), "slot 4 starts the second chunk"
    for s in slots:
        assert np.all(slab.view(s, 1) == s % 251), f"slot {s} shares bytes with another"
    slab.give(slots)
    slab.close()


def test_the_slab_never_books_more_than_the_budget_and_grows_in_whole_chunks_cut_to_it(dev):
    budget = HostKVBudget(10 * SLOT)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=4)
    allocs, _ = watch(dev)
    a = slab.take(5)                            # two chunks: 8 slots
    assert a is not None and slab.slots == 8 and budget.in_use == 8 * SLOT
    b = slab.take(4)                            # 3 free, 1 missing: the last 2 the budget holds
    assert b is not None and slab.slots == 10 and budget.in_use == 10 * SLOT
    assert [n // SLOT for _, n in allocs] == [4, 4, 2]
    assert slab.take(2) is None, "over the budget"
    assert budget.in_use == slab.nbytes == budget.limit_bytes
    slab.give(a + b)
    slab.close()
    assert budget.in_use == 0


@pytest.mark.parametrize("booked_elsewhere", [0, 3, 7])
def test_a_take_is_refused_exactly_when_free_slots_and_the_budget_cannot_hold_it(
        dev, booked_elsewhere):
    """The rule the per-swap buffers had: a swap fits when the budget's free bytes plus this
    decoder's spare bytes hold it; refused, nothing is booked or pinned."""
    budget = HostKVBudget(12 * SLOT)
    assert budget.take(booked_elsewhere * SLOT)         # another decoder's swapped KV
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=4)
    held = slab.take(2)
    assert held is not None
    slab.give(held[:1])                                 # one free slot, one out
    for n in range(1, 14):
        fits = slab.free_bytes + budget.available() >= n * SLOT
        before, slots = budget.in_use, slab.slots
        got = slab.take(n)
        assert (got is not None) == fits, f"take({n}): fits {fits}, got {got}"
        if got is None:
            assert (budget.in_use, slab.slots) == (before, slots), "a refusal booked something"
        else:
            slab.give(got)
    slab.give(held[1:])
    slab.close()
    budget.give(booked_elsewhere * SLOT)
    assert budget.in_use == 0


def test_trim_frees_only_chunks_with_no_slot_out_and_keeps_keep_slots_free(dev):
    budget = HostKVBudget(64 * SLOT)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=4)
    slots = slab.take(16)                               # four chunks
    assert slots is not None
    slab.give(slots[:4] + slots[8:])                    # chunks 0, 2, 3 idle; one slot of 1 out
    slab.give(slots[4:7])
    assert slab.trim(5) == 2 * 4 * SLOT, "the newest idle chunks go while 5 stay free"
    assert slab.free_slots == 7 and slab.slots == 8     # chunk 0 idle, chunk 1 partly out
    assert slab.trim(0) == 4 * SLOT and slab.slots == 4, "only the chunk with a slot out stays"
    assert budget.in_use == slab.nbytes == 4 * SLOT
    assert slab.close() == 0, "a chunk with a slot out is never freed"
    slab.give(slots[7:8])
    assert slab.trim(0) == 4 * SLOT and budget.in_use == 0


def test_a_refused_pinned_allocation_gives_its_booking_back(dev):
    budget = HostKVBudget(16 * SLOT)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=4)
    alloc = dev.alloc_pinned
    calls = []

    def second_refused(n):
        calls.append(n)
        if len(calls) == 2:
            raise DeviceError("cuMemHostAlloc: out of memory (injected)")
        return alloc(n)
    dev.alloc_pinned = second_refused
    with pytest.raises(DeviceError, match="injected"):
        slab.take(6)                                    # two chunks wanted, the second refused
    assert slab.failures == 1 and slab.slots == 4, "the chunk pinned before stays, free"
    assert budget.in_use == slab.nbytes == 4 * SLOT, "the refused chunk's booking stayed"
    slab.close()
    assert budget.in_use == 0


def test_with_keep_the_slab_grows_ahead_on_its_own_thread_and_a_take_without_growth_never_pins(
        dev):
    budget = HostKVBudget(64 * SLOT)
    allocs, _ = watch(dev)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=4, keep=6)
    try:
        assert slab.take(1, grow=False) is None and slab.misses == 1, "nothing ahead yet: a miss"
        assert slab.wait_free(6, timeout_s=10), "the refill did not grow keep free slots"
        assert budget.in_use == slab.nbytes == 8 * SLOT, "two whole chunks, booked"
        taken = [slab.take(1, grow=False) for _ in range(5)]
        assert all(t is not None for t in taken)
        assert slab.wait_free(6, timeout_s=10), "taken slots were not replaced ahead"
        assert threading.get_ident() not in {t for t, _ in allocs}, \
            "a chunk was pinned on the caller's thread"
        for t in taken:
            slab.give(t)
    finally:
        slab.close()
    assert budget.in_use == 0


def test_the_refill_stops_at_the_budget(dev):
    budget = HostKVBudget(3 * SLOT)
    slab = PinnedSlab(dev, SLOT, budget, chunk_slots=4, keep=8)
    try:
        slab.start()
        assert not slab.wait_free(4, timeout_s=0.5), "pinned past the budget"
        assert slab.slots == 3 and budget.in_use == 3 * SLOT
    finally:
        slab.close()
    assert budget.in_use == 0


def test_keep_zero_starts_no_thread_and_bad_shapes_are_refused(dev):
    budget = HostKVBudget(8 * SLOT)
    before = threading.active_count()
    slab = PinnedSlab(dev, SLOT, budget)
    assert slab.take(1, grow=False) is None and threading.active_count() == before
    slab.close()
    for bad in ({"slot_bytes": 0}, {"chunk_slots": 0}, {"keep": -1}):
        with pytest.raises(ValueError, match="PinnedSlab"):
            PinnedSlab(dev, **{"slot_bytes": SLOT, "budget": budget, **bad})
    with pytest.raises(ValueError, match="at least one slot"):
        PinnedSlab(dev, SLOT, budget).take(0)
