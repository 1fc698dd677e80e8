"""The loader's quantizer on the device (checkpoints/device_quantizer.py), here on the sim device:
the same bytes as the host's, a lane per loader thread, booked while it lives and gone after.
The CUDA kernel's own bits are tests/gpu/test_kernels.py's int4_quantize cases."""
from __future__ import annotations

import pathlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gpu_worker.checkpoints.loader as L
from gpu_worker.checkpoints import Checkpoint
from gpu_worker.checkpoints.device_quantizer import ZONE, DeviceQuantizer
from gpu_worker.checkpoints.quantize import HostQuantizer, quantize_rows
from gpu_worker.kernels.selfcheck import stored_rows

GOLDEN = pathlib.Path(__file__).parent / "golden"


def _quantized(quantize, raw: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = raw.shape
    packed = np.full((rows, cols // 2), 0xAB, np.uint8)    # garbage: every byte must be written
    scales = np.full((rows, cols // 32), np.nan, np.float16)
    quantize(raw, dtype, packed, scales)
    return packed, scales


def _assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    np.testing.assert_array_equal(got[0], want[0])
    # NaN scales compare equal whatever their payload (assert_array_equal's NaN rule)
    np.testing.assert_array_equal(got[1], want[1])
    assert (got[1].view(np.uint16) == want[1].view(np.uint16))[~np.isnan(want[1])].all()


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_device_quantizer_writes_what_the_host_quantizer_writes(device, compiler, dtype):
    raw = stored_rows(np.random.default_rng(3), 40, 256, dtype, hard=True)
    with DeviceQuantizer(device, compiler) as q:
        got = _quantized(q, raw, dtype)
        assert q.chunks == 1 and q.stored_bytes == raw.nbytes   # it ran on the device
    _assert_same(got, _quantized(quantize_rows, raw, dtype))


def test_a_chunk_staged_in_its_lane_goes_up_without_another_copy(device, compiler):
    raw = stored_rows(np.random.default_rng(4), 8, 128, "BF16")
    with DeviceQuantizer(device, compiler) as q:
        staged = q.staging(raw.nbytes)[:raw.nbytes].view(np.uint16).reshape(raw.shape)
        staged[...] = raw
        got = _quantized(q, staged, "BF16")
        assert q.staging(1).ctypes.data == staged.ctypes.data   # one buffer a thread, reused
        assert q.chunks == 1
    _assert_same(got, _quantized(quantize_rows, raw, "BF16"))


def test_threads_share_at_most_device_sets_buffer_sets_and_close_frees_every_one(device,
                                                                                 compiler):
    rng = np.random.default_rng(5)
    chunks = [stored_rows(rng, 16, 96 * (1 + i % 3), "BF16") for i in range(24)]
    before = device.ledger.snapshot()[ZONE][0]
    q = DeviceQuantizer(device, compiler, device_sets=2)
    with ThreadPoolExecutor(5) as pool:
        got = list(pool.map(lambda raw: _quantized(q, raw, "BF16"), chunks))
    assert 1 <= len(q._sets) <= 2 and 1 <= len(q._staging) <= 5   # pinned staging: a thread
    assert q.device_bytes() > 0 and device.ledger.snapshot()[ZONE][0] >= before + q.device_bytes()
    q.close()
    assert device.ledger.snapshot()[ZONE][0] == before and q.device_bytes() == 0
    for raw, g in zip(chunks, got):
        _assert_same(g, _quantized(quantize_rows, raw, "BF16"))
    with pytest.raises(RuntimeError, match="closed"):
        _quantized(q, chunks[0], "BF16")


class _HostRows(HostQuantizer):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __call__(self, raw, dtype, packed, scales) -> None:
        self.rows.append(raw.shape[0])
        super().__call__(raw, dtype, packed, scales)


class _DeviceRows(DeviceQuantizer):
    rows: list[int]

    def __call__(self, raw, dtype, packed, scales) -> None:
        self.rows.append(raw.shape[0])
        super().__call__(raw, dtype, packed, scales)


def test_the_loader_gives_the_device_quantizer_chunks_chunk_scale_times_bigger(device, compiler,
                                                                               monkeypatch):
    monkeypatch.setattr(L, "CHUNK_ROWS", 3)
    host, dev = _HostRows(), _DeviceRows(device, compiler)
    dev.rows = []
    for q in (host, dev):
        with Checkpoint.open(GOLDEN / "qwen2-untied", 256, quantizer=q) as c:
            c.host_weights()
    dev.close()
    assert max(host.rows) == 3 and max(dev.rows) == 3 * DeviceQuantizer.chunk_scale > 3


def test_what_the_kernel_does_not_take_gets_the_host_quantizers_answer(device, compiler):
    with DeviceQuantizer(device, compiler) as q:
        with pytest.raises(ValueError, match="not a multiple of 32"):
            _quantized(q, np.zeros((2, 48), np.uint16), "BF16")
        empty = _quantized(q, np.zeros((0, 64), np.uint16), "BF16")
        assert empty[0].shape == (0, 32) and q.chunks == 0 and q._function is None


@pytest.mark.parametrize("golden", ["llama-llama3-sharded", "qwen2-untied"])
def test_a_checkpoint_loads_to_the_same_weights_on_either_quantizer(device, compiler, monkeypatch,
                                                                    golden):
    monkeypatch.setattr(L, "CHUNK_ROWS", 7)    # many chunks, a tensor's last one short
    with Checkpoint.open(GOLDEN / golden, 256) as c:
        want = c.host_weights()
    with DeviceQuantizer(device, compiler) as q, \
            Checkpoint.open(GOLDEN / golden, 256, quantizer=q) as c:
        got = c.host_weights()
        assert q.chunks > 10
    assert list(got) == list(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_an_fp16_load_stages_in_the_lanes_and_never_loads_the_kernel(device, compiler):
    with Checkpoint.open(GOLDEN / "qwen2-untied", 256, weight_format="fp16") as c:
        want = c.host_weights()
    with DeviceQuantizer(device, compiler) as q, \
            Checkpoint.open(GOLDEN / "qwen2-untied", 256, weight_format="fp16", quantizer=q) as c:
        got = c.host_weights()
        assert q._staging and q._function is None and q.chunks == 0
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_device_without_room_for_a_set_slows_the_load_it_does_not_fail_it(device, compiler,
                                                                           monkeypatch, caplog):
    from services.common.errors import ResourceExhausted

    def full(nbytes, zone, role="default"):
        raise ResourceExhausted(f"zone {zone}: asked {nbytes}, free 0")
    monkeypatch.setattr(device.arena, "alloc", full)
    raw = stored_rows(np.random.default_rng(6), 12, 160, "BF16", hard=True)
    with caplog.at_level("WARNING"), DeviceQuantizer(device, compiler) as q:
        got = _quantized(q, raw, "BF16")
        assert (q.chunks, q.host_chunks) == (0, 1)
    _assert_same(got, _quantized(quantize_rows, raw, "BF16"))
    assert "1 of 1 chunks were quantized on the host" in caplog.text   # the operator is told


def test_a_failing_chunk_gives_its_device_set_back_so_no_other_thread_waits_forever(
        device, compiler, monkeypatch):
    from gpu_worker.device.backend import DeviceError

    def broken(nbytes, zone, role="default"):
        raise DeviceError("cuMemCreate: CUDA_ERROR_UNKNOWN")
    monkeypatch.setattr(device.arena, "alloc", broken)
    chunks = [stored_rows(np.random.default_rng(i), 4, 64, "BF16") for i in range(6)]
    with DeviceQuantizer(device, compiler, device_sets=1) as q, ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_quantized, q, raw, "BF16") for raw in chunks]
        for f in futures:   # each fails on its own; none waits on a set that never came back
            with pytest.raises(DeviceError, match="CUDA_ERROR_UNKNOWN"):
                f.result(timeout=30)
