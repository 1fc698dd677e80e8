"""The engine off the critical path (issue 23), on the real paged decoder over the sim backend:
overlapped steps give the tokens serial steps give, the decode ladder is fine enough, a step
neither synchronizes the stream nor grows its host work with context, and a long prompt does not
hold up the decoding streams or a later short prompt."""
from __future__ import annotations

import sys

import pytest

from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from gpu_worker.engines.scheduler.scheduler import Scheduler, prefill_shares
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models.configs import get_config
from gpu_worker.models.paged import DECODE_LADDER, PagedDecoderModel, decode_bucket
from tests.scheduler.runners import TokenPoolRunner, solo
from tests.sim_fixtures import compiler, device, kernel_cache_dir  # noqa: F401

CFG = get_config("tiny", "decoder")
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11)


@pytest.fixture
def model(device, compiler):  # noqa: F811
    m = PagedDecoderModel(ModelExecutor(device, compiler), CFG, 5, max_batch_size=64,
                          prefill_chunk=32)
    m.load()
    yield m
    m.executor.close()
    m.close()


def engine(model, overlap: bool, **kw) -> Scheduler:
    return Scheduler(model, model.pool, thread=False, overlap=overlap, **kw)


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 37 + k * 11 + 1) % CFG.vocab_size for k in range(n)]


def run_trace(model, overlap: bool, trace, cancel_at: dict[int, int] | None = None):
    """Submit trace[i] = (arrival step, prompt, max_new, sampling) at its step, cancel the
    sequences of `cancel_at` (index -> step), step until idle; the sequences."""
    sched = engine(model, overlap)
    seqs: dict[int, object] = {}
    step = 0
    while step < 500:
        for i, (at, prompt, new, sampling) in enumerate(trace):
            if at == step:
                seqs[i] = sched.submit(prompt, new, sampling)
        for i, at in (cancel_at or {}).items():
            if at == step:
                seqs[i].cancel()
        if step > max(t[0] for t in trace) and not sched.busy():
            break
        sched.step()
        step += 1
    assert not sched.busy(), "the engine never went idle"
    stats = sched.stats()
    sched.close()
    return [seqs[i] for i in range(len(trace))], stats


def test_overlapped_steps_give_the_same_tokens_as_serial_ones_with_stops_lengths_and_cancels(model):
    sampling = [GREEDY, SEEDED, GREEDY, SamplingParams(temperature=1.0, seed=3), GREEDY, SEEDED]
    base = [(i % 3, prompt_of(i, 5 + 7 * i), 6 + 3 * i, sampling[i]) for i in range(6)]
    free, _ = run_trace(model, False, base)
    free_tokens = [list(s.generated) for s in free]
    # stops that hit at different steps: sequence i stops at its (i + 1)-th token
    trace = []
    for i, (at, prompt, new, s) in enumerate(base):
        if i % 2 == 0:
            s = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed,
                               stop_token_ids=(free_tokens[i][i + 1],))
        trace.append((at, prompt, new, s))
    serial, serial_stats = run_trace(model, False, trace)
    overlapped, stats = run_trace(model, True, trace)
    for i, (a, b) in enumerate(zip(serial, overlapped, strict=True)):
        assert b.generated == a.generated, f"stream {i}: overlapped tokens differ from serial ones"
        assert b.finish_reason == a.finish_reason, f"stream {i}: finish reason differs"
    stopped = {len(s.generated) for s in serial if s.finish_reason == "stop"}
    assert len(stopped) >= 2, f"the stops did not hit at different steps: {stopped}"
    assert all(s.finish_reason == "length" for s in serial[1::2]), "a length stop did not hit"
    assert stats["dropped_tokens"] > 0, "no speculative token was dropped: the late stop is untested"
    assert serial_stats["dropped_tokens"] == 0, "serial steps produced a token nobody asked for"
    assert stats["kv_blocks_used"] == 0 and serial_stats["kv_blocks_used"] == 0, "a block leaked"
    # cancels: a cancelled stream is a prefix of its full stream, the others are untouched
    cancelled, cstats = run_trace(model, True, base, cancel_at={1: 4, 4: 6})
    for i, seq in enumerate(cancelled):
        if i in (1, 4):
            assert seq.finish_reason == "cancelled"
            assert seq.generated == free_tokens[i][:len(seq.generated)], f"stream {i} went wrong"
        else:
            assert seq.generated == free_tokens[i], f"stream {i} changed by another's cancel"
    assert cstats["kv_blocks_used"] == 0, "a cancelled stream's blocks leaked"


