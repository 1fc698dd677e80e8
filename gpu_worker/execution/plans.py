"""Shape plans: (model, batch, seq bucket) -> activation arena + resolved kernels + graph exec.

Hazard (DESIGN 1.2): plans retained per (batch, seq) forever, each with an arena, a matmul
workspace and a captured graph, OOMed a 6 GiB card under diverse batch shapes. A second failure
hid behind it: the plan map and its LRU list drifted apart when a run threw between insert and
touch, leaving a plan that no eviction could reach (a zombie) and an eviction that popped a key the
map no longer had (a crash).
Contract:
- at most `max_plans` plans per model (`--max-plans`, default 2) and optionally at most
  `max_bytes` of activation + graph memory;
- the map is the LRU (one OrderedDict): they cannot drift; a plan is touched when inserted, before
  its run, and again after it, whether the run returned or threw;
- victims are released only after the stream is synchronized (their graphs may still be running),
  and the plan just executed is never the victim; on a miss at the bound the LRU plan is released
  before the new one is built, so two plans' arenas never coexist beyond the bound;
- prefill lengths are bucketed onto a small ladder, so a model holds few distinct shapes;
- a plan class with a finite shape set of its own (the batched decoder's graphs, one per rung of
  its batch ladder: `bound_class("paged_decode", 7)`; its prefill graphs, one per chunk bucket:
  `bound_class("paged_prefill", 8)`) is counted against its own bound, not
  `max_plans`: a continuous-batching step alternates a decode graph with prefill chunks, and with
  all of them under one bound of 2 every change of batch rung or chunk shape evicted the graph
  the next step needed and captured it again. The class's shapes are finite, so its number and
  memory stay bounded (and booked like every plan); the byte bound still covers every class.
Cost: an eviction costs one stream synchronize, paid only when a bound is exceeded.
"""
from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from gpu_worker.config import DEFAULT_MAX_PLANS

# Powers of two from 16; beyond the ladder a prompt is rounded up to a multiple of the last rung.
SEQ_LADDER = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

T = TypeVar("T")
_ANY_CLASS = object()     # _evict_lru's "victims of any class"


def seq_bucket(n: int, ladder: tuple[int, ...] = SEQ_LADDER) -> int:
    """The smallest rung >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {n}")
    i = bisect.bisect_left(ladder, n)
    if i < len(ladder):
        return ladder[i]
    top = ladder[-1]
    return -(-n // top) * top


class Plan(Protocol):
    activation_bytes: int
    graph_bytes: int

    def release(self) -> int:
        """Free the plan's graph and activations; returns the bytes released."""


class PlanCache:
    """LRU of warm plans for one model."""

    def __init__(self, max_plans: int | None = None, max_bytes: int | None = None,
                 synchronize: Callable[[], None] = lambda: None,
                 shared_bytes: Callable[[], int] = lambda: 0) -> None:
        """`shared_bytes`: activation bytes the plans hold in arenas they share
        (class_arena.py), counted once, beside each plan's own."""
        self.max_plans = DEFAULT_MAX_PLANS if max_plans is None else max_plans
        if self.max_plans < 1:
            raise ValueError(f"max_plans must be >= 1, got {self.max_plans}")
        self.max_bytes = max_bytes
        self._synchronize = synchronize
        self._shared_bytes = shared_bytes
        self._plans: OrderedDict[Hashable, Plan] = OrderedDict()
        self._class_bounds: dict[Hashable, int] = {}
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = 0

    def bound_class(self, kind: Hashable, max_plans: int) -> None:
        """Count plans whose key is a tuple starting with `kind` against `max_plans` of their own
        (a finite shape set, e.g. one graph per rung of a batch ladder) instead of the cache's."""
        if max_plans < 1:
            raise ValueError(f"a plan class bound must be >= 1, got {max_plans}")
        with self._lock:
            self._class_bounds[kind] = max_plans

    def _class_of(self, key: Hashable) -> Hashable:
        if isinstance(key, tuple) and key and key[0] in self._class_bounds:
            return key[0]
        return None          # the cache's own bound

    def _bound(self, cls: Hashable) -> int:
        return self.max_plans if cls is None else self._class_bounds[cls]

    def _count(self, cls: Hashable) -> int:
        return sum(1 for k in self._plans if self._class_of(k) == cls)

    def run(self, key: Hashable, build: Callable[[], Plan], execute: Callable[[Plan], T]) -> T:
        """Run `execute` on the plan for `key` (built on a miss), then enforce the bound."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                self.misses += 1
                # Make room first, so a new plan's arena never coexists with the victim's.
                cls = self._class_of(key)
                self._evict_lru(lambda: self._count(cls) >= self._bound(cls), protect=key,
                                within=cls)
                plan = build()
                self._plans[key] = plan       # insert...
            else:
                self.hits += 1
            self._plans.move_to_end(key)      # ...and touch before the run
            try:
                return execute(plan)
            finally:
                if key in self._plans:
                    self._plans.move_to_end(key)   # touch again after, even when it threw
                self._enforce(protect=key)

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and self.total_bytes() > self.max_bytes

    def _enforce(self, protect: Hashable) -> None:
        for cls in {self._class_of(k) for k in self._plans}:
            self._evict_lru(lambda c=cls: self._count(c) > self._bound(c), protect, within=cls)
        self._evict_lru(self._over_bytes, protect)

    def _evict_lru(self, over: Callable[[], bool], protect: Hashable,
                   within: Hashable = _ANY_CLASS) -> None:
        """Pop least recently used plans (of class `within`, or of any class) while `over()`."""
        victims = []
        order = [k for k in self._plans if k != protect and    # LRU first, never the protected
                 (within is _ANY_CLASS or self._class_of(k) == within)]
        while over() and order:
            key = order.pop(0)
            victims.append((key, self._plans.pop(key)))
        if not victims:
            return
        try:
            self._synchronize()          # their graphs may still be executing on the stream
        except BaseException:
            for key, v in reversed(victims):   # cannot free safely: keep them reachable
                self._plans[key] = v
                self._plans.move_to_end(key, last=False)
            raise
        self._release_all([v for _, v in victims])

    def _release_all(self, plans: list[Plan]) -> int:
        """Release each plan even when one release fails; the first failure is re-raised."""
        freed, failure = 0, None
        for plan in plans:
            try:
                freed += plan.release()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others
                failure = failure or exc
            self.evictions += 1
        if failure is not None:
            raise failure
        return freed

    def evict_all(self) -> int:
        """Release every plan (trim, unload) after synchronizing; returns bytes released."""
        with self._lock:
            if not self._plans:
                return 0
            self._synchronize()
            plans = list(self._plans.values())
            self._plans.clear()
            return self._release_all(plans)

    def keys(self) -> list[Hashable]:
        """Plan keys, least recently used first."""
        with self._lock:
            return list(self._plans)

    def get(self, key: Hashable) -> Plan | None:
        with self._lock:
            return self._plans.get(key)

    def total_bytes(self) -> int:
        return (sum(p.activation_bytes + p.graph_bytes for p in self._plans.values())
                + self._shared_bytes())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._plans),
                "evictions": self.evictions,
                "hits": self.hits,
                "misses": self.misses,
                "graph_bytes": sum(p.graph_bytes for p in self._plans.values()),
                "activation_bytes": (sum(p.activation_bytes for p in self._plans.values())
                                     + self._shared_bytes()),
            }
