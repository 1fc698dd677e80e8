"""Kernel cache benchmark: Lookup/Store latency (p50, p99) and throughput vs a local-file cache.

Sizes 16 KiB, 256 KiB, 4 MiB; 1 and 16 concurrent clients (16 = 16 client processes, "hosts").
The server runs as its own process (`python -m cache_service serve`), as deployed. Everything is
measured side by side in one run and printed as ratios:

  hit ratio  = remote hit p50 / (local file read+verify p50 + empty RPC round trip p50)
               target <= 1.5 for 256 KiB (issues 2, 16)
  rate ratio = hits/s with 16 clients / empty RPCs/s (health Check) of the same 16 clients
               against the same server, alternated in rounds; target >= 0.5 for 256 KiB (issue 16)
  throughput = hits/s with 16 clients (issue 2 asked for >= 2,000 on 2 cores; printed, see
               docs/design.md amendment 9)
  store ratio = remote Store p50 / local file publish (temp file + rename) p50
A target MISSED makes the exit status 1 (bench/targets.py).

With --ceiling, the same client processes also call bench/cache_echo.py (a bare gRPC server: no
protobuf, no interceptors, no store), alternated with the hits in the same rounds, once for as
many bytes as a hit's response and once for nothing. Printed as information (no targets):
  latency = hit p50 / bare-bytes p50 (1 client): what the cache service and its client add
            (also against bare-bytes p50 + the SHA-256 of the bytes, which every hit must pay)
  rate    = hits/s / bare-bytes calls/s (16 clients): the same for throughput
  bytes   = bare-bytes / bare-empty (p50 at 1 client, calls/s at 16): what moving the bytes costs
            Python gRPC itself, before any cache code runs

The local-file baseline reads the same bytes from a file and checks their SHA-256, as every tier
must before loading code. Single-client hits, file reads and empty RPCs are alternated in rounds
in this process, so a shared machine's changing load hits all three alike.
Run: python bench/cache_service_bench.py [--quick] [--ceiling] [--json OUT]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cache_echo import BYTES_METHOD, EMPTY_METHOD
from bench.record import add_record_flag
from bench.targets import Targets
from cache_service.artifact import Artifact
from cache_service.client import KernelCacheClient
from cache_service.convert import artifact_to_pb

TOKEN = "bench-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SIZES = {"16KiB": 16 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20}
KEYS_PER_SIZE = 8


def artifact(size: int, tag: str) -> Artifact:
    block = hashlib.sha256(tag.encode()).digest() + os.urandom(32)
    return Artifact((block * (size // 64 + 1))[:size], "cubin", "sm_90", "13.0", tag, 0.08)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- client processes ---------------------------------------------------------------------------

_client: KernelCacheClient | None = None
_stub = None
_health = None
_barrier = None
_bare: dict = {}  # "bytes" / "empty" -> unary callable on the bare server (with --ceiling)


def _bare_methods(channel: grpc.Channel) -> dict:
    """The bare server's two methods: raw bytes in and out, no protobuf."""
    return {"bytes": channel.unary_unary(BYTES_METHOD), "empty": channel.unary_unary(EMPTY_METHOD)}


def _bare_channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])


