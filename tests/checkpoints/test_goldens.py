"""Our loader + decoder against transformers: goldens made by scripts/make_checkpoint_goldens.py
(tiny random Llama with llama3 rope scaling and a sharded index, Llama tied, Qwen2 tied and untied,
bf16 safetensors). The peer ran in fp32 on the weights we serve (int4-dequantized linears, fp16
embedding), so a mismatch is a mapping or graph error, not quantization noise.

Our reference in f32 (`fp16=False`) must match the peer to 1e-4. The executor rounds what the
hardware path rounds (fp16 operands of every int4 linear, the fp16 KV cache): it must match our
reference with the same rounding to SAME_ROUNDING_ATOL, the peer within fp16 tolerance, and give
the peer's greedy tokens."""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from gpu_worker.checkpoints import Checkpoint
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models.decoder import DecoderModel

GOLDEN = pathlib.Path(__file__).parent / "golden"
FP16_ATOL = 2e-2   # fp16 operands and KV against an fp32 peer, logits of magnitude ~1
# Executor against our reference with the same rounding: both round every linear's x to fp16, so
# an f32 ulp of difference upstream (attention's summation order) that straddles an fp16
# rounding boundary moves that element by 2^-11 relative, and the logits by a few 1e-4.
SAME_ROUNDING_ATOL = 2e-3
MODELS = ["llama-llama3-sharded", "llama-tied", "qwen2-tied", "qwen2-untied", "llama-gptq"]


def _golden(name: str):
    return np.load(GOLDEN / f"{name}.npz")


@pytest.mark.parametrize("name", MODELS)
def test_numpy_reference_on_the_loaded_checkpoint_matches_transformers(name):
    g = _golden(name)
    with Checkpoint.open(GOLDEN / name, max_context=256) as ckpt:
        ref = R.DecoderReference(ckpt.cfg, ckpt.host_weights(), fp16=False)
        for prompt, want_logits, want_tokens in zip(g["prompts"], g["logits"], g["greedy"]):
            logits = R.DecoderReference(ckpt.cfg, ref.w, fp16=False).forward(list(prompt), 0)[-1]
            np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name}: last-position logits differ from transformers")
            got = ref.generate(list(prompt), len(want_tokens))
            assert got == list(want_tokens), f"{name}: greedy tokens {got} != transformers {list(want_tokens)}"


@pytest.mark.parametrize("name", MODELS)
def test_decoder_on_the_sim_backend_matches_transformers(name, device, compiler):
    g = _golden(name)
    with Checkpoint.open(GOLDEN / name, max_context=256) as ckpt:
        model = DecoderModel(ModelExecutor(device, compiler), ckpt.cfg, 0, weights=ckpt.weights)
        model.load()
        ours = ckpt.host_weights()
    for prompt, want_logits, want_tokens in zip(g["prompts"], g["logits"], g["greedy"]):
        logits = model.logits(list(prompt))
        same_rounding = R.DecoderReference(model.cfg, ours).forward(list(prompt), 0)[-1]
        np.testing.assert_allclose(logits, same_rounding, rtol=0, atol=SAME_ROUNDING_ATOL,
                                   err_msg=f"{name}: executor logits differ from our reference")
        np.testing.assert_allclose(logits, want_logits, rtol=0, atol=FP16_ATOL,
                                   err_msg=f"{name}: executor logits differ from transformers")
        got = list(model.generate(list(prompt), len(want_tokens)))
        assert got == list(want_tokens), f"{name}: executor tokens {got} != transformers {list(want_tokens)}"


