"""Governor latency and throughput: Acquire/Release over loopback with 1, 8 and 32 clients.

    .venv/bin/python bench/governor_bench.py [--levels 1,8,32] [--seconds 3] [--processes 4]
    .venv/bin/python bench/governor_bench.py --base main [--rounds 2] [--levels 32]

The governor runs as its own process (`python -m services.governor serve`), as in production,
with a real SQLite file (WAL). Each client is a worker with its own channel that loops
Acquire(64 MiB) + Release as fast as it can (closed loop: saturation, where latency is bounded by
Little's law, clients / throughput), then at a fixed rate per client (open loop: real workers call
once per 64 MiB chunk of growth, a few times a second at most). Clients are spread over several
processes so that the client side's GIL is not what is measured. Printed side by side in one run:
- per level: p50/p99 of Acquire and Release, calls per second, p99 relative to one client, and
  the CPU per call of the governor process and of the client processes (where the cores go);
- the domain core alone (Ledger.acquire + release in process, no gRPC): where the time goes;
- GovernorClient.reserve/release of 1 MiB (served from chunks) vs one RPC per allocation.
With `--base REV`, the top level instead runs on REV's governor (exported with git archive) and on
this checkout's, alternating for `--rounds`, the same clients against both; it prints the medians
and tree/base ratios; `--ceiling` adds bench/governor_echo.py (no ledger) as a third side and
prints tree/ceiling calls/s and open-loop p50 (information: docs/governor.md's proposed bounds).
Targets (issue 16, bench/targets.py): open-loop Acquire p99 < 2 ms at the top level, and with
--base closed-loop calls/s >= 2x the base's; a miss prints MISSED, exit status 1.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record import add_record_flag
from bench.targets import Targets

P99_TARGET_MS = 2.0  # issue 16: Acquire p99 with 32 open-loop clients on 2 cores
THROUGHPUT_TARGET = 2.0  # issue 16: closed-loop throughput against the base
# docs/governor.md's proposed targets against the do-nothing server measured in the same run
CEILING_SHARE = 0.75  # closed-loop calls/s, tree / ceiling
CEILING_P50 = 1.25  # open-loop Acquire p50, tree / ceiling
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


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.05))


def run_level(target: str, clients: int, processes: int, seconds: float,
              rate: float = 0.0, server_pid: int = 0) -> dict[str, float]:
    """One level; with `server_pid`, also the CPU the server and the clients spent per call
    inside the measured window (where the two cores go)."""
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
    cpu: dict[str, float] = {}
    if server_pid:
        _sleep_until(start_at)
        server0, clients0 = _cpu_s(server_pid), sum(_cpu_s(w.pid) for w in workers)
        _sleep_until(stop_at)
        cpu = {"server": _cpu_s(server_pid) - server0,
               "clients": sum(_cpu_s(w.pid) for w in workers) - clients0}
    acquire, release = [], []
    for _ in workers:
        a, r = out.get(timeout=seconds + 60)
        acquire += a
        release += r
    for w in workers:
        w.join()
    calls = len(acquire) + len(release)
    per_call = {f"{k}_cpu_us_per_call": v / calls * 1e6 if calls else float("nan")
                for k, v in cpu.items()}
    return {"clients": clients, "samples": len(acquire), "calls_per_s": calls / seconds, **per_call,
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


def _free_target() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_server(tree: pathlib.Path, target: str, db: str) -> subprocess.Popen:
    """`python -m services.governor serve` from `tree` (this checkout, or a base exported for
    --base), as in production; returns once it listens."""
    governor = subprocess.Popen(
        [sys.executable, "-m", "services.governor", "serve", "--listen", target, "--db", db],
        cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": str(tree), "GPUPLANE_LOG_LEVEL": "WARNING"})
    if "listening" not in governor.stdout.readline():
        governor.kill()
        raise SystemExit(f"the governor from {tree} did not start")
    return governor


def start_echo(target: str) -> subprocess.Popen:
    """bench/governor_echo.py: GovernorService on grpc.aio with no ledger (the ceiling)."""
    echo = subprocess.Popen([sys.executable, str(ROOT / "bench" / "governor_echo.py"), target],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    if "listening" not in echo.stdout.readline():
        echo.kill()
        raise SystemExit("the echo governor did not start")
    return echo


def _print_header() -> None:
    print(f"{'clients':>7} {'pairs':>7} {'calls/s':>9} {'acq p50':>8} {'acq p99':>8} "
          f"{'rel p50':>8} {'rel p99':>8} {'p99 vs 1':>8} {'srv us/call':>11} {'cli us/call':>11}")


def _print_row(r: dict, base_p99: float) -> None:
    print(f"{r['clients']:>7} {r['samples']:>7} {r['calls_per_s']:>9.0f} {r['acquire_p50_ms']:>7.2f}m "
          f"{r['acquire_p99_ms']:>7.2f}m {r['release_p50_ms']:>7.2f}m {r['release_p99_ms']:>7.2f}m "
          f"{r['acquire_p99_ms'] / base_p99:>7.1f}x {r.get('server_cpu_us_per_call', float('nan')):>11.0f} "
          f"{r.get('clients_cpu_us_per_call', float('nan')):>11.0f}", flush=True)


def one_tree(args: argparse.Namespace, targets: Targets) -> dict:
    """Every level on this checkout's governor; the open-loop p99 target at the top level."""
    figures: dict = {}
    target = _free_target()
    levels = [int(x) for x in args.levels.split(",")]
    with tempfile.TemporaryDirectory() as d:
        governor = start_server(ROOT, target, ":memory:" if args.memory_db else f"{d}/gov.sqlite")
        try:
            print(f"governor bench: {os.cpu_count()} cores, {args.seconds:.0f} s per level, "
                  f"closed loop Acquire(64 MiB)+Release, clients over {args.processes} processes; "
                  "us/call = CPU per call of the governor process and of all client processes")
            modes = [("closed loop", 0.0, args.seconds)]
            if args.rate:
                modes.append((f"open loop, {args.rate:g} pairs/s per client", args.rate,
                              args.open_seconds))
            for mode, rate, seconds in modes:
                print(f"{mode}:")
                _print_header()
                base = None
                for clients in levels:
                    r = run_level(target, clients, args.processes, seconds, rate, governor.pid)
                    figures[f"{'open' if rate else 'closed'}_{clients}"] = {
                        k: v for k, v in r.items() if isinstance(v, (int, float))}
                    loop = f"{'open' if rate else 'closed'} loop, {clients} clients"
                    targets.figure(f"{loop}: calls/s", r["calls_per_s"], "calls/s")
                    targets.figure(f"{loop}: Acquire p50", r["acquire_p50_ms"], "ms")
                    targets.figure(f"{loop}: Acquire p99", r["acquire_p99_ms"], "ms")
                    base = base or r["acquire_p99_ms"]
                    _print_row(r, base)
            core = domain_core()
            print(f"domain core alone (Ledger acquire+release, SQLite WAL): {core:.0f} us/pair")
            chunked, per_call = chunked_vs_per_call(target)
            print(f"1 MiB reserve+release: GovernorClient {chunked:.1f} us vs one RPC each "
                  f"{per_call:.0f} us ({per_call / chunked:.0f}x)")
            figures["domain_core_us"] = core
            targets.figure("domain core alone: Ledger acquire+release", core, "us/pair")
            targets.figure("1 MiB reserve+release through GovernorClient", chunked, "us",
                           peer=per_call)
        finally:
            governor.kill()
            governor.wait()
    if args.rate:
        top = figures[f"open_{levels[-1]}"]
        targets.check(f"open-loop Acquire p99 ms, {levels[-1]} clients x {args.rate:g} pairs/s",
                      top["acquire_p99_ms"], "<", P99_TARGET_MS)
    return figures


