"""The governor client hands a cached-only reclaim ask (Reclaim.cached_only) to the owner's
`on_reclaim_cached` (the worker's reclaimer stops there after the cached KV step), and a plain ask
to `on_reclaim`; without `on_reclaim_cached` a cached-only ask still reaches `on_reclaim`."""
from __future__ import annotations

import grpc
import pytest
from gpuplane.governor.v1 import governor_pb2 as pb

from services.governor.client import DeviceDescription, GovernorClient
from tests.governor.test_kv_cached import DEVICE, MIB, governor, register, wait_for  # noqa: F401


def test_a_cached_only_ask_goes_to_on_reclaim_cached_cut_to_what_is_cached(governor):  # noqa: F811
    server, ledger, stub = governor
    cached = {"bytes": 96 * MIB}
    plain: list[tuple[str, int]] = []
    cached_asks: list[tuple[str, int]] = []
    client = GovernorClient(server.address, "cw", DeviceDescription(
        DEVICE.uuid, DEVICE.name, DEVICE.total_bytes, DEVICE.free_bytes, DEVICE.granule_bytes),
        chunk_bytes=64 * MIB, heartbeat_s=0.05, kv_cached=lambda: cached["bytes"],
        on_reclaim=lambda zone, nbytes: plain.append((zone, nbytes)))
    client.on_reclaim_cached = lambda zone, nbytes: cached_asks.append((zone, nbytes))
    try:
        client.reserve("kv", 128 * MIB)
        client.report({"kv": (128 * MIB, 128 * MIB)}, 0, 0)
        assert wait_for(lambda: ledger.resources()[0].kv_cached_bytes == 96 * MIB)
        register(stub, "asker")
        cached["bytes"] = 8 * MIB         # most of the cache reused since the last report
        with pytest.raises(grpc.RpcError):  # 872 MiB free of 1000; 96 cached would cure it
            stub.Acquire(pb.AcquireRequest(worker_id="asker", zone=pb.ZONE_ACTIVATIONS,
                                           bytes=900 * MIB), timeout=5)
        assert wait_for(lambda: cached_asks), "the cached-only ask must reach on_reclaim_cached"
        assert cached_asks == [("kv", 8 * MIB)], cached_asks
        assert plain == [], f"a cached-only ask went to on_reclaim: {plain}"
    finally:
        client.close()
