"""Padded encoder batches on the real device: the masked attention and mean pooling kernels at
production shapes (small-encoder, large-encoder) against their NumPy references, a padded batch
of the small encoder against each sequence alone, and concurrent runtime callers batched.

Run on the GPU machine:
    python3 -m pytest -m gpu tests/gpu/test_encoder_batching.py -v
    compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/gpu/test_encoder_batching.py -q
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.kernels.selfcheck import KernelHarness
from gpu_worker.kernels.selfcheck.encoder import ENCODER_CASES, ENCODER_MODEL_CASES
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.encoder import EncoderModel, padded_shape

pytestmark = pytest.mark.gpu
SOLO_ATOL = 1e-3   # padded vs solo: other GEMM shapes, an fp16 rounding flip moves 2^-11 relative
CASES = ENCODER_CASES + ENCODER_MODEL_CASES


@pytest.fixture
def device():
    from gpu_worker.device import open_device
    dev = open_device("cuda")
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")   # one NVRTC cache for the module's tests


@pytest.fixture
def compiler(device, kernel_dir):
    from gpu_worker.compile import KernelCompiler
    return KernelCompiler(device.info.arch, cache_dir=kernel_dir)


@pytest.mark.parametrize("case", CASES, ids=[c.id[:80] for c in CASES])
def test_cuda_masked_encoder_kernel_matches_its_numpy_reference(device, compiler, case) -> None:
    with KernelHarness(device, compiler) as h:
        failure = case.run(h, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id[:80]}: {failure}"


def _ragged(cfg, lengths: list[int]) -> list[list[int]]:
    return [[(b * 131 + t * 17 + 3) % cfg.vocab_size for t in range(n)]
            for b, n in enumerate(lengths)]


def test_cuda_padded_small_encoder_batch_gives_each_sequence_its_solo_embedding(device, compiler):
    cfg = CONFIGS["small-encoder"]
    ex = ModelExecutor(device, compiler, max_plans=4)
    model = EncoderModel(ex, cfg, 1, bucketed=True)
    model.load()
    try:
        sequences = _ragged(cfg, [1, 200, 37, 5, 128, 64, 255, 9, 100, 2, 17, 250])
        batched = model.embed(sequences)
        solo = np.stack([model.embed([s])[0] for s in sequences])
        np.testing.assert_allclose(batched, solo, rtol=0, atol=SOLO_ATOL,
                                   err_msg="padding changed a real row on the device")
        b, s = padded_shape([len(x) for x in sequences], cfg.max_context)
        want = R.EncoderReference(cfg, W.load_host(cfg, 1)).embed(sequences, rows=b * s)
        np.testing.assert_allclose(batched, want, rtol=1e-2, atol=2e-3,
                                   err_msg="padded batch differs from the NumPy reference")
    finally:
        ex.close()


def test_cuda_concurrent_runtime_embeds_share_batches_with_solo_results(kernel_dir) -> None:
    from gpu_worker import WorkerConfig, WorkerRuntime
    rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=kernel_dir, max_plans=8,
                                    embed_batch_wait_ms=100.0)).start()
    try:
        rt.load_model("enc", "encoder", "small-encoder", 2)
        cfg = CONFIGS["small-encoder"]
        requests = [_ragged(cfg, [3 + (i * 29) % 120]) for i in range(16)]
        solo = [rt.embed("enc", r) for r in requests]
        before = rt.stats()["embed_batch"]["batches"]
        barrier = threading.Barrier(len(requests))

        def one(r):
            barrier.wait()
            return rt.embed("enc", r)

        with ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(one, requests))
        ran = rt.stats()["embed_batch"]["batches"] - before
        assert ran < len(requests), f"16 concurrent calls ran as {ran} batches"
        for i, (g, s) in enumerate(zip(got, solo, strict=True)):
            np.testing.assert_allclose(g, s, rtol=0, atol=SOLO_ATOL, err_msg=f"request {i}")
    finally:
        rt.close()
