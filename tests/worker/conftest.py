"""A real worker: WorkerRuntime on the sim backend behind a real gRPC server on loopback port 0."""
from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from gpu_worker.edge.client import WorkerClient

DECODER = "tiny-dec"
ENCODER = "tiny-enc"
SEED = 7


@pytest.fixture(scope="session")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One NVRTC disk cache for every worker these tests start (NVRTC is real; the cache only
    saves each module compiling the same kernel sources again)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def worker(kernels: pathlib.Path) -> Iterator[WorkerClient]:
    """A sim worker with the tiny decoder and encoder loaded; shared by a module's tests."""
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker

    cache_dir = kernels
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=cache_dir, worker_id="test-worker"))
    runtime.start()
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider())
    client = WorkerClient(server.address, deadline_s=120.0)
    client.load_model(DECODER, "decoder", "tiny", SEED)
    client.load_model(ENCODER, "encoder", "tiny", SEED)
    try:
        yield client
    finally:
        client.close()
        server.stop(grace=5.0)
