"""The prefix cache through WorkerService on the sim backend (real gRPC on loopback, the real
paged decoder): shared prefixes prefill only their suffixes, tokens as with the cache off and as
the reference decoder's, stats and metrics report it, --no-prefix-cache turns it off."""
from __future__ import annotations

import random
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from gpu_worker.edge.client import WorkerClient
from gpu_worker.edge.metrics import WorkerCollector
from gpu_worker.models.configs import get_config
from gpu_worker.models.reference import DecoderReference
from gpu_worker.models.weights import load_host

CFG = get_config("tiny", "decoder")
SEED = 7
MODEL = "dec"
PREFIX = 512


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


def start_worker(cache_dir, **config):
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=cache_dir, **config)).start()
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider(), max_workers=48)
    client = WorkerClient(server.address, deadline_s=120.0)
    client.load_model(MODEL, "decoder", "tiny", SEED)
    return runtime, server, client


@pytest.fixture(scope="module", params=[True, False], ids=["cache-on", "cache-off"])
def worker(request, kernels):
    runtime, server, client = start_worker(kernels, prefix_cache=request.param)
    yield request.param, runtime, client
    client.close()
    server.stop(grace=5.0)


def concurrently(calls):
    out: list = [None] * len(calls)

    def run(i):
        out[i] = calls[i]()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


PROMPTS = [toks(1, PREFIX) + toks(100 + i, 5 + 3 * i) for i in range(16)]
NEW = 6


@pytest.fixture(scope="module")
def reference():
    ref = DecoderReference(CFG, load_host(CFG, SEED))
    return [ref.generate(p, NEW) for p in PROMPTS]


def test_fifteen_streams_sharing_a_prefilled_512_token_prefix_prefill_only_their_suffixes(
        worker, reference):
    on, _, client = worker
    first = client.generate(MODEL, PROMPTS[0], NEW)
    before = client.stats().scheduler
    results = concurrently([lambda p=p: client.generate(MODEL, p, NEW) for p in PROMPTS[1:]])
    after = client.stats().scheduler
    assert [first.tokens] + [r.tokens for r in results] == reference, \
        f"tokens differ from the reference decoder with the prefix cache {'on' if on else 'off'}"
    hit = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    prefilled = after.prefill_tokens - before.prefill_tokens
    suffixes = sum(len(p) - PREFIX for p in PROMPTS[1:])
    if on:
        assert hit == 15 * PREFIX, f"hit {hit} tokens, not 15 x {PREFIX}"
        assert prefilled == suffixes, "a stream prefilled more than its suffix"
        assert after.kv_blocks_cached > 0 and after.kv_blocks_used == 0
    else:
        assert hit == 0 and after.prefix_cache_queried_tokens == 0 and after.kv_blocks_cached == 0
        assert prefilled == sum(len(p) for p in PROMPTS[1:])
    assert after.kv_swapped_out_blocks == after.kv_swapped_in_blocks == 0
    assert client.stats().arena.faults == 0, "the ledger left the device's truth"


def test_the_prefix_cache_counters_are_prometheus_counters(worker):
    _, runtime, client = worker
    registry = CollectorRegistry()
    registry.register(WorkerCollector(runtime))
    text = generate_latest(registry).decode()
    s = client.stats().scheduler
    assert f"gpuplane:prefix_cache_hit_tokens_total {float(s.prefix_cache_hit_tokens)}" in text
    assert "# TYPE gpuplane:prefix_cache_queried_tokens_total counter" in text
    assert f"gpuplane:kv_blocks_cached {float(s.kv_blocks_cached)}" in text
    assert "gpuplane_worker_scheduler_kv_blocks_cached" in text
