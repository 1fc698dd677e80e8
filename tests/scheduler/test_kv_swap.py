"""The KV tier in pinned host memory (sim backend): a preempted sequence's blocks go to host and
back with their bytes (the device-token runner keeps its tokens in the pool's device memory), the
host budget and the copy failures fall back to recompute, the rule picks the cheaper, and no
block nor host byte leaks through starts, cancels, preemptions and reclaims."""
from __future__ import annotations

import random

import pytest

from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.kv_swap import (
    READY_BLOCKS,
    CopyRates,
    HostKVBudget,
    HostKVTier,
    KVSwap,
    swap_is_cheaper,
)
from gpu_worker.engines.scheduler.sampling import SamplingParams
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.models.configs import get_config
from services.common.errors import InvalidArgument
from tests.device.conftest import make_device
from tests.scenarios import swapped_and_plain_runs
from tests.scheduler.runners import DeviceTokenRunner, solo
from tests.sim_fixtures import compiler, device, kernel_cache_dir  # noqa: F401

GEO = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=512)
FAST = CopyRates(1e12, 1e12, "configured")      # copies next to free: swap whenever allowed


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


def make(dev, capacity=12, chunk=16, host_bytes=1 << 30, prefill_rate=1000.0, rates=FAST, **kw):
    pool = KVBlockPool(dev.arena, GEO, capacity)
    runner = DeviceTokenRunner(dev, pool, GEO, capacity, chunk)
    budget = HostKVBudget(host_bytes)
    swap = KVSwap(dev, pool, budget, rates)
    sched = Scheduler(runner, pool, thread=False, kv_swap=swap,
                      prefill_tokens_per_s=prefill_rate, **kw)
    return sched, pool, budget, swap


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 31 + k * 7) % 1000 for k in range(n)]


def check(sched: Scheduler, pool: KVBlockPool, budget: HostKVBudget, swap: KVSwap) -> None:
    used, cached, free = pool.used_blocks(), pool.cached_blocks(), pool.free_blocks()
    assert used + cached + free == pool.usable_blocks, \
        f"blocks leaked: used {used} + cached {cached} + free {free} != {pool.usable_blocks}"
    assert budget.in_use == swap.host_bytes <= budget.limit_bytes
    held = sum(s.swapped.nbytes for s in sched._all() if s.swapped is not None)
    assert swap.host_bytes >= held + hosted(sched), \
        "a swapped sequence's or a demoted block's host bytes are not booked"


def hosted(sched: Scheduler) -> int:
    """Host bytes the demoted prefix blocks hold (kv_demote.py): all that stays out of the
    slab once every swapped sequence came back."""
    return sched.host_cache.nbytes if sched.host_cache is not None else 0


def settled(sched: Scheduler, budget: HostKVBudget, swap: KVSwap) -> None:
    """Idle, every swapped sequence back or gone: the budget books the slab's chunks and
    nothing else, no slot is out but the demoted blocks', and no chunk with no slot out is
    left (these slabs keep no free slots ahead)."""
    swap.collect(wait=True)
    assert budget.in_use == swap.host_bytes, "the budget holds bytes that are not the slab's"
    assert swap.host_bytes - swap.spare_bytes == hosted(sched), "a slot is out for no one"
    assert swap.slab.trimmable_bytes(0) == 0, "idle kept a chunk with no slot out"


def drain(sched, pool, budget, swap, limit=20_000) -> None:
    steps = 0
    while sched.busy() and steps < limit:
        sched.step()
        check(sched, pool, budget, swap)
        steps += 1
    assert not sched.busy(), "the scheduler never finished"


def step_until_swapped(sched, pool, budget, swap, limit=2_000):
    for _ in range(limit):
        sched.step()
        check(sched, pool, budget, swap)
        swapped = [s for s in sched._all() if s.swapped is not None]
        if swapped:
            return swapped
    raise AssertionError("no sequence was swapped out")


