"""TLS on a real server over loopback: mutual TLS handshakes, rotation without a restart, the
plaintext health-only port. Certificates are made in the test (tests/certs.py)."""
from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator

import grpc
import pytest
from gpuplane.governor.v1 import governor_pb2 as pb
from gpuplane.governor.v1 import governor_pb2_grpc
from gpuplane.worker.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import InvalidArgument
from services.common.security import ServerSecurity
from services.common.tls import ChannelTLS, ServerTLS
from services.governor.server import start_governor
from tests.certs import CertificateAuthority

MIB = 1 << 20
DEVICE = pb.Device(uuid="GPU-tls", total_bytes=2000 * MIB, free_bytes=1000 * MIB,
                   granule_bytes=2 * MIB, name="test")
# A channel of its own connection: gRPC otherwise shares subchannels between channels, and a
# test about handshakes must make a new one.
FRESH = [("grpc.use_local_subchannel_pool", 1)]


def channel(target: str, tls: ChannelTLS | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=FRESH)
    return grpc.secure_channel(target, tls.credentials(), options=FRESH)


def client_tls(ca: CertificateAuthority, trust: CertificateAuthority, name: str,
               uri: str = "") -> ChannelTLS:
    leaf = ca.issue(name, uris=(uri,) if uri else ())
    return ChannelTLS(str(trust.ca_file), str(leaf.cert), str(leaf.key))


@pytest.fixture
def mtls_governor(tmp_path: pathlib.Path, ca: CertificateAuthority) -> Iterator:
    leaf = ca.issue("governor")
    security = ServerSecurity(ServerTLS(str(leaf.cert), str(leaf.key), str(ca.ca_file)),
                              health_listen="127.0.0.1:0")
    server, ledger = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite",
                                    tracer_provider=TracerProvider(), security=security)
    yield server, ledger
    server.stop(grace=0)


def register(target: str, tls: ChannelTLS | None, worker_id: str) -> grpc.StatusCode:
    with channel(target, tls) as ch:
        try:
            governor_pb2_grpc.GovernorServiceStub(ch).RegisterWorker(
                pb.RegisterWorkerRequest(worker_id=worker_id, device=DEVICE), timeout=5)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_mutual_tls_server_refuses_in_the_handshake_every_client_without_a_certificate_of_its_ca(
        mtls_governor, ca, other_ca):
    server, ledger = mtls_governor
    intruder = client_tls(other_ca, ca, "intruder")  # trusts the server, signed by another CA
    refused = {
        "plaintext": None,
        "TLS without a client certificate": ChannelTLS(str(ca.ca_file)),
        "a certificate of another CA": intruder,
    }
    for what, tls in refused.items():
        assert register(server.address, tls, f"w-{what}") == grpc.StatusCode.UNAVAILABLE, \
            f"{what}: the mutual-TLS server did not refuse the handshake"
    assert ledger.resources() == [], "a refused client changed the ledger"
    assert register(server.address, client_tls(ca, ca, "worker"), "w-ok") == grpc.StatusCode.OK, \
        "a client with a certificate of the server's client CA was refused"


def test_a_client_refuses_a_server_whose_certificate_another_ca_signed(mtls_governor, ca, other_ca):
    server, _ = mtls_governor
    leaf = ca.issue("worker")
    misled = ChannelTLS(str(other_ca.ca_file), str(leaf.cert), str(leaf.key))
    assert register(server.address, misled, "w") == grpc.StatusCode.UNAVAILABLE, \
        "the client accepted a server certificate its CA did not sign"


def test_the_health_port_answers_plaintext_probes_and_serves_nothing_else(mtls_governor):
    server, _ = mtls_governor
    target = f"127.0.0.1:{server.health_port}"
    assert server.health_port, "--health-listen did not open a port"
    with channel(target, None) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            governor_pb2_grpc.GovernorServiceStub(ch).GetResources(pb.GetResourcesRequest(),
                                                                   timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, \
        "the plaintext health port serves the governor's API"


def test_a_key_that_does_not_match_its_certificate_is_refused_at_startup(tmp_path, ca):
    a, b = ca.issue("a"), ca.issue("b")
    with pytest.raises(InvalidArgument, match="do not form a pair"):
        start_governor("127.0.0.1:0", tmp_path / "gov.sqlite", tracer_provider=TracerProvider(),
                       security=ServerSecurity(ServerTLS(str(a.cert), str(b.key))))


# --- rotation ------------------------------------------------------------------------------------


@pytest.fixture
def rotating_worker(tmp_path: pathlib.Path, ca: CertificateAuthority) -> Iterator:
    """A sim worker over mutual TLS whose certificate files live at fixed paths, as mounted."""
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker

    cert, key = tmp_path / "mount" / "tls.crt", tmp_path / "mount" / "tls.key"
    cert.parent.mkdir()
    ca.issue("worker", cert_path=cert, key_path=key)
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path / "kernels",
                                         worker_id="rotating")).start()
    security = ServerSecurity(ServerTLS(str(cert), str(key), str(ca.ca_file)))
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider(), security=security)
    yield server, cert, key
    server.stop(grace=5.0)


