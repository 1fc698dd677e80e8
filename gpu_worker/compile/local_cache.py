"""The per-host disk tier of the kernel cache: one file per artifact, LRU under a byte budget.

Hazards: several worker processes share the directory, so a reader must never see a half-written
file (publish is a temp file in the same directory + `os.replace`, atomic on POSIX); a file damaged
on disk (torn by a crash, a full disk, a stray edit) must never reach the driver (every file carries
the SHA-256 of its payload, checked on read; a mismatch is a miss and the file is removed); and the
directory must not grow without bound (an LRU byte budget, pruned after every write).

Contract: `get` returns the exact bytes `put` stored or None; no method raises for an I/O problem
(the tier is never load-bearing: a failure is a miss and the caller compiles). Recency is the file
mtime, set explicitly with nanosecond resolution on publish and on every hit, because atime is
usually off (noatime/relatime) and kernel timestamps are coarse (a few ms).

Cost: a hit is one open+read+SHA-256 (~2 us per KiB) and one utime; a prune scans the directory
(a model's kernel set is tens of files).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import pathlib
import re
import tempfile
import threading
import time

from services.common.config import parse_bytes

log = logging.getLogger(__name__)

MAGIC = b"GPUPLANE-KERNEL-1\n"
DIGEST_BYTES = 32
DEFAULT_MAX_BYTES = 256 << 20
MAX_BYTES_ENV = "GPUPLANE_KERNEL_CACHE_MAX_BYTES"
_KEY_RE = re.compile(r"^[0-9a-f]{32,128}$")
# A temp file older than this belongs to a writer that died mid-publish.
_STALE_TEMP_S = 600.0


def default_cache_dir() -> pathlib.Path:
    """$XDG_CACHE_HOME/gpuplane/kernels, else ~/.cache/gpuplane/kernels."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "gpuplane" / "kernels"


def default_max_bytes() -> int:
    """GPUPLANE_KERNEL_CACHE_MAX_BYTES ("268435456", "256MiB"), else 256 MiB; 0 means unbounded."""
    raw = os.environ.get(MAX_BYTES_ENV, "")
    if not raw.strip():
        return DEFAULT_MAX_BYTES
    try:
        return parse_bytes(raw)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{MAX_BYTES_ENV}={raw!r}: {exc} (0 = unbounded)") from None


class LocalKernelCache:
    """Artifacts by key under `root`, sharded by the key's first two hex digits."""

    def __init__(self, root: pathlib.Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes cannot be negative (0 = unbounded)")
        self.root = pathlib.Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # guards the counters only; files are safe across processes
        self._counts = {
            "hits": 0,
            "misses": 0,
            "corrupt": 0,
            "writes": 0,
            "write_errors": 0,
            "evictions": 0,
        }

    def path_for(self, key: str) -> pathlib.Path:
        if not _KEY_RE.match(key):
            raise ValueError(f"not a cache key (lowercase hex): {key!r}")
        return self.root / key[:2] / f"{key}.bin"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss; a file whose digest does not match is removed."""
        path = self.path_for(key)
        try:
            blob = path.read_bytes()
        except OSError:
            self._count("misses")
            return None
        head = len(MAGIC) + DIGEST_BYTES
        data = blob[head:]
        if (
            len(blob) < head
            or blob[: len(MAGIC)] != MAGIC
            or hashlib.sha256(data).digest() != blob[len(MAGIC) : head]
        ):
            log.warning("kernel cache file %s is corrupt; removed", path)
            self._count("corrupt")
            self._count("misses")
            self._unlink(path)
            return None
        self._touch(path)
        self._count("hits")
        return data

    def put_many(self, items: dict[str, bytes]) -> int:
        """Publish several artifacts, then prune once; returns how many were written."""
        written = sum(self.put(key, data, prune=False) for key, data in items.items())
        self.prune()
        return written

    def put(self, key: str, data: bytes, prune: bool = True) -> bool:
        """Publish `data` under `key` atomically, then prune to the budget. False if it failed."""
        path = self.path_for(key)
        blob = MAGIC + hashlib.sha256(data).digest() + data
        tmp_name = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp_name, path)
            tmp_name = None
            self._touch(path)
        except OSError as exc:
            log.warning("kernel cache write of %s failed: %s", path, exc)
            self._count("write_errors")
            if tmp_name is not None:
                self._unlink(pathlib.Path(tmp_name))
            return False
        self._count("writes")
        if prune:
            self.prune()
        return True

    def prune(self) -> int:
        """Evict least recently used files until the total fits the budget; returns evictions."""
        entries = self._scan()
        if self.max_bytes == 0:
            return 0
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if self._unlink(path):
                evicted += 1
            total -= size
        if evicted:
            self._count("evictions", evicted)
        return evicted

    def _scan(self) -> list[tuple[int, int, pathlib.Path]]:
        """(mtime_ns, size, path) of every published file; removes stale temp files on the way."""
        entries = []
        now = time.time()
        try:
            shards = [d for d in self.root.iterdir() if d.is_dir()]
        except OSError:
            return entries
        for shard in shards:
            try:
                names = list(os.scandir(shard))
            except OSError:
                continue
            for entry in names:
                try:
                    st = entry.stat()
                except OSError:
                    continue  # removed by another process meanwhile
                if entry.name.endswith(".bin"):
                    entries.append((st.st_mtime_ns, st.st_size, pathlib.Path(entry.path)))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TEMP_S:
                    self._unlink(pathlib.Path(entry.path))
        return entries

    def _touch(self, path: pathlib.Path) -> None:
        now = time.time_ns()
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass  # recency is advisory; a lost touch only makes eviction slightly less exact

    def _unlink(self, path: pathlib.Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False

    def stats(self) -> dict[str, int]:
        entries = self._scan()
        with self._lock:
            counts = dict(self._counts)
        counts["entries"] = len(entries)
        counts["bytes"] = sum(size for _, size, _ in entries)
        counts["max_bytes"] = self.max_bytes
        return counts
