"""Cached prefix blocks demoted to pinned host instead of dropped (kv_demote.py, sim backend):
the device-token runner keeps each token in the pool's device memory, so a promoted block
carries its prefix only if the copies really moved its bytes. Tokens are the same with demotion
on and off, a prefix used again and evicted from the device is promoted on its next hit
instead of prefilled, a prefix seen once is dropped (no evidence of reuse),
the host budget bounds the demoted blocks (oldest dropped first, never a swapped sequence's
copy), a refused copy falls back to drop or prefill, and no block nor host byte leaks."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from gpu_worker.engines.scheduler.kv_demote import HostPrefixCache
from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.kv_swap import CopyRates, HostKVBudget, KVSwap
from gpu_worker.engines.scheduler.prefix_cache import chain_hashes, root_key
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.models.configs import get_config
from tests.device.conftest import make_device
from tests.scheduler.demotion_scenario import demoted_and_cached_runs
from tests.scheduler.runners import DeviceTokenRunner, solo
from tests.sim_fixtures import compiler, device, kernel_cache_dir  # noqa: F401

GEO = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=512)
BT = GEO.block_tokens
FAST = CopyRates(1e12, 1e12, "configured")      # copies next to free: demotion always pays
SLOW = CopyRates(1.0, 1.0, "configured")        # a byte a second: never worth a copy


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


def make(dev, capacity=12, chunk=16, host_blocks=64, demote=True, rates=FAST,
         prefill_rate=1000.0, **kw):
    pool = KVBlockPool(dev.arena, GEO, capacity)
    runner = DeviceTokenRunner(dev, pool, GEO, capacity, chunk)
    budget = HostKVBudget(host_blocks * GEO.block_bytes)
    swap = KVSwap(dev, pool, budget, rates)
    sched = Scheduler(runner, pool, thread=False, kv_swap=swap, kv_demote=demote,
                      prefill_tokens_per_s=prefill_rate, **kw)
    return sched, pool, budget, swap


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 31 + k * 7) % 1000 for k in range(n)]


def check(sched: Scheduler, pool: KVBlockPool, budget: HostKVBudget, swap: KVSwap) -> None:
    """Every device block is used, cached or free; every host byte is in the budget, and the
    budget holds the swapped sequences' copies and the demoted blocks."""
    used, cached, free = pool.used_blocks(), pool.cached_blocks(), pool.free_blocks()
    assert used + cached + free == pool.usable_blocks, \
        f"device blocks leaked: used {used} + cached {cached} + free {free} != {pool.usable_blocks}"
    assert budget.in_use == swap.host_bytes <= budget.limit_bytes, \
        f"host bytes {swap.host_bytes} are not the budget's {budget.in_use}"
    host = sched.host_cache
    hosted = host.nbytes if host is not None else 0
    if host is not None:
        assert hosted == host.blocks * GEO.block_bytes, "a demoted block's bytes are not counted"
    held = sum(s.swapped.nbytes for s in sched._all() if s.swapped is not None)
    assert swap.host_bytes >= held + hosted, "a swapped sequence's or demoted block's bytes unbooked"


def settled(sched: Scheduler, budget: HostKVBudget, swap: KVSwap) -> None:
    """Every copy ran and no sequence is swapped out: the budget books the slab's chunks, the
    slots out are the demoted blocks', and no chunk beyond the free slots kept ahead is left."""
    swap.collect(wait=True)
    assert budget.in_use == swap.host_bytes, "the budget holds bytes that are not the slab's"
    hosted = sched.host_cache.nbytes if sched.host_cache is not None else 0
    assert swap.host_bytes - swap.spare_bytes == hosted, "a slot is out for no one"
    assert swap.slab.trimmable_bytes(swap.slab.keep) == 0, "idle kept a chunk with no slot out"


def drain(sched, pool, budget, swap, limit=20_000) -> None:
    steps = 0
    while sched.busy() and steps < limit:
        sched.step()
        check(sched, pool, budget, swap)
        steps += 1
    assert not sched.busy(), "the scheduler never finished"


