"""The governor as a process: workers in several processes racing, kill -9 and restart."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from gpuplane.governor.v1 import governor_pb2 as pb
from gpuplane.governor.v1 import governor_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import ResourceExhausted
from services.governor.client import DeviceDescription, GovernorClient
from tests.polling import eventually as _eventually

MIB = 1 << 20
ROOT = pathlib.Path(__file__).resolve().parents[2]
RACER = pathlib.Path(__file__).with_name("racer.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(db: pathlib.Path, port: int, *flags: str) -> subprocess.Popen:
    """Start `python -m services.governor serve` and wait until it says it is listening."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.governor", "serve", "--listen", f"127.0.0.1:{port}",
         "--db", str(db), *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env={**os.environ, "GPUPLANE_LOG_LEVEL": "WARNING"})
    line = proc.stdout.readline()
    assert "listening" in line, f"the governor did not start: {line!r}"
    return proc


def stub_for(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, governor_pb2_grpc.GovernorServiceStub(channel)


def eventually(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    _eventually(predicate, timeout, what, interval=0.05)


def governor_leases(stub) -> dict[str, set[str]]:
    """worker -> lease ids, as the governor reports them."""
    return {w.worker_id: {lease.lease_id for lease in w.leases}
            for d in stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices
            for w in d.workers}


def registered(stub) -> int:
    return sum(len(d.workers)
               for d in stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices)


def test_workers_in_several_processes_racing_for_the_last_bytes_never_overcommit(tmp_path):
    port = free_port()
    governor = start(tmp_path / "gov.sqlite", port, "--budget-fraction", "0.25")
    channel, stub = stub_for(port)
    go = tmp_path / "go"
    racers = [subprocess.Popen(
        [sys.executable, str(RACER), f"127.0.0.1:{port}", f"racer-{i}", str(go), str(3 * MIB),
         str(8 * MIB)], cwd=ROOT, stdout=subprocess.PIPE, text=True) for i in range(4)]
    try:
        eventually(lambda: registered(stub) == 4, timeout=60, what="all racers registered")
        go.touch()
        results = [json.loads(r.communicate(timeout=120)[0]) for r in racers]
        device = stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices[0]
        budget = 64 * MIB  # 0.25 x 256 MiB free
        assert device.budget_bytes == budget
        assert device.leased_bytes <= budget, "the sum of leases must never exceed the budget"
        assert sum(r["reserved"] for r in results) <= budget
        assert sum(r["reserved"] for r in results) >= budget - 4 * 3 * MIB, \
            "racers must get the last bytes, short of less than one step each"
        held = governor_leases(stub)
        for r in results:
            assert set(r["lease_ids"]) == held[r["worker_id"]], \
                f"{r['worker_id']}: the client's and the governor's leases must match (none lost)"
        assert sum(r["leased"] for r in results) == device.leased_bytes
    finally:
        for r in racers:
            r.kill()
        channel.close()
        governor.kill()
        governor.wait()


def test_kill_9_and_restart_keeps_every_lease_and_never_grants_twice(tmp_path):
    port = free_port()
    db = tmp_path / "gov.sqlite"
    governor = start(db, port, "--budget-fraction", "1.0")
    device = DeviceDescription("GPU-kill", "kill", 1024 * MIB, 512 * MIB, 2 * MIB)
    clients = [GovernorClient(f"127.0.0.1:{port}", f"w{i}", device, chunk_bytes=64 * MIB,
                              heartbeat_s=0.1, tracer_provider=TracerProvider())
               for i in range(2)]
    channel, stub = stub_for(port)
    try:
        clients[0].reserve("weights", 300 * MIB)
        clients[1].reserve("kv", 100 * MIB)
        before = governor_leases(stub)
        leased = stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices[0].leased_bytes
        assert leased == 448 * MIB  # 5 + 2 chunks of 64 MiB

        governor.send_signal(signal.SIGKILL)
        governor.wait()
        clients[0].reserve("weights", 20 * MIB)  # inside the held chunks
        eventually(lambda: not any(c.connected() for c in clients), what="clients see it down")
        with pytest.raises(ResourceExhausted):
            clients[1].reserve("kv", 200 * MIB)

        governor = start(db, port, "--budget-fraction", "1.0")
        eventually(lambda: all(c.connected() for c in clients), what="clients reconnect")
        eventually(lambda: all(c.stats()["registrations"] >= 2 for c in clients),
                   what="clients re-register after the restart")
        assert governor_leases(stub) == before, "every lease must survive kill -9"
        res = stub.GetResources(pb.GetResourcesRequest(), timeout=5).devices[0]
        assert res.leased_bytes == leased and res.free_budget_bytes == 64 * MIB
        stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id="late", device=pb.Device(
            uuid="GPU-kill", total_bytes=1024 * MIB, free_bytes=512 * MIB)), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            stub.Acquire(pb.AcquireRequest(worker_id="late", zone=pb.ZONE_KV,
                                           bytes=64 * MIB + 1), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, \
            "memory held before the crash must not be granted again"
        clients[1].reserve("kv", 64 * MIB)  # the one free chunk is still there to be had
    finally:
        for c in clients:
            c.close()
        channel.close()
        governor.kill()
        governor.wait()
