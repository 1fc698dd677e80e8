"""The prefix cache on the paged KV pool (sim arena, token-pool runner): hits prefill only the
rest, whole blocks only, a shared block is never written, tokens as with caching off, the pool's
block states always add up, and cached blocks are what a shrink for reclaim takes first."""
from __future__ import annotations

import random

import pytest

from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.prefix_cache import PrefixIndex, chain_hashes, root_key
from gpu_worker.engines.scheduler.scheduler import Scheduler
from tests.device.conftest import GRANULE, make_device
from tests.scheduler.runners import TokenPoolRunner, solo

# 4 KiB blocks: 16 per 64 KiB sim granule
GEO = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=1024)
BT = GEO.block_tokens


class NoSharedWriteRunner(TokenPoolRunner):
    """The token-pool runner that fails on any write into a named block: the scheduler names a
    block only after the chunk that fills it (written here at once), so a named block written
    again is a write into a block that is, or may become, shared."""

    kv: KVBlockPool

    def _write(self, table, position, token):
        block = table[position // BT]
        assert not self.kv.index.is_named(block), \
            f"position {position} was written into named (shareable) KV block {block}"
        super()._write(table, position, token)


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


def make(dev, capacity=256, chunk=64, prefix_cache=True, **kw):
    pool = KVBlockPool(dev.arena, GEO, capacity)
    runner = NoSharedWriteRunner(GEO, capacity, chunk)
    runner.kv = pool
    sched = Scheduler(runner, pool, thread=False, prefix_cache=prefix_cache, **kw)
    return sched, runner, pool


def drain(sched: Scheduler, limit: int = 20_000) -> None:
    steps = 0
    while sched.busy() and steps < limit:
        sched.step()
        steps += 1
    assert not sched.busy(), "the scheduler never finished"


def tokens(prefix_seed: int, n: int, salt: int = 0) -> list[int]:
    rng = random.Random(prefix_seed * 1000 + salt)
    return [rng.randrange(1000) for _ in range(n)]


def check_states(pool: KVBlockPool) -> None:
    used, cached, free = pool.used_blocks(), pool.cached_blocks(), pool.free_blocks()
    assert used + cached + free == pool.usable_blocks, \
        f"blocks leaked: used {used} + cached {cached} + free {free} != {pool.usable_blocks}"


def run_all(sched: Scheduler, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    seqs = [sched.submit(p, max_new) for p in prompts]
    drain(sched)
    return [s.generated for s in seqs]


def test_fifteen_streams_sharing_a_cached_512_token_prefix_prefill_only_their_suffixes(dev):
    sched, _, pool = make(dev)
    prefix = tokens(1, 512)
    suffixes = [tokens(2, 3 + i, salt=i) for i in range(15)]
    first = run_all(sched, [prefix + tokens(3, 9)], 8)[0]
    assert first == solo(prefix + tokens(3, 9), 8)
    assert pool.cached_blocks() >= 512 // BT, "the first stream's prefix blocks were not cached"
    before = dict(sched.counters)
    prompts = [prefix + s for s in suffixes]
    outs = run_all(sched, prompts, 6)
    hit = sched.counters["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    prefilled = sched.counters["prefill_tokens"] - before["prefill_tokens"]
    assert hit == 15 * 512, f"hit {hit} tokens, not every stream's whole 512-token prefix"
    assert prefilled == sum(len(s) for s in suffixes), "a stream prefilled more than its suffix"
    assert (sched.counters["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
            == sum(len(p) for p in prompts))
    off, _, _ = make(make_device(), prefix_cache=False)
    assert outs == run_all(off, prompts, 6), "tokens differ with the prefix cache off"
    assert off.counters["prefix_cache_hit_tokens"] == 0 and off.pool.cached_blocks() == 0
    for p, out in zip(prompts, outs, strict=True):
        assert out == solo(p, 6)
    assert pool.used_blocks() == 0
    check_states(pool)
    sched.close()
    off.close()


def test_a_partially_matching_prefix_reuses_only_its_whole_blocks(dev):
    sched, _, pool = make(dev)
    base = tokens(4, 80)                      # 5 full blocks
    run_all(sched, [base], 2)
    # shares 40 tokens: blocks 0 and 1 whole, block 2 only in part
    other = base[:40] + tokens(5, 30)
    before = sched.counters["prefix_cache_hit_tokens"]
    out = run_all(sched, [other], 4)[0]
    assert sched.counters["prefix_cache_hit_tokens"] - before == 2 * BT, \
        "a partly matching block was reused (or a whole one was not)"
    assert out == solo(other, 4)
    check_states(pool)
    sched.close()


def test_a_prompt_cached_to_a_block_boundary_recomputes_its_last_block(dev):
    sched, runner, _ = make(dev)
    prompt = tokens(6, 4 * BT)
    run_all(sched, [prompt], 3)
    calls = len(runner.prefill_calls)
    before = sched.counters["prefix_cache_hit_tokens"]
    out = run_all(sched, [prompt], 3)[0]
    assert sched.counters["prefix_cache_hit_tokens"] - before == 3 * BT
    assert runner.prefill_calls[calls:] == [BT], "the last block was not re-prefilled alone"
    assert out == solo(prompt, 3)
    sched.close()


def test_a_shared_block_is_reference_counted_and_cached_only_when_unreferenced(dev):
    sched, _, pool = make(dev)
    prefix = tokens(7, 3 * BT)
    run_all(sched, [prefix + [1]], 1)
    a = sched.submit(prefix + [2, 3], 50)
    b = sched.submit(prefix + [4, 5], 50)
    for _ in range(4):
        sched.step()
    assert a.table.blocks[:3] == b.table.blocks[:3], "the prefix blocks are not shared"
    shared = a.table.blocks[:3]
    assert all(pool._refs[blk] == 2 for blk in shared)
    a.cancel()
    sched.step()
    assert all(pool._refs[blk] == 1 for blk in shared), "the cancel did not drop its references"
    assert not any(pool.index.is_parked(blk) for blk in shared), "a referenced block was cached"
    b.cancel()
    drain(sched)
    assert all(pool.index.is_parked(blk) for blk in shared)
    check_states(pool)
    sched.close()


def test_a_named_block_counts_as_reused_once_a_later_sequence_shares_it_until_named_again(dev):
    """KVBlockPool.reused, the host tier's evidence: a prompt's blocks are not reused when named,
    are once a later sequence acquires them, and stop being when the block holds a new name."""
    sched, _, pool = make(dev)
    prefix = tokens(9, 2 * BT)
    keys = chain_hashes(sched._root, prefix, BT)
    run_all(sched, [prefix + [1]], 1)
    blocks = pool.index.lookup(keys)
    assert len(blocks) == 2 and not any(pool.reused(b) for b in blocks)
    run_all(sched, [prefix + [2]], 1)
    assert pool.index.lookup(keys) == blocks and all(pool.reused(b) for b in blocks)
    pool.forget()
    assert not any(pool.reused(b) for b in blocks), "a forgotten name kept its evidence"
    got = pool.allocate(1)
    pool.name(got[0], b"another prefix")
    assert not pool.reused(got[0])
    pool.free(got)
    sched.close()


def test_eviction_takes_free_blocks_first_then_the_least_recently_cached(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=16)
    root = root_key("m", BT)
    keys = chain_hashes(root, tokens(8, 4 * BT), BT)
    blocks = pool.allocate(4)
    for blk, key in zip(blocks, keys, strict=True):
        pool.name(blk, key)
    pool.free(blocks)
    assert pool.cached_blocks() == 4 and pool.free_blocks() == 12
    fresh = pool.allocate(12)
    assert not set(fresh) & set(blocks) and pool.cached_blocks() == 4, "a cached block went first"
    one = pool.allocate(1)
    assert one == [blocks[-1]], "the prefix's tail is not the first evicted"
    assert pool.match(keys) == 3
    check_states(pool)
    pool.close()


def test_the_pool_grows_only_once_no_cached_block_is_left(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=64)
    keys = chain_hashes(root_key("m", BT), tokens(12, 16 * BT), BT)
    blocks = pool.allocate(16)                 # one granule, all of it
    for blk, key in zip(blocks, keys, strict=True):
        pool.name(blk, key)
    pool.free(blocks)
    committed = pool.committed
    assert pool.allocate(10) is not None and pool.committed == committed, \
        "the pool committed a granule while cached blocks could serve"
    assert pool.allocate(10) is not None and pool.committed == 2 * committed
    assert pool.cached_blocks() == 0, "a growth left cached blocks behind"
    check_states(pool)
    pool.close()


def test_a_shrink_for_reclaim_evicts_cached_top_blocks_and_never_a_used_one(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=64)
    keys = chain_hashes(root_key("m", BT), tokens(9, 48 * BT), BT)
    blocks = pool.allocate(48)                 # 3 granules
    for blk, key in zip(blocks, keys, strict=True):
        pool.name(blk, key)
    used = blocks[:5]
    pool.free(blocks[5:])                      # cached: the rest of granule 0, granules 1 and 2
    assert pool.shrink() == 0, "the idle shrink dropped cached blocks"
    booked = dev.ledger.snapshot()["kv"][0]
    assert pool.cached_releasable_bytes() == 2 * GRANULE
    assert pool.shrink(evict_cached=True, need_bytes=1) == GRANULE, "it took more than asked"
    assert pool.shrink(evict_cached=True) == GRANULE
    dev.queue.drain()            # the fenced releases
    assert dev.ledger.snapshot()["kv"][0] == booked - 2 * GRANULE
    assert all(pool._refs.get(b) == 1 for b in used), "a block in use was evicted"
    assert pool.cached_blocks() == 11, "cached blocks below the used one were evicted for nothing"
    check_states(pool)
    pool.close()


def test_a_failed_step_forgets_every_name(dev):
    sched, runner, pool = make(dev)
    run_all(sched, [tokens(10, 5 * BT)], 2)
    assert pool.cached_blocks() > 0
    boom = RuntimeError("device fault")

    def fail(*a, **k):
        raise boom
    runner.decode = fail
    seq = sched.submit(tokens(11, 20), 5)
    with pytest.raises(RuntimeError):
        for _ in range(5):
            sched.step()
    assert seq.state == "finished" and len(pool.index) == 0 and pool.cached_blocks() == 0
    check_states(pool)
    sched.close()


def test_the_index_maps_a_key_to_one_block(dev):
    index = PrefixIndex()
    assert index.name(3, b"k") and not index.name(4, b"k"), "a key named two blocks"
    assert index.lookup([b"k", b"x"]) == [3]


@pytest.mark.parametrize("seed", range(6))
def test_a_fuzz_of_starts_cancels_preemptions_and_reclaims_never_leaks_a_block(dev, seed):
    rng = random.Random(seed)
    prefixes = [tokens(100 + k, rng.choice((16, 40, 64, 100))) for k in range(4)]
    # small enough that admission waits and decodes preempt
    sched, _, pool = make(dev, capacity=28, chunk=32, max_batch_size=6, max_step_tokens=64)
    off, _, _ = make(make_device(), capacity=28, chunk=32, max_batch_size=6, max_step_tokens=64,
                     prefix_cache=False)
    plan = []
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.randrange(1, 101)] + tokens(200, rng.randrange(0, 20), i)
        plan.append((prompt or [1], rng.randrange(1, 40)))
    seqs, cancelled = [], set()
    for i, (prompt, max_new) in enumerate(plan):
        seqs.append(sched.submit(prompt, max_new))
        for _ in range(rng.randrange(0, 4)):
            sched.step()
            check_states(pool)
        r = rng.random()
        if r < 0.15:
            victim = rng.randrange(len(seqs))
            seqs[victim].cancel()
            cancelled.add(victim)
        elif r < 0.3:
            sched.preempt_newest()
        elif r < 0.45:
            in_use = {b: n for b, n in pool._refs.items()}
            sched.release_cached(rng.randrange(1, 3) * GRANULE)
            assert pool._refs == in_use, "a reclaim touched a block in use"
        check_states(pool)
    drain(sched)
    check_states(pool)
    assert pool.used_blocks() == 0, "a finished sequence kept a block"
    ref = [s.generated for s in (off.submit(p, m) for p, m in plan)]
    drain(off)
    for i, (seq, (prompt, max_new)) in enumerate(zip(seqs, plan, strict=True)):
        if i in cancelled:
            assert seq.generated == solo(prompt, max_new)[:len(seq.generated)]
            continue
        assert seq.generated == ref[i] == solo(prompt, max_new), f"stream {i} differs"
    assert sched.counters["prefix_cache_hit_tokens"] > 0, "the fuzz never hit the cache"
    assert sched.counters["preemptions"] > 0 and pool.evictions > 0, "the fuzz never squeezed"
    sched.close()
    off.close()


def run_together(dev, order: str, lengths, max_new: int = 2):
    """Distinct prompts of `lengths` submitted together, chunks that start mid-block (a 256-token
    step, a floor of 40 on 16-token blocks), drained; the scheduler, its pool, the prefill chunks'
    start positions, and per sequence how many of its prompt's full blocks were cached (parked)
    right after it ended."""
    sched, runner, pool = make(dev, capacity=256, chunk=128, max_step_tokens=256,
                               min_prefill_share=40, prefill_order=order)
    starts: list[int] = []
    prefill = runner.prefill

    def record(tokens_, start, table, sampling, sample):
        starts.append(start)
        return prefill(tokens_, start, table, sampling, sample)
    runner.prefill = record
    parked: dict[int, int] = {}
    finish = sched._finish

    def spy(seq, reason, error=None):
        blocks = list(seq.table.blocks[:len(seq.prompt) // BT])
        finish(seq, reason, error)
        parked[id(seq)] = sum(pool.index.is_parked(b) for b in blocks)
    sched._finish = spy
    prompts = [tokens(60 + i, n) for i, n in enumerate(lengths)]
    seqs = [sched.submit(p, max_new) for p in prompts]
    drain(sched)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.generated == solo(prompt, max_new)
    return sched, pool, starts, [parked[id(s)] for s in seqs]


@pytest.mark.parametrize("order", ["fair", "shortest"])
def test_a_prompts_completed_full_blocks_are_named_and_cached_at_its_end_whatever_the_chunks(
        dev, order):
    """Every full block a prefill chunk completes is named at its launch and cached when its
    sequence ends, under either prefill order, with chunks that start and end mid-block: a cached
    block leaves the cache only by eviction (a later allocation takes it before the pool grows)."""
    lengths = (300, 37, 150, 90, 221, 64, 16, 130, 100, 75)
    sched, pool, starts, parked = run_together(dev, order, lengths)
    assert any(s % BT for s in starts), "no chunk started mid-block: the test proves nothing"
    assert parked == [n // BT for n in lengths], "a completed full block was not cached at its end"
    assert len(pool.index) == pool.cached_blocks() == sum(n // BT for n in lengths) - pool.evictions
    check_states(pool)
    sched.close()


def test_the_cache_keeps_only_what_the_pools_peak_committed_so_prompts_that_never_coexist_leave_less(
        dev):
    """Why a burst of short-lived streams leaves fewer cached blocks under shortest first than
    under fair shares, though both cache every full block at each end: a cached block is reused
    before the pool grows (kv_pool.allocate), so what stays cached is bounded by the blocks the
    pool committed, which is the burst's peak footprint. Fair shares start 6 prompts a step (6
    floors of 40 in 256 tokens), so all 12 hold their blocks at once; shortest first prefills
    about 2.5 whole prompts a step, the first ending while the last still wait: a smaller peak,
    and the later admissions take the earlier prompts' cached blocks."""
    lengths = (100,) * 12           # 6 full blocks and a partial one each
    sched_f, fair, _, parked_f = run_together(dev, "fair", lengths)
    sched_s, short, _, parked_s = run_together(dev, "shortest", lengths)
    assert parked_f == parked_s == [6] * 12
    assert fair.evictions == 0 and fair.cached_blocks() == 72
    assert short.usable_blocks < fair.usable_blocks, "shortest first's peak was not smaller"
    assert short.evictions > 0 and short.cached_blocks() + short.evictions == 72
    for sched in (sched_f, sched_s):
        sched.close()