def run(sched, pool, budget, swap, prompt, max_new=4):
    seq = sched.submit(prompt, max_new)
    drain(sched, pool, budget, swap)
    return seq.generated


PREFIX = prompt_of(1, 4 * BT)       # four full blocks


def run_shared_prefix(sched, pool, budget, swap) -> list[int]:
    """PREFIX + [1], then PREFIX + [4], which shares its four cached blocks: the evidence of
    reuse the host tier asks before it demotes a block. The first stream."""
    first = run(sched, pool, budget, swap, PREFIX + [1])
    run(sched, pool, budget, swap, PREFIX + [4])
    return first


def evict_and_hit(dev, demote: bool, fail: str | None = None):
    """A 4-block prefix runs twice, an unrelated 10-block request evicts its tail from the
    12-block pool (LRU: tail first), then the prefix is asked again. Returns the last stream,
    the scheduler's counters around the hit, and the scheduler."""
    sched, pool, budget, swap = make(dev, demote=demote)
    first = run_shared_prefix(sched, pool, budget, swap)
    assert first == solo(PREFIX + [1], 4)
    assert pool.cached_blocks() == 4
    run(sched, pool, budget, swap, prompt_of(2, 150), 10)
    assert pool.match(chain_hashes(sched._root, PREFIX, BT)) < 4, "the prefix was not evicted"
    before = dict(sched.stats())
    if fail is not None:
        dev.backend.fail_next(fail)
    out = run(sched, pool, budget, swap, PREFIX + [2, 3])
    after = sched.stats()
    delta = {k: after[k] - before[k] for k in after}
    return out, delta, after, (sched, pool, budget, swap)


def test_a_prefix_evicted_from_the_device_and_hit_again_is_promoted_and_prefills_less(dev):
    out, delta, stats, (sched, *_rest) = evict_and_hit(dev, demote=True)
    assert stats["kv_blocks_demoted"] >= 2, stats
    assert delta["kv_blocks_promoted"] == 2, "the prefix's host-resident tail was not promoted"
    assert delta["prefix_cache_hit_tokens"] == 4 * BT, "the hit did not cover the whole prefix"
    assert out == solo(PREFIX + [2, 3], 4)
    plain_out, plain_delta, _, (plain, *_) = evict_and_hit(make_device(), demote=False)
    assert plain_out == out, "tokens differ with demotion off"
    assert plain_delta["kv_blocks_promoted"] == 0 and plain.host_cache is None
    assert delta["prefill_tokens"] < plain_delta["prefill_tokens"], (delta, plain_delta)
    assert plain_delta["prefill_tokens"] - delta["prefill_tokens"] == 2 * BT
    sched.close()
    plain.close()


def test_a_failed_promotion_recomputes_with_the_right_tokens(dev):
    # the device-token runner writes through the sim's view: the only H2D copies are promotions
    out, delta, _, (sched, pool, budget, swap) = evict_and_hit(dev, True, "copy_h2d_async")
    assert delta["kv_promote_failed"] == 1 and delta["kv_blocks_promoted"] == 0, delta
    assert delta["prefix_cache_hit_tokens"] == 2 * BT, "a block whose copy failed counted as hit"
    assert out == solo(PREFIX + [2, 3], 4), "a failed promotion gave wrong KV"
    keys = chain_hashes(sched._root, PREFIX, BT)
    assert sched.host_cache.match(keys[2:]) == 0, "a taken host block was kept after its failure"
    assert pool.match(keys) == 4, "the recomputed blocks were not cached again"
    settled(sched, budget, swap)
    sched.close()
    assert budget.in_use == 0


def test_a_failed_demotion_drops_the_block_and_books_nothing(dev):
    sched, pool, budget, swap = make(dev)
    run_shared_prefix(sched, pool, budget, swap)
    dev.backend.fail_next("copy_d2h_async")
    run(sched, pool, budget, swap, prompt_of(2, 150), 10)
    stats = sched.stats()
    assert stats["kv_demote_failed"] == 1 and stats["kv_blocks_demoted"] >= 1, stats
    settled(sched, budget, swap)
    assert sched.host_cache.nbytes == stats["kv_host_cached_bytes"]
    assert run(sched, pool, budget, swap, PREFIX + [2, 3]) == solo(PREFIX + [2, 3], 4)
    sched.close()