def test_swap_out_then_in_gives_the_tokens_of_a_run_without_preemption(dev):
    # 12 blocks of 16 tokens for 6 sequences needing up to 6 blocks each: preemptions happen
    sched, pool, budget, swap = make(dev)
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    seqs = [sched.submit(p, 40) for p in prompts]
    drain(sched, pool, budget, swap)
    c = sched.counters
    assert c["preemptions"] > 0 and c["kv_swap_outs"] > 0, "nothing was swapped"
    assert c["kv_swapped_out_blocks"] == c["kv_swapped_in_blocks"] > 0
    assert c["kv_swap_refused"] == c["kv_swap_failed"] == 0
    for p, s in zip(prompts, seqs, strict=True):
        assert list(s.stream()) == solo(p, 40)
    assert pool.used_blocks() == 0
    settled(sched, budget, swap)
    stats = sched.stats()
    assert stats["kv_swap_host_bytes"] == stats["kv_swap_host_free_bytes"], \
        "a swapped sequence's slots stayed out"
    assert stats["kv_swapped_in_blocks"] > 0 and stats["kv_swap_host_us"] > 0
    assert 0 < stats["kv_swap_chunks_pinned"] < stats["kv_swap_outs"], \
        "the slab pinned per swap instead of once"
    sched.close()


def test_a_swapped_sequence_prefills_less_than_a_recomputed_one(dev):
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    totals = {}
    for name, host_bytes in (("swap", 1 << 30), ("recompute", 0)):
        d = make_device()
        sched, pool, budget, swap = make(d, host_bytes=host_bytes)
        seqs = [sched.submit(p, 40) for p in prompts]
        drain(sched, pool, budget, swap)
        for p, s in zip(prompts, seqs, strict=True):
            assert s.generated == solo(p, 40)
        totals[name] = (sched.counters["prefill_tokens"], sched.counters["preemptions"])
        sched.close()
        d.close()
    assert totals["swap"][0] < totals["recompute"][0], totals


def test_seeded_sampling_resumes_with_the_same_tokens_after_a_swap(dev):
    sched, pool, budget, swap = make(dev, capacity=10)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i) for i in range(5)]
    prompts = [prompt_of(i, 30) for i in range(5)]
    seqs = [sched.submit(p, 40, s) for p, s in zip(prompts, params, strict=True)]
    drain(sched, pool, budget, swap)
    assert sched.counters["kv_swap_ins"] > 0
    for p, s, q in zip(prompts, seqs, params, strict=True):
        assert s.generated == solo(p, 40, q)
    sched.close()


@pytest.mark.parametrize("host_blocks", [0, 1, 3])
def test_a_swap_that_does_not_fit_the_host_budget_recomputes(dev, host_blocks):
    # the victims hold 1 to 4 blocks: a budget of 0 refuses every swap, 1 or 3 blocks some
    sched, pool, budget, swap = make(dev, host_bytes=host_blocks * GEO.block_bytes)
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    seqs = [sched.submit(p, 40) for p in prompts]
    drain(sched, pool, budget, swap)      # checks in_use <= the limit after every step
    c = sched.counters
    assert c["kv_swap_refused"] > 0, "the budget refused nothing"
    if host_blocks == 0:
        assert c["kv_swapped_out_blocks"] == 0
    for p, s in zip(prompts, seqs, strict=True):
        assert s.generated == solo(p, 40)
    assert pool.used_blocks() == 0
    settled(sched, budget, swap)
    sched.close()


def test_a_failed_swap_in_recomputes_and_still_gives_identical_tokens(dev):
    # the device-token runner writes through the sim's view: the only H2D copies are swap-ins
    sched, pool, budget, swap = make(dev)
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    seqs = [sched.submit(p, 40) for p in prompts]
    step_until_swapped(sched, pool, budget, swap)
    dev.backend.fail_next("copy_h2d_async")
    drain(sched, pool, budget, swap)
    assert sched.counters["kv_swap_failed"] >= 1
    assert sched.counters["kv_swapped_in_blocks"] < sched.counters["kv_swapped_out_blocks"]
    for p, s in zip(prompts, seqs, strict=True):
        assert s.generated == solo(p, 40)
    assert pool.used_blocks() == 0
    settled(sched, budget, swap)
    sched.close()