def against_base(args: argparse.Namespace, targets: Targets) -> dict:
    """The top level on the base's governor and on this checkout's, alternating, same clients."""
    from bench.compare import export

    clients = int(args.levels.split(",")[-1])
    sides = ["base", "tree", *(["ceiling"] if args.ceiling else [])]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as d:
        base_tree = pathlib.Path(d) / "base"
        base_tree.mkdir()
        sha = export(args.base, base_tree)
        print(f"governor bench against base {args.base} ({sha[:12]}): {os.cpu_count()} cores, "
              f"{clients} clients, {args.rounds} rounds alternating, closed loop {args.seconds:g} s "
              f"then open loop {args.rate:g} pairs/s per client {args.open_seconds:g} s")
        _print_header()
        for i in range(args.rounds):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                target = _free_target()
                db = f"{d}/{side}-{i}.sqlite"
                governor = start_echo(target) if side == "ceiling" else \
                    start_server(base_tree if side == "base" else ROOT, target, db)
                try:
                    closed = run_level(target, clients, args.processes, args.seconds, 0.0,
                                       governor.pid)
                    opened = run_level(target, clients, args.processes, args.open_seconds,
                                       args.rate, governor.pid) if args.rate else {}
                finally:
                    governor.kill()
                    governor.wait()
                runs[side].append({"closed": closed, "open": opened})
                print(f"round {i + 1} {side}: closed", end="")
                _print_row(closed, closed["acquire_p99_ms"])
                if opened:
                    print(f"round {i + 1} {side}: open  ", end="")
                    _print_row(opened, opened["acquire_p99_ms"])

    def med(side: str, mode: str, key: str) -> float:
        values = [r[mode][key] for r in runs[side] if r[mode]]
        return statistics.median(values) if values else float("nan")

    keys = [("closed", "calls_per_s"), ("closed", "acquire_p99_ms"),
            ("closed", "server_cpu_us_per_call"), ("closed", "clients_cpu_us_per_call"),
            ("open", "acquire_p50_ms"), ("open", "acquire_p99_ms")]
    ceiling = args.ceiling
    print(f"medians over {args.rounds} rounds    {'base':>9} {'tree':>9} {'tree/base':>9}"
          + (f" {'ceiling':>9} {'ceil/base':>9}" if ceiling else ""))
    figures: dict = {}
    for mode, key in keys:
        b, t = med("base", mode, key), med("tree", mode, key)
        figures[f"{mode}_{key}"] = {"base": b, "tree": t, "ratio": t / b}
        line = f"{mode + ' ' + key:<29} {b:>9.2f} {t:>9.2f} {t / b:>8.2f}x"
        if ceiling:
            c = med("ceiling", mode, key)
            figures[f"{mode}_{key}"].update(ceiling=c, ceiling_ratio=c / b)
            line += f" {c:>9.2f} {c / b:>8.2f}x"
        print(line)
    if ceiling:
        print("ceiling = GovernorService on grpc.aio with no ledger, SQLite or interceptors "
              "(bench/governor_echo.py): what Python gRPC alone allows these clients")
    ratios = sorted(t["closed"]["calls_per_s"] / b["closed"]["calls_per_s"]
                    for t, b in zip(runs["tree"], runs["base"], strict=True))
    print(f"closed-loop calls/s ratio per round: {', '.join(f'{r:.2f}x' for r in ratios)}")
    if ceiling:
        _print_ceiling_ratios(runs, figures, bool(args.rate))
    targets.check(f"closed-loop calls/s at {clients} clients, tree / base",
                  figures["closed_calls_per_s"]["ratio"], ">=", THROUGHPUT_TARGET)
    if args.rate:
        targets.check(f"open-loop Acquire p99 ms, {clients} clients x {args.rate:g} pairs/s",
                      figures["open_acquire_p99_ms"]["tree"], "<", P99_TARGET_MS)
    return figures


