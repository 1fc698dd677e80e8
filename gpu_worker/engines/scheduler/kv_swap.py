"""The KV tier in pinned host memory: a preempted sequence's KV blocks are copied to pinned host
and back before it resumes, instead of being recomputed, when the copies cost less than the
prefill (DESIGN 6.3; the rule: docs/scheduler.md, "KV swap to pinned host").

Hazard: a block's bytes are read and written by the device asynchronously. A swap-out copy that
runs after the block was handed to another sequence copies the other sequence's K/V; a host
slot reused while its copy is still queued corrupts the K/V it holds; an unbounded host tier
takes the host's memory; pinning and freeing host memory on the engine thread put the host on
the step path (pinned_slab.py).
Contract:
- Every copy goes on the device's compute stream, the stream every step of every decoder runs
  on (`device.stream`). A swap-out is queued after the steps that wrote the blocks (launched
  before the preemption) and before any step that writes them again, so the host frees the
  blocks at once, as after a recompute preemption. A swap-in is queued before the step that
  reads the blocks. No cross-stream event and no host wait on the step path.
- A block is `geometry.block_bytes` contiguous bytes of the pool (every layer, K and V), and a
  host slot of the decoder's `PinnedSlab` (pinned_slab.py) holds one block, so a run of
  consecutive blocks into consecutive slots of one chunk is one copy each way.
- A slot goes back to the slab's free list only after an event recorded behind its last copy
  has passed (`collect`; `collect(wait=True)` waits, at idle and close). The slab pins whole
  chunks when a copy out finds too few free slots and keeps them while the decoder is busy; it
  frees chunks with no slot out at idle (down to those kept for demotions) and at close.
- Every host byte is booked in the worker's `HostKVBudget` (`--kv-swap-host-bytes`): the
  slab's chunks, from before they are pinned until they are freed. A swap that does not fit
  (this decoder's free slots plus the budget's free bytes, after the other decoders' idle
  chunks) is refused before anything is booked (the scheduler recomputes instead).
Cost: no pinned allocation once the slab holds the decoder's peak (one per chunk before, ~30 ms
for 64 MiB on the H200 host), no free on the step path, one async copy per run of contiguous
blocks and slots each way, bytes over the measured pinned copy rates.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.device.backend import DeviceError
from gpu_worker.engines.scheduler.pinned_slab import CHUNK_SLOTS, PinnedSlab
from services.common.errors import InvalidArgument, ResourceExhausted

PROBE_BYTES = 8 << 20       # what the load-time copy-rate probe moves each way (~160 us on H200)
READY_BLOCKS = 32           # free slots pinned ahead per demoting decoder (64 MiB at 2 MiB blocks)


class SwapFailed(RuntimeError):
    """A swap copy could not be queued (pinned allocation or copy refused by the device)."""


class HostKVBudget:
    """Pinned host bytes all decoders' swapped KV and demoted prefix blocks (kv_demote.py) may
    hold (0: none; the tier is off). Thread-safe: every decoder's engine thread books here."""

    def __init__(self, limit_bytes: int) -> None:
        if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes < 0:
            raise InvalidArgument(f"kv swap host bytes must be an integer >= 0 (0: no swap), "
                                  f"got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._in_use

    def available(self) -> int:
        """Bytes that could be booked now."""
        with self._lock:
            return self.limit_bytes - self._in_use

    def take(self, nbytes: int) -> bool:
        """Book `nbytes`; False (nothing booked) when they do not fit the limit."""
        with self._lock:
            if self._in_use + nbytes > self.limit_bytes:
                return False
            self._in_use += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self._in_use:
                raise InvalidArgument(f"kv swap: giving back {nbytes} host bytes, only "
                                      f"{self._in_use} are booked")
            self._in_use -= nbytes


@dataclass(frozen=True)
class CopyRates:
    """Pinned copy rates of the device, bytes per second each way, and where they come from
    ("measured": `measure_copy_rates` at load; "configured": `--kv-swap-copy-rate`)."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise InvalidArgument(f"kv swap copy rate {name}={value} must be a finite "
                                      "positive number of bytes per second")

    def round_trip_s(self, nbytes: int) -> float:
        """Seconds to copy `nbytes` out to host and back."""
        return nbytes / self.d2h_bytes_per_s + nbytes / self.h2d_bytes_per_s


def swap_is_cheaper(nbytes: int, positions: int, rates: CopyRates,
                    prefill_tokens_per_s: float | None) -> bool:
    """The rule: swap when nbytes / d2h + nbytes / h2d < positions / prefill rate (the prefill a
    recompute runs again). Without a prefill rate (none measured yet, none configured): recompute."""
    if positions < 1 or not prefill_tokens_per_s or prefill_tokens_per_s <= 0:
        return False
    return rates.round_trip_s(nbytes) < positions / prefill_tokens_per_s


def measure_copy_rates(device, nbytes: int = PROBE_BYTES) -> CopyRates:
    """Time one pinned D2H and one H2D of `nbytes` on the device's stream with timing events
    (a warm-up round first), through a temporary `kv` allocation. At load: it synchronizes the
    stream (never the device)."""
    alloc = device.arena.alloc(nbytes, "kv")
    host = device.alloc_pinned(nbytes)
    events = [device.create_event(timing=True) for _ in range(3)]
    try:
        for _ in range(2):
            device.record_event(events[0])
            device.copy_from_device_async(host, alloc.ptr)
            device.record_event(events[1])
            device.copy_to_device_async(alloc.ptr, host)
            device.record_event(events[2])
            device.wait_event(events[2])
        d2h = max(device.event_elapsed_s(events[0], events[1]), 1e-9)
        h2d = max(device.event_elapsed_s(events[1], events[2]), 1e-9)
    finally:
        device.synchronize(device.stream)
        for event in events:
            device.destroy_event(event)
        device.free_pinned(host)
        device.arena.free(alloc)
        device.synchronize(device.stream)     # runs the fenced release of the probe's pages
    return CopyRates(nbytes / h2d, nbytes / d2h, "measured")


@dataclass(eq=False)
class SwappedKV:
    """One sequence's blocks on the host: `blocks` blocks holding positions [0, positions), in
    the slab's `slots` (block i in slots[i])."""

    slots: list[int]
    blocks: int
    positions: int
    nbytes: int
    event: object           # recorded behind the slots' last queued copy
    released: bool = False


class KVSwap:
    """Block copies between one decoder's KV pool and its pinned slab, booked in a HostKVBudget.
    Engine-thread only (or a reclaimer holding the model's lock), like the pool."""

    def __init__(self, device, pool, budget: HostKVBudget, rates: CopyRates,
                 ready_blocks: int = 0, chunk_slots: int = CHUNK_SLOTS,
                 reclaim: Callable[[PinnedSlab, int], int] | None = None) -> None:
        """`ready_blocks`: free slots the slab keeps pinned ahead on its own thread, from now on
        (the runtime, when the decoder demotes: READY_BLOCKS); 0: none ahead, a copy out that
        finds too few free slots grows the slab on the caller's thread (deterministic: the
        scheduler tests). `reclaim`: the tier's hook that frees other decoders' idle chunks
        when the budget is short (HostKVTier)."""
        self.device, self.pool, self.budget, self.rates = device, pool, budget, rates
        self.block_bytes = pool.block_bytes
        self.slab = PinnedSlab(device, pool.block_bytes, budget, chunk_slots=chunk_slots,
                               keep=ready_blocks, reclaim=reclaim)
        if ready_blocks:
            self.slab.start()                    # ready before the first demotion
        self._retired: list[SwappedKV] = []       # released, copies maybe still queued
        self._events: list[object] = []           # spare events
        self.swap_seconds = 0.0                   # host time queueing swaps (slab growth too)

    def _event(self) -> object:
        return self._events.pop() if self._events else self.device.create_event()

    def _copy(self, blocks: list[int], slots: list[int], out: bool, event: object) -> None:
        """Queue the copies, then `event`, inside a gate section: never while another
        thread captures on the stream (the copies would join its graph)."""
        bb, base = self.block_bytes, self.pool.base
        with self.device.gate.shared():
            for first_block, first_slot, n in _runs(blocks, slots, self.slab.same_chunk):
                view = self.slab.view(first_slot, n)
                if out:
                    self.device.copy_from_device_async(view, base + first_block * bb)
                else:
                    self.device.copy_to_device_async(base + first_block * bb, view)
            self.device.record_event(event)

    @property
    def host_bytes(self) -> int:
        """Host bytes this decoder books: its slab's chunks (swapped, demoted and free slots)."""
        return self.slab.nbytes

    @property
    def spare_bytes(self) -> int:
        """Booked bytes of free slots."""
        return self.slab.free_bytes

    def available(self) -> int:
        """Host bytes a copy out could have now: the budget's free bytes plus this decoder's
        free slots (booked already)."""
        return self.budget.available() + self.slab.free_bytes

    def swap_out(self, blocks: list[int], positions: int,
                 allocate: bool = True) -> SwappedKV | None:
        """Queue the copy of `blocks` (a table's leading blocks, holding positions
        [0, positions)) into free slots of the slab, growing it when too few are free; None
        when the host budget refuses (nothing booked), or with `allocate=False` (never pin on
        this thread) when too few are free. SwapFailed when the device refuses (the slots, if
        any were taken, go back)."""
        if not blocks:
            return None
        t = time.perf_counter()
        try:
            slots = self.slab.take(len(blocks), grow=allocate)
        except DeviceError as exc:
            raise SwapFailed(f"pinned host allocation for {len(blocks)} KV blocks "
                             f"({len(blocks) * self.block_bytes} bytes): {exc}") from exc
        if slots is None:
            return None
        rec = SwappedKV(slots, len(blocks), positions, len(blocks) * self.block_bytes,
                        self._event())
        try:
            self._copy(blocks, slots, True, rec.event)
        except DeviceError as exc:
            self.release(rec, fenced=False)
            raise SwapFailed(f"swap-out copy of {len(blocks)} KV blocks: {exc}") from exc
        self.swap_seconds += time.perf_counter() - t
        return rec

    def pins_ahead(self) -> bool:
        """Whether free slots are pinned ahead in the background (else on demand)."""
        return self.slab.keep > 0

    def swap_in(self, rec: SwappedKV, blocks: list[int]) -> None:
        """Queue the copy of `rec` into `blocks` (fresh, `rec.blocks` of them) before the next
        step; `rec` is released either way (its slots freed once the copy ran). SwapFailed
        when the device refuses: the blocks' contents are then undefined (the caller frees
        them and recomputes)."""
        if len(blocks) != rec.blocks or rec.released:
            raise InvalidArgument(f"kv swap-in of {rec.blocks} blocks into {len(blocks)} "
                                  f"(released: {rec.released})")
        t = time.perf_counter()
        try:
            self._copy(blocks, rec.slots, False, rec.event)
        except DeviceError as exc:
            self.release(rec, fenced=False)
            raise SwapFailed(f"swap-in copy of {rec.blocks} KV blocks: {exc}") from exc
        self.release(rec)
        self.swap_seconds += time.perf_counter() - t

    def release(self, rec: SwappedKV, fenced: bool = True) -> None:
        """The host copy is no longer needed (swapped in, cancelled, or given up): its slots
        go back to the free list once its last copy ran. `fenced=False`: a copy failed to
        queue, so the event may not be behind it: the stream is synchronized first."""
        if rec.released:
            return
        rec.released = True
        if not fenced:
            with contextlib.suppress(DeviceError):
                self.device.synchronize(self.device.stream)
            self._events.append(rec.event)      # re-armed by its next record
            rec.event = None
        self._retired.append(rec)
        with contextlib.suppress(SwapFailed):   # a lost context: the slots stay out
            self.collect()

    def collect(self, wait: bool = False) -> int:
        """Give the released records' slots back to the free list once their copies ran; with
        `wait` (idle, close) wait for every copy first, then free the slab's chunks that hold
        no slot, down to the free slots kept for demotions. Returns the host bytes given back
        to the budget (0 without `wait`: a give never frees). SwapFailed when the device fails
        the wait or a free (a lost context): those slots and chunks stay booked, as they may
        still be copied into."""
        keep = []
        for i, rec in enumerate(self._retired):
            try:
                if rec.event is not None and not self.device.event_done(rec.event):
                    if not wait:
                        keep.append(rec)
                        continue
                    self.device.wait_event(rec.event)
            except DeviceError as exc:
                self._retired = keep + self._retired[i:]
                raise SwapFailed(f"a KV swap copy could not be waited for ({exc}): "
                                 f"{self.host_bytes} host bytes stay booked") from exc
            self.slab.give(rec.slots)
            if rec.event is not None:
                self._events.append(rec.event)
        self._retired = keep
        if not wait:
            return 0
        try:
            return self.slab.trim(self.slab.keep)
        except DeviceError as exc:
            raise SwapFailed(f"a pinned KV chunk could not be freed ({exc})") from exc

    def close(self) -> None:
        """Wait for every released record's copy, free the slab, destroy the spare events."""
        self.collect(wait=True)
        try:
            self.slab.close()
        except DeviceError as exc:
            raise SwapFailed(f"a pinned KV chunk could not be freed ({exc})") from exc
        for event in self._events:
            self.device.destroy_event(event)
        self._events.clear()


def _runs(blocks: list[int], slots: list[int],
          same_chunk: Callable[[int, int], bool]) -> list[tuple[int, int, int]]:
    """(first block, first slot, count) for each run of consecutive block ids copied to (or
    from) consecutive slots of one chunk: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for b, s in zip(blocks, slots, strict=True):
        if runs:
            fb, fs, n = runs[-1]
            if fb + n == b and fs + n == s and same_chunk(fs, s):
                runs[-1] = (fb, fs, n + 1)
                continue
        runs.append((b, s, 1))
    return runs


class HostKVTier:
    """The worker's host KV tier: one pinned host budget and one set of copy rates for every
    decoder (configured, or measured once, at the first decoder's load), and the decoders'
    slabs, so that a swap the budget cannot hold first takes the others' idle chunks."""

    def __init__(self, budget: HostKVBudget, copy_rate: float = 0.0) -> None:
        self.budget = budget
        self._rates = CopyRates(copy_rate, copy_rate, "configured") if copy_rate else None
        self._lock = threading.Lock()
        self._slabs: weakref.WeakSet[PinnedSlab] = weakref.WeakSet()

    def rates(self, device) -> CopyRates:
        with self._lock:
            if self._rates is None:
                self._rates = measure_copy_rates(device)
            return self._rates

    def reclaim(self, asking: PinnedSlab, nbytes: int) -> int:
        """Free other decoders' chunks that hold no slot (beyond the free slots each keeps for
        its demotions) until `nbytes` went; returns the bytes freed. On the asking decoder's
        engine thread, before it refuses a swap: a free synchronizes the context, which is
        cheaper than the recompute a refusal costs."""
        with self._lock:
            others = [s for s in self._slabs if s is not asking]
        freed = 0
        for slab in others:
            if freed >= nbytes:
                break
            with contextlib.suppress(DeviceError):      # that chunk stays, booked
                freed += slab.trim(slab.keep, need_bytes=nbytes - freed)
        return freed

    def swap_for(self, device, pool, demotes: bool = True) -> KVSwap | None:
        """The block copier of one decoder's pool, booking in this tier's budget; None when the
        rates are not known and the probe's device bytes cannot be committed (that decoder
        then recomputes; its stats say `kv_swap` 0; the next load probes again). `demotes`:
        the decoder demotes cached prefix blocks, so READY_BLOCKS free slots are pinned ahead
        for them from now on (else none: a swap-out grows the slab itself)."""
        try:
            rates = self.rates(device)
        except ResourceExhausted:
            return None
        swap = KVSwap(device, pool, self.budget, rates,
                      ready_blocks=READY_BLOCKS if demotes else 0, reclaim=self.reclaim)
        with self._lock:
            self._slabs.add(swap.slab)
        return swap
