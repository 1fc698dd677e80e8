"""Continuous batching on the real device: concurrent streams through the runtime's scheduler
equal their solo streams, and the decode ladder's graphs stay warm across requests under the
default plan bound (amendment 31; the sim twins are in tests/worker/test_batching.py and
tests/execution/test_runtime.py). Run on the GPU machine:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_batching.py
"""
from __future__ import annotations

import threading

import pytest

from gpu_worker import WorkerConfig, WorkerRuntime

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


def mixed_round(rt: WorkerRuntime) -> list[tuple[list[int], str]]:
    """Greedy and seeded streams with stop ids and max_new_tokens hitting at different steps,
    all queued at once (the engine batches them), drained concurrently."""
    from gpu_worker.engines.scheduler.sampling import SamplingParams

    specs = []
    for i in range(STREAMS):
        seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=100 + i)
        sampling = seeded if i % 2 else SamplingParams()
        if i % 3 == 0:   # a stop id this stream produces (its token at step 3 + i of a free run)
            free = [c[0] for c in rt.generate("m", prompt_of(i), 24, sampling=sampling)]
            sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k,
                                      sampling.seed, stop_token_ids=(free[3 + i],))
        specs.append((prompt_of(i), 10 + 2 * i, sampling))
    streams = [rt.generate("m", p, n, sampling=s) for p, n, s in specs]
    out: list[tuple[list[int], str]] = [([], "")] * STREAMS

    def drain(i: int) -> None:
        tokens = [c[0] for c in streams[i]]
        out[i] = (tokens, streams[i].seq.finish_reason)
    threads = [threading.Thread(target=drain, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def test_on_cuda_overlapped_steps_give_the_same_tokens_as_serial_ones(runtime) -> None:
    """Overlap (step n+1 launched before step n is read back, tokens fed on the device, pinned
    readback and an event per step) against serial steps, same engine, same streams."""
    sched = runtime._get("m").scheduler
    assert sched.overlap, "the engine's default is overlapped steps"
    overlapped = mixed_round(runtime)
    before = sched.stats()
    sched.overlap = False
    try:
        assert sched.wait_idle(60)
        serial = mixed_round(runtime)
    finally:
        sched.overlap = True
    assert overlapped == serial, "overlapped steps gave different tokens from serial ones"
    reasons = {reason for _, reason in serial}
    assert {"stop", "length"} <= reasons, f"the round did not hit both stops: {reasons}"
    after = sched.stats()
    assert after["step_device_us"] > before["step_device_us"] > 0, "no device time was measured"
    assert runtime.stats()["arena"]["faults"] == 0


def test_on_cuda_dependent_launches_give_the_same_tokens_as_serialized_ones(runtime,
                                                                           tmp_path) -> None:
    """The decode and prefill graphs captured with programmatic dependent launch (every kernel
    waits for its predecessor itself: gpuplane_common.cuh) against a worker whose launches are
    all serialized: same streams, same tokens, bit for bit (the int4 kernels are deterministic)."""
    assert runtime.device.dependent_launch, "sm_90's default is dependent launch on"
    overlapped = mixed_round(runtime)
    serial_rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=tmp_path,
                                           dependent_launch=False)).start()
    try:
        assert not serial_rt.device.dependent_launch
        serial_rt.load_model("m", "decoder", "small", 3)
        serialized = mixed_round(serial_rt)
    finally:
        serial_rt.close()
    assert overlapped == serialized, "dependent launches gave different tokens"
