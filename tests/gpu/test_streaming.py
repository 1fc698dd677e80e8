"""Streaming through a weight budget on the real device (issue 14): captured segments replay
while the next segment pages in on the copy stream, and the tokens equal the unconstrained run
on the same device. Run on the GPU machine:

    .venv/bin/python -m pytest -m gpu tests/gpu/test_streaming.py
    compute-sanitizer --tool memcheck .venv/bin/python -m pytest -m gpu tests/gpu/test_streaming.py
"""
from __future__ import annotations

import pytest

from gpu_worker import WorkerConfig, WorkerRuntime

pytestmark = pytest.mark.gpu

MIB = 1 << 20
BUDGET = 12 * MIB       # `small`: 23.8 MiB of weights, streaming floor 12 MiB
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def kernel_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc-cache-gpu-streaming")


def run(cache_dir, budget: int | None, capture: bool, governor: str | None = None
        ) -> tuple[list[int], dict]:
    rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=cache_dir, capture=capture,
                                    weight_budget_bytes=budget, governor=governor)).start()
    try:
        rt.load_model("m", "decoder", "small", 2)
        tokens = [c[0] for c in rt.generate("m", PROMPT, NEW_TOKENS)]
        again = [c[0] for c in rt.generate("m", PROMPT, NEW_TOKENS)]
        assert again == tokens, "a second request (replays of captured segments) differs"
        rt.device.synchronize()
        rt.device.synchronize(rt.device.copy_stream)
        rt.device.arena.collect()
        stats = {"streams": rt._get("m").executor.streams(), "weights": rt.device.weights.stats(),
                 "faults": rt.stats()["arena"]["faults"],
                 "unaccounted": abs(rt.device.unaccounted_bytes()),
                 "tolerance": rt.device.unaccounted_tolerance()}
        return tokens, stats
    finally:
        rt.close()


@pytest.mark.parametrize("capture", [True, False], ids=["captured", "eager"])
def test_a_decoder_larger_than_its_budget_matches_the_unconstrained_run_on_cuda(
        kernel_cache_dir, capture):
    want, free = run(kernel_cache_dir, None, capture=True)
    assert not free["streams"]
    got, stats = run(kernel_cache_dir, BUDGET, capture)
    assert stats["streams"] and stats["weights"]["evictions"] > 0
    assert got == want
    assert 0 < stats["weights"]["peak_committed_bytes"] <= BUDGET
    assert stats["faults"] == 0 and stats["unaccounted"] <= stats["tolerance"]


def test_a_decoder_larger_than_the_governors_weights_cap_matches_the_unconstrained_run_on_cuda(
        kernel_cache_dir, tmp_path):
    """The same, with the budget coming from a governor's weights zone cap (lending off) and no
    flag: on the device the lease also bounds releases in flight, so page-ins wait for fences."""
    from opentelemetry.sdk.trace import TracerProvider

    from services.governor.policy import Policy
    from services.governor.server import start_governor
    want, _ = run(kernel_cache_dir, None, capture=True)
    server, _ = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite",
                               Policy(zone_budgets={"weights": BUDGET}, lending=False),
                               tracer_provider=TracerProvider())
    try:
        got, stats = run(kernel_cache_dir, None, True, governor=server.address)
    finally:
        server.stop(grace=0)
    assert stats["streams"] and got == want
    assert 0 < stats["weights"]["peak_committed_bytes"] <= BUDGET
    assert stats["faults"] == 0 and stats["unaccounted"] <= stats["tolerance"]