def test_overlapped_steps_read_a_step_back_only_after_the_next_is_launched_without_a_sync(model):
    sched = engine(model, True)
    seqs = [sched.submit(prompt_of(i, 9), 40) for i in range(4)]
    for _ in range(4):
        sched.step()
    calls = model.executor.device.backend.calls
    syncs = (calls["synchronize_stream"], calls["synchronize_context"])
    produced = sum(len(s.generated) for s in seqs)
    for _ in range(10):
        sched.step()
        assert sched.stats()["inflight_steps"] == 1, "a step was read back before the next launched"
    assert (calls["synchronize_stream"], calls["synchronize_context"]) == syncs, \
        "a decode step synchronized the stream or the device"
    assert sum(len(s.generated) for s in seqs) == produced + 40, "a step streamed no tokens"
    while sched.busy():
        sched.step()
    sched.close()


def test_a_batch_of_33_replays_the_40_rung_not_64(model):
    assert decode_bucket(33) == 40 and len(DECODE_LADDER) == 11
    sched = engine(model, True)
    seqs = [sched.submit(prompt_of(i, 6), 4) for i in range(33)]
    while sched.busy():
        sched.step()
    plans = model.executor.plans
    decode_rungs = {k[1] for k in plans.keys() if k[0] == "paged_decode"}  # noqa: SIM118 (a PlanCache)
    assert sched.stats()["peak_batch_size"] == 33
    assert 40 in decode_rungs and max(decode_rungs) == 40, \
        f"a batch of 33 ran on rungs {sorted(decode_rungs)}"
    assert plans.get(("paged_decode", 40)).replays >= 3, "the 40 rung was not replayed"
    solo_run = engine(model, True)
    alone = solo_run.submit(prompt_of(7, 6), 4)
    while solo_run.busy():
        solo_run.step()
    assert seqs[7].generated == alone.generated, "a row's tokens depend on its batch"
    sched.close()
    solo_run.close()


def _calls_per_step(sched: Scheduler, steps: int) -> list[int]:
    counts = []
    for _ in range(steps):
        n = 0

        def prof(frame, event, arg):
            nonlocal n
            if event in ("call", "c_call"):
                n += 1
        sys.setprofile(prof)
        try:
            sched.step()
        finally:
            sys.setprofile(None)
        counts.append(n)
    return counts


def test_the_python_work_of_a_decode_step_does_not_grow_with_context(model):
    """Counted, not timed: the engine thread's Python calls per decode step (sim kernels run on
    the sim stream's thread, which the profile does not see) at 40 and at 900 tokens of context."""
    medians = {}
    for context in (40, 900):
        sched = engine(model, True)
        seqs = [sched.submit(prompt_of(i, context), 60) for i in range(4)]
        while not all(s.generated for s in seqs):    # prompts in, decoding
            sched.step()
        counts = sorted(_calls_per_step(sched, 15))
        medians[context] = counts[len(counts) // 2]
        while sched.busy():
            sched.step()
        sched.close()
    assert medians[900] <= medians[40] * 1.1 + 20, \
        f"a decode step's Python calls grew with context: {medians}"


def test_a_long_prompt_arriving_while_8_streams_decode_holds_them_up_by_one_chunk_per_step(device):  # noqa: F811
    geo = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=4096)
    pool = KVBlockPool(device.arena, geo, 512)
    runner = TokenPoolRunner(geo, 512, 256)
    sched = Scheduler(runner, pool, thread=False, max_step_tokens=512, min_prefill_share=64)
    streams = [sched.submit(prompt_of(i, 20), 40) for i in range(8)]
    for _ in range(3):
        sched.step()
    long = sched.submit(prompt_of(99, 3000), 2)
    sched.step()
    short = sched.submit(prompt_of(98, 30), 2)     # behind the long prompt's 12 chunks
    submitted_at = sched.counters["steps"]
    while sched.busy():
        before = sched.counters["prefill_tokens"]
        sched.step()
        assert sched.counters["prefill_tokens"] - before <= 512 - 8, "the step budget was exceeded"
    assert max(runner.prefill_calls) <= 256, "a step ran more than one chunk of a prompt"
    for i, s in enumerate(streams):
        steps = s.token_steps
        assert steps == list(range(steps[0], steps[0] + len(steps))), \
            f"stream {i} skipped steps while the long prompt prefilled: {steps}"
        assert s.generated == solo(prompt_of(i, 20), 40)
    assert short.token_steps[0] - submitted_at <= 1, \
        "the short prompt's first token waited behind the long prompt"
    assert long.token_steps[0] > short.token_steps[0]
    assert long.generated == solo(prompt_of(99, 3000), 2)
    sched.close()


@pytest.mark.parametrize("demands,budget,floor,want", [
    ([3000, 30], 504, 64, [474, 30]),          # the short prompt gets all it needs at once
    ([100, 100, 100], 120, 64, [100, 0, 0]),   # only the floors that fit, FCFS: no 20-token chunk
    ([10, 500, 500], 400, 64, [10, 195, 195]),
    ([256], 2000, 256, [256]),
    ([], 10, 4, []),
])
def test_prefill_shares_are_max_min_fair_within_the_budget_and_floor(demands, budget, floor, want):
    got = prefill_shares(demands, budget, floor)
    assert got == want and sum(got) <= budget
