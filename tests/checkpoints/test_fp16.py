"""`weight_format: fp16` (issue 15): checkpoints served unquantized, checked against transformers.

The `<name>-fp16.npz` goldens were made by `scripts/make_checkpoint_goldens.py --fp16-peer` from
the committed checkpoints: the peer ran in fp32 on the weights the fp16 load serves (linears and
tables rounded to fp16). Our f32 reference on the loaded fp16 weights must match the peer to 1e-4;
the sim executor (every linear on the BLAS with x rounded to fp16, the fp16 KV cache) must match
our reference with the same rounding to 1e-4, the peer within fp16 tolerance, and give the peer's
greedy tokens over 16 steps."""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from gpu_worker.checkpoints import Checkpoint, CheckpointError
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models.decoder import DecoderModel
from gpu_worker.models.encoder import EncoderModel
from gpu_worker.models.weights import weight_names, weight_sizes
from services.common.errors import InvalidArgument
from tests.checkpoints.test_goldens import FP16_ATOL
from tests.checkpoints.test_loader import _rewrite

GOLDEN = pathlib.Path(__file__).parent / "golden"
DECODERS = ["llama-llama3-sharded", "llama-tied", "qwen2-tied", "qwen2-untied"]


def _golden(name: str):
    return np.load(GOLDEN / f"{name}-fp16.npz")


def test_int4_stays_the_default_weight_format():
    with Checkpoint.open(GOLDEN / "llama-tied", 256) as ckpt:
        assert ckpt.cfg.weight_format == "int4"
        assert "layers.0.wq.q" in dict(ckpt.weights())


def test_fp16_linears_are_the_stored_values_under_h_keys_in_graph_order():
    """bf16 -> fp16 is exact in fp16's normal range: each `.h` equals the stored tensor."""
    from gpu_worker.checkpoints.shards import ShardSet
    with Checkpoint.open(GOLDEN / "qwen2-untied", 256, "fp16") as ckpt:
        pairs = list(ckpt.weights())
        cfg = ckpt.cfg
    assert cfg.weight_format == "fp16"
    assert [k for k, _ in pairs] == weight_names(cfg)
    assert [a.nbytes for _, a in pairs] == weight_sizes(cfg) and sum(weight_sizes(cfg)) == cfg.weight_bytes()
    w = dict(pairs)
    assert not any(k.endswith((".q", ".s")) for k in w)
    shards = ShardSet(GOLDEN / "qwen2-untied")
    try:
        for ours, theirs in (("layers.1.w_down.h", "model.layers.1.mlp.down_proj.weight"),
                             ("lm_head.h", "lm_head.weight")):
            assert w[ours].dtype == np.float16
            np.testing.assert_array_equal(w[ours].astype(np.float32), shards.float32(theirs), err_msg=ours)
    finally:
        shards.close()


def test_a_tied_head_is_served_as_the_fp16_embedding():
    with Checkpoint.open(GOLDEN / "llama-tied", 256, "fp16") as ckpt:
        w = ckpt.host_weights()
    np.testing.assert_array_equal(w["lm_head.h"], w["embed"])


def test_fp16_cast_streams_in_row_chunks_with_the_same_result(monkeypatch):
    import gpu_worker.checkpoints.loader as L
    with Checkpoint.open(GOLDEN / "llama-tied", 256, "fp16") as c:
        whole = c.host_weights()
    monkeypatch.setattr(L, "CHUNK_ROWS", 5)   # several chunks, the last one partial
    with Checkpoint.open(GOLDEN / "llama-tied", 256, "fp16") as c:
        chunked = c.host_weights()
    for k in whole:
        np.testing.assert_array_equal(whole[k], chunked[k], err_msg=k)


def test_a_weight_beyond_fp16_range_is_refused_by_name(tmp_path):
    ckpt = pathlib.Path(shutil.copytree(GOLDEN / "llama-tied", tmp_path / "llama"))

    def big(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 5] = 1e5   # over 65504; its int4 scale (1e5 / 7) fits fp16
    _rewrite(ckpt, big)
    with Checkpoint.open(ckpt, 256, "fp16") as c, \
            pytest.raises(CheckpointError, match=r"model.safetensors, tensor "
                                                 r"'model.layers.1.mlp.up_proj.weight'.*fp16's range"):
        c.host_weights()
    with Checkpoint.open(ckpt, 256) as c:   # int4 scales it: nothing to refuse there
        c.host_weights()


@pytest.mark.parametrize("name, fmt, says", [
    ("llama-gptq", "fp16", "already 4-bit"),
    ("llama-tied", "int8", "use 'int4'"),
])
def test_fp16_refuses_gptq_and_unknown_formats_saying_what_works(name, fmt, says):
    with pytest.raises(InvalidArgument, match=says):
        Checkpoint.open(GOLDEN / name, 256, fmt)


