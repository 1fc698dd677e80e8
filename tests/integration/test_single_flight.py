"""Cross-host single flight end to end: worker processes with empty disks load one model at once."""
from __future__ import annotations

import pathlib
import threading

import grpc
import pytest
from gpuplane.kernelcache.v1 import kernel_cache_pb2, kernel_cache_pb2_grpc

from cache_service.client import KernelCacheClient
from gpu_worker.compile import KernelCompiler
from gpu_worker.compile.single_flight import CLAIM_WAIT_ENV
from gpu_worker.edge.client import WorkerClient
from gpu_worker.kernels import ALL_SOURCES
from gpu_worker.stack.processes import Stack
from tests.polling import wait_until

TOKEN = "single-flight-token"
HOSTS = 3
WAIT_S = 150   # within the cache service's longest claim (300 s)
pytestmark = pytest.mark.slow


def cache_claims(address: str) -> kernel_cache_pb2.ClaimStats:
    with grpc.insecure_channel(address) as channel:
        return kernel_cache_pb2_grpc.KernelCacheServiceStub(channel).GetStats(
            kernel_cache_pb2.GetStatsRequest(), timeout=5).claims


def test_worker_processes_loading_the_same_model_at_once_compile_each_module_once(
        tmp_path: pathlib.Path) -> None:
    # A loaded 2-core CI machine can put tens of seconds between two hosts reaching the first
    # module, more than a host's default claim wait (20 s): each waits up to WAIT_S here, and the
    # gate's claim outlives the test's own wait for them.
    with Stack(tmp_path, env={CLAIM_WAIT_ENV: str(WAIT_S)}) as stack:
        cache = stack.start_cache(write_token=TOKEN)
        workers = [stack.start_worker(f"host{i}", backend="sim", cache=cache.address,
                                      cache_write_token=TOKEN) for i in range(HOSTS)]
        clients = [WorkerClient(w.address, deadline_s=120.0) for w in workers]
        # The loads must overlap for the claims to matter, and a loaded CI machine can start one
        # host seconds after another. So the test holds the claim on the first module the hosts
        # compile until every host waits on it, then gives it back: from there on it is theirs.
        first_key = KernelCompiler("sm_90", cache_dir=tmp_path / "keys").keys(ALL_SOURCES[0])[0]
        gate = KernelCacheClient(cache.address, write_token=TOKEN, deadline_s=5.0)
        assert gate.claim(first_key, "", "test-gate", ttl_s=2 * WAIT_S).outcome == "granted"
        results: dict[int, object] = {}

        def load(i: int) -> None:
            results[i] = clients[i].load_model("m", "decoder", "tiny", 0)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(HOSTS)]
        for t in threads:
            t.start()
        all_waiting = wait_until(lambda: cache_claims(cache.address).waiting == HOSTS, WAIT_S)
        assert gate.release_claim(first_key, "", "test-gate"), "the gate claim was lost"
        gate.close()
        for t in threads:
            t.join(300)
        assert all_waiting, "the hosts never all waited on the first module's claim"
        try:
            assert len(results) == HOSTS, f"only {len(results)} of {HOSTS} loads finished"
            compiled = [r.kernels_compiled for r in results.values()]
            stats = [c.stats().compile for c in clients]
        finally:
            for c in clients:
                c.close()
        claims = cache_claims(cache.address)
        assert sum(compiled) == len(ALL_SOURCES), (
            f"{HOSTS} hosts compiled {compiled} modules; the model has {len(ALL_SOURCES)} and "
            f"each should be compiled once across the fleet")
        assert sum(s.claims_granted for s in stats) == len(ALL_SOURCES), stats
        assert claims.granted == len(ALL_SOURCES) + 1 and claims.released == 1, claims  # + gate
        assert all(s.claim_waits >= 1 for s in stats), f"a host never waited: {stats}"
        assert sum(s.claim_wait_hits for s in stats) >= HOSTS - 1, stats
        assert claims.expired == 0 and sum(s.claim_wait_timeouts for s in stats) == 0, claims
        assert stack.stop() == {"cache": 0, **{f"host{i}": 0 for i in range(HOSTS)}}
