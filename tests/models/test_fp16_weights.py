"""fp16 weights (`weight_format: fp16`): the graphs, sizes and admission that know the format, and
the sim executor against the NumPy reference on synthetic models (the checkpoints' tests are in
tests/checkpoints/test_fp16.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpu_worker.core.admission import admission_by_zone
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS, ModelConfig
from gpu_worker.models.decoder import DecoderModel, build_decoder_graph
from gpu_worker.models.encoder import EncoderModel, build_encoder_graph
from services.common.errors import InvalidArgument

# head_dim 64: the flash attention's fp16 output feeds wo as it is (no widening for fp16 weights)
HD64 = ModelConfig("tiny-hd64-fp16", "decoder", vocab_size=512, hidden=128, layers=2, heads=2,
                   kv_heads=1, ffn=256, max_context=512, weight_format="fp16")
TINY = dataclasses.replace(CONFIGS["tiny"], weight_format="fp16")
TINY_ENC = dataclasses.replace(CONFIGS["tiny-encoder"], weight_format="fp16")
# Every fp16 linear rounds x to fp16 (the reference does too), so an f32 summation-order
# difference that crosses an fp16 rounding boundary moves a value by 2^-11 relative.
ATOL = 1e-3


def _linears(graph):
    return [n for n in graph.nodes if n.op.startswith("linear")]


@pytest.mark.parametrize("cfg", [TINY, HD64, dataclasses.replace(CONFIGS["8b-int4"], weight_format="fp16")])
@pytest.mark.parametrize("seq, phase", [(1, "decode"), (1, "prefill"), (64, "prefill")])
def test_every_fp16_linear_is_one_gemm_on_fp16_x_at_every_row_count(cfg, seq, phase):
    g = build_decoder_graph(cfg, seq, phase)
    lins = _linears(g)
    assert lins and all(n.op == "linear_f16" for n in lins), {n.op for n in lins}
    assert "lm_head" in {n.name for n in lins}
    for n in lins:
        assert g.tensors[n.inputs[0]].dtype == "f16", n.name
        assert n.weights == (n.name + ".h",) and g.tensors[n.weights[0]].dtype == "f16"
    assert not any(n.op == "from_f16" for n in g.nodes), "fp16 weights never widen x to f32"


def test_every_fp16_encoder_linear_is_linear_f16():
    g = build_encoder_graph(TINY_ENC, 2, 3)
    assert {n.op for n in _linears(g)} == {"linear_f16"}


@pytest.mark.parametrize("cfg", [TINY, HD64, TINY_ENC, CONFIGS["tiny"], CONFIGS["tiny-encoder"]])
def test_weight_sizes_are_what_generation_yields_and_what_the_graph_reads(cfg):
    host = list(W.generate(cfg, 3))
    assert [k for k, _ in host] == W.weight_names(cfg)
    assert [a.nbytes for _, a in host] == W.weight_sizes(cfg)
    assert sum(W.weight_sizes(cfg)) == cfg.weight_bytes()
    g = build_encoder_graph(cfg, 1, 4) if cfg.family == "encoder" else build_decoder_graph(cfg, 4, "prefill")
    read = {w for n in g.nodes for w in n.weights}
    loaded = dict(W.fuse_linears(cfg, host))   # what the model puts on the device
    assert list(loaded) == W.device_weight_names(cfg)
    assert read == set(loaded), "every weight loaded is read, and only those"
    assert sum(a.nbytes for a in loaded.values()) == cfg.weight_bytes(), \
        "fusing the linears concatenates: not a byte more or less"


def test_fp16_linears_take_32_over_9_of_int4_bytes_and_admission_asks_for_them():
    """int4 is 4.5 bits a weight (nibble + one fp16 scale per 32), fp16 is 16: a ratio of 32/9."""
    int4, fp16 = CONFIGS["8b-int4"], dataclasses.replace(CONFIGS["8b-int4"], weight_format="fp16")

    def linear_bytes(cfg):
        return sum(sum(cfg.linear_sizes(o, i)) for o, i in cfg.linear_shapes().values())
    assert linear_bytes(fp16) * 9 == linear_bytes(int4) * 32
    granule = 2 << 20
    a4, a16 = admission_by_zone(int4, granule), admission_by_zone(fp16, granule)
    assert a16["kv"] == a4["kv"]
    assert a16["weights"] >= fp16.weight_bytes() > a4["weights"] >= int4.weight_bytes()
    slack = 256 * len(W.weight_sizes(fp16)) + 2 * granule   # carve alignment + granule rounding
    assert a16["weights"] - fp16.weight_bytes() <= slack
    assert fp16.weight_bytes() > 15e9, "an 8B model in fp16 is ~16 GB"


def test_an_unknown_weight_format_is_refused():
    with pytest.raises(InvalidArgument, match="weight_format 'int8'"):
        dataclasses.replace(CONFIGS["tiny"], weight_format="int8")


@pytest.mark.parametrize("cfg", [TINY, HD64])
def test_fp16_decoder_on_the_sim_backend_matches_the_reference_that_rounds_x(cfg, device, compiler):
    ex = ModelExecutor(device, compiler)
    model = DecoderModel(ex, cfg, 5)
    model.load()
    host = W.load_host(cfg, 5)
    prompt = [3, 17, 250, 9, 1, 77, 12]
    ref = R.DecoderReference(cfg, host)
    np.testing.assert_allclose(model.logits(prompt), ref.forward(prompt, 0)[-1], rtol=0, atol=ATOL)
    assert list(model.generate(prompt, 12)) == R.DecoderReference(cfg, host).generate(prompt, 12)
    assert ex.tile is None and ex.shared_workspace_bytes() == 0, "no dequantization tile for fp16"
    assert device.blas.calls > 0, "the fp16 linears ran on the BLAS"


@pytest.mark.parametrize("capture", [False, True])
def test_a_one_row_fp16_linear_is_the_gemm_of_x_rounded_to_fp16(device, compiler, capture):
    """x = 1 + 2^-12 is 1 in fp16: the one-row linear (decode's) must compute with the rounded x,
    as cuBLAS does, not with the f32 x of the int4 GEMV; the two differ by 64 * 2^-12."""
    from gpu_worker.models.graph import GraphBuilder
    ex = ModelExecutor(device, compiler)
    w = np.random.default_rng(0).uniform(0.5, 1.5, (32, 64)).astype(np.float16)
    ex.add_weight("lin.h", w)
    ex.ensure_resident()
    x = np.full((1, 64), 1 + 2.0**-12, np.float32)

    def build():
        g = GraphBuilder()
        g.tensor("x", (1, 64), "f32", "input")
        g.linear_f16("lin", "x", "y", 1, 32, 64)
        return g.build(outputs=("y",))
    y = ex.run(("one", 1, 1), build, {"x": x}, ("y",), capture=capture)["y"]
    w32 = w.astype(np.float32)
    np.testing.assert_allclose(y, R.f16(x) @ w32.T, rtol=1e-6)
    assert np.abs(y - x @ w32.T).min() > 64 * 2.0**-12 * 0.4, "negative control: f32 x differs"
    ex.close()


def test_fp16_encoder_on_the_sim_backend_matches_the_reference(device, compiler):
    model = EncoderModel(ModelExecutor(device, compiler), TINY_ENC, 2)
    model.load()
    seqs = [[5, 9, 100, 3], [7, 7, 1, 1000]]
    want = R.EncoderReference(TINY_ENC, W.load_host(TINY_ENC, 2)).embed(np.array(seqs))
    np.testing.assert_allclose(model.embed(seqs), want, rtol=0, atol=ATOL)


def test_trimming_an_fp16_model_gives_the_blas_back(device, compiler):
    ex = ModelExecutor(device, compiler)
    model = DecoderModel(ex, TINY, 5)
    model.load()
    model.logits([1, 2, 3])
    assert device._blas_users == 1
    ex.trim()
    assert device._blas_users == 0
    assert model.logits([1, 2, 3]).shape == (TINY.vocab_size,), "runs again after a trim"
