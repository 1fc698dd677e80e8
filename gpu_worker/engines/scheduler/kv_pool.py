"""The paged KV pool of one decoder model: fixed-size blocks in one stable VA range of the arena.

Hazard: captured decode graphs bake the pool's base address, and kernels may still read a block
after the host has freed it. Contract: the pool is one range carved once (`Arena.carve`) and never
moved; it grows by committing whole arena granules at its top (`Arena.commit(zone="kv")`, so
every byte is booked in the ledger and the governor, and a refusal goes through the reclaimer)
and shrinks by decommitting only top granules that hold no used block; the arena's fenced release
queue keeps an unmap behind the kernels still reading. Blocks are handed out lowest first, so the
used blocks stay packed at the bottom and the top can go.
Cost: one arena commit per granule (one physical handle each, ~70 us on an H200), on growth only.

Layout (i13 contract): block b is bytes [b * block_bytes, (b + 1) * block_bytes), fp16,
[layer][K|V][slot][kv_head][dim]. Backend-independent: no grpc, no device calls but the arena's.
"""
from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

import numpy as np

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

    Not thread-safe for allocation (one engine thread per model owns it); `stats()` may be read
    from any thread.
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
        self._used: set[int] = set()
        self._lock = threading.Lock()
        self.grows = self.shrinks = 0
        self.closed = False

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return min(self.committed // self.block_bytes, self.capacity_blocks)

    def used_blocks(self) -> int:
        return len(self._used)

    def free_blocks(self) -> int:
        """Blocks obtainable without committing more memory."""
        return len(self._free)

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, lowest free first, growing the pool when needed; None when the pool is at
        capacity or the budget refuses the growth (nothing is taken then)."""
        if n <= 0:
            return []
        if len(self._free) < n and not self._grow(n - len(self._free)):
            return None
        with self._lock:
            blocks = [heapq.heappop(self._free) for _ in range(n)]
            self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool (the caller's table no longer names them)."""
        with self._lock:
            for b in blocks:
                if b not in self._used:
                    raise InvalidArgument(f"KV block {b} is not allocated (double free)")
                self._used.remove(b)
                heapq.heappush(self._free, b)

    def _grow(self, blocks: int) -> bool:
        """Commit granules at the top until `blocks` more blocks are usable; False (and nothing
        kept beyond what is usable) when capacity or the budget stops it."""
        target_blocks = self.usable_blocks + blocks
        if target_blocks > self.capacity_blocks:
            return False
        target = -(-target_blocks * self.block_bytes // self.granule) * self.granule
        before = self.usable_blocks
        ok = True
        while self.committed < target:
            try:
                self.arena.commit(self.base + self.committed, self.granule, "kv", role="kv")
            except ResourceExhausted:
                ok = False
                break
            self.committed += self.granule
        with self._lock:
            for b in range(before, self.usable_blocks):
                heapq.heappush(self._free, b)
        if self.usable_blocks > before:
            self.grows += 1
        return ok

    def shrink(self) -> int:
        """Decommit the top granules that hold no used block; returns the bytes released."""
        with self._lock:
            top_used = max(self._used, default=-1)
            keep = -(-(top_used + 1) * self.block_bytes // self.granule) * self.granule
            if keep >= self.committed:
                return 0
            released = self.committed - keep
            self.committed = keep
            limit = self.usable_blocks
            self._free = [b for b in self._free if b < limit]
            heapq.heapify(self._free)
        # one decommit per granule, matching the per-granule commits
        for off in range(keep, keep + released, self.granule):
            self.arena.decommit(self.base + off, self.granule, "kv")
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
            self._used.clear()
        self.shrink()
        self.arena.uncarve(self._carved, self.reserved + self.granule)
        self.closed = True

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"kv_block_tokens": self.geometry.block_tokens,
                    "kv_blocks_total": self.usable_blocks,
                    "kv_blocks_used": len(self._used),
                    "kv_blocks_capacity": self.capacity_blocks,
                    "kv_committed_bytes": self.committed,
                    "kv_block_bytes": self.block_bytes}


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
