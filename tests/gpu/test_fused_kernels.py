"""The fused decoder-layer kernels on a real device (issue 24): the shared cases
(gpu_worker.kernels.selfcheck.qkv.QKV_CASES; rmsnorm_f16 / silu_gate_f16 run with
selfcheck.CASES in test_kernels.py) plus production shapes (Llama-3-8B: 32 heads, 8 KV heads,
head_dim 128, qkv rows of 6144, hidden 4096, ffn 14336; decode batches 1..64, prefill chunks of
2048, contexts to 8192; Qwen2-style biases, llama3 frequency tables) and odd sizes; then the
fused decoder graphs, captured and eager, give the NumPy reference's tokens.

Run on the GPU machine:
    python3 -m pytest -m gpu tests/gpu/test_fused_kernels.py -v
    compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/gpu/test_fused_kernels.py -q \
        -k "not tokens"
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.selfcheck import Case, KernelHarness, rmsnorm_f16_case, silu_gate_f16_case
from gpu_worker.kernels.selfcheck.qkv import (
    PAGED,
    QKV_CASES,
    SINGLE,
    qkv_rope_append_case,
    qkv_rope_append_paged_case,
)

pytestmark = pytest.mark.gpu

LLAMA = {"heads": 32, "kv_heads": 8, "head_dim": 128}
_rng = np.random.default_rng(24)
_B64 = [int(x) for x in _rng.integers(0, 1024, 64)]
_B64[7] = _B64[40] = -1
_B8 = [0, 15, 16, 255, 4097, 8191, -1, 1000]
_B20, _B32 = _B64[:20], _B64[32:]   # 2 and 4 heads a thread (qkv.rope_heads on 132 SMs)

MODEL_CASES: list[Case] = [
    Case(PAGED, qkv_rope_append_paged_case, {**LLAMA, "positions": [8191], "layers": 2,
                                             "layer": 1, "block_tokens": 16, "max_blocks": 512}),
    Case(PAGED, qkv_rope_append_paged_case, {**LLAMA, "positions": _B8, "layers": 1, "layer": 0,
                                             "block_tokens": 16, "max_blocks": 512,
                                             "table": True}),
    Case(PAGED, qkv_rope_append_paged_case, {**LLAMA, "positions": _B64, "layers": 1,
                                             "layer": 0, "block_tokens": 16, "max_blocks": 64}),
    Case(PAGED, qkv_rope_append_paged_case, {**LLAMA, "positions": _B20, "layers": 1,
                                             "layer": 0, "block_tokens": 16, "max_blocks": 64}),
    Case(PAGED, qkv_rope_append_paged_case, {**LLAMA, "positions": _B32, "layers": 1,
                                             "layer": 0, "block_tokens": 16, "max_blocks": 64}),
    # a prefill chunk of 2048 rows through a one-row table, Qwen2-7B-like biases (28 heads, 4 KV)
    Case(PAGED, qkv_rope_append_paged_case, {"heads": 28, "kv_heads": 4, "head_dim": 128,
                                             "positions": list(range(100, 2148)), "table_rows": 1,
                                             "layers": 1, "layer": 0, "block_tokens": 64,
                                             "max_blocks": 40, "bias": True}),
    # odd: 33 rows with padding at both ends, head_dim 64, GQA 4
    Case(PAGED, qkv_rope_append_paged_case, {"heads": 16, "kv_heads": 4, "head_dim": 64,
                                             "positions": [-1] + list(range(300, 331)) + [-1],
                                             "block_tokens": 32, "max_blocks": 16}),
    Case(SINGLE, qkv_rope_append_case, {**LLAMA, "tokens": 1, "start": 8191, "max_len": 8192,
                                        "theta": 500000.0}),
    Case(SINGLE, qkv_rope_append_case, {**LLAMA, "tokens": 2048, "start": 2048,
                                        "max_len": 8192, "theta": 500000.0, "table": True}),
    Case(SINGLE, qkv_rope_append_case, {"heads": 28, "kv_heads": 4, "head_dim": 128,
                                        "tokens": 77, "start": 8150, "max_len": 8192,
                                        "bias": True}),     # rows past the cache
    Case(SINGLE, qkv_rope_append_case, {"heads": 4, "kv_heads": 2, "head_dim": 16,
                                        "tokens": 129, "start": 3, "max_len": 1024,
                                        "q_half": False}),
    Case("rmsnorm_f16", rmsnorm_f16_case, {"rows": 1, "hidden": 4096}),
    Case("rmsnorm_f16", rmsnorm_f16_case, {"rows": 2048, "hidden": 4096}),
    Case("rmsnorm_f16", rmsnorm_f16_case, {"rows": 65, "hidden": 4097}),
    Case("silu_gate_f16", silu_gate_f16_case, {"rows": 2048, "cols": 14336}),
    Case("silu_gate_f16", silu_gate_f16_case, {"rows": 1, "cols": 14336}),
    Case("silu_gate_f16", silu_gate_f16_case, {"rows": 33, "cols": 14337}),
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


def _check(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id[:120]}: device result differs from the reference: {failure}"


@pytest.mark.parametrize("case", QKV_CASES, ids=[c.id for c in QKV_CASES])
def test_cuda_qkv_kernel_matches_its_numpy_reference(harness, case) -> None:
    _check(harness, case)


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.id[:100] for c in MODEL_CASES])
def test_cuda_fused_kernel_at_model_shapes_matches_its_numpy_reference(harness, case) -> None:
    _check(harness, case)


@pytest.fixture(scope="module")
def cuda(tmp_path_factory):
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.device import open_device

    device = open_device("cuda")
    yield device, KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("k2"))
    device.close()


@pytest.mark.parametrize("fmt", ["int4", "fp16"])
@pytest.mark.parametrize("capture", [True, False], ids=["graph", "eager"])
def test_fused_decoder_graphs_give_the_reference_tokens(cuda, fmt, capture) -> None:
    """The single-sequence and the paged decoder, q/k/v and gate/up fused, biases and a llama3
    table (every input of the fused qkv kernel), fp16 linears accumulating the residual: the NumPy
    reference's greedy tokens, captured and eager alike."""
    from gpu_worker.engines.scheduler.sampling import GREEDY
    from gpu_worker.engines.scheduler.scheduler import Scheduler
    from gpu_worker.execution.executor import ModelExecutor
    from gpu_worker.models import reference as R
    from gpu_worker.models import weights as W
    from gpu_worker.models.configs import ModelConfig
    from gpu_worker.models.decoder import DecoderModel
    from gpu_worker.models.paged import PagedDecoderModel
    from gpu_worker.models.rope import Llama3Scaling

    device, compiler = cuda
    cfg = ModelConfig("hd128-bias", "decoder", vocab_size=2048, hidden=512, layers=2, heads=4,
                      kv_heads=2, ffn=1024, max_context=1024, qkv_bias=True,
                      rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 256), weight_format=fmt)
    ref = R.DecoderReference(cfg, W.load_host(cfg, 3))
    prompts = [[(i * 7 + k * 13 + 1) % cfg.vocab_size for k in range(n)] for i, n in
               enumerate((1, 100, 300))]
    want = [ref.generate(p, 8) for p in prompts]
    single = DecoderModel(ModelExecutor(device, compiler), cfg, 3, capture=capture,
                          prefill_chunk=128)
    single.load()
    try:
        for p, w in zip(prompts, want, strict=True):
            assert list(single.generate(p, 8)) == w, f"single sequence, {len(p)}-token prompt"
    finally:
        single.executor.close()
    paged = PagedDecoderModel(ModelExecutor(device, compiler), cfg, 3, max_batch_size=8,
                              capture=capture, prefill_chunk=128)
    paged.load()
    sched = Scheduler(paged, paged.pool, thread=False, max_batch_size=8, max_step_tokens=256)
    try:
        seqs = [sched.submit(p, 8, GREEDY) for p in prompts]
        for _ in range(500):
            if not sched.busy():
                break
            sched.step()
    finally:
        sched.close()
        paged.executor.close()
        paged.close()
    for p, s, w in zip(prompts, seqs, want, strict=True):
        assert list(s.generated) == w, f"paged, {len(p)}-token prompt: {s.generated} != {w}"
