"""KernelCacheService over real gRPC on loopback: auth, status codes, batch, stats, prune, metrics."""
from __future__ import annotations

import sqlite3
import time

import grpc
import pytest
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc
from prometheus_client import generate_latest

from cache_service.convert import artifact_to_pb
from cache_service.servicer import MAX_BATCH_KEYS
from tests.cache_service.cache_helpers import TOKEN, make_artifact

AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(server.address, options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    yield pb_grpc.KernelCacheServiceStub(channel)
    channel.close()


def store_request(key: str = "k", size: int = 4096, seed: int = 0, **kw) -> pb.StoreRequest:
    return pb.StoreRequest(key=key, artifact=artifact_to_pb(make_artifact(size, seed)), **kw)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_store_without_a_token_is_unauthenticated_and_with_a_wrong_one_permission_denied(stub):
    assert code_of(lambda: stub.Store(store_request(), timeout=5)) == \
        grpc.StatusCode.UNAUTHENTICATED, "a write without credentials must be UNAUTHENTICATED"
    wrong = (("authorization", "Bearer nope"),)
    assert code_of(lambda: stub.Store(store_request(), timeout=5, metadata=wrong)) == \
        grpc.StatusCode.PERMISSION_DENIED, "a wrong token must be PERMISSION_DENIED"
    assert code_of(lambda: stub.Prune(pb.PruneRequest(), timeout=5)) == \
        grpc.StatusCode.UNAUTHENTICATED, "Prune is a write and needs the token too"
    assert not stub.Lookup(pb.LookupRequest(key="k"), timeout=5).found, "refused writes stored"
    assert stub.Store(store_request(), timeout=5, metadata=AUTH).stored
    assert stub.Lookup(pb.LookupRequest(key="k"), timeout=5).found, "reads must stay open"


def test_writes_are_open_when_no_token_is_configured(start_server):
    server = start_server(write_token=None)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KernelCacheServiceStub(channel)
        assert stub.Store(store_request(), timeout=5).stored


@pytest.mark.parametrize("name, request_", [
    ("empty key", lambda: store_request(key="")),
    ("digest mismatch", lambda: pb.StoreRequest(key="k", artifact=pb.Artifact(
        data=b"abc", sha256="0" * 64, kind=pb.ARTIFACT_KIND_PTX))),
    ("missing digest", lambda: pb.StoreRequest(key="k", artifact=pb.Artifact(
        data=b"abc", kind=pb.ARTIFACT_KIND_PTX))),
    ("no kind", lambda: pb.StoreRequest(key="k", artifact=pb.Artifact(
        data=b"abc", sha256=make_artifact(3).sha256))),
    ("no artifact", lambda: pb.StoreRequest(key="k")),
    ("oversized", lambda: store_request(size=(1 << 20) + 1)),
    ("bad namespace", lambda: store_request(namespace="a/b")),
])
def test_bad_store_is_invalid_argument_and_stores_nothing(start_server, name, request_):
    server = start_server(max_artifact_bytes=1 << 20)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KernelCacheServiceStub(channel)
        assert code_of(lambda: stub.Store(request_(), timeout=5, metadata=AUTH)) == \
            grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be INVALID_ARGUMENT"
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
        assert stats.entries == 0 and stats.stores == 0, f"{name} stored something"


def test_lookup_of_a_bad_key_or_too_many_keys_is_invalid_argument(stub):
    assert code_of(lambda: stub.Lookup(pb.LookupRequest(key=""), timeout=5)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    keys = [f"k{i}" for i in range(MAX_BATCH_KEYS + 1)]
    assert code_of(lambda: stub.BatchLookup(pb.BatchLookupRequest(keys=keys), timeout=5)) == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_repeated_hits_send_the_kept_encoding_byte_for_byte_and_a_miss_a_message(server, stub):
    request = store_request(key="enc", size=300_000, seed=5)
    stub.Store(request, timeout=5, metadata=AUTH)
    with grpc.insecure_channel(server.address, options=[
            ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        raw = channel.unary_unary("/gpuplane.kernelcache.v1.KernelCacheService/Lookup",
                                  request_serializer=pb.LookupRequest.SerializeToString)
        sent = [raw(pb.LookupRequest(key="enc"), timeout=5) for _ in range(3)]
        missed = pb.LookupResponse.FromString(raw(pb.LookupRequest(key="absent"), timeout=5))
    expected = pb.LookupResponse(found=True, artifact=request.artifact).SerializeToString()
    assert sent == [expected] * 3, "a hit's bytes on the wire differ from its LookupResponse"
    assert not missed.found and not missed.HasField("artifact")
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
    assert stats.hot_hits == 3 and stats.hot_bytes >= 2 * 300_000, \
        "the encoding was not kept with the hot entry (or not counted in its budget)"


def test_store_lookup_round_trip_keeps_every_field_and_repeat_store_is_idempotent(stub):
    request = store_request(key="abc", size=10000, seed=3, namespace="prod")
    first = stub.Store(request, timeout=5, metadata=AUTH)
    again = stub.Store(request, timeout=5, metadata=AUTH)
    assert first.stored and not again.stored and not again.digest_conflict
    got = stub.Lookup(pb.LookupRequest(key="abc", namespace="prod"), timeout=5)
    assert got.found and got.artifact == request.artifact, "the artifact changed in the cache"
    conflict = stub.Store(store_request(key="abc", seed=4, namespace="prod"), timeout=5,
                          metadata=AUTH)
    assert conflict.digest_conflict, "a different digest under a known key must be flagged"
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
    assert (stats.hits, stats.stores, stats.digest_conflicts) == (1, 1, 1)
    assert [n.namespace for n in stats.namespaces] == ["prod"]


def test_batch_lookup_returns_one_result_per_key_in_request_order(server, stub):
    for k in ("a", "c"):
        stub.Store(store_request(key=k, seed=ord(k)), timeout=5, metadata=AUTH)
    response = stub.BatchLookup(pb.BatchLookupRequest(keys=["c", "b", "a"]), timeout=5)
    assert [r.found for r in response.results] == [True, False, True]
    assert response.results[0].artifact.module_name == f"mod{ord('c')}", "results out of order"


def test_prune_rpc_evicts_down_to_the_target(stub):
    for i in range(5):
        stub.Store(store_request(key=f"k{i}", seed=i), timeout=5, metadata=AUTH)
    pruned = stub.Prune(pb.PruneRequest(target_bytes=2 * 4096), timeout=5, metadata=AUTH)
    assert (pruned.evicted_entries, pruned.total_bytes) == (3, 2 * 4096)
    assert stub.Lookup(pb.LookupRequest(key="k4"), timeout=5).found, "MRU entries must survive"


def test_metrics_expose_hits_misses_errors_bytes_budget_and_latency(server, stub):
    stub.Store(store_request(), timeout=5, metadata=AUTH)
    stub.Lookup(pb.LookupRequest(key="k"), timeout=5)
    stub.Lookup(pb.LookupRequest(key="nope"), timeout=5)
    code_of(lambda: stub.Store(store_request(), timeout=5))
    text = generate_latest(server.metrics.registry).decode()
    for line in ("kernel_cache_hits_total 1.0", "kernel_cache_misses_total 1.0",
                 'kernel_cache_bytes{namespace=""} 4096.0',
                 'kernel_cache_budget_bytes{namespace=""} 2.68435456e+08',
                 'kernel_cache_errors_total{code="UNAUTHENTICATED",method="Store"} 1.0',
                 'kernel_cache_request_seconds_count{method="Lookup"} 2.0'):
        assert line in text, f"metric line missing: {line}"


def test_the_maintenance_timer_persists_hits_and_prunes_without_any_write(start_server):
    server = start_server(maintenance_s=0.05, budget_bytes=0)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KernelCacheServiceStub(channel)
        stub.Store(store_request(), timeout=5, metadata=AUTH)
        stub.Lookup(pb.LookupRequest(key="k"), timeout=5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        row = sqlite3.connect(server.store.path).execute("SELECT hits FROM entries").fetchone()
        if row == (1,):
            break
        time.sleep(0.02)
    assert row == (1,), "the timer must persist access records when nothing else writes"


def test_a_max_artifact_size_at_or_above_the_message_limit_is_refused_at_startup(tmp_path):
    from cache_service.config import ServerConfig
    from cache_service.store import StoreConfig
    from services.common.server import MAX_MESSAGE_BYTES

    with pytest.raises(ValueError, match="message limit"):
        ServerConfig(db=tmp_path / "c.sqlite",
                     store=StoreConfig(max_artifact_bytes=MAX_MESSAGE_BYTES))


# -- single-flight claims ---------------------------------------------------------------------


def claim(stub, holder: str, key: str = "k", ttl_s: float = 30.0, wait_s: float = 0.0,
          metadata=AUTH, timeout: float = 10.0) -> pb.ClaimResponse:
    return stub.Claim(pb.ClaimRequest(key=key, holder=holder, ttl_s=ttl_s, wait_s=wait_s),
                      timeout=timeout, metadata=metadata)


def test_a_claim_needs_the_write_token_because_it_makes_other_hosts_wait(stub, server):
    assert code_of(lambda: claim(stub, "h", metadata=None)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: stub.ReleaseClaim(pb.ReleaseClaimRequest(key="k", holder="h"),
                                             timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert server.servicer.claims.stats().active == 0, "a refused claim was taken"


@pytest.mark.parametrize("request_fields", [
    {"key": "", "holder": "h", "ttl_s": 1.0}, {"key": "k", "holder": "", "ttl_s": 1.0},
    {"key": "k", "holder": "h", "ttl_s": 0.0}, {"key": "k", "holder": "h", "ttl_s": 1e9},
    {"key": "k", "holder": "h", "ttl_s": 1.0, "wait_s": -1.0},
    {"key": "k", "holder": "h", "ttl_s": 1.0, "namespace": "bad ns"}])
def test_a_bad_claim_is_invalid_argument_and_takes_nothing(stub, server, request_fields):
    assert code_of(lambda: stub.Claim(pb.ClaimRequest(**request_fields), timeout=5,
                                      metadata=AUTH)) == grpc.StatusCode.INVALID_ARGUMENT
    assert server.servicer.claims.stats().active == 0


def test_claim_then_store_ends_the_claim_and_the_waiter_gets_the_artifact(stub, server):
    import threading

    assert claim(stub, "host-a").outcome == pb.CLAIM_OUTCOME_GRANTED
    assert claim(stub, "host-b").outcome == pb.CLAIM_OUTCOME_HELD
    replies: list[pb.ClaimResponse] = []
    waiter = threading.Thread(target=lambda: replies.append(claim(stub, "host-b", wait_s=10.0)))
    waiter.start()
    deadline = time.monotonic() + 5
    while server.servicer.claims.stats().waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stored = store_request("k", seed=7)
    assert stub.Store(stored, timeout=5, metadata=AUTH).stored
    waiter.join(10)
    assert replies and replies[0].outcome == pb.CLAIM_OUTCOME_FOUND, replies
    assert replies[0].artifact == stored.artifact, "FOUND must carry the stored artifact"
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=5).claims
    assert (stats.granted, stats.waits, stats.wait_hits, stats.active) == (1, 1, 1, 0), stats
    text = generate_latest(server.metrics.registry).decode()
    for line in ("kernel_cache_claims_granted_total 1.0", "kernel_cache_claim_waits_total 1.0",
                 "kernel_cache_claim_wait_hits_total 1.0", "kernel_cache_claims_expired_total 0.0"):
        assert line in text, f"{line!r} missing from /metrics"


def test_release_lets_the_next_host_claim_at_once(stub):
    assert claim(stub, "host-a").outcome == pb.CLAIM_OUTCOME_GRANTED
    assert not stub.ReleaseClaim(pb.ReleaseClaimRequest(key="k", holder="host-b"), timeout=5,
                                 metadata=AUTH).released
    assert stub.ReleaseClaim(pb.ReleaseClaimRequest(key="k", holder="host-a"), timeout=5,
                             metadata=AUTH).released
    assert claim(stub, "host-b").outcome == pb.CLAIM_OUTCOME_GRANTED


def test_a_claim_never_waits_past_the_callers_deadline(stub):
    assert claim(stub, "host-a").outcome == pb.CLAIM_OUTCOME_GRANTED
    started = time.monotonic()
    reply = claim(stub, "host-b", wait_s=30.0, timeout=0.5)
    assert reply.outcome == pb.CLAIM_OUTCOME_HELD
    assert time.monotonic() - started < 0.5, "the server waited past the caller's deadline"
