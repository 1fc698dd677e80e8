"""GPU: cuBLAS through ctypes (gpu_worker.device.blas) inside captured graphs, at prefill shapes.

    python3 -m pytest -m gpu tests/gpu/test_blas.py -v
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels import reference as ref

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture
def device():
    from gpu_worker.device import open_device

    dev = open_device("cuda")
    yield dev
    dev.close()


def put(dev, host):
    a = dev.arena.alloc(host.nbytes, "activations")
    dev.to_device(a.ptr, host)
    return a


def test_gpu_captured_cublas_gemm_replays_bit_identical_to_eager_at_a_prefill_shape(device):
    rng = np.random.default_rng(0)
    m, n, k = 5502, 4096, 4096
    x = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    w = (rng.standard_normal((n, k), dtype=np.float32) / 64).astype(np.float16)
    xa, wa = put(device, x), put(device, w)
    eager = device.arena.alloc(m * n * 4, "activations")
    graph = device.arena.alloc(m * n * 4, "activations")
    blas = device.blas
    blas.warm({(m, n, k)}, lambda: blas.gemm_nt(eager.ptr, xa.ptr, wa.ptr, m, n, k))
    with device.capture() as cap:
        blas.gemm_nt(graph.ptr, xa.ptr, wa.ptr, m, n, k)
    device.replay(cap.graph_exec)
    device.synchronize()
    got = device.from_device(graph.ptr, m * n * 4).view(np.float32).reshape(m, n)
    want = device.from_device(eager.ptr, m * n * 4).view(np.float32).reshape(m, n)
    assert np.array_equal(got, want), "the graph's GEMM differs from the eager call"
    rows = slice(0, 64)
    np.testing.assert_allclose(got[rows], ref.gemm_nt_f16(x[rows], w), rtol=1e-3, atol=1e-3,
                               err_msg="cuBLAS fp16 GEMM differs from the f32-accumulated reference")
    device.destroy_graph_exec(cap.graph_exec)


def test_gpu_the_handle_and_first_calls_leave_nothing_unaccounted(device):
    rng = np.random.default_rng(1)
    u0 = device.unaccounted_bytes()
    blas = device.acquire_blas()
    m, n, k = 469, 14336, 4096
    xa = put(device, rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
    wa = put(device, rng.standard_normal((n, k), dtype=np.float32).astype(np.float16))
    ya = device.arena.alloc(m * n * 4, "activations")
    blas.warm({(m, n, k)}, lambda: blas.gemm_nt(ya.ptr, xa.ptr, wa.ptr, m, n, k))
    with device.capture() as cap:
        blas.gemm_nt(ya.ptr, xa.ptr, wa.ptr, m, n, k)
    device.replay(cap.graph_exec)
    device.synchronize()
    drift = device.unaccounted_bytes() - u0
    print(f"\ncuBLAS library memory booked {blas.library_bytes / MIB:.1f} MiB; "
          f"unaccounted moved {drift / MIB:+.1f} MiB")
    assert abs(drift) <= 2 * MIB, f"cuBLAS left {drift / MIB:.1f} MiB unaccounted"
    device.destroy_graph_exec(cap.graph_exec)
    device.release_blas()
