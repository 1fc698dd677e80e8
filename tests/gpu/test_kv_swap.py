"""The KV tier in pinned host memory on the real device: KV blocks copied to pinned host and back
keep their bytes (non-contiguous blocks, runs of consecutive ones), the load-time probe measures
the pinned copy rates, and a decoder preempted with its KV swapped out and back gives the tokens
it gives unpreempted, alone and through the runtime under a pool too small for its streams
(the sim twins are in tests/scheduler/test_kv_swap.py). Run on the GPU machine:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_kv_swap.py -s
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.kv_swap import (
    READY_BLOCKS,
    HostKVBudget,
    KVSwap,
    measure_copy_rates,
)
from gpu_worker.models.configs import get_config
from tests.scenarios import swapped_and_plain_runs

pytestmark = pytest.mark.gpu

CFG = get_config("small", "decoder")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc-gpu-kv-swap")


@pytest.fixture
def device():
    dev = open_device("cuda")
    yield dev
    dev.close()


def test_on_cuda_blocks_swapped_to_pinned_host_and_back_keep_their_bytes(device) -> None:
    rates = measure_copy_rates(device)
    print(f"pinned copy rates: h2d {rates.h2d_bytes_per_s / 1e9:.1f} GB/s, "
          f"d2h {rates.d2h_bytes_per_s / 1e9:.1f} GB/s")
    assert rates.h2d_bytes_per_s > 1e9 and rates.d2h_bytes_per_s > 1e9, rates
    geo = KVGeometry(CFG.layers, CFG.kv_heads, CFG.head_dim, 16, CFG.max_context)
    pool = KVBlockPool(device.arena, geo, 64)
    budget = HostKVBudget(64 * geo.block_bytes)
    swap = KVSwap(device, pool, budget, rates)
    blocks = pool.allocate(12)
    try:
        out = [blocks[i] for i in (0, 1, 2, 5, 7, 8, 11)]      # runs of 3, 1 and 2, then 1
        rng = np.random.default_rng(7)
        data = {b: rng.integers(0, 256, geo.block_bytes, dtype=np.uint8) for b in out}
        for b, d in data.items():
            device.to_device(pool.base + b * pool.block_bytes, d)
        rec = swap.swap_out(out, 7 * 16)
        assert rec is not None and budget.in_use == swap.host_bytes
        assert swap.host_bytes - swap.spare_bytes == 7 * geo.block_bytes
        for b in out:                    # queued behind the swap-out copies on the stream
            device.memset(pool.base + b * pool.block_bytes, 0, pool.block_bytes)
        into = [blocks[i] for i in (11, 10, 3, 4, 6, 9, 0)]
        swap.swap_in(rec, into)
        device.synchronize()
        for src, dst in zip(out, into, strict=True):
            got = device.from_device(pool.base + dst * pool.block_bytes, pool.block_bytes)
            assert np.array_equal(got, data[src]), f"block {src} -> {dst} lost its bytes"
        swap.collect(wait=True)
        assert budget.in_use == swap.host_bytes == 0
    finally:
        pool.free(blocks)
        swap.close()
        pool.close()


def test_on_cuda_a_decoder_swapped_out_and_in_gives_the_tokens_it_gives_unpreempted(
        device, cache_dir) -> None:
    runs, stats = swapped_and_plain_runs(device, KernelCompiler(device.info.arch,
                                                                cache_dir=cache_dir), CFG, 3, 16)
    print({k: v for k, v in stats.items() if "swap" in k})
    assert stats["kv_swap_outs"] >= 1 and stats["kv_swapped_in_blocks"] > 0, stats
    assert runs["swapped"] == runs["plain"], "a swapped stream differs from its unpreempted run"


def _streams(cache_dir, **cfg) -> tuple[list[list[int]], dict, dict]:
    """4 concurrent streams of 40 + 40 tokens (5 blocks each) through a 10-block pool."""
    rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=cache_dir,
                                    kv_pool_bytes=10 * 16 * 2 * CFG.layers * CFG.kv_heads
                                    * CFG.head_dim * 2, max_batch_size=4,
                                    max_step_tokens=64, **cfg)).start()
    try:
        rt.load_model("m", "decoder", "small", 3)
        prompts = [[(i * 53 + k * 5 + 2) % CFG.vocab_size for k in range(40)] for i in range(4)]
        solo = [[c[0] for c in rt.generate("m", p, 40)] for p in prompts]
        outs: list[list[int]] = [[] for _ in prompts]

        def client(i: int) -> None:
            outs[i] = [c[0] for c in rt.generate("m", prompts[i], 40)]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert outs == solo, "a stream differs from its solo run"
        stats = rt.stats()
        assert stats["arena"]["faults"] == 0
        swap = rt._get("m").scheduler.kv_swap     # a client that saw its end sees it idle
        trimmable = swap.slab.trimmable_bytes(READY_BLOCKS) if swap is not None else 0
        return outs, stats["scheduler"], {**rt._get("m").scheduler.stats(),
                                          "trimmable": trimmable}
    finally:
        rt.close()


def test_on_cuda_the_runtime_swaps_preempted_kv_and_its_streams_equal_their_solo_runs(
        cache_dir) -> None:
    swapped, stats, sched = _streams(cache_dir)
    plain, plain_stats, _ = _streams(cache_dir, kv_swap=False)
    print({k: v for k, v in sched.items() if "swap" in k or k == "preemptions"})
    assert stats["preemptions"] > 0 and stats["kv_swapped_out_blocks"] > 0, stats
    assert stats["kv_swapped_in_blocks"] == stats["kv_swapped_out_blocks"]
    # idle: no slot holds a swapped sequence, and the slab freed every chunk with no slot out
    # beyond the free slots it keeps ahead for demotions
    assert sched["kv_swap_host_bytes"] == sched["kv_swap_host_free_bytes"], sched
    assert sched["trimmable"] == 0, "idle kept a chunk beyond those ahead"
    assert plain_stats["kv_swapped_out_blocks"] == 0
    assert swapped == plain
