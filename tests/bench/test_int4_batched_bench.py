"""bench/int4_batched_bench.py's --xk on the sim at a small shape: every K-over-warps build is
checked against the default kernel, then timed at every row count; a result that differs stops
the run (WrongBuild) instead of timing. (The tuning builds' sweeps compile a module a build,
~7 s each with NVRTC: `python bench/int4_batched_bench.py --backend sim --small --rows-sweep
--xk` runs them all, 2 minutes.)"""
from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import pytest

from bench import int4_batched_bench as bench
from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.int4_batched import XK_BUILDS
from gpu_worker.kernels.selfcheck import KernelHarness

N, K = 96, 384


@pytest.fixture
def setup():
    dev = open_device("sim")
    h = KernelHarness(dev, KernelCompiler(dev.info.arch, cache_dir=pathlib.Path(tempfile.mkdtemp())))
    rng = np.random.default_rng(3)
    packed, scales = ref.int4_quantize(rng.standard_normal((N, K)).astype(np.float32) / 16)
    weights = [(h.put(packed), h.put(scales))]
    x = h.put(rng.standard_normal((64, K)).astype(np.float16))
    y = h.put(np.zeros((64, N), np.float32))
    yield dev, h, weights, x, y
    h.close()
    dev.close()


def test_the_xk_times_cover_both_entries_and_a_wrong_result_stops_them(setup, monkeypatch) -> None:
    dev, h, weights, x, y = setup
    times = bench.xk_times(dev, h, weights, x, y, N, K, 1, 1)
    assert set(times) == {(b, build) for b in bench.XK_BATCHES for build in XK_BUILDS}
    real, calls = h.get, iter(range(1 << 30))

    def get(p, shape, *a, **kw):   # every second read (an xk result, not the default's) is off
        out = real(p, shape, *a, **kw)
        return out + 1.0 if next(calls) % 2 else out
    monkeypatch.setattr(h, "get", get)
    with pytest.raises(bench.WrongBuild):
        bench.xk_times(dev, h, weights, x, y, N, K, 1, 1)
