"""Fleet cold start: N hosts with empty disks load the same model's kernels from one cache service.

    .venv/bin/python bench/fleet_bench.py [--hosts 64] [--arch sm_90] [--json OUT]

Each "host" is its own process on loopback running the worker's kernel path exactly as
`WorkerRuntime.load_model` does (a KernelCompiler with an empty disk cache and the shared
service: one prefetch BatchLookup for the model's kernel set, then compile() of every module),
with real NVRTC and a real cache server process (`python -m cache_service serve`). Every host
imports and connects first, then all start together. The run is done twice, in this order, each
against a fresh service: with cross-host single flight (the default) and without it
(GPUPLANE_KERNEL_CLAIM_WAIT_S=0, the behaviour before issue 16). Printed per run:
- time until every host has its kernels (from the common start to the last host's finish),
  and the p50 host;
- total NVRTC compiles (target with single flight: one per module), claims, waits;
- cache service CPU seconds (utime + stime from /proc) and bytes served.
A missed target prints MISSED and the process exits 1. docs/cache_service.md extrapolates these
figures to 1,000 hosts.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record import add_record_flag
from bench.targets import Targets

TOKEN = "fleet-bench-token"


def _host(index: int, target: str, arch: str, folder: str, wait_s: float, ready, go,
          out: mp.Queue) -> None:
    os.environ["GPUPLANE_LOG_LEVEL"] = "WARNING"
    from cache_service.client import KernelCacheClient
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.compile.single_flight import ClaimPolicy
    from gpu_worker.kernels import ALL_SOURCES

    client = KernelCacheClient(target, write_token=TOKEN)
    compiler = KernelCompiler(arch, cache_dir=pathlib.Path(folder) / f"host{index}",
                              remote=client, claim=ClaimPolicy(wait_s=wait_s,
                                                               holder=f"host{index}"))
    ready.release()
    go.wait()
    started = time.time()
    compiler.prefetch(ALL_SOURCES)
    for src in ALL_SOURCES:  # the order load_model uses
        compiler.compile(src)
    finished = time.time()
    client.flush(30.0)
    out.put({"host": index, "started": started, "finished": finished,
             "modules": len(ALL_SOURCES), **compiler.stats()})
    client.close()


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_server(db: pathlib.Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "serve", "--listen", "127.0.0.1:0", "--db",
         str(db), "--write-token", TOKEN],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "GPUPLANE_LOG_LEVEL": "WARNING", "OTEL_TRACES_EXPORTER": "none"})
    for line in proc.stderr:
        match = re.search(r"listening on port (\d+)", line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, f"127.0.0.1:{match.group(1)}"
    raise SystemExit("cache server did not start")


def _server_stats(target: str) -> dict:
    import grpc
    from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
    from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        s = pb_grpc.KernelCacheServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    return {"hits": s.hits, "misses": s.misses, "stores": s.stores, "bytes_served": s.bytes_served,
            "claims_granted": s.claims.granted, "claim_waits": s.claims.waits,
            "claim_wait_hits": s.claims.wait_hits, "claims_expired": s.claims.expired}


def run_fleet(hosts: int, arch: str, wait_s: float, scratch: pathlib.Path) -> dict:
    """One cold start of `hosts` processes against a fresh service; the figures of one run."""
    proc, target = _start_server(scratch / "cache.sqlite")
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_host, args=(i, target, arch, str(scratch), wait_s, ready, go,
                                             out)) for i in range(hosts)]
    try:
        for p in procs:
            p.start()
        for _ in range(hosts):  # every host imported and connected: the start is the same
            if not ready.acquire(timeout=600):
                raise SystemExit("a host process did not get ready in 10 minutes")
        cpu_before = _cpu_seconds(proc.pid)
        start = time.time()
        go.set()
        rows = [out.get(timeout=900) for _ in range(hosts)]
        cpu = _cpu_seconds(proc.pid) - cpu_before
        for p in procs:
            p.join(60)
        server = _server_stats(target)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        proc.terminate()
        proc.wait(30)
    done = sorted(r["finished"] - start for r in rows)
    return {"hosts": hosts, "modules": rows[0]["modules"], "single_flight": wait_s > 0,
            "all_done_s": done[-1], "p50_host_s": done[len(done) // 2],
            "compiled": sum(r["compiled"] for r in rows),
            "compile_seconds": sum(r["compile_seconds"] for r in rows),
            "host_claims": sum(r["claims_granted"] for r in rows),
            "host_waits": sum(r["claim_waits"] for r in rows),
            "host_wait_timeouts": sum(r["claim_wait_timeouts"] for r in rows),
            "server_cpu_s": cpu, **{f"server_{k}": v for k, v in server.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=64)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--wait-s", type=float, default=60.0,
                        help="claim wait budget per module with single flight (a fleet of "
                             "processes on 2 cores compiles slowly)")
    parser.add_argument("--json", type=pathlib.Path)
    add_record_flag(parser)
    args = parser.parse_args(argv)
    targets = Targets("fleet_bench", args=args)
    runs = []
    for wait_s in (args.wait_s, 0.0):
        with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
            runs.append(run_fleet(args.hosts, args.arch, wait_s, pathlib.Path(tmp)))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"fleet bench  {stamp}  {os.cpu_count()} cpus  load average at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{args.hosts} hosts cold-start {runs[0]['modules']} kernel modules ({args.arch}) "
          f"against one cache service")
    print(f"{'':18} {'all done s':>10} {'p50 host s':>10} {'compiles':>8} {'claims':>6} "
          f"{'waits':>6} {'svc CPU s':>9} {'MiB served':>10} {'svc hits':>8}")
    for r in runs:
        name = "single flight" if r["single_flight"] else "no single flight"
        print(f"{name:18} {r['all_done_s']:10.2f} {r['p50_host_s']:10.2f} {r['compiled']:8d} "
              f"{r['server_claims_granted']:6d} {r['server_claim_waits']:6d} "
              f"{r['server_cpu_s']:9.2f} {r['server_bytes_served'] / 2**20:10.2f} "
              f"{r['server_hits']:8d}")
    on, off = runs
    print(f"compiles: {on['compiled']} with single flight vs {off['compiled']} without "
          f"({off['compiled'] / max(1, on['compiled']):.1f}x fewer); time until every host has "
          f"its kernels {on['all_done_s']:.2f} s vs {off['all_done_s']:.2f} s")
    targets.figure(f"{args.hosts} hosts: time until every host has its kernels, single flight",
                   on["all_done_s"], "s", peer=off["all_done_s"])
    targets.require(f"each module compiled once across {args.hosts} hosts",
                    on["compiled"] == on["modules"],
                    f"{on['compiled']} compiles for {on['modules']} modules")
    if args.json:
        args.json.write_text(json.dumps({"date": stamp, "runs": runs}, indent=2))
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
