"""The governor's SQLite store: what a call acknowledges is committed before it returns."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from services.governor.store import LeaseRow, Store

WRITER = textwrap.dedent("""
    import sys
    from services.governor.store import LeaseRow, Store
    store = Store(sys.argv[1])
    i = 0
    while True:  # acknowledge each lease on stdout once put_lease has returned, until killed
        store.put_lease(LeaseRow(f"l-{i}", "w", "GPU-0", "kv", 1 << 20))
        print(f"l-{i}", flush=True)
        i += 1
""")


def test_a_single_row_write_is_committed_before_it_returns(tmp_path):
    store = Store(tmp_path / "gov.sqlite")
    try:
        store.put_lease(LeaseRow("l-1", "w", "GPU-0", "kv", 64))
        assert not store._conn.in_transaction, "a write must not leave a transaction open"
        other = sqlite3.connect(tmp_path / "gov.sqlite")
        try:
            rows = other.execute("SELECT lease_id, bytes FROM leases").fetchall()
        finally:
            other.close()
        assert rows == [("l-1", 64)], "another connection must see the row as soon as it returns"
    finally:
        store.close()


def test_a_multi_statement_change_is_all_or_nothing(tmp_path):
    store = Store(tmp_path / "gov.sqlite")
    try:
        store.put_lease(LeaseRow("l-1", "w", "GPU-0", "kv", 64))
        with pytest.raises(sqlite3.OperationalError):
            store._write([("DELETE FROM leases WHERE lease_id = ?", ("l-1",)),
                          ("DELETE FROM no_such_table", ())])
        assert [r.lease_id for r in store.leases()] == ["l-1"], \
            "a failed change must roll back its earlier statements"
        assert not store._conn.in_transaction
    finally:
        store.close()


def test_every_acknowledged_lease_survives_sigkill_of_the_writer(tmp_path):
    db = tmp_path / "gov.sqlite"
    Store(db).close()  # schema first, so the child's first write is a lease
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE,
                            text=True)
    acknowledged = []
    try:
        while len(acknowledged) < 300:
            line = proc.stdout.readline()
            assert line, "the writer died before it was killed"
            acknowledged.append(line.strip())
        proc.send_signal(signal.SIGKILL)  # mid-stream: it is writing the next leases
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    store = Store(db)
    try:
        stored = {r.lease_id for r in store.leases()}
    finally:
        store.close()
    missing = [i for i in acknowledged if i not in stored]
    assert not missing, f"acknowledged leases lost by kill -9: {missing[:5]}"


def _old_layout(db) -> None:
    """A database as the store made it before the WITHOUT ROWID leases table."""
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE leases (lease_id TEXT PRIMARY KEY, worker_id TEXT, "
                     "device_uuid TEXT, zone TEXT, bytes INTEGER)")
        conn.execute("CREATE INDEX idx_leases_worker_id ON leases (worker_id)")
        conn.executemany("INSERT INTO leases VALUES (?, ?, ?, ?, ?)",
                         [(f"l-{i}", f"w{i % 3}", "GPU-0", "kv", i << 20) for i in range(50)])
    conn.close()


def test_a_lease_change_touches_one_btree(tmp_path):
    store = Store(tmp_path / "gov.sqlite")
    try:
        tables = store._conn.execute(
            "SELECT name FROM sqlite_master WHERE tbl_name = 'leases'").fetchall()
        sql = store._conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'leases'").fetchone()[0]
    finally:
        store.close()
    assert tables == [("leases",)], f"no index beside the table's own b-tree: {tables}"
    assert "WITHOUT ROWID" in sql


def test_an_old_layout_database_keeps_every_lease_when_moved_to_one_btree(tmp_path):
    db = tmp_path / "gov.sqlite"
    _old_layout(db)
    store = Store(db)
    try:
        leases = sorted(store.leases(), key=lambda r: int(r.lease_id[2:]))
        store.delete_worker("w1")  # the worker filter still works without its index
        left = {r.worker_id for r in store.leases()}
    finally:
        store.close()
    assert leases == [LeaseRow(f"l-{i}", f"w{i % 3}", "GPU-0", "kv", i << 20) for i in range(50)]
    assert left == {"w0", "w2"}
    reopened = Store(db)  # a second open finds the new layout and leaves it alone
    try:
        assert len(reopened.leases()) == 50 - 17
    finally:
        reopened.close()


def test_a_failed_move_to_one_btree_changes_nothing(tmp_path, monkeypatch):
    db = tmp_path / "gov.sqlite"
    _old_layout(db)
    monkeypatch.setattr("services.governor.store._LEASES_TABLE",
                        "CREATE TABLE {if_not_exists} {name} (lease_id TEXT PRIMARY KEY, "
                        "bytes INTEGER NOT NULL) WITHOUT ROWID")
    with pytest.raises(sqlite3.OperationalError):
        Store(db)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT count(*) FROM leases").fetchone()[0]
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert rows == 50 and "leases_new" not in names and "idx_leases_worker_id" in names
