"""The governor's domain core: devices, workers, leases, admission, lending, expiry, reconciliation.

Hazard: two workers that each believe they own the same bytes of a GPU OOM each other, and a ledger
that sees only some zones reports a healthy device while it fills. Contract:
- the sum of the leases of a device never exceeds its budget, and other zones never lease into the
  transient headroom; a refused or invalid call changes nothing (checks first, then the durable
  write, then memory);
- a lease exists until its worker releases it, deregisters, or stays silent for the TTL; it is
  committed to the store before the call returns, so a restart never grants it twice;
- `unaccounted = device_used - ledger`, the ledger being the committed bytes the workers report
  (context included); a sustained rise of the floor of that figure raises an alert. The device
  truth is forgotten when a worker of the device goes (its memory went with it), so a dead
  worker's last figure never shows as unaccounted memory;
- one live incarnation holds a worker id: a registration while the id's holder is live (heard
  from within the TTL) is refused ALREADY_EXISTS unless it carries the holder's incarnation (the
  token its registration returned), and a call carrying a stale incarnation changes nothing;
  deregistration or expiry frees the id;
- every figure a worker reports is bounded by its device's total, so one reporter that lies can
  skew its own device's figures but never make a report fail; a device no worker is registered
  on is forgotten after `Policy.device_ttl_s`;
- zone kv is reported in two parts: in use (live sequences) and cached (what the worker drops at
  once without harming one: cached prefix blocks), cached <= committed (InvalidArgument and
  nothing recorded otherwise), 0 from a worker that does not say. Cached KV counts as
  reclaimable in a refusal, and a refusal that giving back could cure asks the other workers of
  the device for their cached KV first (a cached-only ask on their next heartbeat), before any
  borrowed budget is reclaimed.
Cost: one lock, O(zones x workers of the device) per admission, one SQLite transaction per change.
Nothing here imports grpc; the servicer converts messages to these calls.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaViolation,
    ReclaimHint,
    ResourceExhausted,
)
from services.governor.policy import (
    CACHED_ZONES,
    EVICTABLE_ZONES,
    MAX_DEVICE_BYTES,
    MAX_ID_CHARS,
    MAX_TEXT_CHARS,
    ZONES,
    Policy,
    check_zone,
)
from services.governor.store import DeviceRow, LeaseRow, Store, WorkerRow

log = logging.getLogger(__name__)

MIB = 1 << 20
# The floor of the last few samples, so one heartbeat racing another worker's allocation (device
# truth ahead of that worker's report) does not raise the alert on its own.
_RECENT_SAMPLES = 3
_MAX_HINTS = 16
# Quotas on how much state callers can make the governor keep (each refused RESOURCE_EXHAUSTED
# with a QuotaFailure): they bound the memory of the ledger and the size of a GetResources reply.
MAX_DEVICES = 1024
MAX_WORKERS = 4096
MAX_LEASES_PER_WORKER = 4096  # 4096 chunks of 64 MiB: 256 GiB, past any one device
# A refused Acquire's RetryInfo: one worker heartbeat (2 s by default), by which a reclaim ask
# has reached the borrowers and their give-back has come in.
ADMISSION_RETRY_S = 2.0


def check_text(what: str, value: str, limit: int) -> None:
    """InvalidArgument naming the bound when `value` is longer than `limit` characters."""
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; the bound is {limit}",
                              field=what, bound=limit)


def check_size(what: str, value: int, limit: int = MAX_DEVICE_BYTES) -> None:
    """InvalidArgument naming the bound unless 0 <= value <= limit."""
    if not 0 <= value <= limit:
        raise InvalidArgument(f"{what}={value} is outside its bound of [0, {limit}] bytes",
                              field=what, bound=limit)


def check_cached(zone: str, cached: int, committed: int) -> None:
    """InvalidArgument unless `cached` bytes of `zone` can be part of its `committed` ones:
    only zone kv reports cached bytes, and never more than it reports committed."""
    check_zone(zone, leasable=False)
    if cached < 0:
        raise InvalidArgument(f"zone {zone}: cached_bytes={cached} cannot be negative",
                              field="zones.cached_bytes", zone=zone)
    if cached and zone not in CACHED_ZONES:
        raise InvalidArgument(
            f"zone {zone}: cached_bytes={cached}; only zone "
            f"{', '.join(sorted(CACHED_ZONES))} reports cached bytes (send 0)",
            field="zones.cached_bytes", zone=zone)
    if cached > committed:
        raise InvalidArgument(
            f"zone {zone}: cached_bytes={cached} exceeds the {committed} committed bytes reported "
            "with it; cached bytes are part of the committed ones", field="zones.cached_bytes",
            zone=zone, bound=committed)


@dataclass(frozen=True)
class DeviceSpec:
    uuid: str
    total_bytes: int
    free_bytes: int
    granule_bytes: int = 0
    name: str = ""


@dataclass(frozen=True)
class Lease:
    lease_id: str
    worker_id: str
    device_uuid: str
    zone: str
    bytes: int
    expires_at: float  # unix seconds


@dataclass(frozen=True)
class Registration:
    lease_ttl_s: float
    device_budget_bytes: int
    leases: list[Lease]
    zone_caps: dict[str, int] = field(default_factory=dict)  # hard zone caps (Policy.zone_caps)
    incarnation: str = ""  # proof of this incarnation, for its later calls


@dataclass(frozen=True)
class HeartbeatResult:
    lease_ttl_s: float
    reregister: bool
    reclaim: dict[str, int] = field(default_factory=dict)
    zone_caps: dict[str, int] = field(default_factory=dict)  # hard zone caps (Policy.zone_caps)
    # The zones of `reclaim` whose ask is for cached content only (never a live sequence's).
    cached_only: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ZoneReport:
    zone: str
    leased_bytes: int
    committed_bytes: int
    content_bytes: int
    budget_bytes: int
    borrowed_bytes: int
    cached_bytes: int = 0  # of committed: reclaimable at once, no live work harmed (zone kv)

    @property
    def in_use_bytes(self) -> int:
        return max(0, self.committed_bytes - self.cached_bytes)


def _kv(zones: list[ZoneReport]) -> ZoneReport | None:
    return next((z for z in zones if z.zone == "kv"), None)


class _KVSplit:
    """KV in use and KV cached (reclaimable at once) of a report's `kv` zone (0 without one)."""

    zones: list[ZoneReport]

    @property
    def kv_cached_bytes(self) -> int:
        kv = _kv(self.zones)
        return kv.cached_bytes if kv else 0

    @property
    def kv_in_use_bytes(self) -> int:
        kv = _kv(self.zones)
        return kv.in_use_bytes if kv else 0


