"""GovernorService over real gRPC on loopback: status codes, rich details, watch, CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from gpuplane.governor.v1 import governor_pb2 as pb
from gpuplane.governor.v1 import governor_pb2_grpc
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.governor.policy import Policy
from services.governor.server import start_governor

MIB = 1 << 20
DEVICE = pb.Device(uuid="GPU-srv", total_bytes=2000 * MIB, free_bytes=1000 * MIB,
                   granule_bytes=2 * MIB, name="test")


@pytest.fixture
def governor(tmp_path):
    server, ledger = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite",
                                    Policy(budget_fraction=1.0), tracer_provider=TracerProvider())
    channel = grpc.insecure_channel(server.address)
    stub = governor_pb2_grpc.GovernorServiceStub(channel)
    yield server, ledger, stub
    channel.close()
    server.stop(grace=0)


def register(stub, worker_id: str) -> pb.RegisterWorkerResponse:
    return stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=worker_id, device=DEVICE),
                               timeout=5)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_bad_input_gets_the_promised_status_codes_and_changes_nothing(governor):
    _, _, stub = governor
    register(stub, "w1")
    register(stub, "w2")
    lease = stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV, bytes=MIB),
                         timeout=5).lease
    before = stub.GetResources(pb.GetResourcesRequest(), timeout=5)
    cases = {
        "zero bytes": (lambda: stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV),
                                            timeout=5), grpc.StatusCode.INVALID_ARGUMENT),
        "negative bytes": (lambda: stub.Acquire(pb.AcquireRequest(
            worker_id="w1", zone=pb.ZONE_KV, bytes=-1), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT),
        "unspecified zone": (lambda: stub.Acquire(pb.AcquireRequest(worker_id="w1", bytes=1),
                                                  timeout=5), grpc.StatusCode.INVALID_ARGUMENT),
        "foreign zone": (lambda: stub.Acquire(pb.AcquireRequest(
            worker_id="w1", zone=pb.ZONE_FOREIGN, bytes=1), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT),
        "unknown worker": (lambda: stub.Acquire(pb.AcquireRequest(
            worker_id="ghost", zone=pb.ZONE_KV, bytes=1), timeout=5), grpc.StatusCode.NOT_FOUND),
        "unknown lease": (lambda: stub.Release(pb.ReleaseRequest(worker_id="w1", lease_id="l-x"),
                                               timeout=5), grpc.StatusCode.NOT_FOUND),
        "another worker's lease": (lambda: stub.Release(pb.ReleaseRequest(
            worker_id="w2", lease_id=lease.lease_id), timeout=5),
            grpc.StatusCode.PERMISSION_DENIED),
        "wrong device": (lambda: stub.Acquire(pb.AcquireRequest(
            worker_id="w1", device_uuid="GPU-else", zone=pb.ZONE_KV, bytes=1), timeout=5),
            grpc.StatusCode.FAILED_PRECONDITION),
        "unknown device report": (lambda: stub.GetResources(pb.GetResourcesRequest(
            device_uuid="GPU-else"), timeout=5), grpc.StatusCode.NOT_FOUND),
        "inconsistent device": (lambda: stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id="w3", device=pb.Device(uuid="x", total_bytes=1, free_bytes=2)), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT),
        "unspecified zone in a report": (lambda: stub.Heartbeat(pb.HeartbeatRequest(
            worker_id="w1", zones=[pb.ZoneUsage(committed_bytes=1)]), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT),
    }
    for name, (call, expected) in cases.items():
        assert code_of(call) == expected, f"{name} must be {expected.name}"
    after = stub.GetResources(pb.GetResourcesRequest(), timeout=5)
    assert after.devices[0].leased_bytes == before.devices[0].leased_bytes
    assert [w.leased_bytes for w in after.devices[0].workers] == \
        [w.leased_bytes for w in before.devices[0].workers], "refused calls must change nothing"


def test_a_refused_acquire_carries_quota_failure_and_error_info_details(governor):
    _, _, stub = governor
    register(stub, "w1")
    stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_WEIGHTS, bytes=900 * MIB),
                 timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV, bytes=200 * MIB),
                     timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(info.value)
    infos, quotas = [], []
    for detail in status.details:
        message = error_details_pb2.ErrorInfo()
        if detail.Unpack(message):
            infos.append(message)
        quota = error_details_pb2.QuotaFailure()
        if detail.Unpack(quota):
            quotas.append(quota)
    assert infos and infos[0].metadata["asked_bytes"] == str(200 * MIB)
    assert infos[0].metadata["free_bytes"] == str(100 * MIB), "the refusal must say what is free"
    subjects = [v.subject for q in quotas for v in q.violations]
    assert "device:GPU-srv" in subjects
    assert "reclaimable:worker/w1/zone/weights" in subjects, "evictable zones must be hinted"


def test_resize_and_release_return_memory_to_the_pool(governor):
    _, _, stub = governor
    register(stub, "w1")
    lease = stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV, bytes=600 * MIB),
                         timeout=5).lease
    assert stub.Resize(pb.ResizeRequest(worker_id="w1", lease_id=lease.lease_id,
                                        bytes=200 * MIB), timeout=5).lease.bytes == 200 * MIB
    released = stub.Release(pb.ReleaseRequest(worker_id="w1", lease_id=lease.lease_id),
                            timeout=5).released_bytes
    assert released == 200 * MIB
    device = stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices[0]
    assert device.leased_bytes == 0 and device.free_budget_bytes == 1000 * MIB


def test_watch_resources_streams_a_snapshot_after_each_change(governor):
    _, _, stub = governor
    register(stub, "w1")
    stream = stub.WatchResources(pb.WatchResourcesRequest(), timeout=10)
    first = next(stream)
    assert first.devices[0].leased_bytes == 0
    seen = threading.Event()

    def acquire():
        stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV, bytes=64 * MIB),
                     timeout=5)
        seen.set()

    threading.Thread(target=acquire).start()
    for update in stream:
        if update.devices[0].leased_bytes == 64 * MIB:
            break
    else:
        pytest.fail("the watch must deliver the change")
    stream.cancel()
    assert seen.wait(5)


def test_resources_cli_prints_the_same_ledger_as_json(governor):
    server, _, stub = governor
    register(stub, "w1")
    stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_GRAPHS, bytes=10 * MIB),
                 timeout=5)
    out = subprocess.run([sys.executable, "-m", "services.governor", "resources", "--target",
                          server.address, "--json"], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    devices = json.loads(out.stdout)["devices"]
    assert devices[0]["uuid"] == "GPU-srv" and int(devices[0]["leased_bytes"]) == 10 * MIB


def test_acquire_spans_carry_the_worker_and_zone(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server, _ = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite", tracer_provider=provider)
    channel = grpc.insecure_channel(server.address)
    try:
        stub = governor_pb2_grpc.GovernorServiceStub(channel)
        register(stub, "w1")
        stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV, bytes=MIB), timeout=5)
        spans = [s for s in exporter.get_finished_spans() if s.name.endswith("/Acquire")]
        assert spans, "Acquire must be traced"
        assert spans[0].attributes["gpuplane.zone"] == "kv"
        assert spans[0].attributes["gpuplane.worker_id"] == "w1"
    finally:
        channel.close()
        server.stop(grace=0)


def test_the_serving_process_freezes_its_startup_heap_out_of_full_collections():
    import gc

    from services.governor.__main__ import freeze_startup_heap

    survivor = [object() for _ in range(1000)]  # stands for the modules and the loaded ledger
    assert id(survivor) in {id(o) for o in gc.get_objects()}, "negative control: tracked before"
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(survivor), "startup objects must be frozen"
        tracked = {id(o) for o in gc.get_objects()}
        assert id(survivor) not in tracked, \
            "a full collection must not walk objects that were alive when serving began"
    finally:
        gc.unfreeze()
