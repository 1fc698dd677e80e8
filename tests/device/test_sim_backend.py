"""The sim test double reproduces the hardware behaviours the device layer guards against."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gpu_worker.device.backend import CaptureInvalidated, DeviceError, IllegalAddress, i64, ptr
from gpu_worker.device.sim_backend import SimBackend
from tests.device.conftest import GATES, GRANULE, IMAGE


@pytest.fixture
def sim():
    b = SimBackend(total_bytes=64 << 20, granule_bytes=GRANULE, context_bytes=4 << 20)
    yield b
    b.close()


def _mapped(sim: SimBackend, nbytes: int) -> tuple[int, object]:
    va = sim.reserve(nbytes * 4)
    h = sim.create_physical(nbytes)
    sim.map(va, h, nbytes)
    return va, h


def _capture_while_other_thread_calls(sim, mode: str, call) -> bool:
    s = sim.create_stream()
    sim.begin_capture(s, mode=mode)
    t = threading.Thread(target=call)
    t.start()
    t.join(5)
    try:
        sim.end_capture(s)
        return False
    except CaptureInvalidated:
        return True


def test_another_threads_context_sync_invalidates_a_thread_local_capture(sim):
    refused: list[Exception] = []

    def sync() -> None:
        try:
            sim.synchronize_context()
        except DeviceError as exc:  # as on the H200: the sync fails too
            refused.append(exc)

    assert _capture_while_other_thread_calls(sim, "thread_local", sync), \
        "GPU.md: cuCtxSynchronize on another thread invalidates THREAD_LOCAL captures"
    assert sim.invalidations == 1 and len(refused) == 1


def test_thread_local_capture_survives_other_threads_pinned_alloc_and_module_load(sim):
    def calls() -> None:
        sim.free_pinned(sim.alloc_pinned(4096))
        sim.load_module(IMAGE)

    assert not _capture_while_other_thread_calls(sim, "thread_local", calls), \
        "GPU.md: pinned alloc and module load do not invalidate a THREAD_LOCAL capture"
    assert _capture_while_other_thread_calls(sim, "global", calls), \
        "GPU.md: the same calls invalidate a GLOBAL capture"


def test_reading_unmapped_memory_raises_illegal_address(sim):
    va, _h = _mapped(sim, GRANULE)
    sim.view(va, GRANULE)[:] = 1
    with pytest.raises(IllegalAddress):
        sim.view(va, GRANULE + 1)  # one byte past the mapping


def test_a_handle_carries_its_bytes_across_unmap_and_remap_and_the_old_va_is_poisoned(sim):
    va, h = _mapped(sim, GRANULE)
    sim.view(va, 4)[:] = [1, 2, 3, 4]
    sim.unmap(va, GRANULE)
    with pytest.raises(IllegalAddress):
        sim.view(va, 4)
    sim.map(va + GRANULE, h, GRANULE)
    assert list(sim.view(va + GRANULE, 4)) == [1, 2, 3, 4], "a handle lost its bytes on unmap"


def test_an_unfenced_unmap_faults_the_kernel_still_queued_on_the_stream(sim):
    src, _h = _mapped(sim, GRANULE)
    dst, _ = _mapped(sim, GRANULE)
    s = sim.create_stream()
    GATES[1] = threading.Event()
    fn = sim.get_function(sim.load_module(IMAGE), "wait_then_copy")
    sim.launch(fn, (1, 1, 1), (1, 1, 1), [ptr(src), ptr(dst), i64(GRANULE), i64(1)], s)
    sim.unmap(src, GRANULE)  # no fence: the kernel has not read it yet
    GATES[1].set()
    with pytest.raises(IllegalAddress):
        sim.synchronize_stream(s)
    assert sim.faults, "the use after unmap was not recorded as a device fault"


def test_mem_get_info_counts_physical_bytes_nobody_booked(sim):
    free0, _total = sim.mem_get_info()
    h = sim.create_physical(4 * GRANULE)
    free1, _ = sim.mem_get_info()
    assert free0 - free1 == 4 * GRANULE, "an unbooked handle must still show as device-used"
    sim.release_physical(h)
    assert sim.mem_get_info()[0] == free0


def test_replay_reads_whatever_is_mapped_at_replay_time(sim):
    src, _h = _mapped(sim, GRANULE)
    dst, _ = _mapped(sim, GRANULE)
    s = sim.create_stream()
    fn = sim.get_function(sim.load_module(IMAGE), "copy_u8")
    sim.begin_capture(s)
    sim.launch(fn, (1, 1, 1), (1, 1, 1), [ptr(src), ptr(dst), i64(16)], s)
    exe = sim.instantiate(sim.end_capture(s))
    sim.unmap(src, GRANULE)
    h2 = sim.create_physical(GRANULE)
    h2.data[:16] = np.arange(16, dtype=np.uint8) + 100
    sim.map(src, h2, GRANULE)
    sim.launch_graph(exe, s)
    sim.synchronize_stream(s)
    assert list(sim.view(dst, 16)) == list(range(100, 116)), "replay did not read the new pages"


def test_get_function_refuses_an_entry_the_image_does_not_contain(sim):
    from gpu_worker.device.backend import DeviceError

    with pytest.raises(DeviceError, match="NOT_FOUND"):
        sim.get_function(sim.load_module(b".entry other"), "copy_u8")


def test_a_tensor_map_is_refused_as_the_driver_refuses_it_and_reads_back_what_it_describes(sim):
    from gpu_worker.device.backend import tmap
    from gpu_worker.device.sim_kernels import SimTensorMap, sim_tensor_map

    m = sim.tensor_map_2d(4096, 4096, 48, 8192, (64, 64))
    assert tmap(m).kind == "tmap"
    assert sim_tensor_map(m) == SimTensorMap(4096, (4096, 48), (8192,), (64, 64), 2, 128)
    w = sim.tensor_map_2d(4096, 4096, 63, 32768, (128, 16), 8, 0)   # u64, as it lies: 1 KiB rows
    assert sim_tensor_map(w) == SimTensorMap(4096, (4096, 63), (32768,), (128, 16), 8, 0)
    # five dimensions: a paged KV pool's (dims, heads, block rows, layer and K/V, blocks)
    pool = sim.tensor_map(4096, (128, 8, 16, 4, 100), (256, 2048, 32768, 131072), (64, 1, 16, 1, 1))
    assert sim_tensor_map(pool) == SimTensorMap(4096, (128, 8, 16, 4, 100), (256, 2048, 32768, 131072),
                                                (64, 1, 16, 1, 1), 2, 128)
    for sizes, strides, box in (((128, 8, 16), (256, 2048, 32768), (64, 1, 16)),   # a stride too many
                                ((128, 8, 16, 4, 100, 2), (256,) * 5, (64,) + (1,) * 5),   # rank 6
                                ((128, 8), (264,), (64, 1))):   # a stride not whole 16 bytes
        with pytest.raises(DeviceError, match="cuTensorMapEncodeTiled"):
            sim.tensor_map(4096, sizes, strides, box)
    for bad in ((4100, 4096, 48, 8192, (64, 64)),    # address not 16-byte aligned
                (4096, 4096, 48, 8200, (64, 64)),    # rows not 16 bytes apart
                (4096, 4096, 48, 4096, (64, 64)),    # rows overlap
                (4096, 4096, 48, 8192, (128, 64)),   # a box row wider than the 128-byte swizzle
                (4096, 4096, 48, 8192, (64, 512)),   # a box past 256 rows
                (4096, 4096, 48, 8192, (12, 16), 2, 0)):   # a box row not whole 16 bytes
        with pytest.raises(DeviceError, match="cuTensorMapEncodeTiled"):
            sim.tensor_map_2d(*bad)
    with pytest.raises(ValueError, match="128 bytes"):
        tmap(m[:64])
