"""The host KV tier in GetStats, Prometheus and `gpuplane stats` (WorkerRuntime on the sim
backend): a running sequence preempted by a reclaim swaps its KV to pinned host; while it is out
the scheduler stats show the host bytes it holds (the worker's HostKVBudget in use) and the
worker's budget, counted once for two decoders sharing it; once it resumed, one swap each way
and the host bytes back to 0; the figures survive the proto, the collector and the CLI."""
from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.edge.messages import stats_message
from gpu_worker.edge.metrics import WorkerCollector
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from tests.execution.test_reclaim_cached_kv import CFG, GRANULE, LONG

HOST_BUDGET = 64 << 20
SWAP_FIELDS = ("kv_swap_outs", "kv_swap_ins", "kv_swap_declined", "kv_swap_refused",
               "kv_swap_failed", "kv_swap_host_bytes", "kv_swap_host_budget_bytes")


@pytest.fixture
def runtime(kernel_cache_dir):
    # copies next to free and a slow prefill: a preemption always swaps
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    kv_block_tokens=128, kv_swap_host_bytes=HOST_BUDGET,
                                    kv_swap_copy_rate=1e12, kv_swap_prefill_rate=1.0,
                                    # the swap alone: no free slots pinned ahead for
                                    # demotions, so the slab is the swapped sequence's
                                    kv_demote=False)).start()
    rt.load_model("a", "decoder", "tiny", 1)
    rt.load_model("b", "decoder", "tiny", 2)        # a second decoder booking in the same budget
    yield rt
    rt.close()


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_swapped_out_sequence_shows_in_the_scheduler_stats_metrics_and_cli(runtime):
    idle = runtime.stats()["scheduler"]
    assert {k: idle[k] for k in SWAP_FIELDS} == {**dict.fromkeys(SWAP_FIELDS, 0),
                                                 "kv_swap_host_budget_bytes": HOST_BUDGET}, \
        "the budget is the worker's, counted once for two decoders"
    stream = runtime.generate("a", LONG, 120)
    got = [next(stream)[0]]
    loaded = runtime._get("a")
    sched = loaded.scheduler
    with loaded.lock:
        (seq,) = sched._running
    go, step = threading.Event(), sched.step

    def gated() -> int:
        go.wait(60)
        return step()
    sched.step = gated
    try:
        runtime.reclaimer.on_governor_ask("kv", 8 * GRANULE)   # nothing cached: it preempts
        out = runtime.stats()
        slab = (sched.kv_swap.host_bytes, sched.kv_swap.spare_bytes)
        registry = CollectorRegistry()      # scraped while the sequence is still out
        registry.register(WorkerCollector(runtime))
        text = generate_latest(registry).decode()
    finally:
        go.set()
    s = out["scheduler"]
    assert seq.preemptions == 1 and s["kv_swap_outs"] == 1, s
    blocks = s["kv_swapped_out_blocks"]
    block_bytes = sched.pool.block_bytes
    # the slab's chunks are what is booked: the swapped blocks' slots and the chunk's free ones
    assert blocks > 0 and slab[0] - slab[1] == blocks * block_bytes, (s, slab)
    assert s["kv_swap_host_bytes"] == slab[0] >= blocks * block_bytes, (s, slab)
    assert s["kv_swap_host_bytes"] == runtime.kv_host.budget.in_use, "not the worker's budget"
    assert s["kv_swap_host_budget_bytes"] == HOST_BUDGET
    msg = stats_message(out).scheduler
    assert {f: getattr(msg, f) for f in SWAP_FIELDS} == {f: s[f] for f in SWAP_FIELDS}

    samples = {m.name: m.value for f in text_string_to_metric_families(text) for m in f.samples}
    assert samples["gpuplane:kv_swap_host_budget_bytes"] == HOST_BUDGET
    assert samples["gpuplane:kv_swap_host_bytes"] == s["kv_swap_host_bytes"]
    assert samples["gpuplane:kv_swap_outs_total"] == 1
    assert samples["gpuplane_worker_scheduler_kv_swap_host_bytes"] == s["kv_swap_host_bytes"]
    assert "# TYPE gpuplane:kv_swap_host_bytes gauge" in text
    for name in ("kv_swap_outs", "kv_swap_ins", "kv_swap_declined", "kv_swap_refused",
                 "kv_swap_failed"):
        assert f"# TYPE gpuplane:{name}_total counter" in text, name

    got += [c[0] for c in stream]
    assert got == R.DecoderReference(CFG, W.load_host(CFG, 1)).generate(LONG, 120)
    assert wait_for(lambda: runtime.stats()["scheduler"]["kv_swap_host_bytes"] == 0)
    after = runtime.stats()["scheduler"]
    assert after["kv_swap_ins"] == 1 and after["kv_swapped_in_blocks"] == blocks, after
    assert after["kv_swap_declined"] == after["kv_swap_refused"] == after["kv_swap_failed"] == 0
    assert runtime.kv_host.budget.in_use == 0
    assert runtime.stats()["arena"]["faults"] == 0


def test_gpuplane_stats_prints_the_kv_swap_line(runtime, capsys):
    from gpu_worker.edge.servicer import serve_worker
    from gpu_worker.edge.user_cli import main
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider(), max_workers=4)
    try:
        assert main(["--worker", server.address, "stats"]) == 0
    finally:
        server.stop(grace=1.0)
    out = capsys.readouterr().out
    line = next((ln for ln in out.splitlines() if ln.startswith("kv swap:")), None)
    assert line is not None, f"no kv swap line:\n{out}"
    assert "of 64.0 MiB" in line or "of 64 MiB" in line, line
    assert "0 out" in line and "0 in" in line, line
