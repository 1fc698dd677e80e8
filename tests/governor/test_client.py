"""services.governor.client: LocalBudget and GovernorClient against a real governor on loopback."""
from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.governor.client import DeviceDescription, GovernorClient, LocalBudget
from services.governor.policy import Policy
from services.governor.server import start_governor
from tests.polling import eventually

MIB = 1 << 20
CHUNK = 8 * MIB
DEVICE = DeviceDescription("GPU-client", "test", 2000 * MIB, 100 * MIB, 2 * MIB)


def serve(tmp_path, port: int = 0, db: str = "gov.sqlite", **policy):
    policy.setdefault("budget_fraction", 1.0)
    return start_governor(f"127.0.0.1:{port}", tmp_path / db, Policy(**policy),
                          tracer_provider=TracerProvider())


@pytest.fixture
def governor(tmp_path):
    server, ledger = serve(tmp_path)
    yield server, ledger
    server.stop(grace=0)


def client(server, worker_id: str = "w1", **kw) -> GovernorClient:
    kw.setdefault("chunk_bytes", CHUNK)
    kw.setdefault("heartbeat_s", 0.05)
    return GovernorClient(server.address, worker_id, DEVICE, tracer_provider=TracerProvider(),
                          **kw)


def leased(ledger, worker_id: str = "w1") -> int:
    return sum(lease.bytes for lease in ledger.leases_of(worker_id))


def test_local_budget_admits_up_to_its_budget_and_refuses_with_numbers():
    budget = LocalBudget(10 * MIB)
    budget.reserve("weights", 6 * MIB)
    budget.reserve("kv", 4 * MIB)
    with pytest.raises(ResourceExhausted) as info:
        budget.reserve("kv", 1)
    assert (info.value.asked_bytes, info.value.free_bytes, info.value.zone) == (1, 0, "kv")
    with pytest.raises(InvalidArgument):
        budget.release("kv", 5 * MIB)
    with pytest.raises(InvalidArgument):
        budget.reserve("nonsense", 1)
    assert budget.used() == {"weights": 6 * MIB, "kv": 4 * MIB}, "refusals must change nothing"
    budget.release("weights", 6 * MIB)
    budget.reserve("kv", 6 * MIB)


def test_small_reserves_are_served_from_chunks_not_one_rpc_each(governor):
    server, ledger = governor
    c = client(server)
    try:
        for _ in range(40):
            c.reserve("workspace", MIB // 2)
        assert c.stats()["acquires"] == 3, "40 x 0.5 MiB in 8 MiB chunks must take 3 Acquires"
        assert leased(ledger) == 3 * CHUNK
    finally:
        c.close()
    assert ledger.resources()[0].leased_bytes == 0, "close must hand every lease back"


def test_idle_chunks_go_back_with_hysteresis(governor):
    server, ledger = governor
    c = client(server)
    try:
        c.reserve("kv", 5 * CHUNK)
        c.release("kv", 5 * CHUNK)
        eventually(lambda: leased(ledger) == CHUNK, what="idle chunks returned down to one")
        acquires = c.stats()["acquires"]
        for _ in range(20):  # a cycle at the chunk boundary must not become Acquire/Release churn
            c.reserve("kv", CHUNK)
            c.release("kv", CHUNK)
        assert c.stats()["acquires"] == acquires
    finally:
        c.close()


def test_the_last_bytes_are_granted_exactly_when_a_whole_chunk_does_not_fit(governor):
    server, ledger = governor
    c = client(server)
    try:
        c.reserve("weights", 100 * MIB - 3 * MIB)
        c.reserve("weights", 3 * MIB)  # a chunk of 8 MiB would not fit; 3 MiB does
        assert ledger.resources()[0].free_budget_bytes == 0
        with pytest.raises(ResourceExhausted) as info:
            c.reserve("kv", MIB)
        assert info.value.zone == "kv" and info.value.free_bytes == 0
        assert info.value.reclaimable and info.value.reclaimable[0].zone == "weights", \
            "the client must surface the governor's reclaim hints"
        assert c.used() == {"weights": 100 * MIB}, "a refused reserve must change nothing"
    finally:
        c.close()


def test_heartbeats_carry_the_last_report_into_the_ledger(governor):
    server, ledger = governor
    c = client(server)
    try:
        c.report({"context": (500 * MIB, 500 * MIB), "kv": (8 * MIB, 7 * MIB)}, 600 * MIB, 0)
        eventually(lambda: ledger.resources()[0].ledger_bytes == 508 * MIB,
                   what="the report to reach the governor")
        assert ledger.resources()[0].unaccounted_bytes == 92 * MIB
    finally:
        c.close()


def test_the_client_keeps_working_inside_its_leases_while_the_governor_is_down(tmp_path):
    server, ledger = serve(tmp_path)
    port = server.port
    c = client(server)
    try:
        c.reserve("kv", MIB)  # holds one 8 MiB chunk
        server.stop(grace=0)
        c.reserve("kv", 6 * MIB)  # inside the held chunk: no governor needed
        eventually(lambda: not c.connected(), what="the client to notice the governor is down")
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="unreachable"):
            c.reserve("kv", 64 * MIB)
        assert time.monotonic() - started < 3, "growth while down must fail within a deadline"
        c.release("kv", 7 * MIB)
        server, ledger = serve(tmp_path, port=port)  # same db, same port
        eventually(c.connected, what="the client to reconnect")
        assert leased(ledger) == CHUNK, "the lease held across the outage must survive"
        c.reserve("kv", 20 * MIB)
    finally:
        c.close()
        server.stop(grace=0)


