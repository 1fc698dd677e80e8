"""GovernorService: validate and convert messages, call the Ledger, convert back. Nothing else.

Validation comes first and costs O(1) per field: every string and repeated field of a request has
a bound (policy.py, docs/governor.md "Bounds"), checked before the Ledger is called; a request
past one is INVALID_ARGUMENT naming it. Messages themselves are capped by the server at
MAX_REQUEST_BYTES (gRPC refuses a larger one before any handler runs). Reports saturate every
figure at the int64 range, so no value can make GetResources or WatchResources fail.

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
from services.common.zones import zone_name, zone_value
from services.governor.ledger import (
    DeviceReport,
    DeviceSpec,
    Lease,
    Ledger,
    ZoneReport,
    check_text,
)
from services.governor.policy import MAX_ID_CHARS, ZONES

SERVICE_NAME = governor_pb2.DESCRIPTOR.services_by_name["GovernorService"].full_name
# A watcher gets at most one snapshot per interval however busy the ledger is, and one per
# keepalive even when nothing changes, so a dead client is noticed.
WATCH_MIN_INTERVAL_S = 0.1
WATCH_KEEPALIVE_S = 5.0
# The largest request the governor's server accepts: its biggest, a Heartbeat with every zone,
# is a few hundred bytes.
MAX_REQUEST_BYTES = 64 << 10
_I64_MAX = (1 << 63) - 1


def _i64(value: int) -> int:
    """`value` saturated to int64: a report must serialize whatever the figures add up to."""
    return max(-_I64_MAX - 1, min(_I64_MAX, value))


def _ids(request, *names: str) -> None:
    """InvalidArgument naming the bound for any id field of `request` longer than MAX_ID_CHARS."""
    for name in names:
        check_text(name, getattr(request, name), MAX_ID_CHARS)


def _tag(**attributes: str | int) -> None:
    """Domain attributes on the server span the tracing interceptor opened for this call."""
    span = trace.get_current_span()
    if not span.is_recording():  # no exporter: no span, so no attribute names to format
        return
    for key, value in attributes.items():
        span.set_attribute(f"gpuplane.{key}", value)


def lease_pb(lease: Lease) -> governor_pb2.Lease:
    return governor_pb2.Lease(
        lease_id=lease.lease_id, worker_id=lease.worker_id, device_uuid=lease.device_uuid,
        zone=zone_value(lease.zone), bytes=_i64(lease.bytes),
        expires_at_unix_ms=_i64(int(lease.expires_at * 1000)))


def _zone_pb(z: ZoneReport) -> governor_pb2.ZoneUsage:
    return governor_pb2.ZoneUsage(
        zone=zone_value(z.zone), committed_bytes=_i64(z.committed_bytes),
        content_bytes=_i64(z.content_bytes), leased_bytes=_i64(z.leased_bytes),
        budget_bytes=_i64(z.budget_bytes), borrowed_bytes=_i64(z.borrowed_bytes),
        cached_bytes=_i64(z.cached_bytes))


def _caps_pb(caps: dict[str, int]) -> list[governor_pb2.ZoneCap]:
    return [governor_pb2.ZoneCap(zone=zone_value(z), bytes=b) for z, b in sorted(caps.items())]


def device_pb(d: DeviceReport) -> governor_pb2.DeviceResources:
    return governor_pb2.DeviceResources(
        uuid=d.uuid, name=d.name, total_bytes=_i64(d.total_bytes),
        budget_bytes=_i64(d.budget_bytes), granule_bytes=_i64(d.granule_bytes),
        transient_headroom_bytes=_i64(d.transient_headroom_bytes),
        leased_bytes=_i64(d.leased_bytes), device_used_bytes=_i64(d.device_used_bytes),
        ledger_bytes=_i64(d.ledger_bytes), unaccounted_bytes=_i64(d.unaccounted_bytes),
        free_budget_bytes=_i64(d.free_budget_bytes), unaccounted_alert=d.unaccounted_alert,
        zones=[_zone_pb(z) for z in d.zones],
        workers=[governor_pb2.WorkerResources(
            worker_id=w.worker_id, host=w.host, leased_bytes=_i64(w.leased_bytes),
            committed_bytes=_i64(w.committed_bytes), content_bytes=_i64(w.content_bytes),
            process_used_bytes=_i64(w.process_used_bytes),
            last_heartbeat_unix_ms=_i64(int(w.last_heartbeat * 1000)),
            zones=[_zone_pb(z) for z in w.zones], leases=[lease_pb(lease) for lease in w.leases],
            host_weights_bytes=_i64(w.host_weights_bytes), host_kv_bytes=_i64(w.host_kv_bytes))
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
            request.host, request.incarnation)
        return governor_pb2.RegisterWorkerResponse(
            lease_ttl_ms=int(reg.lease_ttl_s * 1000), device_budget_bytes=reg.device_budget_bytes,
            leases=[lease_pb(lease) for lease in reg.leases], zone_caps=_caps_pb(reg.zone_caps),
            incarnation=reg.incarnation)

    async def DeregisterWorker(self, request, context):
        _ids(request, "worker_id", "incarnation")
        return governor_pb2.DeregisterWorkerResponse(
            released_bytes=self.ledger.deregister(request.worker_id, request.incarnation))

    async def Acquire(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id, zone=ZONES[request.zone - 1] if 0 < request.zone
                 <= len(ZONES) else "unspecified", bytes=request.bytes)
        _ids(request, "worker_id", "device_uuid", "incarnation")
        lease = self.ledger.acquire(request.worker_id, request.device_uuid,
                                    zone_name(request.zone), request.bytes, request.incarnation)
        return governor_pb2.AcquireResponse(lease=lease_pb(lease))

    async def Resize(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id, lease_id=request.lease_id, bytes=request.bytes)
        _ids(request, "worker_id", "lease_id", "incarnation")
        lease = self.ledger.resize(request.worker_id, request.lease_id, request.bytes,
                                   request.incarnation)
        return governor_pb2.ResizeResponse(lease=lease_pb(lease))

    async def Release(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id, lease_id=request.lease_id)
        _ids(request, "worker_id", "lease_id", "incarnation")
        return governor_pb2.ReleaseResponse(released_bytes=self.ledger.release(
            request.worker_id, request.lease_id, request.incarnation))

    async def Heartbeat(self, request, context):
        if self._traced:
            _tag(worker_id=request.worker_id)
        _ids(request, "worker_id", "device_uuid", "incarnation")
        if len(request.zones) > len(ZONES):
            raise InvalidArgument(f"zones has {len(request.zones)} entries; the bound is "
                                  f"{len(ZONES)}, one per zone", field="zones", bound=len(ZONES))
        zones = {zone_name(z.zone): (z.committed_bytes, z.content_bytes) for z in request.zones}
        if len(zones) != len(request.zones):
            raise InvalidArgument("zones names a zone more than once; the bound is one entry "
                                  "per zone", field="zones", bound=len(ZONES))
        # An old worker sends no cached_bytes: 0, all of its kv in use.
        cached = {zone_name(z.zone): z.cached_bytes for z in request.zones if z.cached_bytes}
        result = self.ledger.heartbeat(request.worker_id, request.device_uuid,
                                       request.device_used_bytes, request.process_used_bytes, zones,
                                       request.incarnation, cached,
                                       host_weights_bytes=request.host_weights_bytes,
                                       host_kv_bytes=request.host_kv_bytes)
        return governor_pb2.HeartbeatResponse(
            lease_ttl_ms=int(result.lease_ttl_s * 1000), reregister=result.reregister,
            reclaim=[governor_pb2.Reclaim(zone=zone_value(z), bytes=b,
                                          cached_only=z in result.cached_only)
                     for z, b in sorted(result.reclaim.items())],
            zone_caps=_caps_pb(result.zone_caps))

    async def GetResources(self, request, context):
        _ids(request, "device_uuid")
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
