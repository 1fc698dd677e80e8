"""Cached prefix blocks demoted to pinned host instead of dropped, and promoted back on a hit
(DESIGN 6.3; the rule: docs/scheduler.md, "Cached prefix blocks on host").

Hazard: the same as the swap's (kv_swap.py): a copy out that runs after the block was handed to
another sequence copies that sequence's K/V, a host slot reused while its copy is queued
corrupts the K/V it holds, an unbounded tier takes the host's memory. Two more: a block named by a
step that then failed may never have been written, and a copy queued by the thread that is
capturing a graph (a reclaim its own commit ran mid-capture) would join the graph.
Contract:
- A cached block the pool evicts (for a new block, `KVBlockPool.allocate`; for a reclaim's
  cached-KV step, `shrink(evict_cached=True)`) reaches `demote` with its prefix key before the
  pool hands the block out or decommits its granule, so its copy out is queued on the compute
  stream behind the steps that wrote it and ahead of any reuse (the KVSwap copy: one slot of
  the decoder's pinned slab and one event per block, inside a gate section). Demoted only
  when the rule says a round trip costs less device time than prefilling the block's tokens
  again (`swap_is_cheaper(block_bytes, block_tokens, ...)`, the swap rule's inputs), never on
  the capturing thread; else dropped, as before.
- Admission needs evidence of reuse: a block is demoted only when its prefix was used again
  since it was named (a later sequence shared it on the device, or it came back from host:
  `KVBlockPool.reused`), or when its key was evicted and dropped before (the prefix came back
  and was prefilled again). Any other block is dropped and its key remembered (the last
  `remembered` keys), so a prompt seen once costs no copy: in a workload without reuse every
  demotion was a copy out never copied back.
- The host keeps each demoted block under its key in an LRU. Every byte is booked in the
  worker's HostKVBudget (the slab's chunks: pinned_slab.py); its slot goes back to the free
  list after its last copy ran. A demotion that does not fit drops this decoder's oldest host
  blocks first, then the block itself; a swapped-out sequence's slots are never taken for a
  demotion, and a swap-out that does not fit drops host blocks first (`make_room`: a swapped
  sequence's positions are sure to be needed, a cached block's only maybe).
- Promotion (`take`, then `promote`): at admission, after the leading run of device-resident
  blocks of a prefix, the leading run of host-resident keys leaves the LRU (so the allocation
  that follows cannot drop them), is copied into fresh blocks (one H2D each, queued before the
  step that reads them) and named: device cached blocks like any other. A copy the device
  refuses leaves that block and the rest unnamed; the sequence prefills them (never wrong KV).
- A failed step drops every host block (`clear`): one may be a copy of a block the step never
  wrote.
Cost: per demoted block a free slot (pinned ahead on the slab's own thread: none free and the
budget has room, the block is dropped as declined) and block_bytes / d2h rate of
compute-stream time between steps; per promoted block block_bytes / h2d rate; a lookup is
one dict probe per key. Engine-thread only (or a reclaimer holding the model's lock), like the
pool; `blocks` and `nbytes` may be read from any thread.
"""
from __future__ import annotations

import collections
from collections.abc import Callable

from gpu_worker.device.backend import DeviceError
from gpu_worker.engines.scheduler.kv_swap import KVSwap, SwapFailed, SwappedKV, swap_is_cheaper

COUNTERS = ("kv_blocks_demoted", "kv_blocks_promoted", "kv_demote_declined",
            "kv_demote_refused", "kv_demote_failed", "kv_promote_failed",
            "kv_host_cache_evictions")


