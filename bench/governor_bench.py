"""Governor latency and throughput: Acquire/Release over loopback with 1, 8 and 32 clients.

    .venv/bin/python bench/governor_bench.py [--levels 1,8,32] [--seconds 3] [--processes 4]

The governor runs as its own process (`python -m services.governor serve`), as in production,
with a real SQLite file (WAL). Each client is a worker with its own channel that loops
Acquire(64 MiB) + Release as fast as it can (closed loop: saturation, where latency is bounded by
Little's law, clients / throughput), then at a fixed rate per client (open loop: real workers call
once per 64 MiB chunk of growth, a few times a second at most). Clients are spread over several processes so that the client side's
GIL is not what is measured. Printed side by side in one run:
- per level: p50/p99 of Acquire and Release, calls per second, and p99 relative to one client;
- the domain core alone (Ledger.acquire + release in process, no gRPC): where the time goes;
- GovernorClient.reserve/release of 1 MiB (served from chunks) vs one RPC per allocation.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20
DEVICE_UUID = "GPU-bench"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _client_process(target: str, first: int, count: int, start_at: float, stop_at: float,
                    rate: float, out: mp.Queue) -> None:
    import threading

    import grpc
    from gpuplane.governor.v1 import governor_pb2 as pb
    from gpuplane.governor.v1 import governor_pb2_grpc

    acquire_s: list[float] = []
    release_s: list[float] = []
    lock = threading.Lock()

    def run(worker_id: str) -> None:
        channel = grpc.insecure_channel(target)
        stub = governor_pb2_grpc.GovernorServiceStub(channel)
        stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=worker_id, device=pb.Device(
            uuid=DEVICE_UUID, total_bytes=1 << 50, free_bytes=1 << 50)), timeout=10)
        mine_a, mine_r = [], []
        while time.time() < start_at:
            time.sleep(0.001)
        # Open loop: pairs start on a fixed schedule (rate per second, staggered per client), so a
        # slow answer does not slow the offered load; rate 0 is closed loop (back to back).
        period = 1.0 / rate if rate else 0.0
        next_at = time.time() + (int(worker_id.split("-")[1]) % 97) / 97 * period
        while time.time() < stop_at:
            if period:
                delay = next_at - time.time()
                if delay > 0:
                    time.sleep(delay)
                next_at += period
            t0 = time.perf_counter()
            lease = stub.Acquire(pb.AcquireRequest(worker_id=worker_id, zone=pb.ZONE_KV,
                                                   bytes=64 * MIB), timeout=5).lease
            t1 = time.perf_counter()
            stub.Release(pb.ReleaseRequest(worker_id=worker_id, lease_id=lease.lease_id),
                         timeout=5)
            t2 = time.perf_counter()
            mine_a.append(t1 - t0)
            mine_r.append(t2 - t1)
        with lock:
            acquire_s.extend(mine_a)
            release_s.extend(mine_r)
        stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id=worker_id), timeout=5)
        channel.close()

    threads = [threading.Thread(target=run, args=(f"bench-{i}",))
               for i in range(first, first + count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((acquire_s, release_s))


def run_level(target: str, clients: int, processes: int, seconds: float,
              rate: float = 0.0) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = min(processes, clients)
    start_at = time.time() + 3.0  # time for the spawned interpreters to import and register
    stop_at = start_at + seconds
    workers, first = [], 0
    for p in range(procs):
        count = clients // procs + (1 if p < clients % procs else 0)
        workers.append(ctx.Process(target=_client_process,
                                   args=(target, first, count, start_at, stop_at, rate, out)))
        first += count
    for w in workers:
        w.start()
    acquire, release = [], []
    for _ in workers:
        a, r = out.get(timeout=seconds + 60)
        acquire += a
        release += r
    for w in workers:
        w.join()
    return {"clients": clients, "samples": len(acquire),
            "calls_per_s": (len(acquire) + len(release)) / seconds,
            "acquire_p50_ms": _pct(acquire, 0.5) * 1e3, "acquire_p99_ms": _pct(acquire, 0.99) * 1e3,
            "release_p50_ms": _pct(release, 0.5) * 1e3, "release_p99_ms": _pct(release, 0.99) * 1e3}


def domain_core(n: int = 5000) -> float:
    """Microseconds per Ledger.acquire + release in process, SQLite file included."""
    from services.governor.ledger import DeviceSpec, Ledger
    from services.governor.store import Store

    with tempfile.TemporaryDirectory() as d:
        store = Store(pathlib.Path(d) / "core.sqlite")
        ledger = Ledger(store)
        ledger.register("w", DeviceSpec(DEVICE_UUID, 1 << 50, 1 << 50))
        t0 = time.perf_counter()
        for _ in range(n):
            ledger.release("w", ledger.acquire("w", "", "kv", 64 * MIB).lease_id)
        elapsed = time.perf_counter() - t0
        store.close()
        return elapsed / n * 1e6


def chunked_vs_per_call(target: str, n: int = 2000) -> tuple[float, float]:
    """Microseconds per 1 MiB reserve+release: GovernorClient (chunks) vs one RPC each."""
    import grpc
    from gpuplane.governor.v1 import governor_pb2 as pb
    from gpuplane.governor.v1 import governor_pb2_grpc
    from opentelemetry.sdk.trace import TracerProvider

    from services.governor.client import DeviceDescription, GovernorClient

    client = GovernorClient(target, "bench-chunked",
                            DeviceDescription(DEVICE_UUID, "bench", 1 << 50, 1 << 50, 2 * MIB),
                            tracer_provider=TracerProvider())
    t0 = time.perf_counter()
    for _ in range(n):
        client.reserve("kv", MIB)
    for _ in range(n):
        client.release("kv", MIB)
    chunked = (time.perf_counter() - t0) / n * 1e6
    client.close()
    channel = grpc.insecure_channel(target)
    stub = governor_pb2_grpc.GovernorServiceStub(channel)
    stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id="bench-raw", device=pb.Device(
        uuid=DEVICE_UUID, total_bytes=1 << 50, free_bytes=1 << 50)), timeout=5)
    t0 = time.perf_counter()
    ids = [stub.Acquire(pb.AcquireRequest(worker_id="bench-raw", zone=pb.ZONE_KV, bytes=MIB),
                        timeout=5).lease.lease_id for _ in range(n)]
    for lease_id in ids:
        stub.Release(pb.ReleaseRequest(worker_id="bench-raw", lease_id=lease_id), timeout=5)
    per_call = (time.perf_counter() - t0) / n * 1e6
    channel.close()
    return chunked, per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rate", type=float, default=5.0,
                        help="open-loop Acquire+Release pairs per second per client (0 = skip)")
    parser.add_argument("--open-seconds", type=float, default=10.0,
                        help="duration of each open-loop level (longer: enough samples for p99)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the figures here")
    parser.add_argument("--memory-db", action="store_true",
                        help="serve from an in-memory SQLite database (no durable writes at all): "
                             "the ceiling of any commit optimisation, never a deployment")
    args = parser.parse_args()
    figures: dict = {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as d:
        governor = subprocess.Popen(
            [sys.executable, "-m", "services.governor", "serve", "--listen", target, "--db",
             ":memory:" if args.memory_db else f"{d}/gov.sqlite"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env={**os.environ, "GPUPLANE_LOG_LEVEL": "WARNING"})
        try:
            assert "listening" in governor.stdout.readline(), "the governor did not start"
            print(f"governor bench: {os.cpu_count()} cores, {args.seconds:.0f} s per level, "
                  f"closed loop Acquire(64 MiB)+Release, clients over {args.processes} processes")
            modes = [("closed loop", 0.0, args.seconds)]
            if args.rate:
                modes.append((f"open loop, {args.rate:g} pairs/s per client", args.rate,
                              args.open_seconds))
            for mode, rate, seconds in modes:
                print(f"{mode}:")
                print(f"{'clients':>7} {'pairs':>7} {'calls/s':>9} {'acq p50':>8} {'acq p99':>8} "
                      f"{'rel p50':>8} {'rel p99':>8} {'p99 vs 1':>8}")
                base = None
                for clients in [int(x) for x in args.levels.split(",")]:
                    r = run_level(target, clients, args.processes, seconds, rate)
                    figures[f"{'open' if rate else 'closed'}_{clients}"] = {
                        k: v for k, v in r.items() if isinstance(v, (int, float))}
                    base = base or r["acquire_p99_ms"]
                    print(f"{clients:>7} {r['samples']:>7} {r['calls_per_s']:>9.0f} {r['acquire_p50_ms']:>7.2f}m "
                          f"{r['acquire_p99_ms']:>7.2f}m {r['release_p50_ms']:>7.2f}m "
                          f"{r['release_p99_ms']:>7.2f}m {r['acquire_p99_ms'] / base:>7.1f}x",
                          flush=True)
            core = domain_core()
            print(f"domain core alone (Ledger acquire+release, SQLite WAL): {core:.0f} us/pair")
            chunked, per_call = chunked_vs_per_call(target)
            print(f"1 MiB reserve+release: GovernorClient {chunked:.1f} us vs one RPC each "
                  f"{per_call:.0f} us ({per_call / chunked:.0f}x)")
            figures["domain_core_us"] = core
            if args.json:
                import json

                args.json.write_text(json.dumps(figures, indent=2))
        finally:
            governor.kill()
            governor.wait()


if __name__ == "__main__":
    main()
