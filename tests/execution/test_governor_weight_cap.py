"""Issue 14: the weight budget is the smaller of --weight-budget-bytes and the governor's weights
zone cap (a zone budget with lending off), sent at registration and in every heartbeat reply.
A real governor on loopback, the sim backend, real NVRTC, WorkerRuntime.

`small` has 23.8 MiB of weights; its streaming floor is 12 MiB (its 8 MiB embedding next to one
layer: tests/execution/test_streaming.py), so 12 MiB is the smallest cap it can stream through.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from services.common.errors import ResourceExhausted
from services.governor.policy import Policy
from services.governor.server import start_governor
from tests.polling import eventually

MIB = 1 << 20
FLOOR = 12 * MIB          # `small`'s streaming floor
WHOLE = 40 * MIB          # holds all of `small`'s weights
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NEW_TOKENS = 3
SEED = 2


@pytest.fixture(scope="module")
def reference() -> list[int]:
    cfg = CONFIGS["small"]
    return R.DecoderReference(cfg, W.load_host(cfg, SEED)).generate(PROMPT, NEW_TOKENS)


def serve(db, weights_cap: int, lending: bool = False, listen: str = "127.0.0.1:0"):
    return start_governor(listen, db, Policy(zone_budgets={"weights": weights_cap},
                                             lending=lending), tracer_provider=TracerProvider())


def leased(ledger, worker_id: str, zone: str = "weights") -> int:
    return sum(lease.bytes for lease in ledger.leases_of(worker_id) if lease.zone == zone)


def worker(kernel_cache_dir, governor: str | None, flag: int | None = None,
           worker_id: str = "w", capture: bool = True) -> WorkerRuntime:
    return WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                      governor=governor, worker_id=worker_id, capture=capture,
                                      weight_budget_bytes=flag)).start()


def generate(rt: WorkerRuntime, model_id: str = "m") -> list[int]:
    return [c[0] for c in rt.generate(model_id, PROMPT, NEW_TOKENS)]


@contextlib.contextmanager
def peaks(rt: WorkerRuntime, ledger) -> Iterator[dict[str, int]]:
    """Resident (live) weight bytes and the governor's weights lease, sampled in a thread."""
    seen = {"resident": 0, "lease": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            seen["resident"] = max(seen["resident"], rt.device.arena.zone_live_bytes("weights"))
            seen["lease"] = max(seen["lease"], leased(ledger, rt.config.worker_id))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        stop.set()
        sampler.join()


@pytest.mark.parametrize("capture", [True, False], ids=["captured", "eager"])
def test_a_decoder_larger_than_the_governors_weights_cap_streams_identically(
        tmp_path, kernel_cache_dir, reference, capture):
    """No --weight-budget-bytes: the governor's 12 MiB weights cap alone makes the 23.8 MiB
    decoder stream. It loads without paging a weight in, generates the uncapped tokens (twice:
    the second run replays), and neither its resident weights nor its weights lease ever exceed
    the cap."""
    server, ledger = serve(tmp_path / "gov.sqlite", FLOOR)
    rt = worker(kernel_cache_dir, server.address, capture=capture)
    try:
        assert rt.device.weights.budget_bytes == FLOOR
        with peaks(rt, ledger) as seen:
            rt.load_model("m", "decoder", "small", SEED)
            assert rt.device.arena.zone_live_bytes("weights") == 0, "the load paged weights in"
            assert generate(rt) == reference
            assert generate(rt) == reference, "a second request differs"
        executor = rt._get("m").executor
        assert executor.streams()
        decode = executor.plans.get(("paged_decode", 1))
        assert decode.graph_exec is None and len(decode.streamed.schedule.segments) >= 4
        stats = rt.stats()
        assert stats["weights"]["budget_bytes"] == FLOOR, "GetStats does not show the cap"
        assert stats["weights"]["page_ins"] > 0 and stats["arena"]["faults"] == 0
        assert stats["weights"]["evictions"] > 0, "nothing was paged out: no streaming"
        assert 0 < seen["resident"] <= FLOOR, f"resident peaked at {seen['resident'] / MIB} MiB"
        assert 0 < seen["lease"] <= FLOOR, f"the weights lease peaked at {seen['lease'] / MIB} MiB"
        assert rt.device.weights.stats()["peak_committed_bytes"] <= FLOOR
    finally:
        rt.close()
        server.stop(grace=0)


@pytest.mark.parametrize("flag, cap, lending, want, source", [
    (20 * MIB, FLOOR, False, FLOOR, "governor"),      # the grant is the smaller
    (FLOOR, WHOLE, False, FLOOR, "flag"),             # the flag is the smaller
    (None, FLOOR, True, None, None),                  # lending on: a share, not a cap
    (FLOOR, 8 * MIB, True, FLOOR, "flag"),            # ... whatever its size
], ids=["grant-smaller", "flag-smaller", "lending-no-flag", "lending-flag"])
def test_the_effective_weight_budget_is_the_smaller_of_flag_and_grant(
        tmp_path, kernel_cache_dir, reference, flag, cap, lending, want, source):
    """Both orders, and lending on (a zone share other zones may borrow from caps nothing). The
    effective budget is what streams(), the load probe and GetStats all use."""
    server, ledger = serve(tmp_path / "gov.sqlite", cap, lending)
    rt = worker(kernel_cache_dir, server.address, flag)
    try:
        weights = rt.device.weights
        assert weights.budget_bytes == want
        assert weights.limits() == {"flag": flag, "governor": None if lending else cap}
        rt.load_model("m", "decoder", "small", SEED)
        streams = want is not None and want < 23 * MIB
        assert rt._get("m").executor.streams() == streams
        assert rt.stats()["weights"]["budget_bytes"] == (want or 0)
        if source is not None:
            assert weights.budget_source == {"flag": "--weight-budget-bytes",
                                             "governor": "the governor's weights zone cap"}[source]
        assert generate(rt) == reference
        assert rt.device.arena.zone_live_bytes("weights") <= (want or WHOLE)
        if not lending:
            assert leased(ledger, "w") <= cap
    finally:
        rt.close()
        server.stop(grace=0)


def test_no_governor_keeps_the_flag_as_the_weight_budget(kernel_cache_dir):
    rt = worker(kernel_cache_dir, None, FLOOR)
    try:
        assert rt.device.weights.budget_bytes == FLOOR
        assert rt.device.weights.limits() == {"flag": FLOOR, "governor": None}
    finally:
        rt.close()


def test_a_governor_cap_below_the_streaming_floor_is_refused_naming_the_numbers_and_books_nothing(
        tmp_path, kernel_cache_dir):
    cap = FLOOR - 2 * MIB
    server, ledger = serve(tmp_path / "gov.sqlite", cap)
    rt = worker(kernel_cache_dir, server.address, flag=WHOLE)
    try:
        before = rt.device.ledger.snapshot()
        with pytest.raises(ResourceExhausted,
                           match=rf"at least {FLOOR} .*{cap}-byte weight budget \(the governor's "
                                 r"weights zone cap\)") as e:
            rt.load_model("m", "decoder", "small", SEED)
        assert e.value.zone == "weights" and e.value.asked_bytes == FLOOR
        assert e.value.free_bytes == cap
        assert rt.list_models() == [] and rt.device.ledger.snapshot() == before
        assert rt.device.weights.stats()["slots"] == 0
        assert rt.budget.used().get("weights", 0) == 0
        assert leased(ledger, "w") <= cap
    finally:
        rt.close()
        server.stop(grace=0)


def test_a_shrinking_cap_pages_idle_weights_out_and_the_next_request_streams(
        tmp_path, kernel_cache_dir, reference):
    """The governor restarts (same database, same address) with a smaller weights cap: within a
    heartbeat the worker's budget follows, the idle model's weights page out down to it, and the
    lease bytes above it go back; the next request streams with the same tokens. The cap grows
    back: the next request runs whole again, every weight resident."""
    db = tmp_path / "gov.sqlite"
    server, ledger = serve(db, WHOLE)
    address = server.address
    rt = worker(kernel_cache_dir, address)
    try:
        rt.load_model("m", "decoder", "small", SEED)
        assert generate(rt) == reference
        executor = rt._get("m").executor
        assert not executor.streams() and rt.list_models()[0].state == "resident"
        assert leased(ledger, "w") > FLOOR
        server.stop(grace=0)
        server, ledger = serve(db, FLOOR, listen=address)
        eventually(lambda: rt.device.weights.budget_bytes == FLOOR, timeout=15,
                   what="the worker's budget to follow the governor's new cap")
        assert rt.device.arena.zone_live_bytes("weights") <= FLOOR, "idle weights stayed"
        eventually(lambda: leased(ledger, "w") <= FLOOR, timeout=10,
                   what="the lease bytes above the new cap to go back")
        with peaks(rt, ledger) as seen:
            assert generate(rt) == reference
        assert executor.streams() and seen["resident"] <= FLOOR and seen["lease"] <= FLOOR
        server.stop(grace=0)
        server, ledger = serve(db, WHOLE, listen=address)
        eventually(lambda: rt.device.weights.budget_bytes == WHOLE, timeout=15,
                   what="the worker's budget to follow the governor's larger cap")
        assert generate(rt) == reference
        assert not executor.streams() and rt.list_models()[0].state == "resident"
        assert rt.stats()["arena"]["faults"] == 0
    finally:
        rt.close()
        server.stop(grace=0)


@pytest.mark.parametrize("direction", ["shrinks", "grows"])
def test_a_request_keeps_the_mode_it_started_in_while_the_budget_changes(
        kernel_cache_dir, reference, direction):
    """The budget changes while the model's weights are held for a request (the scheduler holds
    `resident()` for as long as it has sequences; the governor's cap arrives on its heartbeat
    thread): a model that pinned every weight keeps running whole (its weights stay pinned, hence
    mapped), one that pinned nothing keeps streaming (a whole-graph replay would read unpaged
    weights), with the reference tokens. Once released, the next request takes the new mode."""
    start, then = (WHOLE, FLOOR) if direction == "shrinks" else (FLOOR, WHOLE)
    rt = worker(kernel_cache_dir, None, start)
    try:
        rt.load_model("m", "decoder", "small", SEED)
        executor = rt._get("m").executor
        was = executor.streams()
        assert was == (direction == "grows")
        with executor.resident():
            rt.device.weights.set_budget(then)
            assert executor.streams() == was, "the mode changed under a held request"
            assert generate(rt) == reference
        assert executor.streams() != was
        assert generate(rt) == reference
        if direction == "shrinks":
            assert rt.device.arena.zone_live_bytes("weights") <= FLOOR
        assert rt.stats()["arena"]["faults"] == 0
    finally:
        rt.close()
