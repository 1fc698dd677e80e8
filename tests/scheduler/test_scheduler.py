"""The continuous-batching scheduler on a real KV pool (sim arena) with the token-pool runner
(tests/scheduler/runners.py): streams, joins, cancels, preemption, the queue bound, no stalls."""
from __future__ import annotations

import random
import threading
import time

import pytest

from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.sampling import SamplingParams
from gpu_worker.engines.scheduler.scheduler import Scheduler
from services.common.errors import InvalidArgument, ResourceExhausted
from tests.device.conftest import make_device
from tests.scheduler.runners import TokenPoolRunner, solo

GEO = KVGeometry(layers=2, kv_heads=2, head_dim=16, block_tokens=16, max_context=512)


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()


def make(dev, capacity=512, chunk=32, thread=False, **kw):
    pool = KVBlockPool(dev.arena, GEO, capacity)
    runner = TokenPoolRunner(GEO, capacity, chunk)
    return Scheduler(runner, pool, thread=thread, **kw), runner, pool


def drain(sched: Scheduler, limit: int = 10_000) -> int:
    steps = 0
    while sched.busy() and steps < limit:
        sched.step()
        steps += 1
    assert not sched.busy(), "the scheduler never finished"
    return steps


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 31 + k * 7) % 1000 for k in range(n)]


def test_sixteen_concurrent_streams_each_get_the_tokens_they_get_alone(dev):
    sched, runner, pool = make(dev, thread=True)
    try:
        prompts = [prompt_of(i, 5 + 9 * i) for i in range(16)]
        seqs = [None] * 16
        outs: list[list[int] | None] = [None] * 16

        def client(i):
            seqs[i] = sched.submit(prompts[i], 20 + i)
            outs[i] = list(seqs[i].stream())
        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for i in range(16):
            assert outs[i] == solo(prompts[i], 20 + i), f"stream {i} differs from its solo run"
            assert seqs[i].finish_reason == "length"
        assert max(runner.decode_batches) > 1, "the streams were never batched"
        assert pool.used_blocks() == 0
    finally:
        sched.close()


def test_a_request_arriving_mid_batch_joins_at_the_next_step(dev):
    sched, _, _ = make(dev)
    a = sched.submit(prompt_of(1, 10), 30)
    for _ in range(5):
        sched.step()
    b = sched.submit(prompt_of(2, 10), 5)
    steps_before = sched.counters["steps"]
    sched.step()
    assert b.admitted_step == steps_before, "the new request did not join at the next step"
    sched.step()     # overlapped: a step's tokens are read back after the next one is launched
    assert b.token_steps[0] == steps_before      # its prompt fits one chunk: first token at once
    assert steps_before in a.token_steps         # and the running stream advanced in that step
    drain(sched)
    assert list(a.stream()) == solo(prompt_of(1, 10), 30)
    assert list(b.stream()) == solo(prompt_of(2, 10), 5)
    sched.close()


def test_a_cancel_frees_the_sequence_blocks_within_one_step(dev):
    sched, _, pool = make(dev)
    keep = sched.submit(prompt_of(1, 40), 50)
    gone = sched.submit(prompt_of(2, 100), 50)
    for _ in range(6):
        sched.step()
    held = len(gone.table.blocks)
    assert held > 0
    used = pool.used_blocks()
    gone.cancel()
    sched.step()
    assert gone.state == "finished" and gone.finish_reason == "cancelled"
    assert gone.table.blocks == [] and pool.used_blocks() <= used - held + 1
    drain(sched)
    assert pool.used_blocks() == 0
    assert list(keep.stream()) == solo(prompt_of(1, 40), 50)
    sched.close()


def test_a_passed_deadline_cancels_within_one_step(dev):
    sched, _, pool = make(dev)
    seq = sched.submit(prompt_of(1, 20), 100, deadline=time.monotonic() + 0.05)
    sched.step()
    time.sleep(0.06)
    sched.step()
    assert seq.finish_reason == "cancelled" and pool.used_blocks() == 0
    sched.close()


def test_preemption_under_a_tiny_pool_keeps_every_stream_identical_to_its_unconstrained_run(dev):
    # 12 blocks of 16 tokens for 6 sequences that need up to 6 blocks each: preemption must happen
    sched, _, pool = make(dev, capacity=12, chunk=16)
    prompts = [prompt_of(i, 20 + 7 * i) for i in range(6)]
    seqs = [sched.submit(p, 40) for p in prompts]
    drain(sched)
    assert sched.counters["preemptions"] > 0, "the pool was not small enough to preempt"
    for p, s in zip(prompts, seqs, strict=True):
        assert list(s.stream()) == solo(p, 40)
    assert pool.used_blocks() == 0
    sched.close()


