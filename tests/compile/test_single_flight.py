"""Cross-host single flight at the compiler: a dead holder, a service that dies or stalls mid-wait.

Every case runs a real cache server (or a real socket that never answers) on loopback and real
NVRTC; the point of each is that no answer of the service holds a compile past its deadline.
"""
from __future__ import annotations

import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from cache_service.client import KernelCacheClient
from cache_service.config import ServerConfig
from cache_service.server import CacheServer, start_cache_server
from gpu_worker.compile import KernelCompiler
from gpu_worker.compile.single_flight import ClaimPolicy
from tests.compile.test_compiler import ARCH, source
from tests.polling import wait_until

TOKEN = "sf-token"


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[CacheServer]:
    config = ServerConfig(listen="127.0.0.1:0", db=tmp_path / "kernels.sqlite",
                          write_token=TOKEN, maintenance_s=3600.0)
    running = start_cache_server(config, registry=CollectorRegistry())
    yield running
    running.stop(grace=0.5)


def client(target: str) -> KernelCacheClient:
    return KernelCacheClient(target, write_token=TOKEN, deadline_s=0.5)


def compiler(tmp_path: pathlib.Path, remote: KernelCacheClient, name: str,
             wait_s: float = 20.0) -> KernelCompiler:
    return KernelCompiler(ARCH, cache_dir=tmp_path / name, remote=remote,
                          claim=ClaimPolicy(ttl_s=10.0, wait_s=wait_s, holder=name))


_HOLDER = """
import sys, time
from cache_service.client import KernelCacheClient
c = KernelCacheClient(sys.argv[1], write_token=sys.argv[2], deadline_s=2.0)
reply = c.claim(sys.argv[3], "", "doomed-host", ttl_s=float(sys.argv[4]))
print(reply.outcome if reply else "none", flush=True)
time.sleep(600)
"""


def test_a_claim_whose_holder_is_killed_expires_and_a_waiter_takes_over(
        tmp_path: pathlib.Path, server: CacheServer) -> None:
    src = source("sf_killed", body="y[i] = 3.0f * x[i];")
    key = KernelCompiler(ARCH, cache_dir=tmp_path / "keys").keys(src)[0]
    ttl = 1.5
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, server.address, TOKEN, key, str(ttl)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "granted", "the holder process got no claim"
        claimed_at = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        remote = client(server.address)
        try:
            survivor = compiler(tmp_path, remote, "survivor")
            module = survivor.compile(src)
        finally:
            remote.close()
    finally:
        if holder.poll() is None:
            holder.kill()
    took = time.monotonic() - claimed_at
    assert module.source_tier == "compiled", module.source_tier
    claims = server.servicer.claims.stats()
    assert claims.expired == 1 and claims.granted == 2, claims
    assert survivor.stats()["claim_takeovers"] == 1, survivor.stats()
    assert took >= ttl - 0.2, f"the waiter compiled after {took:.2f}s, before the claim expired"
    assert took < ttl + 10, f"the takeover took {took:.2f}s after a {ttl}s claim"


def test_the_takeover_is_counted_in_the_worker_compile_stats(
        tmp_path: pathlib.Path, server: CacheServer) -> None:
    src = source("sf_takeover", body="y[i] = 5.0f * x[i];")
    key = KernelCompiler(ARCH, cache_dir=tmp_path / "keys").keys(src)[0]
    stalled = client(server.address)
    remote = client(server.address)
    try:
        assert stalled.claim(key, "", "stalled-host", ttl_s=0.5).outcome == "granted"
        c = compiler(tmp_path, remote, "taker")
        assert c.compile(src).source_tier == "compiled"
        s = c.stats()
        assert (s["claim_waits"], s["claims_granted"], s["claim_takeovers"], s["compiled"]) == \
            (1, 1, 1, 1), s
        assert remote.flush(5.0)
        # The takeover's store ended its claim: the stalled host, waking up, finds the artifact.
        late = stalled.claim(key, "", "stalled-host", ttl_s=0.5)
        assert late.outcome == "found" and late.artifact.kind == "cubin", late
    finally:
        stalled.close()
        remote.close()


def test_a_failed_compile_releases_its_claim_so_the_next_host_need_not_wait(
        tmp_path: pathlib.Path, server: CacheServer) -> None:
    from gpu_worker.compile import NvrtcError

    bad = source("sf_broken", body="this is not C++;")
    remote = client(server.address)
    try:
        with pytest.raises(NvrtcError):
            compiler(tmp_path, remote, "host-a").compile(bad)
        assert server.servicer.claims.stats().released == 1
        started = time.monotonic()
        with pytest.raises(NvrtcError):
            compiler(tmp_path, remote, "host-b").compile(bad)
        assert time.monotonic() - started < 5.0, "host-b waited out host-a's released claim"
    finally:
        remote.close()


