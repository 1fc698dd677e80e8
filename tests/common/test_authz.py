"""Per-RPC authorization: the rules in isolation, then on real servers over mutual TLS (governor,
worker, kernel cache) and over bearer tokens, with the audit lines each decision leaves."""
from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterator

import grpc
import pytest
from gpuplane.governor.v1 import governor_pb2 as gpb
from gpuplane.governor.v1 import governor_pb2_grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as cpb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc
from gpuplane.worker.v1 import worker_pb2 as wpb
from gpuplane.worker.v1 import worker_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from cache_service.access import ACCESS as CACHE_ACCESS
from cache_service.convert import artifact_to_pb
from gpu_worker.edge.access import ACCESS as WORKER_ACCESS
from services.common import errors
from services.common.authz import Policy, Rule
from services.common.identity import (
    Level,
    Principal,
    RoleMap,
    Tokens,
    parse_role,
)
from services.common.security import ServerSecurity
from services.common.tls import ChannelTLS, ServerTLS
from services.governor.access import ACCESS as GOVERNOR_ACCESS
from services.governor.policy import Policy as LedgerPolicy
from services.governor.server import start_governor
from tests.cache_service.cache_helpers import make_artifact
from tests.certs import CertificateAuthority

MIB = 1 << 20
DEVICE = gpb.Device(uuid="GPU-authz", total_bytes=2000 * MIB, free_bytes=1000 * MIB,
                    granule_bytes=2 * MIB, name="test")
ROLES = RoleMap.of([("worker", "spiffe://gpuplane/worker/*"), ("admin", "spiffe://gpuplane/admin/*"),
                    ("client", "spiffe://gpuplane/client/*")])
DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


# --- the rules alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("service, access", [
    (gpb.DESCRIPTOR.services_by_name["GovernorService"], GOVERNOR_ACCESS),
    (wpb.DESCRIPTOR.services_by_name["WorkerService"], WORKER_ACCESS),
    (cpb.DESCRIPTOR.services_by_name["KernelCacheService"], CACHE_ACCESS),
])
def test_every_rpc_of_every_service_has_exactly_one_rule(service, access):
    rpcs = {m.name for m in service.methods}
    assert set(access) == rpcs, (f"{service.name}: rules for {sorted(set(access) - rpcs)} that do "
                                 f"not exist, none for {sorted(rpcs - set(access))}")


def test_identities_speak_for_the_last_uri_segment_the_first_dns_label_and_the_token_name():
    who = Principal(("spiffe://gpuplane/worker/host-a", "host-b.workers.svc", "token:host-c"))
    assert who.subjects == {"host-a", "host-b", "host-c"}


def test_roles_are_ordered_and_a_caller_gets_its_highest():
    assert Principal(("x",), frozenset({"client", "admin"})).level == Level.ADMIN
    assert Principal(("x",)).level == Level.AUTHENTICATED, "an identity without a role"
    assert Principal().level == Level.PUBLIC, "an anonymous caller"


@pytest.mark.parametrize("text", ["worker", "root=spiffe://*", "admin=", "=x"])
def test_a_malformed_role_mapping_is_refused_with_the_expected_form(text):
    with pytest.raises(errors.InvalidArgument, match="ROLE=GLOB"):
        parse_role(text)


def test_a_wrong_or_malformed_bearer_token_is_refused_and_no_token_is_anonymous():
    tokens = Tokens({"ops": "s3cret"})
    assert tokens.identify([("authorization", "Bearer s3cret")]) == "token:ops"
    assert tokens.identify([]) is None
    with pytest.raises(errors.PermissionDenied):
        tokens.identify([("authorization", "Bearer nope")])
    with pytest.raises(errors.Unauthenticated):
        tokens.identify([("authorization", "Basic s3cret")])


def test_an_rpc_without_a_rule_is_denied_by_default_even_to_an_admin():
    with pytest.raises(errors.PermissionDenied, match="denied by default"):
        Policy.authorize("/x.S/New", None, Principal(("a",), frozenset({"admin"})), object())


def test_a_worker_acts_only_on_its_own_worker_id_and_an_admin_on_any():
    rule = Rule(Level.WORKER, owner_field="worker_id")
    request = gpb.ReleaseRequest(worker_id="host-b", lease_id="l-1")
    with pytest.raises(errors.PermissionDenied, match="own worker id"):
        Policy.authorize("/g/Release", rule, Principal(("spiffe://gpuplane/worker/host-a",),
                                                       frozenset({"worker"})), request)
    Policy.authorize("/g/Release", rule, Principal(("spiffe://gpuplane/worker/host-b",),
                                                   frozenset({"worker"})), request)
    Policy.authorize("/g/Release", rule, Principal(("spiffe://gpuplane/admin/ops",),
                                                   frozenset({"admin"})), request)


