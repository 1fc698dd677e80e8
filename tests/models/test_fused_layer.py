"""A decoder layer of few nodes (issue 24, DESIGN 6.2): q/k/v and gate/up as one linear each
(concatenated at load), bias + rotary + KV append + the query cast in one kernel, the norm and
SiLU writing the dtype the next linear reads, the residual added in the linear's epilogue where
the linear supports it; tokens identical to the NumPy reference with per-projection weights."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpu_worker.engines.scheduler.kv_pool import KVGeometry
from gpu_worker.engines.scheduler.sampling import GREEDY
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.execution.ops import OPS
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS, ModelConfig
from gpu_worker.models.decoder import DecoderModel, build_decoder_graph
from gpu_worker.models.paged import DECODE_LADDER, PagedDecoderModel, build_paged_graph
from gpu_worker.models.rope import Llama3Scaling

LLAMA8B = CONFIGS["8b-int4"]
FP16_8B = dataclasses.replace(LLAMA8B, weight_format="fp16")
# Qwen2's q/k/v biases and Llama 3.1's rescaled frequencies, at head_dim 16 (the f32-q kernels)
# and 64 (flash): every input the fused qkv kernel takes
SCALING = Llama3Scaling(8.0, 1.0, 4.0, 64)
QWENISH = dataclasses.replace(CONFIGS["tiny"], name="tiny-bias", qkv_bias=True,
                              rope_scaling=SCALING)
QWENISH64 = ModelConfig("hd64-bias", "decoder", vocab_size=512, hidden=128, layers=2, heads=2,
                        kv_heads=1, ffn=256, max_context=512, qkv_bias=True, rope_scaling=SCALING)
REMOVED = {"rotary", "rotary_rows", "kv_append", "kv_append_paged", "to_f16", "bias_add"}


def _layer(graph, layer: int = 0) -> list:
    return [n for n in graph.nodes if n.name.startswith(f"layers.{layer}.")]


def _paged(cfg: ModelConfig, rows: int, phase: str):
    geo = KVGeometry(cfg.layers, cfg.kv_heads, cfg.head_dim, 16, cfg.max_context)
    return build_paged_graph(cfg, geo, 64, rows, phase)


def _per_layer_nodes(fmt: str) -> int:
    """norm, wqkv, qkv_rope, attention, wo, norm, w_gateup, silu_mul, w_down (9), for both
    weight formats: every linear reads fp16 x, which attention, the norms and silu_mul write. The
    residual adds are no nodes of their own: both linear ops accumulate into the residual in their
    epilogue (OpBinding.accumulate)."""
    del fmt
    return 9


@pytest.mark.parametrize("rows", DECODE_LADDER)
@pytest.mark.parametrize("cfg", [LLAMA8B, FP16_8B], ids=["int4", "fp16"])
def test_a_paged_decode_layer_at_llama_8b_shapes_is_a_dozen_nodes_at_most(cfg, rows):
    g = _paged(cfg, rows, "decode")
    nodes = _layer(g)
    assert len(nodes) == _per_layer_nodes(cfg.weight_format) <= 9, [n.op for n in nodes]
    assert not {n.op for n in g.nodes} & (REMOVED | {"add"}), "a fused-away op is back"
    assert len(g.nodes) == cfg.layers * len(nodes) + 4, "embed, final norm, lm_head, sample"
    assert len(g.nodes) <= 292, "was 580 nodes (612 kernels) before issue 24"


@pytest.mark.parametrize("cfg", [LLAMA8B, FP16_8B], ids=["int4", "fp16"])
def test_prefill_and_single_sequence_layers_fuse_the_same_way(cfg):
    for g in (_paged(cfg, 512, "prefill"), build_decoder_graph(cfg, 1, "decode"),
              build_decoder_graph(cfg, 128, "prefill")):
        nodes = _layer(g)
        assert not {n.op for n in g.nodes} & REMOVED, [n.op for n in nodes]
        linears = [n for n in nodes if n.op.startswith("linear")]
        assert [n.name.rsplit(".", 1)[-1] for n in linears] == ["wqkv", "wo", "w_gateup", "w_down"]
        h, kvd = cfg.hidden, cfg.kv_heads * cfg.head_dim
        assert g.tensors[linears[0].outputs[0]].shape[1] == h + 2 * kvd
        assert len(nodes) <= 12, [n.op for n in nodes]


@pytest.mark.parametrize("rows,phase", [(8, "decode"), (64, "decode"), (512, "prefill")])
@pytest.mark.parametrize("cfg", [LLAMA8B, FP16_8B], ids=["int4", "fp16"])
def test_the_linears_add_the_residual_in_place_in_their_epilogue(cfg, rows, phase):
    assert OPS["linear_f16"].accumulate and OPS["linear_int4"].accumulate
    g = _paged(cfg, rows, phase)
    wo, w_down = (next(n for n in _layer(g) if n.name.endswith(s)) for s in ("wo", "w_down"))
    for node in (wo, w_down):
        assert node.attributes.get("accumulate") and node.outputs == ("x",) \
            and node.inputs[1] == "x", f"{node.name} does not accumulate into the residual"
    assert not any(n.op == "add" for n in g.nodes)


def test_every_norm_and_silu_writes_what_its_linear_reads_so_no_cast_node_is_left():
    for cfg, rows in ((FP16_8B, 1), (LLAMA8B, 512), (LLAMA8B, 8)):
        g = _paged(cfg, rows, "prefill" if rows > 64 else "decode")
        casts = [n.name for n in g.nodes if n.op in ("to_f16", "from_f16")]
        assert casts == [], "every linear reads fp16, which its producer writes"


def test_fused_linears_are_their_parts_concatenated_along_n_exactly():
    for cfg in (QWENISH, dataclasses.replace(QWENISH, weight_format="fp16")):
        parts = W.load_host(cfg, 3)
        fused = dict(W.fuse_linears(cfg, W.generate(cfg, 3)))
        assert list(fused) == W.device_weight_names(cfg)
        for key, arr in fused.items():
            if ".wqkv." in key or ".w_gateup." in key:
                lin, sfx = key.rsplit(".", 2)[-2:]
                p = key[:-len(lin) - len(sfx) - 1]
                want = np.concatenate([parts[p + m + "." + sfx] for m in W.FUSED_LINEARS[lin]])
                np.testing.assert_array_equal(arr, want, err_msg=key)
            else:
                np.testing.assert_array_equal(arr, parts[key], err_msg=key)


def test_fusing_refuses_a_part_that_does_not_concatenate():
    cfg = CONFIGS["tiny"]
    source = [(k, a[:1] if k == "layers.0.wk.q" else a) for k, a in W.generate(cfg, 1)]
    with pytest.raises(ValueError, match="layers.0.wk.q"):
        list(W.fuse_linears(cfg, source))
    incomplete = [(k, a) for k, a in W.generate(cfg, 1) if k != "layers.1.w_up.s"]
    with pytest.raises(ValueError, match="missing parts"):
        list(W.fuse_linears(cfg, incomplete))


@pytest.mark.parametrize("cfg", [QWENISH, QWENISH64], ids=["hd16", "hd64"])
def test_single_sequence_tokens_with_biases_and_scaled_rope_equal_the_reference(device, compiler,
                                                                                 cfg):
    model = DecoderModel(ModelExecutor(device, compiler), cfg, 4, prefill_chunk=32)
    model.load()
    ref = R.DecoderReference(cfg, W.load_host(cfg, 4))
    for prompt in ([5], [(i * 29) % cfg.vocab_size for i in range(70)]):
        got = list(model.generate(prompt, 6))
        want = ref.generate(prompt, 6)
        assert got == want, f"{len(prompt)}-token prompt: {got} != reference {want}"


@pytest.mark.parametrize("cfg", [QWENISH, QWENISH64], ids=["hd16", "hd64"])
def test_paged_tokens_with_biases_and_scaled_rope_equal_the_reference(device, compiler, cfg):
    model = PagedDecoderModel(ModelExecutor(device, compiler), cfg, 4, max_batch_size=8,
                              prefill_chunk=32)
    model.load()
    prompts = [[(i * 7 + k * 13 + 1) % cfg.vocab_size for k in range(n)] for i, n in
               enumerate((3, 40, 17))]
    sched = Scheduler(model, model.pool, thread=False, max_batch_size=8, max_step_tokens=64)
    try:
        seqs = [sched.submit(p, 5, GREEDY) for p in prompts]
        for _ in range(200):
            if not sched.busy():
                break
            sched.step()
        assert not sched.busy(), "the engine never went idle"
    finally:
        sched.close()
        model.executor.close()
        model.close()
    for p, s in zip(prompts, seqs, strict=True):
        want = R.DecoderReference(cfg, W.load_host(cfg, 4)).generate(p, 5)
        assert list(s.generated) == want, f"{len(p)}-token prompt: {s.generated} != {want}"