@dataclass(frozen=True)
class WorkerReport(_KVSplit):
    worker_id: str
    host: str
    leased_bytes: int
    committed_bytes: int
    content_bytes: int
    process_used_bytes: int
    last_heartbeat: float
    zones: list[ZoneReport]
    leases: list[Lease] = field(default_factory=list)
    host_weights_bytes: int = 0   # the host tier (pinned host memory) of its last heartbeat
    host_kv_bytes: int = 0


@dataclass(frozen=True)
class DeviceReport(_KVSplit):
    uuid: str
    name: str
    total_bytes: int
    budget_bytes: int
    granule_bytes: int
    transient_headroom_bytes: int
    leased_bytes: int
    device_used_bytes: int
    ledger_bytes: int
    unaccounted_bytes: int
    unaccounted_alert: bool
    zones: list[ZoneReport]
    workers: list[WorkerReport]

    @property
    def free_budget_bytes(self) -> int:
        return self.budget_bytes - self.leased_bytes


@dataclass
class _Device:
    row: DeviceRow
    device_used_bytes: int = 0
    samples: deque = field(default_factory=deque)  # (t, unaccounted) inside the alert window
    alert: bool = False
    # Bytes the governor wants back per zone: a zone inside its own share was refused because
    # others borrowed it. Handed out once through heartbeats, so a worker is not asked twice.
    reclaim_wanted: dict[str, int] = field(default_factory=dict)
    # Cached KV bytes wanted back per worker (a refusal others' cached KV can help cure): asked
    # for first, cached-only, on that worker's next heartbeat, once.
    cached_wanted: dict[str, int] = field(default_factory=dict)
    # When the device's last worker went (None while one is registered): the row is forgotten
    # Policy.device_ttl_s later, so rows of departed or made-up devices do not pile up.
    empty_since: float | None = None


