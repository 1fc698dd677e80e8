"""The engine off the critical path (issue 23), on the real paged decoder over the sim backend:
overlapped steps give the tokens serial steps give, the decode ladder is fine enough, a step
neither synchronizes the stream nor grows its host work with context, and a long prompt does not
hold up the decoding streams or a later short prompt. Then the prefill orders (fair shares and
shortest first): their share functions, and what each changes in a trace (when, never what)."""
from __future__ import annotations

import random
import statistics
import sys

import pytest

from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.engines.scheduler.shares import prefill_shares, shortest_first_shares
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.execution.layout import plan_layout
from gpu_worker.models.configs import get_config
from gpu_worker.models.paged import DECODE_LADDER, PagedDecoderModel, decode_bucket
from services.common.errors import InvalidArgument
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


def test_streams_left_on_high_slots_move_down_so_the_tail_replays_small_rungs(model):
    # stream i holds slot i and outlives every stream before it: without compaction the last
    # one decodes alone on slot 9, i.e. on the 16-row graph
    records: list[dict] = []
    sched = engine(model, True, step_trace=records.append)
    sampling = [GREEDY, SEEDED]
    news = [3 + 4 * i for i in range(9)] + [50]
    seqs = [sched.submit(prompt_of(i, 4 + i), news[i], sampling[i % 2]) for i in range(10)]
    while sched.busy():
        sched.step()
    stats = sched.stats()
    sched.close()
    lone = [r["decode_graph_rows"] for r in records if r["decode_rows"] == 1 and not r["chunks"]]
    assert len(lone) >= 8, "the trace has no tail of one stream"
    assert max(lone) <= 2 and lone.count(1) >= len(lone) - 1, \
        f"a lone stream ran {lone} graph rows: it stayed on a high slot"
    assert stats["slot_moves"] >= 5, f"only {stats['slot_moves']} slot moves"
    for r in records:     # no decode graph ran rows beyond the batch's rung and the finishers'
        if r["decode_rows"]:
            assert r["decode_graph_rows"] <= decode_bucket(min(64, 2 * r["decode_rows"] + 1))
    for i in (0, 5, 9):   # a moved stream's tokens are its solo tokens
        solo_run = engine(model, True)
        alone = solo_run.submit(prompt_of(i, 4 + i), news[i], sampling[i % 2])
        while solo_run.busy():
            solo_run.step()
        solo_run.close()
        assert seqs[i].generated == alone.generated, f"stream {i} changed when it moved slot"


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