def test_a_prefix_seen_once_is_dropped_at_eviction_and_demoted_once_it_comes_back(dev):
    """No evidence of reuse, no copy: a prompt's blocks that no later sequence shared are
    dropped when evicted, their keys remembered; when the prefix comes back it is prefilled
    again, and its next eviction demotes it, so the third time it is promoted."""
    sched, pool, budget, swap = make(dev)
    keys = chain_hashes(sched._root, PREFIX, BT)
    assert run(sched, pool, budget, swap, PREFIX + [1]) == solo(PREFIX + [1], 4)
    run(sched, pool, budget, swap, prompt_of(2, 150), 10)       # evicts the prefix's tail
    stats = sched.stats()
    assert pool.match(keys) < 4, "the prefix was not evicted"
    assert stats["kv_blocks_demoted"] == 0 and stats["kv_demote_declined"] >= 2, stats
    assert sched.host_cache.blocks == 0
    swap.collect(wait=True)
    assert swap.host_bytes == swap.spare_bytes, "a dropped block holds a host slot"
    assert run(sched, pool, budget, swap, PREFIX + [2, 3]) == solo(PREFIX + [2, 3], 4)
    assert sched.stats()["kv_blocks_promoted"] == 0, "promoted what was never demoted"
    run(sched, pool, budget, swap, prompt_of(3, 150), 10)       # evicts it again: demoted now
    assert sched.stats()["kv_blocks_demoted"] >= 2
    assert sched.host_cache.match(keys[pool.match(keys):]) > 0, "the tail is not on host"
    before = sched.stats()["kv_blocks_promoted"]
    assert run(sched, pool, budget, swap, PREFIX + [5]) == solo(PREFIX + [5], 4)
    assert sched.stats()["kv_blocks_promoted"] > before, "the demoted tail was not promoted"
    check(sched, pool, budget, swap)
    sched.close()
    assert budget.in_use == 0


def test_demotion_is_declined_when_the_round_trip_costs_more_than_the_prefill(dev):
    for rates, rate in ((SLOW, 1000.0), (FAST, 0.0)):     # slow copies; no prefill rate known
        d = make_device()
        sched, pool, budget, swap = make(d, rates=rates, prefill_rate=rate)
        run(sched, pool, budget, swap, PREFIX + [1])
        run(sched, pool, budget, swap, prompt_of(2, 150), 10)
        stats = sched.stats()
        assert stats["kv_demote_declined"] >= 2 and stats["kv_blocks_demoted"] == 0, stats
        assert budget.in_use == 0
        sched.close()
        d.close()


def test_tokens_are_identical_with_demotion_on_and_off(dev):
    rng = random.Random(26)
    prefixes = [prompt_of(100 + k, rng.choice((32, 48, 64))) for k in range(3)]
    plan = [(rng.choice(prefixes) + prompt_of(200 + i, rng.randrange(1, 20)), rng.randrange(1, 24))
            for i in range(24)]
    outs, counters = {}, {}
    for name, demote in (("on", True), ("off", False)):
        d = dev if demote else make_device()
        sched, pool, budget, swap = make(d, capacity=14, demote=demote, max_batch_size=3,
                                         max_step_tokens=48)
        seqs = []
        for prompt, max_new in plan:
            seqs.append(sched.submit(prompt, max_new))
            for _ in range(3):
                sched.step()
                check(sched, pool, budget, swap)
        drain(sched, pool, budget, swap)
        outs[name] = [s.generated for s in seqs]
        counters[name] = sched.stats()
        sched.close()
    assert counters["on"]["kv_blocks_promoted"] > 0, "the workload never promoted a block"
    assert outs["on"] == outs["off"], "tokens differ with demotion on and off"
    assert outs["on"] == [solo(p, n) for p, n in plan]
    assert counters["on"]["prefill_tokens"] < counters["off"]["prefill_tokens"], counters


