"""Does a CUBIN that NVRTC 13.0 builds for `--gpu-architecture=sm_90a` with `wgmma.mma_async`
load and run on the H200's driver? (The question before any wgmma linear.)

The probe (tests/gpu/wgmma_probe.cu) is one warpgroup MMA, m64n8k16, A from registers and B from
shared memory through a no-swizzle descriptor. The first test answers the question (module load,
launch, synchronize: no driver error); the second checks the numbers against NumPy under the
descriptor's two readings of which byte offset steps along K, and says which one the hardware
uses. docs/kernels.md records the answer.

    python3 -m pytest -m gpu tests/gpu/test_wgmma_sm90a.py -v
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpu_worker.compile.nvrtc import compile_program

pytestmark = pytest.mark.gpu

SOURCE = (Path(__file__).parent / "wgmma_probe.cu").read_text()
LAYOUTS = {"lbo=K step": (128, 256), "sbo=K step": (256, 128)}


@pytest.fixture(scope="module")
def probe():
    from gpu_worker.device import open_device

    device = open_device("cuda")
    cubin = compile_program("wgmma_probe", SOURCE, {}, "sm_90a", ("--std=c++17",)).cubin
    module = device.load_module(cubin)      # the question: the driver takes the sm_90a image
    yield device, device.get_function(module, "gp_wgmma_probe")
    device.unload_module(module)
    device.close()


def _harness_run(h, fn, a, b, lbo, sbo) -> np.ndarray:
    from gpu_worker.device.backend import i32, ptr

    d = h.put(np.full((64, 8), np.nan, np.float32))
    h.device.launch(fn, (1, 1, 1), (128, 1, 1), [ptr(d), ptr(h.put(a)), ptr(h.put(b)), i32(lbo),
                                                 i32(sbo)])
    h.device.synchronize()
    return h.get(d, (64, 8))


@pytest.fixture(scope="module")
def harness(probe, tmp_path_factory):
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.kernels.selfcheck import KernelHarness

    device, _ = probe
    h = KernelHarness(device, KernelCompiler(device.info.arch,
                                             cache_dir=tmp_path_factory.mktemp("kernels")))
    yield h
    h.close()


def _operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(90)
    # small integers: every product and sum is exact in fp16 inputs / f32 accumulation
    a = rng.integers(-4, 5, (64, 16)).astype(np.float16)
    b = rng.integers(-4, 5, (16, 8)).astype(np.float16)
    return a, b


def test_an_nvrtc_sm_90a_cubin_with_wgmma_loads_and_runs_on_the_driver(probe, harness) -> None:
    _, fn = probe
    a, b = _operands()
    d = _harness_run(harness, fn, a, b, *LAYOUTS["lbo=K step"])
    assert np.isfinite(d).all(), "the wgmma probe ran but left outputs unwritten"


def test_the_wgmma_probe_computes_a_times_b_under_one_descriptor_reading(probe, harness) -> None:
    _, fn = probe
    a, b = _operands()
    want = a.astype(np.float32) @ b.astype(np.float32)
    matches = []
    for name, (lbo, sbo) in LAYOUTS.items():
        got = _harness_run(harness, fn, a, b, lbo, sbo)
        print(f"wgmma m64n8k16, no-swizzle K-major B, {name} (lbo {lbo}, sbo {sbo}): "
              f"{'matches' if np.array_equal(got, want) else 'differs from'} NumPy "
              f"(max |error| {np.abs(got - want).max():.3g})")
        if np.array_equal(got, want):
            matches.append(name)
    assert matches, "neither descriptor reading gives A @ B: the probe's B layout is wrong"
