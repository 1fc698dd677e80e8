"""One live incarnation holds a worker id: in the ledger, over gRPC, in the client, on a worker's
health. A process that reuses a live worker's id can neither take its leases nor overwrite its
reports, and is told so (ALREADY_EXISTS naming the holder's host) until the id frees."""
from __future__ import annotations

import grpc
import pytest
from gpuplane.governor.v1 import governor_pb2 as pb
from gpuplane.governor.v1 import governor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import AlreadyExists, FailedPrecondition, ResourceExhausted
from services.governor.client import DeviceDescription, GovernorClient
from services.governor.ledger import DeviceSpec, Ledger
from services.governor.policy import Policy
from services.governor.server import start_governor
from services.governor.store import Store
from tests.polling import eventually

MIB = 1 << 20
GPU = DeviceSpec("GPU-inc", total_bytes=2000 * MIB, free_bytes=1000 * MIB, granule_bytes=2 * MIB)
OTHER = DeviceSpec("GPU-other", total_bytes=2000 * MIB, free_bytes=1000 * MIB)
TTL = 10.0


@pytest.fixture
def ledger(tmp_path, clock) -> Ledger:
    return Ledger(Store(tmp_path / "gov.sqlite"), Policy(budget_fraction=1.0, lease_ttl_s=TTL),
                  clock=clock)


def books(ledger: Ledger) -> tuple:
    """What an impostor must leave untouched: leases, their owners, the reports."""
    return tuple((d.uuid, d.leased_bytes, d.device_used_bytes,
                  tuple((w.worker_id, w.host, w.leased_bytes, w.committed_bytes)
                        for w in d.workers),
                  tuple(sorted(r.lease_id for r in ledger.store.leases())))
                 for d in ledger.resources())


def test_a_second_registration_of_a_live_worker_id_is_refused_naming_the_holder_and_changes_nothing(
        ledger, clock):
    holder = ledger.register("w1", GPU, host="node-a")
    ledger.acquire("w1", "", "kv", 192 * MIB, holder.incarnation)
    ledger.heartbeat("w1", "", 700 * MIB, 0, {"kv": (192 * MIB, 190 * MIB)}, holder.incarnation)
    before = books(ledger)
    for device in (GPU, OTHER):  # the same device, and another one
        clock.now += 1
        with pytest.raises(AlreadyExists, match="node-a") as info:
            ledger.register("w1", device, host="node-b")
        assert info.value.details["holder_host"] == "node-a"
        with pytest.raises(AlreadyExists):
            ledger.register("w1", device, host="node-b", incarnation="made-up")
    assert books(ledger) == before, "a refused registration took over the holder's leases"
    stale = ledger.heartbeat("w1", "", 5 * MIB, 0, {}, incarnation="made-up")
    assert stale.reregister, "a beat of another incarnation must be told to register"
    assert books(ledger) == before, "another incarnation's beat overwrote the holder's reports"
    again = ledger.register("w1", GPU, host="node-a", incarnation=holder.incarnation)
    assert again.incarnation == holder.incarnation, "the holder proves itself and keeps its id"
    assert [lease.bytes for lease in again.leases] == [192 * MIB]


def test_a_clean_deregistration_frees_the_id_at_once(ledger):
    first = ledger.register("w1", GPU, host="node-a")
    with pytest.raises(FailedPrecondition):
        ledger.deregister("w1", incarnation="made-up")
    assert ledger.leases_of("w1") == [], "negative control: w1 still registered"
    ledger.deregister("w1", first.incarnation)
    second = ledger.register("w1", OTHER, host="node-b")
    assert second.incarnation and second.incarnation != first.incarnation, \
        "a freed id must get a new incarnation"


def test_expiry_frees_the_id_and_the_stale_incarnation_then_changes_nothing(ledger, clock):
    old = ledger.register("w1", GPU, host="node-a")
    lease = ledger.acquire("w1", "", "kv", 64 * MIB, old.incarnation)
    clock.now += TTL + 1  # node-a is silent past the TTL: its leases and its id go
    new = ledger.register("w1", GPU, host="node-b")
    kept = ledger.acquire("w1", "", "kv", 32 * MIB, new.incarnation)
    ledger.heartbeat("w1", "", 600 * MIB, 0, {"kv": (32 * MIB, 32 * MIB)}, new.incarnation)
    before = books(ledger)
    assert ledger.heartbeat("w1", "", 0, 0, {"kv": (9 * MIB, 0)}, old.incarnation).reregister
    with pytest.raises(FailedPrecondition, match="node-b"):
        ledger.acquire("w1", "", "kv", MIB, old.incarnation)
    with pytest.raises(FailedPrecondition):
        ledger.release("w1", kept.lease_id, old.incarnation)
    with pytest.raises(FailedPrecondition):
        ledger.resize("w1", kept.lease_id, MIB, old.incarnation)
    with pytest.raises(AlreadyExists, match="node-b"):
        ledger.register("w1", GPU, host="node-a", incarnation=old.incarnation)
    assert books(ledger) == before, "the stale incarnation changed the new holder's books"
    assert lease.lease_id not in {r.lease_id for r in ledger.store.leases()}


