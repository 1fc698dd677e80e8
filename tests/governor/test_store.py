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
