"""The fp16 attention kernels on a real device: the shared cases (gpu_worker.kernels.selfcheck.flash)
plus production shapes (32 heads / 8 KV heads / head_dim 128 at 469, 2048 and 5502 tokens, head_dim
64, a chunk against a KV-cache prefix, decode at 8k context), and chunked prefill against a whole one.

Run on the GPU machine:
    python3 -m pytest -m gpu tests/gpu/test_flash_attention.py -v
    compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/gpu/test_flash_attention.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.flash_attention import (
    FLASH_ATTENTION_PREFILL,
    flash_decode_splits,
    launch_flash_attention_prefill,
)
from gpu_worker.kernels.selfcheck import Case, KernelHarness
from gpu_worker.kernels.selfcheck.flash import (
    COMBINE,
    FLASH_CASES,
    PREFILL,
    SPLIT,
    flash_decode_case,
    flash_prefill_case,
)

pytestmark = pytest.mark.gpu

LLAMA = {"heads": 32, "kv_heads": 8, "head_dim": 128}
MODEL_CASES: list[Case] = [
    Case(PREFILL, flash_prefill_case, {"batch": 1, "tokens": 469, **LLAMA, "rows": 64}),
    Case(PREFILL, flash_prefill_case, {"batch": 1, "tokens": 2048, **LLAMA, "rows": 64}),
    Case(PREFILL, flash_prefill_case, {"batch": 1, "tokens": 5502, **LLAMA, "rows": 64}),
    Case(PREFILL, flash_prefill_case, {"batch": 1, "tokens": 2048, "heads": 32, "kv_heads": 8,
                                       "head_dim": 64, "rows": 64}),
    Case(PREFILL, flash_prefill_case, {"batch": 1, "tokens": 512, **LLAMA, "past": 1536,
                                       "past_arg": 2, "rows": 64}),
    Case(PREFILL, flash_prefill_case, {"batch": 2, "tokens": 469, **LLAMA, "causal": False,
                                       "lens": [469, 300], "rows": 64}),
    Case(SPLIT, flash_decode_case, {"batch": 1, **LLAMA, "lengths": [8191], "len_add": 1,
                                    "max_len": 8192, "splits": flash_decode_splits(8192)}, COMBINE),
    Case(SPLIT, flash_decode_case, {"batch": 1, **LLAMA, "lengths": [5502], "len_add": 1,
                                    "max_len": 8192, "splits": flash_decode_splits(8192)}, COMBINE),
    Case(SPLIT, flash_decode_case, {"batch": 4, "heads": 32, "kv_heads": 8, "head_dim": 64,
                                    "lengths": [1, 1000, 4000, 8000], "max_len": 8192,
                                    "splits": flash_decode_splits(8192, batch=4)}, COMBINE),
    Case(SPLIT, flash_decode_case, {"batch": 1, **LLAMA, "lengths": [1024], "len_add": 1,
                                    "max_len": 8192, "splits": flash_decode_splits(8192),
                                    "replay_lengths": [[4096], [8191]]}, COMBINE),
]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.device import open_device

    device = open_device("cuda")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.mark.parametrize("case", FLASH_CASES + MODEL_CASES, ids=[c.id for c in FLASH_CASES + MODEL_CASES])
def test_cuda_flash_kernel_matches_its_numpy_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id}: device result differs from the reference: {failure}"


def test_chunked_prefill_equals_one_whole_prefill(harness) -> None:
    """2048 tokens in four 512-token chunks against the growing cache give the whole prefill's
    output (same fp16 arithmetic per row: each row's keys arrive in the same 64-key tiles)."""
    tokens, chunk, heads, kv_heads, hd = 2048, 512, 32, 8, 128
    rng = np.random.default_rng(12)
    q = rng.standard_normal((tokens, heads * hd), dtype=np.float32).astype(np.float16)
    kv = [rng.standard_normal((tokens, kv_heads * hd), dtype=np.float32).astype(np.float16)
          for _ in "kv"]
    h, fn = harness, harness.function(FLASH_ATTENTION_PREFILL)
    qp, kp, vp = h.put(q), h.put(kv[0]), h.put(kv[1])
    whole, chunked = (h.put(np.zeros((tokens, heads * hd), np.float16)) for _ in "wc")
    row = kv_heads * hd
    launch_flash_attention_prefill(h.device, fn, whole, qp, kp, vp, 0, 0, 1, tokens, heads,
                                   kv_heads, hd, heads * hd, row, tokens * row)
    for c0 in range(0, tokens, chunk):
        launch_flash_attention_prefill(h.device, fn, chunked + 2 * c0 * heads * hd,
                                       qp + 2 * c0 * heads * hd, kp, vp, 0, 0, 1, chunk, heads,
                                       kv_heads, hd, heads * hd, row, tokens * row, past_len=c0)
    a = h.get(whole, (tokens, heads * hd), np.float16)
    b = h.get(chunked, (tokens, heads * hd), np.float16)
    assert np.isfinite(a).all(), "whole prefill produced non-finite values"
    assert np.array_equal(a, b), \
        f"chunked prefill differs from the whole one: max {np.abs(a - b).max()} at {np.argmax(np.abs(a - b))}"
