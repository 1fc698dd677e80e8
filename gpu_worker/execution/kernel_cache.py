"""Per-node kernel cache: (node, input shapes) -> resolved kernel variant with its workspaces.

Hazard (DESIGN 1.1): a cache keyed by input shapes that never evicts grows by one variant per node
per new prompt length, and every variant owns device workspaces (attention scratch, dequantization
scratch) that the ledger never saw: 38 -> 72 GiB and OOM over 12 requests.
Contract:
- at most `variants_per_node` variants per node (`--variants-per-node`, default 16: a serving
  decoder's 11 decode rungs and a few prefill buckets),
  LRU per node (not FIFO, not global), so the decode shape survives a run of new prefill shapes;
- every workspace is allocated through the arena in the `workspace` zone, so the ledger sees it,
  and starts zeroed where the cache has a `zero` (the executor's: the device's memset), so a
  kernel may keep counters there that it leaves at zero (the cluster decode's);
- an eviction of a variant with workspaces first resets every captured graph registered as a
  holder of it (a graph bakes workspace pointers; replaying it after the free is a
  use-after-free), then frees each workspace through the arena's fenced, deferred release
  (kernels in flight finish first); a variant whose graph cannot be reset is quarantined (kept
  allocated and booked), never freed. A variant without workspaces frees nothing (its kernel
  functions live as long as the process), so its eviction leaves the graphs that baked it alone:
  a serving worker's decode rungs and prefill buckets outnumber the bound, and resetting those
  graphs made it capture them again step after step;
- the node key is the caller's: the executor keys a variant with workspaces by its op, not its
  node, with the workspace sizes in its shapes, so a model's layers share one scratch per shape
  (they run one after another on one stream: `ModelExecutor.variant_key`).
Cost: one dict lookup per node per eager run; a captured plan does not consult the cache at all.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from gpu_worker.config import DEFAULT_VARIANTS_PER_NODE


class GraphHolder(Protocol):
    def reset_graph(self) -> None:
        """Destroy the captured graph (which may bake workspace pointers); rebuild on next run."""


@dataclass(frozen=True)
class VariantSpec:
    """What the executor's builder resolves for a node at given shapes."""

    function: object                     # the loaded kernel function(s) the launcher takes
    workspace_bytes: dict[str, int] = field(default_factory=dict)
    launch: dict[str, object] = field(default_factory=dict)   # static launch parameters


@dataclass(eq=False)
class KernelVariant:
    node: Hashable
    shapes: tuple
    function: object
    workspaces: dict[str, object]        # name -> arena Allocation (.ptr, .size)
    launch: dict[str, object]
    holders: set = field(default_factory=set)
    evicted: bool = False

    @property
    def workspace_bytes(self) -> int:
        return sum(a.size for a in self.workspaces.values())

    def workspace_ptr(self, name: str) -> int:
        """The workspace's address; 0 where the op asked no bytes of it at these shapes."""
        assert not self.evicted, f"variant {self.node}@{self.shapes} used after eviction"
        alloc = self.workspaces.get(name)
        return alloc.ptr if alloc is not None else 0


class KernelCache:
    """Bounded per-node LRU of kernel variants. Thread-safe; builders run under the lock."""

    def __init__(self, arena, variants_per_node: int | None = None,
                 zero: Callable[[int, int], None] | None = None) -> None:
        self.arena = arena
        self._zero = zero   # (ptr, nbytes): a new workspace's bytes to zero before its first use
        self.bound = DEFAULT_VARIANTS_PER_NODE if variants_per_node is None else variants_per_node
        if self.bound < 1:
            raise ValueError(f"variants_per_node must be >= 1, got {self.bound}")
        self._nodes: dict[Hashable, OrderedDict[tuple, KernelVariant]] = {}
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = 0
        self.quarantined: list[KernelVariant] = []

    def resolve(self, node: Hashable, shapes: tuple, build: Callable[[], VariantSpec]) -> KernelVariant:
        """The variant for (node, shapes), built on a miss; evicts the node's LRU variant if full."""
        with self._lock:
            lru = self._nodes.setdefault(node, OrderedDict())
            variant = lru.get(shapes)
            if variant is not None:
                self.hits += 1
                lru.move_to_end(shapes)
                return variant
            self.misses += 1
            spec = build()
            # Make room before allocating, so peak workspace never exceeds the bound.
            while len(lru) >= self.bound:
                _, victim = lru.popitem(last=False)
                self._evict(victim)
            workspaces: dict[str, object] = {}
            try:
                for name, nbytes in spec.workspace_bytes.items():
                    if nbytes > 0:
                        workspaces[name] = self.arena.alloc(nbytes, "workspace", role="workspace")
                        if self._zero is not None:
                            self._zero(workspaces[name].ptr, nbytes)
            except BaseException:
                for alloc in workspaces.values():
                    self.arena.free(alloc)
                raise
            variant = KernelVariant(node, shapes, spec.function, workspaces, dict(spec.launch))
            lru[shapes] = variant
            return variant

    def hold(self, variant: KernelVariant, holder: GraphHolder) -> None:
        """Register `holder` as a captured graph that may bake `variant`'s workspace pointers."""
        with self._lock:
            assert not variant.evicted, "a graph must not capture an evicted variant"
            variant.holders.add(holder)

    def forget_holder(self, holder: GraphHolder) -> None:
        """The holder destroyed its graph (or was released): it no longer pins anything."""
        with self._lock:
            for lru in self._nodes.values():
                for variant in lru.values():
                    variant.holders.discard(holder)

    def _evict(self, victim: KernelVariant) -> None:
        # Order matters: reset every graph that may replay with these pointers, then free.
        # Without workspaces nothing is freed, so the graphs stay valid and are kept.
        try:
            for holder in list(victim.holders) if victim.workspaces else ():
                holder.reset_graph()
        except BaseException:
            # A graph that may still hold the pointers survives: never free under it. The
            # workspaces stay allocated (and booked), out of the LRU, counted as quarantined.
            self.quarantined.append(victim)
            raise
        victim.holders.clear()
        victim.evicted = True
        for alloc in victim.workspaces.values():
            self.arena.free(alloc)
        self.evictions += 1

    def clear(self) -> int:
        """Evict everything (trim, unload); returns the workspace bytes released."""
        with self._lock:
            freed = 0
            for lru in self._nodes.values():
                while lru:
                    _, victim = lru.popitem(last=False)
                    freed += victim.workspace_bytes
                    self._evict(victim)
            self._nodes.clear()
            return freed

    def variants(self, node: Hashable) -> list[tuple]:
        """Shapes held for `node`, least recently used first."""
        with self._lock:
            return list(self._nodes.get(node, {}))

    def stats(self) -> dict[str, int]:
        with self._lock:
            counts = [len(lru) for lru in self._nodes.values()]
            return {
                "entries": sum(counts),
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "max_variants_per_node": max(counts, default=0),
                "workspace_bytes": sum(v.workspace_bytes for lru in self._nodes.values()
                                       for v in lru.values()),
                "variant_bound": self.bound,
                "quarantined": len(self.quarantined),
            }
