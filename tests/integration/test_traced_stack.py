"""The three services in one process on loopback ports, each with its own tracer provider and
in-memory exporter: one client call must be one trace across worker, cache service and governor.
Every test runs twice: in plaintext, and over mutual TLS with per-RPC authorization on all three
servers (certificates made here, roles mapped from their SPIFFE URIs)."""
from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from gpu_worker.edge.client import WorkerClient
from services.common.authz import Policy
from services.common.identity import RoleMap
from services.common.security import ServerSecurity
from services.common.tls import ChannelTLS, ServerTLS

from .spans import Traced, ancestors, assert_rpc_attributes, rpc_span, trace_spans

WORKER = "gpuplane.worker.v1.WorkerService"
GOVERNOR = "gpuplane.governor.v1.GovernorService"
CACHE = "gpuplane.kernelcache.v1.KernelCacheService"
TOKEN = "integration-token"


@dataclass
class Security:
    """What each party of the stack is given in one mode: plaintext (all None) or mutual TLS."""

    servers: dict[str, ServerSecurity] = field(default_factory=dict)
    worker_out: ChannelTLS | None = None  # the worker's calls to the governor and the cache
    client: ChannelTLS | None = None      # the test's calls to the worker (an admin identity)


@pytest.fixture(params=["plaintext", "mutual-tls"])
def security(request, tmp_path: pathlib.Path) -> Security:
    if request.param == "plaintext":
        return Security()
    from tests.certs import CertificateAuthority

    ca = CertificateAuthority(tmp_path / "pki")
    ca_file = str(ca.ca_file)
    servers = {}
    for name, roles in (("governor", [("worker", "spiffe://gpuplane/worker/*")]),
                        ("cache", [("worker", "spiffe://gpuplane/worker/*")]),
                        ("worker", [("admin", "spiffe://gpuplane/admin/*")])):
        leaf = ca.issue(name, uris=(f"spiffe://gpuplane/{name}",))
        servers[name] = ServerSecurity(ServerTLS(str(leaf.cert), str(leaf.key), ca_file),
                                       Policy(RoleMap.of(roles)))
    worker = ca.issue("worker-id", uris=("spiffe://gpuplane/worker/traced-worker",))
    admin = ca.issue("admin", uris=("spiffe://gpuplane/admin/ops",))
    # The worker serves and calls out with one certificate, as in a pod.
    servers["worker"] = ServerSecurity(ServerTLS(str(worker.cert), str(worker.key), ca_file),
                                       servers["worker"].policy)
    return Security(servers, ChannelTLS(ca_file, str(worker.cert), str(worker.key)),
                    ChannelTLS(ca_file, str(admin.cert), str(admin.key)))


@pytest.fixture
def stack(tmp_path: pathlib.Path, security: Security) -> Iterator[tuple[Traced, WorkerClient]]:
    from cache_service.config import ServerConfig
    from cache_service.server import start_cache_server
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker
    from services.governor.server import start_governor

    traced = Traced()
    governor, _ = start_governor("127.0.0.1:0", tmp_path / "governor.db",
                                 tracer_provider=traced.provider("governor"),
                                 security=security.servers.get("governor"))
    cache = start_cache_server(
        ServerConfig(listen="127.0.0.1:0", db=tmp_path / "cache.db", write_token=TOKEN,
                     security=security.servers.get("cache", ServerSecurity())),
        tracer_provider=traced.provider("kernel-cache"), registry=CollectorRegistry())
    runtime = WorkerRuntime(WorkerConfig(
        backend="sim", governor=governor.address, cache=cache.address,
        cache_dir=tmp_path / "kernels", worker_id="traced-worker", cache_write_token=TOKEN,
        tls=security.worker_out, tracer_provider=traced.provider("gpu-worker")))
    runtime.start()
    worker = serve_worker(runtime, "127.0.0.1:0", traced.provider("gpu-worker"),
                          security=security.servers.get("worker"))
    client = WorkerClient(worker.address, deadline_s=120.0, tracer_provider=traced.provider("client"),
                          tls=security.client)
    try:
        yield traced, client
    finally:
        client.close()
        worker.stop(grace=5.0)
        cache.stop()
        governor.stop(grace=5.0)
        traced.shutdown()


def _server_span_of(traced: Traced, service: str, full_service: str, trace_id: int):
    """Any server span `service` recorded in `trace_id`."""
    for name, span in trace_spans(traced, trace_id):
        if name == service and span.kind == SpanKind.SERVER and full_service in span.name:
            return span
    seen = sorted(f"{n}:{s.name}" for n, s in trace_spans(traced, trace_id))
    raise AssertionError(f"the trace has no {service} server span; it has {seen}")