def list_models(target: str, tls: ChannelTLS) -> grpc.StatusCode:
    with channel(target, tls) as ch:
        try:
            worker_pb2_grpc.WorkerServiceStub(ch).ListModels(worker_pb2.ListModelsRequest(),
                                                             timeout=5)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_rotated_certificate_is_served_to_new_connections_while_a_running_generate_completes(
        rotating_worker, ca, tmp_path):
    server, cert, key = rotating_worker
    renewed = CertificateAuthority(tmp_path / "renewed", "renewed")  # a new issuer tells them apart
    old_trust = client_tls(ca, ca, "client")
    new_trust = client_tls(ca, renewed, "client2")
    with channel(server.address, old_trust) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        stub.LoadModel(worker_pb2.LoadModelRequest(model_id="m", family="decoder", config="tiny"),
                       timeout=120)
        stream = stub.Generate(worker_pb2.GenerateRequest(model_id="m", prompt_tokens=[1, 2, 3],
                                                          max_new_tokens=48), timeout=120)
        first = next(stream)
        # Renewal, as a Secret volume does it: both files replaced while the stream runs.
        renewed.issue("worker", cert_path=cert, key_path=key)
        assert list_models(server.address, new_trust) == grpc.StatusCode.OK, \
            "a new connection did not get the renewed certificate"
        assert list_models(server.address, old_trust) == grpc.StatusCode.UNAVAILABLE, \
            "a new connection still got the old certificate after the files changed"
        rest = list(stream)
        assert stream.code() == grpc.StatusCode.OK, "the in-flight Generate did not complete"
    tokens = [t for m in [first, *rest] for t in m.tokens]
    assert len(tokens) == 48, f"the in-flight Generate returned {len(tokens)} of 48 tokens"


def test_a_half_written_rotation_keeps_the_previous_certificate_until_the_pair_matches(
        rotating_worker, ca, tmp_path):
    server, cert, key = rotating_worker
    renewed = CertificateAuthority(tmp_path / "renewed", "renewed")
    old_trust, new_trust = client_tls(ca, ca, "client"), client_tls(ca, renewed, "client2")
    staged = renewed.issue("staged")
    shutil.copyfile(staged.cert, cert)  # the certificate is new, the key still the old one
    assert list_models(server.address, old_trust) == grpc.StatusCode.OK, \
        "a certificate without its key was served (or the old pair dropped)"
    shutil.copyfile(staged.key, key)
    assert list_models(server.address, new_trust) == grpc.StatusCode.OK, \
        "the completed pair was not picked up"


def test_a_client_presents_its_renewed_certificate_on_new_calls_while_its_open_stream_continues(
        tmp_path, ca):
    from services.common.authz import Policy
    from services.common.channels import open_channel
    from services.common.identity import RoleMap
    from tests.polling import eventually

    leaf = ca.issue("governor")
    security = ServerSecurity(ServerTLS(str(leaf.cert), str(leaf.key), str(ca.ca_file)),
                              Policy(RoleMap.of([("worker", "spiffe://gpuplane/worker/*")])))
    server, _ = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite",
                               tracer_provider=TracerProvider(), security=security)
    cert, key = tmp_path / "client" / "tls.crt", tmp_path / "client" / "tls.key"
    cert.parent.mkdir()
    ca.issue("old", uris=("spiffe://gpuplane/worker/old",), cert_path=cert, key_path=key)
    channel = open_channel(server.address, "gpuplane.governor.v1.GovernorService",
                           tls=ChannelTLS(str(ca.ca_file), str(cert), str(key)))
    stub = governor_pb2_grpc.GovernorServiceStub(channel)  # made once, as the worker does

    def register(worker_id: str) -> grpc.StatusCode:
        try:
            stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=worker_id, device=DEVICE),
                                timeout=5)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    try:
        assert register("old") == grpc.StatusCode.OK
        watch = stub.WatchResources(pb.WatchResourcesRequest(), timeout=60)
        next(watch)
        ca.issue("new", uris=("spiffe://gpuplane/worker/new",), cert_path=cert, key_path=key)
        eventually(lambda: register("new") == grpc.StatusCode.OK, timeout=10,
                   what="a call under the renewed client certificate")
        assert register("old") == grpc.StatusCode.PERMISSION_DENIED, \
            "new calls still presented the old certificate"
        seen = next(watch)  # the stream opened before the renewal is still served
        while "new" not in {w.worker_id for d in seen.devices for w in d.workers}:
            seen = next(watch)
        watch.cancel()
    finally:
        channel.close()
        server.stop(grace=0)
