"""The batched tensor-core int4 linear (gpu_worker.kernels.int4_batched) on a real device against
reference.int4_matmul at 8b-int4 shapes (wq 4096x4096, w_gate 14336x4096, w_down 4096x14336, a
slice of lm_head) and batch 2..64, plus the small shared cases (selfcheck.CASES' int4_mma).

Run on the GPU machine:
    python3 -m pytest -m gpu tests/gpu/test_int4_batched.py -v
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.int4_batched import MT_CHOICES, STAGED_MT, x_tiles
from gpu_worker.kernels.selfcheck import (
    CASES,
    Case,
    KernelHarness,
    int4_mma_case,
    int4_mma_staged_case,
)

pytestmark = pytest.mark.gpu

SHARED = [c for c in CASES if c.kernel in ("int4_mma", "int4_mma_staged")]
MODEL: list[Case] = [
    Case("int4_mma", int4_mma_case, {"m": m, "n": n, "k": k, **extra})
    for m, n, k, extra in ((2, 4096, 4096, {}), (16, 14336, 4096, {"bias": True}),
                           (16, 4096, 14336, {"accumulate": True}), (8, 4096, 4096, {}),
                           (32, 4096, 14336, {}), (64, 16032, 4096, {}), (64, 4096, 4096, {}),
                           (5, 1024, 4096, {}), (64, 28672, 4096, {}),
                           (33, 6144, 4096, {"bias": True, "accumulate": True}),
                           (64, 4096, 14336, {}), (24, 1000, 4224, {}))
]
# every 16-row-tile count per warp the kernel is built for, forced, at odd N (a partial last
# block) and K not a power of two: each (NT, MT) instantiation and its row guards
FORCED: list[Case] = [
    Case("int4_mma", int4_mma_case, {"m": m, "n": 1000 + m, "k": 4224, "mt": mt,
                                     "accumulate": m % 2 == 1})
    for m in (5, 16, 24, 64) for mt in MT_CHOICES[x_tiles(m)]
]

# the staged kernel at the decode step's shapes on its default plan, then every weight tile forced
# with K split over 1, 3 and 8 CTAs of a cluster, at odd N and K not a power of two
STAGED: list[Case] = [
    Case("int4_mma_staged", int4_mma_staged_case, {"m": m, "n": n, "k": k, **extra})
    for m, n, k, extra in ((17, 6144, 4096, {"bias": True}), (32, 4096, 4096, {}),
                           (33, 28672, 4096, {"accumulate": True}), (64, 4096, 14336, {}),
                           (64, 6144, 4096, {"bias": True, "accumulate": True}),
                           (64, 16032, 4096, {}), (48, 1000, 4224, {}))
] + [
    Case("int4_mma_staged", int4_mma_staged_case, {"m": m, "n": 1000 + m, "k": 4224, "mt": mt,
                                                   "split": split, "accumulate": m % 2 == 1})
    for m in (24, 64) for mt in STAGED_MT for split in (1, 3, 8)
]
ALL = SHARED + MODEL + FORCED + STAGED


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.device import open_device

    device = open_device("cuda")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_cuda_int4_mma_matches_the_f32_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    harness.close()
    assert failure is None, f"{case.id}: device result differs from the reference: {failure}"


def test_int4_mma_is_deterministic_run_to_run(harness) -> None:
    """The split-K sum is in warp order (no atomics): two runs give identical bits."""
    for m in (16, 64):
        outs = [int4_mma_case(harness, np.random.default_rng(1), m, 4096, 4096).got for _ in range(2)]
        assert np.array_equal(outs[0], outs[1]), m
    for split in (1, 8):   # the staged kernel's cluster sum is in rank order
        outs = [int4_mma_staged_case(harness, np.random.default_rng(1), 64, 4096, 4096,
                                     split=split).got for _ in range(2)]
        assert np.array_equal(outs[0], outs[1]), split

