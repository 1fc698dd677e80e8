"""The kernel cache's domain core: artifacts in SQLite under LRU byte budgets. Never imports grpc.

Hazard: SQLite allows one writer at a time. Two writers on one connection interleave statements of
different transactions; two writers on two connections wait on the file lock and fail with
SQLITE_BUSY after the busy timeout, a stall that lands on every client's deadline. A crash between
the statements of a multi-statement write (delete victims, insert the new entry) would leave the
budget broken or a half-written row.
Contract: one writer connection behind one lock; every multi-statement write is one `BEGIN
IMMEDIATE` transaction (the write lock is taken at BEGIN, so a transaction never fails half-way on
a lock upgrade); WAL so readers (one connection per thread) never block the writer or each other;
`synchronous=NORMAL`, so a Store acknowledged to a client survives kill -9 of the server (the WAL
is in the OS page cache) though not a power cut, an accepted trade for a cache. One server per
database file: an exclusive `flock` on `<db>.lock` refuses a second one.
Ordering lives in memory (`RecencyIndex`): a hit moves an entry to most-recently-used at once;
`last_access` and hit counts reach the database in batches with the next write or maintenance pass.
Cost: a hit from the in-memory hot tier (`hot_tier.HotTier`, filled on store and on first read)
is a dict lookup; past it, one indexed SELECT of the blob plus a SHA-256 of it (~0.15 ms per
256 KiB); a store
is one fsync-free transaction; eviction prunes to a low watermark so it runs once per ~10 % of
turnover, followed by an incremental vacuum that gives the freed pages back to the file system.
"""
from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Self

import sqlite_utils

from cache_service.artifact import Artifact, sha256_hex
from cache_service.hot_tier import DEFAULT_HOT_BYTES, HotTier
from cache_service.recency import EntryId, EntryMeta, RecencyIndex
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "default"
DEFAULT_BUDGET_BYTES = 256 << 20
# Below the servers' 64 MiB max message size with room for the envelope; NVRTC CUBINs are ~KiB-MiB.
DEFAULT_MAX_ARTIFACT_BYTES = 32 << 20
_KEY_RE = re.compile(r"^[A-Za-z0-9._:/+=-]{1,256}$")
_NS_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_FIELD_MAX = 256
_QUARANTINE_KEEP = 1000  # rows of quarantine/conflict history kept for operators

_SCHEMA_VERSION = 1
_WAL_TRUNCATE_BYTES = 4 << 20  # maintenance truncates a fully checkpointed WAL above this size
_READER_CACHE_KIB = 8 << 10  # page cache per reader connection (see _connect)


@dataclass(frozen=True)
class StoreConfig:
    budget_bytes: int = DEFAULT_BUDGET_BYTES  # 0 = unbounded
    namespace_budgets: Mapping[str, int] = field(default_factory=dict)
    low_watermark: float = 0.9
    max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES
    busy_timeout_ms: int = 5000
    # Dirty last-access records that make a read path flush them early (bounds memory and staleness).
    access_flush_threshold: int = 4096
    hot_bytes: int = DEFAULT_HOT_BYTES  # in-memory tier of verified artifacts; 0 = off

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise InvalidArgument("budget_bytes cannot be negative (0 = unbounded)")
        if self.hot_bytes < 0:
            raise InvalidArgument("hot_bytes cannot be negative (0 = no in-memory tier)")
        if not 0.0 < self.low_watermark <= 1.0:
            raise InvalidArgument("low_watermark must be in (0, 1]")
        for ns, budget in self.namespace_budgets.items():
            if not _NS_RE.match(ns) or budget < 0:
                raise InvalidArgument(f"bad namespace budget {ns}={budget}")

    def budget_for(self, ns: str) -> int:
        return self.namespace_budgets.get(ns, 0)


@dataclass(frozen=True)
class StoreOutcome:
    stored: bool  # False: an entry with this key already existed (identical or conflicting)
    digest_conflict: bool = False
    evicted_entries: int = 0


@dataclass(frozen=True)
class PruneOutcome:
    evicted_entries: int
    freed_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class NamespaceStats:
    namespace: str
    entries: int
    total_bytes: int
    budget_bytes: int