# --- real servers over mutual TLS ---------------------------------------------------------------


class Identities:
    """Client credentials for each identity a test plays, all signed by the servers' client CA."""

    def __init__(self, ca: CertificateAuthority) -> None:
        self.ca = ca
        self._channels: list[grpc.Channel] = []

    def channel(self, target: str, uri: str) -> grpc.Channel:
        leaf = self.ca.issue(uri.rsplit("/", 1)[-1] + "-" + uri.split("/")[3], uris=(uri,))
        tls = ChannelTLS(str(self.ca.ca_file), str(leaf.cert), str(leaf.key))
        ch = grpc.secure_channel(target, tls.credentials())
        self._channels.append(ch)
        return ch

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


@pytest.fixture
def identities(ca: CertificateAuthority) -> Iterator[Identities]:
    ids = Identities(ca)
    yield ids
    ids.close()


def server_security(ca: CertificateAuthority, name: str, policy: Policy) -> ServerSecurity:
    leaf = ca.issue(name)
    return ServerSecurity(ServerTLS(str(leaf.cert), str(leaf.key), str(ca.ca_file)), policy)


def code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def audit_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gpuplane.audit"]


@pytest.fixture
def governor(tmp_path: pathlib.Path, ca: CertificateAuthority) -> Iterator:
    server, ledger = start_governor(
        "127.0.0.1:0", tmp_path / "gov.sqlite", LedgerPolicy(budget_fraction=1.0),
        tracer_provider=TracerProvider(), security=server_security(ca, "gov", Policy(ROLES)))
    yield server, ledger
    server.stop(grace=0)


def governor_stub(identities: Identities, server, who: str):
    return governor_pb2_grpc.GovernorServiceStub(
        identities.channel(server.address, f"spiffe://gpuplane/{who}"))


def test_a_client_identity_cannot_acquire_and_the_refusal_changes_nothing_and_is_audited(
        governor, identities, caplog):
    server, ledger = governor
    caplog.set_level(logging.INFO, logger="gpuplane.audit")
    worker = governor_stub(identities, server, "worker/host-a")
    worker.RegisterWorker(gpb.RegisterWorkerRequest(worker_id="host-a", device=DEVICE), timeout=5)
    before = ledger.resources()
    caplog.clear()
    client = governor_stub(identities, server, "client/frontend")
    acquire = gpb.AcquireRequest(worker_id="host-a", zone=gpb.ZONE_KV, bytes=64 * MIB)
    assert code(lambda: client.Acquire(acquire, timeout=5)) == DENIED, \
        "a client identity acquired device memory"
    assert ledger.resources() == before, "a refused Acquire changed the ledger"
    (line,) = audit_lines(caplog)
    assert (line.audit, line.method, line.identity, line.code) == (
        "deny", "/gpuplane.governor.v1.GovernorService/Acquire",
        "spiffe://gpuplane/client/frontend", "PERMISSION_DENIED"), "the audit line is wrong"
    assert code(lambda: client.GetResources(gpb.GetResourcesRequest(), timeout=5)) == \
        grpc.StatusCode.OK, "reads are for any authenticated caller"


