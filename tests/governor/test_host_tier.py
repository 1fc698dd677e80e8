"""Issue 26, "every byte on both tiers is booked": the governor's view shows each worker's host
tier, the pinned host memory of its weights' host copies and of its host KV, beside its device
zones; over real gRPC on loopback. An old worker that sends neither books 0; a figure beyond
the request bound is INVALID_ARGUMENT and changes nothing.
"""
from __future__ import annotations

import grpc
import pytest
from gpuplane.governor.v1 import governor_pb2 as pb
from prometheus_client import CollectorRegistry

from services.governor.metrics import LedgerCollector
from services.governor.policy import MAX_DEVICE_BYTES
from services.governor.report import resource_lines
from tests.governor.test_kv_cached import (  # noqa: F401 - the fixture
    MIB,
    governor,
    register,
    resources,
    wait_for,
    worker_of,
)
from tests.sim_fixtures import kernel_cache_dir  # noqa: F401 - the worker runtime test's


def host_beat(stub, worker_id: str, weights: int, kv: int) -> None:
    stub.Heartbeat(pb.HeartbeatRequest(worker_id=worker_id, host_weights_bytes=weights,
                                       host_kv_bytes=kv), timeout=5)


def test_the_host_tier_shows_per_worker_in_the_view_the_metrics_and_the_report(
        governor):  # noqa: F811 - the fixture imported above
    _, ledger, stub = governor
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger))
    register(stub, "new")
    register(stub, "old")
    host_beat(stub, "new", 600 * MIB, 40 * MIB)
    stub.Heartbeat(pb.HeartbeatRequest(worker_id="old"), timeout=5)   # sends neither field
    device = resources(stub)
    new, old = worker_of(device, "new"), worker_of(device, "old")
    assert (new.host_weights_bytes, new.host_kv_bytes) == (600 * MIB, 40 * MIB)
    assert (old.host_weights_bytes, old.host_kv_bytes) == (0, 0)
    value = registry.get_sample_value
    labels = {"device": "GPU-kv", "worker": "new"}
    assert value("gpuplane_governor_worker_host_weights_bytes", labels) == 600 * MIB
    assert value("gpuplane_governor_worker_host_kv_bytes", labels) == 40 * MIB
    line = next(ln for ln in resource_lines(stub.GetResources(pb.GetResourcesRequest(), timeout=5))
                if "worker new" in ln)
    assert "host tier (pinned): weights 600.0 MiB, kv 40.0 MiB" in line, line
    host_beat(stub, "new", 600 * MIB, 0)      # the swapped sequence came back in
    assert worker_of(resources(stub), "new").host_kv_bytes == 0


@pytest.mark.parametrize("field", ["host_weights_bytes", "host_kv_bytes"])
def test_a_host_figure_beyond_the_bound_is_invalid_and_changes_nothing(
        governor, field):  # noqa: F811 - the fixture imported above
    _, _, stub = governor
    register(stub, "w")
    host_beat(stub, "w", 10 * MIB, 20 * MIB)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Heartbeat(pb.HeartbeatRequest(worker_id="w", **{field: MAX_DEVICE_BYTES + 1}),
                       timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
    w = worker_of(resources(stub), "w")
    assert (w.host_weights_bytes, w.host_kv_bytes) == (10 * MIB, 20 * MIB)


def test_a_worker_runtime_reports_its_weights_host_copies_and_host_kv(
        governor, kernel_cache_dir):  # noqa: F811 - the fixture imported above
    """The sim worker end to end: after a load the governor shows the weights' pinned host
    copies the weight store holds, and the host KV budget's bytes in use (what a swap-out books)
    as they change."""
    from gpu_worker import WorkerConfig, WorkerRuntime

    server, ledger, _ = governor
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir, worker_id="sim",
                                    governor=server.address)).start()
    try:
        rt.load_model("a", "decoder", "tiny", 1)
        host_weights = rt.device.weights.stats()["host_bytes"]
        assert host_weights > 0, "a loaded model keeps its weights' host copies"

        def sim_worker():
            return next(w for d in ledger.resources() for w in d.workers if w.worker_id == "sim")
        # the decoder's slab pins free slots ahead for its demotions (booked host KV)
        swap = rt._get("a").scheduler.kv_swap
        assert swap.slab.wait_free(swap.slab.keep, timeout_s=10)
        ahead = rt.kv_host.budget.in_use
        assert ahead == swap.spare_bytes == swap.host_bytes > 0
        rt.device.report()
        assert wait_for(lambda: (sim_worker().host_weights_bytes, sim_worker().host_kv_bytes)
                        == (host_weights, ahead)), sim_worker()
        assert rt.kv_host.budget.take(8 * MIB)      # a swap-out's booking, as KVSwap makes it
        rt.device.report()
        assert wait_for(lambda: sim_worker().host_kv_bytes == ahead + 8 * MIB), sim_worker()
        rt.kv_host.budget.give(8 * MIB)
    finally:
        rt.close()
