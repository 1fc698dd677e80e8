"""Suite-wide fixtures: GPU tests skip cleanly where there is no CUDA device."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def cuda_device_present() -> bool:
    """True when the CUDA driver initialises and reports at least one device."""
    from gpu_worker.device.cuda_backend import cuda_device_count

    return cuda_device_count() > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_device_present():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make test-gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