class HostPrefixCache:
    """One decoder's demoted prefix blocks: key -> its pinned copy, least recently used first."""

    def __init__(self, swap: KVSwap, block_tokens: int,
                 prefill_rate: Callable[[], float | None],
                 reused: Callable[[int], bool] = lambda block: True,
                 remembered: int = 4096) -> None:
        """`reused(block)`: whether an evicted block's prefix was used again since it was
        named (the pool's `reused`; by default every block counts as reused); `remembered`:
        how many keys of dropped blocks are kept as evidence for their next eviction."""
        self.swap, self.block_tokens = swap, block_tokens
        self._prefill_rate = prefill_rate
        self._reused = reused
        self._dropped: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._remembered = max(0, remembered)
        self._lru: collections.OrderedDict[bytes, SwappedKV] = collections.OrderedDict()
        self.nbytes = 0                        # booked by the blocks in the LRU
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def blocks(self) -> int:
        return len(self._lru)

    def pays(self) -> bool:
        """The rule: a block's round trip through pinned host costs less device time than
        prefilling its tokens again (no prefill rate known yet: it does not)."""
        return swap_is_cheaper(self.swap.block_bytes, self.block_tokens, self.swap.rates,
                               self._prefill_rate())

    # -- demotion (the pool's on_evict) -----------------------------------------------------------
    def demote(self, evicted: list[tuple[int, bytes]]) -> None:
        """Copy evicted cached blocks to host, least recently used first; each one the rule, the
        budget or the device refuses is dropped (counted)."""
        if self.swap.device.gate.is_capturing_thread() or not self.pays():
            self.counters["kv_demote_declined"] += len(evicted)
            return
        todo = []
        for block, key in evicted:
            if key in self._lru:           # the same key holds the same K/V: one copy is enough
                self._lru.move_to_end(key)
            elif self._reused(block) or self._dropped.pop(key, False):
                todo.append((block, key))  # used again, or evicted before and come back
            else:                          # no evidence of reuse yet: dropped, key remembered
                self.counters["kv_demote_declined"] += 1
                self._dropped[key] = True
                if len(self._dropped) > self._remembered:
                    self._dropped.popitem(last=False)
        # more than the budget can hold even without the older host blocks: the most recently
        # used of the evicted ones go (copying the others would only drop them again)
        fit = self._room(len(todo) * self.swap.block_bytes) // self.swap.block_bytes
        if len(todo) > fit:
            self.counters["kv_demote_refused"] += len(todo) - fit
            todo = todo[len(todo) - fit:]
        for block, key in todo:
            rec = self._copy_out(block)
            if rec is not None:
                self._lru[key] = rec
                self.nbytes += rec.nbytes
                self.counters["kv_blocks_demoted"] += 1

    def _copy_out(self, block: int) -> SwappedKV | None:
        """Copy `block` out to a free slot (pinned ahead off this thread, or given back by
        the oldest host block), never one pinned here while slots are pinned ahead
        (pinned_slab.py: pinning costs the host ~1 ms per 2 MiB on the step path); None when
        none can be had (counted)."""
        ahead = self.swap.pins_ahead()
        while True:
            try:
                rec = self.swap.swap_out([block], self.block_tokens, allocate=not ahead)
            except SwapFailed:
                self.counters["kv_demote_failed"] += 1
                return None
            if rec is not None:
                return rec
            if ahead and self.swap.budget.available() >= self.swap.block_bytes:
                self.counters["kv_demote_declined"] += 1   # room, but none pinned yet
                return None
            if not self._drop_oldest():
                self.counters["kv_demote_refused"] += 1
                return None

    def _copied(self, rec: SwappedKV) -> bool:
        """Its copy out ran: dropping it gives its bytes back now."""
        try:
            return rec.event is None or self.swap.device.event_done(rec.event)
        except DeviceError:
            return False

    def _room(self, want: int) -> int:
        """Bytes the budget could give (up to `want`): what is free plus the oldest host blocks
        whose copies ran (in order: a block whose copy is still queued stops the count)."""
        room = self.swap.available()
        for rec in self._lru.values():
            if room >= want or not self._copied(rec):
                break
            room += rec.nbytes
        return room

    def _drop_oldest(self) -> bool:
        """Drop the oldest host block if its copy ran (so its bytes come back at once);
        whether one was dropped."""
        if not self._lru or not self._copied(next(iter(self._lru.values()))):
            return False
        _, rec = self._lru.popitem(last=False)
        self.nbytes -= rec.nbytes
        self.counters["kv_host_cache_evictions"] += 1
        self.swap.release(rec)             # its slot is free now: its event passed
        return True

    def make_room(self, nbytes: int) -> bool:
        """Drop host blocks, oldest first, until `nbytes` fit the budget (a swap-out needs
        them); whether they fit now. Only blocks whose copies ran are dropped."""
        while self.swap.available() < nbytes and self._drop_oldest():
            pass
        return self.swap.available() >= nbytes

    # -- promotion --------------------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> int:
        """How many leading `keys` are on host now (nothing taken)."""
        n = 0
        for key in keys:
            if key not in self._lru:
                break
            n += 1
        return n

    def take(self, keys: list[bytes]) -> list[tuple[bytes, SwappedKV]]:
        """The leading run of `keys` on host, out of the LRU (still booked): for `promote`, or
        `put_back` when the blocks to copy them into cannot be had."""
        taken = []
        for key in keys[:self.match(keys)]:
            rec = self._lru.pop(key)
            self.nbytes -= rec.nbytes
            taken.append((key, rec))
        return taken

    def put_back(self, taken: list[tuple[bytes, SwappedKV]]) -> None:
        for key, rec in taken:
            if key in self._lru:           # demoted again meanwhile: keep one copy
                self.swap.release(rec)
                continue
            self._lru[key] = rec
            self.nbytes += rec.nbytes

    def promote(self, taken: list[tuple[bytes, SwappedKV]], blocks: list[int]) -> int:
        """Queue each taken copy into its fresh block (in order); returns how many were queued.
        At the first copy the device refuses, that one and the rest are released: their blocks'
        contents are undefined, the caller prefills from there. Every host copy is released
        either way (its slot free once its copy in ran)."""
        done = 0
        capturing = self.swap.device.gate.is_capturing_thread()
        for (_, rec), block in zip(taken, blocks, strict=False):
            if capturing:       # the copies would join the graph: prefill them instead
                break
            try:
                self.swap.swap_in(rec, [block])
            except SwapFailed:
                self.counters["kv_promote_failed"] += 1
                break
            done += 1
        for _, rec in taken[done:]:
            self.swap.release(rec)
        self.counters["kv_blocks_promoted"] += done
        return done

    def clear(self) -> None:
        """Drop every host block (a failed step, or the scheduler closing)."""
        while self._lru:
            _, rec = self._lru.popitem(last=False)
            self.nbytes -= rec.nbytes
            self.swap.release(rec)
