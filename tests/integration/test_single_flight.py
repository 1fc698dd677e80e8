"""Cross-host single flight end to end: worker processes with empty disks load one model at once."""
from __future__ import annotations

import pathlib
import threading

import grpc
import pytest
from gpuplane.kernelcache.v1 import kernel_cache_pb2, kernel_cache_pb2_grpc

from gpu_worker.client import WorkerClient
from gpu_worker.kernels import ALL_SOURCES
from gpu_worker.stack import Stack

TOKEN = "single-flight-token"
HOSTS = 3
pytestmark = pytest.mark.slow


def test_worker_processes_loading_the_same_model_at_once_compile_each_module_once(
        tmp_path: pathlib.Path) -> None:
    with Stack(tmp_path) as stack:
        cache = stack.start_cache(write_token=TOKEN)
        workers = [stack.start_worker(f"host{i}", backend="sim", cache=cache.address,
                                      cache_write_token=TOKEN) for i in range(HOSTS)]
        clients = [WorkerClient(w.address, deadline_s=120.0) for w in workers]
        barrier = threading.Barrier(HOSTS)
        results: dict[int, object] = {}

        def load(i: int) -> None:
            barrier.wait()
            results[i] = clients[i].load_model("m", "decoder", "tiny", 0)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(HOSTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        try:
            assert len(results) == HOSTS, f"only {len(results)} of {HOSTS} loads finished"
            compiled = [r.kernels_compiled for r in results.values()]
            stats = [c.stats().compile for c in clients]
        finally:
            for c in clients:
                c.close()
        with grpc.insecure_channel(cache.address) as channel:
            claims = kernel_cache_pb2_grpc.KernelCacheServiceStub(channel).GetStats(
                kernel_cache_pb2.GetStatsRequest(), timeout=5).claims
        assert sum(compiled) == len(ALL_SOURCES), (
            f"{HOSTS} hosts compiled {compiled} modules; the model has {len(ALL_SOURCES)} and "
            f"each should be compiled once across the fleet")
        assert sum(s.claims_granted for s in stats) == len(ALL_SOURCES) == claims.granted, \
            (stats, claims)
        assert claims.waits >= 1 and sum(s.claim_wait_hits for s in stats) >= 1, (
            f"no host waited on another's claim: the loads did not overlap ({stats}, {claims})")
        assert claims.expired == 0 and sum(s.claim_wait_timeouts for s in stats) == 0, claims
        assert stack.stop() == {"cache": 0, **{f"host{i}": 0 for i in range(HOSTS)}}