@pytest.mark.parametrize("name", DECODERS + ["bert-st"])
def test_every_float_golden_loads_as_fp16(name):
    with Checkpoint.open(GOLDEN / name, 256, "fp16") as ckpt:
        assert sorted(ckpt.host_weights()) == sorted(weight_names(ckpt.cfg))


@pytest.mark.parametrize("name", DECODERS)
def test_f32_reference_on_the_fp16_weights_matches_transformers(name):
    g = _golden(name)
    with Checkpoint.open(GOLDEN / name, 256, "fp16") as ckpt:
        cfg, w = ckpt.cfg, ckpt.host_weights()
    for prompt, want_logits, want_tokens in zip(g["prompts"], g["logits"], g["greedy"]):
        logits = R.DecoderReference(cfg, w, fp16=False).forward(list(prompt), 0)[-1]
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4,
                                   err_msg=f"{name}: f32 reference differs from transformers")
        got = R.DecoderReference(cfg, w, fp16=False).generate(list(prompt), len(want_tokens))
        assert got == list(want_tokens), f"{name}: greedy {got} != transformers {list(want_tokens)}"


@pytest.mark.parametrize("name", DECODERS)
def test_fp16_decoder_on_the_sim_backend_matches_transformers(name, device, compiler):
    g = _golden(name)
    with Checkpoint.open(GOLDEN / name, 256, "fp16") as ckpt:
        model = DecoderModel(ModelExecutor(device, compiler), ckpt.cfg, 0, weights=ckpt.weights)
        model.load()
        ours = ckpt.host_weights()
    assert model.executor.tile is None, "fp16 linears need no dequantization tile"
    for prompt, want_logits, want_tokens in zip(g["prompts"], g["logits"], g["greedy"]):
        logits = model.logits(list(prompt))
        same_rounding = R.DecoderReference(model.cfg, ours).forward(list(prompt), 0)[-1]
        np.testing.assert_allclose(logits, same_rounding, rtol=1e-4, atol=1e-4,
                                   err_msg=f"{name}: executor logits differ from our reference")
        np.testing.assert_allclose(logits, want_logits, rtol=0, atol=FP16_ATOL,
                                   err_msg=f"{name}: executor logits differ from transformers")
        got = list(model.generate(list(prompt), len(want_tokens)))
        assert got == list(want_tokens), f"{name}: executor tokens {got} != transformers {list(want_tokens)}"


@pytest.mark.parametrize("name", DECODERS)
def test_negative_control_the_fp16_goldens_tell_fp16_from_int4_weights(name):
    """The int4 load's logits leave the fp16 goldens' tolerance: the comparisons above prove that
    the fp16 weights were served, not the int4 ones."""
    g = _golden(name)
    with Checkpoint.open(GOLDEN / name, 256) as ckpt:
        cfg, w = ckpt.cfg, ckpt.host_weights()
    logits = R.DecoderReference(cfg, w).forward(list(g["prompts"][0]), 0)[-1]
    assert np.abs(logits - g["logits"][0]).max() > 10 * FP16_ATOL


def test_fp16_bert_embeddings_match_transformers(device, compiler):
    g = np.load(GOLDEN / "bert-st-fp16.npz")
    with Checkpoint.open(GOLDEN / "bert-st", 256, "fp16") as ckpt:
        host, cfg = ckpt.host_weights(), ckpt.cfg
        model = EncoderModel(ModelExecutor(device, compiler), cfg, 0, weights=ckpt.weights,
                             normalize=True)
        model.load()

    def unit(v: np.ndarray) -> np.ndarray:
        return v / np.linalg.norm(v, axis=1, keepdims=True)
    ref = unit(R.EncoderReference(cfg, host, fp16=False).embed(g["sequences"]))
    np.testing.assert_allclose(ref, g["embeddings"], atol=1e-5, err_msg="f32 reference != transformers")
    rounded = unit(R.EncoderReference(cfg, host).embed(g["sequences"]))
    got = model.embed([list(s) for s in g["sequences"]])
    np.testing.assert_allclose(got, rounded, atol=1e-5, err_msg="sim encoder != our reference")
    np.testing.assert_allclose(got, g["embeddings"], atol=FP16_ATOL, err_msg="sim encoder != transformers")
    int4 = np.load(GOLDEN / "bert-st.npz")["embeddings"]   # negative control: the int4 peer
    assert np.abs(int4 - g["embeddings"]).max() > 10 * np.abs(got - g["embeddings"]).max()
