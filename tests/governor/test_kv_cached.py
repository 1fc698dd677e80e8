"""Issue 26, the governor's view of zone kv: in use vs cached, over real gRPC on loopback.

A worker's heartbeat says how much of its kv zone is cached (ZoneUsage.cached_bytes: prefix
blocks no sequence uses, given back at once); an old worker that does not say books 0 cached.
The view, the metrics and the report show kv in use and cached per worker and per device; a
refusal counts cached KV as reclaimable and asks the other workers for it first.
"""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from gpuplane.governor.v1 import governor_pb2 as pb
from gpuplane.governor.v1 import governor_pb2_grpc
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from services.governor.client import DeviceDescription, GovernorClient, exhausted_from
from services.governor.metrics import LedgerCollector
from services.governor.policy import Policy
from services.governor.report import resource_lines
from services.governor.server import start_governor
from tests.sim_fixtures import kernel_cache_dir  # noqa: F401 - the worker runtime test's

MIB = 1 << 20
DEVICE = pb.Device(uuid="GPU-kv", total_bytes=2000 * MIB, free_bytes=1000 * MIB,
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


def register(stub, worker_id: str) -> None:
    stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=worker_id, device=DEVICE), timeout=5)


def kv_lease(stub, worker_id: str, nbytes: int) -> None:
    stub.Acquire(pb.AcquireRequest(worker_id=worker_id, zone=pb.ZONE_KV, bytes=nbytes), timeout=5)


def beat(stub, worker_id: str, kv_committed: int, kv_cached: int | None = None,
         extra: tuple[pb.ZoneUsage, ...] = ()) -> pb.HeartbeatResponse:
    """A heartbeat reporting zone kv; `kv_cached=None`: an old worker's ZoneUsage, no field set."""
    kv = pb.ZoneUsage(zone=pb.ZONE_KV, committed_bytes=kv_committed, content_bytes=kv_committed)
    if kv_cached is not None:
        kv.cached_bytes = kv_cached
    return stub.Heartbeat(pb.HeartbeatRequest(worker_id=worker_id, zones=[kv, *extra]),
                          timeout=5)


def resources(stub) -> pb.DeviceResources:
    return stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices[0]


def kv_of(zones) -> pb.ZoneUsage:
    return next(z for z in zones if z.zone == pb.ZONE_KV)


def worker_of(device: pb.DeviceResources, worker_id: str) -> pb.WorkerResources:
    return next(w for w in device.workers if w.worker_id == worker_id)


def test_an_old_report_without_the_field_books_zero_cached(governor):
    _, ledger, stub = governor
    register(stub, "old")
    kv_lease(stub, "old", 128 * MIB)
    request = pb.HeartbeatRequest(worker_id="old", zones=[pb.ZoneUsage(
        zone=pb.ZONE_KV, committed_bytes=100 * MIB, content_bytes=100 * MIB)])
    assert "cached_bytes" not in {f.name for f, _ in request.zones[0].ListFields()}, \
        "negative control: the old worker's message carries no cached_bytes at all"
    stub.Heartbeat(request, timeout=5)
    device = resources(stub)
    assert kv_of(device.zones).cached_bytes == 0, "an old worker's kv must book 0 cached"
    assert kv_of(worker_of(device, "old").zones).cached_bytes == 0
    report = ledger.resources()[0]
    assert report.kv_in_use_bytes == 100 * MIB and report.kv_cached_bytes == 0, \
        "all of an old worker's kv is in use"


