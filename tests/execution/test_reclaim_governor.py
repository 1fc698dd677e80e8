"""Issue 14 with a real governor on loopback: the weights zone cap it grants is shared by several
models through paging, and its reclaim asks are answered by the worker's reclaim order."""
from __future__ import annotations

import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
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
    """Bytes `worker_id` leases in `zone` (0 for a worker that never registered)."""
    if not any(w.worker_id == worker_id for d in ledger.resources() for w in d.workers):
        return 0
    return sum(lease.bytes for lease in ledger.leases_of(worker_id) if lease.zone == zone)


@pytest.mark.parametrize("cap_from", ["governor", "flag"])
def test_three_small_decoders_share_a_40_mib_weights_cap(tmp_path, kernel_cache_dir, cap_from):
    """Each `small` decoder has 23.8 MiB of weights: two never fit under the cap together. All
    three load (the idle ones page out instead of the load being refused) and serve, each stream
    identical to the uncapped reference run, with resident weights (and the governor's weights
    lease) never above the cap. The cap comes from the governor's weights zone (lending off) or
    from --weight-budget-bytes."""
    server, ledger = serve(tmp_path, zone_budgets={"weights": CAP}, lending=False)
    rt = WorkerRuntime(WorkerConfig(
        backend="sim", cache_dir=kernel_cache_dir, worker_id="capped",
        governor=server.address if cap_from == "governor" else None,
        weight_budget_bytes=CAP if cap_from == "flag" else None)).start()
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
        if cap_from == "governor":  # its refusals are answered by the reclaim order
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
        weights_borrowed = leased(ledger, "A", "weights") - 1 * MIB
        assert weights_borrowed > ask, "A does not borrow enough for the test to mean anything"
        fill_kv = kv_share - leased(ledger, "A", "kv") - ask
        b.reserve("kv", fill_kv)
        scratch = [0]   # what B reserved in zone scratch to fill the device

        def full() -> bool:
            """B takes what is free now: A's heartbeat may give idle lease slack back between
            one read of the ledger and the next, so fill until a read finds nothing free."""
            free = ledger.resources(info.uuid)[0].free_budget_bytes
            if free > 0:
                b.reserve("scratch", free)
                scratch[0] += free
            return ledger.resources(info.uuid)[0].free_budget_bytes == 0
        eventually(full, timeout=10, interval=0.05, what="the device full of B's leases")
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
        b.release("scratch", scratch[0])
        b.close()
        b = None
        assert [c[0] for c in a.generate("m", PROMPT, NEW_TOKENS)] == first
    finally:
        if b is not None:
            b.close()
        a.close()
        server.stop(grace=0)


def fill_device(ledger, uuid: str, filler, keep_free: int, room: dict[str, int]) -> None:
    """Lease all but `keep_free` bytes of the device to `filler`: every zone with a share up to
    it (less `room` left inside it), the rest in `scratch` (no share: the pool the shares leave).
    The pool cannot overflow while the device does not, so the filler borrows nothing the
    governor could ask back."""
    report = ledger.resources(uuid)[0]
    left = report.free_budget_bytes - keep_free
    for z in report.zones:
        if left > 0 and z.budget_bytes and z.leased_bytes < z.budget_bytes:
            take = min(left, max(0, z.budget_bytes - z.leased_bytes - room.get(z.zone, 0)))
            if take:
                filler.reserve(z.zone, take)
                left -= take
    if left > 0:
        filler.reserve("scratch", left)
    assert ledger.resources(uuid)[0].free_budget_bytes == keep_free
    assert not any(z.borrowed_bytes for z in ledger.resources(uuid)[0].zones
                   if z.zone not in ("activations",)), "the filler borrowed"


def test_a_second_worker_gets_memory_from_the_first_workers_idle_zones_instead_of_a_refusal(
        tmp_path, kernel_cache_dir, monkeypatch):
    """Two workers on one device. A's idle model borrowed the activations zone (1 MiB share);
    the rest of the device is leased inside the shares. B's load, inside its weights share, is
    refused by the governor, which asks A to give back; B's reclaim order ends by waiting for
    that (about one heartbeat) and its load succeeds: no RESOURCE_EXHAUSTED reaches B's caller."""
    from types import SimpleNamespace

    from gpu_worker.device import sim_backend
    from services.governor.client import DeviceDescription, GovernorClient

    shares = {"weights": 64 * MIB, "kv": 2900 * MIB, "context": 600 * MIB,
              "activations": 1 * MIB}
    server, ledger = serve(tmp_path, budget_fraction=1.0, lending=True, zone_budgets=shares)
    workers: list = []
    filler = None
    try:
        a = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir, worker_id="A",
                                       governor=server.address, lease_chunk_bytes=2 * MIB)).start()
        workers.append(a)
        a.load_model("m", "decoder", "small", 1)
        list(a.generate("m", PROMPT, 2))                 # A's plans: borrowed activations
        uuid = a.device.info.uuid
        monkeypatch.setattr(sim_backend, "uuidlib",      # B's sim device is A's device
                            SimpleNamespace(uuid4=lambda: uuid.removeprefix("GPU-sim-")))
        b = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir, worker_id="B",
                                       governor=server.address, lease_chunk_bytes=2 * MIB)).start()
        workers.append(b)
        assert b.device.info.uuid == uuid
        borrowed = leased(ledger, "A", "activations") - shares["activations"]
        assert borrowed > 0, "A borrowed nothing: the test would prove nothing"
        filler = GovernorClient(server.address, "filler", DeviceDescription(
            uuid, "sim", 4 << 30, 4 << 30, 2 * MIB), chunk_bytes=1, heartbeat_s=0.05,
            tracer_provider=TracerProvider())
        # B's load probes 4 MiB of weights: leave less free than that, short by what A borrowed.
        need = 4 * MIB
        fill_device(ledger, uuid, filler, need - min(borrowed, 2 * MIB), {"weights": need})
        before = leased(ledger, "A", "activations")
        b.load_model("enc", "encoder", "tiny", 1)       # refused first, then granted
        assert b.stats()["reclaim"]["peer_waits"] >= 1, "B's load did not wait for a peer"
        assert a.budget.counters["reclaim_asks"] >= 1, "the governor never asked A"
        assert leased(ledger, "A", "activations") < before, "A gave nothing back"
        assert [m.model_id for m in b.list_models()] == ["enc"]
    finally:
        if filler is not None:
            filler.close()
        for w in reversed(workers):
            w.close()
        server.stop(grace=0)