def test_the_incarnation_survives_a_governor_restart_so_no_one_takes_the_id_meanwhile(
        tmp_path, clock):
    policy = Policy(budget_fraction=1.0, lease_ttl_s=TTL)
    first = Ledger(Store(tmp_path / "gov.sqlite"), policy, clock=clock).register("w1", GPU,
                                                                                 host="node-a")
    reopened = Ledger(Store(tmp_path / "gov.sqlite"), policy, clock=clock)
    with pytest.raises(AlreadyExists):
        reopened.register("w1", GPU, host="node-b")
    assert reopened.register("w1", GPU, incarnation=first.incarnation).incarnation == \
        first.incarnation


# ---- over gRPC, the client and a worker's health ------------------------------------------------

@pytest.fixture
def governor(tmp_path):
    server, ledger = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite",
                                    Policy(budget_fraction=1.0, lease_ttl_s=3.0),
                                    tracer_provider=TracerProvider())
    channel = grpc.insecure_channel(server.address)
    yield server, ledger, governor_pb2_grpc.GovernorServiceStub(channel)
    channel.close()
    server.stop(grace=0)


def _register(stub, host: str, uuid: str = "GPU-inc", incarnation: str = ""):
    return stub.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id="w1", host=host, incarnation=incarnation,
        device=pb.Device(uuid=uuid, total_bytes=2000 * MIB, free_bytes=1000 * MIB)), timeout=5)


def test_over_grpc_a_registration_of_a_live_id_is_already_exists_naming_the_holders_host(governor):
    _, _, stub = governor
    holder = _register(stub, "node-a")
    assert holder.incarnation, "a registration must return its incarnation"
    for uuid in ("GPU-inc", "GPU-other"):
        with pytest.raises(grpc.RpcError) as info:
            _register(stub, "node-b", uuid)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "node-a" in info.value.details(), "the refusal must name the holder's host"
    assert _register(stub, "node-a", incarnation=holder.incarnation).incarnation == \
        holder.incarnation


def test_a_client_refused_its_worker_id_is_not_serving_and_serves_once_the_holder_deregisters(
        governor):
    server, ledger, stub = governor
    holder = _register(stub, "node-a")
    heard: list[bool] = []
    client = GovernorClient(server.address, "w1",
                            DeviceDescription("GPU-inc", "test", 2000 * MIB, 1000 * MIB, 0),
                            chunk_bytes=8 * MIB, heartbeat_s=0.1,
                            tracer_provider=TracerProvider(), on_standing=heard.append)
    try:
        assert not client.serving(), "a refused client must not be serving"
        assert "node-a" in client.refusal
        eventually(lambda: heard == [False], what="on_standing to hear the refusal")
        with pytest.raises(ResourceExhausted, match="refuses this worker id"):
            client.reserve("kv", MIB)
        assert ledger.leases_of("w1") == [], "the refused client acquired under the holder's id"
        stub.DeregisterWorker(pb.DeregisterWorkerRequest(
            worker_id="w1", incarnation=holder.incarnation), timeout=5)
        eventually(client.serving, what="the client to register once the id is free")
        eventually(lambda: heard == [False, True], what="on_standing to hear it serves again")
        client.reserve("kv", MIB)
        assert sum(lease.bytes for lease in ledger.leases_of("w1")) == 8 * MIB
    finally:
        client.close()
    assert "w1" not in {w.worker_id for d in ledger.resources() for w in d.workers}, \
        "the client's close must deregister its own incarnation"


def test_a_refused_client_closing_does_not_deregister_the_holder(governor):
    server, ledger, stub = governor
    _register(stub, "node-a")
    client = GovernorClient(server.address, "w1",
                            DeviceDescription("GPU-inc", "test", 2000 * MIB, 1000 * MIB, 0),
                            heartbeat_s=0.1, tracer_provider=TracerProvider())
    assert not client.serving()
    client.close()
    assert [w.host for d in ledger.resources() for w in d.workers] == ["node-a"], \
        "a refused client freed the holder's id on close"


def test_a_worker_refused_its_governor_registration_reports_not_serving_on_health(
        governor, tmp_path):
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker

    server, _, stub = governor
    holder = _register(stub, "node-a")
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path / "kernels",
                                         worker_id="w1", governor=server.address)).start()
    worker = serve_worker(runtime, "127.0.0.1:0", TracerProvider())
    channel = grpc.insecure_channel(worker.address)
    health = health_pb2_grpc.HealthStub(channel)

    def status() -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    try:
        eventually(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING,
                   what="the refused worker to report NOT_SERVING")
        stub.DeregisterWorker(pb.DeregisterWorkerRequest(
            worker_id="w1", incarnation=holder.incarnation), timeout=5)
        eventually(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=30,
                   what="the worker to serve once its id is free")
    finally:
        channel.close()
        worker.stop(grace=0)