@pytest.mark.parametrize("call", ["copy_d2h_async", "alloc_pinned"])
def test_a_failed_swap_out_recomputes_and_books_nothing(dev, call):
    sched, pool, budget, swap = make(dev)
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    seqs = [sched.submit(p, 40) for p in prompts]
    dev.backend.fail_next(call)
    drain(sched, pool, budget, swap)
    assert sched.counters["kv_swap_failed"] == 1
    for p, s in zip(prompts, seqs, strict=True):
        assert s.generated == solo(p, 40)
    settled(sched, budget, swap)
    sched.close()


def test_cancelling_a_swapped_out_sequence_frees_its_host_bytes(dev):
    sched, pool, budget, swap = make(dev)
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    seqs = [sched.submit(p, 40) for p in prompts]
    victim = step_until_swapped(sched, pool, budget, swap)[0]
    held = victim.swapped.nbytes
    assert budget.in_use >= held > 0
    victim.cancel()
    sched.step()                    # reaped: its host copy is released
    check(sched, pool, budget, swap)
    assert victim.state == "finished" and victim.swapped is None
    others = sum(s.swapped.nbytes for s in sched._all() if s.swapped is not None)
    swap.collect()
    assert swap.host_bytes - swap.spare_bytes == others + hosted(sched), \
        "the cancelled sequence's slots did not go back"
    drain(sched, pool, budget, swap)
    assert pool.used_blocks() == 0
    settled(sched, budget, swap)
    for p, s in zip(prompts, seqs, strict=True):
        if s is not victim:
            assert s.generated == solo(p, 40)
    sched.close()


def test_recompute_is_chosen_when_it_is_cheaper_or_no_prefill_rate_is_known(dev):
    slow = CopyRates(1.0, 1.0, "configured")        # one byte per second: never worth it
    for rates, rate in ((slow, 1000.0), (FAST, 0.0)):
        d = make_device()
        sched, pool, budget, swap = make(d, rates=rates, prefill_rate=rate)
        prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
        seqs = [sched.submit(p, 40) for p in prompts]
        drain(sched, pool, budget, swap)
        assert sched.counters["preemptions"] > 0
        assert sched.counters["kv_swap_declined"] > 0 and sched.counters["kv_swap_outs"] == 0
        for p, s in zip(prompts, seqs, strict=True):
            assert s.generated == solo(p, 40)
        sched.close()
        d.close()


def test_the_rule_compares_the_round_trip_with_the_prefill_it_saves():
    rates = CopyRates(50e9, 25e9, "configured")
    # 1 MiB: 1/50e9 + 1/25e9 s per byte = 62.9 us; 1,000 positions at 20k tokens/s: 50 ms
    assert swap_is_cheaper(1 << 20, 1000, rates, 20_000.0)
    # 1 GiB (64 ms) for 1,000 positions at 100k tokens/s (10 ms): recompute
    assert not swap_is_cheaper(1 << 30, 1000, rates, 100_000.0)
    assert not swap_is_cheaper(1 << 20, 1000, rates, None)
    assert not swap_is_cheaper(1 << 20, 0, rates, 20_000.0)
    assert rates.round_trip_s(50_000) == pytest.approx(3e-6)