def test_a_serving_mix_of_decode_rungs_and_prefill_buckets_captures_each_graph_once(
        device, compiler):  # noqa: F811
    """Batches wandering over more decode rungs than the kernel cache's default bound of 4
    once was, between prefill chunks of all four buckets of a 128-token chunk (more than
    --max-plans): the second pass of the same trace captures nothing (no graph reset by a
    kernel variant's eviction, no prefill plan evicted) and gives the same tokens. The
    attention scratch of every layer is one variant per rung."""
    m = PagedDecoderModel(ModelExecutor(device, compiler), CFG, 5, max_batch_size=64,
                          prefill_chunk=128)
    m.load()
    try:
        trace = [(i // 3, prompt_of(i, 9 + 37 * (i % 5)), 3 + 5 * (i % 7), GREEDY)
                 for i in range(30)]
        gate = m.executor.device.gate.stats
        first, stats = run_trace(m, True, trace)
        rungs = {decode_bucket(b) for b in range(1, stats["peak_batch_size"] + 1)}
        assert len(rungs) > 4, f"the trace must wander over more than 4 rungs, got {sorted(rungs)}"
        buckets = {k[1] for k in m.executor.plans.keys() if k[0] == "paged_prefill"}  # noqa: SIM118 - PlanCache, not a dict
        assert buckets == {16, 32, 64, 128} and m.prefill_buckets() == 4, buckets
        captured = gate.captures
        again, _ = run_trace(m, True, trace)
        assert gate.captures == captured, \
            f"{gate.captures - captured} graphs captured again: a live graph was reset or evicted"
        assert [list(s.generated) for s in again] == [list(s.generated) for s in first]
        kernels = m.executor.kernels
        scratch = [k for k in kernels._nodes if isinstance(k, tuple) and k[0] == "scratch"]
        assert scratch and all(len(kernels.variants(k)) <= len(DECODE_LADDER) for k in scratch)
        assert kernels.stats()["workspace_bytes"] == sum(
            v.workspace_bytes for k in scratch for v in kernels._nodes[k].values()), \
            "only the shared attention scratch holds workspaces"
    finally:
        m.executor.close()
        m.close()


def test_the_prefill_buckets_share_one_activation_arena_and_free_it_with_the_last(
        device, compiler):  # noqa: F811
    """Chunks of five buckets of a 512-token chunk (16 .. 384 .. 512 rows): their graphs bake
    one arena, the size of the largest bucket's layout, booked once; it goes with the plans."""
    m = PagedDecoderModel(ModelExecutor(device, compiler), CFG, 5, max_batch_size=64,
                          prefill_chunk=512)
    m.load()
    try:
        trace = [(i, prompt_of(i, n), 2, GREEDY) for i, n in enumerate((9, 30, 100, 300, 500))]
        run_trace(m, True, trace)
        plans = m.executor.plans
        keys = plans.keys()      # PlanCache.keys(): LRU order, not a dict
        prefill = [plans.get(k) for k in keys if k[0] == "paged_prefill"]
        assert sorted(p.key[1] for p in prefill) == [16, 32, 128, 384, 512]
        assert len({p.arena_alloc.ptr for p in prefill}) == 1, "each bucket baked its own arena"
        largest = plan_layout(m._graph(512, "prefill")()).nbytes
        arena = prefill[0].arena_alloc.size
        assert largest <= arena < largest + (2 << 20)
        own = sum(plans.get(k).activation_bytes for k in keys)
        assert plans.stats()["activation_bytes"] == own + arena, "the shared arena counted once"
        plans.evict_all()
        assert m.executor.arenas.bytes() == 0
    finally:
        m.executor.close()
        m.close()


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


@pytest.mark.parametrize("demands,remaining,budget,floor,oldest,want", [
    ([256, 30, 128], [900, 30, 128], 504, 64, 0, [256, 30, 128]),   # everyone fits
    ([256, 30, 128], [900, 30, 128], 200, 64, 0, [170, 30, 0]),     # 128 does not fit whole
    ([256, 256, 100], [2000, 300, 100], 400, 64, 0, [256, 0, 100]),
    ([256, 100, 100], [2000, 100, 100], 150, 64, 0, [150, 0, 0]),   # neither 100 fits in 86
    ([256, 100, 100], [2000, 100, 100], 300, 64, 0, [100, 100, 100]),  # ties: candidate order
    ([256, 200, 224], [1000, 200, 224], 300, 64, 2, [0, 200, 100]),  # the oldest may be split
    ([0, 256], [0, 500], 256, 64, 1, [0, 256]),       # a swapped-in decoder needs nothing
    ([], [], 10, 4, 0, []),
])
def test_shortest_first_serves_the_oldest_floor_then_whole_shortest_prompts(
        demands, remaining, budget, floor, oldest, want):
    assert shortest_first_shares(demands, remaining, budget, floor, oldest) == want


def test_shortest_first_splits_no_prompt_but_the_oldest_and_never_exceeds_the_budget():
    rng = random.Random(7)
    for _ in range(2000):
        n, chunk, floor = rng.randint(1, 9), rng.choice([32, 256, 2048]), rng.choice([1, 16, 256])
        remaining = [rng.randint(1, 3000) for _ in range(n)]
        demands = [min(chunk, r) for r in remaining]
        budget, oldest = rng.randint(1, 2048), rng.randrange(n)
        got = shortest_first_shares(demands, remaining, budget, floor, oldest)
        case = (demands, remaining, budget, floor, oldest, got)
        assert sum(got) <= budget, f"the budget was exceeded: {case}"
        assert all(0 <= g <= d for g, d in zip(got, demands)), f"more than a demand: {case}"
        assert got[oldest] >= min(demands[oldest], floor, budget), f"the oldest starved: {case}"
        assert all(g in (0, d) for i, (g, d) in enumerate(zip(got, demands)) if i != oldest), \
            f"a prompt other than the oldest was split: {case}"
        assert got[oldest] == demands[oldest] or sum(got) == budget, \
            f"the oldest was cut short while tokens were left: {case}"
        order = sorted(range(n), key=lambda i: remaining[i])
        for k, i in enumerate(order):
            if got[i] and i != oldest:
                shorter = [j for j in order[:k] if j != oldest]
                assert all(got[j] == demands[j] for j in shorter), \
                    f"a longer prompt was served before a shorter one: {case}"


def test_negative_control_without_the_oldest_floor_the_long_prompt_gets_nothing():
    """The floor goes to `oldest`: pointed at the short prompt instead, the long one is left out
    (what a plain shortest-first order does to it every step while shorter prompts keep coming)."""
    long_, short = 0, 1
    guarded = shortest_first_shares([256, 224], [1000, 224], 256, 64, long_)
    unguarded = shortest_first_shares([256, 224], [1000, 224], 256, 64, short)
    assert guarded == [256, 0] and unguarded == [0, 224]


GEO = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=4096)
# (arrival step, prompt tokens, max_new_tokens, sampling): 8 prompts arriving together, then more
MIXED = [(0, 1500, 6, GREEDY), (0, 300, 8, SEEDED), (0, 2000, 4, GREEDY), (0, 128, 10, GREEDY),
         (0, 700, 5, SEEDED), (0, 40, 12, GREEDY), (0, 1100, 3, GREEDY), (0, 450, 7, SEEDED),
         (3, 90, 6, GREEDY), (5, 1800, 4, SEEDED), (6, 200, 9, GREEDY), (9, 60, 5, GREEDY)]


