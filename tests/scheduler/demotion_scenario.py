"""The demotion scenario shared by the sim test (tests/scheduler/test_kv_demotion.py) and its GPU
twin (tests/gpu/test_kv_demotion.py): the same steps on the real paged decoder, the backend
differs."""
from __future__ import annotations

import numpy as np


def demoted_and_cached_runs(device, compiler, cfg, seed: int, new_tokens: int) -> dict:
    """A paged decoder serves prefix P + suffix A, then P + B with P's blocks cached on the device
    ("cached"); a reclaim's cached-KV step then evicts every cached block (demoted to pinned
    host), and P + B runs again, its prefix promoted back ("promoted"). Returns both runs' tokens,
    P's block bytes before the eviction and after the promotion, and the scheduler's stats after
    the promoted run. Asserts every host byte is given back at close."""
    from gpu_worker.engines.scheduler.kv_swap import HostKVBudget, KVSwap, measure_copy_rates
    from gpu_worker.engines.scheduler.prefix_cache import chain_hashes
    from gpu_worker.engines.scheduler.scheduler import Scheduler
    from gpu_worker.execution.executor import ModelExecutor
    from gpu_worker.models.paged import PagedDecoderModel

    rates = measure_copy_rates(device)
    model = PagedDecoderModel(ModelExecutor(device, compiler), cfg, seed, max_batch_size=4,
                              prefill_chunk=32)
    model.load()
    pool = model.pool
    bt = pool.geometry.block_tokens
    budget = HostKVBudget(1 << 30)
    # a prefill rate of 1 token/s: a round trip through host always pays (the rule is tested
    # on its own; here the copies are)
    sched = Scheduler(model, pool, thread=False, max_batch_size=4,
                      kv_swap=KVSwap(device, pool, budget, rates), prefill_tokens_per_s=1.0)
    prefix = [(k * 13 + 3) % cfg.vocab_size for k in range(4 * bt)]
    suffix_a = [(k * 7 + 5) % cfg.vocab_size for k in range(9)]
    suffix_b = [(k * 11 + 2) % cfg.vocab_size for k in range(5)]
    keys = chain_hashes(sched._root, prefix, bt)

    def run(prompt: list[int]) -> list[int]:
        seq = sched.submit(prompt, new_tokens)
        for _ in range(400):
            if not sched.busy():
                break
            sched.step()
        assert not sched.busy()
        return list(seq.generated)

    def block_bytes() -> list[np.ndarray]:
        device.synchronize()
        blocks = pool.index.lookup(keys)
        assert len(blocks) == len(keys), f"only {len(blocks)} of P's {len(keys)} blocks on the device"
        return [device.from_device(pool.base + b * pool.block_bytes, pool.block_bytes).copy()
                for b in blocks]

    try:
        run(prefix + suffix_a)
        before = block_bytes()
        cached = run(prefix + suffix_b)
        assert sched.release_cached(1 << 40) > 0, "the reclaim released nothing"
        assert pool.match(keys) == 0 and sched.host_cache.match(keys) == len(keys), \
            "P's blocks were not demoted to host"
        promoted = run(prefix + suffix_b)
        after = block_bytes()
        stats = sched.stats()
    finally:
        sched.close()
        model.executor.close()
        model.close()
    assert budget.in_use == 0, "host bytes left booked after the scheduler closed"
    return {"cached": cached, "promoted": promoted, "before": before, "after": after,
            "stats": stats}
