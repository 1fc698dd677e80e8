"""cache_service.store: budgets, LRU order, namespaces, corruption, idempotence, vacuum, durability."""
from __future__ import annotations

import hashlib
import os
import pathlib
import sqlite3

import pytest

from cache_service.artifact import Artifact
from cache_service.store import ArtifactStore, StoreConfig, read_entries
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound

KiB = 1 << 10


def art(size: int, seed: int = 0, kind: str = "cubin") -> Artifact:
    data = (seed.to_bytes(4, "little") + os.urandom(16)) * (size // 20 + 1)
    return Artifact(data=data[:size], kind=kind, arch="sm_90", nvrtc_version="13.0",
                    module_name=f"mod{seed}", compile_seconds=0.08)


@pytest.fixture
def db(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "cache.sqlite"


def keys_of(store: ArtifactStore) -> set[str]:
    return {k for (_, k) in store._index.oldest_first()}


def test_store_opens_sqlite_in_wal_with_normal_sync_and_incremental_vacuum(db):
    with ArtifactStore(db) as store:
        assert store.pragma("journal_mode") == "wal", "the store must run in WAL mode"
        assert store.pragma("synchronous") == 1, "synchronous must be NORMAL (1)"
        assert store.pragma("auto_vacuum") == 2, "auto_vacuum must be INCREMENTAL (2)"
        assert store.pragma("busy_timeout") == 5000, "a busy timeout must be set"


def test_a_second_store_on_the_same_database_file_is_refused(db):
    with ArtifactStore(db), pytest.raises(FailedPrecondition, match="one server per database"):
        ArtifactStore(db)
    ArtifactStore(db).close()  # released on close


def test_global_budget_holds_after_every_store_and_prunes_to_the_low_watermark(db):
    budget = 100 * KiB
    with ArtifactStore(db, StoreConfig(budget_bytes=budget, low_watermark=0.5)) as store:
        evicted_at = []
        for i in range(40):
            outcome = store.store(f"k{i}", art(10 * KiB, i))
            assert store.stats().total_bytes <= budget, f"budget broken after store {i}"
            if outcome.evicted_entries:
                evicted_at.append(i)
                assert store.stats().total_bytes <= budget * 0.5 + 10 * KiB, \
                    "an eviction must prune down to the low watermark, not just below the budget"
        assert len(evicted_at) < 15, "watermark pruning should evict in batches, not on every store"
        assert store.stats().evictions == 40 - store.stats().entries


def test_eviction_follows_last_access_and_a_hit_moves_an_entry_to_most_recently_used(db):
    with ArtifactStore(db, StoreConfig(budget_bytes=30 * KiB, low_watermark=1.0)) as store:
        for k in ("a", "b", "c"):
            store.store(k, art(10 * KiB))
        assert store.lookup("a") is not None
        store.store("d", art(10 * KiB))
        assert keys_of(store) == {"a", "c", "d"}, "the hit on 'a' must have made 'b' the LRU victim"
        store.store("e", art(10 * KiB))
        assert keys_of(store) == {"a", "d", "e"}, "'c' was least recently used next"


def test_recency_survives_a_restart_through_lazily_persisted_access_times(db):
    config = StoreConfig(budget_bytes=30 * KiB, low_watermark=1.0)
    with ArtifactStore(db, config) as store:
        for k in ("a", "b", "c"):
            store.store(k, art(10 * KiB))
        store.lookup("a")
    with ArtifactStore(db, config) as store:
        store.store("d", art(10 * KiB))
        assert keys_of(store) == {"a", "c", "d"}, "the hit on 'a' before restart was forgotten"
        hits = sqlite3.connect(db).execute("SELECT hits FROM entries WHERE key='a'").fetchone()[0]
        assert hits == 1, "per-entry hit counts must be persisted"


def test_namespace_budget_evicts_only_inside_its_namespace(db):
    config = StoreConfig(budget_bytes=0, namespace_budgets={"small": 20 * KiB}, low_watermark=1.0)
    with ArtifactStore(db, config) as store:
        store.store("x", art(10 * KiB), namespace="big")
        for k in ("a", "b", "c"):
            store.store(k, art(10 * KiB), namespace="small")
        stats = {n.namespace: n for n in store.stats().namespaces}
        assert stats["small"].total_bytes <= 20 * KiB, "namespace budget broken"
        assert store.lookup("x", "big") is not None, "another namespace's entry was evicted"
        assert store.lookup("a", "small") is None, "the namespace's LRU entry should be gone"
        assert store.lookup("a", "big") is None, "namespaces must not share keys"


def test_empty_namespace_is_the_default_namespace(db):
    with ArtifactStore(db) as store:
        store.store("k", art(KiB))
        assert store.lookup("k", "default") is not None, "'' and 'default' must be one namespace"


def test_same_key_same_digest_is_idempotent(db):
    with ArtifactStore(db) as store:
        a = art(4 * KiB, 1)
        assert store.store("k", a).stored
        outcome = store.store("k", Artifact(a.data, "cubin", "sm_90", "13.0", "other-name"))
        assert not outcome.stored and not outcome.digest_conflict, "a re-store must be a no-op"
        assert store.stats().entries == 1 and store.stats().stores == 1


def test_same_key_different_digest_keeps_the_first_and_flags_the_conflict(db, caplog):
    with ArtifactStore(db) as store:
        first, second = art(4 * KiB, 1), art(4 * KiB, 2)
        store.store("k", first)
        outcome = store.store("k", second)
        assert outcome.digest_conflict and not outcome.stored, "a conflict must be reported"
        assert store.lookup("k").sha256 == first.sha256, "the first artifact must be kept"
        assert store.stats().digest_conflicts == 1, "the conflict must be counted in stats"
        assert any("digest conflict" in r.getMessage() for r in caplog.records), "and logged"
        row = sqlite3.connect(db).execute("SELECT kept_sha256, offered_sha256 FROM conflicts")
        assert row.fetchone() == (first.sha256, second.sha256), "and recorded for operators"


@pytest.mark.parametrize("call, message", [
    (lambda s: s.store("", art(KiB)), "key is empty"),
    (lambda s: s.store("k", art(KiB), sha256="0" * 64), "does not match"),
    (lambda s: s.store("k", art(KiB), sha256=""), "does not match"),
    (lambda s: s.store("k", art(65 * KiB)), "limit"),
    (lambda s: s.store("k", art(KiB), namespace="bad ns!"), "namespace"),
    (lambda s: s.store("k", Artifact(b"", "ptx", "sm_90", "13.0", "m")), "empty"),
    (lambda s: s.store("k" * 300, art(KiB)), "key must match"),
])
def test_bad_store_raises_invalid_argument_and_changes_nothing(db, call, message):
    with ArtifactStore(db, StoreConfig(max_artifact_bytes=64 * KiB)) as store:
        store.store("keep", art(KiB))
        before = store.stats()
        with pytest.raises(InvalidArgument, match=message):
            call(store)
        after = store.stats()
        assert (after.entries, after.total_bytes, after.stores) == \
               (before.entries, before.total_bytes, before.stores), "a bad store changed the cache"


def test_artifact_larger_than_a_budget_is_invalid_and_evicts_nothing(db):
    with ArtifactStore(db, StoreConfig(budget_bytes=8 * KiB)) as store:
        store.store("keep", art(KiB))
        with pytest.raises(InvalidArgument, match="budget"):
            store.store("huge", art(9 * KiB))
        assert store.lookup("keep") is not None, "a refused store must not evict anything"


def _flip_byte_of(path: pathlib.Path, needle: bytes) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.find(needle)
    assert at >= 0, "artifact bytes not found in the database file"
    raw[at + len(needle) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_bytes_corrupted_in_the_db_file_are_a_counted_miss_and_the_entry_is_quarantined(db, caplog):
    good = art(8 * KiB, 7)
    with ArtifactStore(db) as store:
        store.store("k", good)
        store.store("other", art(8 * KiB, 8))
    _flip_byte_of(db, good.data[1000:1100])  # bit rot in the blob's page, as a disk would do it
    with ArtifactStore(db) as store:
        assert store.lookup("k") is None, "corrupt bytes were served"
        stats = store.stats()
        assert stats.corrupt == 1 and stats.quarantined == 1, "corruption must be counted"
        assert stats.misses == 1 and stats.entries == 1, "a corrupt read is a miss and removed"
        assert store.lookup("other") is not None, "the database must stay readable"
        assert any("quarantined" in r.getMessage() for r in caplog.records)
        assert store.store("k", good).stored, "a quarantined key can be stored again"
        assert store.lookup("k").data == good.data
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT key, reason FROM quarantine").fetchall() == \
        [("k", "digest mismatch on read")], "the quarantine must record what was moved aside"


def test_a_digest_column_edited_in_the_database_is_caught_on_read(db):
    with ArtifactStore(db) as store:
        store.store("k", art(KiB))
    conn = sqlite3.connect(db)
    conn.execute("UPDATE entries SET data = ? WHERE key = 'k'", (b"x" * KiB,))
    conn.commit()
    conn.close()
    with ArtifactStore(db) as store:
        assert store.lookup("k") is None and store.stats().corrupt == 1, "edited bytes were served"


def test_database_file_shrinks_when_content_is_pruned(db):
    with ArtifactStore(db, StoreConfig(budget_bytes=0)) as store:
        for i in range(24):
            store.store(f"k{i}", art(128 * KiB, i))
        store.maintain()
        full = store.db_file_bytes()
        outcome = store.prune(target_bytes=1)
        store.maintain()
        assert outcome.evicted_entries == 24 and store.stats().total_bytes == 0
        assert store.db_file_bytes() < full // 10, \
            f"the file did not shrink with its content ({full} -> {store.db_file_bytes()})"


def test_budget_lowered_at_restart_is_enforced_when_the_store_opens(db):
    with ArtifactStore(db, StoreConfig(budget_bytes=0)) as store:
        for i in range(10):
            store.store(f"k{i}", art(10 * KiB, i))
    with ArtifactStore(db, StoreConfig(budget_bytes=50 * KiB)) as store:
        assert store.stats().total_bytes <= 50 * KiB, "a lowered budget must hold after reopen"
        assert store.lookup("k9") is not None and store.lookup("k0") is None, "LRU order kept"


def test_batch_lookup_answers_in_order_and_omits_what_exceeds_the_byte_cap(db):
    with ArtifactStore(db) as store:
        for k in ("a", "b", "c"):
            store.store(k, art(10 * KiB))
        results = store.batch_lookup(["a", "zz", "b", "c"], max_bytes=15 * KiB)
        assert results[0] is not None and results[1] is None, "order and misses must be kept"
        assert all(type(r).__name__ == "Omitted" for r in results[2:]), "cap must be respected"


def test_concurrent_reads_and_evicting_rewrites_never_count_corruption(db):
    import threading

    config = StoreConfig(budget_bytes=40 * KiB, low_watermark=0.5)
    with ArtifactStore(db, config) as store:
        stop = threading.Event()
        served: list[tuple[str, Artifact]] = []

        def reader() -> None:
            while not stop.is_set():
                for k in ("k0", "k1", "k2", "k3"):
                    got = store.lookup(k)
                    if got is not None:
                        served.append((k, got))

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(300):  # every re-store of a key after its eviction carries new bytes
            store.store(f"k{i % 4}", art(8 * KiB, i))
            store.store(f"filler{i}", art(8 * KiB, 10_000 + i))
        stop.set()
        for t in threads:
            t.join()
        assert served, "the readers never saw a hit"
        assert store.stats().corrupt == 0, "a row replaced under a reader was taken for corruption"
        assert all(a.module_name.startswith("mod") for _, a in served)


def test_a_hit_carries_the_digest_of_the_bytes_it_returns(db):
    with ArtifactStore(db) as store:
        stored = art(3 * KiB, 5)
        store.store("k", stored)
        got = store.lookup("k")
        assert got.sha256 == stored.sha256 == hashlib.sha256(got.data).hexdigest(), \
            "the digest served with a hit must be the digest of its bytes"


def test_entries_list_the_last_use_and_hits_the_store_has_seen_before_they_are_persisted(db):
    now = [1000.0]
    with ArtifactStore(db, clock=lambda: now[0]) as store:
        store.store("a", art(2 * KiB), namespace="prod")
        now[0] += 1
        store.store("b", art(1 * KiB, 1, kind="ptx"))
        now[0] += 1
        assert store.lookup("a", "prod") is not None   # a hit, not yet written to the file
        live = store.entries()
        assert [(e.namespace, e.key) for e in live] == [("prod", "a"), ("default", "b")], \
            "a hit must make an entry the most recently used at once"
        assert (live[0].size, live[0].kind, live[0].hits, live[0].last_access) == (
            2 * KiB, "cubin", 1, 1002.0)
        assert (live[1].kind, live[1].arch, live[1].hits) == ("ptx", "sm_90", 0)
        assert [e.key for e in store.entries("prod")] == ["a"], "--namespace must filter"
        on_disk = read_entries(db)
        assert on_disk[0].key == "b" and on_disk[1].hits == 0, \
            "negative control: the file has not seen the hit before maintenance"
        store.maintain()
        assert read_entries(db) == store.entries(), \
            "after a maintenance pass the file and the live store must agree"


def test_read_entries_refuses_a_missing_file_and_a_database_that_is_not_a_cache(tmp_path):
    with pytest.raises(NotFound, match="no kernel cache database"):
        read_entries(tmp_path / "absent.sqlite")
    assert not (tmp_path / "absent.sqlite").exists(), "reading must not create the file"
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(FailedPrecondition, match="not a kernel cache database"):
        read_entries(other)
