"""The paged KV pool on a real sim device: stable base, granule growth and shrink, ledger."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.device.ledger import local_budget
from gpu_worker.engines.scheduler.kv_pool import BlockTable, KVBlockPool, KVGeometry
from services.common.errors import InvalidArgument
from tests.device.conftest import GRANULE, make_device

# 2 layers x K/V x 16 tokens x 2 heads x 16 dims x 2 bytes = 4 KiB: 16 blocks per 64 KiB granule
GEO = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=256)


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


def kv_booked(dev) -> int:
    return dev.ledger.snapshot().get("kv", (0, 0))[0]


def test_the_pool_base_address_never_moves_as_it_grows(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=64)
    base = pool.base
    assert base % GRANULE == 0
    got = [pool.allocate(5) for _ in range(10)]
    assert all(g is not None for g in got)
    assert pool.base == base and pool.committed == 4 * GRANULE   # 50 blocks: 4 granules
    dev.to_device(pool.base + 49 * GEO.block_bytes, __import__("numpy").ones(8, "u1"))
    pool.close()


def test_blocks_are_allocated_lowest_free_first(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=64)
    a = pool.allocate(4)
    b = pool.allocate(4)
    assert a == [0, 1, 2, 3] and b == [4, 5, 6, 7]
    pool.free([1, 2])
    assert pool.allocate(3) == [1, 2, 8]
    pool.close()


def test_every_commit_is_booked_in_zone_kv_and_released_by_shrink(dev):
    before = kv_booked(dev)
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=64)
    assert kv_booked(dev) == before            # carving books nothing
    blocks = pool.allocate(20)                 # 2 granules
    assert kv_booked(dev) - before == 2 * GRANULE
    pool.free(blocks)
    assert pool.shrink() == 2 * GRANULE
    dev.queue.drain()            # the fenced releases (compute and copy streams)
    assert kv_booked(dev) == before and pool.used_blocks() == 0
    pool.close()


def test_the_pool_shrinks_only_free_top_granules(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=64)
    low = pool.allocate(16)      # granule 0
    mid = pool.allocate(16)      # granule 1
    top = pool.allocate(16)      # granule 2
    assert pool.committed == 3 * GRANULE
    pool.free(mid)
    assert pool.shrink() == 0    # the top granule is used: a hole below it stays committed
    pool.free(top)
    assert pool.shrink() == 2 * GRANULE and pool.committed == GRANULE
    assert pool.usable_blocks == 16 and pool.free_blocks() == 0
    pool.free(low[8:])
    assert pool.shrink() == 0    # granule 0 still holds blocks 0..7
    assert pool.allocate(1) == [8]
    pool.close()


def test_a_full_pool_answers_none_and_takes_nothing(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=20)
    assert pool.allocate(18) is not None
    committed = pool.committed
    assert pool.allocate(3) is None
    assert pool.used_blocks() == 18 and pool.committed == committed
    assert pool.allocate(2) is not None
    pool.close()


def test_a_budget_refusal_stops_growth_without_error():
    # the kv zone refuses past the device budget: the pool keeps what it has and answers None
    d = make_device(budget=local_budget((16 << 20) + 3 * GRANULE), total=(16 << 20) + 64 * GRANULE)
    try:
        pool = KVBlockPool(d.arena, GEO, capacity_blocks=1000)
        got = pool.allocate(16)
        assert got is not None
        assert pool.allocate(1000) is None
        assert pool.used_blocks() == 16
        assert kv_booked(d) <= 3 * GRANULE
        pool.close()
    finally:
        d.close()


def test_a_double_free_is_refused(dev):
    pool = KVBlockPool(dev.arena, GEO, capacity_blocks=16)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(InvalidArgument):
        pool.free(blocks[:1])
    pool.close()


def test_block_tokens_must_be_a_power_of_two_in_range():
    for bad in (8, 24, 512):
        with pytest.raises(InvalidArgument):
            KVGeometry(layers=1, kv_heads=1, head_dim=16, block_tokens=bad, max_context=64)


def test_a_block_table_row_is_padded_with_zeros_to_max_blocks():
    t = BlockTable(GEO)
    assert t.blocks_needed(17) == 2
    t.extend([5, 3])
    assert t.row().dtype == np.int32
    assert list(t.row()) == [5, 3] + [0] * (GEO.max_blocks - 2)
    assert t.blocks_needed(32) == 0 and t.blocks_needed(33) == 1


def test_a_block_table_row_follows_its_blocks_through_extend_and_clear():
    t = BlockTable(GEO)
    t.extend([7])
    t.extend([2, 9])
    assert list(t.row()[:4]) == [7, 2, 9, 0] and t.blocks == [7, 2, 9]
    assert t.clear() == [7, 2, 9]
    assert t.blocks == [] and not t.row().any(), "a cleared table must not keep stale blocks"
    t.extend([4])
    assert list(t.row()[:2]) == [4, 0]
