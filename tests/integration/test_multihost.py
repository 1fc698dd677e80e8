"""Two worker hosts and the cache service, each in its own network namespace on one bridge.

The second host starts with an empty disk cache and must compile nothing: every kernel comes from
the shared cache service over the (virtual) network. Needs root and `ip`; skips cleanly otherwise.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpu_worker.edge.client import WorkerClient
from gpu_worker.stack.processes import Stack

from .test_process_stack import cache_entries

TOKEN = "multihost-token"
pytestmark = pytest.mark.slow


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _netns_possible() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"gpprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here: {exc}"
    return None


def _bridge_blocked(server_ns: str, client_ns: str, server_ip: str) -> str | None:
    """None when a TCP connection crosses the bridge between two namespaces; a host firewall
    (br_netfilter with a DROP policy, as on Docker hosts) can stop it."""
    listener = subprocess.Popen(
        ["ip", "netns", "exec", server_ns, sys.executable, "-c",
         ("import socket; s = socket.create_server(('0.0.0.0', 50099)); print('up', flush=True); "
          "s.settimeout(10); s.accept()")], stdout=subprocess.PIPE, text=True)
    try:
        if listener.stdout.readline().strip() != "up":
            return "could not listen inside a namespace"
        probe = subprocess.run(
            ["ip", "netns", "exec", client_ns, sys.executable, "-c",
             f"import socket; socket.create_connection(('{server_ip}', 50099), timeout=3)"],
            capture_output=True, timeout=15, check=False)
        return None if probe.returncode == 0 else "the bridge between namespaces drops traffic here"
    finally:
        listener.kill()
        listener.wait()


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Namespaces cache, host-a, host-b on a bridge; returns name -> IP reachable from here."""
    why = _netns_possible()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250}"
    bridge = f"gpbr{tag}"
    names = {"cache": f"gpc{tag}", "host-a": f"gpa{tag}", "host-b": f"gpb{tag}"}
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        addresses = {}
        for i, (role, ns) in enumerate(names.items(), start=2):
            _ip("netns", "add", ns)
            made.append(ns)
            veth = f"gpv{tag}{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            addresses[role] = f"{subnet}.{i}"
        why = _bridge_blocked(names["cache"], names["host-a"], addresses["cache"])
        if why:
            pytest.skip(why)
        yield {"ns:" + role: ns for role, ns in names.items()} | addresses
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"could not build the namespace network: {exc.stderr.decode(errors='replace')}")
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)


def test_a_second_host_warms_from_the_shared_cache_across_namespaces_and_compiles_nothing(
        hosts: dict[str, str], tmp_path: pathlib.Path) -> None:
    def inside(role: str) -> list[str]:
        return ["ip", "netns", "exec", hosts["ns:" + role]]

    with Stack(tmp_path) as stack:
        cache = stack.start_cache(write_token=TOKEN, host=hosts["cache"], port=50052,
                                  prefix=inside("cache"))
        a = stack.start_worker("host-a", backend="sim", cache=cache.address, cache_write_token=TOKEN,
                               cache_dir=tmp_path / "host-a" / "kernels", host=hosts["host-a"],
                               port=50051, prefix=inside("host-a"))
        with WorkerClient(a.address, deadline_s=120.0) as client:
            client.load_model("d", "decoder", "tiny", 2)
            tokens_a = client.generate("d", [9, 8, 7, 6, 5], 4).tokens
            compiled_a = client.stats().compile.compiled
        assert compiled_a > 0, "host-a compiled nothing: the test would prove nothing"
        # Stores are fire-and-forget: wait until the shared cache stops growing.
        last, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 1.0:
            now = cache_entries(cache.address)
            if now != last:
                last, stable_since = now, time.monotonic()
            time.sleep(0.1)
        assert last > 0, "host-a stored nothing in the shared cache"

        b = stack.start_worker("host-b", backend="sim", cache=cache.address, cache_write_token=TOKEN,
                               cache_dir=tmp_path / "host-b" / "kernels", host=hosts["host-b"],
                               port=50051, prefix=inside("host-b"))
        with WorkerClient(b.address, deadline_s=120.0) as client:
            client.load_model("d", "decoder", "tiny", 2)
            tokens_b = client.generate("d", [9, 8, 7, 6, 5], 4).tokens
            compile_b = client.stats().compile
        assert compile_b.compiled == 0, \
            f"host-b compiled {compile_b.compiled} kernels despite the shared cache"
        assert compile_b.remote_hits > 0, "host-b did not fetch its kernels from the cache service"
        assert tokens_b == tokens_a, "the two hosts disagree on the same model and prompt"
        codes = stack.stop()
    assert set(codes.values()) == {0}, f"a namespaced service did not stop cleanly: {codes}"
