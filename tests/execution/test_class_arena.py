"""One activation arena for a plan class whose plans never run at once (class_arena.py)."""
from __future__ import annotations

import pytest

from gpu_worker.execution.class_arena import ClassArenas
from gpu_worker.execution.plans import PlanCache


class FakeArena:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self._next = 0

    def alloc(self, size, zone, role=""):
        self._next += 1
        self.live[self._next] = size
        return type("Alloc", (), {"ptr": self._next * 4096, "size": size, "id": self._next})()

    def free(self, alloc) -> None:
        del self.live[alloc.id]


def test_plans_of_a_shared_class_hold_one_allocation_until_the_last_is_released():
    arena = FakeArena()
    arenas = ClassArenas(arena)
    arenas.share("paged_prefill", lambda: 1000)
    a = arenas.acquire(("paged_prefill", 16), 100)
    b = arenas.acquire(("paged_prefill", 512), 1000)
    assert a is b and list(arena.live.values()) == [1000] and arenas.bytes() == 1000
    assert arenas.acquire(("paged_decode", 8), 50) is None, "a class that does not share"
    assert arenas.release(("paged_prefill", 16)) == 0 and arenas.bytes() == 1000
    assert arenas.release(("paged_prefill", 512)) == 1000
    assert arena.live == {} and arenas.bytes() == 0


def test_a_plan_larger_than_its_class_arena_is_refused_and_takes_no_share():
    arenas = ClassArenas(FakeArena())
    arenas.share("paged_prefill", lambda: 1000)
    arenas.acquire(("paged_prefill", 16), 100)
    with pytest.raises(RuntimeError, match="more than its class's shared arena"):
        arenas.acquire(("paged_prefill", 4096), 5000)
    assert arenas.release(("paged_prefill", 16)) == 1000, "the refused plan was not counted"


def test_the_plan_cache_counts_a_shared_arena_once():
    arenas = ClassArenas(FakeArena())
    arenas.share("k", lambda: 1000)

    class Plan:
        graph_bytes = 10

        def __init__(self, key):
            self.key = key
            arenas.acquire(key, 500)
            self.activation_bytes = 0

        def release(self):
            return self.graph_bytes + arenas.release(self.key)
    cache = PlanCache(2, shared_bytes=arenas.bytes)
    cache.bound_class("k", 8)
    for rows in (16, 32, 64):
        cache.run(("k", rows), lambda rows=rows: Plan(("k", rows)), lambda p: None)
    assert cache.total_bytes() == 3 * 10 + 1000
    assert cache.stats()["activation_bytes"] == 1000
    assert cache.evict_all() == 3 * 10 + 1000 and cache.total_bytes() == 0
