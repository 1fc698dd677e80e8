"""The host KV tier's pinned memory: a few large pinned chunks carved into KV-block slots, with a
free list (kv_swap.py hands the slots to swapped sequences and demoted prefix blocks).

Hazard: pinning is slow and freeing synchronizes. cuMemHostAlloc locks every page (~1 ms per
2 MiB on the H200 host) and cuMemFreeHost synchronizes the context. A buffer pinned per swap-out
(blocks x block_bytes) and freed once its swap-in ran put both on the engine thread, on the step
path (kv_swap_bench's swap side on the H200, 2026-12-03 at 53b7190: 0.84x the recompute side's
tok/s, 2.5 ms more engine-thread time a step).
Contract:
- Memory comes in chunks of at most `chunk_slots` slots of `slot_bytes` each. A slot id names one
  slot for its chunk's life; `take(n)` hands out n free slots, lowest ids first (a fresh slab
  gives one run, one copy), or None; a slot is never handed out twice (`give` of a slot that is
  not out raises). The caller gives a slot back only once every copy into or out of it ran.
- Every chunk's bytes are booked in the budget (HostKVBudget) before it is pinned and given back
  after it is freed: `nbytes` is what this slab books, so the budget bounds it. A take that
  finds too few free slots grows the slab by whole chunks (the last cut to what the budget
  holds); when the budget cannot hold the missing slots, even after `reclaim` (the other
  decoders' free chunks, `HostKVTier`), nothing is booked and the take is refused: the rule the
  per-swap buffers had (free budget + this decoder's spare bytes >= the swap's bytes).
- A chunk is freed only when no slot of it is out, and only by `trim` (the decoder idle, close,
  or another decoder's refused growth through `reclaim`): a give never frees, so a busy decoder
  pins nothing once its slab reached its peak, and frees nothing on the step path.
- With `keep` > 0 a thread of its own grows the slab ahead so that `keep` slots are free (from
  `start`, and after each take): `take(n, grow=False)` never pins on the caller's thread. Idle
  trims down to `keep` free slots, never below (no free-then-pin churn between bursts).
Cost: a take or give is a lock and O(n log slots) heap work; a growth is one cuMemHostAlloc per
chunk (64 MiB at 8b-int4's 2 MiB blocks: ~30 ms of the H200 host), once per chunk while busy.
Free slots stay booked while the decoder is busy: its peak, bounded by the budget.
"""
from __future__ import annotations

import bisect
import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpu_worker.device.backend import DeviceError

CHUNK_SLOTS = 32            # slots a chunk holds at most (64 MiB at 2 MiB blocks)


@dataclass(eq=False)
class _Chunk:
    host: np.ndarray        # the pinned allocation, freed as a whole
    first: int              # its first slot id; its slots are first .. first + slots - 1
    slots: int
    out: int = 0            # slots handed out now