def test_one_load_model_call_is_one_trace_across_worker_cache_and_governor(stack) -> None:
    traced, client = stack
    traced.clear()
    client.load_model("traced-decoder", "decoder", "tiny", 1)

    call = rpc_span(traced, "client", "WorkerService/LoadModel", SpanKind.CLIENT)
    trace_id = call.context.trace_id
    served = rpc_span(traced, "gpu-worker", "WorkerService/LoadModel", SpanKind.SERVER, trace_id)
    assert served.parent is not None and served.parent.span_id == call.context.span_id, \
        "the worker's server span is not the child of the client's call"
    assert_rpc_attributes(call, WORKER, "LoadModel")
    assert_rpc_attributes(served, WORKER, "LoadModel")

    for service, full in (("governor", GOVERNOR), ("kernel-cache", CACHE)):
        downstream = _server_span_of(traced, service, full, trace_id)
        chain = ancestors(traced, downstream)
        assert chain and chain[0].kind == SpanKind.CLIENT, \
            f"the {service} span's parent is not the worker's outgoing call"
        assert served in chain, f"the {service} span does not descend from the worker's LoadModel"
        method = downstream.name.rsplit("/", 1)[-1]
        assert_rpc_attributes(downstream, full, method)
        assert_rpc_attributes(chain[0], full, method)


def test_one_generate_call_is_one_trace_with_the_worker_span_under_the_client(stack) -> None:
    traced, client = stack
    client.load_model("traced-decoder", "decoder", "tiny", 1)
    traced.clear()
    client.generate("traced-decoder", [1, 2, 3, 4], 3)

    call = rpc_span(traced, "client", "WorkerService/Generate", SpanKind.CLIENT)
    served = rpc_span(traced, "gpu-worker", "WorkerService/Generate", SpanKind.SERVER,
                      call.context.trace_id)
    assert served.parent is not None and served.parent.span_id == call.context.span_id, \
        "Generate's server span is not the child of the client's call"
    assert_rpc_attributes(served, WORKER, "Generate")
    tags = served.attributes
    assert (tags.get("gpuplane.model_id"), tags.get("gpuplane.prompt_tokens")) == \
        ("traced-decoder", 4), "Generate's span lacks the model and shape attributes"
    # Every span the worker made for this request belongs to the client's trace.
    own = [s for s in traced.spans("gpu-worker")
           if s[1].parent is not None and s[1].parent.span_id == served.context.span_id]
    assert all(span.context.trace_id == call.context.trace_id for _, span in own), \
        "a child of Generate's span started a new trace"


def test_errors_carry_their_status_code_on_the_spans(stack) -> None:
    traced, client = stack
    traced.clear()
    with pytest.raises(grpc.RpcError) as caught:
        client.generate("no-such-model", [1, 2], 2)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, "unknown model is not NOT_FOUND"
    call = rpc_span(traced, "client", "WorkerService/Generate", SpanKind.CLIENT)
    served = rpc_span(traced, "gpu-worker", "WorkerService/Generate", SpanKind.SERVER,
                      call.context.trace_id)
    not_found = grpc.StatusCode.NOT_FOUND.value[0]
    for span in (call, served):
        assert span.attributes.get("rpc.grpc.status_code") == not_found, \
            f"{span.kind.name} {span.name}: the span does not carry NOT_FOUND"
    assert call.status.status_code == StatusCode.ERROR, "the client span does not record the error"
    # OTel's gRPC conventions mark a server span ERROR only for server faults (INTERNAL,
    # UNAVAILABLE, ...); a caller's mistake such as NOT_FOUND stays UNSET there.
    assert served.status.status_code == StatusCode.UNSET, "a caller's mistake marked as a server fault"


def test_an_admission_refused_by_the_governor_is_recorded_on_both_services_spans(stack) -> None:
    traced, client = stack
    traced.clear()
    with pytest.raises(grpc.RpcError) as caught:
        client.load_model("huge", "decoder", "large", 0)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, \
        f"a model bigger than the device budget gave {caught.value.code().name}"
    call = rpc_span(traced, "client", "WorkerService/LoadModel", SpanKind.CLIENT)
    trace_id = call.context.trace_id
    served = rpc_span(traced, "gpu-worker", "WorkerService/LoadModel", SpanKind.SERVER, trace_id)
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert served.attributes.get("rpc.grpc.status_code") == exhausted, \
        "the worker's span does not carry RESOURCE_EXHAUSTED"
    assert call.status.status_code == StatusCode.ERROR, "the client span does not record the error"
    refused = [(name, s) for name, s in trace_spans(traced, trace_id)
               if s.attributes.get("rpc.grpc.status_code") == exhausted and "GovernorService" in s.name]
    kinds = {(name, s.kind) for name, s in refused}
    assert ("governor", SpanKind.SERVER) in kinds, "the governor's refusal is not in the client's trace"
    outgoing = [s for name, s in refused if name == "gpu-worker" and s.kind == SpanKind.CLIENT]
    assert outgoing and outgoing[0].status.status_code == StatusCode.ERROR, \
        "the worker's call to the governor does not record the refusal as an error"


def test_health_checks_are_not_traced(stack, security: Security) -> None:
    traced, client = stack
    traced.clear()
    tls = security.client
    with (grpc.secure_channel(client.target, tls.credentials()) if tls
          else grpc.insecure_channel(client.target)) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    client.list_models()
    rpc_span(traced, "gpu-worker", "WorkerService/ListModels", SpanKind.SERVER)
    noisy = [span.name for _, span in traced.spans() if "grpc.health" in span.name]
    assert not noisy, f"health checks were traced: {noisy}"
