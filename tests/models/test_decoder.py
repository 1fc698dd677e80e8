"""The tiny decoder on the sim backend (NVRTC-compiled kernels, NumPy launches) against the
NumPy reference model."""
from __future__ import annotations

import pytest

from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.decoder import DecoderModel
from services.common.errors import InvalidArgument


def load(device, compiler, seed=7, **kw):
    ex = ModelExecutor(device, compiler, **kw)
    model = DecoderModel(ex, CONFIGS["tiny"], seed)
    model.load()
    return ex, model


def test_tiny_decoder_tokens_are_identical_to_the_numpy_reference(device, compiler):
    _, model = load(device, compiler)
    host = W.load_host(CONFIGS["tiny"], 7)
    for prompt in ([3], list(range(5, 40)), [(i * 37) % 1024 for i in range(100)]):
        got = list(model.generate(prompt, 8))
        want = R.DecoderReference(CONFIGS["tiny"], host).generate(prompt, 8)
        assert got == want, f"prompt of {len(prompt)} tokens: executor {got} != reference {want}"


def test_decoder_runs_a_prompt_near_the_full_context(device, compiler):
    _, model = load(device, compiler)
    prompt = [(i * 13) % 1024 for i in range(1000)]
    got = list(model.generate(prompt, 3))
    want = R.DecoderReference(CONFIGS["tiny"], W.load_host(CONFIGS["tiny"], 7)).generate(prompt, 3)
    assert got == want, "a 1000-token prompt (bucket 1024 = the whole KV cache) diverged"


def test_decode_plan_is_one_captured_graph_replayed_for_every_step(device, compiler):
    ex, model = load(device, compiler)
    list(model.generate(list(range(20)), 10))
    plan = ex.plans.get(("decode", 1, 1))
    assert plan is not None and plan.graph_exec is not None, "decode should run from a captured graph"
    assert plan.replays == 9, f"9 decode steps should be 9 replays of one graph, got {plan.replays}"


def test_the_decode_graph_survives_a_run_of_new_prefill_buckets(device, compiler):
    ex, model = load(device, compiler, variants_per_node=4)
    list(model.generate([(7 * i) % 1024 for i in range(10)], 2))
    plan = ex.plans.get(("decode", 1, 1))
    graph = plan.graph_exec
    for n in (20, 40, 100, 200, 400):                # five more prefill buckets, bound 4 per node
        list(model.generate([(7 * i) % 1024 for i in range(n)], 2))
        assert ex.plans.get(("decode", 1, 1)) is plan and plan.graph_exec is graph, \
            f"the decode graph was reset by prefill shapes (after a {n}-token prompt)"
    s = ex.kernels.stats()
    assert s["max_variants_per_node"] <= 4 and s["evictions"] > 0, s


def test_bad_generate_requests_are_invalid_argument_and_change_nothing(device, compiler):
    ex, model = load(device, compiler)
    before = device.ledger.snapshot()
    for prompt, n in (([], 4), ([1, 2, 5000], 4), ([1] * 1020, 10), ([1], 0)):
        with pytest.raises(InvalidArgument):
            list(model.generate(prompt, n))
    assert device.ledger.snapshot() == before, "a refused request changed the ledger"
    assert ex.plans.stats()["entries"] == 0


def test_cancelled_generation_stops_between_steps(device, compiler):
    _, model = load(device, compiler)
    seen: list[int] = []
    for tok in model.generate([1, 2, 3], 50, cancelled=lambda: len(seen) >= 3):
        seen.append(tok)  # noqa: PERF402 - `cancelled` reads `seen` as it grows
    assert len(seen) == 3, f"generation ran past cancellation: {len(seen)} tokens"


def chunked(device, compiler, chunk, seed=7, **kw):
    ex = ModelExecutor(device, compiler, **kw)
    model = DecoderModel(ex, CONFIGS["tiny"], seed, prefill_chunk=chunk)
    model.load()
    return ex, model


def test_chunked_prefill_gives_the_reference_tokens_captured_and_eager(device, compiler):
    _, model = chunked(device, compiler, 64)
    host = W.load_host(CONFIGS["tiny"], 7)
    prompt = [(i * 37) % 1024 for i in range(150)]           # chunks 64 + 64 + 22 (padded)
    assert [c[1:] for c in model.prefill_chunks(150)] == [(64, 64), (64, 64), (22, 64)]
    want = R.DecoderReference(CONFIGS["tiny"], host).generate(prompt, 6)
    assert list(model.generate(prompt, 6)) == want, "chunked prefill diverged from the reference"
    model.capture = False
    assert list(model.generate(prompt, 6)) == want, "eager chunked prefill diverged from the graph"


def test_every_prompt_length_uses_a_handful_of_shapes_and_pads_less_than_one_chunk(device, compiler):
    _, model = chunked(device, compiler, 256)
    shapes = set()
    for n in range(1, 1001):
        chunks = model.prefill_chunks(n)
        assert sum(c[1] for c in chunks) == n and chunks[0][0] == 0
        assert sum(c[2] for c in chunks) - n < 256, f"a {n}-token prompt pads by a chunk or more"
        shapes |= {c[2] for c in chunks}
    assert shapes == {16, 32, 64, 128, 256}, f"plan shapes {sorted(shapes)}"


def test_prefill_activation_memory_is_bounded_by_the_chunk(device, compiler):
    ex, model = chunked(device, compiler, 64, max_plans=1)
    model.prefill(list(range(64)))
    one_chunk = ex.plans.stats()["activation_bytes"]
    model.prefill([(i * 3) % 1024 for i in range(900)])       # 15 chunks of 64
    assert ex.plans.keys() == [("prefill", 1, 64)]
    assert ex.plans.stats()["activation_bytes"] == one_chunk, "activations grew with the prompt"


def test_a_padded_last_chunk_at_the_end_of_the_context_stays_inside_the_cache(device, compiler):
    # 1020 tokens in chunks of 96: the last chunk's padding reaches rows 1020..1055 of a
    # 1024-row cache; appends past the end are dropped and attention reads only real rows
    # (an out-of-bounds read raises IllegalAddress on the sim)
    _, model = chunked(device, compiler, 96)
    host = W.load_host(CONFIGS["tiny"], 7)
    prompt = [(i * 11) % 1024 for i in range(1020)]
    want = R.DecoderReference(CONFIGS["tiny"], host).generate(prompt, 4)
    assert list(model.generate(prompt, 4)) == want


def test_the_kv_cache_is_fp16_half_the_bytes_of_f32(device, compiler):
    cfg = CONFIGS["tiny"]
    before = device.ledger.snapshot()["kv"][1]
    ex, _ = load(device, compiler)
    per_token = 2 * cfg.layers * cfg.kv_heads * cfg.head_dim      # K and V elements
    assert device.ledger.snapshot()["kv"][1] - before == per_token * cfg.max_context * 2, \
        "the KV zone must hold exactly 2 bytes per K/V element of the context"
    assert cfg.kv_bytes() == per_token * cfg.max_context * 2
    ex.close()
