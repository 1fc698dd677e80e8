"""The Device facade: every synchronizing call gated, captures always ended, every byte booked."""
from __future__ import annotations

import contextlib
import importlib
import sys
import threading

import numpy as np
import pytest

from gpu_worker.device import Device, open_device
from gpu_worker.device.backend import CaptureInvalidated, DeviceError, i64, ptr
from gpu_worker.device.gate import CaptureGate
from gpu_worker.device.sim_backend import SimBackend
from services.common.errors import InvalidArgument
from tests.device.conftest import GRANULE, IMAGE, make_device


def _workload(d: Device, rounds: int = 20) -> None:
    fn = d.get_function(d.load_module(IMAGE), "add_one")
    for i in range(rounds):
        a = d.arena.alloc((i + 1) * 1000, "scratch")
        d.launch(fn, (1,), (1,), [ptr(a.ptr), i64(a.size)])
        d.synchronize_device()
        d.arena.free(a)


def _capture_while_others_sync(d: Device, captures: int, threads: int) -> int:
    fn = d.get_function(d.load_module(IMAGE), "add_one")
    buf = d.arena.alloc(4096, "activations")
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                _workload(d, 2)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=churn) for _ in range(threads)]
    for t in ts:
        t.start()
    invalid = 0
    try:
        for _ in range(captures):
            try:
                with d.capture() as cap:
                    d.launch(fn, (1,), (1,), [ptr(buf.ptr), i64(4096)])
                d.destroy_graph_exec(cap.graph_exec)
            except CaptureInvalidated:
                invalid += 1
    finally:
        stop.set()
        for t in ts:
            t.join(10)
    assert not errors, f"synchronizing threads failed: {errors[:2]}"
    d.arena.free(buf)
    return invalid


def test_gate_on_no_capture_is_invalidated_by_threads_synchronizing_through_the_device():
    d = make_device()
    try:
        invalid = _capture_while_others_sync(d, captures=100, threads=4)
        assert invalid == 0 and d.backend.invalidations == 0, f"{invalid} captures invalidated"
        assert d.gate.stats.writer_waits > 0 or d.gate.stats.shared_sections > 100, \
            "the threads never contended with the captures: the test proves nothing"
    finally:
        d.close()


def _sync_expecting_refusal(d: Device) -> None:
    with contextlib.suppress(DeviceError):  # the H200 refuses the sync too (docs/device.md)
        d.synchronize_device()


def test_gate_off_another_threads_sync_invalidates_the_capture_negative_control():
    d = make_device(gate=CaptureGate(enabled=False))
    try:
        fn = d.get_function(d.load_module(IMAGE), "add_one")
        buf = d.arena.alloc(4096, "activations")
        with pytest.raises(CaptureInvalidated), d.capture():
            d.launch(fn, (1,), (1,), [ptr(buf.ptr), i64(4096)])
            t = threading.Thread(target=_sync_expecting_refusal, args=(d,))
            t.start()
            t.join(5)
        assert d.backend.invalidation_causes["synchronize_context"] == 1
        assert d.capture_invalidations == 1, "the failed end-capture was not counted by the device"
        d.arena.free(buf)
    finally:
        d.close()


def test_every_synchronizing_backend_call_goes_through_the_gate(dev):
    _workload(dev)
    dev.weights.add("w", np.arange(200_000, dtype=np.uint32))
    dev.weights.ensure_resident(["w"])
    with dev.capture() as cap:
        a = dev.arena.alloc(1000, "scratch")  # the capturing thread may allocate
    dev.arena.free(a)
    dev.replay(cap.graph_exec)
    dev.destroy_graph_exec(cap.graph_exec)
    dev.weights.evict("w")
    b = dev.arena.alloc(64, "scratch")
    dev.to_device(b.ptr, np.arange(64, dtype=np.uint8))
    assert list(dev.from_device(b.ptr, 4)) == [0, 1, 2, 3]
    dev.synchronize()
    dev.arena.collect()
    dev.weights.remove("w")
    assert sum(dev.backend.calls[c] for c in ("map", "unmap", "synchronize_context")) > 0
    assert not dev.backend.ungated_calls, f"ungated synchronizing calls: {dict(dev.backend.ungated_calls)}"


def test_a_capture_whose_body_fails_is_still_ended_and_books_nothing(dev):
    before = dev.ledger.snapshot()["graphs"]
    with pytest.raises(RuntimeError, match="body failed"), dev.capture():
        raise RuntimeError("capture body failed")
    assert not dev.backend.is_capturing(dev.stream), "a failed capture left the stream capturing"
    assert dev.gate.capturing_thread() is None, "a failed capture kept the gate"
    assert dev.ledger.snapshot()["graphs"] == before