def test_bad_budgets_rates_and_copies_are_refused_with_clear_errors(dev):
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgument, match="kv swap host bytes"):
            HostKVBudget(bad)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument, match="copy rate"):
            CopyRates(bad, 1.0, "configured")
    pool = KVBlockPool(dev.arena, GEO, 4)
    with pytest.raises(InvalidArgument, match="prefill_tokens_per_s"):
        Scheduler(DeviceTokenRunner(dev, pool, GEO, 4, 16), pool, thread=False,
                  prefill_tokens_per_s=-1.0)
    budget = HostKVBudget(1 << 20)
    with pytest.raises(InvalidArgument, match="giving back"):
        budget.give(1)
    swap = KVSwap(dev, pool, budget, FAST)
    blocks = pool.allocate(2)
    rec = swap.swap_out(blocks, 20)
    with pytest.raises(InvalidArgument, match="swap-in of 2 blocks into 1"):
        swap.swap_in(rec, blocks[:1])
    swap.release(rec)
    swap.close()
    assert budget.in_use == 0
    pool.free(blocks)
    pool.close()


@pytest.mark.parametrize("seed", [2026, 7])
def test_a_seeded_fuzz_of_starts_cancels_preemptions_and_reclaims_leaks_no_block_nor_host_byte(
        dev, seed):
    rng = random.Random(seed)
    sched, pool, budget, swap = make(dev, capacity=14, host_bytes=4 * GEO.block_bytes,
                                     max_batch_size=6, max_step_tokens=64)
    live: list[tuple[list[int], int, object]] = []
    cancelled: set[int] = set()
    for _ in range(400):
        if rng.random() < 0.4 and len(live) < 48:
            p = prompt_of(rng.randrange(1000), rng.randrange(1, 90))
            n = rng.randrange(1, 40)
            live.append((p, n, sched.submit(p, n)))
        if rng.random() < 0.05 and live:
            i = rng.randrange(len(live))
            live[i][2].cancel()
            cancelled.add(i)
        if rng.random() < 0.08:
            sched.preempt_newest()          # the reclaim order's last step
            check(sched, pool, budget, swap)
        if rng.random() < 0.03:
            sched.release_cached(GEO.block_bytes)
        if rng.random() < 0.02:     # the next swap copy that way fails: recompute
            dev.backend.fail_next(rng.choice(["copy_h2d_async", "copy_d2h_async"]))
        sched.step()
        check(sched, pool, budget, swap)
    drain(sched, pool, budget, swap)
    c = sched.counters
    assert c["kv_swap_outs"] > 0 and c["kv_swap_ins"] > 0 and c["kv_swap_refused"] > 0, c
    assert c["kv_swap_failed"] > 0, c
    assert pool.used_blocks() == 0
    settled(sched, budget, swap)
    for i, (p, n, s) in enumerate(live):
        want = solo(p, n)
        if i in cancelled:
            assert s.generated == want[:len(s.generated)]
        else:
            assert s.generated == want, f"stream {i} differs"
    sched.close()


# -- the real paged decoder on the sim backend, with the measured rates ------------------------
CFG = get_config("tiny", "decoder")


def test_the_paged_decoder_swapped_out_and_in_gives_the_tokens_it_gives_unpreempted(device, compiler):  # noqa: F811
    runs, stats = swapped_and_plain_runs(device, compiler, CFG, 5, 12)
    assert stats["kv_swap_outs"] >= 1 and stats["kv_swapped_in_blocks"] > 0, stats
    assert stats["kv_swap_prefill_tokens_per_s"] > 0
    assert runs["swapped"] == runs["plain"]


