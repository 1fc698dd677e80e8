"""Durable state of the governor: devices, workers and leases in SQLite (WAL).

Hazard: a governor that forgets a lease grants the same memory twice, and two workers then OOM
each other. Contract: every change to devices, workers or leases is committed (one transaction,
`BEGIN IMMEDIATE`) before the call that made it returns, so a governor killed with `kill -9` at
any instant restarts knowing every lease it ever answered for (a one-row change is a single
autocommit statement, which is its own transaction). Heartbeats are not written: after a
restart every loaded lease gets a fresh TTL, which errs on the side of holding memory, never of
granting it twice.
Cost: one WAL append of one page (the leases table is one b-tree) per Acquire/Resize/Release,
~10 us of CPU. `synchronous=NORMAL` survives a process crash; a power loss may drop the last
transactions (use `durable=True`, i.e. synchronous=FULL, to survive that too, at an fsync per
change).
One writer: the ledger calls the store under its own lock, so the connection is never shared by
two threads at once (check_same_thread is off only because that thread varies).
"""
from __future__ import annotations

import logging
import pathlib
import sqlite3
import threading
from dataclasses import dataclass

import sqlite_utils

log = logging.getLogger(__name__)

_LEASES_TABLE = """CREATE TABLE {if_not_exists} {name} (
    lease_id TEXT PRIMARY KEY NOT NULL, worker_id TEXT NOT NULL, device_uuid TEXT NOT NULL,
    zone TEXT NOT NULL, bytes INTEGER NOT NULL) WITHOUT ROWID"""

@dataclass(frozen=True)
class DeviceRow:
    uuid: str
    name: str
    total_bytes: int
    budget_bytes: int
    granule_bytes: int


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    device_uuid: str
    host: str
    # The live incarnation's proof (services.governor.ledger): kept across a governor restart, so
    # the worker that holds the id keeps it and no other process can take it over meanwhile.
    incarnation: str = ""


@dataclass(frozen=True)
class LeaseRow:
    lease_id: str
    worker_id: str
    device_uuid: str
    zone: str
    bytes: int


