"""The loader's device quantizer on the real device: the host's bytes, at the loader's shapes and
through a whole checkpoint load (the runtime's default path), its lanes gone after.

    python3 -m pytest -m gpu tests/gpu/test_device_quantizer.py
"""
from __future__ import annotations

import pathlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gpu_worker.checkpoints.loader as L
from gpu_worker.checkpoints import Checkpoint
from gpu_worker.checkpoints.device_quantizer import ZONE, DeviceQuantizer
from gpu_worker.checkpoints.quantize import quantize_rows
from gpu_worker.kernels.selfcheck import stored_rows

GOLDEN = pathlib.Path(__file__).parents[1] / "checkpoints" / "golden"

pytestmark = pytest.mark.gpu


def _quantized(quantize, raw: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = raw.shape
    packed = np.full((rows, cols // 2), 0xAB, np.uint8)
    scales = np.full((rows, cols // 32), np.nan, np.float16)
    quantize(raw, dtype, packed, scales)
    return packed, scales


def _assert_same(got, want) -> None:
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])   # NaN == NaN, whatever the payload
    finite = ~np.isnan(want[1])
    assert (got[1].view(np.uint16)[finite] == want[1].view(np.uint16)[finite]).all()


@pytest.mark.parametrize("dtype,rows,cols", [("BF16", 146, 14336), ("BF16", 512, 4096),
                                             ("F16", 75, 4096), ("F32", 33, 1024)])
def test_the_loaders_chunks_quantize_to_the_host_quantizers_bytes(device, compiler, dtype, rows,
                                                                   cols):
    rng = np.random.default_rng(rows)
    chunks = [stored_rows(rng, rows, cols, dtype, hard=i % 2 == 1) for i in range(6)]
    with DeviceQuantizer(device, compiler) as q:
        with ThreadPoolExecutor(3) as pool:   # lanes on three threads at once
            got = list(pool.map(lambda raw: _quantized(q, raw, dtype), chunks))
        assert q.chunks == len(chunks)
    for raw, g in zip(chunks, got):
        _assert_same(g, _quantized(quantize_rows, raw, dtype))


@pytest.mark.parametrize("golden", ["llama-llama3-sharded", "qwen2-untied", "bert-st"])
def test_a_checkpoint_loads_to_the_same_weights_on_the_device_quantizer(device, compiler,
                                                                        monkeypatch, golden):
    monkeypatch.setattr(L, "CHUNK_ROWS", 7)
    with Checkpoint.open(GOLDEN / golden, 256) as c:
        want = c.host_weights()
    before = device.ledger.snapshot()[ZONE][0]
    with DeviceQuantizer(device, compiler) as q, \
            Checkpoint.open(GOLDEN / golden, 256, quantizer=q) as c:
        got = c.host_weights()
        assert q.chunks > 0
    assert device.ledger.snapshot()[ZONE][0] == before, "the lanes' buffers outlived the load"
    assert list(got) == list(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_the_worker_loads_a_checkpoint_through_the_device_quantizer(tmp_path):
    import shutil

    from gpu_worker import WorkerConfig, WorkerRuntime
    root = tmp_path / "models"
    shutil.copytree(GOLDEN / "llama-tied", root / "llama-tied")
    results = {}
    for kind in ("device", "host"):
        rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=tmp_path / "nvrtc",
                                        model_root=root, checkpoint_quantizer=kind)).start()
        try:
            before = rt.device.ledger.snapshot()[ZONE][0]
            rt.load_checkpoint("m", "llama-tied")
            assert rt.device.ledger.snapshot()[ZONE][0] == before
            results[kind] = [c[0] for c in rt.generate("m", [1, 2, 3, 4], 8)]
        finally:
            rt.close()
    assert len(results["device"]) == 8 and results["device"] == results["host"]
