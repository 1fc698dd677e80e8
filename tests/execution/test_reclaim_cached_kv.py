"""Cached prefix KV blocks in the one reclaim order (WorkerRuntime on the sim backend): a reclaim
ask, a governor ask and a refused commit take cached blocks first (after completed releases,
before any model's plans), and never a block a running sequence uses."""
from __future__ import annotations

import random
import threading

import pytest

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from services.common.errors import ResourceExhausted

GRANULE = 2 << 20          # the sim backend's
PROMPT = [4, 8, 15, 16, 23, 42]
CFG = CONFIGS["tiny"]


def generate(rt: WorkerRuntime, model_id: str, prompt: list[int], n: int) -> list[int]:
    return [c[0] for c in rt.generate(model_id, prompt, n)]


def plan_count(rt: WorkerRuntime, model_id: str) -> int:
    return rt._get(model_id).executor.plans.stats()["entries"]


@pytest.fixture
def runtime(kernel_cache_dir):
    # 32 KiB blocks of 128 tokens: 64 per granule, so 16 streams of 900 tokens fill two granules
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    kv_block_tokens=128)).start()
    rt.load_model("a", "decoder", "tiny", 1)
    rt.load_model("idle", "decoder", "tiny", 2)
    generate(rt, "idle", PROMPT, 2)                 # plans to lose, if the order were wrong
    yield rt
    rt.close()


def fill_cache(rt: WorkerRuntime) -> None:
    """16 concurrent streams of distinct 900-token prompts: 7 named blocks each, then cached.

    Concurrent in the pool, whatever the prefill order: queued together while the engine is held,
    each decoding 16 tokens (still 8 blocks), so none ends before the last is admitted (fair
    admits 8 a step, shortest first 2 whole prompts) and the pool commits two granules for them.
    A cached block is reused before the pool grows (kv_pool.allocate), so streams that never hold
    their blocks at once leave only their peak footprint cached: streams of 2 new tokens each,
    under shortest first, held at most 6 at once (48 blocks, one granule), and the later
    admissions evicted the earlier prompts' cached blocks."""
    prompts = [[random.Random(i).randrange(CFG.vocab_size) for _ in range(900)] for i in range(16)]
    loaded = rt._get("a")
    with loaded.lock:       # between two steps: all 16 are queued before the next one plans
        streams = [rt.generate("a", p, 16) for p in prompts]
    for stream in streams:
        assert len(list(stream)) == 16
    pool = loaded.scheduler.pool
    assert pool.cached_blocks() > 0
    assert pool.cached_releasable_bytes() >= GRANULE, "the cached blocks fill no whole granule"


LONG = [random.Random(99).randrange(CFG.vocab_size) for _ in range(900)]


def test_a_reclaim_takes_cached_blocks_before_any_plans_and_never_a_block_in_use(runtime):
    # a stream whose blocks are fixed at admission (900 + 120 tokens: 8 blocks, the lowest)
    stream = runtime.generate("a", LONG, 120)
    got = [next(stream)[0]]
    loaded = runtime._get("a")
    sched = loaded.scheduler
    with loaded.lock:
        (seq,) = sched._running
        held = list(seq.table.blocks)
    fill_cache(runtime)
    # hold the engine between two steps (outside its lock) while the reclaim runs
    go, step = threading.Event(), sched.step

    def gated() -> int:
        go.wait(60)
        return step()
    sched.step = gated
    with loaded.lock:
        assert seq.state == "running", "the long stream ended before the reclaim"
    plans = plan_count(runtime, "idle")
    try:
        report = runtime.reclaimer.reclaim(GRANULE)
    finally:
        go.set()
    assert [s.step for s in report.steps] == ["completed_releases", "cached_kv"], report
    assert report.steps[1].freed_bytes >= GRANULE and report.steps[1].models == ("a",), report
    assert plan_count(runtime, "idle") == plans, "plans went although cached blocks sufficed"
    assert seq.table.blocks == held, "a block in use was taken"
    got += [c[0] for c in stream]
    assert seq.preemptions == 0, "the running sequence was preempted"
    assert got == R.DecoderReference(CFG, W.load_host(CFG, 1)).generate(LONG, 120)
    assert runtime.stats()["reclaim"]["cached_kv_bytes"] >= GRANULE
    assert runtime.stats()["arena"]["faults"] == 0


def test_a_governor_kv_ask_is_answered_by_cached_blocks_first(runtime):
    fill_cache(runtime)
    cached = runtime._get("a").scheduler.pool.cached_blocks()
    runtime.reclaimer.on_governor_ask("kv", GRANULE)
    report = runtime.reclaimer.last
    assert report.steps[1].step == "cached_kv" and report.freed_bytes >= GRANULE, report
    assert runtime.stats()["reclaim"]["kv_preemption_bytes"] == 0
    left = runtime._get("a").scheduler.pool.cached_blocks()
    assert 0 < left < cached, "the ask took all cached blocks (or none) for one granule"
    assert runtime.stats()["scheduler"]["kv_blocks_cached"] == left


def test_a_refused_commit_frees_cached_blocks_before_anything_else(runtime):
    fill_cache(runtime)
    plans = plan_count(runtime, "idle")
    refusal = ResourceExhausted("test refusal", asked_bytes=GRANULE, free_bytes=0, zone="kv")
    assert runtime.reclaimer.on_refusal("kv", refusal) >= GRANULE
    assert [s.step for s in runtime.reclaimer.last.steps] == ["completed_releases", "cached_kv"]
    assert plan_count(runtime, "idle") == plans
    # the cache still answers the prefixes whose blocks stayed
    assert runtime._get("a").scheduler.pool.cached_blocks() > 0


class _EngineModel:
    """A decoder as the reclaimer sees it, asked from its own engine thread mid-step: the lock is
    held by the calling thread (a plain Lock: taking it again would wait, then skip the model)."""

    def __init__(self, pool) -> None:
        self.model_id, self.pool, self.closed, self.last_used = "self", pool, False, 0.0
        self.lock = threading.Lock()

    def engine_is_current(self) -> bool:
        return True

    def kv_cached_bytes(self) -> int:
        return self.pool.cached_releasable_bytes()

    def release_cached_kv(self, need: int) -> int:
        return self.pool.shrink(evict_cached=True, need_bytes=need)

    def reclaimable_bytes(self) -> int:
        return 0


def test_a_refusal_on_a_decoders_own_engine_thread_takes_its_cached_blocks_without_its_lock():
    from gpu_worker.core.reclaim import Reclaimer
    from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
    from gpu_worker.engines.scheduler.prefix_cache import chain_hashes, root_key
    from tests.device.conftest import GRANULE as SIM_GRANULE
    from tests.device.conftest import make_device

    dev = make_device()
    geo = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=1024)
    pool = KVBlockPool(dev.arena, geo, 64)
    blocks = pool.allocate(48)                    # 3 granules of 16 blocks
    keys = chain_hashes(root_key("m", 16), list(range(48 * 16)), 16)
    for b, k in zip(blocks, keys, strict=True):
        pool.name(b, k)
    pool.free(blocks[4:])                         # blocks 0..3 stay in use
    model = _EngineModel(pool)
    reclaimer = Reclaimer(dev, lambda: [model])
    with model.lock:                              # the engine's step holds it
        report = reclaimer.reclaim(SIM_GRANULE, "kv", "refusal")
    assert report.steps[1].step == "cached_kv" and report.steps[1].freed_bytes == SIM_GRANULE
    assert sorted(pool._refs) == blocks[:4], "a block in use was taken"
    pool.close()
    dev.close()
