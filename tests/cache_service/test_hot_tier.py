"""The in-memory hot tier: bounded, in step with SQLite (also across kill -9), never serving
bytes whose digest was not verified."""
from __future__ import annotations

import os
import pathlib
import random
import signal
import sqlite3
import threading

import grpc
import pytest
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

from cache_service.artifact import Artifact
from cache_service.client import KernelCacheClient
from cache_service.convert import artifact_from_pb, artifact_to_pb, found_response_bytes
from cache_service.hot_tier import HotTier
from cache_service.store import ArtifactStore, StoreConfig
from services.common.errors import InvalidArgument
from tests.cache_service.cache_helpers import TOKEN
from tests.cache_service.test_integration import _spawn_server
from tests.cache_service.test_store import _flip_byte_of

KiB = 1024


def art(size: int, seed: int) -> Artifact:
    data = (seed.to_bytes(4, "little") + os.urandom(28)) * (size // 32 + 1)
    return Artifact(data[:size], "cubin", "sm_90", "13.0", f"m{seed}", 0.05)


def sqlite_rows(db: pathlib.Path) -> dict[tuple[str, str], str]:
    conn = sqlite3.connect(db)
    try:
        return {(ns, k): sha for ns, k, sha in
                conn.execute("SELECT namespace, key, sha256 FROM entries")}
    finally:
        conn.close()


def assert_in_step(store: ArtifactStore, db: pathlib.Path) -> None:
    rows = sqlite_rows(db)
    stray = {e: sha for e, sha in store.hot_snapshot().items() if rows.get(e) != sha}
    assert not stray, f"the hot tier holds {len(stray)} artifacts SQLite does not: {list(stray)[:3]}"


@pytest.fixture
def db(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "cache.sqlite"


def test_the_hot_tier_stays_within_its_byte_budget_and_skips_blobs_over_a_quarter_of_it() -> None:
    tier = HotTier(budget_bytes=100 * KiB)
    for i in range(20):
        tier.put(("default", f"k{i}"), art(10 * KiB, i))
        assert tier.bytes <= 100 * KiB, f"{tier.bytes} bytes held on a 100 KiB budget"
    assert len(tier) == 10 and ("default", "k19") in tier.snapshot(), "LRU must keep the newest"
    tier.put(("default", "big"), art(26 * KiB, 99))
    assert ("default", "big") not in tier.snapshot(), "a blob over a quarter of the budget was kept"


def test_a_stored_artifact_is_served_from_memory_with_the_same_bytes(db) -> None:
    a = art(8 * KiB, 1)
    with ArtifactStore(db, StoreConfig(hot_bytes=1 << 20)) as store:
        store.store("k", a)
        got = [store.lookup("k") for _ in range(3)]
        s = store.stats()
    assert all(g is not None and g.data == a.data and g.sha256 == a.sha256 for g in got)
    assert s.hot_hits == 3 and s.hits == 3 and s.hot_entries == 1 and s.hot_bytes == 8 * KiB, s


def test_the_first_read_after_a_restart_fills_the_tier_and_the_next_is_from_memory(db) -> None:
    with ArtifactStore(db) as store:
        store.store("k", art(4 * KiB, 2))
    with ArtifactStore(db) as store:
        assert store.stats().hot_entries == 0, "a restart starts with an empty tier"
        store.lookup("k")
        assert store.stats().hot_hits == 0 and store.stats().hot_entries == 1
        store.lookup("k")
        assert store.stats().hot_hits == 1


def test_hot_bytes_zero_turns_the_tier_off(db) -> None:
    with ArtifactStore(db, StoreConfig(hot_bytes=0)) as store:
        store.store("k", art(4 * KiB, 3))
        assert store.lookup("k") is not None
        assert store.stats().hot_entries == 0 and store.stats().hot_hits == 0
    with pytest.raises(InvalidArgument):
        StoreConfig(hot_bytes=-1)


def test_bytes_corrupted_at_rest_are_quarantined_and_never_reach_memory(db) -> None:
    good = art(8 * KiB, 7)
    with ArtifactStore(db) as store:
        store.store("k", good)
    _flip_byte_of(db, good.data[1000:1100])
    with ArtifactStore(db) as store:
        for _ in range(3):
            assert store.lookup("k") is None, "corrupt bytes were served"
        assert store.hot_snapshot() == {}, "a corrupt row reached the hot tier"
        assert store.stats().quarantined == 1 and store.stats().hot_hits == 0


def test_a_row_whose_digest_column_disagrees_with_its_bytes_never_reaches_memory(db) -> None:
    with ArtifactStore(db) as store:
        store.store("k", art(KiB, 4))
    conn = sqlite3.connect(db)
    conn.execute("UPDATE entries SET data = ? WHERE key = 'k'", (b"x" * KiB,))
    conn.commit()
    conn.close()
    with ArtifactStore(db) as store:
        assert store.lookup("k") is None and store.hot_snapshot() == {}


def test_a_store_with_a_wrong_digest_is_refused_and_not_kept_in_memory(db) -> None:
    with ArtifactStore(db) as store:
        with pytest.raises(InvalidArgument):
            store.store("k", art(KiB, 5), sha256="0" * 64)
        assert store.hot_snapshot() == {} and store.lookup("k") is None


def test_evicted_and_pruned_entries_leave_memory_and_a_re_store_never_serves_old_bytes(db) -> None:
    config = StoreConfig(budget_bytes=64 * KiB, low_watermark=0.5, hot_bytes=1 << 20)
    with ArtifactStore(db, config) as store:
        for i in range(12):
            store.store(f"k{i}", art(8 * KiB, i))
            assert_in_step(store, db)
        assert ("default", "k0") not in store.hot_snapshot(), "an evicted entry stayed in memory"
        store.prune(8 * KiB)
        assert_in_step(store, db)
        assert len(store.hot_snapshot()) <= 1
        fresh = art(8 * KiB, 100)
        store.store("k0", fresh)  # the key comes back with other bytes
        assert store.lookup("k0").data == fresh.data


def _decoded(encoded: bytes | None) -> Artifact | None:
    if encoded is None:
        return None
    response = pb.LookupResponse.FromString(encoded)
    assert response.found, "an encoded hit said not found"
    artifact, claimed = artifact_from_pb(response.artifact)
    assert claimed == artifact.sha256, "an encoded hit carries a digest that is not its bytes'"
    return artifact


_READS = {"artifact": lambda store, key: store.lookup(key),
          "encoded": lambda store, key: _decoded(store.lookup_encoded(key, "", found_response_bytes))}


@pytest.mark.parametrize("read", sorted(_READS))
def test_memory_stays_in_step_with_sqlite_under_concurrent_stores_reads_and_evictions(
        db, read: str) -> None:
    config = StoreConfig(budget_bytes=96 * KiB, low_watermark=0.6, hot_bytes=48 * KiB)
    # Two artifacts per key: after an eviction the key may come back with the other one.
    variants = {f"k{i}": [art(s * KiB, i * 10 + v) for v, s in enumerate((2 + i % 3, 6 + i % 5))]
                for i in range(30)}
    digests = {k: {a.sha256 for a in v} for k, v in variants.items()}
    with ArtifactStore(db, config) as store:
        stop = threading.Event()
        bad: list[str] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                key = f"k{rng.randrange(30)}"
                got = _READS[read](store, key)
                if got is not None and got.sha256 not in digests[key]:
                    bad.append(key)

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        try:
            rng = random.Random(0)
            for _ in range(300):
                key = f"k{rng.randrange(30)}"
                if store.lookup(key) is None:  # absent: store either variant
                    store.store(key, rng.choice(variants[key]))
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        assert not bad, f"a lookup served bytes that were never stored under its key: {bad[:3]}"
        s = store.stats()
        assert s.hot_bytes <= 48 * KiB and s.evictions > 0 and s.hot_hits > 0, s
        assert_in_step(store, db)


def test_an_encoded_hit_is_made_once_kept_with_its_entry_and_counted_in_the_budget() -> None:
    tier = HotTier(budget_bytes=100 * KiB)
    a, made = art(20 * KiB, 1), []

    def encode(x: Artifact) -> bytes:
        made.append(x)
        return found_response_bytes(x)

    tier.put(("default", "k"), a)
    held = tier.get(("default", "k"), a.sha256)
    first = tier.encoded(("default", "k"), held, encode)
    again = tier.encoded(("default", "k"), held, encode)
    assert first is again and len(made) == 1, "the encoding was made more than once"
    assert _decoded(first).data == a.data, "the encoding is not the held artifact's response"
    assert tier.bytes == a.size + len(first), "the kept encoding is not counted in the budget"
    other = art(20 * KiB, 2)  # the key re-stored with other bytes: the old encoding goes with it
    tier.put(("default", "k"), other)
    assert tier.encoded(("default", "k"), held, encode) is None, "an encoding of replaced bytes"
    assert tier.bytes == other.size
    tier.drop(("default", "k"))
    assert tier.encoded(("default", "k"), other, encode) is None and tier.bytes == 0


def test_encodings_give_way_to_artifacts_and_never_push_one_out_of_the_tier() -> None:
    tier = HotTier(budget_bytes=100 * KiB)
    arts = [art(20 * KiB, i) for i in range(5)]
    for i, a in enumerate(arts[:3]):
        tier.put(("default", f"k{i}"), a)
        tier.encoded(("default", f"k{i}"), a, found_response_bytes)
        assert tier.bytes <= 100 * KiB, f"{tier.bytes} bytes held on a 100 KiB budget"
    assert tier.bytes > 60 * KiB + 20 * KiB, "no encoding was kept though they fit"
    for i, a in enumerate(arts[3:], start=3):  # the artifacts now fill the budget alone
        tier.put(("default", f"k{i}"), a)
        tier.encoded(("default", f"k{i}"), a, found_response_bytes)
        assert tier.bytes <= 100 * KiB, f"{tier.bytes} bytes held on a 100 KiB budget"
    assert len(tier.snapshot()) == 5, "an encoding pushed an artifact out of the tier"
    assert tier.bytes == 100 * KiB, "encodings kept where only the artifacts fit"
    tier.put(("default", "k5"), art(20 * KiB, 5))  # one more artifact: the LRU one goes
    assert ("default", "k0") not in tier.snapshot() and len(tier.snapshot()) == 5


def test_an_encoded_lookup_sends_the_current_bytes_and_nothing_after_prune_or_quarantine(
        db) -> None:
    with ArtifactStore(db, StoreConfig(hot_bytes=1 << 20)) as store:
        a, b = art(8 * KiB, 1), art(8 * KiB, 2)
        store.store("k", a)
        assert store.lookup_encoded("nope", "", found_response_bytes) is None, "a miss encoded"
        for _ in range(2):
            assert store.lookup_encoded("k", "", found_response_bytes) == found_response_bytes(a)
        s = store.stats()
        assert s.hits == 2 and s.hot_hits == 2 and s.hot_bytes > 2 * a.size, s
        store.prune(1)  # down to 1 byte: everything goes
        assert store.lookup_encoded("k", "", found_response_bytes) is None, "a pruned entry sent"
        assert store.hot_snapshot() == {}
        store.store("k", b)  # back with other bytes: the kept encoding of `a` must be gone
        for _ in range(2):
            assert _decoded(store.lookup_encoded("k", "", found_response_bytes)).data == b.data
    good = art(8 * KiB, 7)
    with ArtifactStore(db) as store:
        store.store("c", good)
    _flip_byte_of(db, good.data[1000:1100])
    with ArtifactStore(db) as store:
        assert store.lookup_encoded("c", "", found_response_bytes) is None, "corrupt bytes sent"
        assert store.hot_snapshot() == {} and store.stats().quarantined == 1


def test_after_kill_9_the_restarted_server_serves_exactly_what_sqlite_holds(tmp_path) -> None:
    db = tmp_path / "cache.sqlite"
    proc, port = _spawn_server(db)
    acked: dict[str, str] = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.KernelCacheServiceStub(channel)
            for i in range(40):
                a = art(20 * KiB, i)
                stub.Store(pb.StoreRequest(key=f"k{i}", artifact=artifact_to_pb(a)), timeout=10,
                           metadata=(("authorization", f"Bearer {TOKEN}"),))
                acked[f"k{i}"] = a.sha256
                stub.Lookup(pb.LookupRequest(key=f"k{i}"), timeout=10)  # served from memory
            assert stub.GetStats(pb.GetStatsRequest(), timeout=10).hot_hits >= 40
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    rows = sqlite_rows(db)
    assert {k: sha for (_, k), sha in rows.items()} == acked, \
        "SQLite after kill -9 differs from what the server acknowledged"
    proc, port = _spawn_server(db)
    try:
        client = KernelCacheClient(f"127.0.0.1:{port}", deadline_s=10.0)
        found = client.batch_lookup(list(acked))
        again = client.batch_lookup(list(acked))  # now from the refilled hot tier
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)
    for served in (found, again):
        assert {k: a.sha256 for k, a in served.items()} == acked, \
            "the restarted server served something other than SQLite's rows"
