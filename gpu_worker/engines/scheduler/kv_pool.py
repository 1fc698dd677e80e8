"""The paged KV pool of one decoder model: fixed-size blocks in one stable VA range of the arena.

Hazard: captured decode graphs bake the pool's base address, and kernels may still read a block
after the host has freed it. Contract: the pool is one range carved once (`Arena.carve`) and never
moved; it grows by committing whole arena granules at its top (`Arena.commit(zone="kv")`, so
every byte is booked in the ledger and the governor, and a refusal goes through the reclaimer)
and shrinks by decommitting only top granules that hold no used block; the arena's fenced release
queue keeps an unmap behind the kernels still reading. Blocks are handed out lowest first, so the
used blocks stay packed at the bottom and the top can go.
Prefix cache (DESIGN 6.3, prefix_cache.py): a full, written block may carry a name (the hash of
its prefix); named blocks are shared by reference count and, once no table names them, stay
committed as cached blocks (booked in zone `kv` like any other) until a new block is needed
(LRU eviction) or a reclaim evicts the top ones to decommit their granules
(`shrink(evict_cached=True)`); the idle shrink keeps them. An evicted cached block goes to
`on_evict` with its key first (kv_demote.py: the host tier may copy it to pinned host), before
the pool hands it out or decommits its granule, so the copy is queued ahead of any reuse.
Cost: one arena commit per granule (one physical handle each, ~70 us on an H200), on growth only.

Layout (i13 contract): block b is bytes [b * block_bytes, (b + 1) * block_bytes), fp16,
[layer][K|V][slot][kv_head][dim]. Backend-independent: no grpc, no device calls but the arena's.
"""
from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpu_worker.engines.scheduler.prefix_cache import PrefixIndex
from services.common.errors import InvalidArgument, ResourceExhausted

