"""The cuda backend's GIL-keeping enqueues, the parts that need no GPU: which host ranges count as
pinned (only those may take a call that keeps the GIL) and the binding's refusal of a library
without the driver's symbols. The calls themselves: tests/gpu/test_cuda_enqueue.py."""
from __future__ import annotations

import ctypes.util

import pytest

from gpu_worker.device.cuda_enqueue import EnqueueCalls, PinnedSpans, handle


def test_a_copy_counts_as_pinned_only_inside_one_pinned_range() -> None:
    spans = PinnedSpans()
    spans.add(0x1000, 0x100)
    spans.add(0x3000, 0x200)
    assert spans.holds(0x1000, 0x100) and spans.holds(0x1080, 0x10) and spans.holds(0x3100, 0x100)
    assert not spans.holds(0x0FFF, 0x10), "starts before the range"
    assert not spans.holds(0x10F0, 0x20), "runs past the range's end"
    assert not spans.holds(0x1000, 0x2100), "spans two ranges and the gap between them"
    assert not spans.holds(0x2000, 0x10), "in the gap"
    assert not spans.holds(0x3200, 1), "just past the last range"


def test_a_freed_range_no_longer_counts_and_an_unknown_one_is_refused() -> None:
    spans = PinnedSpans()
    spans.add(0x1000, 0x100)
    spans.add(0x2000, 0x100)
    spans.remove(0x1000)
    assert not spans.holds(0x1000, 1) and spans.holds(0x2000, 1) and len(spans) == 1
    with pytest.raises(KeyError, match="0x1000"):
        spans.remove(0x1000)


def test_a_library_without_the_drivers_calls_is_refused_by_name() -> None:
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library to stand in for one without the driver's symbols")
    with pytest.raises(OSError, match="cuEventRecord"):
        EnqueueCalls(libc)


def test_no_handle_is_the_drivers_zero() -> None:
    from cuda.bindings import driver
    assert handle(None) == 0 and handle(driver.CUstream(0)) == 0
    assert handle(driver.CUevent(0x1234)) == 0x1234