def _print_ceiling_ratios(runs: dict[str, list[dict]], figures: dict, opened: bool) -> None:
    """The governor against the do-nothing server of the same run (information, not a target of
    the issue: docs/governor.md proposes >= 0.75x its calls/s and <= 1.25x its open-loop p50)."""
    per_round = sorted(t["closed"]["calls_per_s"] / c["closed"]["calls_per_s"]
                       for t, c in zip(runs["tree"], runs["ceiling"], strict=True))
    closed = figures["closed_calls_per_s"]
    ratio = closed["tree"] / closed["ceiling"]
    figures["tree_over_ceiling"] = {"closed_calls_per_s": ratio}
    print(f"tree / ceiling closed-loop calls/s: {ratio:.2f}x (per round "
          f"{', '.join(f'{r:.2f}x' for r in per_round)}; proposed >= {CEILING_SHARE:.2f}x: "
          f"{'met' if ratio >= CEILING_SHARE else 'not met'}; information)")
    if opened:
        p50 = figures["open_acquire_p50_ms"]
        ratio = p50["tree"] / p50["ceiling"]
        figures["tree_over_ceiling"]["open_acquire_p50_ms"] = ratio
        print(f"tree / ceiling open-loop Acquire p50: {ratio:.2f}x (proposed <= "
              f"{CEILING_P50:.2f}x: {'met' if ratio <= CEILING_P50 else 'not met'}; information)")


def main() -> int:
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
    parser.add_argument("--base", metavar="REV",
                        help="also serve the governor of git revision REV and run the top level "
                             "on both, alternating; prints tree/base ratios")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per side with --base")
    parser.add_argument("--ceiling", action="store_true",
                        help="with --base, also run bench/governor_echo.py (no ledger, no SQLite, "
                             "no interceptors): the most any governor change could give")
    add_record_flag(parser)
    args = parser.parse_args()
    if args.ceiling and not args.base:
        parser.error("--ceiling compares against a base: give --base REV too")
    targets = Targets("governor_bench", args=args)
    figures = against_base(args, targets) if args.base else one_tree(args, targets)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