def _named(pool: KVBlockPool, seed: int, n: int) -> tuple[list[int], list[bytes]]:
    """n fresh blocks, each written with its own bytes and named: a cached prefix once freed."""
    keys = chain_hashes(root_key("m", BT), prompt_of(seed, n * BT), BT)
    blocks = pool.allocate(n)
    for b, key in zip(blocks, keys, strict=True):
        pool.name(b, key)
    return blocks, keys


def test_the_host_budget_bounds_demoted_blocks_oldest_dropped_first_never_a_swapped_copy(dev):
    pool = KVBlockPool(dev.arena, GEO, 7)
    budget = HostKVBudget(4 * GEO.block_bytes)
    swap = KVSwap(dev, pool, budget, FAST)
    host = HostPrefixCache(swap, BT, lambda: 1000.0)
    pool.on_evict = host.demote
    seq_blocks = pool.allocate(1)
    swapped = swap.swap_out(seq_blocks, BT)         # a preempted sequence's copy: 1 block
    assert swapped is not None and budget.in_use == swap.host_bytes == budget.limit_bytes, \
        "the slab's first chunk is cut to the budget"
    assert swap.host_bytes - swap.spare_bytes == GEO.block_bytes
    old, old_keys = _named(pool, 1, 3)
    new, new_keys = _named(pool, 2, 3)
    pool.free(old)
    again = pool.allocate(3)            # the pool is full: the three cached blocks are evicted
    assert again is not None and host.match(old_keys) == 3
    dev.synchronize()                   # their copies out ran
    pool.free(new)
    fresh = pool.allocate(3)            # three more: the budget holds one copy + 3 blocks
    assert fresh is not None and pool.cached_blocks() == 0
    dev.synchronize()
    assert host.blocks == 3 and budget.in_use <= budget.limit_bytes, "the budget did not bound it"
    assert host.match(new_keys) == 3 and host.match(old_keys) == 0, \
        "not the oldest host blocks were dropped first"
    assert not swapped.released, "a demotion dropped a swapped-out sequence's host copy"
    assert host.counters["kv_host_cache_evictions"] == 3
    assert budget.in_use == swap.host_bytes
    assert swap.host_bytes - swap.spare_bytes == swapped.nbytes + host.nbytes
    # a swap-out that does not fit drops host blocks (oldest first) and goes first
    more = again[:2]
    assert host.make_room(2 * GEO.block_bytes) and host.blocks == 1
    assert host.match(new_keys[:1]) == 1, "the prefix's head went before its tail"
    rec = swap.swap_out(more, 2 * BT)
    assert rec is not None and budget.in_use == budget.limit_bytes
    for r in (swapped, rec):
        swap.release(r)
    host.clear()
    swap.close()
    assert budget.in_use == swap.host_bytes == 0
    pool.free(seq_blocks + again + fresh)
    pool.close()


def test_no_demotion_while_this_thread_captures(dev):
    pool = KVBlockPool(dev.arena, GEO, 16)
    swap = KVSwap(dev, pool, HostKVBudget(1 << 20), FAST)
    host = HostPrefixCache(swap, BT, lambda: 1000.0)
    blocks, keys = _named(pool, 3, 2)
    with dev.gate.exclusive():          # a copy queued now would join the captured graph
        host.demote(list(zip(blocks, keys, strict=True)))
    assert host.blocks == 0 and host.counters["kv_demote_declined"] == 2
    assert swap.host_bytes == 0
    pool.free(blocks)
    pool.close()


def test_a_failed_step_drops_every_host_block(dev):
    sched, pool, budget, swap = make(dev)
    run_shared_prefix(sched, pool, budget, swap)
    run(sched, pool, budget, swap, prompt_of(2, 150), 10)
    assert sched.host_cache.blocks > 0
    runner = sched.runner.inner
    real = runner.decode

    def broken(rows):
        runner.decode = real
        raise RuntimeError("injected step failure")
    runner.decode = broken
    sched.submit(prompt_of(3, 20), 5)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(50):
            sched.step()
    assert sched.host_cache.blocks == 0, "a host block outlived a failed step"
    swap.collect(wait=True)
    assert budget.in_use == swap.host_bytes == 0
    assert run(sched, pool, budget, swap, PREFIX + [2, 3]) == solo(PREFIX + [2, 3], 4)
    sched.close()


