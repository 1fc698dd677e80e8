"""The KV tier in pinned host memory: a preempted sequence's KV blocks are copied to pinned host
and back before it resumes, instead of being recomputed, when the copies cost less than the
prefill (DESIGN 6.3; the rule: docs/scheduler.md, "KV swap to pinned host").

Hazard: a block's bytes are read and written by the device asynchronously. A swap-out copy that
runs after the block was handed to another sequence copies the other sequence's K/V; a host
buffer freed (or reused) while its copy is still queued corrupts pinned memory; an unbounded
host tier takes the host's memory.
Contract:
- Every copy goes on the device's compute stream, the stream every step of every decoder runs
  on (`device.stream`). A swap-out is queued after the steps that wrote the blocks (launched
  before the preemption) and before any step that writes them again, so the host frees the
  blocks at once, as after a recompute preemption. A swap-in is queued before the step that
  reads the blocks. No cross-stream event and no host wait on the step path.
- A block is `geometry.block_bytes` contiguous bytes of the pool (every layer, K and V), so a
  run of consecutive blocks is one copy each way.
- A host buffer is freed only after an event recorded behind its last copy has passed
  (`collect`; `collect(wait=True)` waits, at idle and close). One-block buffers come from
  `PinnedBlocks` (pinned_blocks.py): pinned ahead of need on a thread of its own, and a
  one-block buffer whose copies ran goes back there (still booked) instead of being freed.
  Cached-prefix demotions (kv_demote.py) copy out one block per evicted cached block, hundreds
  a second under pool pressure: a cuMemHostAlloc (~1 ms per 2 MiB on the H200 host) and a
  synchronizing cuMemFreeHost per block on the engine thread put the host on the step path.
- Every host byte is booked in the worker's `HostKVBudget` (`--kv-swap-host-bytes`) from the
  swap-out until its buffer is freed; a swap that does not fit is refused before anything is
  allocated (the scheduler recomputes instead).
Cost: one pinned allocation per swap-out of more than one block (a swap is a preemption: rare),
none on the engine thread for a one-block copy out when PinnedBlocks refills in the background,
one async copy per run of contiguous blocks each way, bytes over the measured pinned copy rates.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import numpy as np

from gpu_worker.device.backend import DeviceError
from gpu_worker.engines.scheduler.pinned_blocks import PinnedBlocks
from services.common.errors import InvalidArgument, ResourceExhausted

PROBE_BYTES = 8 << 20       # what the load-time copy-rate probe moves each way (~160 us on H200)
READY_BLOCKS = 32           # one-block buffers pinned ahead per decoder (64 MiB at 2 MiB blocks)
SPARE_BLOCKS = 64           # one-block buffers kept for reuse per decoder, at most


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
    """One sequence's blocks on the host: `blocks` blocks holding positions [0, positions)."""

    host: np.ndarray        # the pinned buffer (as allocated: freed as a whole)
    blocks: int
    positions: int
    nbytes: int
    event: object           # recorded behind the buffer's last queued copy
    released: bool = False


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(index in `blocks`, first block, count) for each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