def test_graph_memory_is_measured_and_booked_in_the_graphs_zone(dev):
    fn = dev.get_function(dev.load_module(IMAGE), "add_one")
    a = dev.arena.alloc(4096, "activations")
    with dev.capture() as cap:
        dev.launch(fn, (1,), (1,), [ptr(a.ptr), i64(4096)])
    assert cap.graph_bytes > 0, "the sim's graph memory was not measured"
    assert dev.ledger.snapshot()["graphs"] == (cap.graph_bytes, cap.graph_bytes)
    dev.destroy_graph_exec(cap.graph_exec)
    assert dev.ledger.snapshot()["graphs"] == (0, 0)
    dev.arena.free(a)


def test_the_ledger_explains_every_device_byte_after_a_mixed_workload(dev):
    _workload(dev)
    for i in range(5):
        dev.weights.add(f"w{i}", np.full(100_000 + i * 777, i, np.uint8))
    dev.weights.ensure_resident([f"w{i}" for i in range(5)])
    kept = [dev.arena.alloc(50_000 * (i + 1), "kv", role="kv") for i in range(3)]
    dev.weights.evict("w2")
    with dev.capture() as cap:
        pass
    assert dev.unaccounted_bytes() == 0, "device bytes the ledger does not explain"
    dev.synchronize()
    dev.synchronize(dev.copy_stream)
    dev.arena.collect()
    assert dev.unaccounted_bytes() == 0, "unaccounted bytes after releases ran"
    dev.destroy_graph_exec(cap.graph_exec)
    for a in kept:
        dev.arena.free(a)
    assert dev.stats()["fault_underflow"] == 0


class _NeighbourBackend(SimBackend):
    """A sim device shared with another process that allocates `step` bytes at each of its
    first `moves` device reads, between that read and the NVML query after it (the race of
    GPU tests run in parallel processes)."""

    def __init__(self, step: int, moves: int, **kw) -> None:
        super().__init__(**kw)
        self.neighbour, self.step, self.moves = 0, step, moves

    def mem_get_info(self) -> tuple[int, int]:
        free, total = super().mem_get_info()
        free -= self.neighbour                       # the device sees the neighbour's bytes...
        if self.moves > 0:
            self.moves -= 1
            self.neighbour += self.step              # ...and it allocates right after this read
        return free, total

    def others_used_bytes(self) -> int:
        return self.neighbour


def _beside(neighbour: _NeighbourBackend) -> Device:
    return Device(neighbour, reserve_bytes=256 << 20, gate=CaptureGate(), report_interval_s=0)


def test_a_neighbour_allocating_between_the_two_reads_is_not_counted_as_ours() -> None:
    backend = _NeighbourBackend(step=64 * GRANULE, moves=4, total_bytes=256 << 20,
                                granule_bytes=GRANULE, context_bytes=16 << 20)
    d = _beside(backend)   # the context baseline is read while the neighbour moves, too
    try:
        assert d.ledger.snapshot()["context"][0] == 16 << 20, "the neighbour's bytes were booked"
        d.arena.alloc(GRANULE, "kv")
        assert d.unaccounted_bytes() == 0, "the neighbour's moving bytes were counted as ours"
        assert backend.moves == 0, "the readings did not see the neighbour move"
        assert d.bookkeeping_faults() == 0
        assert d.used_and_others()[1] == backend.neighbour == 4 * 64 * GRANULE
    finally:
        d.close()


def test_what_a_module_load_and_a_capture_book_leaves_out_the_neighbours_bytes() -> None:
    backend = _NeighbourBackend(step=64 * GRANULE, moves=0, total_bytes=256 << 20,
                                granule_bytes=GRANULE, context_bytes=16 << 20)
    d = _beside(backend)
    try:
        backend.moves = 3                    # settled by the 4th reading of its 4 attempts
        d.load_module(IMAGE)                 # the sim's module takes no device memory
        assert d.ledger.snapshot()["context"][0] == 16 << 20
        backend.moves = 3
        with d.capture() as cap:
            pass
        assert cap.graph_bytes < 64 * GRANULE, "the neighbour's allocation was booked as graphs"
        assert d.unaccounted_bytes() == 0
        d.destroy_graph_exec(cap.graph_exec)
    finally:
        d.close()


def test_a_neighbour_that_never_settles_gives_up_after_the_attempts() -> None:
    backend = _NeighbourBackend(step=GRANULE, moves=100, total_bytes=256 << 20,
                                granule_bytes=GRANULE, context_bytes=16 << 20)
    d = _beside(backend)
    try:
        moves = backend.moves
        d.used_and_others(attempts=3)
        assert moves - backend.moves == 3, "the reading did not stop after its attempts"
    finally:
        d.close()


def test_truth_is_reported_to_the_budget_owner_with_the_zones(dev):
    dev.arena.alloc(GRANULE, "kv")
    dev.report()
    zones, used, proc = dev.ledger.budget.last_report
    assert zones["kv"][0] == GRANULE and used == dev.truth()[0] and proc > 0


def test_open_device_auto_falls_back_to_sim_without_a_cuda_device():
    from tests.conftest import cuda_device_present

    if cuda_device_present():
        pytest.skip("a CUDA device is present")
    d = open_device("auto")
    try:
        assert d.backend.name == "sim"
    finally:
        d.close()
    with pytest.raises(Exception, match="backend must be"):
        open_device("tpu")


