"""Stable-address weight slots: offload and page-in without moving a weight.

What a slot holds: one or more weight tensors (`add_group`: the executor puts every tensor of one
`layers.N.` layer in one slot, and each non-layer weight in a slot of its own), laid out at
ALIGN-aligned offsets in one contiguous virtual range and mirrored byte for byte in one contiguous
pinned host buffer. A slot is the unit of residency: one commit, one H2D copy, one event, one
policy entry, one pin count. A weight key names its tensor (`tensor` gives its address); every
method that takes keys accepts weight keys or slot names and acts once per slot they touch.
Why: per-tensor slots paid the driver per tensor (516 page-ins and ~200 ms of host driver work per
token for an 8B model streaming through its budget, at 0.46 of pinned H2D); per-layer slots bound
the host work per token by the number of layers.

Hazards and contract:
- A captured graph bakes weight addresses. Each slot therefore gets one virtual range for the life
  of the model (carved once from the arena), and each tensor a fixed offset in it; eviction unmaps
  its pages, page-in maps new pages at the same address and copies from pinned host memory, so a
  graph captured earlier reads the new pages on replay.
- Eviction while a kernel still reads the slot would fault: eviction is an arena decommit, fenced
  on the compute and copy streams. A page-in that touches granules whose release is still queued
  resurrects them instead of racing the unmap.
- Page-in copies on the copy stream; the compute stream waits on an event, the host never blocks.
  A prefetch (`ensure_resident(wait=False)`, streaming) defers that wait to `wait_resident`,
  which the owner calls before launching on the slots (pinned from before the prefetch).
- Never map or unmap inside a capture (FailedPrecondition); a capture may only use resident slots.
- Admission counts committed granule bytes (what the device pays), not tensor bytes; slots are
  packed, so a granule shared by neighbours is paid once.
- State per slot: idle (no pages), pending (copy in flight), resident, poisoned (a failed copy or
  release: never used until removed). A failed page-in leaves the slot idle or poisoned, never
  mapped to the wrong bytes.
- Only an *evictable*, *unpinned* slot is ever chosen as a victim. A slot whose owner never calls
  ensure_resident again before launching kernels on it must not lose its pages to make room for
  another slot: the owner's next launch would read unmapped memory (illegal address, context
  lost); such a page-in is refused with ResourceExhausted instead. An owner that does page back in
  (the model executor: `pin` + ensure_resident at the start of every request) pins its slots while
  it launches on them, so only an idle owner's pages can go.
- Pinned host memory is a budget too (`host_budget_bytes`): a slot whose host copy would exceed it
  is refused with ResourceExhausted before anything is allocated.
- The budget has sources (`--weight-budget-bytes`, the governor's weights zone cap) and is the
  smallest of them, set through `set_budget` only. A budget that shrinks pages idle (unpinned)
  weights out at once; pinned ones stay mapped (kernels are being launched on them) until their
  owner unpins them and calls `trim`.

Cost: a page-in is one cuMemCreate/Map/SetAccess per large handle (a slot's range: an edge granule
at each end that a neighbour may share, 1 GiB handles inside) plus one copy (~55 GB/s pinned on
H200) and one event record; a hit is a dict lookup. Per streamed token: one page-in per slot that
is not resident, whatever the number of tensors in it.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gpu_worker.device.arena import ALIGN, Arena
from gpu_worker.device.backend import Backend
from gpu_worker.device.gate import CaptureGate
from gpu_worker.device.release_queue import ReleaseQueue
from gpu_worker.device.residency import ResidencyPolicy
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

ZONE = "weights"
# Where a limit on resident weights comes from, as error messages name it.
BUDGET_SOURCES: dict[str, str] = {
    "flag": "--weight-budget-bytes",
    "governor": "the governor's weights zone cap",
}


# A slot's host copy is written by up to COPY_THREADS threads, a big tensor split along its first
# axis: at load this copy is the consumer of the checkpoint loader's pipeline (~160 MB a layer at
# 8B; the int4 tile permutation's 64-byte elements copy at ~1.3x a plain copy's time), and one
# core caps it. NumPy releases the GIL inside each copy.
COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else os.cpu_count() or 1))
COPY_SPLIT_BYTES = 4 << 20   # a tensor at least this big is split


class HostCopier:
    """np.copyto of (destination, source) pairs on a small pool of threads, made on first use."""

    def __init__(self, threads: int = COPY_THREADS) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        tasks: list[tuple[np.ndarray, np.ndarray]] = []
        for dst, src in pairs:
            rows = src.shape[0] if src.ndim else 1
            parts = min(self.threads, rows) if src.nbytes >= COPY_SPLIT_BYTES else 1
            if parts <= 1:
                tasks.append((dst, src))
                continue
            bounds = [rows * i // parts for i in range(parts + 1)]
            tasks += [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(bounds)]
        if self.threads <= 1 or len(tasks) <= 1:
            for dst, src in tasks:
                np.copyto(dst, src)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="weight-copy")
            pool = self._pool
        for future in [pool.submit(np.copyto, dst, src) for dst, src in tasks]:
            future.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


@dataclass(eq=False)
class WeightSlot:
    key: str                 # the slot's name (a single weight's slot: the weight key)
    va: int
    nbytes: int
    host: np.ndarray = field(repr=False)
    # weight key -> (offset, nbytes) inside [va, va + nbytes) and `host`; ALIGN-aligned offsets
    tensors: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    evictable: bool = True  # False: the owner never pages it back, so it is never a victim
    pins: int = 0           # > 0 while an owner launches on it: never a victim then
    state: str = "idle"  # idle | pending | resident | poisoned
    event: object = field(default=None, repr=False)
    error: str = ""


class WeightSlots:
    def __init__(
        self,
        backend: Backend,
        gate: CaptureGate,
        arena: Arena,
        queue: ReleaseQueue,
        compute_stream: object,
        copy_stream: object,
        budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
    ) -> None:
        self._backend = backend
        self._gate = gate
        self._arena = arena
        self._queue = queue
        self._compute = compute_stream
        self._copy = copy_stream
        self._lock = threading.RLock()
        self._slots: dict[str, WeightSlot] = {}     # slot name -> slot
        self._owner: dict[str, WeightSlot] = {}     # slot name and each weight key -> its slot
        # Each source's limit on resident weights (None: none from it); the budget is the least.
        self._limits: dict[str, int | None] = dict.fromkeys(BUDGET_SOURCES)
        self._limits["flag"] = budget_bytes
        self.policy = ResidencyPolicy(budget_bytes)
        self.host_budget_bytes = host_budget_bytes  # pinned host bytes all slots may hold (None: any)
        self._host_bytes = 0
        self.copier = HostCopier()   # writes each slot's pinned host copy (add_group)
        self.counters = dict.fromkeys(
            ("page_ins", "hits", "misses", "evictions", "bytes_copied", "failed_page_ins"), 0)
        self.driver_seconds = 0.0
        self.total_seconds = 0.0
        self.peak_committed_bytes = 0   # the most committed weight bytes seen after a page-in
        arena.on_quarantine.append(self._on_quarantine)

    @property
    def budget_bytes(self) -> int | None:
        """The effective budget: the least of the sources' limits (None: only the ledger's)."""
        return self.policy.capacity_bytes

    @property
    def budget_source(self) -> str:
        """Where the effective budget comes from, for error messages."""
        with self._lock:
            budget = self.policy.capacity_bytes
            return next((BUDGET_SOURCES[s] for s, b in self._limits.items() if b == budget),
                        "no weight budget")

    def limits(self) -> dict[str, int | None]:
        with self._lock:
            return dict(self._limits)

    def set_budget(self, budget_bytes: int | None, source: str = "flag") -> int | None:
        """Set one source's committed-byte limit on resident weights (None: none from it);
        returns the effective budget, the least of all sources' limits. A shrink pages idle
        weights out down to the new budget at once and waits for their fenced releases (a pinned
        slot stays until its owner unpins it and calls `trim`: it is being launched on)."""
        if source not in BUDGET_SOURCES:
            raise InvalidArgument(f"weight budget source {source!r} is not one of "
                                  f"{', '.join(BUDGET_SOURCES)}")
        if budget_bytes is not None and budget_bytes <= 0:
            raise InvalidArgument(f"weight budget {budget_bytes} must be positive (or None)")
        with self._lock:
            self._limits[source] = budget_bytes
            limits = [b for b in self._limits.values() if b is not None]
            budget = min(limits) if limits else None
            self.policy.capacity_bytes = budget
        self.trim()
        return budget

    def trim(self) -> int:
        """Page idle (unpinned) weights out until resident weights fit the budget; returns the
        slots evicted. Over budget only after a shrink while slots were pinned: the owner calls
        this once it unpins them (the end of a request)."""
        budget = self.policy.capacity_bytes
        if budget is None or self._arena.zone_live_bytes(ZONE) <= budget:
            return 0   # the common case, without the gate
        if self._gate.is_capturing_thread():
            raise FailedPrecondition("never page weights out inside a capture (it unmaps)")
        evicted = 0
        with self._gate.shared(), self._lock:
            while (budget := self.policy.capacity_bytes) is not None and \
                    self._arena.zone_live_bytes(ZONE) > budget:
                victim = self.policy.victim(exclude=self._excluded(set()))
                if victim is None:
                    break
                self._evict(self._slots[victim])
                evicted += 1
        if evicted:  # run the fenced releases now (per-event waits): the ledger, and with it
            self._queue.drain()  # the governor's lease, drops at once, not at the next commit
        return evicted

    # -- slots ---------------------------------------------------------------------------------
    def add(self, key: str, host: np.ndarray, evictable: bool = True) -> WeightSlot:
        """Register one weight in a slot of its own (named `key`); see `add_group`."""
        return self.add_group(key, [(key, host)], evictable)

    def add_group(self, name: str, tensors: list[tuple[str, np.ndarray]],
                  evictable: bool = True) -> WeightSlot:
        """Register weights that live and page together (one layer): one pinned host copy and one
        stable device range holding them all at ALIGN-aligned offsets; not resident yet. A tensor
        may be a strided view: its bytes in C order are what is stored (one copy, into the pinned
        buffer; the executor's tile-layout permutation happens there).

        `evictable=False` for an owner that does not call ensure_resident before every use: its
        slot is never evicted to make room for another (see the module docstring)."""
        if not name:
            raise InvalidArgument("weight slot name must be a non-empty string")
        if not tensors:
            raise InvalidArgument(f"weight slot {name!r} has no weights")
        layout: dict[str, tuple[int, int]] = {}
        datas: list[np.ndarray] = []
        end = 0
        for key, host in tensors:
            if not key:
                raise InvalidArgument("weight key must be a non-empty string")
            data = np.asarray(host)   # any strides: its bytes in C order are copied, once, below
            if data.nbytes == 0:
                raise InvalidArgument(f"weight {key!r} is empty")
            if key in layout:
                raise InvalidArgument(f"weight {key!r} appears twice in slot {name!r}")
            off = -(-end // ALIGN) * ALIGN
            layout[key] = (off, data.nbytes)
            datas.append(data)
            end = off + data.nbytes
        with self._gate.shared(), self._lock:
            taken = [k for k in (name, *layout) if k in self._owner]
            if taken:
                raise InvalidArgument(f"weight {taken[0]!r} already has a slot")
            if self.host_budget_bytes is not None and \
                    self._host_bytes + end > self.host_budget_bytes:
                free = max(0, self.host_budget_bytes - self._host_bytes)
                raise ResourceExhausted(
                    f"pinned host memory: weight {name!r} needs {end} bytes, {free} free of "
                    f"the {self.host_budget_bytes}-byte host pinned budget "
                    "(--host-pinned-budget-bytes)", asked_bytes=end, free_bytes=free,
                    zone="")
            pinned = self._backend.alloc_pinned(end)
            prev, copies = 0, []
            for (off, n), data in zip(layout.values(), datas):
                pinned[prev:off] = 0      # alignment padding: defined bytes on the device too
                copies.append((pinned[off:off + n].view(data.dtype).reshape(data.shape), data))
                prev = off + n
            self.copier.copy(copies)
            try:
                va = self._arena.carve(end, role="weights")
            except BaseException:
                self._backend.free_pinned(pinned)
                raise
            slot = WeightSlot(name, va, end, pinned, tensors=layout, evictable=evictable)
            self._slots[name] = slot
            self._owner[name] = slot
            for key in layout:
                self._owner[key] = slot
            self._host_bytes += end
            self.policy.window = max(1, len(self._slots))
            return slot

    def get(self, key: str) -> WeightSlot:
        """The slot named `key` or holding weight `key`."""
        slot = self._owner.get(key)
        if slot is None:
            raise NotFound(f"no weight slot {key!r}")
        return slot

    def tensor(self, key: str) -> tuple[int, int]:
        """(device address, bytes) of weight `key`: fixed for the life of its slot."""
        slot = self.get(key)
        off, n = slot.tensors.get(key, (0, slot.nbytes))
        return slot.va + off, n

    def _distinct(self, keys: list[str]) -> list[WeightSlot]:
        """The slots `keys` touch, once each, in first-seen order (NotFound for an unknown key)."""
        seen: dict[int, WeightSlot] = {}
        for k in keys:
            s = self.get(k)
            seen.setdefault(id(s), s)
        return list(seen.values())

    def ensure_resident(self, keys: list[str], stream: object = None, wait: bool = True) -> None:
        """Make `keys` resident; `stream` (default: compute) waits for their page-in copies.
        `wait=False` only issues the page-ins (a prefetch): call `wait_resident` before use."""
        t0 = time.perf_counter()
        d0 = self._arena.driver_seconds
        stream = self._compute if stream is None else stream
        # Lock order everywhere: gate section, then this lock, then the arena's (a capturing
        # thread that only touches resident slots must not wait behind a page-in holding our lock).
        with self._gate.shared(), self._lock:
            slots = self._distinct(keys)  # validate all before changing anything
            for s in slots:
                if s.state == "poisoned":
                    raise FailedPrecondition(f"weight {s.key!r} is poisoned ({s.error}); remove it")
            capturing = self._gate.is_capturing_thread()
            need = {s.key for s in slots}
            drv = 0.0
            for s in slots:
                if s.state in ("resident", "pending"):
                    if s.state == "pending":
                        if self._backend.event_done(s.event):
                            s.state = "resident"
                        elif capturing:
                            raise FailedPrecondition(f"weight {s.key!r} is still paging in; "
                                                     "page in before capturing")
                        elif wait:
                            self._backend.stream_wait_event(stream, s.event)
                    self.counters["hits"] += 1
                    self.policy.touch(s.key)
                    continue
                if capturing:
                    raise FailedPrecondition(f"weight {s.key!r} is not resident: never map inside a "
                                             "capture; call ensure_resident before capturing")
                self.counters["misses"] += 1
                drv += self._page_in(s, need, stream if wait else None)
            self.driver_seconds += drv + (self._arena.driver_seconds - d0)
            self.total_seconds += time.perf_counter() - t0

    def wait_resident(self, keys: list[str], stream: object) -> None:
        """`stream` waits for the page-in copies of `keys` that a prefetch issued; a hit is not
        counted again. FailedPrecondition if one is not mapped (only a pinned key is safe here)."""
        with self._lock:
            for s in self._distinct(keys):
                if s.state == "pending":
                    if self._backend.event_done(s.event):
                        s.state = "resident"
                    else:
                        self._backend.stream_wait_event(stream, s.event)
                elif s.state != "resident":
                    raise FailedPrecondition(f"weight {s.key!r} is {s.state}, not resident: pin it "
                                             "before its page-in and until its launches")

    def pin(self, keys: list[str]) -> None:
        """Keep `keys` from being chosen as victims until `unpin` (an owner launching on them)."""
        with self._lock:
            for s in self._distinct(keys):
                s.pins += 1

    def unpin(self, keys: list[str]) -> None:
        """Undo one `pin` of the same keys (once per slot they touch)."""
        with self._lock:
            seen: set[int] = set()
            for k in keys:
                s = self._owner.get(k)
                if s is not None and id(s) not in seen and s.pins > 0:
                    seen.add(id(s))
                    s.pins -= 1

    def demote(self, keys: list[str]) -> None:
        """Make the resident, evictable slots of `keys` the next victims (a streamed segment that
        just ran: the rest of the sweep and the next run's kept layers come first)."""
        with self._lock:
            for s in self._distinct(keys):
                if s.evictable and s.state in ("pending", "resident"):
                    self.policy.demote(s.key)

    def page_out(self, keys: list[str]) -> int:
        """Evict every mapped slot of `keys` (the host copies stay); returns the slot bytes that
        were resident. Refused (FailedPrecondition, nothing changed) while any of them is pinned."""
        with self._gate.shared(), self._lock:
            slots = self._distinct(keys)
            busy = [s.key for s in slots if s.pins]
            if busy:
                raise FailedPrecondition(f"weights {busy[:3]} are in use (pinned); not paged out")
            freed = 0
            for s in slots:
                if s.state in ("pending", "resident"):
                    freed += s.nbytes
                    self._evict_if_mapped(s)
            return freed

    def resident_bytes(self, keys: list[str]) -> int:
        with self._lock:
            slots = {id(s): s for k in keys if (s := self._owner.get(k)) is not None}
            return sum(s.nbytes for s in slots.values() if s.state in ("resident", "pending"))

    def evict(self, key: str) -> None:
        """Unmap the pages of `key`'s slot (fenced); its address stays reserved for the next
        page-in."""
        with self._gate.shared(), self._lock:
            self._evict_if_mapped(self.get(key))

    def remove(self, key: str) -> None:
        """Forget `key`'s slot and every weight in it: evict, give back its address, free its
        pinned copy after the copy stream."""
        with self._gate.shared(), self._lock:
            slot = self.get(key)
            key = slot.key
            self._evict_if_mapped(slot, counted=False)  # a removal is not an eviction
            del self._slots[key]
            for k in (key, *slot.tensors):
                self._owner.pop(k, None)
            self.policy.forget(key)
            self.policy.window = max(1, len(self._slots))
            if "quarantined" not in slot.error:  # a quarantined range is never reused
                self._arena.uncarve(slot.va, slot.nbytes)
            pinned, event = slot.host, slot.event
            self._host_bytes -= slot.nbytes

            def free_host() -> None:
                self._backend.free_pinned(pinned)
                if event is not None:
                    self._backend.destroy_event(event)
            self._queue.defer([self._copy], free_host, what=f"free pinned copy of {key}")

    def stats(self) -> dict:
        with self._lock:
            c = dict(self.counters)
            total = c["hits"] + c["misses"]
            states: dict[str, int] = {}
            for s in self._slots.values():
                states[s.state] = states.get(s.state, 0) + 1
            return {
                **c,
                "hit_rate": c["hits"] / total if total else 0.0,
                "slots": len(self._slots),
                "tensors": sum(len(s.tensors) for s in self._slots.values()),
                "slot_bytes": sum(s.nbytes for s in self._slots.values()),
                "resident_bytes": sum(s.nbytes for s in self._slots.values()
                                      if s.state in ("resident", "pending")),
                "committed_bytes": self._arena.zone_live_bytes(ZONE),
                "peak_committed_bytes": self.peak_committed_bytes,
                "budget_bytes": self.policy.capacity_bytes,      # effective: the least limit
                "budget_limits": dict(self._limits),
                "host_bytes": self._host_bytes,
                "host_budget_bytes": self.host_budget_bytes,
                "states": states,
                "driver_seconds": self.driver_seconds,
                "bookkeeping_seconds": max(0.0, self.total_seconds - self.driver_seconds),
            }

    # -- internals -----------------------------------------------------------------------------
    def _evict_if_mapped(self, slot: WeightSlot, counted: bool = True) -> None:
        if self._gate.is_capturing_thread():
            raise FailedPrecondition("never unmap inside a capture")
        if slot.state in ("pending", "resident"):
            self._evict(slot, counted)

    def _page_in(self, slot: WeightSlot, need: set[str], stream: object | None) -> float:
        self._make_room(slot, need)
        while True:
            try:
                self._arena.commit(slot.va, slot.nbytes, ZONE, role="weights")
                break
            except ResourceExhausted:
                victim = self.policy.victim(exclude=self._excluded(need))  # the ledger refused
                if victim is None:
                    raise
                self._evict(self._slots[victim])
        self.peak_committed_bytes = max(self.peak_committed_bytes,
                                        self._arena.zone_live_bytes(ZONE))
        t0 = time.perf_counter()
        try:
            if slot.event is None:
                slot.event = self._backend.create_event()
            self._backend.copy_h2d_async(slot.va, slot.host, self._copy)
            self._backend.record_event(slot.event, self._copy)
            if stream is not None:
                self._backend.stream_wait_event(stream, slot.event)
        except BaseException as exc:
            slot.state = "poisoned"
            slot.error = f"page-in copy failed: {exc}"
            self.counters["failed_page_ins"] += 1
            self._arena.decommit(slot.va, slot.nbytes, ZONE, [self._compute, self._copy])
            raise
        slot.state = "pending"
        if slot.evictable:  # the policy only ever names victims among the keys it was given
            self.policy.admit(slot.key, slot.nbytes)
        self.counters["page_ins"] += 1
        self.counters["bytes_copied"] += slot.nbytes
        return time.perf_counter() - t0

    def _make_room(self, slot: WeightSlot, need: set[str]) -> None:
        budget = self.policy.capacity_bytes
        if budget is None:
            return
        while True:
            cost = self._arena.commit_cost(slot.va, slot.nbytes)
            live = self._arena.zone_live_bytes(ZONE)
            if live + cost <= budget:
                return
            victim = self.policy.victim(exclude=self._excluded(need))
            if victim is None:
                raise ResourceExhausted(
                    f"weights: paging in {slot.key!r} needs {cost} committed bytes, "
                    f"{max(0, budget - live)} free of a {budget}-byte weight budget and every "
                    "resident weight is needed by this call or pinned by a running request",
                    asked_bytes=cost, free_bytes=max(0, budget - live), zone=ZONE)
            self._evict(self._slots[victim])

    def _excluded(self, need: set[str]) -> set[str]:
        """Keys that cannot be victims now: those this call needs and every pinned slot."""
        return need | {k for k, s in self._slots.items() if s.pins}

    def _evict(self, slot: WeightSlot, counted: bool = True) -> None:
        if slot.state not in ("pending", "resident"):  # e.g. poisoned by a failed release
            self.policy.forget(slot.key)
            return
        self._arena.decommit(slot.va, slot.nbytes, ZONE, [self._compute, self._copy])
        slot.state = "idle"
        self.policy.evicted(slot.key)
        self.counters["evictions"] += counted

    def _on_quarantine(self, va: int, nbytes: int) -> None:
        for s in self._slots.values():
            if s.va < va + nbytes and va < s.va + s.nbytes:
                s.state = "poisoned"
                s.error = f"release of {va:#x}+{nbytes} failed and was quarantined"

    def close(self) -> None:
        for key in list(self._slots):
            self.remove(key)
        self.copier.close()
