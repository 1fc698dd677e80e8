"""The device's BLAS on the sim test double: the GEMM's contract (fp16 operands, f32 accumulation,
strided output columns), capture and replay, the ledger booking, and refusals that change nothing.
The cuda side (libcublas through ctypes) runs the same claims in tests/gpu/test_blas.py."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.device import open_device
from gpu_worker.device.backend import DeviceError
from gpu_worker.device.blas import WORKSPACE_BYTES
from gpu_worker.kernels import reference as ref
from services.common.errors import InvalidArgument


@pytest.fixture
def dev():
    d = open_device("sim")
    yield d
    d.close()


def put(dev, host: np.ndarray):
    a = dev.arena.alloc(max(1, host.nbytes), "activations")
    dev.to_device(a.ptr, host)
    return a


def get(dev, a, shape, dtype=np.float32) -> np.ndarray:
    dev.synchronize()
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return dev.from_device(a.ptr, n).view(dtype).reshape(shape).copy()


def operands(rng, m, n, k):
    return (rng.standard_normal((m, k)).astype(np.float16),
            (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16))


def test_gemm_nt_is_fp16_operands_with_f32_accumulation_into_strided_columns(dev):
    rng = np.random.default_rng(0)
    m, n, k = 33, 70, 96
    x, w = operands(rng, m, n, k)
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    xa, wa, ya = put(dev, x), put(dev, w), put(dev, y0)
    # columns [20, 20 + 30) of y, from rows [20, 50) of w: the tiled linear's call
    dev.blas.gemm_nt(ya.ptr + 4 * 20, xa.ptr, wa.ptr + 2 * 20 * k, m, 30, k, ldy=n)
    got = get(dev, ya, (m, n))
    want = y0.copy()
    want[:, 20:50] = ref.gemm_nt_f16(x, w[20:50])
    assert np.array_equal(got, want), "only columns [20, 50) may change, to x16 @ w16^T in f32"


def test_a_captured_gemm_replays_against_the_current_operands(dev):
    rng = np.random.default_rng(1)
    m, n, k = 17, 40, 64
    x, w = operands(rng, m, n, k)
    xa, wa, ya = put(dev, x), put(dev, w), put(dev, np.zeros((m, n), np.float32))
    with dev.capture() as cap:
        dev.blas.gemm_nt(ya.ptr, xa.ptr, wa.ptr, m, n, k)
    x2, _ = operands(rng, m, n, k)
    dev.to_device(xa.ptr, x2)
    dev.replay(cap.graph_exec)
    assert np.array_equal(get(dev, ya, (m, n)), ref.gemm_nt_f16(x2, w)), \
        "the replay must read the operands at replay time, like a CUDA graph"
    dev.destroy_graph_exec(cap.graph_exec)


def test_the_blas_workspace_is_booked_while_held_and_given_back_by_the_last_holder(dev):
    before = dev.ledger.snapshot()["workspace"][1]
    dev.acquire_blas()
    dev.acquire_blas()
    assert dev.ledger.snapshot()["workspace"][1] == before + WORKSPACE_BYTES
    dev.release_blas()
    assert dev.blas_stats()["workspace_bytes"] == WORKSPACE_BYTES, "one holder is left"
    dev.release_blas()
    assert dev.ledger.snapshot()["workspace"][1] == before, "the last release frees the workspace"
    assert dev.blas_stats()["workspace_bytes"] == 0


@pytest.mark.parametrize("bad", [{"m": -1}, {"k": 2**31}, {"ldy": 3}, {"out_dtype": "f64"}])
def test_bad_gemm_arguments_are_invalid_argument_and_launch_nothing(dev, bad):
    args = {"m": 4, "n": 8, "k": 16, "ldy": 8, "out_dtype": "f32"} | bad
    calls = dev.blas.stats()["calls"]
    with pytest.raises(InvalidArgument):
        dev.blas.gemm_nt(0, 0, 0, args["m"], args["n"], args["k"], ldy=args["ldy"],
                         out_dtype=args["out_dtype"])
    assert dev.blas.stats()["calls"] == calls, "a refused call must not reach the library"


def test_warm_up_runs_once_per_shape_and_is_refused_inside_a_capture(dev):
    runs = []
    assert dev.blas.warm({(1, 2, 3), (4, 5, 6)}, lambda: runs.append(1))
    assert not dev.blas.warm({(1, 2, 3)}, lambda: runs.append(2)), "a warm shape runs nothing"
    assert runs == [1] and dev.blas.is_warm((4, 5, 6))
    with dev.capture(), pytest.raises(DeviceError, match="captures"):
        dev.blas.warm({(7, 8, 9)}, lambda: runs.append(3))
    assert runs == [1] and not dev.blas.is_warm((7, 8, 9))
