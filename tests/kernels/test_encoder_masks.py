"""The encoder's padding masks (attention keys, mean pooling) on the sim backend, in the encoder
graph's layout, with poisoned padding (gpu_worker.kernels.selfcheck.encoder)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.kernels import attention
from gpu_worker.kernels.selfcheck import KernelHarness
from gpu_worker.kernels.selfcheck.encoder import ENCODER_CASES, encoder_attention_case


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    device = open_device("sim")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.mark.parametrize("case", ENCODER_CASES, ids=[c.id for c in ENCODER_CASES])
def test_masked_encoder_kernel_matches_its_numpy_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id}: {failure}"


def test_the_case_fails_when_the_mask_is_dropped(harness, monkeypatch) -> None:
    """Negative control: attention without `lens` reads the poisoned padding and the case says so."""
    real = attention.launch_attention_prefill

    def unmasked(device, fn, out, q, k, v, lens, *rest, **kw):
        real(device, fn, out, q, k, v, 0, *rest, **kw)

    monkeypatch.setattr("gpu_worker.kernels.selfcheck.encoder.launch_attention_prefill", unmasked)
    outcome = encoder_attention_case(harness, np.random.default_rng(0), seq=33, heads=2,
                                     head_dim=16, lengths=[33, 5])
    assert outcome.failure() is not None, "padding leaked into real rows and the case passed"
