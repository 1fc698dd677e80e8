"""The VMM arena: every device byte of the worker comes from here.

Hazards and what this module does about them:
- Per-allocation granule rounding wastes up to a granule (2 MiB on H200) per allocation, ~18 % for
  offloaded weights (DESIGN 1.5). Here one VA reservation is carved at byte granularity and each
  granule carries a refcount of the allocations touching it: waste is at most the partial granules
  at the edges of live ranges.
- VMM cost is per physical handle (H200: ~70 us per 2 MiB handle all-in, ~0.3 ms for one 64 MiB
  handle). Handle size is chosen by role: weights and KV get one large handle per run of granules
  they own alone; small roles get granule handles that a bounded pool retains for reuse.
- cuMemUnmap does not wait for kernels still reading: every release goes through the fenced
  ReleaseQueue. A granule whose release is queued but not yet run is resurrected (the release is
  cancelled) when a new allocation touches it, so a page-in can never race a pending unmap at the
  same address. A release that fails is quarantined: its VA is never handed out again.
- The ledger is charged before the device is touched; a refusal or a driver failure unwinds every
  handle it created, so a failed allocation leaves nothing half-mapped and nothing booked.
- A refusal is not final while something can be given back: `alloc` and `commit` hand it to the
  `reclaimer` (the worker's one reclaim policy, gpu_worker/core/reclaim.py) and retry while it frees
  bytes. It runs outside the arena lock (it frees through this arena and takes the weight slots'
  lock), and never on a capturing thread.

Lock order: capture-gate section first, then the arena lock (the release queue runs our release
actions inside a gate section).
"""
from __future__ import annotations

import bisect
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpu_worker.device.backend import Backend, DeviceError
from gpu_worker.device.gate import CaptureGate
from gpu_worker.device.ledger import Ledger, check_zone
from gpu_worker.device.release_queue import ReleaseQueue
from services.common.errors import InvalidArgument, ResourceExhausted

ALIGN = 256  # byte alignment of every carve (CUDA's cudaMalloc alignment)
MAX_RECLAIM_ROUNDS = 8  # reclaim-and-retry rounds before a refusal reaches the caller
POOL_ZONE = "scratch"  # retained handles are paid for by the device, so they are booked somewhere


@dataclass(frozen=True, eq=False)
class Allocation:
    ptr: int
    size: int
    zone: str
    role: str = "default"


@dataclass(eq=False)
class _Mapping:
    va: int
    nbytes: int
    handle: object
    zone: str
    live: int = 0          # granules of this mapping with a non-zero refcount
    state: str = "live"    # live | releasing | gone | quarantined
    gen: int = 0           # bumps on each scheduled release, so a cancelled release is a no-op
    retain: bool = True    # its handle may go to the pool once released (set by each decommit)


@dataclass(eq=False)
class _Piece:
    va: int
    nbytes: int