def test_a_governor_that_lost_its_state_gets_the_clients_leases_back(tmp_path):
    server, _ = serve(tmp_path)
    port = server.port
    c = client(server)
    try:
        c.reserve("weights", 2 * CHUNK)
        server.stop(grace=0)
        server, ledger = serve(tmp_path, port=port, db="fresh.sqlite")  # a new, empty ledger
        eventually(lambda: leased(ledger) if "w1" in {w.worker_id for d in ledger.resources()
                                                      for w in d.workers} else False,
                   what="the client to re-register and re-acquire")
        assert leased(ledger) == 2 * CHUNK, "re-acquired leases must cover the bytes in use"
        assert c.stats()["reacquired"] >= 1
    finally:
        c.close()
        server.stop(grace=0)


def test_a_borrowing_client_gives_idle_bytes_back_when_the_governor_reclaims(tmp_path):
    """The lender gets what the borrower gives back; the idle bytes stay under the hysteresis
    threshold, so only the reclaim path can return them (negative control: without it the
    lender's second reserve is refused for ever)."""
    server, ledger = serve(tmp_path, zone_budgets={"kv": 50 * MIB, "weights": 50 * MIB})
    asked = []
    lender = client(server, "lender", heartbeat_s=10)
    borrower = client(server, "borrower", on_reclaim=lambda z, b: asked.append((z, b)))
    try:
        borrower.reserve("weights", 90 * MIB)  # 40 MiB and more of kv's share borrowed
        held = leased(ledger, "borrower")
        idle = 2 * CHUNK - 4 * MIB  # idle, but under the 2-chunk hysteresis threshold
        borrower.release("weights", idle - (held - 90 * MIB))
        free = ledger.resources()[0].free_budget_bytes
        want = free + idle  # all the budget's free bytes plus every idle byte the borrower holds
        with pytest.raises(ResourceExhausted, match="admission refused"):
            lender.reserve("kv", want)
        def lender_got_it() -> bool:
            try:
                lender.reserve("kv", want)
                return True
            except ResourceExhausted:
                return False
        eventually(lender_got_it, what="the lender to acquire the bytes the borrower gave back")
        assert borrower.counters["reclaim_asks"] > 0, "the borrower never saw the governor's ask"
        assert asked == [], "idle lease bytes covered the ask: the owner must not shrink its zones"
        assert leased(ledger, "borrower") == held - idle, "the borrower must give back its idle"
        assert leased(ledger, "lender") >= want
    finally:
        lender.close()
        borrower.close()
        server.stop(grace=0)


def test_a_worker_that_starts_before_its_governor_books_its_context_once_the_governor_answers(
    tmp_path,
):
    from gpu_worker.stack.processes import free_port

    port = free_port()
    c = GovernorClient(f"127.0.0.1:{port}", "early", DEVICE, chunk_bytes=CHUNK, heartbeat_s=0.05,
                       tracer_provider=TracerProvider())
    server = None
    try:
        c.adopt("context", 3 * MIB)  # already spent on the device: must not be refused
        assert c.used()["context"] == 3 * MIB
        with pytest.raises(ResourceExhausted, match="unreachable"):
            c.reserve("weights", MIB)  # new memory still needs the governor
        server, ledger = serve(tmp_path, port=port)
        def backed() -> bool:
            try:
                return leased(ledger, "early") >= 3 * MIB
            except NotFound:  # not registered yet
                return False

        eventually(backed,
                   what="the adopted context bytes to be backed by a lease")
        assert c.lease_ids(), "the unbacked booking must turn into a real lease"
        c.reserve("weights", MIB)
    finally:
        c.close()
        if server is not None:
            server.stop(grace=0)