class PinnedSlab:
    """Slots of `slot_bytes` in pinned chunks booked in `budget`; see the module note."""

    def __init__(self, device, slot_bytes: int, budget, chunk_slots: int = CHUNK_SLOTS,
                 keep: int = 0, reclaim: Callable[[PinnedSlab, int], int] | None = None) -> None:
        if slot_bytes < 1 or chunk_slots < 1 or keep < 0:
            raise ValueError(f"PinnedSlab: need slot_bytes ({slot_bytes}) >= 1, chunk_slots "
                             f"({chunk_slots}) >= 1 and keep ({keep}) >= 0")
        self.device, self.slot_bytes, self.budget = device, slot_bytes, budget
        self.chunk_slots, self.keep = chunk_slots, keep
        # asked for bytes the budget lacks before a growth is refused: frees other slabs' free
        # chunks (the budget is the worker's, shared by every decoder); returns the bytes freed
        self.reclaim = reclaim
        self._chunks: dict[int, _Chunk] = {}      # by first slot id
        self._firsts: list[int] = []              # sorted: a slot's chunk by bisection
        self._free: list[int] = []                # heap of free slot ids
        self._is_free: set[int] = set()           # the same ids: a give of a free slot is a bug
        self._next_id = 0                         # ids are never reused: a stale id cannot alias
        self._cond = threading.Condition()
        self._want = False          # the refill thread may grow (a take since the budget refused)
        self._closing = False
        self._thread: threading.Thread | None = None
        self.growths = 0            # chunks pinned
        self.misses = 0             # takes without growth that found too few free slots
        self.failures = 0           # pinned allocations the device refused

    # -- what it holds --------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        with self._cond:
            return sum(c.slots for c in self._chunks.values())

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes this slab books: every slot of every chunk, free or out."""
        return self.slots * self.slot_bytes

    @property
    def free_bytes(self) -> int:
        return self.free_slots * self.slot_bytes

    def trimmable_bytes(self, keep: int) -> int:
        """The bytes `trim(keep)` would free now (nothing is freed)."""
        with self._cond:
            free, total = len(self._free), 0
            for first in reversed(self._firsts):
                chunk = self._chunks[first]
                if chunk.out == 0 and free - chunk.slots >= keep:
                    free -= chunk.slots
                    total += chunk.slots * self.slot_bytes
            return total

    # -- slots ----------------------------------------------------------------------------------
    def take(self, n: int, grow: bool = True) -> list[int] | None:
        """n free slot ids (lowest first), growing the slab on this thread when too few are free
        and `grow`; None when the budget cannot hold them (nothing booked), or without `grow`
        when too few are free. DeviceError when the device refuses a pinned allocation (its
        booking given back)."""
        if n < 1:
            raise ValueError(f"PinnedSlab.take({n}): at least one slot")
        with self._cond:
            if self._closing:
                return None
            self._want = True           # the refill grows back to `keep` free
            self._start_locked()
            self._cond.notify_all()
            if len(self._free) >= n:
                return self._pop(n)
            missing = n - len(self._free)
            if not grow:
                self.misses += 1
                return None
        chunks = self._pin(missing, ahead=False)
        if chunks is None:
            return None
        with self._cond:
            self._add(chunks)
            # popped under the same lock as the add: no trim can free the new chunks first
            return self._pop(n) if len(self._free) >= n else None

    def give(self, slots: list[int]) -> None:
        """Slots whose copies all ran back to the free list (still booked)."""
        with self._cond:
            for s in slots:
                chunk = self._chunk_of(s)
                if chunk is None or s in self._is_free:
                    raise ValueError(f"PinnedSlab.give: slot {s} is not out")
                chunk.out -= 1
                self._is_free.add(s)
                heapq.heappush(self._free, s)
            self._cond.notify_all()     # wait_free

    def view(self, first: int, n: int) -> np.ndarray:
        """The host bytes of slots first .. first + n - 1 (one chunk's, out now)."""
        with self._cond:
            chunk = self._chunk_of(first)
        assert chunk is not None and first + n <= chunk.first + chunk.slots, \
            f"slots {first}..{first + n - 1} are not one chunk's"
        at = (first - chunk.first) * self.slot_bytes
        return chunk.host[at:at + n * self.slot_bytes]

    def same_chunk(self, a: int, b: int) -> bool:
        with self._cond:
            chunk = self._chunk_of(a)
        return chunk is not None and chunk.first <= b < chunk.first + chunk.slots

    # -- chunks ---------------------------------------------------------------------------------
    def trim(self, keep: int, need_bytes: int | None = None) -> int:
        """Free chunks with no slot out, newest first, while at least `keep` slots stay free
        (and, with `need_bytes`, until that many bytes went); gives their bytes back and
        returns them. DeviceError when a free fails (that chunk stays, booked)."""
        freed = 0
        while need_bytes is None or freed < need_bytes:
            with self._cond:
                chunk = next((self._chunks[f] for f in reversed(self._firsts)
                              if self._chunks[f].out == 0
                              and len(self._free) - self._chunks[f].slots >= keep), None)
                if chunk is None:
                    return freed
                self._remove(chunk)
            try:
                self.device.free_pinned(chunk.host)
            except DeviceError:
                with self._cond:
                    self._add([chunk])
                raise
            self.budget.give(chunk.slots * self.slot_bytes)
            freed += chunk.slots * self.slot_bytes
        return freed

    def start(self) -> None:
        """Grow `keep` free slots ahead from now on, before the first take asks."""
        with self._cond:
            self._want = True
            self._start_locked()
            self._cond.notify()

    def wait_free(self, n: int, timeout_s: float) -> bool:
        """Block until `n` slots are free (tests, a warm-up); whether they are."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._free) >= n or self._closing,
                                       timeout_s) and len(self._free) >= n

    def close(self) -> int:
        """Stop the refill thread and free every chunk with no slot out; returns the bytes
        given back (a chunk with a slot out stays booked: its owner never gave it back)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        return self.trim(0)

    # -- internals (the lock held where the name says _locked or the caller says so) -------------
    def _start_locked(self) -> None:
        if self._thread is None and self.keep > 0 and not self._closing:
            self._thread = threading.Thread(target=self._refill, daemon=True,
                                            name="gpuplane-pinned-slab")
            self._thread.start()

    def _chunk_of(self, slot: int) -> _Chunk | None:
        i = bisect.bisect_right(self._firsts, slot) - 1
        if i < 0:
            return None
        chunk = self._chunks[self._firsts[i]]
        return chunk if slot < chunk.first + chunk.slots else None

    def _pop(self, n: int) -> list[int]:
        out = [heapq.heappop(self._free) for _ in range(n)]
        for s in out:
            self._is_free.discard(s)
            self._chunk_of(s).out += 1
        return out

    def _add(self, chunks: list[_Chunk]) -> None:
        for c in chunks:
            self._chunks[c.first] = c
            self._firsts.append(c.first)
            for s in range(c.first, c.first + c.slots):
                if s not in self._is_free:
                    self._is_free.add(s)
                    heapq.heappush(self._free, s)
        self._firsts.sort()
        self._cond.notify_all()

    def _remove(self, chunk: _Chunk) -> None:
        del self._chunks[chunk.first]
        self._firsts.remove(chunk.first)
        gone = range(chunk.first, chunk.first + chunk.slots)
        self._is_free.difference_update(gone)
        self._free = [s for s in self._free if not chunk.first <= s < chunk.first + chunk.slots]
        heapq.heapify(self._free)

    def _pin(self, missing: int, ahead: bool) -> list[_Chunk] | None:
        """Book and pin whole chunks holding at least `missing` slots (the last one cut to the
        budget; `ahead`: as many of them as the budget holds); None when the budget cannot
        hold them (nothing booked). Called without the lock. DeviceError when the device
        refuses an allocation: the slots not pinned are given back to the budget, the chunks
        pinned before it join the slab."""
        short = missing * self.slot_bytes - self.budget.available()
        if short > 0 and self.reclaim is not None and not ahead:
            self.reclaim(self, short)
        room = self.budget.available() // self.slot_bytes
        if ahead:
            missing = min(missing, max(room, 1))
        total = min(room, -(-missing // self.chunk_slots) * self.chunk_slots)
        if room < missing or not self.budget.take(total * self.slot_bytes):
            return None                 # (the second: another decoder booked in between)
        chunks: list[_Chunk] = []
        left = total
        try:
            while left > 0:
                n = min(left, self.chunk_slots)
                host = self.device.alloc_pinned(n * self.slot_bytes)
                with self._cond:
                    first, self._next_id = self._next_id, self._next_id + n
                chunks.append(_Chunk(host, first, n))
                left -= n
        except DeviceError:
            self.budget.give(left * self.slot_bytes)
            with self._cond:
                self.failures += 1
                self.growths += len(chunks)
                self._add(chunks)       # pinned and booked: free slots like any other
            raise
        with self._cond:
            self.growths += len(chunks)
        return chunks

    def _refill(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or (
                    self._want and len(self._free) < self.keep))
                if self._closing:
                    return
                missing = self.keep - len(self._free)
            try:
                chunks = self._pin(missing, ahead=True)
            except DeviceError:
                chunks = None
            with self._cond:
                if chunks is None:
                    self._want = False      # full, or refused: wait for the next take
                else:
                    self._add(chunks)