class Store:
    """SQLite persistence; `path=":memory:"` for tests that do not need a file."""

    def __init__(self, path: str | pathlib.Path, durable: bool = False) -> None:
        if str(path) != ":memory:":
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self.db = sqlite_utils.Database(self._conn)
        try:
            self._create_schema()
        except BaseException:
            self._conn.close()
            raise
        # A WAL checkpoint copies the log into the database and fsyncs; left automatic it runs
        # inside whichever commit crosses 1000 pages, and that Acquire takes ~3-4 ms instead of
        # ~30 us (p999 3.3 ms vs 0.2 ms of Ledger.acquire, 2-core VM, 2026-11-29). Checkpoints
        # run instead on their own connection and thread, off every call's path.
        self._checkpointer: _Checkpointer | None = None
        if str(path) != ":memory:":
            self._conn.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = _Checkpointer(str(path))

    def _create_schema(self) -> None:
        self.db["devices"].create(
            {"uuid": str, "name": str, "total_bytes": int, "budget_bytes": int, "granule_bytes": int},
            pk="uuid", if_not_exists=True,
        )
        self.db["workers"].create(
            {"worker_id": str, "device_uuid": str, "host": str, "incarnation": str},
            pk="worker_id", if_not_exists=True,
        )
        if "incarnation" not in self.db["workers"].columns_dict:
            # A database from before incarnations: its rows prove nothing, so the first
            # registration of each id (with any incarnation) claims it.
            self._conn.execute(
                "ALTER TABLE workers ADD COLUMN incarnation TEXT NOT NULL DEFAULT ''")
        # Every Acquire and Release writes this table, and a commit appends one WAL frame (a 4 KiB
        # page) per b-tree it touches. Keyed by lease_id WITHOUT ROWID, a lease lives in one
        # b-tree; the rowid layout also kept an index on lease_id and one on worker_id: three
        # frames per change, ~2x the statement's cost (20.8 vs 10.5 us per statement, 2-core VM,
        # 2026-12-01, docs/governor.md). Only deleting a whole worker filters by worker_id: a
        # scan of a table that holds the live leases, on a rare path.
        self._conn.execute(_LEASES_TABLE.format(name="leases", if_not_exists="IF NOT EXISTS"))
        self._migrate_leases()

    def _migrate_leases(self) -> None:
        """Move a database made before the WITHOUT ROWID layout onto it, in one transaction."""
        sql = self._conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'leases'").fetchone()[0]
        if "WITHOUT ROWID" in sql.upper():
            return
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.execute(_LEASES_TABLE.format(name="leases_new", if_not_exists=""))
            self._conn.execute("INSERT INTO leases_new (lease_id, worker_id, device_uuid, zone, "
                               "bytes) SELECT lease_id, worker_id, device_uuid, zone, bytes "
                               "FROM leases")
            self._conn.execute("DROP TABLE leases")  # its indexes go with it
            self._conn.execute("ALTER TABLE leases_new RENAME TO leases")
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        log.info("governor store: leases table moved to the one-b-tree layout")

    def _write(self, statements: list[tuple[str, tuple]]) -> None:
        """Run `statements` in one immediate transaction: all of them or none."""
        if len(statements) == 1:
            # In autocommit mode one statement is its own transaction, committed (appended to the
            # WAL) before execute returns: the same promise as BEGIN IMMEDIATE + COMMIT, in one
            # round trip instead of three (Acquire and Release write one row each).
            self._conn.execute(*statements[0])
            return
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                self._conn.execute(sql, params)
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def put_device(self, d: DeviceRow) -> None:
        self._write([(
            "INSERT OR REPLACE INTO devices VALUES (?, ?, ?, ?, ?)",
            (d.uuid, d.name, d.total_bytes, d.budget_bytes, d.granule_bytes),
        )])

    def put_worker(self, w: WorkerRow) -> None:
        self._write([(
            ("INSERT OR REPLACE INTO workers (worker_id, device_uuid, host, incarnation) "
             "VALUES (?, ?, ?, ?)"), (w.worker_id, w.device_uuid, w.host, w.incarnation),
        )])

    def delete_device(self, uuid: str) -> None:
        """Forget a device no worker is registered on (the ledger checks that first)."""
        self._write([("DELETE FROM devices WHERE uuid = ?", (uuid,))])

    def delete_worker(self, worker_id: str) -> None:
        """Forget a worker and every lease it held, in one transaction."""
        self._write([
            ("DELETE FROM leases WHERE worker_id = ?", (worker_id,)),
            ("DELETE FROM workers WHERE worker_id = ?", (worker_id,)),
        ])

    def put_lease(self, lease: LeaseRow) -> None:
        self._write([(
            "INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?, ?)",
            (lease.lease_id, lease.worker_id, lease.device_uuid, lease.zone, lease.bytes),
        )])

    def delete_lease(self, lease_id: str) -> None:
        self._write([("DELETE FROM leases WHERE lease_id = ?", (lease_id,))])

    def devices(self) -> list[DeviceRow]:
        return [DeviceRow(**r) for r in self.db["devices"].rows]

    def workers(self) -> list[WorkerRow]:
        return [WorkerRow(r["worker_id"], r["device_uuid"], r["host"], r["incarnation"] or "")
                for r in self.db["workers"].rows]

    def leases(self) -> list[LeaseRow]:
        return [LeaseRow(*r) for r in self._conn.execute(
            "SELECT lease_id, worker_id, device_uuid, zone, bytes FROM leases")]

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
        self._conn.close()


class _Checkpointer:
    """Checkpoints the WAL every `interval_s` on a separate connection (PASSIVE: never blocks a
    writer, and a reader holding an old snapshot only delays the copy)."""

    def __init__(self, path: str, interval_s: float = 1.0) -> None:
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="governor-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.checkpoint()

    def checkpoint(self) -> None:
        try:
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            log.warning("WAL checkpoint failed; retrying on the next tick", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.checkpoint()
        self._conn.close()
