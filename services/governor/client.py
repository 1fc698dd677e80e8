"""The worker's side of the budget: `BudgetOwner`, with `LocalBudget` and `GovernorClient`.

Hazard: a worker that calls the governor per allocation stalls its allocator on the network, and a
worker that stops when the governor is down turns a control-plane blip into an outage. Contract:
- `reserve` is served from leases already held whenever they cover it; only growth beyond them
  costs an Acquire, of a whole chunk (64 MiB by default), or of the exact remainder when the
  chunk does not fit but the remainder does; in a zone with a cap, never more than the cap less
  what is held, and growth beyond the cap is refused here without an RPC;
- `release` never blocks on the network: whole unused chunks go back from a background thread, and
  only when more than two chunks sit idle, down to one (hysteresis, so a reserve/release cycle at a
  chunk boundary does not become an Acquire/Release cycle);
- while the governor is unreachable, reserves inside held leases keep succeeding, growth is refused
  with ResourceExhausted, heartbeats retry with exponential backoff, and on reconnection the client
  re-registers, adopts leases it did not know it had (a lost Acquire reply) and re-acquires the ones
  the governor lost;
- every RPC has a deadline;
- the device's hard zone caps (a zone budget with lending off) come with the registration and
  every heartbeat reply; `on_caps` hears of a change from the heartbeat thread, never while the
  client's lock is held (a request thread waiting in `reserve` may hold the weight slots' lock,
  which the owner of the caps takes to apply them);
- the registration's incarnation travels on every later call; while the governor refuses the
  worker id (ALREADY_EXISTS: another live process holds it) the client is not `serving()`, says
  why in `refusal`, retries registration with backoff, and `on_standing` hears False (and True
  once a registration succeeds), from the heartbeat thread like `on_caps`;
- every report carries zone kv's cached bytes (`kv_cached`, sampled with the zones, outside the
  client's lock, clamped to the kv bytes reported so a beat is never refused for it); a
  cached-only ask from the governor is cut to what is cached when it arrives, so answering it
  never preempts a live sequence.
Cost: one RPC per chunk of growth plus one heartbeat per `heartbeat_s`.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.rpc import error_details_pb2
from gpuplane.governor.v1 import governor_pb2, governor_pb2_grpc
from grpc_status import rpc_status

from services.common.channels import open_channel
from services.common.errors import InvalidArgument, QuotaViolation, ReclaimHint, ResourceExhausted
from services.common.tls import ChannelTLS
from services.common.zones import zone_name, zone_value
from services.governor.policy import LEASABLE_ZONES, check_zone
from services.governor.servicer import SERVICE_NAME

log = logging.getLogger(__name__)

CALL_DEADLINE_S = 2.0
MAX_BACKOFF_S = 10.0
_UNBACKED = "unbacked-"  # local id of bytes in use whose lease the governor no longer knows


@dataclass(frozen=True)
class DeviceDescription:
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int
    granule_bytes: int


class BudgetOwner(Protocol):
    def reserve(self, zone: str, nbytes: int) -> None: ...
    def adopt(self, zone: str, nbytes: int) -> None: ...
    def release(self, zone: str, nbytes: int) -> None: ...
    def report(self, zones: dict[str, tuple[int, int]], device_used_bytes: int,
               process_used_bytes: int) -> None: ...
    def connected(self) -> bool: ...
    def close(self) -> None: ...


def _check(zone: str, nbytes: int) -> None:
    check_zone(zone)
    if nbytes < 0:
        raise InvalidArgument(f"bytes cannot be negative, got {nbytes}")


class LocalBudget:
    """Admission against a fixed budget in this process, for a worker with no governor."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise InvalidArgument(f"budget must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._used: dict[str, int] = {}
        self.last_report: tuple[dict[str, tuple[int, int]], int, int] = ({}, 0, 0)

    def reserve(self, zone: str, nbytes: int) -> None:
        _check(zone, nbytes)
        with self._lock:
            free = self.budget_bytes - sum(self._used.values())
            if nbytes > free:
                raise ResourceExhausted(
                    f"local budget: asked {nbytes} bytes in zone {zone}, {free} free of "
                    f"{self.budget_bytes}", asked_bytes=nbytes, free_bytes=free, zone=zone,
                    violations=[QuotaViolation(f"local/zone:{zone}", "local budget exhausted")])
            self._used[zone] = self._used.get(zone, 0) + nbytes

    def adopt(self, zone: str, nbytes: int) -> None:
        """Book bytes the device has already spent (the context baseline): never refused."""
        _check(zone, nbytes)
        with self._lock:
            self._used[zone] = self._used.get(zone, 0) + nbytes

    def release(self, zone: str, nbytes: int) -> None:
        _check(zone, nbytes)
        with self._lock:
            if nbytes > self._used.get(zone, 0):
                raise InvalidArgument(f"release of {nbytes} bytes in zone {zone} exceeds the "
                                      f"{self._used.get(zone, 0)} reserved")
            self._used[zone] -= nbytes

    def report(self, zones: dict[str, tuple[int, int]], device_used_bytes: int,
               process_used_bytes: int) -> None:
        self.last_report = (dict(zones), device_used_bytes, process_used_bytes)

    def connected(self) -> bool:
        return True

    def used(self) -> dict[str, int]:
        with self._lock:
            return {z: b for z, b in self._used.items() if b}

    def close(self) -> None:
        pass


