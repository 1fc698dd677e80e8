"""EmbedBatcher on its own (no model, no device): a fake `run` that records every batch and
answers each sequence with a vector derived from it, so ownership of rows is checkable."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gpu_worker.engines.embed_batcher import Cancelled, EmbedBatcher, EmbedBatchStats
from services.common.errors import ResourceExhausted


def _vector(seq: list[int]) -> np.ndarray:
    return np.array([len(seq), sum(seq), seq[0]], np.float32)


class FakeEncoder:
    def __init__(self, seconds: float = 0.0, fail_on: int | None = None) -> None:
        self.batches: list[list[list[int]]] = []
        self.seconds, self.fail_on = seconds, fail_on
        self.lock = threading.Lock()

    def __call__(self, sequences: list[list[int]]) -> np.ndarray:
        with self.lock:   # one batch at a time, as the model lock makes it
            self.batches.append(sequences)
            time.sleep(self.seconds)
            if self.fail_on is not None and any(s[0] == self.fail_on for s in sequences):
                raise ResourceExhausted("the device refused this batch")
            return np.stack([_vector(s) for s in sequences])


def _batcher(run, wait_s=0.2, max_batch=64, max_tokens=10**6, padded=None) -> EmbedBatcher:
    padded = padded or (lambda count, longest: count * longest)
    return EmbedBatcher(run, padded, EmbedBatchStats(), wait_s, max_batch, max_tokens)


def _concurrently(calls) -> list:
    """Run the calls at (nearly) the same moment; results or exceptions, in order."""
    barrier = threading.Barrier(len(calls))

    def one(call):
        barrier.wait()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def test_concurrent_requests_share_batches_and_each_gets_its_own_rows() -> None:
    run = FakeEncoder()
    b = _batcher(run)
    requests = [[[i + 1] * (i % 5 + 1), [100 + i, 7]] for i in range(16)]
    results = _concurrently([lambda r=r: b.submit(r) for r in requests])
    for req, got in zip(requests, results, strict=True):
        np.testing.assert_array_equal(got, np.stack([_vector(s) for s in req]))
    assert len(run.batches) < len(requests), f"{len(run.batches)} batches for 16 requests"
    assert b.stats.snapshot()["sequences"] == 32 and b.stats.snapshot()["requests"] == 16


def test_a_batch_never_exceeds_max_batch_or_max_tokens_and_a_request_may_span_batches() -> None:
    run = FakeEncoder()
    b = _batcher(run, wait_s=0.0, max_batch=4, max_tokens=40)
    req = [[1] * n for n in (3, 3, 3, 3, 3, 12, 12, 30, 2)]
    np.testing.assert_array_equal(b.submit(req), np.stack([_vector(s) for s in req]))
    for batch in run.batches:
        assert len(batch) <= 4
        assert len(batch) == 1 or len(batch) * max(map(len, batch)) <= 40, batch
    assert [s for batch in run.batches for s in batch] == req, "rows out of order (not FCFS)"


def test_a_lone_request_waits_at_most_the_wait_then_runs() -> None:
    run = FakeEncoder(seconds=0.05)
    b = _batcher(run, wait_s=0.15)
    started = time.monotonic()
    b.submit([[1, 2, 3]])
    elapsed = time.monotonic() - started
    # slack for a loaded 2-core CI machine; a batcher that waited for company would never return
    assert 0.15 <= elapsed < 0.15 + 0.05 + 0.4, f"lone request took {elapsed:.3f}s"


def test_a_request_arriving_during_a_batch_waits_at_most_that_batch_plus_its_own() -> None:
    run = FakeEncoder(seconds=0.3)
    b = _batcher(run, wait_s=0.05)
    first = threading.Thread(target=b.submit, args=([[1]],))
    first.start()
    time.sleep(0.1)                      # the first batch is running now
    started = time.monotonic()
    b.submit([[2]])
    elapsed = time.monotonic() - started
    first.join()
    # slack below one more batch (0.3 s), so holding it behind another batch still fails
    assert elapsed < 0.3 + 0.3 + 0.25, f"held {elapsed:.3f}s: more than the running batch + its own"
    assert len(run.batches) == 2


def test_a_failing_batch_fails_only_its_callers() -> None:
    run = FakeEncoder(fail_on=13)
    b = _batcher(run, wait_s=0.0, max_batch=1)   # one sequence per batch: failures are separate
    results = _concurrently([lambda i=i: b.submit([[i, 1]]) for i in range(10, 16)])
    for i, got in zip(range(10, 16), results, strict=True):
        if i == 13:
            assert isinstance(got, ResourceExhausted), got
        else:
            np.testing.assert_array_equal(got, _vector([i, 1])[None])


def test_a_cancelled_caller_leaves_the_queue_and_the_others_complete() -> None:
    run = FakeEncoder()
    b = _batcher(run, wait_s=0.5)
    gone = threading.Event()
    results: dict[str, object] = {}

    def leaver():
        try:
            results["leaver"] = b.submit([[666] * 3], cancelled=gone.is_set)
        except Cancelled as exc:
            results["leaver"] = exc

    t = threading.Thread(target=leaver)
    t.start()
    time.sleep(0.05)
    stayer = threading.Thread(target=lambda: results.setdefault("stayer", b.submit([[5, 5]])))
    stayer.start()
    time.sleep(0.05)
    gone.set()                      # cancels while both wait for company
    t.join(2)
    stayer.join(2)
    assert isinstance(results["leaver"], Cancelled)
    np.testing.assert_array_equal(results["stayer"], _vector([5, 5])[None])
    assert all(s[0] != 666 for batch in run.batches for s in batch), "a cancelled row ran"
    assert b.stats.snapshot()["cancelled_requests"] == 1


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        _batcher(FakeEncoder(), max_batch=0)
    with pytest.raises(ValueError):
        _batcher(FakeEncoder(), wait_s=-1)


def test_histogram_counts_batches_by_sequences() -> None:
    stats = EmbedBatchStats()
    for n in (1, 3, 3, 64):
        stats.record_batch([5] * n, 8 * n)
    buckets, total = stats.histogram()
    cumulative = dict(buckets)
    assert cumulative["1.0"] == 1 and cumulative["4.0"] == 3 and cumulative["64.0"] == 4
    assert cumulative["+Inf"] == 4 and total == 71
    assert stats.snapshot()["peak_batch_sequences"] == 64
