"""Continuous batching on the real device: concurrent streams through the runtime's scheduler
equal their solo streams, and the decode ladder's graphs stay warm across requests under the
default plan bound (amendment 31; the sim twins are in tests/worker/test_batching.py and
tests/execution/test_runtime.py). Run on the GPU machine:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_batching.py
"""
from __future__ import annotations

import threading

import pytest

from gpu_worker.core.runtime import WorkerConfig, WorkerRuntime

pytestmark = pytest.mark.gpu

STREAMS = 8
NEW_TOKENS = 12


def prompt_of(i: int) -> list[int]:
    return [(i * 37 + k * 11 + 1) % 1000 for k in range(20 + 9 * i)]   # 20..83 tokens


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    rt = WorkerRuntime(WorkerConfig(backend="cuda",
                                    cache_dir=tmp_path_factory.mktemp("nvrtc-gpu-batching"))).start()
    rt.load_model("m", "decoder", "small", 3)
    yield rt
    rt.close()


def concurrently(rt: WorkerRuntime) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(STREAMS)]
    streams = [rt.generate("m", prompt_of(i), NEW_TOKENS) for i in range(STREAMS)]  # queued now

    def drain(i: int) -> None:
        out[i] = [c[0] for c in streams[i]]
    threads = [threading.Thread(target=drain, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def test_on_cuda_concurrent_streams_equal_their_solo_streams_and_the_decode_graphs_stay_warm(
        runtime) -> None:
    solo = [[c[0] for c in runtime.generate("m", prompt_of(i), NEW_TOKENS)] for i in range(STREAMS)]
    assert concurrently(runtime) == solo, "a batched stream differs from its solo run"
    plans = runtime._get("m").executor.plans
    keys = plans.keys()
    warm = {k for k in keys if k[0] == "paged_decode"}
    assert concurrently(runtime) == solo
    assert warm <= set(plans.keys()), "a decode graph was evicted between identical rounds"
    stats = runtime.stats()
    assert stats["arena"]["faults"] == 0 and stats["scheduler"]["peak_batch_size"] > 1