def test_worker_a_cannot_release_or_deregister_worker_b_and_the_admin_can(
        governor, identities, caplog):
    server, ledger = governor
    caplog.set_level(logging.INFO, logger="gpuplane.audit")
    a = governor_stub(identities, server, "worker/host-a")
    b = governor_stub(identities, server, "worker/host-b")
    admin = governor_stub(identities, server, "admin/ops")
    for stub, wid in ((a, "host-a"), (b, "host-b")):
        stub.RegisterWorker(gpb.RegisterWorkerRequest(worker_id=wid, device=DEVICE), timeout=5)
    lease = b.Acquire(gpb.AcquireRequest(worker_id="host-b", zone=gpb.ZONE_KV, bytes=64 * MIB),
                      timeout=5).lease
    assert code(lambda: a.Acquire(gpb.AcquireRequest(worker_id="host-b", zone=gpb.ZONE_KV,
                                                     bytes=MIB), timeout=5)) == DENIED
    assert code(lambda: a.Release(gpb.ReleaseRequest(worker_id="host-b", lease_id=lease.lease_id),
                                  timeout=5)) == DENIED, "worker A released B's lease"
    assert code(lambda: a.Release(gpb.ReleaseRequest(worker_id="host-a", lease_id=lease.lease_id),
                                  timeout=5)) == DENIED, "A released B's lease under its own id"
    assert code(lambda: a.DeregisterWorker(gpb.DeregisterWorkerRequest(worker_id="host-b"),
                                           timeout=5)) == DENIED, "worker A deregistered B"
    assert [x.lease_id for x in ledger.leases_of("host-b")] == [lease.lease_id], \
        "B's lease did not survive A's refused calls"
    assert [r.audit for r in audit_lines(caplog)] == ["deny"] * 4, "one line per refusal"
    caplog.clear()
    assert admin.Release(gpb.ReleaseRequest(worker_id="host-b", lease_id=lease.lease_id),
                         timeout=5).released_bytes == 64 * MIB, "the admin could not release"
    admin.DeregisterWorker(gpb.DeregisterWorkerRequest(worker_id="host-b"), timeout=5)
    workers = {w.worker_id for d in ledger.resources() for w in d.workers}
    assert workers == {"host-a"}, "the admin could not deregister B"
    assert [(r.audit, r.method.rsplit("/", 1)[1], r.identity) for r in audit_lines(caplog)] == [
        ("allow", "Release", "spiffe://gpuplane/admin/ops"),
        ("allow", "DeregisterWorker", "spiffe://gpuplane/admin/ops")], \
        "an admin acting on another worker's id must be audit-logged"


@pytest.fixture(scope="module")
def mtls_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker

    tmp = tmp_path_factory.mktemp("authz-worker")
    ca = CertificateAuthority(tmp / "pki")
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp / "kernels",
                                         worker_id="w")).start()
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider(),
                          security=server_security(ca, "worker", Policy(ROLES)))
    ids = Identities(ca)
    yield server, ids
    ids.close()
    server.stop(grace=5.0)


def test_a_client_cannot_load_a_model_the_admin_can_and_its_call_is_audited(mtls_worker, caplog):
    server, ids = mtls_worker
    caplog.set_level(logging.INFO, logger="gpuplane.audit")
    client = worker_pb2_grpc.WorkerServiceStub(ids.channel(server.address,
                                                           "spiffe://gpuplane/client/frontend"))
    admin = worker_pb2_grpc.WorkerServiceStub(ids.channel(server.address,
                                                          "spiffe://gpuplane/admin/ops"))
    load = wpb.LoadModelRequest(model_id="m", family="decoder", config="tiny")
    for what, call in {"LoadModel": lambda: client.LoadModel(load, timeout=60),
                       "Trim": lambda: client.Trim(wpb.TrimRequest(target_bytes=0), timeout=5),
                       "UnloadModel": lambda: client.UnloadModel(
                           wpb.UnloadModelRequest(model_id="m"), timeout=5)}.items():
        assert code(call) == DENIED, f"a client identity may call {what}"
    assert not client.ListModels(wpb.ListModelsRequest(), timeout=5).models, \
        "a refused LoadModel loaded a model"
    assert [r.audit for r in audit_lines(caplog)] == ["deny"] * 3, "one audit line per refusal"
    caplog.clear()
    admin.LoadModel(load, timeout=120)
    (line,) = audit_lines(caplog)
    assert (line.audit, line.identity) == ("allow", "spiffe://gpuplane/admin/ops"), \
        "an admin call was not audit-logged"
    tokens = [t for m in client.Generate(wpb.GenerateRequest(
        model_id="m", prompt_tokens=[1, 2], max_new_tokens=4), timeout=60) for t in m.tokens]
    assert len(tokens) == 4, "a client identity could not Generate"
    admin.UnloadModel(wpb.UnloadModelRequest(model_id="m"), timeout=30)


@pytest.fixture
def cache(tmp_path: pathlib.Path, ca: CertificateAuthority) -> Iterator:
    from cache_service.config import ServerConfig
    from cache_service.server import start_cache_server

    server = start_cache_server(
        ServerConfig(listen="127.0.0.1:0", db=tmp_path / "cache.sqlite",
                     security=server_security(ca, "cache", Policy(ROLES))),
        TracerProvider(), CollectorRegistry())
    yield server
    server.stop(grace=0.5)


