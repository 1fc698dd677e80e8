"""GovernorService: validate and convert messages, call the Ledger, convert back. Nothing else.

Served on a grpc.aio loop (services.common.aio_server): the handlers are coroutines that call the
Ledger inline, because a Ledger call is tens of microseconds (its lock is never held across a
wait) and a thread hop would cost more than the call. Only WatchResources, which waits for
changes, waits in a thread.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent import futures

from gpuplane.governor.v1 import governor_pb2, governor_pb2_grpc
from opentelemetry import trace

from services.common.errors import InvalidArgument
from services.common.server import ServiceRegistration
from services.governor.ledger import DeviceReport, DeviceSpec, Lease, Ledger, ZoneReport
from services.governor.policy import ZONES

SERVICE_NAME = governor_pb2.DESCRIPTOR.services_by_name["GovernorService"].full_name
# A watcher gets at most one snapshot per interval however busy the ledger is, and one per
# keepalive even when nothing changes, so a dead client is noticed.
WATCH_MIN_INTERVAL_S = 0.1
WATCH_KEEPALIVE_S = 5.0


def zone_name(value: int) -> str:
    """Proto enum -> zone string; ZONE_UNSPECIFIED and unknown values are a bad request."""
    if not 1 <= value <= len(ZONES):
        raise InvalidArgument(f"zone is unspecified or unknown (enum value {value}); "
                              f"use one of ZONE_{', ZONE_'.join(z.upper() for z in ZONES)}")
    return ZONES[value - 1]


def _tag(**attributes: str | int) -> None:
    """Domain attributes on the server span the tracing interceptor opened for this call."""
    span = trace.get_current_span()
    if not span.is_recording():  # no exporter: no span, so no attribute names to format
        return
    for key, value in attributes.items():
        span.set_attribute(f"gpuplane.{key}", value)


def zone_value(name: str) -> int:
    return ZONES.index(name) + 1


def lease_pb(lease: Lease) -> governor_pb2.Lease:
    return governor_pb2.Lease(
        lease_id=lease.lease_id, worker_id=lease.worker_id, device_uuid=lease.device_uuid,
        zone=zone_value(lease.zone), bytes=lease.bytes,
        expires_at_unix_ms=int(lease.expires_at * 1000))


def _zone_pb(z: ZoneReport) -> governor_pb2.ZoneUsage:
    return governor_pb2.ZoneUsage(
        zone=zone_value(z.zone), committed_bytes=z.committed_bytes, content_bytes=z.content_bytes,
        leased_bytes=z.leased_bytes, budget_bytes=z.budget_bytes, borrowed_bytes=z.borrowed_bytes)


def _caps_pb(caps: dict[str, int]) -> list[governor_pb2.ZoneCap]:
    return [governor_pb2.ZoneCap(zone=zone_value(z), bytes=b) for z, b in sorted(caps.items())]


def device_pb(d: DeviceReport) -> governor_pb2.DeviceResources:
    return governor_pb2.DeviceResources(
        uuid=d.uuid, name=d.name, total_bytes=d.total_bytes, budget_bytes=d.budget_bytes,
        granule_bytes=d.granule_bytes, transient_headroom_bytes=d.transient_headroom_bytes,
        leased_bytes=d.leased_bytes, device_used_bytes=d.device_used_bytes,
        ledger_bytes=d.ledger_bytes, unaccounted_bytes=d.unaccounted_bytes,
        free_budget_bytes=d.free_budget_bytes, unaccounted_alert=d.unaccounted_alert,
        zones=[_zone_pb(z) for z in d.zones],
        workers=[governor_pb2.WorkerResources(
            worker_id=w.worker_id, host=w.host, leased_bytes=w.leased_bytes,
            committed_bytes=w.committed_bytes, content_bytes=w.content_bytes,
            process_used_bytes=w.process_used_bytes,
            last_heartbeat_unix_ms=int(w.last_heartbeat * 1000),
            zones=[_zone_pb(z) for z in w.zones], leases=[lease_pb(lease) for lease in w.leases])
            for w in d.workers])


class GovernorServicer(governor_pb2_grpc.GovernorServiceServicer):
    def __init__(self, ledger: Ledger, traced: bool = True) -> None:
        self.ledger = ledger
        # False when the server records no spans: then the domain attributes are not even
        # looked up (a context lookup and a kwargs dict per call, for a span nobody keeps).
        self._traced = traced
        # Watchers block in Ledger.wait_for_change (up to the keepalive) off the event loop; their
        # own pool, so they never queue behind the loop's default executor.
        self._waits = futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="watch")

    def close(self) -> None:
        self._waits.shutdown(wait=False, cancel_futures=True)

    async def RegisterWorker(self, request, context):
        d = request.device
        reg = self.ledger.register(
            request.worker_id,
            DeviceSpec(d.uuid, d.total_bytes, d.free_bytes, d.granule_bytes, d.name),
            request.host)
        return governor_pb2.RegisterWorkerResponse(
            lease_ttl_ms=int(reg.lease_ttl_s * 1000), device_budget_bytes=reg.device_budget_bytes,
            leases=[lease_pb(lease) for lease in reg.leases], zone_caps=_caps_pb(reg.zone_caps))

    async def DeregisterWorker(self, request, context):
        return governor_pb2.DeregisterWorkerResponse(
            released_bytes=self.ledger.deregister(request.worker_id))

    async def Acquire(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id, zone=ZONES[request.zone - 1] if 0 < request.zone
                 <= len(ZONES) else "unspecified", bytes=request.bytes)
        lease = self.ledger.acquire(request.worker_id, request.device_uuid,
                                    zone_name(request.zone), request.bytes)
        return governor_pb2.AcquireResponse(lease=lease_pb(lease))

    async def Resize(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id, lease_id=request.lease_id, bytes=request.bytes)
        lease = self.ledger.resize(request.worker_id, request.lease_id, request.bytes)
        return governor_pb2.ResizeResponse(lease=lease_pb(lease))

    async def Release(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id, lease_id=request.lease_id)
        return governor_pb2.ReleaseResponse(
            released_bytes=self.ledger.release(request.worker_id, request.lease_id))

    async def Heartbeat(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id)
        zones = {zone_name(z.zone): (z.committed_bytes, z.content_bytes) for z in request.zones}
        result = self.ledger.heartbeat(request.worker_id, request.device_uuid,
                                       request.device_used_bytes, request.process_used_bytes, zones)
        return governor_pb2.HeartbeatResponse(
            lease_ttl_ms=int(result.lease_ttl_s * 1000), reregister=result.reregister,
            reclaim=[governor_pb2.Reclaim(zone=zone_value(z), bytes=b)
                     for z, b in sorted(result.reclaim.items())],
            zone_caps=_caps_pb(result.zone_caps))

    async def GetResources(self, request, context):
        return governor_pb2.GetResourcesResponse(
            devices=[device_pb(d) for d in self.ledger.resources(request.device_uuid)])

    async def WatchResources(self, request, context) -> AsyncIterator[governor_pb2.GetResourcesResponse]:
        # A cancelled or finished call cancels this generator at its next await.
        loop = asyncio.get_running_loop()
        version = -1
        while True:
            version = await loop.run_in_executor(self._waits, self.ledger.wait_for_change, version,
                                                 WATCH_KEEPALIVE_S)
            yield await self.GetResources(request, context)
            # Coalesce bursts: changes during the pause are covered by the next snapshot.
            await asyncio.sleep(WATCH_MIN_INTERVAL_S)


def registration(ledger: Ledger, traced: bool = True) -> ServiceRegistration:
    """`traced`: whether the server records spans (`telemetry.is_recording` of its provider)."""
    return ServiceRegistration(SERVICE_NAME, GovernorServicer(ledger, traced),
                               governor_pb2_grpc.add_GovernorServiceServicer_to_server)
