"""A cached-only governor ask (Reclaim.cached_only) in the one reclaim order (WorkerRuntime on the
sim backend): it frees cached prefix KV blocks and stops there, however short they fall of the
ask; never a live sequence's KV (no preemption), never plans or weights. A plain kv ask of the
same size goes on down the order and preempts."""
from __future__ import annotations

import threading

import pytest

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from tests.execution.test_reclaim_cached_kv import (
    CFG,
    GRANULE,
    LONG,
    PROMPT,
    fill_cache,
    generate,
    plan_count,
)


@pytest.fixture
def runtime(kernel_cache_dir):
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    kv_block_tokens=128)).start()
    rt.load_model("a", "decoder", "tiny", 1)
    rt.load_model("idle", "decoder", "tiny", 2)
    generate(rt, "idle", PROMPT, 2)                 # plans and weights a wrong order would take
    yield rt
    rt.close()


def running_stream(rt: WorkerRuntime):
    """A long stream in the running batch (its blocks the lowest), cached blocks above it, and the
    engine held between two steps (outside its lock) until the returned event is set."""
    stream = rt.generate("a", LONG, 120)
    got = [next(stream)[0]]
    loaded = rt._get("a")
    sched = loaded.scheduler
    with loaded.lock:
        (seq,) = sched._running
    fill_cache(rt)
    go, step = threading.Event(), sched.step

    def gated() -> int:
        go.wait(60)
        return step()
    sched.step = gated
    with loaded.lock:
        assert seq.state == "running", "the long stream ended before the ask"
    return stream, got, seq, go


def kv_committed(rt: WorkerRuntime) -> int:
    return rt.device.ledger.snapshot()["kv"][0]


def test_a_cached_only_ask_larger_than_the_cache_frees_exactly_the_cached_bytes(runtime):
    stream, got, seq, go = running_stream(runtime)
    loaded = runtime._get("a")
    held = list(seq.table.blocks)
    cached = loaded.kv_cached_bytes()
    assert cached >= GRANULE, "nothing cached: the test proves nothing"
    plans, resident = plan_count(runtime, "idle"), runtime.stats()["weights"]["resident_bytes"]
    before = kv_committed(runtime)
    try:
        runtime.reclaimer.on_governor_cached_ask("kv", cached + 8 * GRANULE)
        report = runtime.reclaimer.last
    finally:
        go.set()
    assert report.cached_only and report.reason == "governor", report
    assert [s.step for s in report.steps] == ["completed_releases", "cached_kv"], report
    assert report.freed_bytes == cached, f"freed {report.freed_bytes}, cached {cached}: {report}"
    assert before - kv_committed(runtime) == cached
    assert loaded.kv_cached_bytes() == 0
    assert seq.preemptions == 0 and seq.table.blocks == held, "a live sequence lost its KV"
    assert plan_count(runtime, "idle") == plans, "plans went on a cached-only ask"
    assert runtime.stats()["weights"]["resident_bytes"] == resident, "weights paged out"
    stats = runtime.stats()
    assert stats["reclaim"]["kv_preemption_bytes"] == 0
    assert stats["scheduler"]["preemptions"] == 0
    got += [c[0] for c in stream]
    assert got == R.DecoderReference(CFG, W.load_host(CFG, 1)).generate(LONG, 120)
    assert runtime.stats()["arena"]["faults"] == 0


def test_a_plain_ask_of_the_same_size_goes_on_to_preempt(runtime):
    stream, got, seq, go = running_stream(runtime)
    cached = runtime._get("a").kv_cached_bytes()
    try:
        runtime.reclaimer.on_governor_ask("kv", cached + 8 * GRANULE)
        report = runtime.reclaimer.last
    finally:
        go.set()
    assert not report.cached_only
    assert [s.step for s in report.steps] == ["completed_releases", "cached_kv",
                                              "kv_preemption"], report
    assert report.steps[1].freed_bytes == cached, report
    assert report.steps[2].freed_bytes > 0 and report.steps[2].models == ("a",), report
    assert seq.preemptions == 1, "the live sequence was not preempted"
    got += [c[0] for c in stream]       # it recomputes (or swaps back) and streams the same tokens
    assert got == R.DecoderReference(CFG, W.load_host(CFG, 1)).generate(LONG, 120)
    assert runtime.stats()["arena"]["faults"] == 0
