"""GPU tests of the device layer on the cuda backend (DESIGN 2.1-2.3, GPU.md).

Kernels are tiny CUDA C sources compiled here with NVRTC directly (cuda.bindings.nvrtc), so these
tests depend on nothing but the device package. Imports stay inside the GPU machine's wheel set:
numpy, cuda-bindings, pytest (services.governor is not imported on this path).

Run on the GPU machine:  python3 -m pytest -m gpu tests/gpu/test_device.py -v
Under the sanitizer:     compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/gpu/test_device.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

KERNELS = r"""
extern "C" __global__ void copy_u8(const unsigned char* src, unsigned char* dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) dst[i] = src[i];
}
extern "C" __global__ void slow_copy_u8(const unsigned char* src, unsigned char* dst, long long n,
                                        long long spin) {
    long long t0 = clock64();
    while (clock64() - t0 < spin) { }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) dst[i] = src[i];
}
extern "C" __global__ void add_one(unsigned char* p, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) p[i] += 1;
}
"""


def nvrtc_cubin(source: str, arch: str) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"device_test.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = [f"--gpu-architecture={arch}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise AssertionError(f"NVRTC failed: {log.decode(errors='replace')}")
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * n
    (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    nvrtc.nvrtcDestroyProgram(prog)
    return buf


@pytest.fixture(scope="module")
def dev():
    from gpu_worker.device import open_device

    d = open_device("cuda")
    yield d
    d.close()


@pytest.fixture(scope="module")
def fns(dev):
    mod = dev.load_module(nvrtc_cubin(KERNELS, dev.info.arch))
    return {n: dev.get_function(mod, n) for n in ("copy_u8", "slow_copy_u8", "add_one")}


def _launch_copy(dev, fn, src, dst, n, stream=None):
    from gpu_worker.device.backend import i64, ptr

    dev.launch(fn, (min(1024, (n + 255) // 256),), (256,), [ptr(src), ptr(dst), i64(n)], stream)


def test_gate_off_another_threads_context_sync_invalidates_a_thread_local_capture(fns):
    """Negative control: without the gate the hazard of GPU.md is real on this device."""
    from gpu_worker.device import Device
    from gpu_worker.device.backend import CaptureInvalidated
    from gpu_worker.device.cuda_backend import CudaBackend
    from gpu_worker.device.gate import CaptureGate

    d = Device(CudaBackend(0), gate=CaptureGate(enabled=False))
    try:
        mod = d.load_module(nvrtc_cubin(KERNELS, d.info.arch))
        add = d.get_function(mod, "add_one")
        buf = d.arena.alloc(1 << 20, "scratch")
        started, synced = threading.Event(), threading.Event()
        refused: list[BaseException] = []

        def other() -> None:
            started.wait(10)
            try:
                d.synchronize_device()  # ungated: the gate is disabled
            except Exception as exc:  # noqa: BLE001 - the driver may also refuse the sync itself
                refused.append(exc)
            finally:
                synced.set()

        t = threading.Thread(target=other)
        t.start()
        from gpu_worker.device.backend import i64, ptr

        with pytest.raises(CaptureInvalidated), d.capture():
            d.launch(add, (4,), (256,), [ptr(buf.ptr), i64(1 << 20)])
            started.set()
            assert synced.wait(10), "the other thread's context sync never returned"
        t.join(10)
        assert not d.backend.is_capturing(d.stream), "a failed capture must still be ended"
        assert d.capture_invalidations == 1, "the cuda backend did not count the invalidation"
        d.arena.free(buf)
    finally:
        d.close()


def test_gate_on_100_captures_survive_4_threads_of_synchronizing_work(dev, fns):
    from gpu_worker.device.backend import i64, ptr

    buf = dev.arena.alloc(1 << 20, "scratch")
    stop = threading.Event()
    errors: list[BaseException] = []
    work = [0]

    def churn(i: int) -> None:
        try:
            while not stop.is_set():
                dev.synchronize_device()
                a = dev.arena.alloc((i + 1) << 16, "scratch")
                dev.arena.free(a)
                work[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    invalidated = 0
    try:
        for _ in range(100):
            try:
                with dev.capture() as cap:
                    for _ in range(8):
                        dev.launch(fns["add_one"], (4,), (256,), [ptr(buf.ptr), i64(1 << 20)])
                dev.replay(cap.graph_exec)
                dev.destroy_graph_exec(cap.graph_exec)
            except Exception:  # noqa: BLE001
                invalidated += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    dev.synchronize()
    dev.arena.free(buf)
    assert not errors, f"synchronizing threads failed: {errors[:3]}"
    assert work[0] > 0, "the synchronizing threads did no work: the test proves nothing"
    assert invalidated == 0, f"gate on: {invalidated} of 100 captures were invalidated"


def test_two_threads_holding_sections_can_both_capture_without_deadlock():
    code = textwrap.dedent("""
        import threading
        from gpu_worker.device import open_device
        d = open_device("cuda")
        streams = [d.backend.create_stream(), d.backend.create_stream()]
        barrier = threading.Barrier(2)
        def run(i):
            with d.gate.shared():
                barrier.wait()
                with d.capture(streams[i]) as cap:
                    d.memset(d_buf.ptr, i, 4096, streams[i])
                d.destroy_graph_exec(cap.graph_exec)
        d_buf = d.arena.alloc(4096, "scratch")
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        [t.start() for t in ts]; [t.join() for t in ts]
        d.arena.free(d_buf)
        print("OK")
    """)
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                       env=env, cwd=os.getcwd())
    assert r.returncode == 0 and "OK" in r.stdout, f"deadlock regression failed: {r.stderr[-2000:]}"


def test_weight_address_is_stable_across_eviction_and_a_graph_replays_the_new_pages(dev, fns):
    n = 3 * (1 << 20) + 12345
    w0 = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    slot = dev.weights.add("stable", w0)
    out = dev.arena.alloc(n, "activations")
    dev.weights.ensure_resident(["stable"])
    va = slot.va
    with dev.capture() as cap:
        _launch_copy(dev, fns["copy_u8"], slot.va, out.ptr, n)
    dev.replay(cap.graph_exec)
    assert np.array_equal(dev.from_device(out.ptr, n), w0), "readback after first page-in is wrong"
    committed = dev.arena.zone_live_bytes("weights")
    dev.weights.evict("stable")
    dev.synchronize()
    dev.synchronize(dev.copy_stream)
    dev.arena.collect()
    assert dev.arena.zone_live_bytes("weights") < committed, "eviction freed no committed bytes"
    w1 = (w0 + 7).astype(np.uint8)
    slot.host[:] = w1  # new content: a replay must read the pages mapped now, not the old ones
    dev.weights.ensure_resident(["stable"])
    assert slot.va == va, "the weight moved: captured graphs would read a stale address"
    dev.replay(cap.graph_exec)
    assert np.array_equal(dev.from_device(out.ptr, n), w1), "replay did not read the new pages"
    dev.destroy_graph_exec(cap.graph_exec)
    dev.weights.remove("stable")
    dev.arena.free(out)


def test_evicting_a_slot_while_a_kernel_still_reads_it_does_not_fault(dev, fns):
    from gpu_worker.device.backend import i64, ptr

    n = 8 << 20
    w = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    dev.weights.add("busy", w)
    out = dev.arena.alloc(n, "activations")
    dev.weights.ensure_resident(["busy"])
    slot = dev.weights.get("busy")
    spin = 200_000_000  # ~0.1 s at H200 clocks: the eviction happens while the kernel spins
    dev.launch(fns["slow_copy_u8"], (1024,), (256,), [ptr(slot.va), ptr(out.ptr), i64(n), i64(spin)])
    dev.weights.evict("busy")
    dev.arena.collect()
    assert dev.queue.pending() > 0, "the fenced release ran before the kernel finished"
    got = dev.from_device(out.ptr, n)  # raises IllegalAddress if the unmap was not fenced
    assert np.array_equal(got, w), "the kernel read wrong bytes: the slot was unmapped under it"
    dev.arena.collect()
    dev.weights.remove("busy")
    dev.arena.free(out)


def test_committing_n_bytes_moves_device_free_memory_by_n_and_the_ledger_agrees():
    from gpu_worker.device import Device
    from gpu_worker.device.cuda_backend import CudaBackend

    d = Device(CudaBackend(0))  # a fresh arena: no pooled handles to blur the figure
    try:
        n = 256 << 20
        # this process's use (the settled reading of design amendment 44): other processes on
        # the card (GPU tests in parallel) move cuMemGetInfo and nvidia-smi, not it; the
        # whole-card nvidia-smi figure is compared only while no other process holds memory
        used0, others0 = d.used_and_others()
        led0 = d.ledger.total_committed()
        smi0 = _smi_used_mib()
        a = d.arena.alloc(n, "kv", role="kv")
        used1, others1 = d.used_and_others()
        smi1 = _smi_used_mib()
        led1 = d.ledger.total_committed()
        g = d.info.granule_bytes
        expect = -(-n // g) * g
        moved = (used1 - others1) - (used0 - others0)
        assert moved == expect, f"this process's device use moved by {moved}, committed {expect}"
        assert led1 - led0 == expect, f"ledger moved by {led1 - led0}, device by {expect}"
        assert d.ledger.snapshot()["kv"] == (expect, n), f"kv zone is {d.ledger.snapshot()['kv']}"
        if smi0 is not None and smi1 is not None and others0 == others1 == 0:
            assert smi1 - smi0 == expect >> 20, (
                f"nvidia-smi moved {smi1 - smi0} MiB, expected {expect >> 20}")
        d.arena.free(a)
        d.synchronize()
        d.synchronize(d.copy_stream)
        d.arena.collect()
        held = d.own_used_bytes() - (used0 - others0)
        assert held == 0, f"freeing did not give the bytes back ({held} still held)"
    finally:
        d.close()


def _smi_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", "0"], check=False, capture_output=True, text=True, timeout=20).stdout
        return int(out.strip().splitlines()[0])
    except Exception:  # noqa: BLE001 - nvidia-smi is optional
        return None


def test_cupy_allocations_come_from_the_arena_and_are_booked(dev):
    cupy = pytest.importorskip("cupy")
    from gpu_worker.device import cupy_allocator

    cupy_allocator.install(dev, zone="scratch")
    try:
        before = dev.ledger.snapshot()["scratch"][1]
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        y = (x * 2).sum()
        assert float(y) == float(np.arange(1 << 20, dtype=np.float64).sum() * 2)
        booked = dev.ledger.snapshot()["scratch"][1] - before
        assert booked >= 4 << 20, f"CuPy's 4 MiB array was not booked in the ledger ({booked})"
        ptr_x = x.data.ptr
        assert dev.arena.base <= ptr_x < dev.arena.base + dev.arena.reserved, "CuPy memory escaped"
        del x, y
        cupy.cuda.get_current_stream().synchronize()
        dev.synchronize()
        dev.arena.collect()
        assert dev.ledger.snapshot()["scratch"][1] == before, "CuPy frees did not reach the arena"
    finally:
        cupy_allocator.uninstall()


def test_a_shared_carveout_set_through_the_device_is_the_functions_attribute(dev, fns):
    from cuda.bindings import driver as drv

    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    try:
        for percent in (100, 0):
            dev.set_shared_carveout(fns["add_one"], percent)
            err, value = drv.cuFuncGetAttribute(attr, fns["add_one"])
            assert err == drv.CUresult.CUDA_SUCCESS and value == percent
    finally:
        dev.set_shared_carveout(fns["add_one"], -1)   # the driver's choice again
