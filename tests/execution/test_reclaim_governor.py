"""Issue 14 with a real governor on loopback: the weights zone cap it grants is shared by several
models through paging, and its reclaim asks are answered by the worker's reclaim order."""
from __future__ import annotations

import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider

from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from gpu_worker.runtime import WorkerConfig, WorkerRuntime
from services.governor.policy import Policy
from services.governor.server import start_governor

MIB = 1 << 20
CAP = 40 * MIB
PROMPT = [3, 1, 4, 1, 5, 9]
NEW_TOKENS = 3


def serve(tmp_path, **policy):
    return start_governor("127.0.0.1:0", tmp_path / "gov.sqlite", Policy(**policy),
                          tracer_provider=TracerProvider())


def leased(ledger, worker_id: str, zone: str) -> int:
    return sum(lease.bytes for lease in ledger.leases_of(worker_id) if lease.zone == zone)


def test_three_small_decoders_share_a_40_mib_weights_cap_from_the_governor(
        tmp_path, kernel_cache_dir):
    """Each `small` decoder has 23.8 MiB of weights: two never fit under the cap together. All
    three load (the idle ones page out instead of the load being refused) and serve, each stream
    identical to the uncapped reference run, with resident weights and the governor's weights
    lease never above the cap."""
    server, ledger = serve(tmp_path, zone_budgets={"weights": CAP}, lending=False)
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    governor=server.address, worker_id="capped")).start()
    cfg = CONFIGS["small"]
    want = {s: R.DecoderReference(cfg, W.load_host(cfg, s)).generate(PROMPT, NEW_TOKENS)
            for s in (1, 2, 3)}
    peak = {"resident": 0}
    stop = threading.Event()

    def sample() -> None:  # resident weights sampled while loads and requests run
        while not stop.wait(0.005):
            peak["resident"] = max(peak["resident"], rt.device.arena.zone_live_bytes("weights"))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for seed in (1, 2, 3):
            rt.load_model(f"m{seed}", "decoder", "small", seed)
            assert leased(ledger, "capped", "weights") <= CAP
        for seed in (1, 2, 3, 1):   # round robin: every request after the first wakes its model
            got = [c[0] for c in rt.generate(f"m{seed}", PROMPT, NEW_TOKENS)]
            assert got == want[seed], f"m{seed} under the cap differs from the uncapped run"
            assert leased(ledger, "capped", "weights") <= CAP
            assert rt.device.arena.zone_live_bytes("weights") <= CAP
        stats = rt.stats()
        assert stats["weights"]["evictions"] > 0, stats
        assert stats["reclaim"]["idle_weights_bytes"] > 0, "no idle model was paged out"
        states = {m.model_id: m.state for m in rt.list_models()}
        assert list(states.values()).count("resident") <= 1, states
        assert stats["arena"]["faults"] == 0
    finally:
        stop.set()
        sampler.join()
        rt.close()
        server.stop(grace=0)
    assert 0 < peak["resident"] <= CAP, f"resident weights peaked at {peak['resident'] / MIB:.1f} MiB"


@pytest.mark.parametrize("config", ["small"])
def test_a_single_load_never_asks_the_zone_for_more_than_it_can_grant(tmp_path, kernel_cache_dir,
                                                                      config):
    """The 40 MiB zone / small decoder case: the admission probe books KV in `kv`, not in
    `weights` (it asked the weights zone for 87.8 MiB), and lease growth falls back from a whole
    chunk to the exact remainder."""
    server, ledger = serve(tmp_path, zone_budgets={"weights": CAP}, lending=False)
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    governor=server.address, worker_id="one")).start()
    try:
        rt.load_model("m", "decoder", config, 1)
        assert leased(ledger, "one", "weights") <= CAP
        assert leased(ledger, "one", "kv") >= CONFIGS[config].kv_bytes()
        assert rt.list_models()[0].state == "resident"
    finally:
        rt.close()
        server.stop(grace=0)