# -- the worker: flags, config, and the runtime's decoders ----------------------------------------
def test_the_serve_flags_set_the_host_kv_tier_and_refuse_bad_values():
    from gpu_worker.__main__ import build_parser, flag_problem, worker_config

    parser = build_parser()
    cfg = worker_config(parser.parse_args(["serve"]))
    assert cfg.kv_swap and cfg.kv_swap_host_bytes == 4 << 30
    assert cfg.kv_swap_copy_rate == cfg.kv_swap_prefill_rate == 0.0
    args = parser.parse_args(["serve", "--no-kv-swap", "--kv-swap-host-bytes", "1024",
                              "--kv-swap-copy-rate", "5e10", "--kv-swap-prefill-rate", "9000"])
    cfg = worker_config(args)
    assert (cfg.kv_swap, cfg.kv_swap_host_bytes, cfg.kv_swap_copy_rate,
            cfg.kv_swap_prefill_rate) == (False, 1024, 5e10, 9000.0)
    assert "--kv-swap-host-bytes" in flag_problem(parser.parse_args(
        ["serve", "--kv-swap-host-bytes", "-1"]))
    assert "--kv-swap-copy-rate" in flag_problem(parser.parse_args(
        ["serve", "--kv-swap-copy-rate", "nan"]))
    from gpu_worker.config import WorkerConfig
    with pytest.raises(InvalidArgument, match="kv_swap_host_bytes"):
        WorkerConfig(kv_swap_host_bytes=-1)
    with pytest.raises(InvalidArgument, match="kv_swap_prefill_rate"):
        WorkerConfig(kv_swap_prefill_rate=float("inf"))


def _runtime_streams(cache_dir, **cfg) -> tuple[list[list[int]], dict, dict]:
    """4 concurrent streams through a 10-block pool (5 blocks each): preemptions happen."""
    import threading

    from gpu_worker import WorkerConfig, WorkerRuntime

    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=cache_dir,
                                    kv_pool_bytes=10 * 4096, max_batch_size=4,
                                    max_step_tokens=64, **cfg)).start()
    try:
        rt.load_model("m", "decoder", "tiny", 3)
        prompts = [[(i * 53 + k * 5 + 2) % CFG.vocab_size for k in range(30)] for i in range(4)]
        outs: list[list[int]] = [[] for _ in prompts]

        def client(i: int) -> None:
            outs[i] = [c[0] for c in rt.generate("m", prompts[i], 40)]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        swap = rt._get("m").scheduler.kv_swap      # a client that saw its end sees it idle
        trimmable = swap.slab.trimmable_bytes(READY_BLOCKS) if swap is not None else 0
        return outs, rt.stats()["scheduler"], {**rt._get("m").scheduler.stats(),
                                               "trimmable": trimmable}
    finally:
        rt.close()


def test_the_runtime_swaps_preempted_kv_and_its_streams_match_no_swap(kernel_cache_dir):  # noqa: F811
    swapped, stats, sched = _runtime_streams(kernel_cache_dir)
    plain, plain_stats, plain_sched = _runtime_streams(kernel_cache_dir, kv_swap=False)
    assert stats["preemptions"] > 0 and stats["kv_swapped_out_blocks"] > 0, stats
    assert stats["kv_swapped_in_blocks"] == stats["kv_swapped_out_blocks"]
    # idle: no slot holds a swapped sequence, and the slab freed every chunk with no slot out
    # beyond the free slots it keeps ahead for demotions
    assert sched["kv_swap_host_bytes"] == sched["kv_swap_host_free_bytes"], sched
    assert sched["trimmable"] == 0, "idle kept a chunk beyond those ahead"
    assert sched["kv_swap"] == 1 and sched["kv_swap_h2d_bytes_per_s"] > 0
    assert plain_sched["kv_swap"] == 0 and plain_stats["kv_swapped_out_blocks"] == 0
    assert swapped == plain


