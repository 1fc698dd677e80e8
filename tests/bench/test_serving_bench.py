"""bench/serving_bench.py's open-loop mode on CPU: the arrival trace is seeded, Poisson with the
asked mean, and the one list of requests both sides replay; requests are sent at their arrival
times whatever is still in flight, and the TTFT target counts only the steady state."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import threading

import pytest

from bench import serving_bench as sb


def lengths(prompt=(128, 2048), new=(64, 512)) -> argparse.Namespace:
    return argparse.Namespace(prompt_range=prompt, new_range=new)


def test_the_arrival_trace_is_seeded_the_same_for_every_call_and_changes_with_the_seed():
    a = sb.arrival_trace(200, 2.0, lengths(), seed=0)
    assert a == sb.arrival_trace(200, 2.0, lengths(), seed=0), "same seed, same trace"
    assert a != sb.arrival_trace(200, 2.0, lengths(), seed=1), "the seed does not change it"
    times = [t for t, _, _ in a]
    assert times == sorted(times) and times[0] > 0, "arrivals in order, after the start"
    assert all(128 <= n <= 2048 and 64 <= new <= 512 for _, n, new in a), "lengths out of range"
    requests = sb.materialize(a, 1000)
    assert requests == sb.materialize(a, 1000), "the prompts are deterministic"
    assert [(t, len(p), new) for t, p, new in requests] == a
    heads = {tuple(p[:16]) for _, p, _ in requests}
    assert len(heads) == len(requests), \
        "two requests share a first KV block: the prefix cache would serve one from the other"


def test_arrivals_are_poisson_with_the_given_mean():
    rate, n = 4.0, 20000
    times = [t for t, _, _ in sb.arrival_trace(n, rate, lengths(), seed=3)]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = statistics.fmean(gaps)
    # standard error of the mean of n exponential gaps: (1/rate)/sqrt(n) = 0.7 %; allow 5 sigma
    assert mean == pytest.approx(1 / rate, rel=5 / math.sqrt(n)), f"mean gap {mean}"
    # exponential: the standard deviation equals the mean, P(gap > mean) = 1/e
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.05), "not exponential gaps"
    above = sum(g > 1 / rate for g in gaps) / n
    assert above == pytest.approx(math.exp(-1), abs=0.02), f"P(gap > mean) = {above}"
    # Poisson counts: per-second counts have mean = variance = rate (dispersion index 1)
    counts = [0] * int(times[-1])
    for t in times:
        if int(t) < len(counts):
            counts[int(t)] += 1
    assert statistics.fmean(counts) == pytest.approx(rate, rel=0.05)
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1, abs=0.1)


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_a_rate_that_is_not_positive_is_refused(rate):
    with pytest.raises(ValueError, match="--arrival-rate"):
        sb.arrival_trace(5, rate, lengths(), seed=0)


class _Message:
    def __init__(self, tokens, done=False, reason=""):
        self.tokens, self.done, self.finish_reason = tokens, done, reason


class FakeClient:
    """Records every Generate it is sent (virtual time, prompt, new); each stream yields its
    tokens at once, except the stream of `hold` (a request index), which waits for `release`."""

    def __init__(self, clock, requests, hold=None):
        self.clock, self.requests, self.hold = clock, requests, hold
        self.sent: list[tuple[float, list[int], int]] = []
        self.release = threading.Event()
        self.lock = threading.Lock()

    def generate_stream(self, model, prompt, new, timeout=None):
        with self.lock:
            self.sent.append((self.clock(), list(prompt), new))
            index = len(self.sent) - 1
        if index == self.hold:
            assert self.release.wait(60), "a later request was never sent: closed loop"
        yield _Message(list(range(new)))
        yield _Message([], done=True, reason="length")


class VirtualClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_requests_are_sent_at_their_arrival_times_the_trace_as_given():
    args = lengths((4, 12), (2, 6))
    requests = sb.materialize(sb.arrival_trace(25, 5.0, args, seed=2), 1000)
    clock = VirtualClock()
    client = FakeClient(clock, requests)
    r = sb.run_arrivals(client, requests, clock=clock, sleep=clock.sleep)
    sent = sorted(client.sent)
    assert [(p, n) for _, p, n in sent] == [(p, n) for _, p, n in requests], \
        "gpuplane was not sent the trace's requests in arrival order"
    assert [t - 100.0 for t, _, _ in sent] == pytest.approx([a for a, _, _ in requests]), \
        "a request was sent before or after its arrival time"
    assert r["lost"] == 0 and r["tokens"] == sum(n for _, _, n in requests)


def test_the_open_loop_does_not_wait_for_earlier_requests_and_ttft_counts_from_arrival():
    requests = [(0.0, [1, 2], 3), (0.001, [3, 4], 3), (0.002, [5], 2)]
    client = FakeClient(None, requests, hold=0)
    client.clock = lambda: 0.0
    original = client.generate_stream

    def stream(model, prompt, new, timeout=None):
        if len(client.sent) == 2:        # a later request is sent while the first still waits
            client.release.set()
        yield from original(model, prompt, new, timeout)
    client.generate_stream = stream
    r = sb.run_arrivals(client, requests)
    assert r["lost"] == 0 and len(r["ttft"]) == 3
    assert all(t >= 0 for t in r["ttft"]), "TTFT before the request's arrival"
    assert r["peak_in_flight"] >= 2, "requests did not overlap: not an open loop"


def test_the_ttft_target_counts_only_requests_after_the_warm_up():
    run = {"ttft": [9.0, 8.0, 0.1, 0.2], "arrival": [0.5, 1.5, 2.0, 3.0]}
    assert sb.steady(run, 2.0) == [0.1, 0.2]


def test_the_peer_replays_the_very_list_gpuplane_was_sent(monkeypatch):
    requests = sb.materialize(sb.arrival_trace(10, 3.0, lengths((4, 9), (2, 5)), seed=0), 500)
    seen = {}

    class Recorder:
        def __init__(self, model, slots):
            seen["slots"] = slots

        def run_arrivals(self, given):
            seen["requests"] = given
            return {"ttft": [], "tpot": [], "arrival": [], "rate": 0.0}

        def release(self):
            seen["released"] = True

    monkeypatch.setattr(sb.bench_peer, "PeerServer", Recorder)
    sb.peer_arrivals(object(), requests, 64)
    assert seen["requests"] is requests and seen["slots"] == 64 and seen["released"]
    clock = VirtualClock()
    client = FakeClient(clock, requests)
    sb.run_arrivals(client, requests, clock=clock, sleep=clock.sleep)
    assert [(p, n) for _, p, n in sorted(client.sent)] == [(p, n) for _, p, n in requests]


def test_burst_prompts_are_their_own_per_trial_stream_and_request_and_the_same_for_both_sides():
    """Equal lengths and repeated trials must not meet the worker's prefix cache (the peer has
    none): every burst prompt differs from its first block on; the peer replays the same lists."""
    jobs = [[(64, 4), (64, 4)], [(64, 4)], [(32, 2)]]
    trials = [sb.burst_work(jobs, 1000, t) for t in range(3)]
    firsts = [tuple(p[:16]) for w in trials for stream in w for p, _ in stream]
    assert len(set(firsts)) == len(firsts), "two burst prompts share their first block"
    assert sb.burst_work(jobs, 1000, 1) == trials[1], "the peer would get other prompts"
    assert [[(len(p), new) for p, new in stream] for stream in trials[0]] == jobs


def test_engine_time_splits_a_trial_into_steps_host_wait_and_device():
    from types import SimpleNamespace as NS
    zero = {f: 0 for f in ("steps", "prefill_tokens", "decode_tokens", "step_host_us",
                           "step_wait_us", "step_device_us")}
    after = NS(**{**zero, "steps": 100, "prefill_tokens": 150_000, "decode_tokens": 6_400,
                  "step_host_us": 200_000, "step_wait_us": 1_800_000, "step_device_us": 1_500_000})
    line = sb.engine_time(NS(**zero), after, wall=3.0)
    assert "100 steps, 1500 prefill + 64.0 decode tokens a step" in line, line
    assert "2.00 ms host + 18.00 ms wait, device 15.00 ms" in line, line
    assert "device busy 50% of the wall" in line, line
    assert sb.engine_time(after, after, 1.0) == "engine: no steps"


def test_step_costs_fit_only_the_steps_of_the_level(tmp_path):
    from bench.serving_bench import step_costs
    path = tmp_path / "steps.jsonl"
    lines = []
    for step in range(60):
        decode, chunks = (8 + step % 5, [] if step % 3 else [100 + step])
        us = 3000 + 100 * decode + 9000 * len(chunks) + 25 * sum(chunks)
        if step < 20:
            us *= 10          # another level's steps: outside the range, they must not count
        lines.append(json.dumps({"model": "m", "step": step, "decode_rows": decode,
                                 "chunks": chunks, "device_us": us, "host_us": 1, "wait_us": 1}))
    path.write_text("\n".join(lines) + "\n")
    line = step_costs(path, 20, 60)
    assert line.startswith("step trace: 40 steps, 13 prefill chunks; fit (R² 1.00)"), line
    assert "per_chunk 9.000 ms" in line and "per_prefill_row 0.025 ms" in line, line
    assert "too few" in step_costs(path, 55, 60)
