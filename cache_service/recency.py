"""The in-memory recency order of the cache: who is evicted next, by bytes, globally and per namespace.

SQLite holds the bytes and a lazily persisted `last_access`; this index is the source of truth for
ordering while the server runs, so a hit moves an entry to most-recently-used at once without
turning the read into a write. Not thread-safe on its own: the store guards it with one lock.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

EntryId = tuple[str, str]  # (namespace, key)


@dataclass
class EntryMeta:
    size: int
    sha256: str
    compile_seconds: float


class RecencyIndex:
    """Global and per-namespace LRU orders (oldest first) with byte totals kept in step."""

    def __init__(self) -> None:
        self._global: OrderedDict[EntryId, EntryMeta] = OrderedDict()
        self._by_ns: dict[str, OrderedDict[EntryId, None]] = {}
        self._ns_bytes: dict[str, int] = {}
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._global)

    def __contains__(self, entry: EntryId) -> bool:
        return entry in self._global

    def get(self, entry: EntryId) -> EntryMeta | None:
        return self._global.get(entry)

    def add(self, entry: EntryId, meta: EntryMeta) -> None:
        """Insert (or replace) `entry` as most recently used."""
        self.remove(entry)
        ns = entry[0]
        self._global[entry] = meta
        self._by_ns.setdefault(ns, OrderedDict())[entry] = None
        self._ns_bytes[ns] = self._ns_bytes.get(ns, 0) + meta.size
        self.total_bytes += meta.size

    def touch(self, entry: EntryId) -> EntryMeta | None:
        """Move `entry` to most recently used; None when it is not cached."""
        meta = self._global.get(entry)
        if meta is not None:
            self._global.move_to_end(entry)
            self._by_ns[entry[0]].move_to_end(entry)
        return meta

    def remove(self, entry: EntryId) -> EntryMeta | None:
        meta = self._global.pop(entry, None)
        if meta is None:
            return None
        ns = entry[0]
        del self._by_ns[ns][entry]
        self._ns_bytes[ns] -= meta.size
        self.total_bytes -= meta.size
        if not self._by_ns[ns]:
            del self._by_ns[ns], self._ns_bytes[ns]
        return meta

    def namespace_bytes(self, ns: str) -> int:
        return self._ns_bytes.get(ns, 0)

    def namespaces(self) -> dict[str, tuple[int, int]]:
        """namespace -> (entries, bytes)."""
        return {ns: (len(order), self._ns_bytes[ns]) for ns, order in self._by_ns.items()}

    def victims(self, ns: str, incoming: int, budget: int, ns_budget: int, low: float) -> list[EntryId]:
        """Least recently used entries to drop so that `incoming` more bytes in `ns` fit.

        Nothing is chosen while both budgets hold; once one would be exceeded, that scope is
        pruned down to its low watermark (`low` x budget) so the next stores do not each evict.
        A budget of 0 is unbounded.
        """
        chosen: dict[EntryId, int] = {}
        if ns_budget and self.namespace_bytes(ns) + incoming > ns_budget:
            target = low * ns_budget - incoming
            held = self.namespace_bytes(ns)
            for entry in self._by_ns.get(ns, ()):
                if held <= target:
                    break
                size = self._global[entry].size
                chosen[entry] = size
                held -= size
        if budget:
            held = self.total_bytes - sum(chosen.values())
            if held + incoming > budget:
                target = low * budget - incoming
                for entry, meta in self._global.items():
                    if held <= target:
                        break
                    if entry in chosen:
                        continue
                    chosen[entry] = meta.size
                    held -= meta.size
        return list(chosen)

    def oldest_first(self) -> list[EntryId]:
        return list(self._global)