def test_blocks_swapped_to_host_and_back_keep_their_bytes_across_runs_and_gaps(dev):
    import numpy as np

    pool = KVBlockPool(dev.arena, GEO, 32)
    budget = HostKVBudget(32 * GEO.block_bytes)
    swap = KVSwap(dev, pool, budget, FAST)
    blocks = pool.allocate(12)
    out = [blocks[i] for i in (0, 1, 2, 5, 7, 8, 11)]      # runs of 3, 1 and 2, then 1
    rng = np.random.default_rng(7)
    data = {b: rng.integers(0, 256, GEO.block_bytes, dtype=np.uint8) for b in out}
    for b, d in data.items():
        dev.to_device(pool.base + b * pool.block_bytes, d)
    calls = dev.backend.calls["copy_d2h_async"]
    rec = swap.swap_out(out, 7 * 16)
    assert dev.backend.calls["copy_d2h_async"] - calls == 4, "one copy per run of blocks"
    assert budget.in_use == swap.host_bytes >= 7 * GEO.block_bytes
    assert swap.host_bytes - swap.spare_bytes == 7 * GEO.block_bytes
    for b in out:                           # queued behind the swap-out copies
        dev.memset(pool.base + b * pool.block_bytes, 0, pool.block_bytes)
    into = [blocks[i] for i in (11, 10, 3, 4, 6, 9, 0)]
    swap.swap_in(rec, into)
    dev.synchronize()
    for src, dst in zip(out, into, strict=True):
        got = dev.from_device(pool.base + dst * pool.block_bytes, pool.block_bytes)
        assert np.array_equal(got, data[src]), f"block {src} -> {dst} lost its bytes"
    swap.collect(wait=True)
    assert budget.in_use == swap.host_bytes == 0
    pool.free(blocks)
    swap.close()
    pool.close()


def test_a_failed_step_drops_every_host_copy_and_the_rest_recompute(dev):
    sched, pool, budget, swap = make(dev)
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    seqs = [sched.submit(p, 40) for p in prompts]
    waiting = step_until_swapped(sched, pool, budget, swap)
    runner = sched.runner.inner
    real = runner.decode

    def broken(rows):
        runner.decode = real
        raise RuntimeError("injected step failure")
    runner.decode = broken
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(50):
            sched.step()
    assert all(s.swapped is None for s in sched._all()), "a host copy outlived a failed step"
    swap.collect(wait=True)
    assert budget.in_use == swap.host_bytes == 0
    drain(sched, pool, budget, swap)
    for p, s in zip(prompts, seqs, strict=True):
        if s.finish_reason != "error":
            assert s.generated == solo(p, 40)
    assert any(s.finish_reason != "error" for s in waiting)
    assert pool.used_blocks() == 0
    sched.close()


def test_a_busy_decoders_swaps_pin_one_chunk_and_free_nothing_until_idle(dev):
    """A pinned allocation (page pinning, ~1 ms per 2 MiB on the H200 host) per swap-out and a
    free (which synchronizes the context) per swap-in put the host on the step path. The slab
    pins a chunk once; every later copy out, of one block or many, takes free slots."""
    pool = KVBlockPool(dev.arena, GEO, 8)
    budget = HostKVBudget(64 * pool.block_bytes)
    swap = KVSwap(dev, pool, budget, FAST, chunk_slots=16)
    blocks = pool.allocate(6)
    allocs, frees = [], []
    alloc, free = dev.alloc_pinned, dev.free_pinned
    dev.alloc_pinned = lambda n: (allocs.append(n), alloc(n))[1]
    dev.free_pinned = lambda buf: (frees.append(buf.nbytes), free(buf))[1]
    for k in range(40):                     # preemptions and demotions, in and out
        n = 1 + k % 6
        rec = swap.swap_out(blocks[:n], n * GEO.block_tokens)
        assert rec is not None
        if k % 2:
            swap.swap_in(rec, blocks[:n])
        else:
            swap.release(rec)
        dev.synchronize(dev.stream)
        swap.collect()
        assert budget.in_use == swap.host_bytes == 16 * pool.block_bytes
    assert allocs == [16 * pool.block_bytes], f"{len(allocs)} pinned allocations for 40 swaps"
    assert frees == [], "a chunk was freed while the decoder was busy"
    assert swap.collect(wait=True) == 16 * pool.block_bytes and frees == [16 * pool.block_bytes]
    assert budget.in_use == swap.host_bytes == swap.spare_bytes == 0
    pool.free(blocks)
    swap.close()
    pool.close()