def exhausted_from(err: grpc.RpcError) -> ResourceExhausted:
    """Rebuild the domain error from a RESOURCE_EXHAUSTED status and its rich details."""
    status = rpc_status.from_call(err)
    asked = free = 0
    zone = ""
    violations, hints = [], []
    retry_after_s = None
    for detail in status.details if status else []:
        info, quota = error_details_pb2.ErrorInfo(), error_details_pb2.QuotaFailure()
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(retry):
            retry_after_s = min(3600.0, max(0.0, retry.retry_delay.ToNanoseconds() / 1e9))
        elif detail.Unpack(info):
            asked = int(info.metadata.get("asked_bytes", 0))
            free = int(info.metadata.get("free_bytes", 0))
            zone = info.metadata.get("zone", "")
        elif detail.Unpack(quota):
            for v in quota.violations:
                if v.subject.startswith("reclaimable:"):
                    _, worker, _, hint_zone = v.subject.split(":", 1)[1].split("/", 3)
                    cached = re.search(r"(\d+) of them cached", v.description)
                    hints.append(ReclaimHint(worker, hint_zone, int(v.description.split()[0]),
                                             int(cached.group(1)) if cached else 0))
                else:
                    violations.append(QuotaViolation(v.subject, v.description))
    extra = {} if retry_after_s is None else {"retry_after_s": retry_after_s}
    return ResourceExhausted(err.details() or "admission refused", asked_bytes=asked,
                             free_bytes=free, zone=zone, violations=violations, reclaimable=hints,
                             **extra)


