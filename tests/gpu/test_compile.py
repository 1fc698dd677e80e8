"""NVRTC artifacts on a real device: CUBIN and PTX both load and run; a PTX the driver rejects falls
back. Run on the GPU machine: `.venv/bin/python -m pytest -m gpu tests/gpu/test_compile.py -v -s`.

Most tests drive the driver directly through `RawDriverDevice` (cuModuleLoadData on the retained
primary context), so they do not depend on the device layer; the last one goes through
gpu_worker.device.open_device("cuda").
"""

from __future__ import annotations

import pathlib
import time
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_worker.compile import KernelCompiler, KernelSource

pytestmark = pytest.mark.gpu

AXPY = KernelSource(
    module_name="gpu_axpy",
    source="""
extern "C" __global__ void gpu_axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
""",
)


class RawDriverDevice:
    """What KernelCompiler.load needs (`info.arch`, `load_module`), straight on the driver."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self._check(driver.cuInit(0)[0], "cuInit")
        err, self.dev = driver.cuDeviceGet(0)
        self._check(err, "cuDeviceGet")
        err, self.ctx = driver.cuDevicePrimaryCtxRetain(self.dev)
        self._check(err, "cuDevicePrimaryCtxRetain")
        self._check(driver.cuCtxSetCurrent(self.ctx)[0], "cuCtxSetCurrent")
        attr = driver.CUdevice_attribute
        err, major = driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev
        )
        self._check(err, "cuDeviceGetAttribute")
        err, minor = driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev
        )
        self._check(err, "cuDeviceGetAttribute")
        self.info = SimpleNamespace(arch=f"sm_{major}{minor}")
        self.modules: list = []

    def _check(self, err, call: str) -> None:
        from gpu_worker.device.backend import DeviceError

        if err != self.driver.CUresult.CUDA_SUCCESS:
            _, name = self.driver.cuGetErrorName(err)
            raise DeviceError(f"{call}: {name.decode() if isinstance(name, bytes) else name}")

    def load_module(self, image: bytes):
        buf = np.frombuffer(image, dtype=np.uint8)  # kept alive across the call
        err, module = self.driver.cuModuleLoadData(buf.ctypes.data)
        self._check(err, "cuModuleLoadData")
        self.modules.append(module)
        return module

    def run_axpy(self, module, n: int = 1000, a: float = 3.0) -> float:
        """Launch gpu_axpy on n elements; returns the max abs error against NumPy."""
        d = self.driver
        err, fn = d.cuModuleGetFunction(module, b"gpu_axpy")
        self._check(err, "cuModuleGetFunction")
        rng = np.random.default_rng(0)
        x = rng.standard_normal(n).astype(np.float32)
        y = rng.standard_normal(n).astype(np.float32)
        expected = y + np.float32(a) * x
        err, dx = d.cuMemAlloc(x.nbytes)
        self._check(err, "cuMemAlloc")
        err, dy = d.cuMemAlloc(y.nbytes)
        self._check(err, "cuMemAlloc")
        try:
            self._check(d.cuMemcpyHtoD(dx, x.ctypes.data, x.nbytes)[0], "cuMemcpyHtoD")
            self._check(d.cuMemcpyHtoD(dy, y.ctypes.data, y.nbytes)[0], "cuMemcpyHtoD")
            args = [
                np.array([a], np.float32),
                np.array([int(dx)], np.uint64),
                np.array([int(dy)], np.uint64),
                np.array([n], np.int32),
            ]
            params = np.array([arg.ctypes.data for arg in args], dtype=np.uint64)
            self._check(
                d.cuLaunchKernel(
                    fn, (n + 255) // 256, 1, 1, 256, 1, 1, 0, 0, params.ctypes.data, 0
                )[0],
                "cuLaunchKernel",
            )
            self._check(d.cuCtxSynchronize()[0], "cuCtxSynchronize")
            out = np.empty_like(y)
            self._check(d.cuMemcpyDtoH(out.ctypes.data, dy, out.nbytes)[0], "cuMemcpyDtoH")
        finally:
            d.cuMemFree(dx)
            d.cuMemFree(dy)
        return float(np.max(np.abs(out - expected)))

    def close(self) -> None:
        for module in self.modules:
            self.driver.cuModuleUnload(module)
        self.modules.clear()


@pytest.fixture
def raw_device():
    device = RawDriverDevice()
    yield device
    device.close()


def test_cubin_and_ptx_both_load_and_compute_the_same_result(
    tmp_path: pathlib.Path,
    raw_device: RawDriverDevice,
) -> None:
    compiled = KernelCompiler(raw_device.info.arch, cache_dir=tmp_path).compile(AXPY)
    timings = {}
    for kind, image in (("cubin", compiled.cubin), ("ptx", compiled.ptx)):
        start = time.perf_counter()
        module = raw_device.load_module(image)
        timings[kind] = time.perf_counter() - start
        assert raw_device.run_axpy(module) < 1e-5, f"the {kind} computed a wrong axpy"
    print(
        f"\ncuModuleLoadData: cubin {timings['cubin'] * 1e6:.0f} us, "
        f"ptx {timings['ptx'] * 1e3:.1f} ms (driver JIT)"
    )


def test_load_picks_the_cubin_for_the_device_arch_without_fallbacks(
    tmp_path: pathlib.Path,
    raw_device: RawDriverDevice,
) -> None:
    c = KernelCompiler(raw_device.info.arch, cache_dir=tmp_path)
    module = c.load(raw_device, AXPY)
    assert raw_device.run_axpy(module) < 1e-5
    assert c.stats()["load_fallbacks"] == 0 and c.detailed_stats()["fresh_compiles"] == 0, c.stats()


def test_a_ptx_for_an_older_arch_is_jitted_by_the_driver(
    tmp_path: pathlib.Path,
    raw_device: RawDriverDevice,
) -> None:
    older = "sm_80" if raw_device.info.arch != "sm_80" else "sm_75"
    c = KernelCompiler(older, cache_dir=tmp_path)
    assert f".target {older}".encode() in c.compile(AXPY).ptx
    module = c.load(raw_device, AXPY)  # arch differs: the PTX path
    assert raw_device.run_axpy(module) < 1e-5, "the JIT-compiled PTX computed a wrong axpy"
    assert c.stats()["load_fallbacks"] == 0, c.stats()


def test_a_ptx_with_an_isa_newer_than_the_driver_falls_back_to_a_fresh_cubin(
    tmp_path: pathlib.Path,
    raw_device: RawDriverDevice,
) -> None:
    from gpu_worker.device.backend import DeviceError

    older = "sm_80" if raw_device.info.arch != "sm_80" else "sm_75"
    c = KernelCompiler(older, cache_dir=tmp_path)
    good = c.compile(AXPY)
    version = next(
        line
        for line in good.ptx.decode(errors="replace").splitlines()
        if line.startswith(".version")
    )
    # What a newer NVRTC writes (13.5 emits 9.5, which a 13.0 driver cannot load); 9.9 is beyond
    # every driver this test targets.
    newer = good.ptx.replace(version.encode(), b".version 9.9")
    with pytest.raises(DeviceError):
        raw_device.load_module(newer)  # negative control: the driver really refuses it
    c.local.put(good.key_ptx, newer)  # the disk tier now holds a PTX this driver cannot load
    c = KernelCompiler(older, cache_dir=tmp_path)
    module = c.load(raw_device, AXPY)
    assert raw_device.run_axpy(module) < 1e-5, "the fallback CUBIN computed a wrong axpy"
    stats = c.detailed_stats()
    assert stats["load_fallbacks"] == 1 and stats["fresh_compiles"] == 1, stats


def test_compiler_load_through_the_cuda_device_layer(tmp_path: pathlib.Path) -> None:
    from gpu_worker.device import open_device

    device = open_device("cuda")
    try:
        c = KernelCompiler(device.info.arch, cache_dir=tmp_path)
        module = c.load(device, AXPY)
        assert device.get_function(module, "gpu_axpy") is not None
        assert c.stats()["load_fallbacks"] == 0, c.stats()
    finally:
        device.close()
