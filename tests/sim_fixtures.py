"""Shared fixtures for executor and model tests: a sim device per test and one NVRTC disk cache
per session (NVRTC is real; the cache only saves recompiling the same modules in every test)."""
from __future__ import annotations

import pytest

from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc-cache")


@pytest.fixture
def device():
    dev = open_device("sim")
    yield dev
    if getattr(dev.backend, "fault", None) is None:   # a lost context (negative controls) cannot close
        dev.close()


@pytest.fixture
def compiler(device, kernel_cache_dir):
    return KernelCompiler(device.info.arch, cache_dir=kernel_cache_dir)