def _init_worker(target: str, barrier, bare_target: str = "") -> None:
    global _client, _stub, _health, _barrier, _bare
    _client = KernelCacheClient(target, deadline_s=30.0)
    channel = grpc.insecure_channel(target, options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    _stub = pb_grpc.KernelCacheServiceStub(channel)
    _health = health_pb2_grpc.HealthStub(channel)
    _barrier = barrier
    if bare_target:
        _bare = _bare_methods(_bare_channel(bare_target))


def _lookups(args: tuple[list[str], int]) -> tuple[float, float, list[float], int]:
    keys, count = args
    _client.lookup(keys[0])  # warm the channel
    _barrier.wait()
    lat, misses, start = [], 0, time.monotonic()
    for i in range(count):
        t = time.perf_counter()
        misses += _client.lookup(keys[i % len(keys)]) is None
        lat.append(time.perf_counter() - t)
    return start, time.monotonic(), lat, misses


def _empty_rpcs(count: int) -> tuple[float, float, list[float], int]:
    request = health_pb2.HealthCheckRequest()
    return _timed(lambda: _health.Check(request, timeout=30), count)


def _bare_calls(args: tuple[str, int, int]) -> tuple[float, float, list[float], int]:
    which, size, count = args
    request = str(size).encode()
    method = _bare[which]
    return _timed(lambda: method(request, timeout=30), count)


def _timed(call, count: int) -> tuple[float, float, list[float], int]:
    call()  # warm the channel
    _barrier.wait()
    lat, failed, start = [], 0, time.monotonic()
    for _ in range(count):
        t = time.perf_counter()
        try:
            call()
        except grpc.RpcError:
            failed += 1
        lat.append(time.perf_counter() - t)
    return start, time.monotonic(), lat, failed


def _stores(args: tuple[int, int, str]) -> tuple[float, float, list[float], int]:
    size, count, tag = args
    requests = [pb.StoreRequest(key=f"{tag}-{i}", artifact=artifact_to_pb(artifact(size, f"{tag}-{i}")))
                for i in range(count)]
    _stub.GetStats(pb.GetStatsRequest(), timeout=30)  # warm the channel
    _barrier.wait()
    lat, failed, start = [], 0, time.monotonic()
    for request in requests:
        t = time.perf_counter()
        try:
            _stub.Store(request, timeout=30, metadata=AUTH)
        except grpc.RpcError:
            failed += 1
        lat.append(time.perf_counter() - t)
    return start, time.monotonic(), lat, failed


def alternated_rates(pool, keys: list[str], per_client: int, clients: int, rounds: int = 3,
                     bare_bytes: int = 0) -> dict[str, dict]:
    """Hits and empty RPCs from the same client processes, alternated in rounds (same load);
    with `bare_bytes`, also the bare server's Bytes(bare_bytes) and Empty in the same rounds."""
    each = max(5, per_client // rounds)
    sides: dict[str, tuple] = {"rpc_n": (_empty_rpcs, each), "hit_n": (_lookups, (keys, each))}
    if bare_bytes:
        sides["bare_bytes_n"] = (_bare_calls, ("bytes", bare_bytes, each))
        sides["bare_empty_n"] = (_bare_calls, ("empty", 0, each))
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            func, task = sides[name]
            rows[name].append(run_parallel(pool, func, [task] * clients))
    return {name: merge(rows[name]) for name in sides}


def merge(rows: list[dict]) -> dict:
    """Rounds combined: total ops over total wall time; percentiles over every sample."""
    lat = [x for r in rows for x in r["lat"]]
    return {"p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3, "ops": len(lat),
            "ops_per_s": len(lat) / sum(r["wall"] for r in rows),
            "failed": sum(r["failed"] for r in rows)}


def run_parallel(pool, func, tasks) -> dict:
    results = pool.map(func, tasks, chunksize=1)
    lat = [x for r in results for x in r[2]]
    wall = max(r[1] for r in results) - min(r[0] for r in results)
    return {"p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3, "ops": len(lat),
            "ops_per_s": len(lat) / wall, "failed": sum(r[3] for r in results), "lat": lat,
            "wall": wall}


# -- baselines in this process ------------------------------------------------------------------

def file_publishes(folder: pathlib.Path, size: int, count: int) -> dict:
    lat = []
    blobs = [artifact(size, f"file-{i}").data for i in range(count)]
    for i, data in enumerate(blobs):
        t = time.perf_counter()
        tmp = folder / f".tmp-{i}"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"pub-{i}")
        lat.append(time.perf_counter() - t)
    return {"p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3}


def interleaved_hits(target: str, client: KernelCacheClient, keys: list[str],
                     paths: list[pathlib.Path], count: int, rounds: int = 20,
                     bare: dict | None = None, bare_bytes: int = 0) -> dict:
    """One client: empty RPC, file read+verify and cache hit, alternated in small rounds; with
    `bare` (the bare server's methods), also its Bytes(bare_bytes) and Empty in the same rounds.

    The machine is shared, so load changes during a run; alternating puts all of them under
    the same load and keeps the ratio honest.
    """
    bare = bare or {}
    lat: dict[str, list[float]] = {"rpc": [], "read": [], "file": [], "verify": [], "hit": [],
                                   **{f"bare_{which}": [] for which in bare}}
    bare_requests = {"bytes": str(bare_bytes).encode(), "empty": b""}
    for which, method in bare.items():
        method(bare_requests[which], timeout=10)  # warm the channel
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        health.Check(request, timeout=10)
        client.lookup(keys[0])
        per_round = max(1, count // rounds)
        for _ in range(rounds):
            for which, method in bare.items():
                for i in range(per_round):
                    t = time.perf_counter()
                    method(bare_requests[which], timeout=10)
                    lat[f"bare_{which}"].append(time.perf_counter() - t)
            for i in range(per_round):
                t = time.perf_counter()
                health.Check(request, timeout=10)
                lat["rpc"].append(time.perf_counter() - t)
            for i in range(per_round):
                t = time.perf_counter()
                data = paths[i % len(paths)].read_bytes()
                t_read = time.perf_counter()
                hashlib.sha256(data).hexdigest()
                t_end = time.perf_counter()
                lat["read"].append(t_read - t)
                lat["verify"].append(t_end - t_read)
                lat["file"].append(t_end - t)
            for i in range(per_round):
                t = time.perf_counter()
                assert client.lookup(keys[i % len(keys)]) is not None, "a seeded key missed"
                lat["hit"].append(time.perf_counter() - t)
    ms = {k: (pct(v, 0.5) * 1e3, pct(v, 0.99) * 1e3) for k, v in lat.items()}
    return {
        "empty_rpc": {"p50_ms": ms["rpc"][0], "p99_ms": ms["rpc"][1]},
        "file_read": {"read_p50_ms": ms["read"][0], "verify_p50_ms": ms["verify"][0],
                      "p50_ms": ms["file"][0], "p99_ms": ms["file"][1]},
        "hit_1": {"p50_ms": ms["hit"][0], "p99_ms": ms["hit"][1], "ops": len(lat["hit"]),
                  "ops_per_s": len(lat["hit"]) / sum(lat["hit"]), "failed": 0},
        **{f"bare_{which}_1": {"p50_ms": ms[f"bare_{which}"][0], "p99_ms": ms[f"bare_{which}"][1]}
           for which in bare},
    }


def start_server(db: pathlib.Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "serve", "--listen", "127.0.0.1:0", "--db",
         str(db), "--budget-bytes", "1GiB", "--write-token", TOKEN],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "GPUPLANE_LOG_LEVEL": "WARNING", "OTEL_TRACES_EXPORTER": "none"})
    for line in proc.stderr:
        match = re.search(r"listening on port (\d+)", line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, f"127.0.0.1:{match.group(1)}"
    raise SystemExit("cache server did not start")


def start_echo() -> tuple[subprocess.Popen, str]:
    """bench/cache_echo.py in its own process (as the cache server runs): the transport ceiling."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "cache_echo.py"), "127.0.0.1:0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    match = re.search(r"listening on port (\d+)", proc.stdout.readline())
    if match is None:
        proc.kill()
        raise SystemExit("the bare echo server did not start")
    return proc, f"127.0.0.1:{match.group(1)}"


def hit_response_bytes(a: Artifact) -> int:
    """The size of a hit's serialized LookupResponse: what the bare server returns instead."""
    response = pb.LookupResponse(found=True)
    artifact_to_pb(a, into=response.artifact)
    return response.ByteSize()


def ceiling_ratios(row: dict) -> None:
    """What the cache adds over the bare server, and what the bytes cost the bare server itself."""
    row["ceiling"] = {
        "hit_over_bare_p50": row["hit_1"]["p50_ms"] / row["bare_bytes_1"]["p50_ms"],
        # The same with the client's digest check added to the bare call: every hit must pay it.
        "hit_over_bare_verified_p50": row["hit_1"]["p50_ms"]
        / (row["bare_bytes_1"]["p50_ms"] + row["file_read"]["verify_p50_ms"]),
        "hits_over_bare_rate": row["hit_n"]["ops_per_s"] / row["bare_bytes_n"]["ops_per_s"],
        "bare_bytes_over_empty_p50": row["bare_bytes_1"]["p50_ms"] / row["bare_empty_1"]["p50_ms"],
        "bare_bytes_over_empty_rate":
            row["bare_bytes_n"]["ops_per_s"] / row["bare_empty_n"]["ops_per_s"],
        # The two ratios with the bare server in place of the cache: the most any cache
        # code could reach on these clients (its hit also pays the digest check, as the file does).
        "bare_hit_ratio": (row["bare_bytes_1"]["p50_ms"] + row["file_read"]["verify_p50_ms"])
        / (row["file_read"]["p50_ms"] + row["empty_rpc"]["p50_ms"]),
        "bare_rate_ratio": row["bare_bytes_n"]["ops_per_s"] / row["rpc_n"]["ops_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (~1 min)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time bench/cache_echo.py (bare gRPC, same bytes, and empty) "
                             "from the same clients, alternated with the hits")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    scale = 0.2 if args.quick else 1.0
    lookups = {"16KiB": 3000, "256KiB": 2000, "4MiB": 200}
    stores = {"16KiB": 400, "256KiB": 200, "4MiB": 30}
    n = lambda base, per=1: max(10, int(base * scale / per))

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="cache-bench-"))
    proc, target = start_server(tmp / "cache.sqlite")
    echo, bare_target = start_echo() if args.ceiling else (None, "")
    bare_channel = _bare_channel(bare_target) if bare_target else None
    bare = _bare_methods(bare_channel) if bare_channel else {}
    ctx = multiprocessing.get_context("spawn")
    barrier1, barrierN = ctx.Barrier(1), ctx.Barrier(args.clients)
    pool1 = ctx.Pool(1, _init_worker, (target, barrier1))
    poolN = ctx.Pool(args.clients, _init_worker, (target, barrierN, bare_target))
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                     "machine": f"{platform.node()} {os.cpu_count()} cpus {platform.processor()}",
                     "python": platform.python_version(), "clients": args.clients,
                     "quick": args.quick, "ceiling": args.ceiling, "sizes": {},
                     "loadavg_start": os.getloadavg()}
    try:
        seed = KernelCacheClient(target, write_token=TOKEN, deadline_s=30)
        for label, size in SIZES.items():
            keys = [f"hit-{label}-{i}" for i in range(KEYS_PER_SIZE)]
            folder = tmp / f"files-{label}"
            folder.mkdir()
            paths = []
            for key in keys:
                a = artifact(size, key)
                seed.store(key, a)
                (folder / key).write_bytes(a.data)
                paths.append(folder / key)
            assert seed.flush(60), "seeding the cache failed"
            reply_bytes = hit_response_bytes(a) if bare else 0
            row = interleaved_hits(target, seed, keys, paths, n(lookups[label]), bare=bare,
                                   bare_bytes=reply_bytes)
            row["file_publish"] = file_publishes(folder, size, n(stores[label]))
            row.update(alternated_rates(poolN, keys, n(lookups[label], args.clients), args.clients,
                                        bare_bytes=reply_bytes))
            row["store_1"] = run_parallel(pool1, _stores, [(size, n(stores[label]), f"s1-{label}")])
            row["store_n"] = run_parallel(poolN, _stores, [
                (size, n(stores[label], args.clients), f"sN-{label}-{c}")
                for c in range(args.clients)])
            base = row["file_read"]["p50_ms"] + row["empty_rpc"]["p50_ms"]
            row["hit_ratio"] = row["hit_1"]["p50_ms"] / base
            row["rate_ratio"] = row["hit_n"]["ops_per_s"] / row["rpc_n"]["ops_per_s"]
            row["store_ratio"] = row["store_1"]["p50_ms"] / row["file_publish"]["p50_ms"]
            if bare:
                row["bare_reply_bytes"] = reply_bytes
                ceiling_ratios(row)
            results["sizes"][label] = row
        seed.close()
    finally:
        pool1.terminate()
        poolN.terminate()
        if bare_channel is not None:
            bare_channel.close()
        for server in (proc, echo):
            if server is not None:
                server.terminate()
                server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)   # ~860 MB of store and files a run
    results["loadavg_end"] = os.getloadavg()
    for row in results["sizes"].values():
        for m in row.values():
            if isinstance(m, dict):
                m.pop("lat", None)
    targets = Targets("cache_service_bench", args=args)
    report(results, targets)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return targets.exit_code()


