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


def test_a_reclaim_ask_is_answered_by_paging_out_idle_weights_and_a_second_worker_gets_them(
        tmp_path, kernel_cache_dir):
    """Worker A's idle `small` decoder borrows the weights zone beyond its 1 MiB share. Worker B
    on the same device fills the device inside its kv share; its next kv ask, still inside the
    share, is refused and the governor asks A for weights. A answers within a heartbeat by paging
    its idle model's weights out (the reclaim order, governor entry) and gives the lease bytes
    back; B's retry is granted. A's model then wakes with the same tokens."""
    from services.common.errors import ResourceExhausted
    from services.governor.client import DeviceDescription, GovernorClient
    from tests.polling import eventually

    kv_share, ask = 3000 * MIB, 16 * MIB
    server, ledger = serve(tmp_path, budget_fraction=1.0, lending=True,
                           zone_budgets={"weights": 1 * MIB, "kv": kv_share})
    a = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir, worker_id="A",
                                   governor=server.address, lease_chunk_bytes=2 * MIB)).start()
    b = None
    try:
        a.load_model("m", "decoder", "small", 1)
        first = [c[0] for c in a.generate("m", PROMPT, NEW_TOKENS)]
        info = a.device.info
        b = GovernorClient(server.address, "B", DeviceDescription(
            info.uuid, info.name, info.total_bytes, info.total_bytes, info.granule_bytes),
            chunk_bytes=2 * MIB, heartbeat_s=0.05, tracer_provider=TracerProvider())
        eventually(lambda: ledger.resources(info.uuid)[0].zones, what="A's zones reported")
        report = ledger.resources(info.uuid)[0]
        weights_borrowed = leased(ledger, "A", "weights") - 1 * MIB
        assert weights_borrowed > ask, "A does not borrow enough for the test to mean anything"
        fill_kv = kv_share - leased(ledger, "A", "kv") - ask
        b.reserve("kv", fill_kv)
        b.reserve("scratch", report.free_budget_bytes - fill_kv)  # the device is now full
        assert ledger.resources(info.uuid)[0].free_budget_bytes == 0
        with pytest.raises(ResourceExhausted):
            b.reserve("kv", ask)       # inside kv's share: the governor asks the borrower back

        def granted() -> bool:
            try:
                b.reserve("kv", ask)
            except ResourceExhausted:
                return False
            return True
        # A's heartbeat is 2 s: one beat delivers the ask and gives the bytes back.
        eventually(granted, timeout=3 * 2.0 + 2, interval=0.1, what="B to get A's idle weights")
        assert [m.state for m in a.list_models()] == ["offloaded"], "A was not shrunk by paging out"
        stats = a.stats()["reclaim"]
        assert stats["governor_asks"] >= 1 and stats["idle_weights_bytes"] > 0, stats
        assert stats["idle_plans_bytes"] == 0, "a weights ask dropped plans (they free no weights)"
        b.release("kv", fill_kv + ask)
        b.release("scratch", report.free_budget_bytes - fill_kv)
        b.close()
        b = None
        assert [c[0] for c in a.generate("m", PROMPT, NEW_TOKENS)] == first
    finally:
        if b is not None:
            b.close()
        a.close()
        server.stop(grace=0)
