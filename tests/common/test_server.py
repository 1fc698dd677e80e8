"""services.common: one server contract (error mapping, health, reflection, tracing, drain) kept by
both bootstraps, the thread-pool server (`create_server`) and the grpc.aio one
(`create_aio_server`, async handlers): every contract test runs on both (`served` is
parametrized). TLS, the health-only port and authorization on the aio server are proven on the
governor, which is served that way (test_tls.py, test_authz.py)."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import errors
from services.common.aio_server import create_aio_server
from services.common.server import ServiceRegistration, create_server
from tests.polling import eventually

SERVICE = "gpuplane.test.v1.Probe"
_raw = lambda b: b

ERRORS = {
    b"invalid": (errors.InvalidArgument("bad shape"), grpc.StatusCode.INVALID_ARGUMENT),
    b"missing": (errors.NotFound("no model 'x'"), grpc.StatusCode.NOT_FOUND),
    b"state": (errors.FailedPrecondition("not loaded"), grpc.StatusCode.FAILED_PRECONDITION),
    b"drain": (errors.Unavailable("draining"), grpc.StatusCode.UNAVAILABLE),
    b"nocred": (errors.Unauthenticated("token required"), grpc.StatusCode.UNAUTHENTICATED),
    b"wrongcred": (errors.PermissionDenied("wrong token"), grpc.StatusCode.PERMISSION_DENIED),
    b"full": (
        errors.ResourceExhausted(
            "asked 64 MiB in zone kv, 12 MiB free",
            asked_bytes=64 << 20,
            free_bytes=12 << 20,
            zone="kv",
            violations=[errors.QuotaViolation("device:GPU-1/zone:kv", "asked 64 MiB, 12 MiB free")],
            reclaimable=[errors.ReclaimHint("w1", "workspace", 32 << 20)],
        ),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
}


class Probe:
    """A servicer whose behaviour the request picks: echo, raise a domain error, crash, or wait."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        if request in ERRORS:
            raise ERRORS[request][0]
        if request == b"crash":
            raise ZeroDivisionError("secret internals")
        if request == b"slow":
            self.release.wait(5)
        if request == b"abort":
            context.abort(grpc.StatusCode.ALREADY_EXISTS, "handler aborted itself")
        return request

    def stream(self, request: bytes, context: grpc.ServicerContext):
        yield b"first"
        if request in ERRORS:
            raise ERRORS[request][0]
        raise ZeroDivisionError("secret internals")


class AsyncProbe:
    """The async twin of Probe, for the grpc.aio server."""

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


# kind -> (bootstrap, probe type)
SERVERS = {"sync": (create_server, Probe), "aio": (create_aio_server, AsyncProbe)}


def _registration(probe: Probe | AsyncProbe) -> ServiceRegistration:
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(probe.unary, _raw, _raw),
            "Stream": grpc.unary_stream_rpc_method_handler(probe.stream, _raw, _raw),
        },
    )
    return ServiceRegistration(SERVICE, probe, lambda _s, server: server.add_generic_rpc_handlers((handler,)))


def _serve(kind: str):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    create, probe_type = SERVERS[kind]
    probe = probe_type()
    running = create("127.0.0.1:0", [_registration(probe)], provider)
    channel = grpc.insecure_channel(running.address)
    yield running, channel, probe, exporter
    probe.release.set()
    channel.close()
    running.stop(grace=0)


@pytest.fixture(params=list(SERVERS))
def served(request):
    yield from _serve(request.param)


@pytest.fixture
def served_aio():
    yield from _serve("aio")


def _unary(channel: grpc.Channel):
    return channel.unary_unary(f"/{SERVICE}/Unary", _raw, _raw)


@pytest.mark.parametrize("request_bytes", list(ERRORS))
def test_domain_errors_map_to_their_status_codes(served, request_bytes):
    _, channel, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(request_bytes, timeout=5)
    assert info.value.code() == ERRORS[request_bytes][1], "domain error mapped to the wrong status"
    assert ERRORS[request_bytes][0].message in info.value.details()


def test_unexpected_errors_are_internal_and_never_leak_a_traceback(served):
    _, channel, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(b"crash", timeout=5)
    assert info.value.code() == grpc.StatusCode.INTERNAL, "unexpected errors must be INTERNAL, not UNKNOWN"
    assert "secret internals" not in info.value.details() and "Traceback" not in info.value.details()
    assert "ref " in info.value.details(), "the client gets a reference id to find the server log entry"


def test_a_handler_that_aborts_itself_keeps_its_own_status(served):
    _, channel, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(b"abort", timeout=5)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_resource_exhausted_carries_what_was_asked_what_is_free_and_what_is_reclaimable(served):
    _, channel, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(b"full", timeout=5)
    status = rpc_status.from_call(info.value)
    assert status is not None, "rich status details missing from the trailers"
    quota = error_details_pb2.QuotaFailure()
    info_detail = error_details_pb2.ErrorInfo()
    kinds = set()
    for detail in status.details:
        if detail.Is(quota.DESCRIPTOR):
            detail.Unpack(quota)
            kinds.add("quota")
        elif detail.Is(info_detail.DESCRIPTOR):
            detail.Unpack(info_detail)
            kinds.add("info")
    assert kinds == {"quota", "info"}
    assert info_detail.metadata["asked_bytes"] == str(64 << 20)
    assert info_detail.metadata["free_bytes"] == str(12 << 20)
    subjects = [v.subject for v in quota.violations]
    assert "device:GPU-1/zone:kv" in subjects
    assert any(s.startswith("reclaimable:worker/w1/zone/workspace") for s in subjects)


