"""The worker's LoadModel (over gRPC, its stable contract) sandboxes a checkpoint's files by its --model-root, not by the
checkpoint directory: links that stay inside the root load, links out of it are refused, and a
refused load leaves nothing listed."""
from __future__ import annotations

import os
import pathlib
import shutil

import grpc
import pytest
from gpuplane.worker.v1 import worker_pb2
from opentelemetry.sdk.trace import TracerProvider

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def worker(tmp_path_factory, kernel_cache_dir):
    from gpu_worker.core.runtime import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.client import WorkerClient
    from gpu_worker.edge.servicer import serve_worker
    base = tmp_path_factory.mktemp("sandbox")
    root = base / "models"
    snapshot = pathlib.Path(shutil.copytree(GOLDEN / "llama-tied", root / "cache" / "snapshots" / "abc"))
    (root / "cache" / "blobs").mkdir()
    for name in ("model.safetensors", "tokenizer.json"):   # a Hugging Face cache's layout
        (snapshot / name).rename(root / "cache" / "blobs" / name)
        os.symlink(f"../../blobs/{name}", snapshot / name)
    escape = pathlib.Path(shutil.copytree(GOLDEN / "llama-tied", root / "escape"))
    shutil.copytree(GOLDEN / "llama-tied", base / "outside")
    (escape / "model.safetensors").unlink()
    os.symlink(base / "outside" / "model.safetensors", escape / "model.safetensors")
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    worker_id="sandbox-worker", model_root=root))
    rt.start()
    server = serve_worker(rt, "127.0.0.1:0", TracerProvider())
    client = WorkerClient(server.address, deadline_s=120.0)
    try:
        yield client
    finally:
        client.close()
        server.stop(grace=5.0)


def _load(worker, model_id: str, checkpoint: str):
    return worker.stub.LoadModel(worker_pb2.LoadModelRequest(model_id=model_id,
                                                             checkpoint=checkpoint))


def test_a_checkpoint_linking_into_a_shared_directory_of_the_root_loads(worker):
    """Needs the worker to pass its model root: the checkpoint directory alone would refuse."""
    reply = _load(worker, "cached", "cache/snapshots/abc")
    try:
        assert reply.model.has_tokenizer, "the tokenizer linked into blobs/ was read"
    finally:
        worker.unload_model("cached")


def test_a_symlinked_weight_file_leading_outside_the_root_is_refused_by_the_worker(worker):
    with pytest.raises(grpc.RpcError) as err:
        _load(worker, "escape", "escape")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    assert err.value.details().startswith("escape/model.safetensors resolves outside the model root")
    assert "outside/" not in err.value.details(), "the link's target must not be echoed"
    assert "escape" not in {m.model_id for m in worker.list_models()}


def test_a_checkpoint_load_past_its_deadline_unwinds_with_nothing_booked(tmp_path, kernel_cache_dir):
    """The whole load has a deadline: storage that stalls (slow NFS, a throttled disk) ends it with
    DEADLINE_EXCEEDED naming the flag, and the ledger is as before."""
    from gpu_worker import WorkerConfig, WorkerRuntime
    from services.common.errors import DeadlineExceeded
    root = tmp_path / "models"
    shutil.copytree(GOLDEN / "llama-tied", root / "llama-tied")
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir, model_root=root,
                                    load_timeout_s=1e-6)).start()
    try:
        before = rt.device.ledger.total_committed()
        with pytest.raises(DeadlineExceeded, match="--load-timeout-seconds"):
            rt.load_checkpoint("late", "llama-tied")
        assert rt.list_models() == [] and rt.device.ledger.total_committed() == before, \
            "a load past its deadline left something listed or booked"
    finally:
        rt.close()
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir, model_root=root)).start()
    try:                                 # control: the same checkpoint loads under the default
        assert rt.load_checkpoint("ok", "llama-tied").info.model_id == "ok"
    finally:
        rt.close()