class GovernorClient:
    """A BudgetOwner backed by the governor: chunked leases, sub-allocated locally."""

    def __init__(self, target: str, worker_id: str, device: DeviceDescription,
                 chunk_bytes: int = 64 << 20, heartbeat_s: float = 2.0, tracer_provider=None,
                 on_reclaim: Callable[[str, int], None] | None = None,
                 tls: ChannelTLS | None = None, token: str | None = None,
                 on_caps: Callable[[dict[str, int]], None] | None = None,
                 on_standing: Callable[[bool], None] | None = None,
                 kv_cached: Callable[[], int] | None = None) -> None:
        if chunk_bytes <= 0 or heartbeat_s <= 0:
            raise InvalidArgument("chunk_bytes and heartbeat_s must be positive")
        self.worker_id, self.device = worker_id, device
        self.chunk_bytes, self.heartbeat_s = chunk_bytes, heartbeat_s
        self.on_reclaim = on_reclaim
        # A cached-only ask (Reclaim.cached_only) goes here instead when set: the owner gives
        # back only cached content (zone kv: cached prefix blocks), never a live sequence's.
        self.on_reclaim_cached: Callable[[str, int], None] | None = None
        self.on_caps = on_caps
        # The bytes of zone kv this worker can give back at once without harming a live
        # sequence (cached prefix blocks); called from any thread, never under our lock.
        self.kv_cached = kv_cached
        # The worker's host tier, (weights' pinned host copies, host KV) bytes, sent with each
        # report's heartbeat; called from any thread, never under our lock.
        self.host_tier: Callable[[], tuple[int, int]] | None = None
        self.zone_caps: dict[str, int] = {}   # the governor's hard caps, zone -> bytes
        self._caps_lock = threading.Lock()    # serializes deliveries (never the client's lock)
        self._delivered: dict[str, int] | None = None  # the caps on_caps last heard
        self._channel = open_channel(target, SERVICE_NAME,
                                     ["RegisterWorker", "Heartbeat", "GetResources"],
                                     tracer_provider, tls=tls, metadata_token=token)
        self._stub = governor_pb2_grpc.GovernorServiceStub(self._channel)
        # One lock for the local books; held across a growth Acquire so two threads do not both
        # grow the same zone (the second one usually fits in the first one's chunk).
        self._lock = threading.RLock()
        self._held: dict[str, dict[str, int]] = {z: {} for z in LEASABLE_ZONES}  # zone->id->bytes
        self._used: dict[str, int] = dict.fromkeys(LEASABLE_ZONES, 0)
        self._report: tuple[dict[str, tuple[int, int]], int, int] = ({}, 0, 0)
        self._cached = 0  # zone kv's cached bytes, of the zones in _report
        self._host = (0, 0)  # host_tier() at the last report
        self._registered = False
        self._connected = False
        self.incarnation = ""  # the governor's proof of this registration, sent on every call
        self.refusal = ""      # why the governor refuses our worker id; "" while it does not
        self.on_standing = on_standing
        self._standing_delivered: bool | None = None  # what on_standing last heard
        self._retry_at = 0.0  # no growth RPC before this (monotonic) while the governor is down
        self._backoff = 0.0
        self.ttl_s = 30.0
        self.budget_bytes = 0
        self.counters = dict.fromkeys(
            ["acquires", "refusals", "gave_back", "heartbeats", "heartbeat_failures",
             "registrations", "adopted", "reacquired", "reclaim_asks", "cap_refusals"], 0)
        self._wake = threading.Event()
        self._closing = threading.Event()
        try:
            self._register()
        except grpc.RpcError as err:
            self._down(err)
        self._thread = threading.Thread(target=self._run, name=f"governor-{worker_id}",
                                        daemon=True)
        self._thread.start()

    # ---- BudgetOwner -------------------------------------------------------------------------

    def reserve(self, zone: str, nbytes: int) -> None:
        _check(zone, nbytes)
        with self._lock:
            need = nbytes - self._slack(zone)
            if need > 0:
                self._grow(zone, need)
            self._used[zone] += nbytes

    def adopt(self, zone: str, nbytes: int) -> None:
        """Book bytes the device has already spent (the CUDA context baseline): never refused.

        Refusing them would not give the memory back, only hide it from the ledger. If the
        governor does not answer (a worker that starts before its node's governor), or refuses,
        the bytes are held unbacked and the heartbeat loop acquires a lease for them as soon as
        it can, like a lease the governor lost.
        """
        _check(zone, nbytes)
        with self._lock:
            try:
                self.reserve(zone, nbytes)
                return
            except ResourceExhausted:
                log.warning("booking already-spent bytes unbacked until the governor admits them",
                            extra={"worker_id": self.worker_id, "zone": zone, "bytes": nbytes})
            self._held[zone][f"{_UNBACKED}adopted-{uuid.uuid4().hex[:12]}"] = nbytes
            self._used[zone] += nbytes

    def release(self, zone: str, nbytes: int) -> None:
        _check(zone, nbytes)
        with self._lock:
            if nbytes > self._used[zone]:
                raise InvalidArgument(f"release of {nbytes} bytes in zone {zone} exceeds the "
                                      f"{self._used[zone]} reserved")
            self._used[zone] -= nbytes
            if self._slack(zone) >= 2 * self.chunk_bytes:
                self._wake.set()

    def report(self, zones: dict[str, tuple[int, int]], device_used_bytes: int,
               process_used_bytes: int) -> None:
        cached = min(self._sample_kv_cached(), zones.get("kv", (0, 0))[0])
        host = self._sample_host_tier()
        with self._lock:
            self._report = (dict(zones), device_used_bytes, process_used_bytes)
            self._cached = cached
            self._host = host

    def _sample_host_tier(self) -> tuple[int, int]:
        """`host_tier()`, or the last figures when there is none or it fails."""
        source = self.host_tier
        if source is None:
            return (0, 0)
        try:
            weights, kv = source()
            return (max(0, int(weights)), max(0, int(kv)))
        except Exception:  # the host tier is information; a failed sample keeps the last one
            log.warning("host_tier failed; reporting the last figures", exc_info=True)
            return self._host

    def _sample_kv_cached(self) -> int:
        """`kv_cached()`, or 0 (all of kv in use) when there is none or it fails."""
        source = self.kv_cached
        if source is None:
            return 0
        try:
            return max(0, int(source()))
        except Exception:  # reporting less as cached is always safe
            log.warning("kv_cached failed; reporting 0 cached", exc_info=True)
            return 0

    def connected(self) -> bool:
        return self._connected

    def serving(self) -> bool:
        """False while the governor refuses this worker's id to us (another live process holds
        it): such a worker must not take work, whatever it still believes it holds."""
        return not self.refusal

    def deliver_standing(self) -> None:
        """Tell `on_standing` whether we may serve, if it has not heard it yet. Called by the
        heartbeat thread after every attempt, and by the owner once it has set `on_standing`."""
        with self._caps_lock:
            serving = self.serving()
            if self.on_standing is None or serving == self._standing_delivered:
                return
            self.on_standing(serving)
            self._standing_delivered = serving

    def deliver_caps(self) -> None:
        """Hand the current zone caps to `on_caps` if it has not heard them yet. Called by the
        heartbeat thread after every beat, and by the owner once it has set `on_caps`."""
        with self._caps_lock:
            with self._lock:
                caps = dict(self.zone_caps)
            if self.on_caps is None or caps == self._delivered:
                return
            log.info("governor zone caps", extra={"worker_id": self.worker_id, "caps": caps})
            self.on_caps(caps)
            self._delivered = caps

    def close(self) -> None:
        """Stop heartbeating and hand every lease back (deregister), best effort."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=CALL_DEADLINE_S + 1)
        try:
            if not self.refusal:  # a refused client holds nothing, and must not free the holder
                self._stub.DeregisterWorker(governor_pb2.DeregisterWorkerRequest(
                    worker_id=self.worker_id, incarnation=self.incarnation),
                    timeout=CALL_DEADLINE_S)
        except grpc.RpcError as err:
            log.info("deregister failed; the leases expire after the TTL",
                     extra={"worker_id": self.worker_id, "code": str(err.code())})
        self._channel.close()

    # ---- introspection -----------------------------------------------------------------------

    def leased(self) -> dict[str, int]:
        with self._lock:
            return {z: sum(h.values()) for z, h in self._held.items() if h}

    def used(self) -> dict[str, int]:
        with self._lock:
            return {z: b for z, b in self._used.items() if b}

    def lease_ids(self) -> set[str]:
        with self._lock:
            return {i for h in self._held.values() for i in h if not i.startswith(_UNBACKED)}

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "leased_bytes": sum(map(sum, (h.values() for h in
                                                                    self._held.values()))),
                    "used_bytes": sum(self._used.values()), "connected": int(self._connected),
                    "registered": int(self._registered)}

    # ---- internals ---------------------------------------------------------------------------

    def _slack(self, zone: str) -> int:
        return sum(self._held[zone].values()) - self._used[zone]

    def _grow(self, zone: str, need: int) -> None:
        if time.monotonic() < self._retry_at:
            self._refuse_unreachable(zone, need)
        chunk = -(-need // self.chunk_bytes) * self.chunk_bytes
        cap = self.zone_caps.get(zone)
        if cap is not None:  # never ask a capped zone for more than it can grant
            room = cap - sum(self._held[zone].values())
            if need > room:
                self._refuse_over_cap(zone, need, cap, room)
            if chunk > room:  # the exact need, not all the room: others may share the zone
                chunk = need
        sizes = [chunk, need] if chunk != need else [need]
        for attempt in range(2):
            try:
                if not self._registered:
                    self._register()
                for i, size in enumerate(sizes):
                    try:
                        lease = self._stub.Acquire(governor_pb2.AcquireRequest(
                            worker_id=self.worker_id, device_uuid=self.device.uuid,
                            zone=zone_value(zone), bytes=size, incarnation=self.incarnation),
                            timeout=CALL_DEADLINE_S).lease
                    except grpc.RpcError as err:
                        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
                        if i + 1 < len(sizes):
                            continue  # the whole chunk does not fit; the exact remainder may
                        self.counters["refusals"] += 1
                        raise exhausted_from(err) from None
                    self._held[zone][lease.lease_id] = lease.bytes
                    self.counters["acquires"] += 1
                    self._up()
                    return
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND and attempt == 0:
                    self._registered = False  # expired or forgotten: register and try again
                    continue
                self._down(err)
                self._refuse_unreachable(zone, need)

    def _refuse_over_cap(self, zone: str, need: int, cap: int, room: int) -> None:
        """Refused here, without an RPC: our own leases already leave the zone's cap no room."""
        self.counters["refusals"] += 1
        self.counters["cap_refusals"] += 1
        raise ResourceExhausted(
            f"zone {zone} cannot grow by {need} bytes: this worker holds {cap - room} of its "
            f"{cap}-byte cap (a zone budget with lending off)", asked_bytes=need,
            free_bytes=max(0, room), zone=zone,
            violations=[QuotaViolation(f"device:{self.device.uuid}/zone:{zone}",
                                       "the zone's cap is held by this worker")])

    def _refuse_unreachable(self, zone: str, need: int) -> None:
        if self.refusal:
            raise ResourceExhausted(
                f"zone {zone} cannot grow by {need} bytes: the governor refuses this worker id "
                f"({self.refusal})", asked_bytes=need, free_bytes=0, zone=zone,
                violations=[QuotaViolation(f"governor:{self.worker_id}",
                                           "worker id held by another live process")])
        raise ResourceExhausted(
            f"governor unreachable: zone {zone} cannot grow by {need} bytes beyond the leases "
            "held; retrying in the background", asked_bytes=need, free_bytes=0, zone=zone,
            violations=[QuotaViolation(f"governor:{self.worker_id}", "governor unreachable")])

    def _up(self) -> None:
        self._connected, self._backoff, self._retry_at = True, 0.0, 0.0

    def _down(self, err: grpc.RpcError) -> None:
        if err.code() == grpc.StatusCode.ALREADY_EXISTS:  # refused our worker id: not serving
            if not self.refusal:
                log.warning("the governor refuses this worker id: not serving until it frees",
                            extra={"worker_id": self.worker_id, "reason": err.details()})
            self.refusal = err.details() or "worker id held by another live process"
        elif self._connected:
            log.warning("governor unreachable; working inside held leases",
                        extra={"worker_id": self.worker_id, "code": str(err.code())})
        self._connected = False
        # An RPC that failed in flight may still have happened (an Acquire granted, a Release
        # done): re-register on reconnection, which reconciles the leases both sides know.
        self._registered = False
        # Never back off past a third of the TTL, or an outage would cost the leases too; a
        # refused id is asked for again every heartbeat (its holder may just have gone).
        cap = self.heartbeat_s if self.refusal else min(MAX_BACKOFF_S, self.ttl_s / 3)
        self._backoff = min(cap, max(0.2, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff

    def _register(self) -> None:
        d = self.device
        reply = self._stub.RegisterWorker(governor_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id, host=socket.gethostname(), incarnation=self.incarnation,
            device=governor_pb2.Device(uuid=d.uuid, name=d.name, total_bytes=d.total_bytes,
                                       free_bytes=d.free_bytes, granule_bytes=d.granule_bytes)),
            timeout=CALL_DEADLINE_S)
        if self.refusal:
            log.info("the governor accepts this worker id again",
                     extra={"worker_id": self.worker_id})
        self.incarnation, self.refusal = reply.incarnation, ""
        self.ttl_s = reply.lease_ttl_ms / 1000
        self.budget_bytes = reply.device_budget_bytes
        self._set_caps(reply.zone_caps)
        known = {lease.lease_id: (zone_name(lease.zone), lease.bytes) for lease in reply.leases}
        with self._lock:
            mine = {i: z for z, h in self._held.items() for i in h}
            for lease_id, (zone, nbytes) in known.items():
                if lease_id not in mine:  # granted, but the reply never reached us
                    self._held[zone][lease_id] = nbytes
                    self.counters["adopted"] += 1
            for lease_id, zone in mine.items():
                if lease_id not in known and not lease_id.startswith(_UNBACKED):
                    nbytes = self._held[zone].pop(lease_id)
                    self._held[zone][f"{_UNBACKED}{lease_id}"] = nbytes
            self._registered = True
            self.counters["registrations"] += 1
            self._up()
            self._reacquire_unbacked()

    def _set_caps(self, caps) -> None:
        """Record the caps of a reply; delivered later, outside the lock (`deliver_caps`)."""
        with self._lock:
            self.zone_caps = {zone_name(c.zone): c.bytes for c in caps}

    def _reacquire_unbacked(self) -> None:
        """Back with new leases the bytes whose leases the governor lost; retried each beat."""
        for zone, held in self._held.items():
            for local_id in [i for i in held if i.startswith(_UNBACKED)]:
                try:
                    lease = self._stub.Acquire(governor_pb2.AcquireRequest(
                        worker_id=self.worker_id, device_uuid=self.device.uuid,
                        zone=zone_value(zone), bytes=held[local_id],
                        incarnation=self.incarnation), timeout=CALL_DEADLINE_S).lease
                except grpc.RpcError as err:
                    log.warning("could not re-acquire a lost lease; still in use, retrying",
                                extra={"worker_id": self.worker_id, "zone": zone,
                                       "code": str(err.code())})
                    return
                del held[local_id]
                held[lease.lease_id] = lease.bytes
                self.counters["reacquired"] += 1

    def _run(self) -> None:
        while not self._closing.is_set():
            interval = min(self.heartbeat_s, self.ttl_s / 3)
            self._wake.wait(self._backoff or interval)
            self._wake.clear()
            if self._closing.is_set():
                return
            try:
                if not self._registered:
                    self._register()
                self._heartbeat()
                self.deliver_caps()
                self._give_back({})
            except grpc.RpcError as err:
                self.counters["heartbeat_failures"] += 1
                self._down(err)
            except Exception:
                log.exception("governor heartbeat failed", extra={"worker_id": self.worker_id})
            try:
                self.deliver_standing()
            except Exception:
                log.exception("on_standing failed", extra={"worker_id": self.worker_id})

    def _heartbeat(self) -> None:
        with self._lock:
            zones, device_used, process_used = self._report
            cached, (host_weights, host_kv) = self._cached, self._host
            if any(i.startswith(_UNBACKED) for h in self._held.values() for i in h):
                self._reacquire_unbacked()
        reply = self._stub.Heartbeat(governor_pb2.HeartbeatRequest(
            worker_id=self.worker_id, device_uuid=self.device.uuid,
            device_used_bytes=device_used, process_used_bytes=process_used,
            incarnation=self.incarnation,
            host_weights_bytes=host_weights, host_kv_bytes=host_kv,
            zones=[governor_pb2.ZoneUsage(zone=zone_value(z), committed_bytes=c, content_bytes=ct,
                                          cached_bytes=cached if z == "kv" else 0)
                   for z, (c, ct) in sorted(zones.items())]), timeout=CALL_DEADLINE_S)
        self.counters["heartbeats"] += 1
        self._up()
        self.ttl_s = reply.lease_ttl_ms / 1000 or self.ttl_s
        if reply.reregister:
            self._registered = False
            self._register()
        else:
            self._set_caps(reply.zone_caps)
        if reply.reclaim:
            asks = {zone_name(r.zone): r.bytes for r in reply.reclaim}
            cached_zones = ({zone_name(r.zone) for r in reply.reclaim if r.cached_only}
                            - {zone_name(r.zone) for r in reply.reclaim if not r.cached_only})
            if any(r.cached_only for r in reply.reclaim):
                now_cached = self._sample_kv_cached()  # may have been reused since the report
                for r in reply.reclaim:
                    if r.cached_only:
                        zone = zone_name(r.zone)
                        with self._lock:
                            idle = max(0, self._slack(zone)) if zone in self._held else 0
                        asks[zone] = min(asks[zone], idle + (now_cached if zone == "kv" else 0))
                asks = {z: b for z, b in asks.items() if b > 0}
            self.counters["reclaim_asks"] += 1
            if self.on_reclaim:  # the owner shrinks the zones first, so this beat gives it back
                for zone, nbytes in asks.items():
                    with self._lock:  # idle lease bytes go back first: shrink only the rest
                        short = nbytes - max(0, self._slack(zone))
                    if short <= 0:
                        continue
                    shrink = self.on_reclaim
                    if zone in cached_zones and self.on_reclaim_cached is not None:
                        shrink = self.on_reclaim_cached
                    try:
                        shrink(zone, short)
                    except Exception:  # give back what is idle all the same
                        log.exception("on_reclaim failed", extra={"zone": zone, "bytes": nbytes})
            self._give_back(asks)

    def _give_back(self, asks: dict[str, int]) -> None:
        """Return idle leases: beyond one chunk of slack, as much of `asks` as is idle, and
        what is idle above a zone's cap (one that shrank while we held more).

        Whole leases go first (smallest first); what remains is cut from one larger lease by
        Resize, in whole chunks unless the governor asked for exact bytes.
        """
        for zone in LEASABLE_ZONES:
            with self._lock:
                slack = self._slack(zone)
                excess = slack - self.chunk_bytes if slack >= 2 * self.chunk_bytes else 0
                unit = self.chunk_bytes
                if asks.get(zone):
                    excess, unit = max(excess, min(asks[zone], slack)), 1
                over_cap = sum(self._held[zone].values()) - self.zone_caps.get(zone, 1 << 62)
                if over_cap > 0 and slack > 0:  # the cap shrank: what is idle above it goes
                    excess, unit = max(excess, min(over_cap, slack)), 1
                plan: list[tuple[str, int, int]] = []  # lease id, bytes before, bytes after
                for lease_id, nbytes in sorted(self._held[zone].items(), key=lambda kv: kv[1]):
                    if nbytes <= excess:
                        plan.append((lease_id, nbytes, 0))
                        excess -= nbytes
                    elif excess >= unit and not lease_id.startswith(_UNBACKED):
                        cut = excess - excess % unit
                        plan.append((lease_id, nbytes, nbytes - cut))
                        excess -= cut
                # Unusable from now, even if the RPC fails: a reserve must not count on them.
                for lease_id, _, after in plan:
                    if after:
                        self._held[zone][lease_id] = after
                    else:
                        del self._held[zone][lease_id]
            for lease_id, before, after in plan:
                if lease_id.startswith(_UNBACKED):
                    continue
                try:
                    if after:
                        self._stub.Resize(governor_pb2.ResizeRequest(
                            worker_id=self.worker_id, lease_id=lease_id, bytes=after,
                            incarnation=self.incarnation), timeout=CALL_DEADLINE_S)
                    else:
                        self._stub.Release(governor_pb2.ReleaseRequest(
                            worker_id=self.worker_id, lease_id=lease_id,
                            incarnation=self.incarnation), timeout=CALL_DEADLINE_S)
                    self.counters["gave_back"] += 1
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:
                        with self._lock:
                            self._held[zone][lease_id] = before  # still ours: usable again
                        raise
