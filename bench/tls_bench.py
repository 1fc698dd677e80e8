"""The price of mutual TLS and per-RPC authorization: governor Acquire and cache hit p50, side by side.

    .venv/bin/python bench/tls_bench.py [--calls 2000] [--rounds 50] [--artifact-bytes 256KiB]

Four servers run as their own processes through their real CLIs, as deployed: a governor and a
kernel cache in plaintext, and a governor and a kernel cache with --tls-cert/--tls-key/
--tls-client-ca and --role mappings (mutual TLS plus the authorization interceptor: the
production configuration). Certificates are made on the spot (tests/certs.py, EC P-256).
One client in this process calls each pair in alternating rounds (plaintext, TLS, plaintext, ...),
so a shared machine's changing load hits both sides alike; each connection is made before the
timed calls (a handshake per connection, not per call, is what a long-lived worker pays).

Printed: p50/p99 per side, and the ratio of p50s (TLS / plaintext) for
  governor Acquire (64 MiB, then Release, untimed), target <= 1.2
  cache hit (Lookup of a stored --artifact-bytes artifact), target <= 1.2
A missed target is printed as MISSED and the process exits 1.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc
from gpuplane.governor.v1 import governor_pb2 as gpb
from gpuplane.governor.v1 import governor_pb2_grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as cpb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc

from bench.record import add_record_flag
from bench.targets import Targets
from cache_service.artifact import Artifact
from cache_service.convert import artifact_to_pb
from services.common.config import parse_bytes
from services.common.tls import ChannelTLS
from tests.certs import CertificateAuthority

TARGET_RATIO = 1.2
MIB = 1 << 20
WORKER_URI = "spiffe://gpuplane/worker/bench-worker"
ROLES = ["--role", "worker=spiffe://gpuplane/worker/*", "--role", "admin=spiffe://gpuplane/admin/*"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Servers:
    """The four server processes; stopped (SIGTERM, then waited for) on close."""

    def __init__(self, tmp: pathlib.Path, ca: CertificateAuthority, roles: bool) -> None:
        self.procs: list[subprocess.Popen] = []
        leaf = ca.issue("server")
        self.tls_flags = ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key),
                          "--tls-client-ca", str(ca.ca_file), *(ROLES if roles else [])]
        self.tmp = tmp

    def start(self, module: str, name: str, tls: bool, extra: list[str]) -> str:
        port = _free_port()
        argv = [sys.executable, "-m", module, "serve", "--listen", f"127.0.0.1:{port}",
                "--db", str(self.tmp / f"{name}.sqlite"), *extra,
                *(self.tls_flags if tls else [])]
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "GPUPLANE_LOG_LEVEL": "warning"}
        self.procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)


def _channel(target: str, tls: ChannelTLS | None) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", 64 * MIB)]
    channel = (grpc.secure_channel(target, tls.credentials(), options=options) if tls
               else grpc.insecure_channel(target, options=options))
    grpc.channel_ready_future(channel).result(timeout=60)
    return channel


def _timed(call: Callable[[], object], n: int, out: list[float]) -> None:
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)


def governor_side(channel: grpc.Channel) -> Callable[[int, list[float]], None]:
    stub = governor_pb2_grpc.GovernorServiceStub(channel)
    stub.RegisterWorker(gpb.RegisterWorkerRequest(
        worker_id="bench-worker", device=gpb.Device(uuid="GPU-bench", total_bytes=1 << 50,
                                                    free_bytes=1 << 50)), timeout=30)
    request = gpb.AcquireRequest(worker_id="bench-worker", device_uuid="GPU-bench",
                                 zone=gpb.ZONE_KV, bytes=64 * MIB)

    def run(n: int, out: list[float]) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            lease = stub.Acquire(request, timeout=10).lease
            out.append(time.perf_counter() - t0)
            stub.Release(gpb.ReleaseRequest(worker_id="bench-worker", lease_id=lease.lease_id),
                         timeout=10)
    return run


def cache_side(channel: grpc.Channel, size: int) -> Callable[[int, list[float]], None]:
    stub = kernel_cache_pb2_grpc.KernelCacheServiceStub(channel)
    data = os.urandom(size)
    artifact = Artifact(data=data, kind="cubin", arch="sm_90", nvrtc_version="13.0",
                        module_name="bench", compile_seconds=0.1)
    stub.Store(cpb.StoreRequest(key="bench-hit", artifact=artifact_to_pb(artifact)), timeout=30)
    request = cpb.LookupRequest(key="bench-hit")

    def run(n: int, out: list[float]) -> None:
        def lookup() -> None:
            assert stub.Lookup(request, timeout=10).found, "the benchmark's artifact is gone"
        _timed(lookup, n, out)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per side per op")
    parser.add_argument("--rounds", type=int, default=50, help="alternations plaintext/TLS")
    parser.add_argument("--artifact-bytes", type=parse_bytes, default=256 * 1024)
    parser.add_argument("--without-roles", action="store_true",
                        help="TLS side without --role (no authorization): splits the cost")
    add_record_flag(parser)
    args = parser.parse_args(argv)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tls-bench-"))
    ca = CertificateAuthority(tmp / "pki")
    worker = ca.issue("bench-worker", uris=(WORKER_URI,))
    tls = ChannelTLS(str(ca.ca_file), str(worker.cert), str(worker.key))
    servers = Servers(tmp, ca, roles=not args.without_roles)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        targets = {
            ("governor", False): servers.start("services.governor", "gov-plain", False, []),
            ("governor", True): servers.start("services.governor", "gov-tls", True, []),
            ("cache", False): servers.start("cache_service", "cache-plain", False, []),
            ("cache", True): servers.start("cache_service", "cache-tls", True, []),
        }
        sides = {}
        for (service, secure), target in targets.items():
            channel = _channel(target, tls if secure else None)
            sides[(service, secure)] = (governor_side(channel) if service == "governor"
                                        else cache_side(channel, args.artifact_bytes))
            sides[(service, secure)](20, [])  # warm-up: imports, first SQLite pages, caches
        per_round = max(1, args.calls // args.rounds)
        for service in ("governor", "cache"):
            results[service] = {"plaintext": [], "mutual TLS": []}
            for _ in range(args.rounds):
                sides[(service, False)](per_round, results[service]["plaintext"])
                sides[(service, True)](per_round, results[service]["mutual TLS"])
    finally:
        servers.close()

    print(f"tls bench  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.node()} "
          f"{os.cpu_count()} cpus  python {platform.python_version()}  grpcio {grpc.__version__}")
    print(f"{args.calls} calls per side in {args.rounds} alternating rounds; cache artifact "
          f"{args.artifact_bytes} bytes; TLS side = mutual TLS (EC P-256)"
          f"{' without authorization' if args.without_roles else ' + role authorization'}")
    print(f"{'op':<26} {'side':<12} {'p50 ms':>9} {'p99 ms':>9}")
    targets = Targets("tls_bench", args=args)
    for service, label in (("governor", "governor Acquire"), ("cache", "cache hit (Lookup)")):
        p50 = {}
        for side, values in results[service].items():
            p50[side] = _pct(values, 0.5) * 1e3
            print(f"{label:<26} {side:<12} {p50[side]:9.3f} {_pct(values, 0.99) * 1e3:9.3f}")
        targets.check(f"{label} p50 mutual TLS / plaintext",
                      p50["mutual TLS"] / p50["plaintext"], "<=", TARGET_RATIO, fmt=".3f")
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