def run_orders(device, trace, capacity: int, **kw):  # noqa: F811
    """The trace through a 512-token step (floor 64, chunk 256) on a pool of `capacity` blocks;
    the sequences, the prefill chunks launched and the preemptions."""
    pool = KVBlockPool(device.arena, GEO, capacity)
    runner = TokenPoolRunner(GEO, capacity, 256)
    sched = Scheduler(runner, pool, thread=False, max_step_tokens=512, min_prefill_share=64, **kw)
    seqs, step = {}, 0
    while step < 2000 and (step <= max(t[0] for t in trace) or sched.busy()):
        for i, (at, n, new, sampling) in enumerate(trace):
            if at == step:
                seqs[i] = sched.submit(prompt_of(i, n), new, sampling)
        sched.step()
        step += 1
    assert not sched.busy(), "the engine never went idle"
    preemptions = sched.counters["preemptions"]
    sched.close()
    return [seqs[i] for i in range(len(trace))], runner.prefill_calls, preemptions


def test_the_fair_order_is_unchanged(device):  # noqa: F811
    """Pinned from the scheduler before the order option: each stream's first-token step, the
    chunks launched and the preemptions, on a roomy pool and on one that preempts."""
    pinned = {512: ([14, 4, 16, 1, 8, 0, 11, 5, 4, 16, 8, 9], 85, 0),
              200: ([20, 4, 29, 1, 8, 0, 35, 36, 4, 42, 35, 26], 138, 16)}
    for capacity, want in pinned.items():
        seqs, chunks, preemptions = run_orders(device, MIXED, capacity, prefill_order="fair")
        got = ([s.token_steps[0] for s in seqs], len(chunks), preemptions)
        assert got == want, f"the fair order planned differently ({capacity} blocks)"


def test_tokens_per_stream_are_identical_under_both_orders(device):  # noqa: F811
    """The order changes when each stream's prefill runs, never what it computes: greedy and
    seeded streams, with preemptions reordering the waiting queue under both orders."""
    for capacity in (512, 200):
        runs = {order: run_orders(device, MIXED, capacity, prefill_order=order)
                for order in ("fair", "shortest")}
        for order, (seqs, _, _) in runs.items():
            for i, (seq, (_, n, new, sampling)) in enumerate(zip(seqs, MIXED, strict=True)):
                assert seq.generated == solo(prompt_of(i, n), new, sampling), \
                    f"stream {i} differs from its solo run under {order} ({capacity} blocks)"
        assert capacity == 512 or runs["shortest"][2] > 0, "no preemption under shortest"


def test_shortest_first_gives_prompts_arriving_together_an_earlier_median_first_token(device):  # noqa: F811
    together = [t for t in MIXED if t[0] == 0]
    first = {order: [s.token_steps[0]
                     for s in run_orders(device, together, 512, prefill_order=order)[0]]
             for order in ("fair", "shortest")}
    assert statistics.median(first["shortest"]) < statistics.median(first["fair"]), first
    shortest = min(range(len(together)), key=lambda i: together[i][1])
    assert first["shortest"][shortest] == 0, "the shortest prompt did not go first"


