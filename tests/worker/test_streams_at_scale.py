"""Issue 23: open streams cost a buffer, never a thread, and readiness is not load (sim backend,
the real paged decoder, a real grpc.aio server on loopback: the `Worker` of test_many_streams;
its 100-streams-at-default-flags test covers the scheduler side).

A stream held open here is a Generate on a channel with a one-byte HTTP/2 receive window: the
server's first write to it never completes, so its handler stays open (parked in that write)
after its sequence finished, and the client side of it is a call object, not a thread. Counts
are compared once every stream is open and every sequence has finished (polling, no timing).
"""
from __future__ import annotations

import gc
import os
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from gpu_worker.edge.servicer import ADMIT_THREADS, LIVENESS_SERVICE
from tests.polling import eventually
from tests.worker.test_many_streams import Worker, collect, prompt_of, reference, request

NEW = 24                   # tokens per held stream: its sequence finishes, its handler stays
SERVING = health_pb2.HealthCheckResponse.SERVING


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def vm_rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def hold_open(worker: Worker, stub, count: int, already: int = 0, finished_before: int = 0
              ) -> list:
    """`count` more held streams of the same work (a 6-token prompt, NEW tokens each) on a
    worker already holding `already` open, whose scheduler finished `finished_before`
    sequences before them; returns the calls once all are open at the edge and every sequence
    has finished."""
    calls = [stub.Generate(request(prompt_of(already + i, 6), NEW), timeout=600)
             for i in range(count)]
    total = already + count
    eventually(lambda: worker.streams.snapshot()["open_streams"] == total, 180,
               f"{total} streams open at the edge")
    eventually(lambda: worker.scheduler()["finished"] >= finished_before + total and
               worker.scheduler()["running"] == worker.scheduler()["waiting"] == 0, 180,
               f"the {total} held streams' sequences finished")
    return calls


def close_all(worker: Worker, calls: list) -> None:
    for c in calls:
        c.cancel()
    eventually(lambda: worker.streams.snapshot()["open_streams"] == 0, 120, "streams closed")
    eventually(lambda: worker.scheduler()["kv_blocks_used"] == 0, 60, "KV freed")


def test_python_and_os_threads_stay_flat_from_10_to_100_open_streams(kernels):
    worker = Worker(kernels)
    calls: list = []
    try:
        stub = worker.stalled_stub()
        calls += hold_open(worker, stub, 10)
        py10, os10 = threading.active_count(), os_threads()
        calls += hold_open(worker, stub, 90, already=10)
        py100, os100 = threading.active_count(), os_threads()
        # A thread per stream would be +90. What may still start lazily between the two counts
        # is a thread pool's thread (the edge's admission pool has ADMIT_THREADS) and one or two
        # of gRPC's own pollers: nothing that scales with streams.
        slack = ADMIT_THREADS + 2
        assert py100 - py10 <= slack, (
            f"threading.active_count() {py10} with 10 open streams, {py100} with 100: "
            f"{py100 - py10} more Python threads for 90 more streams (allowed {slack})")
        assert os100 - os10 <= slack, (
            f"/proc/self/task: {os10} threads with 10 open streams, {os100} with 100: "
            f"{os100 - os10} more OS threads for 90 more streams (allowed {slack})")
        close_all(worker, calls)
        calls = []
    finally:
        for c in calls:
            c.cancel()
        worker.close()


# An open stream's own state: its edge task, a TokenBuffer of at most NEW tokens, the gRPC call
# on both ends of the loopback connection (the client lives in this process too), a finished
# Sequence's bookkeeping. Tens of KiB; a bound of 1 MiB per stream is generous and still far
# below what a thread's stack pages, a per-stream KV allocation or a copy of a model's state
# would cost.
RSS_PER_STREAM_KIB = 1024


def test_process_rss_grows_by_at_most_a_bound_per_open_stream_from_100_to_300(kernels):
    worker = Worker(kernels)
    calls: list = []
    try:
        stub = worker.stalled_stub()
        # warm the allocator and every lazily made object with a first round of 100 streams
        close_all(worker, hold_open(worker, stub, 100))
        base = worker.scheduler()["finished"]
        stub = worker.stalled_stub()
        calls += hold_open(worker, stub, 100, finished_before=base)
        gc.collect()
        rss100 = vm_rss_kib()
        calls += hold_open(worker, stub, 200, already=100, finished_before=base)
        gc.collect()
        rss300 = vm_rss_kib()
        per_stream = (rss300 - rss100) / 200
        print(f"VmRSS {rss100} KiB at 100 open streams, {rss300} KiB at 300: "
              f"{per_stream:.1f} KiB per stream")
        assert per_stream <= RSS_PER_STREAM_KIB, (
            f"VmRSS of this process (the sim worker and its in-process client) grew "
            f"{rss300 - rss100} KiB from 100 to 300 open streams of the same work (6-token "
            f"prompts, {NEW} tokens, sequences finished, handlers open): {per_stream:.0f} KiB "
            f"per open stream, bound {RSS_PER_STREAM_KIB} KiB: an open stream should cost a "
            "buffer, not a thread or memory of its model")
        close_all(worker, calls)
        calls = []
    finally:
        for c in calls:
            c.cancel()
        worker.close()


def test_readiness_stays_serving_while_the_queue_is_full_and_new_streams_are_refused(kernels):
    # docs/worker.md "Health": a full queue is back-pressure (RESOURCE_EXHAUSTED with retry
    # info, per request), never unreadiness, which would make Kubernetes take the pod out of
    # its Service and shed every stream it is serving.
    worker = Worker(kernels, max_queued=8)
    health = health_pb2_grpc.HealthStub(worker.client.channel)

    def status(service: str = "") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status
    try:
        prompts = [prompt_of(i, 5) for i in range(8)]
        with worker.loaded.lock:      # the engine cannot step: the 8 queue and stay queued
            queued = [worker.client.stub.Generate(request(p, 10), timeout=300) for p in prompts]
            eventually(lambda: worker.scheduler()["waiting"] == 8, 60, "8 streams queued")
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as caught:
                    collect(worker.client.stub.Generate(request(prompt_of(99, 5), 10),
                                                        timeout=60))
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, \
                    "a request beyond --max-queued was not refused as back-pressure"
                details = rpc_status.from_call(caught.value).details
                assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in details), \
                    "the refusal carries no RetryInfo"
                assert status() == SERVING, \
                    "readiness went NOT_SERVING at --max-queued: load made the pod unready"
                assert status(LIVENESS_SERVICE) == SERVING
            assert worker.scheduler()["waiting"] == 8, "the full queue drained while held"
        for p, call in zip(prompts, queued, strict=True):
            tokens, _, reason = collect(call)
            assert tokens == reference(p, 10) and reason == "length", "a queued stream was cut"
        assert worker.client.stats().scheduler.rejected == 3
        assert status() == SERVING
    finally:
        worker.close()