def test_errors_in_streaming_handlers_are_mapped_after_the_first_message(served):
    _, channel, _, _ = served
    call = channel.unary_stream(f"/{SERVICE}/Stream", _raw, _raw)(b"missing", timeout=5)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for message in call:
            got.append(message)  # noqa: PERF402 - keep what arrived before the error
    assert got == [b"first"]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_serves_overall_and_per_service(served):
    _, channel, _, _ = served
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"health of {name!r}"


def test_reflection_lists_the_registered_services(served):
    _, channel, _, _ = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_stop_flips_health_to_not_serving_before_in_flight_calls_finish(served):
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
    if hasattr(running, "thread"):      # the aio server's event loop
        assert not running.thread.is_alive(), "stop() must end the event loop's thread"


def test_server_spans_carry_rpc_attributes_and_status_and_health_is_not_traced(served):
    _, channel, _, exporter = served
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    _unary(channel)(b"ok", timeout=5)
    with pytest.raises(grpc.RpcError):
        _unary(channel)(b"missing", timeout=5)
    # On the aio server a failed call's span ends as its handler unwinds, which may be after the
    # client saw the status: wait for it rather than race it.
    eventually(lambda: len([s for s in exporter.get_finished_spans()
                            if s.name == f"/{SERVICE}/Unary"]) >= 2, 5, "both calls' spans")
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    assert all("Health" not in n for n in names), f"health checks must not be traced: {names}"
    probe_spans = [s for s in spans if s.name == f"/{SERVICE}/Unary"]
    assert len(probe_spans) == 2, names
    ok, failed = probe_spans
    assert ok.attributes["rpc.system"] == "grpc"
    assert ok.attributes["rpc.service"] == SERVICE
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


def test_binding_a_busy_port_fails_with_a_clear_error(served):
    running, _, probe, _ = served
    create = SERVERS["aio" if isinstance(probe, AsyncProbe) else "sync"][0]
    with pytest.raises(Exception, match="bind|address|port"):
        create(f"127.0.0.1:{running.port}", [_registration(probe)], TracerProvider())


def test_a_failed_aio_start_leaves_no_event_loop_running(served_aio):
    running, _, probe, _ = served_aio
    loops = sum(t.name == "grpc-aio" for t in threading.enumerate())
    with pytest.raises(OSError, match="bind"):
        create_aio_server(f"127.0.0.1:{running.port}", [_registration(probe)], TracerProvider())
    assert sum(t.name == "grpc-aio" for t in threading.enumerate()) == loops, \
        "a failed start must stop the loop thread it started"


def test_servers_skip_tracing_when_no_exporter_is_configured(monkeypatch):
    from services.common import telemetry

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setattr(telemetry, "_configured", {})
    silent = telemetry.tracer_provider("probe-silent")
    assert not telemetry.is_recording(silent), "a provider that exports nowhere must not be traced"
    exporter = InMemorySpanExporter()
    loud = TracerProvider()
    loud.add_span_processor(SimpleSpanProcessor(exporter))
    assert telemetry.is_recording(loud)
    probe = Probe()
    running = create_server("127.0.0.1:0", [_registration(probe)], silent)
    try:
        with grpc.insecure_channel(running.address) as channel:
            assert _unary(channel)(b"ok", timeout=5) == b"ok"
            with pytest.raises(grpc.RpcError) as info:
                _unary(channel)(b"missing", timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, "errors still mapped untraced"
    finally:
        running.stop(grace=0)


def test_an_untraced_channel_still_carries_the_callers_trace_context(monkeypatch):
    from opentelemetry import trace as trace_api

    from services.common import telemetry

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setattr(telemetry, "_configured", {})
    silent = telemetry.tracer_provider("probe-silent-client")
    seen: list[str] = []

    class Capture(Probe):
        def unary(self, request, context):
            seen.extend(v for k, v in context.invocation_metadata() if k == "traceparent")
            return request

    running = create_server("127.0.0.1:0", [_registration(Capture())], TracerProvider())
    caller = TracerProvider()
    try:
        channel = telemetry.traced_channel(grpc.insecure_channel(running.address), silent)
        with caller.get_tracer("test").start_as_current_span("caller") as span:
            _unary(channel)(b"ok", timeout=5)
            trace_id = format(span.get_span_context().trace_id, "032x")
        assert seen and trace_id in seen[0], "the caller's trace context was dropped"
        assert trace_api.get_current_span() is not span
    finally:
        running.stop(grace=0)
