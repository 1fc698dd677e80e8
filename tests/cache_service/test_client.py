"""cache_service.client against real servers: every failure is a miss, stores never block."""
from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

from cache_service.client import KernelCacheClient
from cache_service.convert import artifact_to_pb
from tests.cache_service.cache_helpers import TOKEN, make_artifact


def free_dead_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_stores_in_the_background_and_looks_up_verified_artifacts(server):
    client = KernelCacheClient(server.address, write_token=TOKEN)
    try:
        artifacts = {f"k{i}": make_artifact(4096 + i, i) for i in range(5)}
        for key, artifact in artifacts.items():
            client.store(key, artifact, namespace="ns")
        assert client.flush(5.0), "queued stores did not drain"
        assert client.lookup("k3", "ns") == artifacts["k3"], "lookup must return the same artifact"
        assert client.lookup("k3") is None, "namespaces are separate"
        found = client.batch_lookup(["k0", "missing", "k4"], "ns")
        assert found == {"k0": artifacts["k0"], "k4": artifacts["k4"]}
        stats = client.stats()
        assert (stats["stores"], stats["hits"], stats["misses"]) == (5, 3, 2), stats
        assert stats["breaker_open"] == 0 and stats["errors"] == 0
    finally:
        client.close()


def test_batch_lookup_fetches_entries_omitted_for_size_in_follow_up_calls(server):
    client = KernelCacheClient(server.address, write_token=TOKEN)
    try:
        for i in range(3):
            client.store(f"k{i}", make_artifact(4096, i))
        assert client.flush()
        server.servicer.batch_response_bytes = 5000  # one 4 KiB entry per response
        found = client.batch_lookup(["k0", "k1", "k2"])
        assert sorted(found) == ["k0", "k1", "k2"], "omitted entries must be fetched again"
        assert server.store.stats().hits == 3, "each entry must be read exactly once"
    finally:
        client.close()


def test_server_down_lookups_are_misses_within_the_deadline_and_the_breaker_opens():
    client = KernelCacheClient(f"127.0.0.1:{free_dead_port()}", deadline_s=0.25,
                               failure_threshold=3, cooldown_s=60)
    try:
        for _ in range(5):
            start = time.monotonic()
            assert client.lookup("k") is None
            assert client.batch_lookup(["k"]) == {}
            # Two calls, each bounded by its 0.25 s deadline; the slack absorbs a loaded CI host.
            assert time.monotonic() - start < 2 * 0.25 + 0.5, "a dead server must not stall lookups"
        client.store("k", make_artifact())  # must not raise or block
        stats = client.stats()
        assert stats["breaker_open"] == 1, "consecutive failures must open the breaker"
        assert stats["short_circuits"] > 0 and stats["errors"] + stats["timeouts"] >= 3, stats
        start = time.monotonic()
        for _ in range(100):
            client.lookup("k")
        assert time.monotonic() - start < 0.1, "an open breaker must answer misses at once"
    finally:
        client.close(flush_timeout=0.1)


def test_a_hung_server_costs_one_deadline_per_lookup_counted_as_a_timeout():
    hung = socket.socket()  # accepts TCP but never speaks HTTP/2
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    client = KernelCacheClient(f"127.0.0.1:{hung.getsockname()[1]}", deadline_s=0.2)
    try:
        start = time.monotonic()
        assert client.lookup("k") is None
        elapsed = time.monotonic() - start
        assert elapsed < 0.2 + 0.25, f"lookup took {elapsed:.3f}s against a 0.2s deadline"
        assert client.stats()["timeouts"] == 1
    finally:
        client.close(flush_timeout=0.1)
        hung.close()


def test_refused_stores_are_counted_errors_not_exceptions(server):
    client = KernelCacheClient(server.address, write_token="wrong")
    try:
        client.store("k", make_artifact())
        assert client.flush(5.0)
        assert client.stats()["errors"] == 1 and client.stats()["stores"] == 0
        assert client.stats()["breaker_open"] == 0, "a refusal is not a dead peer"
        assert server.store.stats().entries == 0
    finally:
        client.close()


def test_store_queue_is_bounded_and_drops_instead_of_blocking():
    hung = socket.socket()  # the first store hangs on it, so the queue cannot drain meanwhile
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    client = KernelCacheClient(f"127.0.0.1:{hung.getsockname()[1]}", queue_items=4,
                               queue_bytes=1 << 30, store_deadline_s=0.5)
    try:
        start = time.monotonic()
        for i in range(50):
            client.store(f"k{i}", make_artifact(1024, i))
        assert time.monotonic() - start < 0.5, "store() must never block on the network"
        assert client.stats()["dropped"] >= 40, "a full queue must drop (and count) stores"
    finally:
        client.close(flush_timeout=0.1)
        hung.close()


class _LyingCache(pb_grpc.KernelCacheServiceServicer):
    """A peer that serves bytes whose digest does not match: what a poisoned cache looks like."""

    def Lookup(self, request, context):
        artifact = artifact_to_pb(make_artifact(2048))
        artifact.data = artifact.data[:-1] + b"!"
        return pb.LookupResponse(found=True, artifact=artifact)


def test_bytes_that_fail_their_digest_are_a_counted_miss_never_returned():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_KernelCacheServiceServicer_to_server(_LyingCache(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = KernelCacheClient(f"127.0.0.1:{port}")
    try:
        assert client.lookup("k") is None, "corrupt bytes reached the caller"
        assert client.stats()["corrupt"] == 1 and client.stats()["misses"] == 1
    finally:
        client.close()
        server.stop(0)


class _Recorder(pb_grpc.KernelCacheServiceServicer):
    """Keeps the metadata of every Lookup it answers."""

    def __init__(self) -> None:
        self.seen: list[list[tuple[str, str]]] = []

    def Lookup(self, request, context):
        self.seen.append([(k, v) for k, v in context.invocation_metadata()
                          if k in ("authorization", "traceparent")])
        return pb.LookupResponse(found=False)


def test_every_call_carries_the_token_and_exactly_one_trace_context_without_interceptors():
    from opentelemetry.sdk.trace import TracerProvider

    from services.common import telemetry

    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_KernelCacheServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    silent, recording = telemetry.tracer_provider("probe-silent-cache-client"), TracerProvider()
    caller = TracerProvider()
    try:
        for provider in (silent, recording):
            client = KernelCacheClient(f"127.0.0.1:{port}", write_token=TOKEN,
                                       tracer_provider=provider)
            client.lookup("outside")
            with caller.get_tracer("test").start_as_current_span("load") as span:
                client.lookup("inside")
                trace_id = format(span.get_span_context().trace_id, "032x")
            client.close()
            outside, inside = recorder.seen[-2:]
            assert ("authorization", f"Bearer {TOKEN}") in outside, "the token was not sent"
            assert sorted(k for k, _ in inside) == ["authorization", "traceparent"], inside
            assert trace_id in dict(inside)["traceparent"], "the caller's trace context was dropped"
            if not telemetry.is_recording(provider):  # no span to make: no Python interceptor
                assert type(client._channel).__module__ != "grpc._interceptor"
    finally:
        server.stop(0)