@dataclass(frozen=True)
class CacheStats:
    entries: int
    total_bytes: int
    budget_bytes: int
    hits: int
    misses: int
    evictions: int
    stores: int
    corrupt: int
    digest_conflicts: int
    compile_seconds_saved: float
    db_file_bytes: int
    quarantined: int
    max_artifact_bytes: int
    low_watermark: float
    namespaces: list[NamespaceStats]
    hot_entries: int = 0
    hot_bytes: int = 0
    hot_budget_bytes: int = 0
    hot_hits: int = 0
    bytes_served: int = 0


@dataclass(frozen=True)
class EntryInfo:
    """One entry as an operator lists it (`python -m cache_service list`): no bytes."""
    namespace: str
    key: str
    kind: str           # "ptx" | "cubin"
    arch: str
    size: int
    last_access: float  # unix seconds
    hits: int


_ENTRIES_SQL = ("SELECT namespace, key, kind, arch, size, last_access, hits FROM entries{where} "
                "ORDER BY last_access DESC, rowid DESC")


def _select_entries(conn: sqlite3.Connection, namespace: str | None) -> list[EntryInfo]:
    if namespace is None:
        rows = conn.execute(_ENTRIES_SQL.format(where=""))
    else:
        rows = conn.execute(_ENTRIES_SQL.format(where=" WHERE namespace = ?"),
                            (normalize_namespace(namespace),))
    return [EntryInfo(ns, key, kind, arch or "", size, last or 0.0, hits or 0)
            for ns, key, kind, arch, size, last, hits in rows]


