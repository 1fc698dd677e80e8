"""services.common.aio_server: create_server's contract kept on a grpc.aio loop (error mapping,
health, tracing, drain) with async handlers. TLS, the health-only port and authorization on the
aio server are proven on the governor, which is served this way (test_tls.py, test_authz.py)."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.aio_server import create_aio_server
from services.common.server import ServiceRegistration
from tests.common.test_server import ERRORS, SERVICE, _raw, _unary
from tests.polling import eventually


class AsyncProbe:
    """The async twin of test_server.Probe: echo, raise a domain error, crash, abort, or wait."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request in ERRORS:
            raise ERRORS[request][0]
        if request == b"crash":
            raise ZeroDivisionError("secret internals")
        if request == b"slow":
            await asyncio.to_thread(self.release.wait, 5)
        if request == b"abort":
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "handler aborted itself")
        return request

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext):
        yield b"first"
        if request in ERRORS:
            raise ERRORS[request][0]
        raise ZeroDivisionError("secret internals")


def _registration(probe: AsyncProbe) -> ServiceRegistration:
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(probe.unary, _raw, _raw),
        "Stream": grpc.unary_stream_rpc_method_handler(probe.stream, _raw, _raw),
    })
    return ServiceRegistration(SERVICE, probe,
                               lambda _s, server: server.add_generic_rpc_handlers((handler,)))


@pytest.fixture
def served():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    probe = AsyncProbe()
    running = create_aio_server("127.0.0.1:0", [_registration(probe)], provider)
    channel = grpc.insecure_channel(running.address)
    yield running, channel, probe, exporter
    probe.release.set()
    channel.close()
    running.stop(grace=0)


@pytest.mark.parametrize("request_bytes", list(ERRORS))
def test_aio_domain_errors_map_to_their_status_codes(served, request_bytes):
    _, channel, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(request_bytes, timeout=5)
    assert info.value.code() == ERRORS[request_bytes][1], "domain error mapped to the wrong status"
    assert ERRORS[request_bytes][0].message in info.value.details()


def test_aio_unexpected_errors_are_internal_and_never_leak_a_traceback(served):
    _, channel, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(b"crash", timeout=5)
    assert info.value.code() == grpc.StatusCode.INTERNAL, "unexpected errors must be INTERNAL"
    assert "secret internals" not in info.value.details()
    assert "ref " in info.value.details(), "the client gets a reference id for the server log"


def test_aio_a_handler_that_aborts_itself_keeps_its_own_status(served):
    _, channel, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(b"abort", timeout=5)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_aio_errors_in_streaming_handlers_are_mapped_after_the_first_message(served):
    _, channel, _, _ = served
    call = channel.unary_stream(f"/{SERVICE}/Stream", _raw, _raw)(b"missing", timeout=5)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for message in call:
            got.append(message)  # noqa: PERF402 - keep what arrived before the error
    assert got == [b"first"]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_aio_health_and_reflection_serve_the_registered_service(served):
    _, channel, _, _ = served
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"health of {name!r}"
    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_aio_stop_flips_health_to_not_serving_before_in_flight_calls_finish(served):
    running, channel, probe, _ = served
    slow = _unary(channel).future(b"slow", timeout=10)
    time.sleep(0.2)
    stopper = threading.Thread(target=running.stop, kwargs={"grace": 5})
    stopper.start()
    try:
        deadline = time.monotonic() + 5
        while running.health._server_status.get(SERVICE) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health never flipped to NOT_SERVING during drain"
            time.sleep(0.01)
        assert not slow.done(), "the in-flight call was cut off instead of drained"
    finally:
        probe.release.set()
        stopper.join(10)
    assert slow.result() == b"slow", "the in-flight call must complete during the grace period"
    assert not running.thread.is_alive(), "stop() must end the event loop's thread"


def test_aio_server_spans_carry_the_status_and_health_is_not_traced(served):
    _, channel, _, exporter = served
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    _unary(channel)(b"ok", timeout=5)
    with pytest.raises(grpc.RpcError):
        _unary(channel)(b"missing", timeout=5)
    # An aborted call's span ends as its handler unwinds, which may be after the client saw the
    # status: wait for it rather than race it.
    eventually(lambda: len([s for s in exporter.get_finished_spans()
                            if s.name == f"/{SERVICE}/Unary"]) >= 2, 5, "both calls' spans")
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    assert all("Health" not in n for n in names), f"health checks must not be traced: {names}"
    probe_spans = [s for s in spans if s.name == f"/{SERVICE}/Unary"]
    assert len(probe_spans) == 2, names
    assert probe_spans[1].attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


def test_aio_binding_a_busy_port_fails_with_a_clear_error_and_leaves_no_loop_running(served):
    running, _, probe, _ = served
    loops = sum(t.name == "grpc-aio" for t in threading.enumerate())
    with pytest.raises(OSError, match="bind"):
        create_aio_server(f"127.0.0.1:{running.port}", [_registration(probe)], TracerProvider())
    assert sum(t.name == "grpc-aio" for t in threading.enumerate()) == loops, \
        "a failed start must stop the loop thread it started"