class KVSwap:
    """Block copies between one decoder's KV pool and pinned host, booked in a HostKVBudget.
    Engine-thread only (or a reclaimer holding the model's lock), like the pool."""

    def __init__(self, device, pool, budget: HostKVBudget, rates: CopyRates,
                 ready_blocks: int = 0) -> None:
        """`ready_blocks`: one-block buffers PinnedBlocks keeps pinned ahead on its own thread,
        from now on (the runtime, when the decoder demotes: READY_BLOCKS); 0: none ahead, a one-block copy out that finds no spare
        pins its buffer on the caller's thread (deterministic: the scheduler tests)."""
        self.device, self.pool, self.budget, self.rates = device, pool, budget, rates
        self.block_bytes = pool.block_bytes
        self._held = 0                            # booked by buffers in use or retired
        self._retired: list[SwappedKV] = []       # released, copies maybe still queued
        self.blocks = PinnedBlocks(device, pool.block_bytes, budget, keep=ready_blocks,
                                   cap=max(SPARE_BLOCKS, ready_blocks))
        if ready_blocks:
            self.blocks.start()                  # ready before the first demotion
        self.spare_reuses = 0                     # one-block copies out that allocated nothing
        self._events: list[object] = []           # spare events
        self.swap_seconds = 0.0                   # host time queueing swaps (pinned allocs too)

    def _event(self) -> object:
        return self._events.pop() if self._events else self.device.create_event()

    def _copy(self, blocks: list[int], host: np.ndarray, out: bool, event: object) -> None:
        """Queue the copies, then `event`, inside a gate section: never while another
        thread captures on the stream (the copies would join its graph)."""
        bb, base = self.block_bytes, self.pool.base
        with self.device.gate.shared():
            for index, first, n in _runs(blocks):
                view = host[index * bb:(index + n) * bb]
                if out:
                    self.device.copy_from_device_async(view, base + first * bb)
                else:
                    self.device.copy_to_device_async(base + first * bb, view)
            self.device.record_event(event)

    @property
    def host_bytes(self) -> int:
        """Host bytes this decoder books: its swapped and demoted buffers and its ready ones."""
        return self._held + self.blocks.nbytes

    @property
    def spare_bytes(self) -> int:
        return self.blocks.nbytes

    def available(self) -> int:
        """Host bytes a copy out could have now: the budget's free bytes plus this decoder's
        ready buffers (booked already; a one-block copy takes one, a larger one frees them)."""
        return self.budget.available() + self.blocks.nbytes

    def _book(self, nbytes: int) -> bool:
        if self.budget.take(nbytes):
            return True
        if self.blocks.nbytes and self.available() >= nbytes:
            self.blocks.free_all()       # booked bytes this copy can use instead
            return self.budget.take(nbytes)
        return False

    def free_spares(self) -> int:
        """Free every ready buffer and give its bytes back; returns them."""
        try:
            return self.blocks.free_all()
        except DeviceError as exc:
            raise SwapFailed(f"a spare pinned KV buffer could not be freed ({exc})") from exc

    def swap_out(self, blocks: list[int], positions: int,
                 allocate: bool = True) -> SwappedKV | None:
        """Queue the copy of `blocks` (a table's leading blocks, holding positions
        [0, positions)) to a pinned buffer (a ready one for one block, else a new one); None
        when the host budget refuses it (nothing booked), or for one block with
        `allocate=False` when none is ready. SwapFailed when the device refuses (nothing left
        booked)."""
        nbytes = len(blocks) * self.block_bytes
        if not blocks:
            return None
        t = time.perf_counter()
        host = self.blocks.take() if len(blocks) == 1 else None
        if host is not None:
            self._held += nbytes                 # booked since it was pinned
            self.spare_reuses += 1
        else:
            if not allocate or not self._book(nbytes):
                return None
            self._held += nbytes
            try:
                host = self.device.alloc_pinned(nbytes)
            except DeviceError as exc:
                self._held -= nbytes
                self.budget.give(nbytes)
                raise SwapFailed(f"pinned host allocation of {nbytes} bytes: {exc}") from exc
        rec = SwappedKV(host, len(blocks), positions, nbytes, self._event())
        try:
            self._copy(blocks, host, True, rec.event)
        except DeviceError as exc:
            self.release(rec, fenced=False)
            raise SwapFailed(f"swap-out copy of {len(blocks)} KV blocks: {exc}") from exc
        self.swap_seconds += time.perf_counter() - t
        return rec

    def pins_ahead(self) -> bool:
        """Whether one-block buffers are pinned ahead in the background (else on demand)."""
        return self.blocks.keep > 0

    def swap_in(self, rec: SwappedKV, blocks: list[int]) -> None:
        """Queue the copy of `rec` into `blocks` (fresh, `rec.blocks` of them) before the next
        step; `rec` is released either way (its buffer freed once the copy ran). SwapFailed
        when the device refuses: the blocks' contents are then undefined (the caller frees
        them and recomputes)."""
        if len(blocks) != rec.blocks or rec.released:
            raise InvalidArgument(f"kv swap-in of {rec.blocks} blocks into {len(blocks)} "
                                  f"(released: {rec.released})")
        t = time.perf_counter()
        try:
            self._copy(blocks, rec.host, False, rec.event)
        except DeviceError as exc:
            self.release(rec, fenced=False)
            raise SwapFailed(f"swap-in copy of {rec.blocks} KV blocks: {exc}") from exc
        self.release(rec)
        self.swap_seconds += time.perf_counter() - t

    def release(self, rec: SwappedKV, fenced: bool = True) -> None:
        """The host copy is no longer needed (swapped in, cancelled, or given up): its buffer
        is freed, and its bytes given back, once its last copy ran. `fenced=False`: a copy
        failed to queue, so the event may not be behind it: the stream is synchronized first."""
        if rec.released:
            return
        rec.released = True
        if not fenced:
            with contextlib.suppress(DeviceError):
                self.device.synchronize(self.device.stream)
            self._events.append(rec.event)      # re-armed by its next record
            rec.event = None
        self._retired.append(rec)
        with contextlib.suppress(SwapFailed):   # a lost context: the bytes stay booked
            self.collect()

    def collect(self, wait: bool = False) -> int:
        """Free the released buffers whose copies ran, or give them back to `blocks` (one-block
        ones, up to SPARE_BLOCKS ready: still booked); with `wait` (idle, close) wait for every
        copy and free every buffer, the ready ones down to those pinned ahead. Returns the host
        bytes given back. SwapFailed when the device fails the wait or the
        free (a lost context): those buffers stay booked, as they may still be copied into."""
        freed, keep = 0, []
        for i, rec in enumerate(self._retired):
            try:
                if rec.event is not None and not self.device.event_done(rec.event):
                    if not wait:
                        keep.append(rec)
                        continue
                    self.device.wait_event(rec.event)
                if not wait and rec.blocks == 1 and self.blocks.give(rec.host):
                    self._held -= rec.nbytes         # still booked, as a ready buffer
                    if rec.event is not None:
                        self._events.append(rec.event)
                    continue
                self.device.free_pinned(rec.host)
            except DeviceError as exc:
                self._retired = keep + self._retired[i:]
                raise SwapFailed(f"pinned KV buffers could not be freed ({exc}): "
                                 f"{self.host_bytes} host bytes stay booked") from exc
            if rec.event is not None:
                self._events.append(rec.event)
            self._held -= rec.nbytes
            self.budget.give(rec.nbytes)
            freed += rec.nbytes
        self._retired = keep
        return freed + (self._trim_spares() if wait else 0)

    def _trim_spares(self) -> int:
        """At idle: ready buffers down to those pinned ahead (`blocks.keep`: 0 in the tests)."""
        try:
            return self.blocks.trim(self.blocks.keep)
        except DeviceError as exc:
            raise SwapFailed(f"a spare pinned KV buffer could not be freed ({exc})") from exc

    def close(self) -> None:
        """Wait for every released buffer's copy, free it and the spares, destroy the spare
        events."""
        self.collect(wait=True)
        self.blocks.close()               # frees the ones pinned ahead too
        for event in self._events:
            self.device.destroy_event(event)
        self._events.clear()


class HostKVTier:
    """The worker's host KV tier: one pinned host budget and one set of copy rates for every
    decoder (configured, or measured once, at the first decoder's load)."""

    def __init__(self, budget: HostKVBudget, copy_rate: float = 0.0) -> None:
        self.budget = budget
        self._rates = CopyRates(copy_rate, copy_rate, "configured") if copy_rate else None
        self._lock = threading.Lock()

    def rates(self, device) -> CopyRates:
        with self._lock:
            if self._rates is None:
                self._rates = measure_copy_rates(device)
            return self._rates

    def swap_for(self, device, pool, demotes: bool = True) -> KVSwap | None:
        """The block copier of one decoder's pool, booking in this tier's budget; None when the
        rates are not known and the probe's device bytes cannot be committed (that decoder
        then recomputes; its stats say `kv_swap` 0; the next load probes again). `demotes`:
        the decoder demotes cached prefix blocks, so READY_BLOCKS one-block buffers are pinned
        ahead for them from now on (else none: a swap-out pins its own)."""
        try:
            rates = self.rates(device)
        except ResourceExhausted:
            return None
        return KVSwap(device, pool, self.budget, rates,
                      ready_blocks=READY_BLOCKS if demotes else 0)