def test_local_budget_adopts_already_spent_bytes_even_beyond_its_budget():
    budget = LocalBudget(MIB)
    budget.adopt("context", 2 * MIB)
    assert budget.used()["context"] == 2 * MIB
    with pytest.raises(ResourceExhausted):
        budget.reserve("kv", 1)


@pytest.mark.parametrize("lending", [False, True])
def test_zone_caps_reach_the_client_at_registration_and_on_every_beat_only_with_lending_off(
        tmp_path, lending):
    """A zone budget is a hard cap only with lending off; `on_caps` hears each change once."""
    server, _ = serve(tmp_path, zone_budgets={"weights": 40 * MIB, "kv": 64 * MIB},
                      lending=lending)
    heard: list[dict[str, int]] = []
    c = client(server)
    try:
        want = {} if lending else {"weights": 40 * MIB, "kv": 64 * MIB}
        assert c.zone_caps == want, "the registration reply did not carry the caps"
        c.on_caps = heard.append
        c.deliver_caps()
        beats = c.counters["heartbeats"]
        eventually(lambda: c.counters["heartbeats"] >= beats + 3, what="three heartbeats")
        assert heard == [want], "on_caps must hear the caps once, not on every beat"
    finally:
        c.close()
        server.stop(grace=0)


def test_a_cap_that_shrinks_below_the_held_lease_gets_the_idle_bytes_above_it_back(tmp_path):
    """The governor restarts with a smaller weights cap: the beat that brings it delivers it and
    gives back the idle lease bytes above it (in exact bytes, not chunks); bytes in use stay."""
    server, ledger = serve(tmp_path, zone_budgets={"weights": 40 * MIB}, lending=False)
    port = int(server.address.rsplit(":", 1)[1])
    heard: list[dict[str, int]] = []
    c = client(server, on_caps=heard.append, chunk_bytes=64 * MIB)
    try:
        c.reserve("weights", 30 * MIB)      # the chunk does not fit the cap: exactly 30 MiB
        c.release("weights", 20 * MIB)      # 20 MiB idle, under the 2-chunk hysteresis
        time.sleep(0.2)
        assert leased(ledger) == 30 * MIB
        server.stop(grace=0)
        server, ledger = serve(tmp_path, port=port, zone_budgets={"weights": 16 * MIB},
                               lending=False)
        eventually(lambda: heard and heard[-1] == {"weights": 16 * MIB}, what="the new cap")
        eventually(lambda: leased(ledger) == 16 * MIB, what="the bytes above the cap to go back")
        assert c.used() == {"weights": 10 * MIB}
    finally:
        c.close()
        server.stop(grace=0)


def test_a_lease_request_never_asks_a_capped_zone_for_more_than_it_can_grant(tmp_path):
    """Under a 40 MiB weights cap and 64 MiB chunks: growth asks for the exact need when a chunk
    would not fit the cap (no refused whole-chunk Acquire first), and growth beyond the cap is
    refused by the client with the numbers, without an RPC."""
    server, ledger = serve(tmp_path, zone_budgets={"weights": 40 * MIB}, lending=False)
    c = client(server, chunk_bytes=64 * MIB)
    try:
        c.reserve("weights", 30 * MIB)
        assert leased(ledger) == 30 * MIB, "the exact need, not all the room the cap leaves"
        assert ledger.counters["refused"] == 0, "a whole chunk was asked and refused first"
        c.reserve("weights", 10 * MIB)
        assert leased(ledger) == 40 * MIB and c.counters["acquires"] == 2
        with pytest.raises(ResourceExhausted, match="41943040-byte cap") as e:
            c.reserve("weights", 1)
        assert (e.value.asked_bytes, e.value.free_bytes, e.value.zone) == (1, 0, "weights")
        assert ledger.counters["refused"] == 0, "the refusal cost an RPC"
        assert c.counters["cap_refusals"] == 1 and c.used() == {"weights": 40 * MIB}
        c.reserve("kv", 1)                        # another zone has no cap
    finally:
        c.close()
        server.stop(grace=0)