def test_preempted_seeded_sampling_resumes_with_the_same_tokens(dev):
    sched, _, _ = make(dev, capacity=10, chunk=16)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i) for i in range(5)]
    prompts = [prompt_of(i, 30) for i in range(5)]
    seqs = [sched.submit(p, 40, s) for p, s in zip(prompts, params, strict=True)]
    drain(sched)
    assert sched.counters["preemptions"] > 0
    for p, s, q in zip(prompts, seqs, params, strict=True):
        assert list(s.stream()) == solo(p, 40, q)
    sched.close()


def test_the_queue_bound_answers_resource_exhausted_and_changes_nothing(dev):
    sched, _, pool = make(dev, max_queued=3)
    seqs = [sched.submit(prompt_of(i, 10), 5) for i in range(3)]
    before = (sched.stats(), pool.used_blocks())
    with pytest.raises(ResourceExhausted):
        sched.submit(prompt_of(9, 10), 5)
    after = sched.stats()
    assert after["waiting"] == 3 and after["rejected"] == 1
    assert {k: v for k, v in after.items() if k != "rejected"} == \
        {k: v for k, v in before[0].items() if k != "rejected"}
    assert pool.used_blocks() == before[1]
    drain(sched)
    for i, s in enumerate(seqs):
        assert list(s.stream()) == solo(prompt_of(i, 10), 5), "an accepted stream lost tokens"
    sched.close()


def test_no_decoding_stream_stalls_more_than_one_chunk_behind_a_long_prompt(dev):
    sched, runner, _ = make(dev, chunk=32, max_step_tokens=64)
    short = sched.submit(prompt_of(1, 8), 40)
    sched.step()
    sched.step()
    long = sched.submit(prompt_of(2, 400), 4)    # 13 chunks of 32
    drain(sched)
    steps = short.token_steps
    assert steps == list(range(steps[0], steps[0] + len(steps))), \
        f"the short stream skipped steps while the long prompt prefilled: {steps}"
    assert max(runner.prefill_calls) <= 32, "a step ran more than one chunk of a prompt"
    assert long.token_steps[0] - long.admitted_step == 12, "the long prompt was not chunked"
    assert list(long.stream()) == solo(prompt_of(2, 400), 4)
    sched.close()


def test_the_batch_is_capped_by_max_batch_size(dev):
    sched, runner, _ = make(dev, max_batch_size=4)
    for i in range(10):
        sched.submit(prompt_of(i, 5), 10)
    drain(sched)
    assert max(runner.decode_batches) == 4 and sched.counters["peak_batch_size"] == 4
    sched.close()


def test_a_stop_token_ends_the_stream_with_finish_reason_stop(dev):
    want = solo(prompt_of(3, 12), 10)
    sched, _, _ = make(dev)
    seq = sched.submit(prompt_of(3, 12), 10, SamplingParams(stop_token_ids=(want[4],)))
    drain(sched)
    assert list(seq.stream()) == want[:want.index(want[4]) + 1] and seq.finish_reason == "stop"
    sched.close()


def test_a_fuzz_of_concurrent_starts_and_cancels_never_leaks_a_block(dev):
    sched, _, pool = make(dev, capacity=40, chunk=16, thread=True)
    rng = random.Random(7)
    errors: list[BaseException] = []

    def client(i):
        r = random.Random(i)
        try:
            seq = sched.submit(prompt_of(i, r.randint(1, 60)), r.randint(1, 60))
            it = seq.stream()
            for k, _ in enumerate(it):
                if r.random() < 0.05:
                    it.close()      # the client goes away mid-stream
                    break
        except ResourceExhausted:
            pass
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        time.sleep(rng.random() * 0.002)
        t.start()
    for t in threads:
        t.join(60)
    deadline = time.monotonic() + 10
    while sched.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not errors, errors
    assert not sched.busy() and pool.used_blocks() == 0, "a block leaked"
    sched.close()


def test_a_request_larger_than_the_pool_is_refused_at_submit(dev):
    sched, _, _ = make(dev, capacity=4)
    with pytest.raises(ResourceExhausted):
        sched.submit(prompt_of(1, 60), 10)
    with pytest.raises(InvalidArgument):
        sched.submit([], 10)
    sched.close()


def test_unloading_fails_waiting_streams_with_failed_precondition(dev):
    from services.common.errors import FailedPrecondition
    sched, _, _ = make(dev)
    seq = sched.submit(prompt_of(1, 5), 5)
    sched.close()
    with pytest.raises(FailedPrecondition):
        list(seq.stream())


def test_a_step_budget_below_the_batch_size_is_refused(dev):
    # a full batch of decodes would leave a prefilling member no tokens: it would starve
    pool = KVBlockPool(dev.arena, GEO, 16)
    with pytest.raises(InvalidArgument):
        Scheduler(TokenPoolRunner(GEO, 16, 16), pool, max_batch_size=8, max_step_tokens=4,
                  thread=False)
    pool.close()