def test_cached_bytes_show_in_the_view_per_worker_and_device_and_in_the_metrics(governor):
    _, ledger, stub = governor
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger))
    for worker_id in ("w1", "w2"):
        register(stub, worker_id)
        kv_lease(stub, worker_id, 256 * MIB)
    beat(stub, "w1", 200 * MIB, 150 * MIB)
    beat(stub, "w2", 100 * MIB, None)  # an old worker beside a new one
    device = resources(stub)
    assert kv_of(worker_of(device, "w1").zones).cached_bytes == 150 * MIB
    assert kv_of(worker_of(device, "w2").zones).cached_bytes == 0
    assert kv_of(device.zones).committed_bytes == 300 * MIB
    assert kv_of(device.zones).cached_bytes == 150 * MIB, "the device sums its workers' cached"
    value = registry.get_sample_value
    assert value("gpuplane_governor_kv_cached_bytes", {"device": "GPU-kv"}) == 150 * MIB
    assert value("gpuplane_governor_kv_in_use_bytes", {"device": "GPU-kv"}) == 150 * MIB
    assert value("gpuplane_governor_worker_kv_cached_bytes",
                 {"device": "GPU-kv", "worker": "w1"}) == 150 * MIB
    assert value("gpuplane_governor_worker_kv_in_use_bytes",
                 {"device": "GPU-kv", "worker": "w1"}) == 50 * MIB
    assert value("gpuplane_governor_worker_kv_in_use_bytes",
                 {"device": "GPU-kv", "worker": "w2"}) == 100 * MIB
    assert value("gpuplane_governor_zone_cached_bytes", {"device": "GPU-kv", "zone": "kv"}) \
        == 150 * MIB
    beat(stub, "w1", 200 * MIB, 0)  # the cached blocks were reused: read at scrape time
    assert value("gpuplane_governor_kv_cached_bytes", {"device": "GPU-kv"}) == 0


def test_cached_beyond_the_kv_reported_is_invalid_and_changes_nothing(governor):
    _, _, stub = governor
    register(stub, "w1")
    kv_lease(stub, "w1", 256 * MIB)
    beat(stub, "w1", 200 * MIB, 50 * MIB)
    before = resources(stub)
    weights = pb.ZoneUsage(zone=pb.ZONE_WEIGHTS, committed_bytes=10 * MIB)
    cases = {
        "cached above committed": lambda: beat(stub, "w1", 100 * MIB, 100 * MIB + 1),
        "cached with no kv committed": lambda: beat(stub, "w1", 0, 1),
        "negative cached": lambda: beat(stub, "w1", 100 * MIB, -1),
        "cached in a zone other than kv": lambda: beat(stub, "w1", 100 * MIB, 0, (pb.ZoneUsage(
            zone=pb.ZONE_WEIGHTS, committed_bytes=10 * MIB, cached_bytes=MIB),)),
    }
    for name, call in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "cached_bytes" in info.value.details(), f"{name}: the error must name the field"
    with pytest.raises(grpc.RpcError) as info:
        beat(stub, "w1", 100 * MIB, 100 * MIB + 1)
    assert "exceeds the 104857600 committed bytes" in info.value.details()
    after = resources(stub)
    for d in (before, after):
        d.ClearField("workers")  # last_heartbeat_unix_ms aside, compare the zones below
    assert after == before, "a refused beat must change nothing"
    w = worker_of(resources(stub), "w1")
    assert kv_of(w.zones).committed_bytes == 200 * MIB and kv_of(w.zones).cached_bytes == 50 * MIB
    beat(stub, "w1", 100 * MIB, 100 * MIB, (weights,))  # negative control: all cached is fine
    assert kv_of(resources(stub).zones).cached_bytes == 100 * MIB


def _quota_subjects(err: grpc.RpcError) -> dict[str, str]:
    out = {}
    for detail in rpc_status.from_call(err).details:
        quota = error_details_pb2.QuotaFailure()
        if detail.Unpack(quota):
            out.update({v.subject: v.description for v in quota.violations})
    return out