@dataclass
class _Worker:
    row: WorkerRow
    last_seen: float
    reported: dict[str, tuple[int, int]] = field(default_factory=dict)  # zone -> committed, content
    cached: dict[str, int] = field(default_factory=dict)  # zone -> cached bytes (kv only), > 0
    process_used_bytes: int = 0
    last_heartbeat: float = 0.0
    host_weights_bytes: int = 0   # pinned host memory: weights' host copies
    host_kv_bytes: int = 0        # pinned host memory: KV swapped out or demoted


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class Ledger:
    """All governor state behind one lock; every public method is one atomic step."""

    def __init__(self, store: Store, policy: Policy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watchers = 0  # threads in wait_for_change: a change with none notifies nobody
        self.version = 0
        self.counters = {"acquired": 0, "refused": 0, "released": 0, "expired_workers": 0,
                         "unaccounted_alerts": 0}
        now = clock()
        self._devices = {d.uuid: _Device(d) for d in store.devices()}
        # A restart gives every known worker a fresh TTL: holding memory a little longer is safe,
        # granting it twice is not.
        self._workers = {w.worker_id: _Worker(w, now) for w in store.workers()}
        # Registered workers per device: whether a device is empty, without a scan of every worker.
        self._device_workers: dict[str, int] = {}
        for w in self._workers.values():
            self._count_on(w.row.device_uuid, +1)
        # No worker can be silent for the TTL before this instant (the oldest last_seen plus the
        # TTL, lowered by every _touch), so an expiry check before it needs no scan: admission
        # stays O(1) in the number of workers. -inf: the first check scans.
        self._quiet_until = float("-inf")
        self._leases = {lease.lease_id: lease for lease in store.leases()}
        self._leased: dict[tuple[str, str], int] = {}  # (device, zone) -> bytes
        self._by_worker: dict[str, set[str]] = {w: set() for w in self._workers}
        for lease in self._leases.values():
            self._index(lease, +1)
        # Devices loaded with no worker (left over from before the restart) expire like any other.
        self._device_check_at = float("inf")  # no device can expire before this instant
        for uuid in self._devices:
            self._settle_device(uuid, now)

    # ---- registration -------------------------------------------------------------------------

    def register(self, worker_id: str, device: DeviceSpec, host: str = "",
                 incarnation: str = "") -> Registration:
        """Register (or re-register) `worker_id` on `device`.

        While the id's holder is live, only a registration carrying its `incarnation` succeeds
        (AlreadyExists otherwise); a free id gets a new incarnation, returned for later calls."""
        if not worker_id:
            raise InvalidArgument("worker_id is required")
        if not device.uuid:
            raise InvalidArgument("device.uuid is required")
        check_text("worker_id", worker_id, MAX_ID_CHARS)
        check_text("incarnation", incarnation, MAX_ID_CHARS)
        check_text("device.uuid", device.uuid, MAX_ID_CHARS)
        check_text("device.name", device.name, MAX_TEXT_CHARS)
        check_text("host", host, MAX_TEXT_CHARS)
        check_size("device.total_bytes", device.total_bytes)
        if device.total_bytes <= 0 or not 0 < device.free_bytes <= device.total_bytes:
            raise InvalidArgument(
                f"device sizes are inconsistent: total {device.total_bytes}, free {device.free_bytes}"
                " (free must be in (0, total])")
        if device.granule_bytes < 0:
            raise InvalidArgument("granule_bytes cannot be negative")
        check_size("device.granule_bytes", device.granule_bytes, device.total_bytes)
        with self._lock:
            self._expire_locked()  # a holder silent for the TTL frees the id first
            known = self._workers.get(worker_id)
            if known and known.row.incarnation and incarnation != known.row.incarnation:
                age = max(0.0, self.clock() - known.last_seen)
                raise AlreadyExists(
                    f"worker id {worker_id!r} is held by a live incarnation on host "
                    f"{known.row.host or '(unnamed)'!r} (device {known.row.device_uuid}, heard "
                    f"from {age:.1f} s ago); it frees when that worker deregisters or stays "
                    f"silent for the {self.policy.lease_ttl_s:g} s lease TTL. Give each worker "
                    "its own --worker-id", worker_id=worker_id, holder_host=known.row.host)
            if known and known.row.device_uuid != device.uuid and self._by_worker[worker_id]:
                raise FailedPrecondition(
                    f"worker {worker_id!r} holds leases on device {known.row.device_uuid}; "
                    "release them or deregister before registering on another device")
            if known is None and len(self._workers) >= MAX_WORKERS:
                raise self._quota_refusal("governor:workers", MAX_WORKERS,
                                          "registered workers")
            if device.uuid not in self._devices and len(self._devices) >= MAX_DEVICES:
                raise self._quota_refusal("governor:devices", MAX_DEVICES, "known devices")
            if device.uuid not in self._devices:
                budget = int(device.free_bytes * self.policy.budget_fraction)
                if device.granule_bytes:
                    budget -= budget % device.granule_bytes
                row = DeviceRow(device.uuid, device.name, device.total_bytes, budget,
                                device.granule_bytes)
                self.store.put_device(row)
                self._devices[device.uuid] = _Device(row)
                log.info("device registered", extra={"device": device.uuid, "budget_bytes": budget})
            token = known.row.incarnation if known and known.row.incarnation \
                else secrets.token_hex(16)
            wrow = WorkerRow(worker_id, device.uuid, host, token)
            if known is None or known.row != wrow:
                self.store.put_worker(wrow)
            now = self.clock()
            moved_from = known.row.device_uuid if known else None
            if known is None:
                known = self._workers[worker_id] = _Worker(wrow, now)
                self._by_worker[worker_id] = set()
            else:
                known.row = wrow
            if moved_from != device.uuid:
                self._count_on(device.uuid, +1)
                if moved_from is not None:
                    self._count_on(moved_from, -1)
            self._devices[device.uuid].empty_since = None
            if moved_from is not None and moved_from != device.uuid:
                self._settle_device(moved_from, now)
            self._touch(known, now)
            self._bump()
            return Registration(self.policy.lease_ttl_s, self._devices[device.uuid].row.budget_bytes,
                                self._worker_leases(worker_id), self.policy.zone_caps(), token)

    def deregister(self, worker_id: str, incarnation: str = "") -> int:
        """Forget `worker_id` and release everything it holds; returns the bytes released.
        An empty `incarnation` is an operator's (or a pre-incarnation client's) deregistration."""
        with self._lock:
            self._same_incarnation(self._known(worker_id), incarnation)
            return self._drop_worker(worker_id)

    # ---- leases -------------------------------------------------------------------------------

    def acquire(self, worker_id: str, device_uuid: str, zone: str, nbytes: int,
                incarnation: str = "") -> Lease:
        check_zone(zone)
        if nbytes <= 0:
            raise InvalidArgument(f"bytes must be positive, got {nbytes}")
        check_size("bytes", nbytes)
        with self._lock:
            self._expire_locked()
            worker = self._same_incarnation(self._known(worker_id), incarnation)
            if len(self._by_worker[worker_id]) >= MAX_LEASES_PER_WORKER:
                raise self._quota_refusal(f"worker:{worker_id}/leases", MAX_LEASES_PER_WORKER,
                                          "leases of one worker (resize one instead)")
            device_uuid = device_uuid or worker.row.device_uuid
            if device_uuid != worker.row.device_uuid:
                raise FailedPrecondition(
                    f"worker {worker_id!r} is registered on device {worker.row.device_uuid}, not "
                    f"{device_uuid}; register on that device first")
            self._touch(worker, self.clock())
            self._admit(self._devices[device_uuid], zone, nbytes, worker_id)
            row = LeaseRow(f"l-{secrets.token_hex(8)}", worker_id, device_uuid, zone, nbytes)
            self.store.put_lease(row)
            self._leases[row.lease_id] = row
            self._index(row, +1)
            self.counters["acquired"] += 1
            self._bump()
            return self._lease(row)

    def resize(self, worker_id: str, lease_id: str, nbytes: int, incarnation: str = "") -> Lease:
        """Grow (admitted like acquire) or shrink (always succeeds) a lease to `nbytes`."""
        if nbytes <= 0:
            raise InvalidArgument(f"bytes must be positive, got {nbytes} (use Release to drop a lease)")
        check_size("bytes", nbytes)
        with self._lock:
            self._expire_locked()
            row = self._owned(worker_id, lease_id, incarnation)
            grow = nbytes - row.bytes
            if grow > 0:
                self._admit(self._devices[row.device_uuid], row.zone, grow, worker_id)
            new = replace(row, bytes=nbytes)
            self.store.put_lease(new)
            self._index(row, -1)
            self._leases[lease_id] = new
            self._index(new, +1)
            self._touch(self._workers[worker_id], self.clock())
            self._bump()
            return self._lease(new)

    def release(self, worker_id: str, lease_id: str, incarnation: str = "") -> int:
        with self._lock:
            row = self._owned(worker_id, lease_id, incarnation)
            self.store.delete_lease(lease_id)
            self._index(row, -1)
            del self._leases[lease_id]
            self._touch(self._workers[worker_id], self.clock())
            self.counters["released"] += 1
            self._bump()
            return row.bytes

    # ---- liveness and reconciliation ---------------------------------------------------------

    def heartbeat(self, worker_id: str, device_uuid: str, device_used_bytes: int,
                  process_used_bytes: int, zones: dict[str, tuple[int, int]],
                  incarnation: str = "", cached: dict[str, int] | None = None,
                  host_weights_bytes: int = 0, host_kv_bytes: int = 0) -> HeartbeatResult:
        """Record a worker's figures (each bounded by its device's total: InvalidArgument and
        nothing recorded otherwise). An unknown worker, or a stale `incarnation` of a known one,
        is answered `reregister` and nothing is recorded. `cached`: zone -> the bytes of its
        committed ones that are cached (zone kv only; none given = 0 cached).
        `host_weights_bytes` / `host_kv_bytes`: its host tier, pinned host memory (weights'
        host copies; swapped-out and demoted KV), shown in reports beside its zones: host
        memory, so no device total bounds them, only MAX_DEVICE_BYTES."""
        if device_used_bytes < 0 or process_used_bytes < 0:
            raise InvalidArgument("used bytes cannot be negative")
        check_size("host_weights_bytes", host_weights_bytes)
        check_size("host_kv_bytes", host_kv_bytes)
        for zone, (committed, content) in zones.items():
            check_zone(zone, leasable=False)
            if committed < 0 or content < 0:
                raise InvalidArgument(f"zone {zone}: committed and content cannot be negative")
        cached = {z: b for z, b in (cached or {}).items() if b}
        for zone, nbytes in cached.items():
            check_cached(zone, nbytes, zones.get(zone, (0, 0))[0])
        with self._lock:
            self._expire_locked()
            worker = self._workers.get(worker_id)
            if worker is None or (incarnation and worker.row.incarnation
                                  and incarnation != worker.row.incarnation):
                return HeartbeatResult(self.policy.lease_ttl_s, reregister=True)
            if device_uuid and device_uuid != worker.row.device_uuid:
                raise FailedPrecondition(
                    f"worker {worker_id!r} is registered on device {worker.row.device_uuid}, "
                    f"not {device_uuid}")
            self._check_figures(self._devices[worker.row.device_uuid].row, device_used_bytes,
                                process_used_bytes, zones)
            now = self.clock()
            worker.last_heartbeat = now
            self._touch(worker, now)
            worker.reported = dict(zones)
            worker.cached = cached
            worker.process_used_bytes = process_used_bytes
            worker.host_weights_bytes, worker.host_kv_bytes = host_weights_bytes, host_kv_bytes
            device = self._devices[worker.row.device_uuid]
            if device_used_bytes:
                device.device_used_bytes = device_used_bytes
                self._sample_unaccounted(device, now)
            reclaim, cached_only = self._reclaim_for(device, worker)
            self._bump()
            return HeartbeatResult(self.policy.lease_ttl_s, reregister=False, reclaim=reclaim,
                                   zone_caps=self.policy.zone_caps(), cached_only=cached_only)

    def expire(self) -> list[str]:
        """Drop every worker silent for longer than the TTL; returns their ids."""
        with self._lock:
            return self._expire_locked()

    # ---- reports ------------------------------------------------------------------------------

    def resources(self, device_uuid: str = "") -> list[DeviceReport]:
        with self._lock:
            if device_uuid and device_uuid not in self._devices:
                raise NotFound(f"no device {device_uuid!r} is registered")
            uuids = [device_uuid] if device_uuid else sorted(self._devices)
            return [self._report(self._devices[u]) for u in uuids]

    def wait_for_change(self, since: int, timeout: float) -> int:
        """Block until the version moves past `since` or `timeout` passes; returns the version."""
        with self._changed:
            self._watchers += 1
            try:
                self._changed.wait_for(lambda: self.version != since, timeout)
            finally:
                self._watchers -= 1
            return self.version

    def leases_of(self, worker_id: str) -> list[Lease]:
        with self._lock:
            self._known(worker_id)
            return self._worker_leases(worker_id)

    # ---- internals (lock held) ----------------------------------------------------------------

    def _bump(self) -> None:
        self.version += 1
        if self._watchers:
            self._changed.notify_all()

    def _touch(self, worker: _Worker, now: float) -> None:
        """Every write of last_seen after loading: keeps _quiet_until at or below its expiry."""
        worker.last_seen = now
        self._quiet_until = min(self._quiet_until, now + self.policy.lease_ttl_s)

    def _index(self, row: LeaseRow, sign: int) -> None:
        key = (row.device_uuid, row.zone)
        self._leased[key] = self._leased.get(key, 0) + sign * row.bytes
        owned = self._by_worker.setdefault(row.worker_id, set())
        if sign > 0:
            owned.add(row.lease_id)
        else:
            owned.discard(row.lease_id)

    def _check_figures(self, device: DeviceRow, device_used: int, process_used: int,
                       zones: dict[str, tuple[int, int]]) -> None:
        """InvalidArgument unless every figure of a heartbeat fits the device it is about."""
        total = device.total_bytes
        where = f"device {device.uuid} has {total} bytes in all"
        if device_used > total or process_used > total:
            raise InvalidArgument(
                f"device_used_bytes={device_used} / process_used_bytes={process_used}: "
                f"{where}; a figure beyond the device total is refused", bound=total)
        for zone, (committed, content) in zones.items():
            if committed > total or content > total:
                raise InvalidArgument(
                    f"zone {zone}: committed {committed} / content {content} bytes: {where}",
                    zone=zone, bound=total)
        committed_sum = sum(c for c, _ in zones.values())
        if committed_sum > total:
            raise InvalidArgument(f"the zones' committed bytes sum to {committed_sum}: {where}",
                                  bound=total)

    def _same_incarnation(self, worker: _Worker, incarnation: str) -> _Worker:
        """`worker`, unless `incarnation` is given and is not the live one (FailedPrecondition:
        that process lost the id, to expiry and another registration)."""
        if incarnation and worker.row.incarnation and incarnation != worker.row.incarnation:
            raise FailedPrecondition(
                f"worker id {worker.row.worker_id!r} is now held by another incarnation (host "
                f"{worker.row.host or '(unnamed)'!r}); this one lost it and must register again",
                worker_id=worker.row.worker_id)
        return worker

    def _quota_refusal(self, subject: str, bound: int, what: str) -> ResourceExhausted:
        self.counters["refused"] += 1
        return ResourceExhausted(
            f"the governor keeps at most {bound} {what}; free some (deregister, release) or let "
            "silent workers expire", zone="",
            violations=[QuotaViolation(subject, f"at most {bound} {what}")],
            retry_after_s=min(self.policy.lease_ttl_s, 60.0))

    def _count_on(self, uuid: str, sign: int) -> None:
        count = self._device_workers.get(uuid, 0) + sign
        if count:
            self._device_workers[uuid] = count
        else:
            self._device_workers.pop(uuid, None)

    def _settle_device(self, uuid: str, now: float) -> None:
        """After a worker of `uuid` went: its last device truth is stale (the worker's memory
        went with it), and with no worker left the device starts its expiry clock."""
        device = self._devices.get(uuid)
        if device is None:
            return
        device.device_used_bytes = 0  # unknown until the next beat that carries the truth
        if self._device_workers.get(uuid, 0):
            return
        if device.empty_since is None:
            device.empty_since = now
        self._device_check_at = min(self._device_check_at, now + self.policy.device_ttl_s)

    def _expire_devices(self, now: float) -> None:
        if now < self._device_check_at:
            return
        next_check = float("inf")
        for uuid, device in list(self._devices.items()):
            if device.empty_since is None:
                continue
            if device.empty_since + self.policy.device_ttl_s > now \
                    or any(self._leased_on(uuid).values()):
                next_check = min(next_check, device.empty_since + self.policy.device_ttl_s)
                continue
            self.store.delete_device(uuid)
            del self._devices[uuid]
            log.info("device forgotten: no worker for the device TTL",
                     extra={"device": uuid, "device_ttl_s": self.policy.device_ttl_s})
            self._bump()
        self._device_check_at = next_check

    def _known(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise NotFound(f"worker {worker_id!r} is not registered (or its leases expired); "
                           "call RegisterWorker first", worker_id=worker_id)
        return worker

    def _owned(self, worker_id: str, lease_id: str, incarnation: str = "") -> LeaseRow:
        self._same_incarnation(self._known(worker_id), incarnation)
        row = self._leases.get(lease_id)
        if row is None:
            raise NotFound(f"no lease {lease_id!r} (released, expired or never granted)",
                           lease_id=lease_id)
        if row.worker_id != worker_id:
            # The caller is known but asks to act on memory that another worker holds: that is
            # a question of who may act (PERMISSION_DENIED), not of the system's state.
            raise PermissionDenied(
                f"lease {lease_id!r} belongs to worker {row.worker_id!r}, not {worker_id!r}",
                lease_id=lease_id)
        return row

    def _worker_leases(self, worker_id: str) -> list[Lease]:
        return [self._lease(self._leases[i]) for i in sorted(self._by_worker.get(worker_id, ()))]

    def _lease(self, row: LeaseRow) -> Lease:
        worker = self._workers.get(row.worker_id)
        last = worker.last_seen if worker else self.clock()
        return Lease(row.lease_id, row.worker_id, row.device_uuid, row.zone, row.bytes,
                     last + self.policy.lease_ttl_s)

    def _leased_on(self, uuid: str) -> dict[str, int]:
        return {z: self._leased.get((uuid, z), 0) for z in ZONES}

    def _borrowed(self, device: _Device, leased: dict[str, int]) -> dict[str, int]:
        """Bytes each zone leases beyond its share; lent by zones that leave theirs unused."""
        shares = self.policy.zone_budgets
        if not shares:
            return {}
        borrowed = {z: max(0, leased[z] - b) for z, b in shares.items()}
        headroom = self.policy.transient_headroom_bytes
        pool = max(0, device.row.budget_bytes - headroom - sum(shares.values()))
        unshared = [z for z in ZONES if z not in shares and z not in ("transient", "foreign")]
        pool_used = sum(leased[z] for z in unshared) + max(0, leased["transient"] - headroom)
        overflow = max(0, pool_used - pool)
        for z in unshared:
            if overflow and leased[z]:
                borrowed[z] = overflow * leased[z] // pool_used
        return {z: b for z, b in borrowed.items() if b > 0}

    def _admit(self, device: _Device, zone: str, extra: int, worker_id: str) -> None:
        """Raise ResourceExhausted (changing nothing but counters) unless `extra` bytes fit."""
        leased = self._leased_on(device.row.uuid)
        budget = device.row.budget_bytes
        headroom = self.policy.transient_headroom_bytes
        reserve = 0 if zone == "transient" else max(0, headroom - leased["transient"])
        free = budget - sum(leased.values()) - reserve
        violations: list[QuotaViolation] = []
        subject = f"device:{device.row.uuid}/zone:{zone}"
        if extra > free:
            violations.append(QuotaViolation(
                f"device:{device.row.uuid}",
                f"asked {_mib(extra)} for {zone}, {_mib(max(free, 0))} free of a {_mib(budget)} "
                f"budget ({_mib(reserve)} kept as transient headroom)"))
        share = self.policy.zone_budgets.get(zone)
        if share is not None and not self.policy.lending and leased[zone] + extra > share:
            zone_free = max(0, share - leased[zone])
            free = min(free, zone_free)
            violations.append(QuotaViolation(
                subject, f"asked {_mib(extra)}, {_mib(zone_free)} left of the zone's {_mib(share)} "
                "budget (lending is off)"))
        if not violations:
            return
        borrowed = self._borrowed(device, leased)
        hints = self._hints(device, leased, borrowed)
        need = extra - max(free, 0)
        # Others' cached KV first: it costs no live sequence. Only when giving back could cure
        # the refusal, and only kv helps a zone that is over its hard cap.
        capped = share is not None and not self.policy.lending and leased[zone] + extra > share
        if (zone == "kv" or not capped) and max(free, 0) + sum(h.bytes for h in hints) >= extra:
            need -= self._ask_cached(device, worker_id, need)
        cached_note = self._cached_note(hints)
        if share is not None and self.policy.lending and leased[zone] + extra <= share and borrowed:
            violations.append(QuotaViolation(
                subject, f"zone {zone} is inside its {_mib(share)} share; "
                f"{_mib(sum(borrowed.values()))} of the budget is lent to "
                f"{', '.join(sorted(borrowed))} and is being reclaimed"))
            for z, b in sorted(borrowed.items(), key=lambda kv: -kv[1]):
                take = min(b, need)
                if take <= 0:
                    break
                device.reclaim_wanted[z] = max(device.reclaim_wanted.get(z, 0), take)
                need -= take
        self.counters["refused"] += 1
        raise ResourceExhausted(
            f"admission refused: asked {_mib(extra)} in zone {zone} on device {device.row.uuid}, "
            f"{_mib(max(free, 0))} free; give back memory from the reclaimable zones listed"
            f"{cached_note}", asked_bytes=extra, free_bytes=max(free, 0), zone=zone,
            violations=violations, reclaimable=hints, retry_after_s=ADMISSION_RETRY_S)

    def _ask_cached(self, device: _Device, worker_id: str, need: int) -> int:
        """Ask the device's other workers for up to `need` bytes of their cached KV, most cached
        first (handed out on their next heartbeat, cached-only); returns the bytes asked."""
        asked = 0
        holders = sorted(((w.cached.get("kv", 0), wid) for wid, w in self._workers.items()
                          if wid != worker_id and w.row.device_uuid == device.row.uuid
                          and w.cached.get("kv", 0) > 0), reverse=True)
        for cached, wid in holders:
            if asked >= need:
                break
            held = sum(self._leases[i].bytes for i in self._by_worker[wid]
                       if self._leases[i].zone == "kv")
            take = min(cached, held, need - asked)
            if take > 0:
                device.cached_wanted[wid] = max(device.cached_wanted.get(wid, 0), take)
                asked += take
        return asked

    @staticmethod
    def _cached_note(hints: list[ReclaimHint]) -> str:
        cached = [h for h in hints if h.cached_bytes]
        if not cached:
            return ""
        holders = ", ".join(sorted({h.worker_id for h in cached}))
        return (f"; {_mib(sum(h.cached_bytes for h in cached))} of it is cached KV (on "
                f"{holders}), given back first: no live sequence is harmed")

    def _hints(self, device: _Device, leased: dict[str, int],
               borrowed: dict[str, int]) -> list[ReclaimHint]:
        """Per worker and zone: evictable bytes, idle lease slack plus cached bytes (kv), or a
        share of borrowed bytes."""
        hints = []
        for worker_id, worker in self._workers.items():
            if worker.row.device_uuid != device.row.uuid:
                continue
            per_zone: dict[str, int] = {}
            for lease_id in self._by_worker[worker_id]:
                row = self._leases[lease_id]
                per_zone[row.zone] = per_zone.get(row.zone, 0) + row.bytes
            for zone, held in per_zone.items():
                committed = worker.reported.get(zone, (held, 0))[0]
                idle = max(0, held - committed)
                cached = min(held, worker.cached.get(zone, 0))
                lent = borrowed.get(zone, 0) * held // leased[zone] if leased[zone] else 0
                give = max(held if zone in EVICTABLE_ZONES else min(held, idle + cached), lent)
                if give > 0:
                    hints.append(ReclaimHint(worker_id, zone, give, min(cached, give)))
        hints.sort(key=lambda h: -h.bytes)
        return hints[:_MAX_HINTS]

    def _reclaim_for(self, device: _Device, worker: _Worker) -> tuple[dict[str, int],
                                                                        frozenset[str]]:
        """The asks for `worker`'s heartbeat, and which of them are cached-only: its cached KV
        first (at most what this beat reports cached), then its share of borrowed bytes."""
        worker_id = worker.row.worker_id
        if not device.reclaim_wanted and worker_id not in device.cached_wanted:
            return {}, frozenset()
        held = {z: 0 for z in ZONES}
        for i in self._by_worker[worker_id]:
            held[self._leases[i].zone] += self._leases[i].bytes
        asks: dict[str, int] = {}
        cached_only: set[str] = set()
        want = device.cached_wanted.pop(worker_id, 0)
        ask = min(want, worker.cached.get("kv", 0), held["kv"])
        if ask > 0:
            asks["kv"] = ask
            cached_only.add("kv")
        borrowed = self._borrowed(device, self._leased_on(device.row.uuid)) \
            if device.reclaim_wanted else {}
        for zone in list(device.reclaim_wanted):
            wanted = min(device.reclaim_wanted[zone], borrowed.get(zone, 0))
            ask = min(wanted, held[zone] - asks.get(zone, 0))
            if ask > 0:
                asks[zone] = asks.get(zone, 0) + ask
                cached_only.discard(zone)  # a plain ask: the worker drops cached KV first anyway
                wanted -= ask
            if wanted > 0:
                device.reclaim_wanted[zone] = wanted
            else:
                del device.reclaim_wanted[zone]
        return asks, frozenset(cached_only)

    def _drop_worker(self, worker_id: str) -> int:
        self.store.delete_worker(worker_id)
        freed = 0
        for lease_id in list(self._by_worker.get(worker_id, ())):
            row = self._leases.pop(lease_id)
            self._index(row, -1)
            freed += row.bytes
        self._by_worker.pop(worker_id, None)
        gone = self._workers.pop(worker_id)
        device = self._devices.get(gone.row.device_uuid)
        if device is not None:
            device.cached_wanted.pop(worker_id, None)
        self._count_on(gone.row.device_uuid, -1)
        self._settle_device(gone.row.device_uuid, self.clock())
        self._bump()
        return freed

    def _expire_locked(self) -> list[str]:
        now = self.clock()
        self._expire_devices(now)
        if now < self._quiet_until:
            return []
        deadline = now - self.policy.lease_ttl_s
        dead = [w for w, s in self._workers.items() if s.last_seen < deadline]
        alive = [s.last_seen for w, s in self._workers.items() if s.last_seen >= deadline]
        self._quiet_until = min(alive, default=float("inf")) + self.policy.lease_ttl_s
        for worker_id in dead:
            freed = self._drop_worker(worker_id)
            self.counters["expired_workers"] += 1
            log.warning("worker expired: leases returned to the pool",
                        extra={"worker_id": worker_id, "freed_bytes": freed})
        return dead

    def _ledger_bytes(self, uuid: str) -> int:
        return sum(c for w in self._workers.values() if w.row.device_uuid == uuid
                   for c, _ in w.reported.values())

    def _sample_unaccounted(self, device: _Device, now: float) -> None:
        unaccounted = device.device_used_bytes - self._ledger_bytes(device.row.uuid)
        samples = device.samples
        samples.append((now, unaccounted))
        while samples and samples[0][0] < now - self.policy.unaccounted_window_s:
            samples.popleft()
        values = [v for _, v in samples]
        alert = False
        if len(values) > _RECENT_SAMPLES:
            growth = min(values[-_RECENT_SAMPLES:]) - min(values[:-_RECENT_SAMPLES])
            alert = growth >= self.policy.unaccounted_alert_bytes
        if alert and not device.alert:
            self.counters["unaccounted_alerts"] += 1
            log.warning("unaccounted device memory is growing: something allocates outside the "
                        "ledger", extra={"device": device.row.uuid, "unaccounted_bytes": unaccounted,
                                         "window_s": self.policy.unaccounted_window_s})
        device.alert = alert

    def _report(self, device: _Device) -> DeviceReport:
        uuid = device.row.uuid
        leased = self._leased_on(uuid)
        borrowed = self._borrowed(device, leased)
        shares = self.policy.zone_budgets
        workers, committed, content = [], dict.fromkeys(ZONES, 0), dict.fromkeys(ZONES, 0)
        cached = dict.fromkeys(ZONES, 0)
        for worker_id, worker in sorted(self._workers.items()):
            if worker.row.device_uuid != uuid:
                continue
            per_zone = dict.fromkeys(ZONES, 0)
            for lease_id in self._by_worker[worker_id]:
                per_zone[self._leases[lease_id].zone] += self._leases[lease_id].bytes
            zones = []
            for z in ZONES:
                c, ct = worker.reported.get(z, (0, 0))
                committed[z] += c
                content[z] += ct
                cached[z] += worker.cached.get(z, 0)
                if c or ct or per_zone[z]:
                    zones.append(ZoneReport(z, per_zone[z], c, ct, shares.get(z, 0), 0,
                                            worker.cached.get(z, 0)))
            workers.append(WorkerReport(
                worker_id, worker.row.host, sum(per_zone.values()),
                sum(c for c, _ in worker.reported.values()),
                sum(ct for _, ct in worker.reported.values()),
                worker.process_used_bytes, worker.last_heartbeat, zones,
                self._worker_leases(worker_id), worker.host_weights_bytes, worker.host_kv_bytes))
        ledger = sum(committed.values())
        unaccounted = device.device_used_bytes - ledger if device.device_used_bytes else 0
        committed["foreign"] = max(0, unaccounted)
        zones = [ZoneReport(z, leased[z], committed[z], content[z],
                            self.policy.transient_headroom_bytes if z == "transient"
                            else shares.get(z, 0), borrowed.get(z, 0), cached[z]) for z in ZONES]
        return DeviceReport(
            uuid, device.row.name, device.row.total_bytes, device.row.budget_bytes,
            device.row.granule_bytes, self.policy.transient_headroom_bytes, sum(leased.values()),
            device.device_used_bytes, ledger, unaccounted, device.alert, zones, workers)
