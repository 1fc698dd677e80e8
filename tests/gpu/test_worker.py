"""The whole stack on the GPU: three service processes, the worker on the `cuda` backend."""
from __future__ import annotations

import pathlib

import grpc
import numpy as np
import pytest
from gpuplane.worker.v1 import worker_pb2, worker_pb2_grpc

from gpu_worker.edge.client import WorkerClient
from gpu_worker.models.configs import get_config
from gpu_worker.models.reference import DecoderReference, EncoderReference
from gpu_worker.models.weights import load_host
from gpu_worker.stack.processes import Stack

pytestmark = pytest.mark.gpu
TOKEN = "gpu-stack-token"


@pytest.fixture(scope="module")
def cuda_stack(tmp_path_factory: pytest.TempPathFactory):
    root: pathlib.Path = tmp_path_factory.mktemp("gpu-stack")
    with Stack(root) as stack:
        governor = stack.start_governor()
        cache = stack.start_cache(write_token=TOKEN)
        worker = stack.start_worker("gpu-worker", backend="cuda", governor=governor.address,
                                    cache=cache.address, cache_write_token=TOKEN)
        with WorkerClient(worker.address, deadline_s=300.0) as client:
            client.load_model("dec", "decoder", "tiny", 3)
            client.load_model("enc", "encoder", "tiny", 3)
            yield stack, client


def test_the_cuda_worker_serves_the_decoder_like_the_reference(cuda_stack) -> None:
    _, client = cuda_stack
    cfg = get_config("tiny", "decoder")
    prompt = [11, 200, 3, 999, 42, 7, 512]
    got = client.generate("dec", prompt, 8).tokens
    want = DecoderReference(cfg, load_host(cfg, 3)).generate(prompt, 8)
    assert client.stats().backend == "cuda", "the worker is not on the cuda backend"
    assert got[0] == want[0], f"the first greedy token differs from the reference: {got} vs {want}"
    agree = sum(a == b for a, b in zip(got, want))
    assert agree >= 6, f"the cuda decoder drifted from the reference: {got} vs {want}"


def test_the_cuda_worker_serves_the_encoder_like_the_reference(cuda_stack) -> None:
    _, client = cuda_stack
    cfg = get_config("tiny", "encoder")
    sequences = [[1, 2, 3, 4, 5, 6, 7, 8], [900, 5, 600, 5, 300, 5, 100, 5]]
    got = client.embed("enc", sequences)
    want = EncoderReference(cfg, load_host(cfg, 3)).embed(np.array(sequences))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3,
                               err_msg="cuda embeddings differ from the NumPy reference")


def test_the_cuda_worker_books_the_device_with_the_governor_and_accounts_for_it(cuda_stack) -> None:
    _, client = cuda_stack
    client.generate("dec", list(range(1, 300)), 4)
    s = client.stats()
    assert s.governor_connected, "the cuda worker is not connected to the governor"
    # unaccounted = device use - other processes (NVML) - this worker's ledger: every byte the
    # worker holds is booked, within 1 % of device use or one 2 MiB granule.
    tolerance = max(2 << 20, s.device_used_bytes // 100)
    assert s.ledger_bytes > 0 and abs(s.unaccounted_bytes) <= tolerance, \
        f"unaccounted {s.unaccounted_bytes} bytes (ledger {s.ledger_bytes}, device used " \
        f"{s.device_used_bytes}): the ledger misses memory"
    assert s.arena.faults == 0, "the arena recorded bookkeeping faults"
    assert s.kernel_cache.max_variants_per_node <= s.kernel_cache.variant_bound, "variant bound broken"


def test_a_disconnect_on_cuda_stops_the_request_and_the_model_serves_on(cuda_stack) -> None:
    _, client = cuda_stack
    with grpc.insecure_channel(client.target) as channel:
        stream = worker_pb2_grpc.WorkerServiceStub(channel).Generate(
            worker_pb2.GenerateRequest(model_id="dec", prompt_tokens=[1, 2, 3], max_new_tokens=1000),
            timeout=300)
        assert next(stream).tokens, "no token before the disconnect"
        stream.cancel()
    assert len(client.generate("dec", [1, 2, 3], 3).tokens) == 3, "the model is stuck after a disconnect"


def test_the_cuda_stack_stops_cleanly(cuda_stack) -> None:
    stack, _ = cuda_stack
    codes = stack.stop()
    assert set(codes.values()) == {0}, f"a service did not stop cleanly on SIGTERM: {codes}"
