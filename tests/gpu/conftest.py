"""Fixtures of the GPU tests: a CUDA device per test and one NVRTC disk cache per module (a file
may define its own, e.g. with other device settings)."""
from __future__ import annotations

import pytest

from gpu_worker.compile import KernelCompiler


@pytest.fixture(scope="module")
def kernel_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc-cache-gpu")


@pytest.fixture
def device():
    from gpu_worker.device import open_device
    dev = open_device("cuda")
    yield dev
    dev.close()


@pytest.fixture
def compiler(device, kernel_cache_dir):
    return KernelCompiler(device.info.arch, cache_dir=kernel_cache_dir)
