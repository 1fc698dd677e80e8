"""Continuous batching through WorkerService on the sim backend (real gRPC on loopback, the real
paged decoder): concurrent streams, the queue bound, sampling, finish reasons, cancels, stats."""
from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from gpu_worker.edge.client import WorkerClient
from gpu_worker.edge.metrics import WorkerCollector
from gpu_worker.execution.plans import seq_bucket
from gpu_worker.models.configs import get_config
from gpu_worker.models.paged import PREFILL_LADDER
from gpu_worker.models.reference import DecoderReference
from gpu_worker.models.weights import load_host

CFG = get_config("tiny", "decoder")
SEED = 7
MODEL = "dec"


def reference(prompt: list[int], n: int) -> list[int]:
    return DecoderReference(CFG, load_host(CFG, SEED)).generate(prompt, n)


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 37 + k * 11 + 1) % CFG.vocab_size for k in range(n)]


def start_worker(tmp_path, **config):
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path, **config)).start()
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider(), max_workers=48)
    client = WorkerClient(server.address, deadline_s=120.0)
    client.load_model(MODEL, "decoder", "tiny", SEED)
    return runtime, server, client


@pytest.fixture(scope="module")
def worker(kernels):
    runtime, server, client = start_worker(kernels, max_plans=8)
    yield runtime, client
    client.close()
    server.stop(grace=5.0)


def concurrently(calls):
    out: list = [None] * len(calls)

    def run(i):
        out[i] = calls[i]()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_sixteen_concurrent_streams_each_get_the_tokens_of_their_solo_run(worker):
    _, client = worker
    prompts = [prompt_of(i, 3 + 5 * i) for i in range(16)]
    results = concurrently([lambda p=p: client.generate(MODEL, p, 12) for p in prompts])
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        assert r.tokens == reference(p, 12), f"stream {i} differs from its solo reference"
        assert r.finish_reason == "length"
    s = client.stats().scheduler
    assert s.peak_batch_size > 1, "the streams never shared a decode step"
    assert s.kv_blocks_used == 0 and s.running == 0 and s.waiting == 0
    assert client.stats().arena.faults == 0, "the ledger left the device's truth (or underflowed)"


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(worker):
    _, client = worker
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    prompt = prompt_of(3, 9)
    alone = client.generate(MODEL, prompt, 16, sampling=params).tokens
    crowd = concurrently([lambda: client.generate(MODEL, prompt, 16, sampling=params)]
                         + [lambda i=i: client.generate(MODEL, prompt_of(i, 4 + i), 16,
                                                        sampling={**params, "seed": i})
                            for i in range(7)])
    assert crowd[0].tokens == alone, "the seeded stream changed with its batch"
    other = client.generate(MODEL, prompt, 16, sampling={**params, "seed": 99}).tokens
    greedy = reference(prompt, 16)
    assert alone != greedy or other != greedy, "temperature 0.9 sampled the greedy stream twice"


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 1.5), ("top_k", 5000),
                                         ("stop_token_ids", [5000])])
def test_bad_sampling_values_are_invalid_argument_and_change_nothing(worker, field, value):
    _, client = worker
    before = client.stats().scheduler
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(MODEL, [1, 2, 3], 4, sampling={field: value})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
    after = client.stats().scheduler
    assert (after.steps, after.waiting, after.kv_blocks_used) == \
        (before.steps, before.waiting, before.kv_blocks_used)


def test_a_stop_token_ends_the_stream_with_finish_reason_stop(worker):
    _, client = worker
    prompt = prompt_of(5, 6)
    want = reference(prompt, 10)
    r = client.generate(MODEL, prompt, 10, sampling={"stop_token_ids": [want[3]]})
    assert r.tokens == want[:want.index(want[3]) + 1] and r.finish_reason == "stop"


def test_a_cancelled_stream_frees_its_kv_blocks(worker):
    _, client = worker
    call = client.generate_stream(MODEL, prompt_of(6, 40), 400)
    got = 0
    for message in call:
        got += len(message.tokens)
        if got >= 3:
            break
    assert client.stats().scheduler.kv_blocks_used > 0
    call.cancel()
    deadline = time.monotonic() + 10
    while client.stats().scheduler.kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.01)
    s = client.stats().scheduler
    assert s.kv_blocks_used == 0 and s.running == 0 and s.cancelled >= 1


def test_scheduler_gauges_and_latency_histograms_are_exported(worker):
    runtime, client = worker
    client.generate(MODEL, [1, 2, 3], 3)
    registry = CollectorRegistry()
    registry.register(WorkerCollector(runtime))
    text = generate_latest(registry).decode()
    for name in ("gpuplane_worker_scheduler_running", "gpuplane_worker_scheduler_waiting",
                 "gpuplane_worker_scheduler_kv_blocks_used",
                 "gpuplane_worker_scheduler_ttft_seconds_bucket",
                 "gpuplane_worker_scheduler_tpot_seconds_count",
                 "gpuplane_worker_scheduler_queue_seconds_sum",
                 "gpuplane_worker_scheduler_step_seconds_count",
                 "gpuplane_worker_scheduler_step_host_seconds_sum",
                 "gpuplane_worker_scheduler_step_device_seconds_bucket",
                 "gpuplane_worker_scheduler_step_device_us"):
        assert name in text, f"{name} is not exported"


