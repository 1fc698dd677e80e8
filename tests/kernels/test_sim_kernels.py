"""Every kernel through the sim device (open_device("sim")) against its NumPy reference.

The sim backend compiles nothing itself: the modules here are compiled by the real NVRTC through
KernelCompiler, loaded, looked up by entry name and launched; only the launch body is NumPy. So
these tests check the launchers' argument lists, grids and memory footprints against the sim
implementations, and (decode_graph) that a captured decode step replays at the current position.
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.kernels import (
    ALL_KERNELS,
    ATTENTION_DECODE_KV16,
    FLASH_ATTENTION_DECODE_SPLIT,
    INT4_DEQUANT,
    INT4_MATMUL,
    MATMUL_NT,
    RMSNORM,
    ROTARY,
    launch_attention_decode,
    launch_int4_matmul,
    launch_rmsnorm,
    launch_rotary,
)
from gpu_worker.kernels.selfcheck import CASES, KernelHarness, Outcome
from gpu_worker.kernels.selfcheck.flash import FLASH_CASES
from gpu_worker.kernels.selfcheck.paged import PAGED_CASES
from gpu_worker.kernels.selfcheck.qkv import QKV_CASES
from services.common.errors import InvalidArgument


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    device = open_device("sim")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sim_kernel_matches_its_numpy_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id}: sim result differs from the reference: {failure}"


def test_every_kernel_def_is_exercised_by_a_case() -> None:
    cases = CASES + FLASH_CASES + PAGED_CASES + QKV_CASES
    covered = {c.kernel for c in cases} | {k for c in cases for k in c.covers}
    missing = [k.name for k in ALL_KERNELS if k.name not in covered]
    assert not missing, f"kernels without a device case: {missing}"


def test_outcome_reports_a_result_outside_tolerance() -> None:
    want = np.ones(4, np.float32)
    assert Outcome(want.copy(), want, 1e-5, 0).failure() is None
    assert Outcome(want + 1e-3, want, 1e-5, 0).failure() is not None, \
        "negative control: a 1e-3 error must fail a 1e-5 tolerance"
    assert Outcome(np.array([1, 2], np.int32), np.array([1, 3], np.int32)).failure() is not None
    assert Outcome(np.full(4, np.nan, np.float32), want, 1, 1).failure() is not None, \
        "a NaN result must never pass"


def test_workspace_bytes_is_a_function_of_the_shapes() -> None:
    assert INT4_DEQUANT.workspace_bytes(n=4096, k=14336) == 4 * 4096 * 14336
    assert INT4_DEQUANT.workspace_bytes(n=7, k=33) == 4 * 7 * 33
    for k in (MATMUL_NT, INT4_MATMUL):
        assert k.workspace_bytes(m=5, n=7, k=9) == 0, f"{k.name} needs no workspace"
    assert ATTENTION_DECODE_KV16.workspace_bytes(batch=2, heads=32, head_dim=128) == 0, \
        "single-pass decode needs no workspace"
    assert FLASH_ATTENTION_DECODE_SPLIT.workspace_bytes(batch=2, heads=32, head_dim=128,
                                                        splits=8) == 4 * 2 * 32 * 8 * 130, \
        "split-K decode books (max, sum, acc) per sequence, head and split"


def test_launchers_refuse_bad_shapes_before_anything_reaches_the_device(harness) -> None:
    dev = harness.device
    launched: list = []

    class Recorder:  # a launch that got through would be recorded here
        def launch(self, *a, **kw):
            launched.append(a)

    rec = Recorder()
    fn = harness.function(RMSNORM)
    with pytest.raises(InvalidArgument):
        launch_rmsnorm(rec, fn, 0, 0, 0, -1, 8, 1e-5)
    with pytest.raises(InvalidArgument, match="head_dim"):
        launch_attention_decode(rec, fn, 0, 0, 0, 0, 256, 1, 2, 1, 600, 1200, 600, 0, 1, 8)
    with pytest.raises(InvalidArgument, match="multiple of kv_heads"):
        launch_attention_decode(rec, fn, 0, 0, 0, 0, 256, 1, 3, 2, 64, 192, 128, 0, 1, 8)
    with pytest.raises(InvalidArgument, match="16-byte aligned"):
        launch_int4_matmul(rec, fn, 0, 0, 0x1008, 0, 0, 1, 8, 32)
    with pytest.raises(InvalidArgument, match="even"):
        launch_rotary(rec, harness.function(ROTARY), 0, 0, 1, 1, 1, 3, 3, 0, 1e4)
    assert not launched, f"a refused launch reached the device: {launched}"
    assert dev is harness.device


def test_an_empty_launch_is_a_no_op_not_a_zero_sized_grid() -> None:
    launched: list = []

    class Recorder:
        def launch(self, *a, **kw):
            launched.append(a)

    launch_rmsnorm(Recorder(), None, 0, 0, 0, 0, 64, 1e-5)
    launch_int4_matmul(Recorder(), None, 0, 0, 0, 0, 0, 0, 64, 32)
    assert not launched, "a launch over zero rows must not reach the driver (grid 0 is invalid)"