def test_the_goldens_cover_the_structure_flags():
    specs = {n: Checkpoint.open(GOLDEN / n, 256) for n in MODELS}
    assert specs["llama-gptq"].spec.gptq_group == 128
    try:
        assert specs["llama-llama3-sharded"].cfg.rope_scaling is not None
        assert specs["llama-tied"].spec.tied_embeddings and specs["qwen2-tied"].spec.tied_embeddings
        assert not specs["qwen2-untied"].spec.tied_embeddings
        assert specs["qwen2-tied"].cfg.qkv_bias and not specs["llama-tied"].cfg.qkv_bias
        assert specs["llama-tied"].cfg.kv_heads < specs["llama-tied"].cfg.heads, "GQA"
    finally:
        for c in specs.values():
            c.close()


@pytest.mark.parametrize("name, drop", [("llama-llama3-sharded", "rope.inv_freq"),
                                        ("qwen2-tied", "layers.0.wk.b")])
def test_negative_control_the_goldens_see_rope_scaling_and_biases(name, drop):
    """Without the llama3 table (or one Qwen2 bias) the logits leave the goldens' tolerance: the
    comparisons above would catch a loader that skipped either."""
    g = _golden(name)
    with Checkpoint.open(GOLDEN / name, max_context=256) as ckpt:
        w = ckpt.host_weights()
        cfg = ckpt.cfg
    if drop == "rope.inv_freq":
        del w[drop]
    else:
        w[drop] = np.zeros_like(w[drop])
    logits = R.DecoderReference(cfg, w).forward(list(g["prompts"][0]), 0)[-1]
    assert np.abs(logits - g["logits"][0]).max() > 1e-2, f"dropping {drop} went unnoticed"


def test_bert_sentence_transformers_embeddings_match_transformers(device, compiler):
    """BertModel in the sentence-transformers layout (no `bert.` prefix, exact GELU, mean pooling,
    Normalize): reference and sim encoder against transformers' pooled, normalized output."""
    from gpu_worker.models.encoder import EncoderModel
    g = np.load(GOLDEN / "bert-st.npz")
    with Checkpoint.open(GOLDEN / "bert-st", max_context=256) as ckpt:
        assert ckpt.cfg.family == "encoder" and ckpt.spec.normalize and ckpt.cfg.gelu_exact
        assert ckpt.cfg.max_context == 64, "the position table bounds the served context"
        host = ckpt.host_weights()
        model = EncoderModel(ModelExecutor(device, compiler), ckpt.cfg, 0, weights=ckpt.weights,
                             normalize=True)
        model.load()
        cfg = ckpt.cfg
    def normalized(reference) -> np.ndarray:
        pooled = reference.embed(g["sequences"])
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    # the mapping: our f32 reference against the f32 peer, tight
    f32 = normalized(R.EncoderReference(cfg, host, fp16=False))
    np.testing.assert_allclose(f32, g["embeddings"], atol=1e-6, err_msg="reference != transformers")
    # negative control: the tanh GELU (what a loader ignoring hidden_act would run) misses by far more
    tanh = normalized(R.EncoderReference(dataclasses.replace(cfg, gelu_exact=False), host, fp16=False))
    assert np.abs(tanh - g["embeddings"]).max() > 2e-5, "the goldens cannot tell erf from tanh GELU"
    # the executor: our reference with its rounding (fp16 x and weights in every int4 linear)
    got = model.embed([list(s) for s in g["sequences"]])
    same = normalized(R.EncoderReference(cfg, host))
    np.testing.assert_allclose(got, same, atol=2e-5, err_msg="sim encoder != our reference")
    np.testing.assert_allclose(got, g["embeddings"], atol=2e-3, err_msg="sim encoder != transformers")


def test_gptq_weights_are_taken_over_bit_for_bit_not_requantized():
    """The GPTQ goldens' q_proj, dequantized by the format's own formula, equals what we serve:
    requantizing into blocks of 32 would have moved it."""
    from gpu_worker.models.weights import dequantize
    g = _golden("llama-gptq")
    with Checkpoint.open(GOLDEN / "llama-gptq", 256) as ckpt:
        w = ckpt.host_weights()
    np.testing.assert_array_equal(dequantize(w["layers.0.wq.q"], w["layers.0.wq.s"]), g["wq0"])
