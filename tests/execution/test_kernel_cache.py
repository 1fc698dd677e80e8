"""Per-node kernel cache invariants (DESIGN 1.1, 2.4), on the cache structure itself."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpu_worker.execution.kernel_cache import KernelCache, VariantSpec


@dataclass
class Alloc:
    ptr: int
    size: int
    zone: str


class RecordingArena:
    """Allocates distinct pointers and records alloc/free events in order."""

    def __init__(self, log: list) -> None:
        self.log, self.next, self.live = log, 0x1000, {}

    def alloc(self, nbytes, zone, role="default"):
        a = Alloc(self.next, nbytes, zone)
        self.next += nbytes
        self.live[a.ptr] = a
        self.log.append(("alloc", a.ptr, zone))
        return a

    def free(self, a, fence_streams=None):
        assert a.ptr in self.live, f"double free of {a.ptr:#x}"
        del self.live[a.ptr]
        self.log.append(("free", a.ptr))


class Holder:
    def __init__(self, log):
        self.log = log

    def reset_graph(self):
        self.log.append(("reset", id(self)))


def spec(nbytes=64):
    return VariantSpec(function="fn", workspace_bytes={"scratch": nbytes})


def test_kernel_cache_bounds_the_shape_variants_it_keeps_per_node():
    log: list = []
    arena = RecordingArena(log)
    cache = KernelCache(arena, variants_per_node=4)
    for n in range(24):
        for node in ("attn", "mlp"):
            cache.resolve(node, ((n + 1, 64),), lambda n=n: spec(128 * (n + 1)))
        assert cache.stats()["max_variants_per_node"] <= 4, "per-node bound broken"
    s = cache.stats()
    assert s["entries"] == 8 and s["evictions"] == 40 and s["misses"] == 48, s
    assert s["workspace_bytes"] == sum(a.size for a in arena.live.values()), \
        "workspace bytes held must equal the arena bytes still allocated"
    assert all(a.zone == "workspace" for a in arena.live.values()), "workspaces booked outside the zone"


def test_kernel_cache_lru_keeps_the_decode_variant_through_new_prefill_shapes():
    cache = KernelCache(RecordingArena([]), variants_per_node=4)
    decode = ((1, 64),)
    cache.resolve("attn", decode, spec)
    for n in range(2, 30):
        cache.resolve("attn", ((n, 64),), spec)     # a run of new prefill shapes...
        cache.resolve("attn", decode, spec)         # ...each followed by a decode step
    assert decode in cache.variants("attn"), "LRU evicted the decode variant (FIFO behaviour)"
    assert cache.stats()["hits"] == 28


def test_kernel_cache_resets_graph_holders_before_freeing_a_variant_workspace():
    log: list = []
    cache = KernelCache(RecordingArena(log), variants_per_node=1)
    v = cache.resolve("attn", ((8, 64),), spec)
    holder = Holder(log)
    cache.hold(v, holder)
    ptr = v.workspaces["scratch"].ptr
    cache.resolve("attn", ((9, 64),), spec)
    assert log.index(("reset", id(holder))) < log.index(("free", ptr)), \
        "a workspace was freed before the graph holding its pointer was reset"
    assert v.evicted and not v.holders


def test_kernel_cache_limit_one_thousand_lifts_the_bound():
    cache = KernelCache(RecordingArena([]), variants_per_node=1000)
    for n in range(24):
        cache.resolve("attn", ((n + 1, 64),), spec)
    assert cache.stats()["entries"] == 24 and cache.stats()["evictions"] == 0


def test_kernel_cache_bound_defaults_to_16_and_the_environment_is_read_only_at_the_edge(monkeypatch):
    monkeypatch.setenv("GPUPLANE_KERNEL_VARIANTS_PER_NODE", "7")   # the serve flag's default
    assert KernelCache(RecordingArena([])).bound == 16, "the core read the environment"
    assert KernelCache(RecordingArena([]), 7).bound == 7


def test_kernel_cache_failed_workspace_allocation_leaves_nothing_behind():
    log: list = []
    arena = RecordingArena(log)

    class Failing(RecordingArena):
        def alloc(self, nbytes, zone, role="default"):
            if nbytes > 1000:
                raise MemoryError("no room")
            return super().alloc(nbytes, zone, role)
    failing = Failing(log)
    cache = KernelCache(failing, variants_per_node=4)
    with pytest.raises(MemoryError):
        cache.resolve("attn", ((1,),), lambda: VariantSpec("fn", {"a": 10, "b": 5000}))
    assert not failing.live and cache.stats()["entries"] == 0, "a failed build leaked a workspace"
    del arena


def test_kernel_cache_clear_frees_every_workspace():
    log: list = []
    arena = RecordingArena(log)
    cache = KernelCache(arena, variants_per_node=4)
    for n in range(6):
        cache.resolve("attn", ((n,),), spec)
    assert cache.clear() == 4 * 64 and not arena.live, "clear must release every workspace"


def test_a_variant_whose_graph_cannot_be_reset_is_quarantined_not_freed():
    log: list = []
    arena = RecordingArena(log)
    cache = KernelCache(arena, variants_per_node=1)
    v = cache.resolve("attn", ((8, 64),), spec)

    class Stuck:
        def reset_graph(self):
            raise RuntimeError("graph destroy failed")
    cache.hold(v, Stuck())
    with pytest.raises(RuntimeError):
        cache.resolve("attn", ((9, 64),), spec)
    assert v.workspaces["scratch"].ptr in arena.live, "freed a workspace a live graph may still use"
    assert cache.stats()["quarantined"] == 1


def test_evicting_a_variant_without_workspaces_leaves_the_graphs_that_baked_it():
    """Nothing is freed, so nothing a graph baked dangles: resetting it would only make the
    next step capture it again (a serving worker's rungs outnumber the bound)."""
    log: list = []
    cache = KernelCache(RecordingArena(log), variants_per_node=1)
    v = cache.resolve("wqkv", ((8, 64),), lambda: VariantSpec("fn"))
    holder = Holder(log)
    cache.hold(v, holder)
    cache.resolve("wqkv", ((9, 64),), lambda: VariantSpec("fn"))
    assert v.evicted and cache.stats()["evictions"] == 1
    assert ("reset", id(holder)) not in log, "a graph was reset though nothing it baked was freed"


def test_every_new_workspace_is_zeroed_before_its_variant_is_handed_out():
    """A kernel may keep counters in its workspace that it leaves at zero (the cluster decode's):
    the cache zeroes each workspace it allocates, once, before the variant is returned; a hit
    zeroes nothing (the counters are the kernel's again), and a workspace of no bytes is none."""
    log: list = []
    cache = KernelCache(RecordingArena(log), zero=lambda ptr, n: log.append(("zero", ptr, n)))
    v = cache.resolve("attn", ((1, 64),), lambda: VariantSpec("fn", {"splits": 96, "cluster": 0}))
    assert log == [("alloc", v.workspace_ptr("splits"), "workspace"),
                   ("zero", v.workspace_ptr("splits"), 96)]
    assert v.workspace_ptr("cluster") == 0, "no bytes asked: no workspace, address 0"
    cache.resolve("attn", ((1, 64),), lambda: VariantSpec("fn", {"splits": 96}))
    assert len(log) == 2, "a hit must not zero a workspace a kernel may be using"