def test_the_service_going_down_during_a_claim_wait_compiles_locally_at_once(
        tmp_path: pathlib.Path, server: CacheServer) -> None:
    src = source("sf_down", body="y[i] = 7.0f * x[i];")
    key = KernelCompiler(ARCH, cache_dir=tmp_path / "keys").keys(src)[0]
    holder = client(server.address)
    remote = client(server.address)
    results: list = []
    try:
        assert holder.claim(key, "", "host-a", ttl_s=60.0).outcome == "granted"
        c = compiler(tmp_path, remote, "host-b", wait_s=60.0)
        waiter = threading.Thread(target=lambda: results.append(c.compile(src)))
        waiter.start()
        assert wait_until(lambda: server.servicer.claims.stats().waiting == 1, 10.0), \
            "host-b never waited on host-a's claim"
        stopped_at = time.monotonic()
        server.stop(grace=0)
        waiter.join(30)
        after_stop = time.monotonic() - stopped_at
    finally:
        holder.close(flush_timeout=0)
        remote.close(flush_timeout=0)
    assert results and results[0].source_tier == "compiled", results
    assert after_stop < 3.0, f"host-b compiled {after_stop:.2f}s after the service went down"
    assert c.stats()["compiled"] == 1 and c.stats()["claim_wait_hits"] == 0, c.stats()


def test_a_service_that_never_answers_holds_a_compile_no_longer_than_its_deadline(
        tmp_path: pathlib.Path) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts TCP, never speaks HTTP/2
    conns: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: conns.append(silent.accept()[0]), daemon=True)
    acceptor.start()
    remote = KernelCacheClient(f"127.0.0.1:{silent.getsockname()[1]}", write_token=TOKEN,
                               deadline_s=0.25)
    try:
        c = compiler(tmp_path, remote, "host-x", wait_s=1.0)
        started = time.monotonic()
        module = c.compile(source("sf_silent", body="y[i] = 9.0f * x[i];"))
        took = time.monotonic() - started
    finally:
        remote.close(flush_timeout=0)
        silent.close()
        for conn in conns:
            conn.close()
    nvrtc = module.compile_seconds
    assert module.source_tier == "compiled"
    # One batch lookup (4 x 0.25 s) plus one Claim (wait 1.0 s + 1.0 s for the answer), then
    # NVRTC: the bound a worker's cold start has against a service that never answers.
    assert took - nvrtc < 3.0 + 0.5, f"{took - nvrtc:.2f}s spent on a silent service"


def test_a_wait_that_outlives_its_budget_compiles_locally_and_is_counted(
        tmp_path: pathlib.Path, server: CacheServer) -> None:
    src = source("sf_budget", body="y[i] = 11.0f * x[i];")
    key = KernelCompiler(ARCH, cache_dir=tmp_path / "keys").keys(src)[0]
    holder = client(server.address)
    remote = client(server.address)
    try:
        assert holder.claim(key, "", "slow-host", ttl_s=60.0).outcome == "granted"
        c = compiler(tmp_path, remote, "impatient", wait_s=0.5)
        started = time.monotonic()
        module = c.compile(src)
        took = time.monotonic() - started - module.compile_seconds
    finally:
        holder.close()
        remote.close()
    assert module.source_tier == "compiled"
    assert 0.4 < took < 1.5, f"waited {took:.2f}s on a 0.5 s budget"
    assert c.stats()["claim_wait_timeouts"] == 1 and c.stats()["claim_waits"] == 1, c.stats()


def test_a_holder_that_is_still_compiling_keeps_its_claim_past_the_ttl(
        server: CacheServer) -> None:
    from gpu_worker.compile.single_flight import CLAIMED, SingleFlight

    holder, other = client(server.address), client(server.address)
    try:
        flight = SingleFlight(holder, "", ClaimPolicy(ttl_s=0.3, wait_s=5.0, holder="slow-host"))
        assert flight.acquire("k-slow") == CLAIMED
        with flight.renewing("k-slow"):
            time.sleep(1.0)  # a compile three TTLs long on a loaded host
            reply = other.claim("k-slow", "", "eager-host", ttl_s=5.0)
            assert reply is not None and reply.outcome == "held", \
                f"a holder still compiling lost its claim: {reply}"
        assert wait_until(lambda: other.claim("k-slow", "", "eager-host", ttl_s=5.0).outcome
                          == "granted", 3.0), "the claim outlived its holder's last renewal"
        assert server.servicer.claims.stats().expired == 1
    finally:
        holder.close()
        other.close()


def test_the_claim_policy_comes_from_the_environment_and_rejects_nonsense(monkeypatch) -> None:
    monkeypatch.setenv("GPUPLANE_KERNEL_CLAIM_TTL_S", "4")
    monkeypatch.setenv("GPUPLANE_KERNEL_CLAIM_WAIT_S", "0")
    policy = ClaimPolicy.from_env()
    assert policy.ttl_s == 4.0 and policy.wait_s == 0.0 and policy.holder
    monkeypatch.setenv("GPUPLANE_KERNEL_CLAIM_WAIT_S", "soon")
    with pytest.raises(ValueError, match="GPUPLANE_KERNEL_CLAIM_WAIT_S"):
        ClaimPolicy.from_env()


def test_wait_zero_turns_single_flight_off_and_asks_the_service_nothing(
        tmp_path: pathlib.Path, server: CacheServer) -> None:
    remote = client(server.address)
    try:
        c = compiler(tmp_path, remote, "solo", wait_s=0.0)
        assert c.compile(source("sf_off", body="y[i] = 13.0f * x[i];")).source_tier == "compiled"
        assert server.servicer.claims.stats().granted == 0 and c.stats()["claims_granted"] == 0
    finally:
        remote.close()
