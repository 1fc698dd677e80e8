"""The kernel cache as deployed: several client processes ("hosts") at once, kill -9 of the server."""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import pathlib
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

from cache_service.artifact import Artifact
from cache_service.client import KernelCacheClient
from cache_service.convert import artifact_to_pb
from tests.cache_service.cache_helpers import TOKEN

ROOT = pathlib.Path(__file__).resolve().parents[2]


def artifact_for(key: str, size: int = 6000) -> Artifact:
    """Deterministic bytes per key: every host compiling `key` produces the same artifact."""
    block = hashlib.sha256(key.encode()).digest()
    return Artifact(data=(block * (size // 32 + 1))[:size], kind="ptx", arch="sm_90",
                    nvrtc_version="13.0", module_name=key, compile_seconds=0.05)


def host(target: str, host_id: int, keys: list[str], results: multiprocessing.Queue) -> None:
    """One worker host: look up its kernel set, store what missed, look it all up again."""
    client = KernelCacheClient(target, write_token=TOKEN, deadline_s=5.0)
    bad = 0
    for key in keys:
        got = client.lookup(key)
        if got is None:
            client.store(key, artifact_for(key))
        elif got != artifact_for(key):
            bad += 1
    client.flush(30)
    found = client.batch_lookup(keys)
    bad += sum(found[k] != artifact_for(k) for k in found)
    results.put((host_id, len(found), bad, client.stats()))
    client.close()


def test_several_host_processes_share_the_cache_concurrently_without_conflicts(server):
    ctx = multiprocessing.get_context("spawn")  # grpc must not be forked after it started
    results = ctx.Queue()
    kernel_set = [f"kernel-{i:03d}" for i in range(40)]
    hosts = [ctx.Process(target=host, args=(server.address, h, kernel_set[h * 5:] + kernel_set[
        :h * 5], results)) for h in range(4)]
    for p in hosts:
        p.start()
    reports = [results.get(timeout=120) for _ in hosts]
    for p in hosts:
        p.join(30)
        assert p.exitcode == 0, "a host process failed"
    for host_id, found, bad, stats in reports:
        assert bad == 0, f"host {host_id} received bytes that differ from what was stored"
        assert found == len(kernel_set), f"host {host_id} misses {len(kernel_set) - found} kernels"
        assert stats["errors"] == 0 and stats["timeouts"] == 0, (host_id, stats)
    stats = server.store.stats()
    assert stats.entries == len(kernel_set), "every kernel must be stored exactly once"
    assert stats.digest_conflicts == 0, "identical concurrent stores must be idempotent"


def _spawn_server(db: pathlib.Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "serve", "--listen", "127.0.0.1:0", "--db",
         str(db), "--budget-bytes", "0", "--write-token", TOKEN],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "GPUPLANE_LOG_LEVEL": "WARNING"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        match = re.search(r"listening on port (\d+)", line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, int(match.group(1))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("cache server subprocess did not start")


def test_every_acknowledged_store_survives_kill_9_of_the_server_and_the_db_stays_readable(tmp_path):
    db = tmp_path / "cache.sqlite"
    proc, port = _spawn_server(db)
    acked: list[tuple[str, str]] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.KernelCacheServiceStub(channel)
            i = 0
            while not stop.is_set():
                key = f"w{w}-{i}"
                artifact = Artifact(os.urandom(20000 + i), "cubin", "sm_90", "13.0", key)
                try:
                    stub.Store(pb.StoreRequest(key=key, artifact=artifact_to_pb(artifact)),
                               timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
                except grpc.RpcError:
                    return  # the server died mid-call: not acknowledged, no promise
                acked.append((key, artifact.sha256))
                i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked) < 150 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(acked) >= 150, "the writers stopped getting acknowledgements before the kill"
    proc.send_signal(signal.SIGKILL)  # mid-write: the writers are still storing
    proc.wait(10)
    stop.set()
    for t in threads:
        t.join(10)
    snapshot = list(acked)

    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok", "db left unreadable"
    conn.close()
    proc, port = _spawn_server(db)  # the lock of the killed server must not block a restart
    try:
        client = KernelCacheClient(f"127.0.0.1:{port}", deadline_s=10.0)
        found = {}
        for i in range(0, len(snapshot), 500):
            found.update(client.batch_lookup([k for k, _ in snapshot[i:i + 500]]))
        lost = [k for k, sha in snapshot if k not in found or found[k].sha256 != sha]
        assert not lost, f"{len(lost)} acknowledged stores were lost by kill -9: {lost[:5]}"
        client.close()
    finally:
        proc.terminate()
        code = proc.wait(10)
    assert code == 0, "SIGTERM must drain and exit cleanly"
    assert not pathlib.Path(f"{db}-wal").exists() or pathlib.Path(f"{db}-wal").stat().st_size == 0, \
        "a clean shutdown must checkpoint the WAL into the database"
