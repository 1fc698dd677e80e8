"""Serving at many streams through WorkerService (sim backend, the real paged decoder, a real
grpc.aio server on loopback): concurrency bounded by --max-batch-size and --max-queued, never by
threads; a reader that does not read is cancelled and its KV freed; control RPCs stay prompt.

A "stalled" reader here is a channel with a one-byte HTTP/2 receive window (and no window
probing): the server's first write to it never completes until the client reads.
"""
from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from gpuplane.worker.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from gpu_worker.core.token_stream import StreamStats
from gpu_worker.edge.client import WorkerClient
from gpu_worker.edge.metrics import WorkerCollector
from gpu_worker.edge.servicer import LIVENESS_SERVICE, MAX_STOP_TOKEN_IDS
from gpu_worker.models.configs import get_config
from gpu_worker.models.reference import DecoderReference
from gpu_worker.models.weights import load_host
from tests.polling import eventually

CFG = get_config("tiny", "decoder")
SEED = 7
MODEL = "dec"
STALLED = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
PROMPTLY_S = 10.0      # a control RPC answers within this on a loaded 2-core CI machine


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 37 + k * 11 + 1) % CFG.vocab_size for k in range(n)]


_references: dict[tuple, list[int]] = {}


def reference(prompt: list[int], n: int) -> list[int]:
    key = (tuple(prompt), n)
    if key not in _references:
        _references[key] = DecoderReference(CFG, load_host(CFG, SEED)).generate(prompt, n)
    return _references[key]


class Worker:
    """A sim worker behind the aio server, its client and its edge stats."""

    def __init__(self, cache_dir, edge: dict | None = None, **config) -> None:
        from gpu_worker.core.runtime import WorkerConfig, WorkerRuntime
        from gpu_worker.edge.servicer import serve_worker
        self.runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=cache_dir,
                                                  **config)).start()
        self.streams = StreamStats()
        self.server = serve_worker(self.runtime, "127.0.0.1:0", TracerProvider(),
                                   streams=self.streams, **(edge or {}))
        self.client = WorkerClient(self.server.address, deadline_s=120.0)
        self.client.load_model(MODEL, "decoder", "tiny", SEED)
        self.loaded = self.runtime._get(MODEL)
        self._channels: list[grpc.Channel] = []

    def stalled_stub(self) -> worker_pb2_grpc.WorkerServiceStub:
        channel = grpc.insecure_channel(self.server.address, options=STALLED)
        self._channels.append(channel)
        return worker_pb2_grpc.WorkerServiceStub(channel)

    def scheduler(self) -> dict:
        return self.loaded.scheduler.stats()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self.client.close()
        self.server.stop(grace=5.0)


def request(prompt: list[int], n: int, **sampling) -> worker_pb2.GenerateRequest:
    message = worker_pb2.GenerateRequest(model_id=MODEL, prompt_tokens=prompt, max_new_tokens=n)
    if sampling:
        message.sampling.CopyFrom(worker_pb2.SamplingParams(**sampling))
    return message


def collect(call) -> tuple[list[int], int, str]:
    """Read a stream to its end: (tokens, token messages, finish_reason)."""
    tokens, messages, reason = [], 0, ""
    for message in call:
        if message.tokens:
            messages += 1
            tokens.extend(message.tokens)
        reason = message.finish_reason or reason
    return tokens, messages, reason


def run_all(calls) -> list:
    out: list = [None] * len(calls)
    errors: list = []

    def run(i):
        try:
            out[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, f"a stream failed: {errors[0]!r}"
    return out


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_at_default_flags_a_hundred_streams_reach_the_scheduler_and_fill_the_batch(kernels):
    worker = Worker(kernels)          # every WorkerConfig and edge default (--max-plans too)
    try:
        assert worker.loaded.scheduler.max_batch_size == 64, "the default batch bound changed"
        prompts = [prompt_of(i % 20, 3 + i % 20) for i in range(100)]
        results: list = [None] * 100
        with worker.loaded.lock:      # the engine cannot step: every stream must queue first
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, worker.client.generate(MODEL, prompts[i], 16))) for i in range(100)]
            for t in threads:
                t.start()
            eventually(lambda: worker.scheduler()["waiting"] == 100, 60,
                       "all 100 streams queued at the scheduler (no thread bound before it)")
        for t in threads:
            t.join(300)
        for i, r in enumerate(results):
            assert r is not None, f"stream {i} did not finish"
            assert r.tokens == reference(prompts[i], 16), f"stream {i} differs from its solo run"
        s = worker.client.stats().scheduler
        assert s.peak_batch_size == 64, f"peak batch {s.peak_batch_size}, not --max-batch-size"
        assert (s.kv_blocks_used, s.running, s.waiting) == (0, 0, 0)
    finally:
        worker.close()


