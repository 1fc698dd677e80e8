"""Suite-wide fixtures: GPU tests skip cleanly where there is no CUDA device."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def cuda_device_present() -> bool:
    """True when the CUDA driver initialises and reports at least one device."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return False
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # noqa: BLE001 - no driver library at all
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_device_present():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make test-gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
