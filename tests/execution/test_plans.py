"""Plan LRU invariants (DESIGN 1.2), on the cache structure itself."""
from __future__ import annotations

import pytest

from gpu_worker.execution.plans import PlanCache, seq_bucket


class RecordingPlan:
    """A plan whose release is observable: it records when it was released relative to syncs."""

    def __init__(self, key, log: list, nbytes: int = 100) -> None:
        self.key, self.log = key, log
        self.activation_bytes, self.graph_bytes = nbytes, 10
        self.released = False

    def release(self) -> int:
        assert not self.released, f"plan {self.key} released twice"
        self.released = True
        self.log.append(("release", self.key))
        return self.activation_bytes + self.graph_bytes


def make_cache(max_plans=2, max_bytes=None):
    log: list = []
    built: dict = {}
    cache = PlanCache(max_plans, max_bytes, synchronize=lambda: log.append(("sync",)))

    def run(key, fail=False):
        def build():
            built[key] = RecordingPlan(key, log)
            return built[key]

        def execute(plan):
            log.append(("run", key))
            if fail:
                raise RuntimeError(f"run of {key} failed")
            return key
        return cache.run(key, build, execute)
    return cache, run, log, built


def test_plan_cache_keeps_at_most_max_plans_and_evicts_least_recently_used():
    cache, run, _, built = make_cache(2)
    for key in ("a", "b", "a", "c"):
        run(key)
    assert cache.keys() == ["a", "c"], "LRU victim should be b (a was touched after b)"
    assert built["b"].released and not built["a"].released, "the evicted plan must be released"
    assert cache.stats()["entries"] == 2 and cache.stats()["evictions"] == 1


def test_plan_cache_synchronizes_before_releasing_a_victim():
    _cache, run, log, _ = make_cache(1)
    run("a")
    run("b")
    assert log.index(("sync",)) < log.index(("release", "a")), "a victim was freed before the sync"


def test_plan_cache_never_evicts_the_plan_just_executed():
    cache, run, _, built = make_cache(1, max_bytes=50)   # every plan alone exceeds the byte bound
    run("a")
    run("b")
    assert cache.keys() == ["b"], "the just-executed plan must survive even over the byte bound"
    assert not built["b"].released


def test_two_throwing_runs_on_new_shapes_then_a_third_shape_keep_the_bound_without_zombies():
    cache, run, _, built = make_cache(2)
    run("a")
    for key in ("b", "c"):
        with pytest.raises(RuntimeError):
            run(key, fail=True)
    assert run("d") == "d"
    assert len(cache.keys()) <= 2, f"bound broken: {cache.keys()}"
    live = {k for k, p in built.items() if not p.released}
    assert live == set(cache.keys()), f"plan outside the LRU (zombie) or LRU entry released: {live}"


def test_plan_cache_byte_bound_evicts_until_under_budget():
    cache, run, _, _ = make_cache(10, max_bytes=250)
    for key in "abcd":
        run(key)
    assert cache.keys() == ["c", "d"], f"byte bound (2 x 110 <= 250) not kept: {cache.keys()}"


def test_evict_all_releases_every_plan_after_one_sync():
    cache, run, _log, built = make_cache(3)
    for key in "abc":
        run(key)
    freed = cache.evict_all()
    assert freed == 330 and all(p.released for p in built.values()), "evict_all left a plan"
    assert cache.keys() == []


def test_seq_bucket_rounds_up_onto_the_ladder():
    assert [seq_bucket(n) for n in (1, 16, 17, 469, 5502, 9000)] == [16, 16, 32, 512, 8192, 16384]
    assert len({seq_bucket(n) for n in range(1, 8193)}) == 10, "the ladder should stay small"


def test_a_new_plan_is_built_only_after_the_lru_victim_was_released():
    log: list = []
    cache = PlanCache(1, synchronize=lambda: log.append(("sync",)))

    def build(key):
        log.append(("build", key))
        return RecordingPlan(key, log)
    cache.run("a", lambda: build("a"), lambda p: None)
    cache.run("b", lambda: build("b"), lambda p: None)
    assert log.index(("release", "a")) < log.index(("build", "b")), \
        "the new plan's memory was allocated while the victim still held its own"


def test_a_bounded_plan_class_is_counted_apart_from_max_plans():
    cache, run, _, built = make_cache(1)
    cache.bound_class("ladder", 2)
    for key in (("ladder", 1), "p", ("ladder", 2), "q", ("ladder", 1), ("ladder", 4)):
        run(key)
    keys = cache.keys()
    assert sorted(k for k in keys if isinstance(k, tuple)) == [("ladder", 1), ("ladder", 4)], keys
    assert [k for k in keys if not isinstance(k, tuple)] == ["q"], "other plans keep max_plans"
    assert built[("ladder", 2)].released and built["p"].released
    assert not built[("ladder", 1)].released, "a class's LRU victim comes from its own class"


def test_a_plan_class_bound_is_at_least_one():
    cache, *_ = make_cache(2)
    with pytest.raises(ValueError):
        cache.bound_class("ladder", 0)