def test_only_workers_store_only_admins_prune_and_any_identity_reads(cache, identities):
    def stub(who: str):
        return kernel_cache_pb2_grpc.KernelCacheServiceStub(
            identities.channel(cache.address, f"spiffe://gpuplane/{who}"))

    client, worker, admin = stub("client/frontend"), stub("worker/host-a"), stub("admin/ops")
    store = cpb.StoreRequest(key="k", artifact=artifact_to_pb(make_artifact(1024, 0)))
    assert code(lambda: client.Store(store, timeout=5)) == DENIED, "a client identity stored"
    assert not client.Lookup(cpb.LookupRequest(key="k"), timeout=5).found, "a refused Store stored"
    assert worker.Store(store, timeout=5).stored, "a worker identity could not store"
    assert code(lambda: worker.Prune(cpb.PruneRequest(), timeout=5)) == DENIED, "a worker pruned"
    assert client.Lookup(cpb.LookupRequest(key="k"), timeout=5).found, "reads are for anyone known"
    admin.Prune(cpb.PruneRequest(target_bytes=0), timeout=5)


# --- bearer tokens, for deployments without mutual TLS -----------------------------------------


def test_with_tokens_a_caller_without_one_is_unauthenticated_and_the_token_names_the_worker(
        tmp_path):
    policy = Policy(RoleMap.of([("worker", "token:host-*")]),
                    Tokens({"host-a": "secret-a", "host-b": "secret-b"}))
    server, ledger = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite",
                                    tracer_provider=TracerProvider(),
                                    security=ServerSecurity(policy=policy))
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = governor_pb2_grpc.GovernorServiceStub(ch)
            register = gpb.RegisterWorkerRequest(worker_id="host-a", device=DEVICE)
            assert code(lambda: stub.RegisterWorker(register, timeout=5)) == UNAUTH
            assert code(lambda: stub.GetResources(gpb.GetResourcesRequest(), timeout=5)) == UNAUTH
            as_b = (("authorization", "Bearer secret-b"),)
            assert code(lambda: stub.RegisterWorker(register, timeout=5, metadata=as_b)) == DENIED
            as_a = (("authorization", "Bearer secret-a"),)
            stub.RegisterWorker(register, timeout=5, metadata=as_a)
        assert [w.worker_id for d in ledger.resources() for w in d.workers] == ["host-a"]
    finally:
        server.stop(grace=0)


def test_the_worker_s_clients_name_it_by_token_to_a_governor_and_a_cache_without_mutual_tls(
        tmp_path):
    from cache_service.client import KernelCacheClient
    from cache_service.config import ServerConfig
    from cache_service.server import start_cache_server
    from services.governor.client import DeviceDescription, GovernorClient

    governor, ledger = start_governor(
        "127.0.0.1:0", tmp_path / "gov.sqlite", LedgerPolicy(budget_fraction=1.0),
        tracer_provider=TracerProvider(), security=ServerSecurity(policy=Policy(
            RoleMap.of([("worker", "token:host-*")]), Tokens({"host-a": "secret-a"}))))
    cache = start_cache_server(ServerConfig(
        listen="127.0.0.1:0", db=tmp_path / "cache.sqlite", write_token="w-secret",
        security=ServerSecurity(policy=Policy(RoleMap.of([("worker", "token:host-*")])))),
        TracerProvider(), CollectorRegistry())
    device = DeviceDescription("GPU-tok", "test", 2000 * MIB, 1000 * MIB, 2 * MIB)
    budget = GovernorClient(governor.address, "host-a", device, chunk_bytes=64 * MIB,
                            token="secret-a")
    writer = KernelCacheClient(cache.address, write_token="w-secret", deadline_s=5)
    anonymous = KernelCacheClient(cache.address, deadline_s=5)
    try:
        budget.reserve("kv", MIB)
        assert [w.worker_id for d in ledger.resources() for w in d.workers] == ["host-a"], \
            "the token did not name the worker to the governor"
        writer.store("k", make_artifact(1024, 1))
        assert writer.flush(10) and writer.lookup("k") is not None, \
            "the write token's holder could not store and read back"
        assert anonymous.lookup("k") is None and anonymous.stats()["errors"] == 1, \
            "with roles mapped, a read without a credential must be refused"
    finally:
        for c in (budget, writer, anonymous):
            c.close()
        cache.stop(grace=0.5)
        governor.stop(grace=0)