def test_overload_beyond_max_queued_is_refused_at_once_with_retry_info_and_accepted_streams_finish(
        kernels):
    worker = Worker(kernels, max_queued=8)
    try:
        prompts = [prompt_of(i, 5) for i in range(8)]
        results: list = [None] * 8
        with worker.loaded.lock:
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, worker.client.generate(MODEL, prompts[i], 10))) for i in range(8)]
            for t in threads:
                t.start()
            eventually(lambda: worker.scheduler()["waiting"] == 8, 60, "8 streams queued")
            for _ in range(5):
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as caught:
                    worker.client.generate(MODEL, prompt_of(99, 5), 10)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() - started < PROMPTLY_S, "the refusal waited for the queue"
                assert "--max-queued" in caught.value.details(), "the refusal names no bound"
                status = rpc_status.from_call(caught.value)
                retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
                assert retry, "RESOURCE_EXHAUSTED carries no google.rpc.RetryInfo"
        for t in threads:
            t.join(120)
        for p, r in zip(prompts, results, strict=True):
            assert r is not None and r.tokens == reference(p, 10), "an accepted stream was cut"
        assert worker.client.stats().scheduler.rejected == 5
    finally:
        worker.close()


@pytest.mark.parametrize("window", ["zero", "small"])
def test_a_reader_that_never_reads_is_cancelled_its_kv_freed_and_others_finish(kernels, window):
    # zero: a one-byte window, the first write never completes. small: a 1 KiB window and a
    # call that is never iterated; gRPC takes what fits, then the writes stop.
    worker = Worker(kernels, edge={"max_stream_buffer_tokens": 8, "stalled_write_grace_s": 300})
    try:
        options = STALLED if window == "zero" else [("grpc.http2.lookahead_bytes", 1024),
                                                    ("grpc.http2.bdp_probe", 0)]
        channel = grpc.insecure_channel(worker.server.address, options=options)
        stalled = worker_pb2_grpc.WorkerServiceStub(channel).Generate(
            request(prompt_of(1, 4), 1000), timeout=300)
        eventually(lambda: worker.streams.snapshot()["overflowed"] == 1, 120,
                   "the stalled stream overflowed its buffer")
        eventually(lambda: worker.scheduler()["cancelled"] >= 1 and
                   worker.scheduler()["running"] == 0, 60, "the stalled sequence was cancelled")
        assert worker.scheduler()["kv_blocks_used"] == 0, "the stalled stream's KV stayed booked"
        prompts = [prompt_of(i, 6 + i) for i in range(4)]
        results = run_all([lambda p=p: worker.client.generate(MODEL, p, 30) for p in prompts])
        for p, r in zip(prompts, results, strict=True):
            assert r.tokens == reference(p, 30), "a reading stream differs from its solo run"
        with pytest.raises(grpc.RpcError) as caught:
            collect(stalled)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-stream-buffer-tokens 8" in caught.value.details(), \
            "the status does not name the bound and how to fix it"
        eventually(lambda: worker.streams.snapshot()["open_streams"] == 0, 30,
                   "the handler of the stalled stream ended")
        channel.close()
    finally:
        worker.close()


def test_a_handler_parked_on_a_reader_that_never_reads_ends_after_the_grace(kernels):
    worker = Worker(kernels, edge={"max_stream_buffer_tokens": 4, "stalled_write_grace_s": 0.5})
    try:
        call = worker.stalled_stub().Generate(request(prompt_of(2, 4), 200), timeout=300)
        eventually(lambda: worker.streams.snapshot()["overflowed"] == 1, 120, "the overflow")
        eventually(lambda: worker.streams.snapshot()["open_streams"] == 0, 60,
                   "the parked handler was cancelled after the grace")
        eventually(lambda: worker.scheduler()["kv_blocks_used"] == 0, 30, "the KV freed")
        call.cancel()
    finally:
        worker.close()


