"""The kernel cache's in-memory hot tier: verified artifacts served without SQLite or SHA-256.

Hazard: a memory copy is a second source of truth. If it could hold bytes whose digest was never
checked, or outlive its row (evicted, quarantined, pruned), a hit would serve code the database
no longer vouches for, and a kill -9 would make memory and disk disagree about what was stored.
Contract: only the store puts artifacts here, and only (a) after the commit of a Store whose
digest it verified, or (b) after a read from SQLite whose bytes it just hashed against the row's
digest; every path that deletes a row (eviction, prune, quarantine) drops the entry under the
same write lock. A hit checks the entry's digest against the index's, so a re-stored key never
serves the old bytes. Memory is bounded by `budget_bytes` (LRU); an artifact larger than a
quarter of it is never kept (one blob must not flush the tier). Nothing here survives a restart:
after kill -9 the tier is empty and refills from SQLite, so it cannot disagree with it.
Cost: a hit is a dict lookup and a move-to-end under one lock (~1 us); the bytes are shared with
the caller (immutable), never copied.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from cache_service.artifact import Artifact

EntryId = tuple[str, str]
DEFAULT_HOT_BYTES = 64 << 20


class HotTier:
    """LRU of verified artifacts bounded by bytes; 0 budget = off. Thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_HOT_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError("hot tier budget cannot be negative (0 = off)")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[EntryId, Artifact] = OrderedDict()
        self._bytes = 0
        self.hits = 0

    def get(self, entry: EntryId, sha256: str) -> Artifact | None:
        """The artifact held for `entry` if its digest is `sha256` (the index's), else None."""
        with self._lock:
            artifact = self._entries.get(entry)
            if artifact is None or artifact.sha256 != sha256:
                return None
            self._entries.move_to_end(entry)
            self.hits += 1
            return artifact

    def put(self, entry: EntryId, artifact: Artifact) -> None:
        """Keep a verified artifact (see the module contract), evicting LRU entries to fit."""
        if artifact.size * 4 > self.budget_bytes:
            return
        with self._lock:
            old = self._entries.pop(entry, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[entry] = artifact
            self._bytes += artifact.size
            while self._bytes > self.budget_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.size

    def drop(self, entry: EntryId) -> None:
        with self._lock:
            old = self._entries.pop(entry, None)
            if old is not None:
                self._bytes -= old.size

    def snapshot(self) -> dict[EntryId, str]:
        """entry -> digest of everything held (for consistency checks)."""
        with self._lock:
            return {e: a.sha256 for e, a in self._entries.items()}

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
