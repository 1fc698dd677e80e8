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
An entry may also keep one encoding of its artifact (the serialized hit response, made by
`encoded` from the held artifact itself, never from anything else), dropped with the entry and
counted in the budget. Encodings live in what the artifacts leave of the budget: over it, the
oldest encodings go first, so an encoding never pushes an artifact out (which artifacts are held
is exactly what it would be without them).
Cost: a hit is a dict lookup and a move-to-end under one lock (~1 us); the bytes are shared with
the caller (immutable), never copied.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from cache_service.artifact import Artifact

EntryId = tuple[str, str]
DEFAULT_HOT_BYTES = 64 << 20


class _Held:
    __slots__ = ("artifact", "encoded")

    def __init__(self, artifact: Artifact) -> None:
        self.artifact = artifact
        self.encoded: bytes | None = None

    @property
    def size(self) -> int:
        return self.artifact.size + (len(self.encoded) if self.encoded is not None else 0)


class HotTier:
    """LRU of verified artifacts bounded by bytes; 0 budget = off. Thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_HOT_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError("hot tier budget cannot be negative (0 = off)")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[EntryId, _Held] = OrderedDict()
        self._encodings: OrderedDict[EntryId, None] = OrderedDict()  # entries with one, LRU first
        self._bytes = 0
        self.hits = 0

    def get(self, entry: EntryId, sha256: str) -> Artifact | None:
        """The artifact held for `entry` if its digest is `sha256` (the index's), else None."""
        with self._lock:
            held = self._entries.get(entry)
            if held is None or held.artifact.sha256 != sha256:
                return None
            self._entries.move_to_end(entry)
            self.hits += 1
            return held.artifact

    def encoded(self, entry: EntryId, artifact: Artifact,
                encode: Callable[[Artifact], bytes]) -> bytes | None:
        """`encode(artifact)`, made once and kept with the entry while `entry` holds this very
        artifact (as `get` returned it); None when it does not (evicted, re-stored, never kept),
        and the caller encodes it itself. `encode` must depend on the artifact alone."""
        with self._lock:
            held = self._entries.get(entry)
            if held is None or held.artifact is not artifact:
                return None
            if held.encoded is not None:
                self._encodings.move_to_end(entry)
                return held.encoded
        made = encode(artifact)  # outside the lock: tens of microseconds for 256 KiB
        with self._lock:
            held = self._entries.get(entry)
            if held is None or held.artifact is not artifact:
                return made
            if held.encoded is None:
                held.encoded = made
                self._encodings[entry] = None
                self._bytes += len(made)
                self._evict_to_budget()
            return made

    def put(self, entry: EntryId, artifact: Artifact) -> None:
        """Keep a verified artifact (see the module contract), evicting LRU entries to fit."""
        if artifact.size * 4 > self.budget_bytes:
            return
        with self._lock:
            self._pop(entry)
            self._entries[entry] = _Held(artifact)
            self._bytes += artifact.size
            self._evict_to_budget()

    def _evict_to_budget(self) -> None:
        """Drop the oldest encodings, then LRU entries, until the held bytes fit (the caller
        holds the lock); the newest entry fits alone (at most a quarter of the budget)."""
        while self._bytes > self.budget_bytes and self._encodings:
            entry, _ = self._encodings.popitem(last=False)
            held = self._entries[entry]
            self._bytes -= len(held.encoded or b"")
            held.encoded = None
        while self._bytes > self.budget_bytes:
            entry, _ = next(iter(self._entries.items()))
            self._pop(entry)

    def _pop(self, entry: EntryId) -> None:
        """Forget `entry` and its encoding (the caller holds the lock)."""
        old = self._entries.pop(entry, None)
        if old is not None:
            self._bytes -= old.size
            self._encodings.pop(entry, None)

    def drop(self, entry: EntryId) -> None:
        with self._lock:
            self._pop(entry)

    def snapshot(self) -> dict[EntryId, str]:
        """entry -> digest of everything held (for consistency checks)."""
        with self._lock:
            return {e: held.artifact.sha256 for e, held in self._entries.items()}

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