def report(r: dict, targets: Targets) -> None:
    """Print the table and the ratios, and check the targets."""
    c = r["clients"]
    print(f"kernel cache bench  {r['date']}  {r['machine']}  python {r['python']}"
          f"{'  (quick)' if r['quick'] else ''}")
    start, end = (" ".join(f"{x:.2f}" for x in r[k]) for k in ("loadavg_start", "loadavg_end"))
    print(f"load average (1, 5, 15 min) at start {start}, at end {end}")
    print(f"{'size':>7} {'op':<22} {'p50 ms':>9} {'p99 ms':>9} {'ops/s':>9}")
    for label, row in r["sizes"].items():
        for name, key in (("empty RPC (health)", "empty_rpc"), ("file read+sha256", "file_read"),
                          ("file publish", "file_publish"),
                          ("hit, 1 client", "hit_1"), (f"empty RPC, {c} clients", "rpc_n"),
                          (f"hit, {c} clients", "hit_n"),
                          ("store, 1 client", "store_1"), (f"store, {c} clients", "store_n"),
                          ("bare bytes, 1 client", "bare_bytes_1"),
                          ("bare empty, 1 client", "bare_empty_1"),
                          (f"bare bytes, {c} clients", "bare_bytes_n"),
                          (f"bare empty, {c} clients", "bare_empty_n")):
            m = row.get(key)
            if m is None:
                continue
            rate = f"{m['ops_per_s']:9.0f}" if "ops_per_s" in m else f"{'':>9}"
            print(f"{label:>7} {name:<22} {m['p50_ms']:9.3f} {m['p99_ms']:9.3f} {rate}")
    print("ratios (same run):")
    for label, row in r["sizes"].items():
        print(f"  {label:>7}: hit p50 / (file read+verify + empty RPC) = {row['hit_ratio']:.2f};  "
              f"hits/s / empty RPCs/s with {c} clients = {row['hit_n']['ops_per_s']:.0f} / "
              f"{row['rpc_n']['ops_per_s']:.0f} = {row['rate_ratio']:.2f};  "
              f"store p50 / file publish = {row['store_ratio']:.2f}")
    for label, row in r["sizes"].items():
        targets.figure(f"{label} hit p50, 1 client", row["hit_1"]["p50_ms"], "ms",
                       peer=row["file_read"]["p50_ms"])
        targets.figure(f"{label} hit p99, 1 client", row["hit_1"]["p99_ms"], "ms")
        targets.figure(f"{label} hits/s, {c} clients", row["hit_n"]["ops_per_s"], "ops/s",
                       peer=row["rpc_n"]["ops_per_s"])
        if "store_1" in row and "file_publish" in row:
            targets.figure(f"{label} store p50, 1 client", row["store_1"]["p50_ms"], "ms",
                           peer=row["file_publish"]["p50_ms"])
    if r.get("ceiling"):
        report_ceiling(r)
    row = r["sizes"].get("256KiB")
    if row is not None:
        targets.check("256 KiB hit p50 / (file read+verify + empty RPC)", row["hit_ratio"], "<=", 1.5)
        targets.check(f"256 KiB hits/s / empty RPCs/s, {c} clients", row["rate_ratio"], ">=", 0.5)