@pytest.mark.parametrize("seed", [26, 2027, 5])
def test_a_fuzz_of_starts_cancels_preemptions_and_reclaims_keeps_both_tiers_booked(dev, seed):
    rng = random.Random(seed)
    sched, pool, budget, swap = make(dev, capacity=14, host_blocks=6, max_batch_size=5,
                                     max_step_tokens=64)
    prefixes = [prompt_of(300 + k, rng.choice((16, 40, 64, 90))) for k in range(4)]
    live: list[tuple[list[int], int, object]] = []
    cancelled: set[int] = set()
    for _ in range(400):
        if rng.random() < 0.35 and len(live) < 48:
            p = rng.choice(prefixes)[:rng.randrange(1, 91)] + prompt_of(rng.randrange(1000),
                                                                          rng.randrange(0, 20))
            n = rng.randrange(1, 30)
            live.append((p, n, sched.submit(p, n)))
        if rng.random() < 0.05 and live:
            i = rng.randrange(len(live))
            live[i][2].cancel()
            cancelled.add(i)
        if rng.random() < 0.06:
            sched.preempt_newest()          # the reclaim order's last step
            check(sched, pool, budget, swap)
        if rng.random() < 0.06:
            in_use = dict(pool._refs)
            sched.release_cached(rng.randrange(1, 3) * GEO.block_bytes)   # the cached_kv step
            assert pool._refs == in_use, "a reclaim touched a block in use"
            check(sched, pool, budget, swap)
        if rng.random() < 0.02:     # the next copy that way fails: drop, prefill or recompute
            dev.backend.fail_next(rng.choice(["copy_h2d_async", "copy_d2h_async"]))
        sched.step()
        check(sched, pool, budget, swap)
    drain(sched, pool, budget, swap)
    c = sched.stats()
    assert c["kv_blocks_demoted"] > 0 and c["kv_blocks_promoted"] > 0, c
    assert c["kv_host_cache_evictions"] > 0, "the host budget never bounded the demoted blocks"
    assert pool.used_blocks() == 0
    settled(sched, budget, swap)
    assert sched.host_cache.nbytes == c["kv_host_cached_bytes"]
    assert c["kv_swap_host_bytes"] == c["kv_swap_host_free_bytes"], \
        "a swapped sequence's slots stayed out"
    for i, (p, n, s) in enumerate(live):
        want = solo(p, n)
        if i in cancelled:
            assert s.generated == want[:len(s.generated)]
        else:
            assert s.generated == want, f"stream {i} differs"
    sched.close()
    assert budget.in_use == 0, "closing the scheduler left host bytes booked"


# -- the real paged decoder on the sim backend, with the measured copy rates ---------------------
def test_the_paged_decoder_promotes_demoted_prefix_blocks_with_their_bytes_and_tokens(
        device, compiler):  # noqa: F811
    out = demoted_and_cached_runs(device, compiler, get_config("tiny", "decoder"), 5, 8)
    s = out["stats"]
    assert s["kv_blocks_demoted"] >= 4 and s["kv_blocks_promoted"] == 4, s
    for i, (a, b) in enumerate(zip(out["before"], out["after"], strict=True)):
        assert np.array_equal(a, b), f"prefix block {i} lost its bytes through host"
    assert out["promoted"] == out["cached"], "a promoted prefix gave other tokens than on device"