def read_entries(path: pathlib.Path | str, namespace: str | None = None,
                 busy_timeout_ms: int = 5000) -> list[EntryInfo]:
    """The entries of a database file, most recently used first, read while another process may
    be serving it: a read-only connection (WAL readers never block the server) and no file lock.
    Last use is as persisted, which trails the server's memory by at most one maintenance pass
    (`--maintenance-s`); `ArtifactStore.entries` on the serving process is exact."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise NotFound(f"no kernel cache database at {path} (pass --db, or set GPUPLANE_CACHE_DB)")
    conn = _connect(path, busy_timeout_ms, read_only=True)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "entries" not in tables:
            raise FailedPrecondition(f"{path} is not a kernel cache database (no entries table)")
        return _select_entries(conn, namespace)
    finally:
        conn.close()


class Omitted:
    """Batch lookup marker: the entry exists but did not fit under the response byte cap."""


OMITTED = Omitted()


def normalize_namespace(namespace: str) -> str:
    ns = namespace or DEFAULT_NAMESPACE
    if not _NS_RE.match(ns):
        raise InvalidArgument(f"namespace {namespace!r} must match {_NS_RE.pattern}")
    return ns


def validate_key(key: str) -> str:
    if not key:
        raise InvalidArgument("key is empty: pass the artifact's cache key (a hex digest)")
    if not _KEY_RE.match(key):
        raise InvalidArgument(f"key must match {_KEY_RE.pattern} (got {len(key)} chars)")
    return key


def _connect(path: pathlib.Path, busy_timeout_ms: int, read_only: bool) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions; we say BEGIN IMMEDIATE where we mean it.
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False,
                           timeout=busy_timeout_ms / 1000)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    if read_only:
        conn.execute("PRAGMA query_only=1")
        # A blob larger than the page cache (default 2 MiB) is re-read page by page from the OS:
        # a 4 MiB hit took 6.5 ms instead of 0.26 ms. 8 MiB per reader thread covers the largest
        # common CUBINs; mmap would too, but turns a disk I/O error into SIGBUS.
        conn.execute(f"PRAGMA cache_size=-{_READER_CACHE_KIB}")
    return conn


class ArtifactStore:
    """Artifacts keyed by (namespace, key) with LRU byte budgets, digest checks and quarantine."""

    def __init__(self, path: pathlib.Path | str, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = pathlib.Path(path)
        self.config = config or StoreConfig()
        self._clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Held for the life of the store (released in close()), so no with-block.
        self._lock_file = open(self.path.with_name(self.path.name + ".lock"), "a+")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise FailedPrecondition(
                f"{self.path} is already served by another process; one server per database file"
            ) from None
        self._write_lock = threading.Lock()  # the one writer
        self._index_lock = threading.Lock()  # index, dirty access records, counters; held briefly
        self._index = RecencyIndex()
        # Verified artifacts in memory; filled and emptied only under _index_lock, in step with
        # the index (see cache_service.hot_tier for the contract).
        self._hot = HotTier(self.config.hot_bytes)
        self._dirty: dict[EntryId, tuple[float, int]] = {}  # entry -> (last access, hits since flush)
        self._readers = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._closed = False
        self._counters = {"hits": 0, "misses": 0, "evictions": 0, "stores": 0, "corrupt": 0,
                              "digest_conflicts": 0, "quarantined": 0, "bytes_served": 0}
        self._compile_seconds_saved = 0.0
        # Called with the entry after every Store (the key is present then, whichever digest it
        # kept), outside every lock: single-flight claims end there (cache_service.claims).
        self._store_listeners: list[Callable[[EntryId], None]] = []
        self._writer = _connect(self.path, self.config.busy_timeout_ms, read_only=False)
        self._db = sqlite_utils.Database(self._writer)
        self._create_schema()
        self._load_index()
        if self._over_budget():
            self.prune(0)

    # -- setup ---------------------------------------------------------------------------------

    def _create_schema(self) -> None:
        w = self._writer
        # auto_vacuum only takes effect if set before the first table is created.
        w.execute("PRAGMA auto_vacuum=INCREMENTAL")
        w.execute("PRAGMA journal_mode=WAL")
        w.execute("PRAGMA synchronous=NORMAL")
        # A checkpoint copies the WAL into the file and fsyncs, inside the commit that triggers
        # it. The default (1000 pages = 4 MiB) checkpoints on every 4 MiB store (36 ms p50 vs
        # 12 ms measured); 8192 pages amortises it. The WAL is trimmed back to 32 MiB on reset.
        w.execute("PRAGMA wal_autocheckpoint=8192")
        w.execute(f"PRAGMA journal_size_limit={32 << 20}")
        if "entries" not in self._db.table_names():
            w.execute("BEGIN IMMEDIATE")
            try:
                self._db["entries"].create(
                    {"namespace": str, "key": str, "kind": str, "arch": str, "nvrtc_version": str,
                     "module_name": str, "size": int, "sha256": str, "data": bytes,
                     "created": float, "last_access": float, "hits": int, "compile_seconds": float},
                    pk=("namespace", "key"),
                    not_null={"namespace", "key", "kind", "size", "sha256", "data"},
                )
                self._db["entries"].create_index(["last_access"])
                self._db["quarantine"].create(
                    {"id": int, "namespace": str, "key": str, "expected_sha256": str,
                     "actual_sha256": str, "size": int, "reason": str, "at": float}, pk="id")
                self._db["conflicts"].create(
                    {"id": int, "namespace": str, "key": str, "kept_sha256": str,
                     "offered_sha256": str, "at": float}, pk="id")
                w.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
                w.execute("COMMIT")
            except BaseException:
                w.execute("ROLLBACK")
                raise
        version = w.execute("PRAGMA user_version").fetchone()[0]
        if version != _SCHEMA_VERSION:
            raise FailedPrecondition(f"{self.path} has schema {version}, expected {_SCHEMA_VERSION}")

    def _load_index(self) -> None:
        rows = self._writer.execute(
            "SELECT namespace, key, size, sha256, compile_seconds FROM entries "
            "ORDER BY last_access, rowid")
        for ns, key, size, sha, cs in rows:
            self._index.add((ns, key), EntryMeta(size=size, sha256=sha, compile_seconds=cs or 0.0))

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._readers, "conn", None)
        if conn is None:
            conn = _connect(self.path, self.config.busy_timeout_ms, read_only=True)
            self._readers.conn = conn
            with self._index_lock:
                self._reader_conns.append(conn)
        return conn

    # -- reads ---------------------------------------------------------------------------------

    def lookup(self, key: str, namespace: str = "") -> Artifact | None:
        """The artifact, or None (a miss). Corrupt bytes are never returned: they are quarantined."""
        entry = (normalize_namespace(namespace), validate_key(key))
        return self._read(entry, self._clock())

    def lookup_encoded(self, key: str, namespace: str,
                       encode: Callable[[Artifact], bytes]) -> bytes | None:
        """Like `lookup`, answered as `encode(artifact)` (a serialized hit response), or None for
        a miss. The encoding of a hot artifact is made once and kept with it in the hot tier, so
        a repeated hit neither converts nor copies the bytes again."""
        entry = (normalize_namespace(namespace), validate_key(key))
        artifact = self._read(entry, self._clock())
        if artifact is None:
            return None
        kept = self._hot.encoded(entry, artifact, encode)
        return kept if kept is not None else encode(artifact)

    def lookup_present(self, key: str, namespace: str = "") -> Artifact | None:
        """Like `lookup`, but an absent key is not counted as a miss (a claim's check, not a read)."""
        entry = (normalize_namespace(namespace), validate_key(key))
        with self._index_lock:
            if self._index.get(entry) is None:
                return None
        return self._read(entry, self._clock())

    def batch_lookup(self, keys: Iterable[str], namespace: str = "",
                     max_bytes: int | None = None) -> list[Artifact | None | Omitted]:
        """One result per key, in order; past `max_bytes` of data, found entries are OMITTED."""
        ns = normalize_namespace(namespace)
        entries = [(ns, validate_key(k)) for k in keys]
        now = self._clock()
        results: list[Artifact | None | Omitted] = []
        budget = max_bytes if max_bytes is not None else float("inf")
        for entry in entries:
            with self._index_lock:
                meta = self._index.get(entry)
            if meta is not None and results and meta.size > budget:
                results.append(OMITTED)  # the first result always fits: progress is guaranteed
                continue
            artifact = self._read(entry, now)
            if artifact is not None:
                budget -= artifact.size
            results.append(artifact)
        return results

    def _read(self, entry: EntryId, now: float) -> Artifact | None:
        with self._index_lock:
            meta = self._index.touch(entry)
            if meta is None:
                self._counters["misses"] += 1
                return None
            last, hits = self._dirty.get(entry, (now, 0))
            self._dirty[entry] = (max(last, now), hits + 1)
        hot = self._hot.get(entry, meta.sha256)
        if hot is not None:
            return self._hit(hot)
        row = self._reader().execute(
            "SELECT data, sha256, kind, arch, nvrtc_version, module_name, compile_seconds "
            "FROM entries WHERE namespace=? AND key=?", entry).fetchone()
        if row is None:  # evicted between the index check and the read
            with self._index_lock:
                self._counters["misses"] += 1
            return None
        data, sha, kind, arch, nvrtc, module, cs = row
        # Checked against the row's own digest, not the index's: a concurrent evict + re-store may
        # have replaced the row since the index was consulted, and that row is not corrupt.
        actual = sha256_hex(data)
        if actual != sha:
            self._quarantine(entry, expected=sha, actual=actual, size=len(data))
            return None
        try:
            artifact = Artifact.hashed(data, actual, kind=kind, arch=arch or "",
                                       nvrtc_version=nvrtc or "", module_name=module or "",
                                       compile_seconds=cs or 0.0)
        except InvalidArgument:  # a corrupted kind column
            self._quarantine(entry, expected=sha, actual=actual, size=len(data))
            return None
        with self._index_lock:
            # Only while the index still vouches for this very row: an eviction or re-store
            # that ran since the SELECT must not leave these bytes in memory.
            current = self._index.get(entry)
            if current is not None and current.sha256 == actual:
                self._hot.put(entry, artifact)
        return self._hit(artifact)

    def _hit(self, artifact: Artifact) -> Artifact:
        with self._index_lock:
            self._counters["hits"] += 1
            self._counters["bytes_served"] += artifact.size
            self._compile_seconds_saved += artifact.compile_seconds
            flush_early = len(self._dirty) >= self.config.access_flush_threshold
        if flush_early and self._write_lock.acquire(blocking=False):
            try:
                self._flush_access()
            finally:
                self._write_lock.release()
        return artifact

    def _quarantine(self, entry: EntryId, expected: str, actual: str, size: int) -> None:
        """Move a corrupt entry aside: never served again, counted, logged, re-storable."""
        log.error("corrupt artifact quarantined", extra={
            "namespace": entry[0], "key": entry[1], "expected_sha256": expected,
            "actual_sha256": actual, "size": size})
        with self._write_lock:
            with self._transaction():
                # Only the row that was read (same digest column): a good row stored in its
                # place meanwhile is left alone.
                gone = self._writer.execute(
                    "DELETE FROM entries WHERE namespace=? AND key=? AND sha256=?",
                    (*entry, expected)).rowcount
                if gone:
                    self._writer.execute(
                        "INSERT INTO quarantine (namespace, key, expected_sha256, actual_sha256,"
                        " size, reason, at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (*entry, expected, actual, size, "digest mismatch on read", self._clock()))
                    self._trim_history("quarantine")
            with self._index_lock:
                meta = self._index.get(entry)
                if gone and meta is not None and meta.sha256 == expected:
                    self._index.remove(entry)
                    self._dirty.pop(entry, None)
                    self._hot.drop(entry)
                self._counters["corrupt"] += 1
                self._counters["quarantined"] += gone
                self._counters["misses"] += 1

    # -- writes --------------------------------------------------------------------------------

    def store(self, key: str, artifact: Artifact, namespace: str = "",
              sha256: str | None = None) -> StoreOutcome:
        """Store `artifact` under `key`. `sha256` is the digest the sender claims (None: trust data).

        A bad request raises InvalidArgument and changes nothing. The same key with the same
        digest is a no-op (the entry becomes most recently used); with a different digest the
        first one is kept and the conflict is counted, logged and recorded.
        """
        ns = normalize_namespace(namespace)
        entry = (ns, validate_key(key))
        self._validate(artifact, sha256, ns)
        outcome = self._store(entry, artifact)
        for listener in self._store_listeners:  # the key is present, whichever digest it kept
            listener(entry)
        return outcome

    def add_store_listener(self, listener: Callable[[EntryId], None]) -> None:
        """Call `listener(entry)` after every Store (the entry is present when it runs)."""
        self._store_listeners.append(listener)

    def _store(self, entry: EntryId, artifact: Artifact) -> StoreOutcome:
        ns = entry[0]
        now = self._clock()
        with self._write_lock:
            with self._index_lock:
                existing = self._index.get(entry)
            if existing is not None:
                return self._store_existing(entry, existing, artifact, now)
            with self._index_lock:
                victims = self._index.victims(ns, artifact.size, self.config.budget_bytes,
                                              self.config.budget_for(ns), self.config.low_watermark)
            with self._transaction():
                self._delete(victims)
                self._writer.execute(
                    "INSERT INTO entries (namespace, key, kind, arch, nvrtc_version, module_name,"
                    " size, sha256, data, created, last_access, hits, compile_seconds)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                    (*entry, artifact.kind, artifact.arch, artifact.nvrtc_version,
                     artifact.module_name, artifact.size, artifact.sha256, artifact.data, now, now,
                     artifact.compile_seconds))
                self._flush_access_statements()
            with self._index_lock:
                self._forget(victims)
                self._index.add(entry, EntryMeta(artifact.size, artifact.sha256,
                                                 artifact.compile_seconds))
                self._hot.put(entry, artifact)  # its digest was verified by _validate
                self._counters["stores"] += 1
            if victims:
                self._vacuum()
        return StoreOutcome(stored=True, evicted_entries=len(victims))

    def _validate(self, artifact: Artifact, sha256: str | None, ns: str) -> None:
        if not artifact.data:
            raise InvalidArgument("artifact.data is empty")
        limit = self.config.max_artifact_bytes
        if artifact.size > limit:
            raise InvalidArgument(f"artifact is {artifact.size} bytes; the limit is {limit}")
        for budget, scope in ((self.config.budget_bytes, "the cache"),
                              (self.config.budget_for(ns), f"namespace {ns!r}")):
            if budget and artifact.size > budget:
                raise InvalidArgument(f"artifact is {artifact.size} bytes, more than the "
                                      f"{budget}-byte budget of {scope}")
        if sha256 is not None and sha256 != artifact.sha256:
            raise InvalidArgument("artifact.sha256 does not match its data (lowercase hex "
                                  "SHA-256 of data expected); nothing stored")
        for name in ("arch", "nvrtc_version", "module_name"):
            if len(getattr(artifact, name)) > _FIELD_MAX:
                raise InvalidArgument(f"artifact.{name} is longer than {_FIELD_MAX} characters")

    def _store_existing(self, entry: EntryId, existing: EntryMeta, artifact: Artifact,
                        now: float) -> StoreOutcome:
        if existing.sha256 == artifact.sha256:
            with self._index_lock:
                self._index.touch(entry)
                last, hits = self._dirty.get(entry, (now, 0))
                self._dirty[entry] = (max(last, now), hits)
            return StoreOutcome(stored=False)
        log.warning("digest conflict: one key, two different artifacts; keeping the first "
                    "(a key field is missing or the compiler is non-deterministic)", extra={
                        "namespace": entry[0], "key": entry[1], "kept_sha256": existing.sha256,
                        "offered_sha256": artifact.sha256})
        with self._transaction():
            self._writer.execute(
                "INSERT INTO conflicts (namespace, key, kept_sha256, offered_sha256, at)"
                " VALUES (?, ?, ?, ?, ?)", (*entry, existing.sha256, artifact.sha256, now))
            self._trim_history("conflicts")
        with self._index_lock:
            self._counters["digest_conflicts"] += 1
        return StoreOutcome(stored=False, digest_conflict=True)

    def prune(self, target_bytes: int = 0) -> PruneOutcome:
        """Evict LRU entries down to `target_bytes` (0: every budget's low watermark)."""
        if target_bytes < 0:
            raise InvalidArgument("target_bytes cannot be negative")
        with self._write_lock:
            with self._index_lock:
                victims = self._prune_victims(target_bytes)
                freed = sum(self._index.get(v).size for v in victims)
            with self._transaction():
                self._delete(victims)
                self._flush_access_statements()
            with self._index_lock:
                self._forget(victims)
                total = self._index.total_bytes
            if victims:
                self._vacuum()
        if victims:
            log.info("pruned", extra={"evicted": len(victims), "freed_bytes": freed})
        return PruneOutcome(evicted_entries=len(victims), freed_bytes=freed, total_bytes=total)

    def _prune_victims(self, target_bytes: int) -> list[EntryId]:
        low = self.config.low_watermark
        chosen: list[EntryId] = []
        seen: set[EntryId] = set()
        for ns, (_, held) in self._index.namespaces().items():
            budget = self.config.budget_for(ns)
            if budget and held > low * budget:
                for entry in self._index.oldest_first():
                    if held <= low * budget:
                        break
                    if entry[0] == ns:
                        chosen.append(entry)
                        seen.add(entry)
                        held -= self._index.get(entry).size
        goal = target_bytes if target_bytes else low * self.config.budget_bytes
        if target_bytes or self.config.budget_bytes:
            held = self._index.total_bytes - sum(self._index.get(e).size for e in chosen)
            for entry in self._index.oldest_first():
                if held <= goal:
                    break
                if entry not in seen:
                    chosen.append(entry)
                    held -= self._index.get(entry).size
        return chosen

    def maintain(self) -> None:
        """Periodic pass: persist access records, prune to budget, vacuum, truncate the WAL."""
        with self._write_lock:
            self._flush_access()
        if self._over_budget():
            self.prune(0)
        with self._write_lock:
            self._vacuum()
            # PASSIVE never waits on readers; a complete one also truncates the main file after a
            # vacuum. The WAL file keeps its size until reset, so once everything is backfilled a
            # TRUNCATE (which may wait briefly for in-flight reads) gives it back too.
            busy, log_pages, done = self._writer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if not busy and log_pages == done and self._wal_bytes() > _WAL_TRUNCATE_BYTES:
                self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def _wal_bytes(self) -> int:
        try:
            return os.stat(f"{self.path}-wal").st_size
        except FileNotFoundError:
            return 0

    def _over_budget(self) -> bool:
        with self._index_lock:
            if self.config.budget_bytes and self._index.total_bytes > self.config.budget_bytes:
                return True
            return any(self.config.budget_for(ns) and held > self.config.budget_for(ns)
                       for ns, (_, held) in self._index.namespaces().items())

    # -- write helpers (caller holds the write lock) --------------------------------------------

    class _Txn:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def __enter__(self) -> None:
            self.conn.execute("BEGIN IMMEDIATE")

        def __exit__(self, exc_type: object, *_: object) -> None:
            if exc_type is None:
                try:
                    self.conn.execute("COMMIT")
                    return
                except BaseException:
                    if self.conn.in_transaction:  # e.g. disk full: nothing of it may stay
                        self.conn.execute("ROLLBACK")
                    raise
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")

    def _transaction(self) -> ArtifactStore._Txn:
        return ArtifactStore._Txn(self._writer)

    def _delete(self, victims: list[EntryId]) -> None:
        if victims:
            self._writer.executemany("DELETE FROM entries WHERE namespace=? AND key=?", victims)

    def _forget(self, victims: list[EntryId]) -> None:
        for v in victims:
            self._index.remove(v)
            self._dirty.pop(v, None)
            self._hot.drop(v)
        self._counters["evictions"] += len(victims)

    def _flush_access_statements(self) -> None:
        """Write pending last-access records inside the caller's transaction."""
        with self._index_lock:
            pending, self._dirty = self._dirty, {}
        if pending:
            self._writer.executemany(
                "UPDATE entries SET last_access=max(last_access, ?), hits=hits+? "
                "WHERE namespace=? AND key=?",
                [(last, hits, ns, key) for (ns, key), (last, hits) in pending.items()])

    def _flush_access(self) -> None:
        with self._index_lock:
            if not self._dirty:
                return
        with self._transaction():
            self._flush_access_statements()

    def _trim_history(self, table: str) -> None:
        self._writer.execute(f"DELETE FROM {table} WHERE id <= (SELECT max(id) FROM {table}) - ?",
                             (_QUARANTINE_KEEP,))

    def _vacuum(self) -> None:
        # Gives free pages back to the file system; outside any transaction, so after COMMIT.
        # NOTE: through sqlite3's execute() the pragma frees a single page (one step);
        # executescript() runs it to completion.
        self._writer.executescript("PRAGMA incremental_vacuum;")

    # -- introspection and lifecycle ------------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._index_lock:
            c = dict(self._counters)
            saved = self._compile_seconds_saved
            namespaces = self._index.namespaces()
            entries, total = len(self._index), self._index.total_bytes
        for ns in self.config.namespace_budgets:
            namespaces.setdefault(ns, (0, 0))
        return CacheStats(
            entries=entries, total_bytes=total, budget_bytes=self.config.budget_bytes,
            hits=c["hits"], misses=c["misses"], evictions=c["evictions"], stores=c["stores"],
            corrupt=c["corrupt"], digest_conflicts=c["digest_conflicts"],
            compile_seconds_saved=saved, db_file_bytes=self.db_file_bytes(),
            quarantined=c["quarantined"], max_artifact_bytes=self.config.max_artifact_bytes,
            low_watermark=self.config.low_watermark,
            namespaces=[NamespaceStats(ns, n, b, self.config.budget_for(ns))
                        for ns, (n, b) in sorted(namespaces.items())],
            hot_entries=len(self._hot), hot_bytes=self._hot.bytes,
            hot_budget_bytes=self._hot.budget_bytes, hot_hits=self._hot.hits,
            bytes_served=c["bytes_served"],
        )

    def entries(self, namespace: str | None = None) -> list[EntryInfo]:
        """Every entry (or one namespace's), most recently used first, with the last use and hits
        this store has seen, access records not yet persisted included."""
        with self._index_lock:
            dirty = dict(self._dirty)
        listed = []
        for e in _select_entries(self._reader(), namespace):
            last, hits = dirty.get((e.namespace, e.key), (0.0, 0))
            listed.append(EntryInfo(e.namespace, e.key, e.kind, e.arch, e.size,
                                    max(e.last_access, last), e.hits + hits))
        listed.sort(key=lambda e: e.last_access, reverse=True)
        return listed

    def hot_snapshot(self) -> dict[EntryId, str]:
        """(namespace, key) -> digest of every artifact the in-memory tier holds."""
        return self._hot.snapshot()

    def db_file_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.stat(f"{self.path}{suffix}").st_size
            except FileNotFoundError:
                pass
        return total

    def pragma(self, name: str) -> object:
        return self._writer.execute(f"PRAGMA {name}").fetchone()[0]

    def close(self) -> None:
        """Persist access records, checkpoint, close every connection, release the file lock."""
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._flush_access()
                self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                with self._index_lock:
                    readers, self._reader_conns = self._reader_conns, []
                for conn in readers:
                    conn.close()
                self._writer.close()
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
                self._lock_file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