KV_BYTES_PER_ELEMENT = 2    # fp16
BLOCK_TOKENS_CHOICES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class KVGeometry:
    """Shapes of one model's paged KV (the contract's `kv.pool` tensor)."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    max_context: int

    def __post_init__(self) -> None:
        if self.block_tokens not in BLOCK_TOKENS_CHOICES:
            raise InvalidArgument(f"kv block tokens must be a power of two in 16..256, got "
                                  f"{self.block_tokens}")

    @property
    def block_bytes(self) -> int:
        return self.layers * 2 * self.block_tokens * self.kv_heads * self.head_dim * KV_BYTES_PER_ELEMENT

    @property
    def max_blocks(self) -> int:
        """Block-table width: the blocks of one sequence at max_context."""
        return -(-self.max_context // self.block_tokens)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)


class KVBlockPool:
    """Blocks of `geometry.block_bytes` in a carved range of `capacity_blocks` blocks.

    Every usable (committed) block is in exactly one state: used (referenced by at least one
    block table; a named block may be shared, reference-counted), cached (named in `index`,
    referenced by none: kept for a later prefix hit, in LRU order) or free:
    used + cached + free == usable_blocks, always (tests/scheduler/test_prefix_cache.py).
    A block that is shared is never written: only full, written blocks get a name, and every
    sequence writes at positions past the blocks it shares.

    Not thread-safe for allocation (one engine thread per model owns it, or a reclaimer holding
    the model's lock); `stats()` may be read from any thread.
    """

    def __init__(self, arena, geometry: KVGeometry, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise InvalidArgument(f"the KV pool needs at least one block, got {capacity_blocks}")
        self.arena, self.geometry, self.capacity_blocks = arena, geometry, capacity_blocks
        self.block_bytes = geometry.block_bytes
        g = self.granule = arena.granule
        self.reserved = -(-capacity_blocks * self.block_bytes // g) * g
        # Carve one granule more and align up: granules of the pool are then the arena's own, so
        # a decommit of the top granule touches no neighbour.
        self._carved = arena.carve(self.reserved + g, role="kv")
        self.base = -(-self._carved // g) * g
        self.committed = 0                  # bytes, a multiple of the granule
        self._free: list[int] = []          # min-heap of free blocks below usable_blocks
        self._refs: dict[int, int] = {}     # used blocks -> the block tables naming them
        self.index = PrefixIndex()          # named blocks; the unreferenced ones are cached
        # named blocks a later sequence shared (acquire) or that were copied back from host since
        # they were named: the host tier's evidence of reuse (kv_demote.py)
        self._reused: set[int] = set()
        self._lock = threading.Lock()
        # set while granules are being committed: a reclaim the commit's refusal runs on this
        # thread must not shrink under the growth (it would decommit the granules just added)
        self._growing = False
        self.grows = self.shrinks = self.evictions = 0
        self.closed = False
        # cached blocks being evicted, (block, key) least recently used first: called on the
        # pool's owner thread before the blocks are reused or decommitted (kv_demote.py)
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return min(self.committed // self.block_bytes, self.capacity_blocks)

    def used_blocks(self) -> int:
        return len(self._refs)

    def cached_blocks(self) -> int:
        return self.index.parked()

    def free_blocks(self) -> int:
        """Free blocks (cached ones are obtainable too, by eviction, without committing)."""
        return len(self._free)

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks (one reference each): free ones lowest first, then cached ones,
        least recently used first (their names forgotten), then new granules. None when the
        pool is at capacity or the budget refuses the growth (nothing is taken then).

        A cached block is memory already committed, so the pool grows only once none is left:
        a growth (and the reclaim its refusal runs) never happens while this pool's own cache
        could have served it. When a growth is needed every cached block goes first (the
        allocation needs them all), even if the growth is then refused."""
        if n <= 0:
            return []
        if len(self._free) + self.index.parked() < n:
            with self._lock:
                evicted = self.index.clear_parked()
                for b, _ in evicted:
                    heapq.heappush(self._free, b)
                    self.evictions += 1
            self._evicted(evicted)
            if not self._grow(n - len(self._free)):
                return None
        evicted = []
        with self._lock:
            blocks = []
            for _ in range(n):
                if self._free:
                    b = heapq.heappop(self._free)
                else:
                    b, key = self.index.evict_lru()
                    evicted.append((b, key))
                    self.evictions += 1
                self._refs[b] = 1
                blocks.append(b)
        self._evicted(evicted)      # before the caller launches any write into them
        return blocks

    def _evicted(self, blocks: list[tuple[int, bytes]]) -> None:
        if blocks and self.on_evict is not None:
            self.on_evict(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a table's blocks, in position order). A block no
        table names any more is cached when it has a name, else free; named blocks are parked
        tail first, so the LRU evicts a prefix's tail before the head the tail depends on."""
        with self._lock:
            for b in reversed(blocks):
                refs = self._refs.get(b)
                if refs is None:
                    raise InvalidArgument(f"KV block {b} is not allocated (double free)")
                if refs > 1:
                    self._refs[b] = refs - 1
                    continue
                del self._refs[b]
                if self.index.is_named(b):
                    self.index.park(b)
                else:
                    heapq.heappush(self._free, b)

    # -- the prefix cache --------------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> int:
        """How many leading `keys` name a block now (nothing taken)."""
        return len(self.index.lookup(keys))

    def acquire(self, keys: list[bytes]) -> list[int]:
        """One more reference to each block of the leading run of `keys` that is named (a cached
        block becomes used); the blocks, in order."""
        with self._lock:
            blocks = self.index.lookup(keys)
            for b in blocks:
                refs = self._refs.get(b, 0)
                if refs == 0:
                    self.index.unpark(b)
                self._refs[b] = refs + 1
            self._reused.update(blocks)
        return blocks

    def name(self, block: int, key: bytes, reused: bool = False) -> bool:
        """A used, full block whose K/V are written (or launched) holds the prefix `key` now;
        False when another block holds it already (this one stays unnamed). `reused`: the
        prefix has been used again already (a block copied back from host)."""
        assert block in self._refs, f"KV block {block} named while not in use"
        with self._lock:
            named = self.index.name(block, key)
            if named and reused:
                self._reused.add(block)
            elif named:
                self._reused.discard(block)
            return named

    def reused(self, block: int) -> bool:
        """Whether the prefix a named block holds was used again since it was named: a later
        sequence shared the block, or it was copied back from host. Read by the eviction
        callback before the block is named again."""
        return block in self._reused

    def forget(self) -> None:
        """Forget every name: cached blocks become free, shared ones stay with their tables
        (a failed step may have left launched blocks unwritten)."""
        with self._lock:
            for b in self.index.clear():
                heapq.heappush(self._free, b)
            self._reused.clear()

    # -- growth and shrink -------------------------------------------------------------------------
    def _grow(self, blocks: int) -> bool:
        """Commit granules at the top until `blocks` more blocks are usable; False (and nothing
        kept beyond what is usable) when capacity or the budget stops it."""
        target_blocks = self.usable_blocks + blocks
        if target_blocks > self.capacity_blocks:
            return False
        target = -(-target_blocks * self.block_bytes // self.granule) * self.granule
        before = self.usable_blocks
        ok = True
        self._growing = True
        try:
            while self.committed < target:
                try:
                    self.arena.commit(self.base + self.committed, self.granule, "kv", role="kv")
                except ResourceExhausted:
                    ok = False
                    break
                self.committed += self.granule
        finally:
            self._growing = False
        with self._lock:
            for b in range(before, self.usable_blocks):
                heapq.heappush(self._free, b)
        if self.usable_blocks > before:
            self.grows += 1
        return ok

    def _keep_bytes(self, top_block: int) -> int:
        """Committed bytes that hold blocks 0..top_block (granule-rounded)."""
        return -(-(top_block + 1) * self.block_bytes // self.granule) * self.granule

    def cached_releasable_bytes(self) -> int:
        """What `shrink(evict_cached=True)` would release now: granules above the highest used
        block (cached blocks below it free nothing: their granules stay for the used one)."""
        with self._lock:
            return max(0, self.committed - self._keep_bytes(max(self._refs, default=-1)))

    def shrink(self, evict_cached: bool = False, need_bytes: int | None = None,
               demote: bool = True) -> int:
        """Decommit the top granules that hold no used block (and, unless `evict_cached`, no
        cached one); returns the bytes released. With `evict_cached` (a reclaim) the cached
        blocks in the way are evicted first, from the top down, until `need_bytes` could go
        (all of them when None), and the granules' handles go back to the device rather than
        to the arena's handle pool (where they would stay committed); a cached block below the
        highest used block stays (evicting it frees nothing). Never a used block. The evicted
        blocks go to `on_evict` before any decommit, unless `demote` is False."""
        if self._growing:
            return 0
        evicted: list[tuple[int, bytes]] = []
        with self._lock:
            top_used = max(self._refs, default=-1)
            floor = self._keep_bytes(top_used)      # what the used blocks keep committed
            lru = self.index.parked_blocks()        # least recently used first
            # the cached blocks that keep a granule above that floor committed
            parked = sorted((b for b in lru if (b + 1) * self.block_bytes > floor), reverse=True)
            if evict_cached:
                for i, b in enumerate(parked):
                    evicted.append((b, self.index.key_of(b)))
                    self.index.evict(b)
                    heapq.heappush(self._free, b)
                    self.evictions += 1
                    rest = self._keep_bytes(parked[i + 1]) if i + 1 < len(parked) else floor
                    if need_bytes is not None and self.committed - max(floor, rest) >= need_bytes:
                        parked = parked[i + 1:]
                        break
                else:
                    parked = []
            top = max(top_used, parked[0] if parked else -1)
            keep = self._keep_bytes(top)
            released = max(0, self.committed - keep)
            if released:
                self.committed = keep
                limit = self.usable_blocks
                self._free = [b for b in self._free if b < limit]
                heapq.heapify(self._free)
        if demote and evicted:      # queued before the decommits' fences
            order = {b: i for i, b in enumerate(lru)}
            self._evicted(sorted(evicted, key=lambda pair: order[pair[0]]))
        if not released:
            return 0
        # one decommit per granule, matching the per-granule commits
        for off in range(keep, keep + released, self.granule):
            self.arena.decommit(self.base + off, self.granule, "kv", retain=not evict_cached)
        # run the releases whose fences passed (the engine read its last step back: they have),
        # so an idle pool leaves no release pending in the arena's queue
        self.arena.collect()
        self.shrinks += 1
        return released

    def close(self) -> None:
        """Decommit everything and give the VA range back (the model is unloading)."""
        if self.closed:
            return
        with self._lock:
            self._refs.clear()
            self.index.clear()
        self.shrink()
        self.arena.uncarve(self._carved, self.reserved + self.granule)
        self.closed = True

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"kv_block_tokens": self.geometry.block_tokens,
                    "kv_blocks_total": self.usable_blocks,
                    "kv_blocks_used": len(self._refs),
                    "kv_blocks_cached": self.index.parked(),
                    "kv_blocks_capacity": self.capacity_blocks,
                    "kv_committed_bytes": self.committed,
                    "kv_block_bytes": self.block_bytes,
                    "kv_cache_evictions": self.evictions}


class BlockTable:
    """One sequence's blocks in position order: token p lives in blocks[p // block_tokens].

    The device's table row is kept next to the list as it changes (`extend`, `clear`), so a
    decode step copies each row instead of converting max_blocks Python ints per sequence (at
    8b-int4's 512-entry rows and 64 sequences that conversion was most of the step's host work:
    bench/scheduler_host_bench.py)."""

    def __init__(self, geometry: KVGeometry) -> None:
        self.geometry = geometry
        self.blocks: list[int] = []
        self._row = np.zeros(geometry.max_blocks, np.int32)

    def blocks_needed(self, tokens: int) -> int:
        """More blocks needed to hold `tokens` positions in total."""
        return max(0, self.geometry.blocks_for(tokens) - len(self.blocks))

    def extend(self, blocks: list[int]) -> None:
        n = len(self.blocks)
        self.blocks += blocks
        self._row[n:n + len(blocks)] = blocks

    def clear(self) -> list[int]:
        """Forget every block; returns them (for the pool to free)."""
        blocks, self.blocks = self.blocks, []
        self._row[:len(blocks)] = 0
        return blocks

    def row(self) -> np.ndarray:
        """The int32 table row: blocks then zeros up to max_blocks (unused entries never read).
        The live array, not a copy: read it within the step, never write it."""
        return self._row
