"""Invariants of the capture gate (DESIGN 2.1), proved with threads and no bare sleeps."""
from __future__ import annotations

import threading

from gpu_worker.device.gate import CaptureGate, process_gate
from tests.polling import wait_until


def test_a_capture_waits_for_shared_sections_in_flight():
    gate = CaptureGate()
    reader = gate.shared()
    got = threading.Event()

    def capture() -> None:
        with gate.exclusive():
            got.set()

    t = threading.Thread(target=capture)
    t.start()
    assert wait_until(lambda: gate.waiting_writers() == 1), "capture never queued"
    assert not got.is_set(), "capture began while a synchronizing section was in flight"
    reader.release()
    t.join(5)
    assert got.is_set(), "capture never began after the section ended"


def test_a_waiting_capture_blocks_new_shared_sections_writer_preference():
    gate = CaptureGate()
    first = gate.shared()
    order: list[str] = []

    def capture() -> None:
        with gate.exclusive():
            order.append("capture")

    def late_reader() -> None:
        with gate.shared():
            order.append("reader")

    w = threading.Thread(target=capture)
    w.start()
    assert wait_until(lambda: gate.waiting_writers() == 1), "capture never queued"
    r = threading.Thread(target=late_reader)
    r.start()
    assert wait_until(lambda: gate.waiting_readers() == 1), "late reader was not held back"
    first.release()
    w.join(5)
    r.join(5)
    assert order == ["capture", "reader"], f"a new section overtook a waiting capture: {order}"


def test_shared_sections_are_reentrant_even_while_a_capture_waits():
    gate = CaptureGate()
    outer = gate.shared()
    w = threading.Thread(target=lambda: gate.exclusive().release())
    w.start()
    assert wait_until(lambda: gate.waiting_writers() == 1)
    inner = gate.shared()  # must not queue behind the writer: this thread would deadlock itself
    inner.release()
    outer.release()
    w.join(5)
    assert not w.is_alive(), "the capture never ran after the re-entrant sections ended"


def test_the_capturing_thread_bypasses_the_gate():
    gate = CaptureGate()
    with gate.exclusive(), gate.shared():  # would deadlock without the bypass
        assert gate.holds_section()
    assert gate.stats.bypassed == 1, "the capturing thread's section was not a bypass"


def test_two_threads_holding_sections_can_both_capture_without_deadlock():
    gate = CaptureGate()
    barrier = threading.Barrier(2)
    done: list[int] = []

    def run(i: int) -> None:
        with gate.shared():
            barrier.wait(5)
            with gate.exclusive():
                done.append(i)
            assert gate.holds_section(), "the set-aside section was not restored"

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    assert sorted(done) == [0, 1], "deadlock: two section holders could not both capture"
    assert gate.stats.set_asides == 2


def test_guards_can_be_released_elsewhere_and_a_second_release_is_a_noop():
    gate = CaptureGate()
    guard = gate.exclusive()

    def end_capture(g) -> None:
        g.release()

    end_capture(guard)
    guard.release()
    assert gate.capturing_thread() is None
    with gate.shared():
        pass


def test_there_is_one_gate_per_process():
    assert process_gate() is process_gate(), "a second gate would admit unsynchronized captures"


def test_run_or_defer_holds_work_until_the_capture_ends():
    gate = CaptureGate()
    ran: list[str] = []
    guard = gate.exclusive()
    t = threading.Thread(target=lambda: ran.append("now" if gate.run_or_defer(
        lambda: ran.append("work")) else "deferred"))
    t.start()
    t.join(5)
    assert ran == ["deferred"], f"work ran during another thread's capture: {ran}"
    guard.release()
    assert ran == ["deferred", "work"], "deferred work did not run when the capture ended"
    assert gate.run_or_defer(lambda: ran.append("again")) and ran[-1] == "again"