@pytest.mark.parametrize("order", ["fair", "shortest"])
def test_the_oldest_prompt_advances_by_its_floor_every_step_behind_a_stream_of_short_ones(
        device, order):  # noqa: F811
    """A 1,000-token prompt, then a 240-token one every step (budget 256, floor 64): under
    shortest first each short prompt is shorter than what the long one has left and they alone
    would fill every step, yet the long one gets at least its floor each step, so its prefill
    ends within 1000 / 64 steps."""
    pool = KVBlockPool(device.arena, GEO, 512)
    runner = TokenPoolRunner(GEO, 512, 256)
    sched = Scheduler(runner, pool, thread=False, max_step_tokens=256, min_prefill_share=64,
                      prefill_order=order)
    long_ = sched.submit(prompt_of(0, 1000), 2)
    for step in range(16):
        sched.submit(prompt_of(step + 1, 240), 1)
        before = long_.computed
        sched.step()
        if long_.prefilled:
            break
        assert long_.computed - before >= 64, f"step {step}: the oldest prompt got less than its floor"
    assert long_.prefilled, "the oldest prompt's prefill did not end within 1000 / 64 steps"
    while sched.busy():
        sched.step()
    assert long_.generated == solo(prompt_of(0, 1000), 2)
    sched.close()


def test_an_unknown_prefill_order_is_refused(device):  # noqa: F811
    pool = KVBlockPool(device.arena, GEO, 64)
    with pytest.raises(InvalidArgument, match="prefill_order must be fair or shortest"):
        Scheduler(TokenPoolRunner(GEO, 64, 256), pool, thread=False, prefill_order="sjf")
    pool.close()


def test_evicting_the_attention_scratch_resets_the_decode_graph_that_baked_it(device, compiler):  # noqa: F811
    """At a bound of one variant, a batch of 2 evicts the 1-row rung's attention scratch: the
    1-row decode graph is reset before the scratch is freed, then captured again, same tokens."""
    m = PagedDecoderModel(ModelExecutor(device, compiler, variants_per_node=1), CFG, 5,
                          max_batch_size=64, prefill_chunk=32)
    m.load()
    try:
        solo_trace = [(0, prompt_of(1, 9), 6, GREEDY)]
        first, _ = run_trace(m, True, solo_trace)
        plan = m.executor.plans.get(("paged_decode", 1))
        assert plan is not None and plan.graph_exec is not None
        run_trace(m, True, [(0, prompt_of(2, 9), 6, GREEDY), (0, prompt_of(3, 11), 6, GREEDY)])
        assert plan.graph_exec is None, "a graph kept the pointers of a freed attention scratch"
        again, _ = run_trace(m, True, solo_trace)
        assert list(again[0].generated) == list(first[0].generated)
    finally:
        m.executor.close()
        m.close()


def _device_calls_per_step(sched: Scheduler, backend, steps: int) -> list[int]:
    """Backend calls of each of `steps` engine steps: each is a driver call on cuda, and each
    driver call releases the GIL (docs/worker.md, "The GIL between the engine and the edge")."""
    calls = {"n": 0, "depth": 0}
    names = [n for n in dir(type(backend)) if not n.startswith("_")
             and callable(getattr(type(backend), n))]
    originals = {n: getattr(backend, n) for n in names}

    def counted(fn):
        def call(*args, **kwargs):   # the calls into the backend, not the sim's own inside it
            calls["n"] += calls["depth"] == 0
            calls["depth"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                calls["depth"] -= 1
        return call
    for n, fn in originals.items():
        setattr(backend, n, counted(fn))
    try:
        counts = []
        for _ in range(steps):
            calls["n"] = 0
            sched.step()
            counts.append(calls["n"])
        return counts
    finally:
        for n in originals:
            delattr(backend, n)


def test_a_decode_steps_device_calls_do_not_grow_with_the_batch(model):
    """Counted, not timed: the backend calls of a decode-only step at 4 and at 64 streams are
    the same few (the step's inputs in a bounded number of copies, one graph, its events), so
    the GIL hand-offs a step costs the engine thread do not grow with the streams."""
    medians = {}
    for batch in (4, 64):
        sched = engine(model, True)
        seqs = [sched.submit(prompt_of(i, 6), 40) for i in range(batch)]
        while not all(s.generated for s in seqs):    # prompts in, decoding
            sched.step()
        counts = sorted(_device_calls_per_step(sched, model.executor.device.backend, 9))
        medians[batch] = counts[len(counts) // 2]
        while sched.busy():
            sched.step()
        sched.close()
    assert medians[64] == medians[4] and medians[4] <= 10, \
        f"device calls a decode step, by batch: {medians}"
