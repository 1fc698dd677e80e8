"""GPU tests of the enqueues that keep the GIL (gpu_worker/device/cuda_enqueue.py): the step's
calls (pinned copies both ways, a graph launch, event records, queries and times) give the same
bytes and the same errors with the GIL kept as with cuda-python's releasing calls.

Run on the GPU machine:  python3 -m pytest -m gpu tests/gpu/test_cuda_enqueue.py -v
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.device.backend import DeviceError, i64, ptr
from tests.gpu.test_device import KERNELS, nvrtc_cubin

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[True, False], ids=["keeps-gil", "releases-gil"])
def dev(request):
    from gpu_worker.device import Device, open_backend

    d = Device(open_backend("cuda", keep_gil=request.param))
    yield d
    d.close()


def test_a_step_of_pinned_copies_a_graph_and_events_gives_the_same_bytes_either_way(dev):
    n = (1 << 20) + 4099
    add_one = dev.get_function(dev.load_module(nvrtc_cubin(KERNELS, dev.info.arch)), "add_one")
    buf = dev.arena.alloc(n, "activations")
    src, dst = dev.alloc_pinned(n), dev.alloc_pinned(n)
    with dev.capture() as cap:
        dev.launch(add_one, (256,), (256,), [ptr(buf.ptr), i64(n)])
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    try:
        for step in range(3):       # the buffers are reused, as the engine's step inputs are
            src[:] = np.random.default_rng(step).integers(0, 256, n, dtype=np.uint8)
            dev.record_event(start)
            dev.copy_to_device_async(buf.ptr, src)
            dev.replay(cap.graph_exec)
            dev.copy_from_device_async(dst, buf.ptr)
            dev.record_event(end)
            dev.wait_event(end)
            assert dev.event_done(end)
            assert np.array_equal(dst, (src + 1).astype(np.uint8)), f"step {step}"
            assert 0 < dev.event_elapsed_s(start, end) < 1
        dev.wait_event(end)         # a completed event: no wait (and no hand-off) at all
    finally:
        for e in (start, end):
            dev.destroy_event(e)
        dev.destroy_graph_exec(cap.graph_exec)
        dev.free_pinned(src)
        dev.free_pinned(dst)
        dev.arena.free(buf)


def test_a_pageable_copy_is_still_right(dev):
    """Not from alloc_pinned: the copy keeps cuda-python's call, which may wait for staging."""
    data = np.arange(3 << 20, dtype=np.uint8)
    buf = dev.arena.alloc(data.nbytes, "activations")
    try:
        dev.to_device(buf.ptr, data)
        assert np.array_equal(dev.from_device(buf.ptr, data.nbytes), data)
    finally:
        dev.arena.free(buf)


def test_a_failed_call_raises_the_drivers_error_by_name_either_way(dev):
    """Events without timing have no elapsed time: the driver refuses, the error names the call."""
    a, b = dev.create_event(), dev.create_event()
    try:
        dev.record_event(a)
        dev.record_event(b)
        dev.wait_event(b)
        with pytest.raises(DeviceError, match="cuEventElapsedTime: CUDA_ERROR_INVALID_HANDLE"):
            dev.event_elapsed_s(a, b)
    finally:
        dev.destroy_event(a)
        dev.destroy_event(b)