def report_ceiling(r: dict) -> None:
    """The ceiling rows: information next to the targets, never a target themselves."""
    c = r["clients"]
    print("against the transport ceiling (bench/cache_echo.py: bare gRPC, no protobuf, no "
          "interceptors, no store; same clients, same rounds):")
    for label, row in r["sizes"].items():
        x = row["ceiling"]
        print(f"  {label:>7}: cache over bare bytes ({row['bare_reply_bytes']} B): latency hit p50 "
              f"/ bare p50 = {row['hit_1']['p50_ms']:.3f} / {row['bare_bytes_1']['p50_ms']:.3f} = "
              f"{x['hit_over_bare_p50']:.2f}, rate hits/s / bare calls/s ({c} clients) = "
              f"{row['hit_n']['ops_per_s']:.0f} / {row['bare_bytes_n']['ops_per_s']:.0f} = "
              f"{x['hits_over_bare_rate']:.2f}; hit p50 / (bare p50 + sha256 p50 "
              f"{row['file_read']['verify_p50_ms']:.3f}) = {x['hit_over_bare_verified_p50']:.2f}")
        print(f"  {'':>7}  transport's cost of the bytes: bare bytes / bare empty p50 = "
              f"{x['bare_bytes_over_empty_p50']:.2f}, calls/s ({c} clients) = "
              f"{x['bare_bytes_over_empty_rate']:.2f}")
        print(f"  {'':>7}  the issue's ratios with the bare server as the cache (the most any "
              f"cache code reaches here): (bare p50 + sha256 p50) / (file read+verify + empty RPC)"
              f" = {x['bare_hit_ratio']:.2f}; bare calls/s / empty RPCs/s = "
              f"{x['bare_rate_ratio']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