def test_get_stats_splits_the_engine_steps_into_host_wait_and_device_time(worker):
    """The host-vs-device figures of a step (issue 23's "end-to-end step within 1.1x the device
    step") reach clients: the host and device totals grow with the steps that ran, and every
    step's wall time is observed together with its host time."""
    runtime, client = worker
    before = client.stats().scheduler
    client.generate(MODEL, prompt_of(9, 30), 12)
    after = client.stats().scheduler
    assert after.steps > before.steps
    host = after.step_host_us - before.step_host_us
    wait = after.step_wait_us - before.step_wait_us
    device = after.step_device_us - before.step_device_us
    assert host > 0 and device > 0 and wait >= 0, (host, wait, device)
    merged = runtime.scheduler_histograms()
    assert merged["step_seconds"].count == merged["step_host_seconds"].count > 0


def test_queue_overflow_is_resource_exhausted_at_once_and_the_accepted_streams_complete(kernels):
    runtime, server, client = start_worker(kernels, max_queued=2)
    try:
        loaded = runtime._get(MODEL)
        prompts = [prompt_of(i, 5) for i in range(2)]
        results: list = [None, None]
        with loaded.lock:          # the engine cannot step: both requests stay queued
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, client.generate(MODEL, prompts[i], 6))) for i in range(2)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while loaded.scheduler.stats()["waiting"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            ledger = runtime.device.ledger.total_committed()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(MODEL, prompt_of(9, 5), 6)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - started < 5, "the refusal waited for the queue"
            assert runtime.device.ledger.total_committed() == ledger
            assert loaded.scheduler.stats()["waiting"] == 2
        for t in threads:
            t.join(60)
        for p, r in zip(prompts, results, strict=True):
            assert r.tokens == reference(p, 6), "an accepted stream did not complete in full"
        assert client.stats().scheduler.rejected == 1
    finally:
        client.close()
        server.stop(grace=5.0)


def test_preemption_under_a_tiny_kv_pool_keeps_every_stream_identical(kernels):
    # tiny: a 16-token block is 4 KiB; 10 blocks for 4 streams needing 4-5 blocks each
    _, server, client = start_worker(kernels, kv_pool_bytes=10 * 4096, max_plans=8)
    try:
        prompts = [prompt_of(i, 20 + 3 * i) for i in range(4)]
        results = concurrently([lambda p=p: client.generate(MODEL, p, 36) for p in prompts])
        for p, r in zip(prompts, results, strict=True):
            assert r.tokens == reference(p, 36)
        s = client.stats().scheduler
        assert s.preemptions > 0, "the pool was not small enough to preempt"
        assert s.kv_blocks_used == 0
    finally:
        client.close()
        server.stop(grace=5.0)


def test_a_fuzz_of_concurrent_starts_and_cancels_never_leaks_a_block(worker):
    import random
    _, client = worker

    def one(i):
        r = random.Random(i)
        call = client.generate_stream(MODEL, prompt_of(i, r.randint(1, 40)), r.randint(1, 40))
        stop_after = r.randint(0, 12)
        got = 0
        for message in call:
            got += len(message.tokens)
            if got >= stop_after and r.random() < 0.5:
                call.cancel()
                break
        return got
    concurrently([lambda i=i: one(i) for i in range(20)])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s = client.stats().scheduler
        if s.kv_blocks_used == 0 and s.running == 0 and s.waiting == 0:
            break
        time.sleep(0.02)
    s = client.stats().scheduler
    assert (s.kv_blocks_used, s.running, s.waiting) == (0, 0, 0), "a block or a sequence leaked"
    assert client.stats().arena.faults == 0


def test_gpuplane_stats_prints_the_step_split(worker, capsys):
    """`gpuplane stats` shows an operator the end-to-end step against the device step."""
    from gpu_worker.edge.user_cli import main
    _, client = worker
    client.generate(MODEL, prompt_of(10, 20), 6)
    assert main(["--worker", client.target, "stats"]) == 0
    out = capsys.readouterr().out
    line = next((ln for ln in out.splitlines() if ln.startswith("steps:")), None)
    assert line is not None, f"no steps line:\n{out}"
    assert "ms on the device; end to end / device " in line, line


def test_the_step_trace_accounts_for_every_token_the_engine_computed(tmp_path, kernels):
    trace = tmp_path / "steps.jsonl"
    _, server, client = start_worker(kernels, max_plans=8, step_trace=trace)
    try:
        prompts = [prompt_of(i, 20 + 30 * i) for i in range(4)]
        results = concurrently([lambda p=p: client.generate(MODEL, p, 6) for p in prompts])
        assert all(r.finish_reason == "length" for r in results)
        s = client.stats().scheduler
    finally:
        client.close()
        server.stop(grace=5.0)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == s.steps, "one record per launched step"
    assert {r["model"] for r in records} == {MODEL}
    assert sum(r["decode_rows"] for r in records) == s.decode_tokens
    assert sum(sum(r["chunks"]) for r in records) == s.prefill_tokens
    chunks = [(n, rows) for r in records for n, rows in zip(r["chunks"], r["chunk_rows"], strict=True)]
    assert chunks and all(rows == seq_bucket(n, PREFILL_LADDER) for n, rows in chunks), \
        f"a chunk's graph rows are its bucket: {chunks}"
    assert sorted(r["step"] for r in records) == list(range(s.steps))
    assert all(r["device_us"] >= 0 and r["host_us"] > 0 for r in records)


class _FullDisk:
    closed = False

    def write(self, line: str) -> int:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def test_a_step_trace_that_cannot_be_written_fails_no_stream(tmp_path, kernels):
    runtime, server, client = start_worker(kernels, max_plans=8, step_trace=tmp_path / "t.jsonl")
    try:
        runtime.step_trace._file = _FullDisk()
        r = client.generate(MODEL, prompt_of(1, 9), 6)
        assert r.finish_reason == "length" and r.tokens == reference(prompt_of(1, 9), 6)
    finally:
        client.close()
        server.stop(grace=5.0)