class Arena:
    def __init__(
        self,
        backend: Backend,
        gate: CaptureGate,
        ledger: Ledger,
        queue: ReleaseQueue,
        fence_streams: Callable[[], list],
        reserve_bytes: int,
        handle_bytes: dict[str, int] | None = None,
        pool_bytes: int = 64 << 20,
    ) -> None:
        self._backend = backend
        self._gate = gate
        self._ledger = ledger
        self._queue = queue
        self._fence_streams = fence_streams
        self.granule = g = backend.info.granule_bytes
        self.reserved = -(-reserve_bytes // g) * g
        self.base = backend.reserve(self.reserved)
        # Large handles where ranges live and die whole; granule handles (poolable) otherwise.
        hb = {"weights": 1 << 30, "kv": 256 << 20, "plan": 64 << 20, "activations": 64 << 20,
              "workspace": 64 << 20, "default": g}
        hb.update(handle_bytes or {})
        self._handle_bytes = {r: max(g, b // g * g) for r, b in hb.items()}
        self._pool_limit = pool_bytes
        self._lock = threading.RLock()
        self._free: list[list[int]] = [[self.base, self.reserved]]  # sorted [start, size] VA ranges
        self._refs = np.zeros(self.reserved // g, dtype=np.int64)
        self._gmap: list[_Mapping | None] = [None] * (self.reserved // g)
        self._live: dict[int, Allocation] = {}
        self._pool: dict[int, list] = {}
        self._quarantined_va: list[tuple[int, int]] = []
        self._mapped_bytes = 0
        self._live_by_zone: dict[str, int] = {}  # bytes of mappings in state live, per zone
        self.on_quarantine: list[Callable[[int, int], None]] = []
        # Called with (zone, the refusal, why) after a refusal; returns the bytes it freed, or a
        # positive number when a retry is worth it (0: give up and let the refusal through).
        self.reclaimer: Callable[[str, ResourceExhausted, str], int] | None = None
        self.counters = dict.fromkeys((
            "commits", "releases", "handles_created", "handles_reused", "resurrected", "peak_committed",
            "pooled_bytes", "quarantined", "quarantined_bytes", "fault_underflow", "allocs", "frees"), 0)
        self.driver_seconds = 0.0

    # -- public API ----------------------------------------------------------------------------
    def alloc(self, nbytes: int, zone: str, role: str = "default") -> Allocation:
        """Carve and commit `nbytes` for `zone`; ResourceExhausted names zone, asked and free."""
        check_zone(zone)
        if nbytes <= 0:
            raise InvalidArgument(f"arena: allocation size must be positive, got {nbytes}")
        return self.retry_reclaiming(zone, lambda: self._alloc_once(nbytes, zone, role))

    def _alloc_once(self, nbytes: int, zone: str, role: str) -> Allocation:
        self._queue.poll()
        with self._gate.shared(), self._lock:
            ptr = self._carve(nbytes, top=role not in ("weights", "kv"))
            try:
                self._commit(ptr, nbytes, zone, role)
            except BaseException:
                self._uncarve(ptr, nbytes)
                raise
            a = Allocation(ptr, nbytes, zone, role)
            self._live[ptr] = a
            self.counters["allocs"] += 1
            return a

    def free(self, allocation: Allocation, fence_streams: list | None = None,
             retain: bool = True) -> None:
        """Release `allocation` once the fence streams (default: the device's) pass this point.
        `retain=False`: its granule handles go back to the device, not to the handle pool."""
        with self._gate.shared(), self._lock:
            if self._live.get(allocation.ptr) is not allocation:
                raise InvalidArgument(f"arena: {allocation.ptr:#x} is not a live allocation (double free?)")
            del self._live[allocation.ptr]
            self._decommit(allocation.ptr, allocation.size, allocation.zone, fence_streams, retain)
            self._uncarve(allocation.ptr, allocation.size)
            self.counters["frees"] += 1
        self._queue.poll()

    # Lower level, for weight slots: a VA range that outlives its physical pages.
    def carve(self, nbytes: int, role: str = "weights") -> int:
        if nbytes <= 0:
            raise InvalidArgument(f"arena: carve size must be positive, got {nbytes}")
        with self._lock:
            return self._carve(nbytes, top=role not in ("weights", "kv"))

    def uncarve(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._uncarve(ptr, nbytes)

    def commit(self, ptr: int, nbytes: int, zone: str, role: str = "weights") -> None:
        check_zone(zone)

        def once() -> None:
            self._queue.poll()
            with self._gate.shared(), self._lock:
                self._commit(ptr, nbytes, zone, role)
        self.retry_reclaiming(zone, once)

    def retry_reclaiming(self, zone: str, attempt: Callable[[], object], reason: str = "refusal"
                         ) -> object:
        """Run `attempt`; on ResourceExhausted ask the reclaimer and retry while it frees bytes.
        Also for bookings outside the arena (a captured graph's memory, in `graphs`)."""
        # Bounded: every round frees something, but other threads may take it again meanwhile.
        for _ in range(MAX_RECLAIM_ROUNDS):
            try:
                return attempt()
            except ResourceExhausted as exc:
                if self.reclaimer is None or self._gate.is_capturing_thread():
                    raise
                if self.reclaimer(zone, exc, reason) <= 0:
                    raise
        return attempt()

    def decommit(self, ptr: int, nbytes: int, zone: str, fence_streams: list | None = None,
                 retain: bool = True) -> None:
        """Drop a commit. `retain=False`: a granule handle it releases goes back to the device,
        not to the handle pool (a reclaim: pooled, the bytes would stay committed, in scratch)."""
        with self._gate.shared(), self._lock:
            self._decommit(ptr, nbytes, zone, fence_streams, retain)

    def commit_cost(self, ptr: int, nbytes: int) -> int:
        """Bytes a commit of [ptr, ptr+nbytes) would add to the live mappings: new granules plus
        whole mappings it would resurrect from a queued release."""
        with self._lock:
            g0, g1 = self._granules(ptr, nbytes)
            cost = 0
            seen: set[int] = set()
            for gi in range(g0, g1 + 1):
                m = self._gmap[gi]
                if m is None:
                    cost += self.granule
                elif m.state == "releasing" and id(m) not in seen:
                    seen.add(id(m))
                    cost += m.nbytes
            return cost

    def zone_live_bytes(self, zone: str) -> int:
        """Committed bytes of `zone` that are not on their way out (releases queued excluded)."""
        with self._lock:
            return self._live_by_zone.get(zone, 0)

    def _live_add(self, m: _Mapping, sign: int) -> None:
        self._live_by_zone[m.zone] = self._live_by_zone.get(m.zone, 0) + sign * m.nbytes

    def releasing_bytes(self) -> int:
        """Mapped bytes whose release is queued (fenced on a stream): what running the release
        queue would give back to the device."""
        with self._lock:
            return self._mapped_bytes - sum(self._live_by_zone.values())

    def collect(self) -> int:
        """Run the releases whose fences have passed."""
        return self._queue.poll()

    def committed_bytes(self) -> int:
        with self._lock:
            return self._committed()

    def stats(self) -> dict:
        with self._lock:
            content = sum(a.size for a in self._live.values())
            return {
                "reserved": self.reserved,
                "granule": self.granule,
                "committed": self._committed(),
                "mapped": self._mapped_bytes,
                "live_allocations": len(self._live),
                "allocation_bytes": content,
                "pending_releases": self._queue.pending(),
                "quarantined_releases": self._queue.stats.quarantined,
                "driver_seconds": self.driver_seconds,
                **self.counters,
            }

    def close(self) -> None:
        """Drain fenced releases, then unmap and release everything still held."""
        self._queue.drain()
        with self._gate.shared(), self._lock:
            for a in list(self._live.values()):
                self._decommit(a.ptr, a.size, a.zone, [])
                self._live.pop(a.ptr, None)
        self._queue.drain()
        self.release_pool()

    def release_pool(self) -> int:
        """Release every retained handle (booked in POOL_ZONE); returns the bytes given back."""
        freed = 0
        with self._gate.shared(), self._lock:
            for size, handles in self._pool.items():
                for h in handles:
                    self._drv(self._backend.release_physical, h)
                    self.counters["pooled_bytes"] -= size
                    self._ledger.uncommit(POOL_ZONE, size)
                    freed += size
            self._pool.clear()
        return freed

    # -- carve ---------------------------------------------------------------------------------
    def _carve(self, nbytes: int, top: bool) -> int:
        size = -(-nbytes // ALIGN) * ALIGN
        best = None
        for i, (start, avail) in enumerate(self._free):
            if avail >= size and (best is None or avail < self._free[best][1]
                                  or (avail == self._free[best][1] and top)):
                best = i
        if best is None:
            raise ResourceExhausted(
                f"arena: no free virtual range of {nbytes} bytes in a {self.reserved}-byte reservation",
                asked_bytes=nbytes, free_bytes=max((s for _, s in self._free), default=0), zone="")
        start, avail = self._free[best]
        if top:  # small roles from the top of a range, weights from the bottom: fewer shared granules
            ptr = start + avail - size
            ptr -= ptr % ALIGN
            self._free[best][1] = ptr - start
            tail = start + avail - (ptr + size)
            if tail:
                self._free.insert(best + 1, [ptr + size, tail])
            if self._free[best][1] == 0:
                del self._free[best]
        else:
            ptr = start
            if avail == size:
                del self._free[best]
            else:
                self._free[best] = [start + size, avail - size]
        return ptr

    def _uncarve(self, ptr: int, nbytes: int) -> None:
        size = -(-nbytes // ALIGN) * ALIGN
        for qs, qn in self._quarantined_va:  # a quarantined range is never handed out again
            if ptr < qs + qn and qs < ptr + size:
                if ptr < qs:
                    self._uncarve(ptr, qs - ptr)
                end = ptr + size
                if end > qs + qn:
                    self._uncarve(qs + qn, end - (qs + qn))
                return
        starts = [s for s, _ in self._free]
        i = bisect.bisect_left(starts, ptr)
        self._free.insert(i, [ptr, size])
        if i + 1 < len(self._free) and ptr + size == self._free[i + 1][0]:
            self._free[i][1] += self._free[i + 1][1]
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == ptr:
            self._free[i - 1][1] += self._free[i][1]
            del self._free[i]

    # -- commit / decommit ---------------------------------------------------------------------
    def _granules(self, ptr: int, nbytes: int) -> tuple[int, int]:
        if ptr < self.base or ptr + nbytes > self.base + self.reserved or nbytes <= 0:
            raise InvalidArgument(f"arena: range {ptr:#x}+{nbytes} is outside the reservation")
        return (ptr - self.base) // self.granule, (ptr + nbytes - 1 - self.base) // self.granule

    def _plan(self, ptr: int, nbytes: int, role: str) -> list[_Piece]:
        """Handles to create: edge granules alone (a neighbour may share them), interior runs in
        pieces of the role's handle size."""
        g = self.granule
        g0, g1 = self._granules(ptr, nbytes)
        max_piece = self._handle_bytes.get(role, self._handle_bytes["default"]) // g
        pieces: list[_Piece] = []
        run: list[int] = []

        def flush() -> None:
            while run:
                n = min(len(run), max_piece)
                pieces.append(_Piece(self.base + run[0] * g, n * g))
                del run[:n]

        for gi in range(g0, g1 + 1):
            m = self._gmap[gi]
            if m is not None and m.state == "quarantined":
                raise DeviceError(f"arena: granule at {self.base + gi * g:#x} is quarantined")
            if m is not None:
                flush()
                continue
            gstart = self.base + gi * g
            whole = ptr <= gstart and gstart + g <= ptr + nbytes
            if not whole:
                flush()
                pieces.append(_Piece(gstart, g))
            else:
                run.append(gi)
        flush()
        return pieces

    def _commit(self, ptr: int, nbytes: int, zone: str, role: str) -> None:
        pieces, need = self._admit(ptr, nbytes, zone, role)
        done: list[tuple[_Piece, object]] = []
        try:
            for p in pieces:
                handle = self._take_handle(p.nbytes)
                try:
                    self._drv(self._backend.map, p.va, handle, p.nbytes)
                except BaseException:
                    self._drv(self._backend.release_physical, handle)
                    raise
                done.append((p, handle))
        except BaseException as exc:
            for p, handle in done:  # never touched by a kernel yet: no fence needed
                self._drv(self._backend.unmap, p.va, p.nbytes)
                self._drv(self._backend.release_physical, handle)
            self._ledger.uncommit(zone, need)
            if isinstance(exc, DeviceError) and "OUT_OF_MEMORY" in str(exc):
                free, _ = self._backend.mem_get_info()
                raise ResourceExhausted(
                    f"device out of memory committing {need} bytes for zone {zone} ({exc})",
                    asked_bytes=need, free_bytes=free, zone=zone) from exc
            raise
        for p, handle in done:
            m = _Mapping(p.va, p.nbytes, handle, zone)
            gi = (p.va - self.base) // self.granule
            for k in range(gi, gi + p.nbytes // self.granule):
                self._gmap[k] = m
            self._mapped_bytes += p.nbytes
            self._live_add(m, +1)
            self.counters["commits"] += 1
        self.counters["peak_committed"] = max(self.counters["peak_committed"], self._committed())
        g0, g1 = self._granules(ptr, nbytes)
        for gi in range(g0, g1 + 1):
            self._refs[gi] += 1
            if self._refs[gi] == 1:
                m = self._gmap[gi]
                if m.state == "releasing":  # a queued release not yet run: cancel it
                    m.state = "live"
                    m.gen += 1
                    self._live_add(m, +1)
                    self.counters["resurrected"] += 1
                m.live += 1
        self._ledger.add_content(zone, nbytes)

    def _admit(self, ptr: int, nbytes: int, zone: str, role: str) -> tuple[list[_Piece], int]:
        """Plan the handles and book them; on refusal, run fenced releases once and re-plan."""
        for attempt in (0, 1):
            pieces = self._plan(ptr, nbytes, role)
            need = sum(p.nbytes for p in pieces)
            try:
                self._ledger.commit(zone, need)
                return pieces, need
            except ResourceExhausted as exc:
                if attempt == 0 and self._reclaim():
                    continue
                raise ResourceExhausted(
                    f"arena: zone {zone} asked {nbytes} bytes ({need} committed granule bytes), "
                    f"{exc.free_bytes} free: {exc.message}",
                    asked_bytes=need, free_bytes=exc.free_bytes, zone=zone,
                    violations=exc.violations, reclaimable=exc.reclaimable) from exc
        raise AssertionError("unreachable")

    def _reclaim(self) -> bool:
        """Complete queued releases (fence waits are per event, never device-wide)."""
        if self._gate.is_capturing_thread():
            return False
        ran = self._queue.poll()
        if self._queue.pending():
            ran += self._queue.drain()
        return ran > 0

    def _committed(self) -> int:
        return self._mapped_bytes + self.counters["pooled_bytes"] + self.counters["quarantined_bytes"]

    def _take_handle(self, nbytes: int) -> object:
        handles = self._pool.get(nbytes)
        if handles:
            h = handles.pop()
            self.counters["pooled_bytes"] -= nbytes
            self.counters["handles_reused"] += 1
            self._ledger.uncommit(POOL_ZONE, nbytes)
            return h
        self.counters["handles_created"] += 1
        return self._drv(self._backend.create_physical, nbytes)

    def _decommit(self, ptr: int, nbytes: int, zone: str, fence_streams: list | None,
                  retain: bool = True) -> None:
        g0, g1 = self._granules(ptr, nbytes)
        dying: list[_Mapping] = []
        for gi in range(g0, g1 + 1):
            if self._refs[gi] <= 0:
                self.counters["fault_underflow"] += 1
                continue
            self._refs[gi] -= 1
            if self._refs[gi] == 0:
                m = self._gmap[gi]
                m.live -= 1
                if m.live == 0:
                    dying.append(m)
        self._ledger.remove_content(zone, nbytes)
        streams = self._fence_streams() if fence_streams is None else fence_streams
        for m in dying:
            m.state = "releasing"
            m.retain = retain
            m.gen += 1
            self._live_add(m, -1)
            self._queue.defer(streams, functools.partial(self._finish_release, m, m.gen),
                              what=f"unmap {m.va:#x}+{m.nbytes} ({m.zone})")

    def _finish_release(self, m: _Mapping, gen: int) -> None:
        with self._lock:
            if m.state != "releasing" or m.gen != gen:
                return  # resurrected by a newer commit
            try:
                self._drv(self._backend.unmap, m.va, m.nbytes)
            except BaseException:
                m.state = "quarantined"
                self._quarantine_va(m.va, m.nbytes)
                for hook in self.on_quarantine:
                    hook(m.va, m.nbytes)
                raise
            m.state = "gone"
            gi = (m.va - self.base) // self.granule
            for k in range(gi, gi + m.nbytes // self.granule):
                if self._gmap[k] is m:
                    self._gmap[k] = None
            self._mapped_bytes -= m.nbytes
            self.counters["releases"] += 1
            if m.retain and self._pool_handle(m):
                self._ledger.uncommit(m.zone, m.nbytes)
                return
            try:
                self._drv(self._backend.release_physical, m.handle)
            except BaseException:
                # The device still pays for the handle: keep it booked, count it, never reuse it.
                self.counters["quarantined"] += 1
                self.counters["quarantined_bytes"] += m.nbytes
                raise
            self._ledger.uncommit(m.zone, m.nbytes)

    def _pool_handle(self, m: _Mapping) -> bool:
        if m.nbytes != self.granule or self.counters["pooled_bytes"] + m.nbytes > self._pool_limit:
            return False
        try:
            self._ledger.commit(POOL_ZONE, m.nbytes)
        except ResourceExhausted:
            return False
        self._pool.setdefault(m.nbytes, []).append(m.handle)
        self.counters["pooled_bytes"] += m.nbytes
        return True

    def _quarantine_va(self, va: int, nbytes: int) -> None:
        self.counters["quarantined"] += 1
        self._quarantined_va.append((va, nbytes))
        out: list[list[int]] = []
        for s, n in self._free:  # cut the quarantined range out of the free list
            if s + n <= va or va + nbytes <= s:
                out.append([s, n])
                continue
            if s < va:
                out.append([s, va - s])
            if s + n > va + nbytes:
                out.append([va + nbytes, s + n - (va + nbytes)])
        self._free = out

    def _drv(self, fn: Callable, *args: object) -> object:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.driver_seconds += time.perf_counter() - t0
