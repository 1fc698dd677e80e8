"""The fused QKV epilogue (gpu_worker.kernels.qkv) through the sim device against its NumPy
reference, and the reference against the four kernels it replaces (rotary, rotary, kv_append,
to_f16): the fusion changes no value."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.kernels import qkv
from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.selfcheck import KernelHarness
from gpu_worker.kernels.selfcheck.qkv import QKV_CASES


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    device = open_device("sim")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.mark.parametrize("case", QKV_CASES, ids=[c.id for c in QKV_CASES])
def test_sim_qkv_kernel_matches_its_numpy_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id}: sim result differs from the reference: {failure}"


def test_the_paged_reference_is_bias_add_rotary_rows_kv_append_and_to_f16_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    heads, kvh, d, bt, mb = 4, 2, 16, 16, 3
    pos = np.array([0, 17, -1, 40], np.int32)
    qkv = rng.standard_normal((4, (heads + 2 * kvh) * d), dtype=np.float32)
    bias = rng.standard_normal(qkv.shape[1], dtype=np.float32)
    pool = rng.standard_normal((12, 2, 2, bt, kvh, d), dtype=np.float32).astype(np.float16)
    table = rng.permutation(12)[:4 * mb].reshape(4, mb).astype(np.int32)
    q16, got_pool = ref.qkv_rope_append_paged(qkv, bias, pos, table, pool, 1, heads, kvh,
                                              np.float32(500000.0))
    x = ref.bias_add(qkv, bias)
    q = ref.rotary_rows(x[:, :heads * d].reshape(4, heads, d), pos, np.float32(500000.0))
    k = ref.rotary_rows(x[:, heads * d:(heads + kvh) * d].reshape(4, kvh, d), pos,
                        np.float32(500000.0))
    want_pool = ref.kv_append_paged(pool, k.reshape(4, -1), x[:, (heads + kvh) * d:], pos, table, 1)
    np.testing.assert_array_equal(q16, ref.to_f16(q.reshape(4, -1)))
    np.testing.assert_array_equal(got_pool, want_pool)
    assert not q16[2].any(), "a padding row's q is zero"


def test_paged_rope_rotates_one_head_a_thread_while_every_angle_fits_the_gpu() -> None:
    """Decode batch 1 computes every angle at once (latency); wider batches share each angle
    between more heads (throughput), never more than the kernel's register arrays hold."""
    device = open_device("sim")   # models an H200: 132 multiprocessors
    try:
        llama = {"heads": 32, "kv_heads": 8, "head_dim": 128}
        chosen = {rows: qkv.rope_heads(device, rows, **llama) for rows in (1, 8, 20, 32, 64, 2048)}
        assert chosen == {1: 1, 8: 1, 20: 2, 32: 4, 64: 8, 2048: qkv.ROPE_HEADS}
    finally:
        device.close()
