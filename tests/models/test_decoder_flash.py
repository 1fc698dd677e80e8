"""The decoder at head_dim 64 (the tensor-core attention path: flash prefill per chunk, split-K
decode, fp16 q and output) on the sim backend against the NumPy reference."""
from __future__ import annotations

import numpy as np

from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.kernels.flash_attention import flash_decode_splits, flash_decode_workspace_bytes
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS, ModelConfig
from gpu_worker.models.decoder import DecoderModel, build_decoder_graph, uses_flash_attention

# tiny's shape at head_dim 64 with GQA (2 query heads per KV head); 512 rows of context give the
# split-K decode 4 splits of 128 keys
HD64 = ModelConfig("tiny-hd64", "decoder", vocab_size=512, hidden=128, layers=2, heads=2,
                   kv_heads=1, ffn=256, max_context=512)


def load(device, compiler, chunk=None, seed=5):
    ex = ModelExecutor(device, compiler)
    model = DecoderModel(ex, HD64, seed, prefill_chunk=chunk)
    model.load()
    return ex, model


def reference_tokens(prompt, n, seed=5):
    return R.DecoderReference(HD64, W.load_host(HD64, seed)).generate(prompt, n)


def test_attention_runs_on_the_flash_kernels_at_head_dims_64_and_128_only():
    for cfg, flash in ((HD64, True), (CONFIGS["8b-int4"], True), (CONFIGS["tiny"], False)):
        assert uses_flash_attention(cfg) == flash, cfg.name
        for seq, phase in ((64, "prefill"), (1, "decode")):
            ops = {nd.op for nd in build_decoder_graph(cfg, seq, phase).nodes}
            fa = {"flash_attention_prefill_cached", "flash_attention_decode"} & ops
            old = {"attention_prefill_cached", "attention_decode"} & ops
            assert (bool(fa), bool(old)) == (flash, not flash), (cfg.name, phase, ops)


def test_flash_attention_output_feeds_wo_as_is_on_every_path():
    prefill = build_decoder_graph(HD64, 128, "prefill")   # > 64 rows: the tensor-core path
    decode = build_decoder_graph(HD64, 1, "decode")
    assert prefill.tensors["layers.0.a"].dtype == "f16"
    wo = {nd.name: nd for nd in prefill.nodes}["layers.0.wo"]
    # (a second input, when there is one, is the residual the linear accumulates into)
    assert wo.inputs[0] == "layers.0.a", "prefill: the tensor-core wo reads the fp16 output as is"
    assert "layers.0.wo.cast" not in {nd.name for nd in prefill.nodes}
    wo = {nd.name: nd for nd in decode.nodes}["layers.0.wo"]
    assert wo.inputs[0] == "layers.0.a", "decode: the int4 GEMV reads the fp16 output as is"
    assert not any(nd.op == "from_f16" for nd in decode.nodes), "no linear widens x to f32"


def test_flash_decoder_tokens_are_identical_to_the_numpy_reference(device, compiler):
    _, model = load(device, compiler)
    # 3 tokens: the fused int4 wo in prefill; 40 and 300: tensor-core wo, decode
    # crossing split boundaries (128-key spans)
    for prompt in ([3], [(i * 37) % 512 for i in range(40)], [(i * 7) % 512 for i in range(300)]):
        got = list(model.generate(prompt, 8))
        assert got == reference_tokens(prompt, 8), f"prompt of {len(prompt)} tokens diverged"


def test_flash_chunked_prefill_gives_the_reference_tokens_captured_and_eager(device, compiler):
    _, model = load(device, compiler, chunk=64)
    prompt = [(i * 13) % 512 for i in range(150)]              # chunks 64 + 64 + 22 (padded)
    want = reference_tokens(prompt, 6)
    assert list(model.generate(prompt, 6)) == want, "chunked flash prefill diverged"
    model.capture = False
    assert list(model.generate(prompt, 6)) == want, "eager run diverged from the captured graphs"


def test_flash_decode_graph_replays_as_the_cache_grows_past_split_boundaries(device, compiler):
    ex, model = load(device, compiler)
    prompt = [(i * 3) % 512 for i in range(120)]
    got = list(model.generate(prompt, 20))                     # keys 121..139: into split 2
    plan = ex.plans.get(("decode", 1, 1))
    assert plan is not None and plan.graph_exec is not None and plan.replays == 19
    assert got == reference_tokens(prompt, 20)


def test_flash_decode_workspace_is_booked_once_for_the_layers_and_fixed_by_max_context(device, compiler):
    ex, model = load(device, compiler)
    before = device.ledger.snapshot()["workspace"][1]
    model.decode(1, 0)
    splits = flash_decode_splits(HD64.max_context, 1, HD64.heads, HD64.kv_heads)
    want = flash_decode_workspace_bytes(batch=1, heads=HD64.heads, head_dim=64, splits=splits)
    assert splits == 4
    held = ex.kernels.stats()
    # one split-K workspace that every layer's decode attention shares (they run one after
    # another), nothing else in a decode graph
    assert want <= held["workspace_bytes"] < want + 4096, held
    assert device.ledger.snapshot()["workspace"][1] - before >= held["workspace_bytes"], \
        "the split-K workspace must be booked in the ledger's workspace zone"
    model.decode(2, 300)                                       # a longer cache: same variants
    again = ex.kernels.stats()
    assert (again["misses"], again["workspace_bytes"]) == (held["misses"], held["workspace_bytes"])


def test_flash_decoder_logits_match_the_reference_that_rounds_q_and_output_to_fp16(device, compiler):
    _, model = load(device, compiler)
    host = W.load_host(HD64, 5)
    for n in (3, 40):
        prompt = [(i * 11) % 512 for i in range(n)]
        got = model.logits(prompt)
        want = R.DecoderReference(HD64, host).forward(prompt, 0)[-1]
        plain = R.DecoderReference(HD64, host)
        plain.fp16_attention = False                         # negative control: q, out in f32
        plain = plain.forward(prompt, 0)[-1]
        err, gap = float(np.max(np.abs(got - want))), float(np.max(np.abs(got - plain)))
        assert err < 0.1 * gap, f"{n} tokens: off the rounding reference by {err} (unrounded {gap})"