def test_control_rpcs_answer_promptly_while_64_streams_are_stalled(kernels):
    worker = Worker(kernels, max_plans=8)
    try:
        # The issue-25 wedge: every stream's handler parked in a write its reader never takes
        # (a thread each on a thread-per-call server). Short streams: their sequences finish,
        # so a new Generate finds a batch slot; only the handlers stay.
        stub = worker.stalled_stub()
        calls = [stub.Generate(request(prompt_of(i, 5), 20), timeout=300) for i in range(64)]
        eventually(lambda: worker.streams.snapshot()["open_streams"] == 64, 120,
                   "64 stalled streams open on the worker")
        health = health_pb2_grpc.HealthStub(worker.client.channel)
        for name, call in (
                ("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=PROMPTLY_S)),
                ("GetStats", lambda: worker.client.stub.GetStats(worker_pb2.GetStatsRequest(),
                                                                 timeout=PROMPTLY_S)),
                ("ListModels", lambda: worker.client.stub.ListModels(
                    worker_pb2.ListModelsRequest(), timeout=PROMPTLY_S)),
                ("LoadModel", lambda: worker.client.stub.LoadModel(worker_pb2.LoadModelRequest(
                    model_id="other", family="decoder", config="tiny", seed=1), timeout=60)),
                ("UnloadModel", lambda: worker.client.stub.UnloadModel(
                    worker_pb2.UnloadModelRequest(model_id="other"), timeout=PROMPTLY_S)),
                ("Generate", lambda: worker.client.generate(MODEL, [1, 2, 3], 5,
                                                            timeout=60))):
            call()   # a deadline exceeded here is the starvation this test rules out
        assert worker.client.generate(MODEL, [4, 5, 6], 5).tokens == reference([4, 5, 6], 5)
        for c in calls:
            c.cancel()
        eventually(lambda: worker.streams.snapshot()["open_streams"] == 0, 60,
                   "cancelled streams closed")
    finally:
        worker.close()


def test_the_worker_thread_count_does_not_grow_with_streams(kernels):
    worker = Worker(kernels, max_plans=8)
    try:
        # warm every pool and plan first: lazily started threads are not growth with streams
        run_all([lambda i=i: worker.client.generate(MODEL, prompt_of(i, 4), 4)
                 for i in range(16)])
        stub = worker.stalled_stub()
        few = [stub.Generate(request(prompt_of(i, 4), 900), timeout=300) for i in range(4)]
        eventually(lambda: worker.streams.snapshot()["open_streams"] == 4, 60, "4 open streams")
        baseline = thread_count()
        many = [stub.Generate(request(prompt_of(i, 4), 900), timeout=300) for i in range(196)]
        eventually(lambda: worker.streams.snapshot()["open_streams"] == 200, 120,
                   "200 open streams")
        grown = thread_count() - baseline
        # a thread per stream would be 196; gRPC's own pools may add one or two under load
        assert grown <= 8, f"{grown} more threads with 196 more open streams"
        for c in few + many:
            c.cancel()
        eventually(lambda: worker.streams.snapshot()["open_streams"] == 0, 60, "streams closed")
        eventually(lambda: worker.scheduler()["kv_blocks_used"] == 0, 60, "KV freed")
    finally:
        worker.close()


def test_a_lagging_reader_gets_its_tokens_coalesced_and_identical(kernels):
    worker = Worker(kernels)
    try:
        prompt = prompt_of(3, 5)
        call = worker.stalled_stub().Generate(request(prompt, 300), timeout=300)
        eventually(lambda: worker.loaded.scheduler.stats()["finished"] >= 1, 120,
                   "the sequence finished while its reader did not read")
        tokens, messages, reason = collect(call)
        assert tokens == reference(prompt, 300), "coalescing changed the tokens"
        assert reason == "length"
        assert messages < 300 // 4, f"{messages} messages for 300 lagging tokens: not coalesced"
    finally:
        worker.close()


def sizes(call) -> tuple[list[int], list[int], str]:
    """Read a stream to its end: (tokens, each token message's size, finish_reason)."""
    tokens, counts, reason = [], [], ""
    for message in call:
        if message.tokens:
            counts.append(len(message.tokens))
            tokens.extend(message.tokens)
        reason = message.finish_reason or reason
    return tokens, counts, reason


def test_a_stream_interval_sends_the_first_token_alone_then_that_many_a_message(kernels):
    worker = Worker(kernels, edge={"stream_interval": 4})
    try:
        prompts = [prompt_of(i, 4 + i) for i in range(6)]
        results = run_all([lambda p=p: sizes(worker.client.stub.Generate(request(p, 23),
                                                                          timeout=300))
                           for p in prompts])
        for p, (tokens, counts, reason) in zip(prompts, results, strict=True):
            assert tokens == reference(p, 23), "the interval changed the tokens"
            assert reason == "length"
            assert counts[0] == 1, f"the first token waited for others: {counts}"
            # a message holds 4 or more (a reader behind takes what piled up), the last the rest
            assert all(c >= 4 for c in counts[1:-1]) and len(counts) <= 1 + -(-22 // 4), counts
        assert worker.streams.messages <= 6 * (1 + -(-22 // 4))
    finally:
        worker.close()


def test_a_stream_interval_beyond_the_buffer_bound_is_refused_naming_both():
    from gpu_worker.edge.servicer import EdgeLimits
    from services.common.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="--max-stream-buffer-tokens"):
        EdgeLimits(max_stream_buffer_tokens=8, stream_interval=9)


@pytest.fixture(scope="module")
def worker(kernels):
    w = Worker(kernels)
    yield w
    w.close()


@pytest.mark.parametrize("entries,ok", [(MAX_STOP_TOKEN_IDS, True), (MAX_STOP_TOKEN_IDS + 1, False)])
def test_stop_token_ids_beyond_the_bound_are_invalid_argument_before_any_work(worker, entries, ok):
    before = worker.scheduler()
    call = worker.client.stub.Generate(request([1, 2, 3], 4, stop_token_ids=list(range(entries))),
                                       timeout=60)
    if ok:
        assert collect(call)[0], "a request at the bound was refused"
        return
    with pytest.raises(grpc.RpcError) as caught:
        collect(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_STOP_TOKEN_IDS) in caught.value.details() and \
        "stop_token_ids" in caught.value.details(), "the refusal names no bound"
    after = worker.scheduler()
    assert after["steps"] == before["steps"] and after["rejected"] == before["rejected"]


def test_a_prompt_longer_than_the_context_is_invalid_argument_naming_it(worker):
    with pytest.raises(grpc.RpcError) as caught:
        collect(worker.client.stub.Generate(request([1] * (CFG.max_context + 1), 1), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(CFG.max_context) in caught.value.details()


def test_liveness_stays_serving_while_readiness_is_not(worker):
    health = health_pb2_grpc.HealthStub(worker.client.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    worker.server.set_serving(False)
    try:
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != serving
        assert health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE),
                            timeout=10).status == serving, "a worker that is not ready died"
    finally:
        worker.server.set_serving(True)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving


def test_serving_metrics_are_exported_under_vllm_names(worker):
    worker.client.generate(MODEL, [1, 2, 3], 4)
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker.runtime, worker.streams))
    text = generate_latest(registry).decode()
    for name in ("gpuplane:time_to_first_token_seconds_bucket",
                 "gpuplane:time_per_output_token_seconds_count",
                 "gpuplane:e2e_request_latency_seconds_sum",
                 "gpuplane:request_queue_time_seconds_bucket",
                 "gpuplane:num_requests_running", "gpuplane:num_requests_waiting",
                 "gpuplane:num_streams_open", "gpuplane:stream_buffer_overflows_total"):
        assert name in text, f"{name} is not exported"
    ttft = [line for line in text.splitlines()
            if line.startswith("gpuplane:time_to_first_token_seconds_count")]
    assert ttft and float(ttft[0].split()[-1]) >= 1, "TTFT observed no stream"
