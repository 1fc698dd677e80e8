"""The stack as `make run` starts it: three `python -m ... serve` processes on loopback ports."""
from __future__ import annotations

import pathlib

import grpc
import pytest
from gpuplane.governor.v1 import governor_pb2, governor_pb2_grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2, kernel_cache_pb2_grpc

from gpu_worker.edge.client import WorkerClient
from gpu_worker.models.configs import get_config
from gpu_worker.models.reference import DecoderReference
from gpu_worker.models.weights import load_host
from gpu_worker.stack.processes import Stack
from tests.polling import wait_until as _wait_until

TOKEN = "process-stack-token"
pytestmark = pytest.mark.slow


def governor_worker(address: str, worker_id: str) -> governor_pb2.WorkerResources | None:
    with grpc.insecure_channel(address) as channel:
        reply = governor_pb2_grpc.GovernorServiceStub(channel).GetResources(
            governor_pb2.GetResourcesRequest(), timeout=5)
    for device in reply.devices:
        for worker in device.workers:
            if worker.worker_id == worker_id:
                return worker
    return None


def cache_entries(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return kernel_cache_pb2_grpc.KernelCacheServiceStub(channel).GetStats(
            kernel_cache_pb2.GetStatsRequest(), timeout=5).entries


def wait_until(predicate, timeout_s: float = 15.0) -> bool:
    return _wait_until(predicate, timeout_s, interval=0.1)


def test_three_service_processes_serve_the_decoder_book_it_with_the_governor_and_stop_cleanly(
        tmp_path: pathlib.Path) -> None:
    cfg = get_config("tiny", "decoder")
    with Stack(tmp_path) as stack:
        governor = stack.start_governor()
        cache = stack.start_cache(write_token=TOKEN)
        worker = stack.start_worker("proc-worker", backend="sim", governor=governor.address,
                                    cache=cache.address, cache_write_token=TOKEN)
        with WorkerClient(worker.address, deadline_s=120.0) as client:
            client.load_model("d", "decoder", "tiny", 5)
            prompt = [3, 1, 4, 1, 5, 9, 2, 6]
            tokens = client.generate("d", prompt, 4).tokens
            stats = client.stats()
        assert tokens == DecoderReference(cfg, load_host(cfg, 5)).generate(prompt, 4), \
            "the worker process served tokens that differ from the reference"
        assert stats.governor_connected, "the worker process is not connected to the governor"
        assert wait_until(lambda: (governor_worker(governor.address, "proc-worker") or
                                   governor_pb2.WorkerResources()).committed_bytes > 0), \
            "the governor never saw the worker's committed bytes in a heartbeat"
        assert wait_until(lambda: cache_entries(cache.address) > 0), \
            "the worker stored no compiled kernel in the shared cache service"
        codes = stack.stop()
    assert codes == {"proc-worker": 0, "cache": 0, "governor": 0}, \
        f"a service did not shut down cleanly on SIGTERM: {codes}"


def test_a_worker_with_no_governor_or_cache_still_serves(tmp_path: pathlib.Path) -> None:
    with Stack(tmp_path) as stack:
        worker = stack.start_worker("lonely", backend="sim")
        with WorkerClient(worker.address, deadline_s=120.0) as client:
            client.load_model("d", "decoder", "tiny", 0)
            assert len(client.generate("d", [1, 2, 3], 2).tokens) == 2, "no tokens without a governor"
            assert not client.stats().governor_connected, "claims a governor it was never given"
        assert stack.stop() == {"lonely": 0}, "the lone worker did not stop cleanly"