def test_importing_the_cuda_backend_never_touches_the_driver():
    sys.modules.pop("gpu_worker.device.cuda_backend", None)
    mod = importlib.import_module("gpu_worker.device.cuda_backend")
    assert mod._driver is None, "importing cuda_backend loaded the driver"


def test_the_public_surface_of_interface_3_is_pinned():
    from gpu_worker import device
    from gpu_worker.device import backend, sim_kernels

    for name in ("open_device", "Device"):
        assert hasattr(device, name), name
    for name in ("ptr", "i32", "i64", "f32", "KernelArg"):
        assert hasattr(backend, name), name
    assert hasattr(sim_kernels, "register_sim_kernel")
    for attr in ("load_module", "get_function", "launch", "capture", "replay", "destroy_graph_exec",
                 "synchronize", "to_device", "from_device", "truth", "close"):
        assert callable(getattr(Device, attr)), attr


def test_no_code_outside_the_device_package_calls_a_synchronizing_backend_method():
    """Wrapper audit: only gpu_worker.device may reach a Backend; everyone else goes via Device."""
    import re
    from pathlib import Path

    from gpu_worker.device.sim_backend import SYNCHRONIZING

    root = Path(__file__).resolve().parents[2]
    names = "|".join(sorted(SYNCHRONIZING))
    pattern = re.compile(rf"\.backend\.({names})\(|cuCtxSynchronize|cudaDeviceSynchronize|"
                         r"cuda\.Device\(\)\.synchronize|runtime\.deviceSynchronize")
    offenders = []
    for top in ("gpu_worker", "services", "cache_service"):
        for path in (root / top).rglob("*.py"):
            if "gpu_worker/device/" in path.as_posix():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "synchronizing calls that bypass the capture gate:\n" + "\n".join(offenders)


def test_zones_and_device_truth_reach_the_budget_owner_periodically():
    from gpu_worker.device.ledger import local_budget
    from tests.polling import wait_until

    budget = local_budget(1 << 30)
    d = make_device(budget=budget, report_interval_s=0.01)
    try:
        d.arena.alloc(GRANULE, "kv")
        assert wait_until(lambda: budget.last_report[0].get("kv", (0, 0))[0] == GRANULE), \
            "the ledger never reached the budget owner without an explicit report()"
        assert budget.last_report[1] == d.truth()[0]
    finally:
        d.close()


def test_a_cluster_launch_must_tile_the_grid_and_fit_the_device() -> None:
    d = make_device()
    try:
        fn = d.get_function(d.load_module(IMAGE), "add_one")
        buf = d.arena.alloc(4096, "scratch")
        args = [ptr(buf.ptr), i64(buf.size)]
        with pytest.raises(ValueError, match="whole number of clusters"):
            d.launch(fn, (6, 1, 1), (1, 1, 1), args, cluster=(4, 1, 1))
        with pytest.raises(DeviceError, match="CLUSTER"):
            d.launch(fn, (32, 1, 1), (1, 1, 1), args, cluster=(32, 1, 1))
        with pytest.raises(DeviceError, match="shared memory"):
            d.launch(fn, (1, 1, 1), (1, 1, 1), args, shared_bytes=228 << 10)
        d.launch(fn, (8, 1, 1), (1, 1, 1), args, shared_bytes=120 << 10, cluster=(8, 1, 1))
        d.synchronize_device()
    finally:
        d.close()


def test_another_threads_launch_on_the_default_stream_runs_while_a_capture_is_open(dev):
    fn = dev.get_function(dev.load_module(IMAGE), "add_one")
    mine, theirs = dev.arena.alloc(4096, "activations"), dev.arena.alloc(4096, "activations")
    dev.to_device(theirs.ptr, np.zeros(4096, np.uint8))
    opened, launched = threading.Event(), threading.Event()
    seen: list[np.ndarray] = []

    def other_model() -> None:
        opened.wait(5)
        dev.launch(fn, (1,), (1,), [ptr(theirs.ptr), i64(theirs.size)])   # its own step
        launched.set()
        dev.synchronize()                       # waits for the capture (the gate), then the stream
        seen.append(dev.from_device(theirs.ptr, 4096).copy())

    t = threading.Thread(target=other_model)
    t.start()
    with dev.capture() as cap:
        dev.launch(fn, (1,), (1,), [ptr(mine.ptr), i64(mine.size)])
        opened.set()
        launched.wait(5)
    t.join(10)
    dev.destroy_graph_exec(cap.graph_exec)
    dev.arena.free(mine)
    dev.arena.free(theirs)
    assert seen and (seen[0] == 1).all(), "the other thread's launch never ran: it was captured"


def test_a_shared_carveout_outside_its_range_is_refused(dev):
    fn = dev.get_function(dev.load_module(IMAGE), "add_one")
    for percent in (-1, 0, 50, 100):
        dev.set_shared_carveout(fn, percent)
    for bad in (-2, 101):
        with pytest.raises(InvalidArgument, match="shared carveout"):
            dev.set_shared_carveout(fn, bad)