def test_a_swap_that_does_not_fit_is_refused_before_anything_is_booked(dev):
    """The budget's free bytes plus this decoder's free slots must hold the swap, as they did
    with a pinned buffer per swap; another decoder's chunks with no slot out are freed for it
    first (its busy slab would otherwise keep them until it goes idle)."""
    pool = KVBlockPool(dev.arena, GEO, 8)
    bb = pool.block_bytes
    budget = HostKVBudget(6 * bb)
    tier = HostKVTier(budget, copy_rate=1e12)
    other_pool = KVBlockPool(dev.arena, GEO, 4)
    other = tier.swap_for(dev, other_pool, demotes=False)
    swap = tier.swap_for(dev, pool, demotes=False)
    blocks = pool.allocate(6)

    def refused(n: int) -> None:
        before = (budget.in_use, swap.host_bytes, other.host_bytes,
                  dev.backend.calls["alloc_pinned"])
        assert swap.swap_out(blocks[:n], n * GEO.block_tokens) is None, f"{n} blocks fit"
        assert (budget.in_use, swap.host_bytes, other.host_bytes,
                dev.backend.calls["alloc_pinned"]) == before, "a refused swap booked something"
    their_blocks = other_pool.allocate(2)
    theirs = other.swap_out(their_blocks, 2 * GEO.block_tokens)
    assert theirs is not None and budget.in_use == other.host_bytes == 6 * bb, \
        "the chunk is cut to the budget"
    refused(2)                                  # the other decoder's chunk has slots out
    other.release(theirs)
    dev.synchronize()
    other.collect()                             # busy: its chunk stays, every slot free
    assert other.host_bytes == 6 * bb
    held = swap.swap_out(blocks[:2], 2 * GEO.block_tokens)
    assert held is not None, "the other decoder's idle chunk was not freed for the swap"
    assert other.host_bytes == 0 and budget.in_use == swap.host_bytes == 6 * bb
    refused(5)                                  # 4 free slots, nothing left in the budget
    rec = swap.swap_out(blocks[2:6], 4 * GEO.block_tokens)
    assert rec is not None and budget.in_use == swap.host_bytes == 6 * bb
    for r in (held, rec):
        swap.release(r)
    swap.close()
    other.close()
    assert budget.in_use == 0
    pool.free(blocks)
    other_pool.free(their_blocks)
    for p in (pool, other_pool):
        p.close()


def test_consecutive_blocks_in_scattered_slots_keep_their_bytes(dev):
    import numpy as np

    pool = KVBlockPool(dev.arena, GEO, 16)
    swap = KVSwap(dev, pool, HostKVBudget(16 * GEO.block_bytes), FAST, chunk_slots=4)
    blocks = pool.allocate(11)
    a = swap.swap_out(blocks[:3], 3 * 16)               # slots 0-2
    b = swap.swap_out(blocks[3:6], 3 * 16)              # slots 3-5 (two chunks)
    swap.release(a)
    dev.synchronize()
    swap.collect()                                      # slots 0-2 free again
    rng = np.random.default_rng(26)
    out = blocks[6:11]
    data = {x: rng.integers(0, 256, GEO.block_bytes, dtype=np.uint8) for x in out}
    for x, d in data.items():
        dev.to_device(pool.base + x * pool.block_bytes, d)
    calls = dev.backend.calls["copy_d2h_async"]
    c = swap.swap_out(out, 5 * 16)
    assert c.slots == [0, 1, 2, 6, 7], "not the lowest free slots"
    assert dev.backend.calls["copy_d2h_async"] - calls == 2, "one copy per run of both"
    for x in out:
        dev.memset(pool.base + x * pool.block_bytes, 0, pool.block_bytes)
    swap.swap_in(c, out)
    dev.synchronize()
    for x in out:
        got = dev.from_device(pool.base + x * pool.block_bytes, pool.block_bytes)
        assert np.array_equal(got, data[x]), f"block {x} lost its bytes"
    swap.release(b)
    swap.close()
    pool.free(blocks)
    pool.close()
