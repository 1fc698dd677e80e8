"""Embed batching end to end: a sim worker behind a real gRPC server on loopback, concurrent
clients, GetStats' embed_batch counters as the witness of how many batches ran."""
from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider

from gpu_worker.edge.client import WorkerClient
from tests.polling import wait_until

ENCODER = "enc"
WAIT_MS = 200.0   # generous: 2 shared CI cores must still gather a burst of calls
ATOL = 2e-5       # padded vs solo plans: different GEMM shapes, same math


@pytest.fixture(scope="module")
def worker(kernels: pathlib.Path) -> Iterator[WorkerClient]:
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker

    cache_dir = kernels
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=cache_dir, worker_id="batching",
                                         embed_batch_wait_ms=WAIT_MS, embed_max_batch=64,
                                         max_plans=4))
    runtime.start()
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider())
    client = WorkerClient(server.address, deadline_s=120.0)
    client.load_model(ENCODER, "encoder", "tiny", 5)
    try:
        yield client
    finally:
        client.close()
        server.stop(grace=5.0)
        runtime.close()


def _requests(n: int) -> list[list[list[int]]]:
    """Request i: one or two sequences of mixed lengths (1..40 tokens)."""
    return [[[(i * 37 + t * 11) % 1024 for t in range(1 + (i * 7) % 40)]]
            + ([[(i + t) % 1024 for t in range(3 + i % 5)]] if i % 2 else [])
            for i in range(n)]


def _concurrently(calls) -> list:
    barrier = threading.Barrier(len(calls))

    def one(call):
        barrier.wait()
        try:
            return call()
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def _batches(worker: WorkerClient) -> int:
    return worker.stats().embed_batch.batches


def test_concurrent_embeds_run_as_fewer_batches_and_each_gets_its_solo_result(worker) -> None:
    requests = _requests(12)
    solo = [np.stack([worker.embed(ENCODER, [s])[0] for s in r]) for r in requests]
    before = worker.stats().embed_batch
    results = _concurrently([lambda r=r: worker.embed(ENCODER, r) for r in requests])
    after = worker.stats().embed_batch
    for i, (got, want) in enumerate(zip(results, solo, strict=True)):
        assert not isinstance(got, grpc.RpcError), f"request {i} failed: {got}"
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL,
                                   err_msg=f"request {i}: batched result differs from solo")
    ran = after.batches - before.batches
    assert ran < len(requests), f"12 concurrent Embed calls ran as {ran} batches"
    assert after.sequences - before.sequences == sum(map(len, requests))
    assert after.peak_batch_sequences > 1
    assert after.padded_tokens - before.padded_tokens >= after.tokens - before.tokens


def test_mixed_lengths_in_one_request_are_one_batch_with_solo_results(worker) -> None:
    seqs = [[1, 2, 3], list(range(100, 140)), [9], list(range(5, 22))]
    before = _batches(worker)
    got = worker.embed(ENCODER, seqs)
    assert _batches(worker) - before == 1, "one request of mixed lengths is one batch"
    for s, row in zip(seqs, got, strict=True):
        np.testing.assert_allclose(row, worker.embed(ENCODER, [s])[0], rtol=0, atol=ATOL)


def test_one_bad_request_does_not_fail_the_others(worker) -> None:
    good = _requests(6)
    bad = [[[1, 2, 10**6]], [[3], []]]         # out of the vocabulary; an empty sequence
    calls = [lambda r=r: worker.embed(ENCODER, r) for r in good + bad]
    results = _concurrently(calls)
    for i, got in enumerate(results[:len(good)]):
        assert not isinstance(got, grpc.RpcError), f"good request {i} failed: {got}"
        assert got.shape[0] == len(good[i])
    for got in results[len(good):]:
        assert isinstance(got, grpc.RpcError), "a bad request was answered"
        assert got.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_lone_request_is_held_at_most_the_wait_plus_one_batch(worker) -> None:
    seq = [[4, 5, 6, 7]]
    worker.embed(ENCODER, seq)                  # the plan is warm
    started = time.monotonic()
    worker.embed(ENCODER, seq)
    lone = time.monotonic() - started
    assert WAIT_MS / 1000 <= lone, "a lone request did not wait for company at all"
    # one tiny-encoder batch on the sim takes well under a second even on 2 busy cores
    assert lone < WAIT_MS / 1000 + 1.0, f"a lone request took {lone:.3f}s"


def test_a_caller_that_cancels_leaves_without_running_its_rows(worker) -> None:
    before = worker.stats().embed_batch
    with pytest.raises(grpc.RpcError) as caught:
        worker.embed(ENCODER, [[8, 8, 8]], timeout=WAIT_MS / 1000 / 3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: worker.stats().embed_batch.cancelled_requests
                      > before.cancelled_requests,
                      timeout=5.0), "the cancelled request never left the batcher"
    after = worker.stats().embed_batch
    assert after.batches == before.batches, "the cancelled caller's rows ran anyway"
    assert worker.embed(ENCODER, [[8, 8, 8]]).shape[0] == 1, "the batcher still serves"