# -- the worker: GetStats, its proto and the Prometheus gauges ------------------------------------
def test_demoted_and_promoted_blocks_show_in_getstats_its_proto_and_the_metrics(kernel_cache_dir):  # noqa: F811
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.messages import stats_message
    from gpu_worker.edge.metrics import WorkerCollector

    cfg = get_config("tiny", "decoder")
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    kv_pool_bytes=10 * 4096, max_batch_size=4,
                                    max_step_tokens=64, kv_swap_prefill_rate=1.0)).start()
    try:
        rt.load_model("m", "decoder", "tiny", 3)
        prefix = [(k * 13 + 3) % cfg.vocab_size for k in range(4 * BT)]

        def gen(prompt: list[int], n: int) -> list[int]:
            return [c[0] for c in rt.generate("m", prompt, n)]
        gen(prefix + [1, 2, 3], 4)
        reference = gen(prefix + [4, 5], 8)          # P's blocks hit on the device
        gen([(k * 29 + 7) % cfg.vocab_size for k in range(120)], 20)   # evicts them: demoted
        assert gen(prefix + [4, 5], 8) == reference, "the promoted prefix gave other tokens"
        out = rt.stats()
        registry = CollectorRegistry()
        registry.register(WorkerCollector(rt))
        text = generate_latest(registry).decode()
        budget_in_use = rt.kv_host.budget.in_use
    finally:
        rt.close()
    s = out["scheduler"]
    fields = ("kv_blocks_demoted", "kv_blocks_promoted", "kv_host_cached_blocks",
              "kv_host_cached_bytes")
    assert s["kv_blocks_demoted"] > 0 and s["kv_blocks_promoted"] > 0, s
    assert s["kv_host_cached_bytes"] == s["kv_host_cached_blocks"] * 4096
    assert s["kv_host_cached_bytes"] + s["kv_swap_host_bytes"] == budget_in_use, \
        "the host budget holds bytes that neither counter shows"
    msg = stats_message(out).scheduler
    assert {f: getattr(msg, f) for f in fields} == {f: s[f] for f in fields}
    samples = {m.name: m.value for f in text_string_to_metric_families(text) for m in f.samples}
    for f in fields:
        assert samples[f"gpuplane_worker_scheduler_{f}"] == s[f], f
    assert samples["gpuplane:kv_blocks_demoted_total"] == s["kv_blocks_demoted"]
    assert samples["gpuplane:kv_blocks_promoted_total"] == s["kv_blocks_promoted"]
    assert samples["gpuplane:kv_host_cached_bytes"] == s["kv_host_cached_bytes"]


def test_with_buffers_pinned_ahead_a_demotion_never_pins_on_the_engine_thread(dev):
    """The runtime's KVSwap keeps free slots pinned ahead on the slab's own thread
    (pinned_slab.py): an evicted cached block is copied into a free slot, and with none free
    while the budget has room it is dropped (declined), never pinned on the step path. The
    prefix still comes back from host, and every host byte is booked and given back."""
    pool = KVBlockPool(dev.arena, GEO, 12)
    runner = DeviceTokenRunner(dev, pool, GEO, 12, 16)
    budget = HostKVBudget(64 * GEO.block_bytes)
    swap = KVSwap(dev, pool, budget, FAST, ready_blocks=8)
    sched = Scheduler(runner, pool, thread=False, kv_swap=swap, prefill_tokens_per_s=1000.0)
    engine = threading.get_ident()
    pins: list[int] = []
    alloc = dev.alloc_pinned
    dev.alloc_pinned = lambda n: (pins.append(threading.get_ident()), alloc(n))[1]

    def serve(prompt, new=4):
        seq = sched.submit(prompt, new)
        for _ in range(20_000):
            if not sched.busy():
                return seq.generated
            sched.step()
        raise AssertionError("the scheduler never finished")
    assert swap.slab.wait_free(8, timeout_s=10), "not pinned ahead from the start"
    assert serve(PREFIX + [1]) == solo(PREFIX + [1], 4)
    serve(PREFIX + [4])                          # shares the prefix: evidence of reuse
    serve(prompt_of(2, 150), 10)                 # evicts the prefix's tail: demoted
    before = dict(sched.stats())
    assert serve(PREFIX + [2, 3]) == solo(PREFIX + [2, 3], 4)
    after = sched.stats()
    assert after["kv_blocks_promoted"] - before["kv_blocks_promoted"] > 0, "nothing came back"
    assert after["kv_blocks_demoted"] > 0 and engine not in pins, \
        "a pinned buffer was allocated on the engine thread"
    assert swap.slab.wait_free(8, timeout_s=10), "idle kept fewer than pinned ahead"
    assert budget.in_use == swap.host_bytes, "a free or demoted slot is not booked"
    sched.close()
    assert budget.in_use == swap.host_bytes == 0
