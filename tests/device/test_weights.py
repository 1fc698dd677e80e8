"""Stable-address weight slots: eviction, page-in, admission, state machine."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import gpu_worker.device.weights as weights_mod
from gpu_worker.device.arena import ALIGN
from gpu_worker.device.backend import DeviceError, i64, ptr
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tests.device.conftest import GATES, GRANULE, IMAGE, make_device


def _settle(d) -> None:
    d.synchronize()
    d.synchronize(d.copy_stream)
    d.arena.collect()


def _w(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_a_weight_keeps_its_address_across_eviction_and_a_graph_replays_the_new_pages(dev):
    n = 3 * GRANULE + 123
    slot = dev.weights.add("w", _w(n, 0))
    out = dev.arena.alloc(n, "activations")
    dev.weights.ensure_resident(["w"])
    fn = dev.get_function(dev.load_module(IMAGE), "copy_u8")
    with dev.capture() as cap:
        dev.launch(fn, (1,), (1,), [ptr(slot.va), ptr(out.ptr), i64(n)])
    va = slot.va
    dev.weights.evict("w")
    _settle(dev)
    assert dev.weights.get("w").state == "idle"
    with pytest.raises(Exception, match="unmapped"):
        dev.backend.view(va + GRANULE, 1)  # really unmapped, not just marked
    slot.host[:] = _w(n, 1)
    dev.weights.ensure_resident(["w"])
    assert slot.va == va, "a weight moved: captured graphs would read a stale address"
    dev.replay(cap.graph_exec)
    assert np.array_equal(dev.from_device(out.ptr, n), _w(n, 1)), "replay did not read the new pages"
    dev.destroy_graph_exec(cap.graph_exec)


def test_evicting_a_slot_while_a_kernel_still_reads_it_does_not_fault(dev):
    n = 2 * GRANULE
    slot = dev.weights.add("w", _w(n, 2))
    out = dev.arena.alloc(n, "activations")
    dev.weights.ensure_resident(["w"])
    fn = dev.get_function(dev.load_module(IMAGE), "wait_then_copy")
    GATES[21] = threading.Event()
    dev.launch(fn, (1,), (1,), [ptr(slot.va), ptr(out.ptr), i64(n), i64(21)])
    dev.weights.evict("w")
    dev.arena.collect()
    GATES[21].set()
    assert np.array_equal(dev.from_device(out.ptr, n), _w(n, 2)) and not dev.backend.faults


def test_slots_are_packed_so_admission_pays_shared_granules_once():
    d = make_device(weight_budget=8 * GRANULE)
    try:
        keys = [f"w{i}" for i in range(8)]
        for k in keys:
            d.weights.add(k, np.ones(GRANULE - 1000, np.uint8))  # just under a granule each
        d.weights.ensure_resident(keys)
        st = d.weights.stats()
        assert st["evictions"] == 0, "packed slots that fit the budget were evicted"
        assert st["committed_bytes"] <= 8 * GRANULE, "admission counted more than the granules"
        per_weight_rounding = 8 * GRANULE
        assert st["committed_bytes"] <= per_weight_rounding
    finally:
        d.close()


def test_admission_counts_committed_granule_bytes_and_evicts_to_fit():
    d = make_device(weight_budget=4 * GRANULE)
    try:
        for i in range(6):
            d.weights.add(f"w{i}", np.ones(GRANULE, np.uint8))
        for i in range(6):
            d.weights.ensure_resident([f"w{i}"])
            assert d.arena.zone_live_bytes("weights") <= 4 * GRANULE, "weights exceeded their budget"
        assert d.weights.stats()["evictions"] >= 2
    finally:
        d.close()


@pytest.mark.parametrize("limit", ["weight_budget", "ledger"])
def test_a_slot_its_owner_never_pages_back_is_never_evicted_for_another(limit):
    """Issue 11: a page-in that needs room evicts only evictable slots; otherwise it is refused,
    and the non-evictable slot stays mapped (its owner's next kernel would fault)."""
    d = make_device(weight_budget=2 * GRANULE if limit == "weight_budget" else None)
    try:
        d.weights.add("pinned", np.ones(GRANULE, np.uint8), evictable=False)
        d.weights.ensure_resident(["pinned"])
        if limit == "ledger":   # leave exactly one granule free in the whole budget
            budget = d.ledger.budget
            budget.budget_bytes = sum(budget.used().values()) + GRANULE
        d.weights.add("other", np.ones(2 * GRANULE, np.uint8))
        with pytest.raises(ResourceExhausted):
            d.weights.ensure_resident(["other"])
        assert d.weights.get("pinned").state in ("resident", "pending"), "the pinned slot lost its pages"
        assert d.weights.stats()["evictions"] == 0
    finally:
        d.close()


def test_a_page_in_that_cannot_fit_names_the_zone_and_changes_nothing():
    d = make_device(weight_budget=2 * GRANULE)
    try:
        d.weights.add("big", np.ones(5 * GRANULE, np.uint8))
        with pytest.raises(ResourceExhausted) as e:
            d.weights.ensure_resident(["big"])
        assert e.value.zone == "weights" and e.value.asked_bytes >= 5 * GRANULE
        assert d.weights.get("big").state == "idle" and d.arena.zone_live_bytes("weights") == 0
    finally:
        d.close()


def test_never_map_inside_a_capture(dev):
    dev.weights.add("w", np.ones(1000, np.uint8))
    with pytest.raises(FailedPrecondition, match="capture"), dev.capture():
        dev.weights.ensure_resident(["w"])
    assert dev.weights.get("w").state == "idle"


def test_a_failed_page_in_copy_poisons_the_slot_and_unmaps_it(dev):
    dev.weights.add("w", np.ones(2 * GRANULE, np.uint8))
    dev.backend.fail_next("copy_h2d_async")
    with pytest.raises(DeviceError):
        dev.weights.ensure_resident(["w"])
    _settle(dev)
    assert dev.weights.get("w").state == "poisoned"
    assert dev.arena.zone_live_bytes("weights") == 0, "a poisoned slot stayed mapped"
    with pytest.raises(FailedPrecondition, match="poisoned"):
        dev.weights.ensure_resident(["w"])
    dev.weights.remove("w")


def test_a_failed_release_poisons_the_slot(dev):
    dev.weights.add("w", np.ones(3 * GRANULE, np.uint8))
    dev.weights.ensure_resident(["w"])
    dev.backend.fail_next("unmap")
    dev.weights.evict("w")
    _settle(dev)
    assert dev.weights.get("w").state == "poisoned", "a quarantined slot can still be paged in"


def test_hits_misses_and_timing_counters(dev):
    dev.weights.add("a", np.ones(1000, np.uint8))
    dev.weights.ensure_resident(["a"])
    dev.weights.ensure_resident(["a"])
    st = dev.weights.stats()
    assert (st["page_ins"], st["hits"], st["bytes_copied"]) == (1, 1, 1000)
    assert st["hit_rate"] == 0.5 and st["driver_seconds"] >= 0 and st["bookkeeping_seconds"] >= 0


def test_bad_keys_are_rejected_and_change_nothing(dev):
    dev.weights.add("a", np.ones(10, np.uint8))
    with pytest.raises(InvalidArgument):
        dev.weights.add("a", np.ones(10, np.uint8))
    with pytest.raises(InvalidArgument):
        dev.weights.add("e", np.ones(0, np.uint8))
    with pytest.raises(NotFound):
        dev.weights.ensure_resident(["a", "missing"])
    assert dev.weights.get("a").state == "idle", "a rejected call paged in part of its keys"


def test_a_capture_using_resident_slots_never_deadlocks_with_a_page_in_on_another_thread(dev):
    dev.weights.add("r", np.ones(1000, np.uint8))
    dev.weights.add("x", np.ones(3 * GRANULE, np.uint8))
    dev.weights.ensure_resident(["r"])
    dev.synchronize(dev.copy_stream)   # r's page-in has landed: the captures find it resident
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                dev.weights.ensure_resident(["x"])
                dev.weights.evict("x")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(50):
            with dev.capture() as cap:
                dev.weights.ensure_resident(["r"])
            dev.destroy_graph_exec(cap.graph_exec)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive(), "deadlock between a capture and a page-in"
    assert not errors, f"page-in thread failed: {errors[:1]}"


def test_a_pinned_slot_is_never_a_victim_and_is_one_again_once_unpinned():
    """Issue 14: an owner launching on its slots pins them; another page-in needing room is
    refused rather than evict them, and takes them once they are unpinned."""
    d = make_device(weight_budget=2 * GRANULE)
    try:
        d.weights.add("running", _w(2 * GRANULE, 1))
        d.weights.add("other", _w(2 * GRANULE, 2))
        d.weights.pin(["running"])
        d.weights.ensure_resident(["running"])
        with pytest.raises(ResourceExhausted, match="pinned"):
            d.weights.ensure_resident(["other"])
        assert d.weights.get("running").state in ("resident", "pending")
        with pytest.raises(FailedPrecondition, match="in use"):
            d.weights.page_out(["running"])
        d.weights.unpin(["running"])
        d.weights.ensure_resident(["other"])
        assert d.weights.get("running").state == "idle", "the unpinned slot was not the victim"
        assert d.weights.resident_bytes(["running", "other"]) == 2 * GRANULE
        with pytest.raises(NotFound):
            d.weights.pin(["nope"])
    finally:
        d.close()


def test_the_pinned_host_budget_refuses_a_slot_before_allocating_anything():
    d = make_device()
    try:
        d.weights.host_budget_bytes = 3 * GRANULE
        d.weights.add("a", _w(2 * GRANULE, 1))
        calls = d.backend.calls["alloc_pinned"]
        with pytest.raises(ResourceExhausted, match="pinned host"):
            d.weights.add("b", _w(2 * GRANULE, 2))
        assert d.backend.calls["alloc_pinned"] == calls and d.weights.stats()["host_bytes"] == 2 * GRANULE
        d.weights.remove("a")
        d.weights.add("b", _w(2 * GRANULE, 2))   # the budget came back with the removal
    finally:
        d.close()


def test_the_budget_is_the_least_of_its_sources_and_a_shrink_pages_idle_weights_out():
    """Issue 14: `set_budget` per source (the flag, the governor's weights zone cap); the
    effective budget is the smaller. A shrink pages unpinned weights out at once and runs their
    releases (the ledger drops now); a pinned slot stays until `trim` after its unpin."""
    d = make_device(weight_budget=6 * GRANULE)
    try:
        for i in range(4):
            d.weights.add(f"w{i}", _w(GRANULE, i))
        d.weights.ensure_resident([f"w{i}" for i in range(4)])
        d.weights.pin(["w3"])
        assert d.weights.set_budget(8 * GRANULE, "governor") == 6 * GRANULE  # the flag is less
        assert d.weights.budget_source == "--weight-budget-bytes"
        assert d.arena.zone_live_bytes("weights") == 4 * GRANULE
        assert d.weights.set_budget(GRANULE, "governor") == GRANULE          # now the grant is
        assert d.weights.budget_source == "the governor's weights zone cap"
        states = [d.weights.get(f"w{i}").state for i in range(4)]
        assert states[:3] == ["idle"] * 3 and states[3] in ("pending", "resident"), states
        assert d.ledger.snapshot()["weights"][0] == GRANULE, "the releases did not run"
        d.weights.set_budget(None, "governor")
        assert d.weights.budget_bytes == 6 * GRANULE and d.weights.stats()["budget_bytes"] == \
            6 * GRANULE
        d.weights.ensure_resident(["w0", "w1"])
        d.weights.set_budget(GRANULE, "flag")      # shrinks under the pinned w3 again
        assert d.arena.zone_live_bytes("weights") == GRANULE
        d.weights.unpin(["w3"])
        assert d.weights.trim() == 0, "w3 is the only slot and fits the budget"
        d.weights.set_budget(None, "flag")
        assert d.weights.budget_bytes is None and d.weights.trim() == 0
    finally:
        d.close()


@pytest.mark.parametrize("args", [(0, "flag"), (-1, "governor"), (GRANULE, "nonsense")])
def test_a_bad_budget_is_rejected_and_changes_nothing(args):
    d = make_device(weight_budget=4 * GRANULE)
    try:
        with pytest.raises(InvalidArgument):
            d.weights.set_budget(*args)
        assert d.weights.budget_bytes == 4 * GRANULE
        assert d.weights.limits() == {"flag": 4 * GRANULE, "governor": None}
    finally:
        d.close()


# -- slots that hold several weights (a layer) --------------------------------------------------
def _layer() -> list[tuple[str, np.ndarray]]:
    return [("l.norm", _w(1000, 3)), ("l.w", _w(GRANULE + 77, 4)), ("l.b", _w(5, 5))]


def test_a_strided_view_is_stored_as_its_bytes_in_c_order_without_touching_its_base(dev):
    """add_group copies a view (the executor's tile-layout permutation) once, into the pinned
    buffer: the device holds the view's C-order bytes, and the array it views is unchanged."""
    base = np.arange(64 * 96, dtype=np.uint16).reshape(64, 96)
    before = base.copy()
    view = base.view(np.uint64).reshape(4, 16, 24).transpose(2, 0, 1)[:, ::-1]
    assert not view.flags.c_contiguous
    dev.weights.add_group("v", [("v.w", view)])
    dev.weights.ensure_resident(["v.w"])
    va, n = dev.weights.tensor("v.w")
    assert n == view.nbytes
    assert np.array_equal(dev.from_device(va, n), np.ascontiguousarray(view).view(np.uint8).reshape(-1))
    assert np.array_equal(base, before)


def test_a_big_view_is_copied_in_row_ranges_on_the_copiers_threads_to_the_same_bytes(dev,
                                                                                 monkeypatch):
    """The host copy of a big tensor is split across the copier's threads (it is the load's
    consumer); the stored bytes are the view's C-order bytes, as one copy would write them."""
    monkeypatch.setattr(weights_mod, "COPY_SPLIT_BYTES", 1 << 16)
    dev.weights.copier = weights_mod.HostCopier(threads=3)
    base = np.arange(256 * 512, dtype=np.uint32).reshape(256, 512)
    view = base.view(np.uint64).reshape(16, 16, 256).transpose(1, 0, 2)[:, ::-1]   # strided
    seen: list[tuple[str, int]] = []
    real = np.copyto

    def copyto(dst, src):
        seen.append((threading.current_thread().name, src.nbytes))
        real(dst, src)
    monkeypatch.setattr(weights_mod.np, "copyto", copyto)
    dev.weights.add_group("big", [("big.w", view), ("big.n", _w(100, 6))])
    monkeypatch.setattr(weights_mod.np, "copyto", real)
    dev.weights.ensure_resident(["big.w"])
    va, n = dev.weights.tensor("big.w")
    assert np.array_equal(dev.from_device(va, n), np.ascontiguousarray(view).view(np.uint8).reshape(-1))
    ranges = sorted(n for _, n in seen if n != 100)      # big.n: 100 bytes, one copy
    assert len(ranges) == 3 and sum(ranges) == view.nbytes, ranges   # one range a thread
    assert all(t.startswith("weight-copy") for t, _ in seen)          # on the copier's pool
    dev.weights.copier.close()


def test_a_group_slot_pages_in_by_one_copy_and_keeps_each_weight_at_an_aligned_offset(
        dev, monkeypatch):
    parts = _layer()
    slot = dev.weights.add_group("l", parts)
    copies: list[tuple[int, int]] = []
    copy = dev.backend.copy_h2d_async
    monkeypatch.setattr(dev.backend, "copy_h2d_async", lambda dst, src, stream: (
        copies.append((int(dst), int(src.nbytes))), copy(dst, src, stream)))
    dev.weights.ensure_resident(["l.w"])   # any weight of the slot pages in all of it
    assert copies == [(slot.va, slot.nbytes)], "a group page-in was not one copy of its range"
    assert dev.weights.stats()["page_ins"] == 1 and dev.weights.get("l.b").state != "idle"
    for key, data in parts:
        va, n = dev.weights.tensor(key)
        assert (va - slot.va) % ALIGN == 0 and n == data.nbytes
        assert slot.va <= va and va + n <= slot.va + slot.nbytes
        assert np.array_equal(dev.from_device(va, n), data), f"{key} read the wrong bytes"
    before = {key: dev.weights.tensor(key) for key, _ in parts}
    dev.weights.evict("l.norm")
    _settle(dev)
    assert dev.weights.get("l").state == "idle", "evicting one weight left its slot mapped"
    dev.weights.ensure_resident(["l.b"])
    assert {key: dev.weights.tensor(key) for key, _ in parts} == before, "a weight moved"
    assert np.array_equal(dev.from_device(*dev.weights.tensor("l.w")), parts[1][1])


def test_pinning_a_group_through_several_of_its_weights_pins_it_once(dev):
    dev.weights.add_group("l", _layer())
    dev.weights.pin(["l.norm", "l.w", "l"])
    assert dev.weights.get("l").pins == 1
    with pytest.raises(FailedPrecondition, match="pinned"):
        dev.weights.page_out(["l.b"])
    dev.weights.unpin(["l.norm", "l.w", "l"])
    assert dev.weights.get("l").pins == 0


def test_removing_a_group_forgets_every_weight_in_it_and_its_name_and_keys_are_unique(dev):
    dev.weights.add_group("l", _layer())
    with pytest.raises(InvalidArgument, match="already has a slot"):
        dev.weights.add("l.w", _w(10, 1))
    with pytest.raises(InvalidArgument, match="twice"):
        dev.weights.add_group("m", [("m.a", _w(10, 1)), ("m.a", _w(10, 2))])
    dev.weights.ensure_resident(["l"])
    dev.weights.remove("l.w")
    for key in ("l", "l.norm", "l.w", "l.b"):
        with pytest.raises(NotFound):
            dev.weights.get(key)
    assert dev.weights.stats()["host_bytes"] == 0 and dev.weights.stats()["slots"] == 0
    dev.weights.add_group("l", _layer())   # its names are free again


def test_the_pinned_host_budget_refuses_a_group_as_one_buffer_before_allocating_anything():
    d = make_device()
    try:
        parts = _layer()
        total = d.weights.add_group("l", parts).nbytes
        d.weights.remove("l")
        d.weights.host_budget_bytes = total - 1   # every weight alone would fit
        calls = d.backend.calls["alloc_pinned"]
        with pytest.raises(ResourceExhausted, match="pinned host"):
            d.weights.add_group("l", parts)
        assert d.backend.calls["alloc_pinned"] == calls and d.weights.stats()["host_bytes"] == 0
        with pytest.raises(NotFound):
            d.weights.get("l.norm")
    finally:
        d.close()
