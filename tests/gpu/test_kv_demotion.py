"""Cached prefix blocks demoted to pinned host and promoted back, on the real device: a prefix's
KV blocks keep every byte through the round trip (D2H at eviction, H2D at the hit, on the
compute stream), and a promoted prefix gives the tokens the same prefix gives when its blocks
stayed on the device, alone and through the runtime under a pool its requests outgrow (the sim
twins are in tests/scheduler/test_kv_demotion.py). Run on the GPU machine:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_kv_demotion.py -s
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.models.configs import get_config
from tests.scheduler.demotion_scenario import demoted_and_cached_runs

pytestmark = pytest.mark.gpu

CFG = get_config("small", "decoder")
BT = 16


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc-gpu-kv-demotion")


@pytest.fixture
def device():
    dev = open_device("cuda")
    yield dev
    dev.close()


def test_on_cuda_a_promoted_prefix_keeps_its_bytes_and_gives_the_tokens_of_a_device_hit(
        device, cache_dir) -> None:
    out = demoted_and_cached_runs(device, KernelCompiler(device.info.arch, cache_dir=cache_dir),
                                  CFG, 3, 16)
    s = out["stats"]
    print({k: v for k, v in s.items() if "demot" in k or "promot" in k or "host" in k})
    assert s["kv_blocks_demoted"] >= 4 and s["kv_blocks_promoted"] == 4, s
    for i, (a, b) in enumerate(zip(out["before"], out["after"], strict=True)):
        assert np.array_equal(a, b), f"prefix block {i} lost its bytes through pinned host"
    assert out["promoted"] == out["cached"], "a promoted prefix gave other tokens than on device"


def test_on_cuda_the_runtime_promotes_a_prefix_its_pool_evicted(cache_dir) -> None:
    """A 10-block pool: P + s1 caches P (4 blocks), P + s2 hits it on the device (the
    reference), a 140-token request evicts P (demoted: a prefill rate of 1 token/s makes every
    round trip pay), then P + s2 again is promoted and must equal the reference."""
    block_bytes = BT * 2 * CFG.layers * CFG.kv_heads * CFG.head_dim * 2
    rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=cache_dir, kv_block_tokens=BT,
                                    kv_pool_bytes=10 * block_bytes, max_batch_size=4,
                                    max_step_tokens=64, kv_swap_prefill_rate=1.0)).start()
    try:
        rt.load_model("m", "decoder", "small", 3)
        prefix = [(k * 13 + 3) % CFG.vocab_size for k in range(4 * BT)]

        def gen(prompt: list[int], n: int) -> list[int]:
            return [c[0] for c in rt.generate("m", prompt, n)]
        gen(prefix + [1, 2, 3], 8)
        reference = gen(prefix + [4, 5], 16)
        gen([(k * 29 + 7) % CFG.vocab_size for k in range(120)], 20)
        before = rt._get("m").scheduler.stats()
        assert before["kv_blocks_demoted"] > 0, before
        got = gen(prefix + [4, 5], 16)
        sched = rt._get("m").scheduler.stats()
        print({k: v for k, v in sched.items() if "demot" in k or "promot" in k or "host" in k})
        assert sched["kv_blocks_promoted"] > before["kv_blocks_promoted"], sched
        assert got == reference, "the promoted prefix gave other tokens than its device hit"
        assert rt.stats()["arena"]["faults"] == 0
        assert rt.kv_host.budget.in_use == sched["kv_host_cached_bytes"] + sched["kv_swap_host_bytes"]
    finally:
        rt.close()
