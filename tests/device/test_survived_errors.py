"""Fallbacks that survive an error log it with context and count it: never silent.

Each test makes a real failure happen (sim fault injection, a fake pynvml or CuPy module, a faulty
arena) and checks the log line (caplog) and gpuplane_worker_survived_errors_total{site}.
"""
from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_worker.device import cuda_backend, cupy_allocator
from gpu_worker.telemetry import survived as survived_mod
from gpu_worker.telemetry.survived import count
from tests.device.conftest import GRANULE


@pytest.fixture(autouse=True)
def fresh_log_once(monkeypatch):
    """Each test sees its site's first occurrence (the log-once memory is per process)."""
    monkeypatch.setattr(survived_mod, "_logged", set())


def _settle(d) -> None:
    d.synchronize()
    d.synchronize(d.copy_stream)
    d.arena.collect()


def _records(caplog, site: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "site", None) == site]


def test_every_quarantined_unmap_is_logged_with_its_range_and_counted(dev, caplog):
    before = count("release_quarantined")
    a = dev.arena.alloc(2 * GRANULE, "scratch", role="kv")
    b = dev.arena.alloc(2 * GRANULE, "scratch", role="kv")
    with caplog.at_level(logging.WARNING, logger="gpu_worker.telemetry.survived"):
        for x in (a, b):
            dev.backend.fail_next("unmap")
            dev.arena.free(x)
            _settle(dev)
    assert dev.queue.stats.quarantined == 2
    assert count("release_quarantined") == before + 2, "quarantines not counted in the metric"
    recs = _records(caplog, "release_quarantined")
    assert len(recs) == 2, "each quarantine leaks a range: each must be logged"
    assert {r.what for r in recs} == {f"unmap {a.ptr:#x}+{2 * GRANULE} (scratch)",
                                      f"unmap {b.ptr:#x}+{2 * GRANULE} (scratch)"}
    assert all("injected failure of unmap" in r.error for r in recs), "the cause is not logged"


def test_a_quarantined_pinned_free_is_logged_and_counted(dev, caplog):
    before = count("release_quarantined")
    dev.weights.add("w", np.ones(GRANULE, np.uint8))
    dev.backend.fail_next("free_pinned")
    with caplog.at_level(logging.WARNING, logger="gpu_worker.telemetry.survived"):
        dev.weights.remove("w")
        _settle(dev)
    assert count("release_quarantined") == before + 1
    [rec] = _records(caplog, "release_quarantined")
    assert rec.what == "free pinned copy of w" and "free_pinned" in rec.error


def test_a_failed_cupy_free_is_logged_and_counted_not_raised(monkeypatch, caplog):
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = SimpleNamespace(get_current_stream=lambda: SimpleNamespace(ptr=0))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    fake_bindings = types.ModuleType("cuda.bindings")
    fake_bindings.driver = SimpleNamespace(CUstream=lambda p: p)
    monkeypatch.setitem(sys.modules, "cuda.bindings", fake_bindings)

    def refuse(allocation, fence_streams):
        raise RuntimeError("arena closed")

    device = SimpleNamespace(_streams=[], arena=SimpleNamespace(free=refuse))
    owner = cupy_allocator._Owner(device, SimpleNamespace(ptr=0x7000, size=4096))
    before = count("cupy_free")
    with caplog.at_level(logging.WARNING, logger="gpu_worker.telemetry.survived"):
        owner.__del__()  # what CuPy's last reference drop runs; must not raise
    assert count("cupy_free") == before + 1, "a failed CuPy free was not counted"
    [rec] = _records(caplog, "cupy_free")
    assert (rec.ptr, rec.nbytes) == ("0x7000", 4096) and "arena closed" in rec.error


def _fake_pynvml(monkeypatch, **overrides) -> None:
    mod = types.ModuleType("pynvml")
    mod.nvmlInit = lambda: None
    mod.nvmlDeviceGetHandleByUUID = lambda uuid: "handle"
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: []
    for name, fn in overrides.items():
        setattr(mod, name, fn)
    monkeypatch.setitem(sys.modules, "pynvml", mod)


def _raise(msg: str):
    def fn(*args):
        raise RuntimeError(msg)
    return fn


def test_nvml_unavailable_falls_back_once_logged_with_what_the_baseline_now_means(monkeypatch,
                                                                                     caplog):
    _fake_pynvml(monkeypatch, nvmlInit=_raise("NVML_ERROR_NO_PERMISSION"))
    before = count("nvml_unavailable")
    with caplog.at_level(logging.WARNING, logger="gpu_worker.telemetry.survived"):
        assert cuda_backend._nvml_handle("GPU-x") is None, "the fallback (no NVML) must be kept"
        assert cuda_backend._nvml_handle("GPU-x") is None
    assert count("nvml_unavailable") == before + 2, "every fallback must be counted"
    [rec] = _records(caplog, "nvml_unavailable")  # logged once, not per call
    assert rec.device_uuid == "GPU-x" and "NO_PERMISSION" in rec.error
    assert "context baseline" in rec.getMessage(), "the log must say what the fallback changes"


def test_a_failed_nvml_query_reports_no_usage_and_is_logged_once_and_counted(monkeypatch, caplog):
    _fake_pynvml(monkeypatch,
                 nvmlDeviceGetComputeRunningProcesses=_raise("NVML_ERROR_GPU_IS_LOST"))
    backend = SimpleNamespace(_nvml="handle", info=SimpleNamespace(uuid="GPU-y"))
    before = count("nvml_query")
    with caplog.at_level(logging.WARNING, logger="gpu_worker.telemetry.survived"):
        for _ in range(3):
            assert cuda_backend.CudaBackend._nvml_usage(backend) == {}
    assert count("nvml_query") == before + 3
    [rec] = _records(caplog, "nvml_query")
    assert rec.device_uuid == "GPU-y" and "GPU_IS_LOST" in rec.error