def test_a_refusal_names_cached_kv_as_reclaimable_and_asks_for_it_first(governor):
    _, _, stub = governor
    for worker_id in ("holder", "old", "asker"):
        register(stub, worker_id)
    kv_lease(stub, "holder", 400 * MIB)
    kv_lease(stub, "old", 400 * MIB)
    beat(stub, "holder", 400 * MIB, 300 * MIB)
    beat(stub, "old", 400 * MIB, None)  # an old worker: its kv is all in use, no hint
    with pytest.raises(grpc.RpcError) as info:  # 200 MiB free of 1000
        stub.Acquire(pb.AcquireRequest(worker_id="asker", zone=pb.ZONE_ACTIVATIONS,
                                       bytes=300 * MIB), timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cached KV" in info.value.details(), info.value.details()
    subjects = _quota_subjects(info.value)
    hint = subjects["reclaimable:worker/holder/zone/kv"]
    assert hint == f"{300 * MIB} bytes could be given back, {300 * MIB} of them cached", hint
    assert "reclaimable:worker/old/zone/kv" not in subjects, \
        "negative control: kv in use is not reclaimable"
    refusal = exhausted_from(info.value)
    (parsed,) = [h for h in refusal.reclaimable if h.zone == "kv"]
    assert (parsed.worker_id, parsed.bytes, parsed.cached_bytes) == \
        ("holder", 300 * MIB, 300 * MIB), "the client must read the cached part back"
    # the holder's next beat asks for the cached KV the refusal lacked (100 MiB), cached only
    reply = beat(stub, "holder", 400 * MIB, 300 * MIB)
    assert [(r.zone, r.bytes, r.cached_only) for r in reply.reclaim] == \
        [(pb.ZONE_KV, 100 * MIB, True)]
    assert not beat(stub, "holder", 400 * MIB, 300 * MIB).reclaim, "asked once"
    assert not beat(stub, "old", 400 * MIB, None).reclaim, "a worker with nothing cached: no ask"


def test_a_refusal_reclaim_of_no_use_asks_for_no_cached_kv(governor):
    _, _, stub = governor
    register(stub, "holder")
    register(stub, "asker")
    kv_lease(stub, "holder", 400 * MIB)
    beat(stub, "holder", 400 * MIB, 100 * MIB)
    with pytest.raises(grpc.RpcError):  # 600 free + 100 cached < 900: cannot be cured
        stub.Acquire(pb.AcquireRequest(worker_id="asker", zone=pb.ZONE_ACTIVATIONS,
                                       bytes=900 * MIB), timeout=5)
    assert not beat(stub, "holder", 400 * MIB, 100 * MIB).reclaim, \
        "an incurable refusal must not cost a peer its cache"


def test_cached_kv_is_asked_back_before_borrowed_budget(tmp_path):
    """Lending: a zone inside its share is refused because kv borrowed it; the kv borrower's
    cached KV is asked for first, and only the rest as a plain kv ask."""
    server, ledger = start_governor(
        "127.0.0.1:0", tmp_path / "gov.sqlite",
        Policy(budget_fraction=1.0, zone_budgets={"weights": 500 * MIB, "kv": 200 * MIB}),
        tracer_provider=TracerProvider())
    channel = grpc.insecure_channel(server.address)
    stub = governor_pb2_grpc.GovernorServiceStub(channel)
    try:
        register(stub, "kvw")
        register(stub, "wts")
        kv_lease(stub, "kvw", 700 * MIB)   # 500 MiB of it borrowed from the weights share
        beat(stub, "kvw", 700 * MIB, 100 * MIB)
        with pytest.raises(grpc.RpcError) as info:  # 300 free, 400 asked inside the share
            stub.Acquire(pb.AcquireRequest(worker_id="wts", zone=pb.ZONE_WEIGHTS,
                                           bytes=400 * MIB), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = beat(stub, "kvw", 700 * MIB, 100 * MIB)
        assert [(r.zone, r.bytes, r.cached_only) for r in reply.reclaim] == \
            [(pb.ZONE_KV, 100 * MIB, True)], \
            "the 100 MiB lacking are all cached: a cached-only ask, no borrowed budget asked"
        assert not ledger.resources()[0].zones[0].cached_bytes  # weights: never cached
        with pytest.raises(grpc.RpcError):  # 500 inside the share: 200 lacking, 100 cached
            stub.Acquire(pb.AcquireRequest(worker_id="wts", zone=pb.ZONE_WEIGHTS,
                                           bytes=500 * MIB), timeout=5)
        reply = beat(stub, "kvw", 700 * MIB, 100 * MIB)
        assert [(r.zone, r.bytes, r.cached_only) for r in reply.reclaim] == \
            [(pb.ZONE_KV, 200 * MIB, False)], \
            "cached first (100), the rest borrowed (100): one plain kv ask of both"
    finally:
        channel.close()
        server.stop(grace=0)


def test_the_report_renders_kv_in_use_and_cached(governor):
    _, _, stub = governor
    register(stub, "w1")
    kv_lease(stub, "w1", 256 * MIB)
    beat(stub, "w1", 200 * MIB, 150 * MIB)
    reply = stub.GetResources(pb.GetResourcesRequest(), timeout=5)
    lines = resource_lines(reply)
    device_kv = [line for line in lines if line.startswith("  zone kv")]
    assert device_kv and device_kv[0].endswith("(in use 50.0 MiB, cached 150.0 MiB)"), lines
    worker_kv = [line for line in lines if line.startswith("    kv")]
    assert worker_kv and "(in use 50.0 MiB, cached 150.0 MiB)" in worker_kv[0], lines
    others = [line for line in lines if "zone weights" in line or line.startswith("    weights")]
    assert not any("cached" in line for line in others), "only zone kv is split"


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_the_governor_client_sends_cached_kv_clamped_and_answers_a_cached_ask_with_cache_only(
        governor):
    server, ledger, stub = governor
    cached = {"bytes": 96 * MIB}
    asks: list[tuple[str, int]] = []
    client = GovernorClient(server.address, "cw", DeviceDescription(
        DEVICE.uuid, DEVICE.name, DEVICE.total_bytes, DEVICE.free_bytes, DEVICE.granule_bytes),
        chunk_bytes=64 * MIB, heartbeat_s=0.05, kv_cached=lambda: cached["bytes"],
        on_reclaim=lambda zone, nbytes: asks.append((zone, nbytes)))
    try:
        client.reserve("kv", 128 * MIB)
        client.report({"kv": (128 * MIB, 128 * MIB)}, 0, 0)

        def seen() -> int:
            return ledger.resources()[0].kv_cached_bytes
        assert wait_for(lambda: seen() == 96 * MIB), seen()
        cached["bytes"] = 1 << 40  # more than the kv reported: clamped, never a refused beat
        client.report({"kv": (128 * MIB, 128 * MIB)}, 0, 0)
        assert wait_for(lambda: seen() == 128 * MIB), seen()
        assert client.counters["heartbeat_failures"] == 0
        cached["bytes"] = 96 * MIB
        client.report({"kv": (128 * MIB, 128 * MIB)}, 0, 0)
        assert wait_for(lambda: seen() == 96 * MIB), seen()
        register(stub, "asker")
        # most of the cache reused by new sequences since the last report (96 MiB cached)
        cached["bytes"] = 8 * MIB
        with pytest.raises(grpc.RpcError):  # 872 MiB free of 1000; 96 cached would cure it
            stub.Acquire(pb.AcquireRequest(worker_id="asker", zone=pb.ZONE_ACTIVATIONS,
                                           bytes=900 * MIB), timeout=5)
        assert wait_for(lambda: asks), "the cached-only ask must reach on_reclaim"
        assert asks == [("kv", 8 * MIB)], \
            f"a cached-only ask (28 MiB) is cut to what is cached when it arrives: {asks}"
    finally:
        client.close()


CFG_PROMPT_TOKENS = 900


def test_a_worker_runtime_reports_its_cached_prefix_blocks_to_the_governor(
        governor, kernel_cache_dir):  # noqa: F811 - the fixture imported above
    """The sim worker end to end: 16 finished streams leave their prefix blocks cached; the
    governor's view shows that much of the worker's kv as cached, the rest in use."""
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.models.configs import CONFIGS

    server, ledger, _ = governor
    cfg = CONFIGS["tiny"]
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir, worker_id="sim",
                                    governor=server.address, kv_block_tokens=128)).start()
    try:
        rt.load_model("a", "decoder", "tiny", 1)
        before = [w for d in ledger.resources() for w in d.workers if w.worker_id == "sim"]
        assert before and before[0].kv_cached_bytes == 0, "nothing cached before any stream"
        prompts = [[random.Random(i).randrange(cfg.vocab_size) for _ in range(CFG_PROMPT_TOKENS)]
                   for i in range(16)]
        threads = [threading.Thread(target=lambda p=p: list(rt.generate("a", p, 2)))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        pool = rt._get("a").scheduler.pool
        assert pool.cached_releasable_bytes() > 0, \
            "the finished streams must leave whole granules cached"
        rt.device.report()

        def sim_worker():
            return next(w for d in ledger.resources() for w in d.workers if w.worker_id == "sim")
        assert wait_for(lambda: sim_worker().kv_cached_bytes == pool.cached_releasable_bytes()
                        > 0), (sim_worker().kv_cached_bytes, pool.cached_releasable_bytes())
        kv = next(z for z in sim_worker().zones if z.zone == "kv")
        assert 0 < kv.cached_bytes <= kv.committed_bytes == pool.committed
    finally:
        rt.close()
