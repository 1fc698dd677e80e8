"""Graph execution on the real device: the CPU suite's invariants again, on CUDA, plus
whole-model logits against the NumPy reference. Run on the GPU machine:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_execution.py
    compute-sanitizer --tool memcheck .venv/bin/python -m pytest -m gpu tests/gpu/test_execution.py
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.execution import ops
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.decoder import DecoderModel
from gpu_worker.models.encoder import EncoderModel

# Above 16 rows the linears round x and W to fp16 (the reference does too), so an f32
# summation-order difference that crosses an fp16 rounding boundary moves a value by 2^-11 relative.
ATOL = 1e-3

pytestmark = pytest.mark.gpu


def make(device, compiler, cls, config, seed, **kw):
    ex = ModelExecutor(device, compiler, **kw)
    model = cls(ex, CONFIGS[config], seed)
    model.load()
    return ex, model


def seqs(batch, seq, salt=0):
    return [[(b * 131 + t * 17 + salt) % 1024 for t in range(seq)] for b in range(batch)]


def test_gpu_tiny_decoder_tokens_are_identical_to_the_numpy_reference(device, compiler):
    _, model = make(device, compiler, DecoderModel, "tiny", 7)
    host = W.load_host(CONFIGS["tiny"], 7)
    for prompt in ([3], list(range(5, 40)), [(i * 37) % 1024 for i in range(300)]):
        got = list(model.generate(prompt, 16))
        want = R.DecoderReference(CONFIGS["tiny"], host).generate(prompt, 16)
        assert got == want, f"prompt of {len(prompt)}: device {got} != reference {want}"


def test_gpu_small_decoder_logits_are_within_tolerance_of_the_reference(device, compiler):
    cfg = CONFIGS["small"]
    _, model = make(device, compiler, DecoderModel, "small", 3)
    ref = R.DecoderReference(cfg, W.load_host(cfg, 3))
    for prompt in ([(i * 29) % cfg.vocab_size for i in range(n)] for n in (1, 20, 300)):
        got = model.logits(prompt)            # tensor cores above 16 rows, fused int4 below
        want = ref.forward(prompt, 0)[-1]
        err = float(np.max(np.abs(got - want)))
        assert err <= 1e-3 * max(1.0, float(np.max(np.abs(want)))), \
            f"logits of a {len(prompt)}-token prompt off by {err}"


def test_gpu_kernel_variants_stay_bounded_under_24_shapes_with_correct_results(device, compiler):
    ex, model = make(device, compiler, EncoderModel, "tiny-encoder", 1)
    ref = R.EncoderReference(CONFIGS["tiny-encoder"], W.load_host(CONFIGS["tiny-encoder"], 1))
    for batch in (1, 2, 3):
        for seq in (5, 9, 17, 24, 31, 40, 48, 63):
            got = model.embed(seqs(batch, seq))
            assert np.allclose(got, ref.embed(np.array(seqs(batch, seq))), atol=ATOL), (batch, seq)
            assert ex.kernels.stats()["max_variants_per_node"] <= ex.kernels.bound
            shared = ex.shared_workspace_bytes() + device.blas_stats()["workspace_bytes"]
            assert device.ledger.snapshot()["workspace"][1] == \
                ex.kernels.stats()["workspace_bytes"] + shared
    assert ex.plans.stats()["entries"] <= 2


def test_gpu_decode_graph_survives_new_prefill_buckets(device, compiler):
    ex, model = make(device, compiler, DecoderModel, "tiny", 7, variants_per_node=4)
    list(model.generate([(7 * i) % 1024 for i in range(10)], 2))
    plan = ex.plans.get(("decode", 1, 1))
    graph = plan.graph_exec
    for n in (20, 40, 100, 200, 400):
        list(model.generate([(7 * i) % 1024 for i in range(n)], 2))
        assert plan.graph_exec is graph, f"decode graph reset by prefill shapes at {n}"


def test_gpu_eviction_resets_graphs_and_rebuilt_plans_are_bit_identical(device, compiler):
    ex, model = make(device, compiler, EncoderModel, "small-encoder", 1, variants_per_node=1,
                     max_plans=1)
    a = seqs(2, 20)
    first = model.embed(a)
    for shape in ((1, 30), (3, 7), (2, 50)):
        model.embed(seqs(*shape))
    again = model.embed(a)
    device.synchronize()
    assert np.array_equal(first, again), "a plan rebuilt after eviction changed the output bits"
    assert ex.kernels.stats()["evictions"] > 0 and ex.plans.stats()["evictions"] > 0


def test_gpu_two_throwing_runs_then_a_third_shape_keep_the_bound(device, compiler, monkeypatch):
    ex, model = make(device, compiler, EncoderModel, "tiny-encoder", 1)
    model.embed(seqs(1, 8))
    real = ops.OPS["gelu"]
    boom = ops.OpBinding(real.kernels, lambda c: (_ for _ in ()).throw(RuntimeError("boom")))
    monkeypatch.setitem(ops.OPS, "gelu", boom)
    for seq in (9, 10):
        with pytest.raises(RuntimeError):
            model.embed(seqs(1, seq))          # throws inside a real stream capture
    monkeypatch.setitem(ops.OPS, "gelu", real)
    model.embed(seqs(1, 11))
    stats = ex.plans.stats()
    assert stats["entries"] <= 2
    assert device.ledger.snapshot()["activations"][1] == stats["activation_bytes"]
    assert device.ledger.snapshot()["graphs"][1] == stats["graph_bytes"]


def test_gpu_decode_graph_replay_matches_eager_decode(device, compiler):
    _ex, model = make(device, compiler, DecoderModel, "small", 5)
    prompt = list(range(1, 50))
    graph_tokens = list(model.generate(prompt, 12))
    model.capture = False
    eager_tokens = list(model.generate(prompt, 12))
    assert graph_tokens == eager_tokens, "captured decode diverged from eager decode"


@pytest.mark.parametrize("probe", ["granules", "content-unprobed"])
def test_on_cuda_a_load_never_evicts_weights_another_model_runs_on(probe, monkeypatch, kernel_cache_dir):
    """Issue 11's device fault, on the H200: under an exact budget the second model loads by
    paging the idle first one out (issue 14), and the first pages back in and serves the same
    tokens; never an illegal address."""
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.core.loader import ModelLoader
    from tests.scenarios import second_model_under_an_exact_budget
    if probe == "content-unprobed":
        monkeypatch.setattr(ModelLoader, "admit", lambda self, cfg, model_id: None)
    rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=kernel_cache_dir)).start()
    try:
        outcome = second_model_under_an_exact_budget(rt, probe.split("-")[0],
                                                 kv_at_load=probe != "content-unprobed")
        assert outcome == "loaded", "the idle first model could have been paged out"
        if probe == "content-unprobed":   # b fit only by paging a out; a paged back in and served
            assert rt.stats()["reclaim"]["rounds"] > 0
    finally:
        rt.close()


def test_gpu_chunked_prefill_gives_the_reference_tokens_captured_and_eager(device, compiler):
    ex = ModelExecutor(device, compiler)
    model = DecoderModel(ex, CONFIGS["tiny"], 7, prefill_chunk=96)
    model.load()
    host = W.load_host(CONFIGS["tiny"], 7)
    # 1020 tokens in chunks of 96: the last chunk's padding runs past the 1024-row cache
    for prompt in ([(i * 37) % 1024 for i in range(300)], [(i * 11) % 1024 for i in range(1020)]):
        want = R.DecoderReference(CONFIGS["tiny"], host).generate(prompt, 4)
        model.capture = True
        assert list(model.generate(prompt, 4)) == want, f"{len(prompt)} tokens, captured"
        model.capture = False
        assert list(model.generate(prompt, 4)) == want, f"{len(prompt)} tokens, eager"
