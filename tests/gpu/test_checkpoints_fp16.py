"""`weight_format: fp16` on the real device: golden checkpoints loaded unquantized, every linear on
cuBLAS GemmEx (1 row included, under CUDA-graph capture), checked against transformers' greedy
tokens and logits (the `<name>-fp16.npz` goldens) and against our NumPy reference with the same rounding.

NOT YET RUN on the H200: written in a session without GPU time (2026-11-30). The path uses only
kernels and library calls already verified there (to_f16, cublasGemmEx under capture), but the
next session with a GPU must run this file first:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_checkpoints_fp16.py
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from gpu_worker.checkpoints import Checkpoint
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models.decoder import DecoderModel
from gpu_worker.models.encoder import EncoderModel

GOLDEN = pathlib.Path(__file__).parents[1] / "checkpoints" / "golden"
FP16_ATOL = 2e-2   # as tests/checkpoints/test_goldens.py: fp16 operands and KV vs an fp32 peer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["llama-llama3-sharded", "llama-tied", "qwen2-tied", "qwen2-untied"])
@pytest.mark.parametrize("capture", [False, True])
def test_an_fp16_golden_on_cuda_gives_transformers_greedy_tokens(name, capture, device, compiler):
    g = np.load(GOLDEN / f"{name}-fp16.npz")
    ex = ModelExecutor(device, compiler)
    with Checkpoint.open(GOLDEN / name, 256, "fp16") as ckpt:
        model = DecoderModel(ex, ckpt.cfg, 0, capture=capture, weights=ckpt.weights)
        model.load()
        host = ckpt.host_weights()
    assert ex.tile is None, "fp16 linears take no dequantization tile"
    try:
        for prompt, want_logits, want_tokens in zip(g["prompts"], g["logits"], g["greedy"]):
            logits = model.logits(list(prompt))
            ref = R.DecoderReference(model.cfg, host).forward(list(prompt), 0)[-1]
            np.testing.assert_allclose(logits, ref, rtol=0, atol=2e-3,
                                       err_msg=f"{name}: cuda logits differ from our reference")
            np.testing.assert_allclose(logits, want_logits, rtol=0, atol=FP16_ATOL,
                                       err_msg=f"{name}: cuda logits differ from transformers")
            got = list(model.generate(list(prompt), len(want_tokens)))
            assert got == list(want_tokens), f"{name}: cuda tokens {got} != transformers {list(want_tokens)}"
        assert device.blas.calls > 0, "the fp16 linears ran on cuBLAS"
    finally:
        ex.close()


def test_the_fp16_bert_golden_on_cuda_matches_transformers(device, compiler):
    g = np.load(GOLDEN / "bert-st-fp16.npz")
    ex = ModelExecutor(device, compiler)
    with Checkpoint.open(GOLDEN / "bert-st", 256, "fp16") as ckpt:
        model = EncoderModel(ex, ckpt.cfg, 0, weights=ckpt.weights, normalize=True)
        model.load()
    try:
        got = model.embed([list(s) for s in g["sequences"]])
        np.testing.assert_allclose(got, g["embeddings"], atol=FP16_ATOL,
                                   err_msg="cuda fp16 encoder != transformers")
    finally:
        ex.close()
