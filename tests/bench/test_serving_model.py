"""bench/serving_model.py: serving_bench's traffic through the real Scheduler on a modeled clock.
Its time is exactly the sum of its steps' modeled costs, every requested token is generated,
and the what-ifs move the figures the way they say."""
from __future__ import annotations

import json

import pytest

from bench import serving_model as sm
from gpu_worker.models.paged import DECODE_LADDER

SMALL = ["--concurrency", "6", "--requests", "2", "--prompt-range", "64,700",
         "--new-range", "4,24", "--arrival-requests", "6", "--arrival-rate", "20"]


@pytest.fixture(scope="module")
def levels():
    return sm.main(SMALL)


def test_every_requested_token_is_generated_and_every_prompt_is_chunked(levels):
    burst, arrivals = levels
    for level in levels:
        assert level.tokens == level.requested > 0, level
        assert level.chunks >= level.prompts and level.prefill_steps <= level.chunks
        assert len(level.ttft) == level.prompts and all(t > 0 for t in level.ttft)
    assert burst.name == "6 streams" and arrivals.name == "20 req/s"


def test_the_modeled_time_is_the_sum_of_the_steps_costs():
    args = sm.parse_args(SMALL)
    replay = sm.Replay(args, sm.H200_COSTS, 2)
    import random
    rng = random.Random(1)
    seqs = [replay.submit(300, 5, rng), replay.submit(90, 3, rng)]
    while any(s.state != "finished" for s in seqs):
        replay.step()
    level = replay.close(sm.Level("two", prompts=2, requested=8))
    want = sum(sm.H200_COSTS.step_s(r) for r in replay.records)
    assert level.seconds == pytest.approx(want) and level.tokens == 8
    assert [sum(r["chunks"]) for r in replay.records if r["chunks"]] == [390], \
        "both prompts whole in the first step"


def test_buckets_of_powers_of_two_pad_more_rows_than_the_workers_ladder(levels):
    pow2 = sm.main([*SMALL, "--ladder", "pow2"])[0]
    assert pow2.steps == levels[0].steps and pow2.chunks == levels[0].chunks, \
        "the ladder changes what a chunk costs, not how the scheduler plans"
    assert pow2.seconds > levels[0].seconds


def test_packing_or_a_cheaper_chunk_never_costs_more_and_a_free_chunk_costs_only_tokens(levels):
    base = levels[0]
    packed = sm.main([*SMALL, "--packed"])[0]
    half = sm.main([*SMALL, "--chunk-scale", "0.5"])[0]
    assert packed.steps == base.steps, "a what-if of the costs changes no scheduling"
    assert packed.seconds < base.seconds and half.seconds < base.seconds
    record = {"decode_rows": 3, "chunks": [100, 50]}
    c = sm.H200_COSTS
    assert c.step_s(record) - c.step_s(record, packed=True) == pytest.approx(c.per_chunk)


def test_folding_saves_a_mixed_steps_decode_linears_less_their_prefill_rows(levels):
    base = levels[0]
    folded = sm.main([*SMALL, "--fold"])[0]
    both = sm.main([*SMALL, "--fold", "--packed"])[0]
    assert folded.steps == base.steps and folded.seconds < base.seconds
    assert both.seconds < folded.seconds
    c = sm.H200_COSTS
    mixed = {"decode_rows": 40, "decode_graph_rows": 40, "chunks": [300]}
    saving = dict(c.linears)[40] - 40 * c.per_prefill_row
    assert c.step_s(mixed) - c.step_s(mixed, fold=True) == pytest.approx(saving)
    for only in ({"decode_rows": 40, "chunks": []}, {"decode_rows": 0, "chunks": [300]}):
        assert c.step_s(only, fold=True) == c.step_s(only), "nothing to fold"


def test_costs_fitted_from_a_step_trace_recover_its_coefficients(tmp_path):
    truth = (3000.0, 100.0, 9000.0, 30.0)      # µs: pass, per row, per chunk, per token
    lines = []
    for step in range(80):
        rows, chunks = step % 17, [64 * (step % 5 + 1)] * (step % 3)
        us = (truth[0] * (rows > 0) + truth[1] * rows + truth[2] * len(chunks)
              + truth[3] * sum(chunks))
        lines.append(json.dumps({"model": "m", "step": step, "decode_rows": rows, "chunks": chunks,
                                 "device_us": us, "host_us": 1.0, "wait_us": 0.0}))
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines) + "\n")
    got = sm.StepCosts.fitted(path, skip=0)
    assert (got.decode_pass, got.per_decode_row, got.per_chunk, got.per_prefill_row) == \
        pytest.approx(tuple(t / 1e6 for t in truth), rel=1e-6)
    rungs = dict(got.rungs)
    assert set(rungs) <= set(DECODE_LADDER) and rungs, "decode-only steps priced by rung"
    assert got.decode_s({"decode_rows": 1, "decode_graph_rows": 1}) == rungs[1]
    assert got.scaled(decode=0.5).decode_s({"decode_rows": 1}) == pytest.approx(rungs[1] / 2)
