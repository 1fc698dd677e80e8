"""Signals every service sends on refusal, on the sync and the aio server alike: RetryInfo (and
QuotaFailure where a quota applies) with RESOURCE_EXHAUSTED, and an audit line with the peer
address for every refusal of who the caller is, even on a server without roles or tokens."""
from __future__ import annotations

import logging

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry.sdk.trace import TracerProvider

from services.common import errors
from services.common.aio_server import create_aio_server
from services.common.interceptors import status_for
from services.common.server import ServiceRegistration, create_server

SERVICE = "gpuplane.test.v1.Refusals"
_raw = lambda b: b

REFUSALS = {
    b"quota": errors.ResourceExhausted(
        "asked 64 MiB in zone kv, 12 MiB free", asked_bytes=64 << 20, free_bytes=12 << 20,
        zone="kv", violations=[errors.QuotaViolation("device:GPU-1/zone:kv", "12 MiB free")],
        retry_after_s=2.5),
    b"queue": errors.ResourceExhausted("1024 requests already wait; retry later"),
    b"who": errors.PermissionDenied("checkpoint resolves outside the model root"),
    b"nocred": errors.Unauthenticated("a token is required"),
}


def _sync_unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    raise REFUSALS[request]


async def _aio_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise REFUSALS[request]


SERVERS = {"sync": (create_server, _sync_unary), "aio": (create_aio_server, _aio_unary)}


@pytest.fixture(params=list(SERVERS))
def channel(request):
    create, unary = SERVERS[request.param]
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Unary": grpc.unary_unary_rpc_method_handler(unary, _raw, _raw)})
    registration = ServiceRegistration(
        SERVICE, object(), lambda _s, server: server.add_generic_rpc_handlers((handler,)))
    running = create("127.0.0.1:0", [registration], TracerProvider())
    chan = grpc.insecure_channel(running.address)
    yield chan
    chan.close()
    running.stop(grace=0)


def _refusal(chan: grpc.Channel, what: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        chan.unary_unary(f"/{SERVICE}/Unary", _raw, _raw)(what, timeout=5)
    return info.value


def _details(err: grpc.RpcError) -> dict[str, object]:
    status = rpc_status.from_call(err)
    assert status is not None, "rich status details missing from the trailers"
    found: dict[str, object] = {}
    for detail in status.details:
        for kind in (error_details_pb2.RetryInfo, error_details_pb2.QuotaFailure,
                     error_details_pb2.ErrorInfo):
            message = kind()
            if detail.Unpack(message):
                found[kind.__name__] = message
    return found


def test_resource_exhausted_carries_retry_info_and_the_quota_that_refused(channel):
    err = _refusal(channel, b"quota")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    found = _details(err)
    assert "RetryInfo" in found, "RESOURCE_EXHAUSTED must say when to retry (google.rpc.RetryInfo)"
    assert found["RetryInfo"].retry_delay.ToMilliseconds() == 2500, \
        "RetryInfo must carry the refusing code's own delay"
    assert [v.subject for v in found["QuotaFailure"].violations] == ["device:GPU-1/zone:kv"], \
        "the quota that refused must travel as QuotaFailure"


def test_resource_exhausted_without_a_quota_still_says_when_to_retry_and_sends_no_empty_quota(
        channel):
    found = _details(_refusal(channel, b"queue"))
    assert found["RetryInfo"].retry_delay.ToMilliseconds() == \
        int(errors.DEFAULT_RETRY_AFTER_S * 1000), "the default delay must be sent"
    assert "QuotaFailure" not in found, "an empty QuotaFailure names no quota"


@pytest.mark.parametrize("what,code", [(b"who", "PERMISSION_DENIED"),
                                        (b"nocred", "UNAUTHENTICATED")])
def test_a_refusal_of_who_the_caller_is_leaves_one_audit_line_with_the_peer_address(
        channel, caplog, what, code):
    caplog.set_level(logging.INFO, logger="gpuplane.audit")
    _refusal(channel, what)
    lines = [r for r in caplog.records if r.name == "gpuplane.audit"]
    assert len(lines) == 1, f"one audit line per refusal, got {len(lines)}"
    assert lines[0].code == code and lines[0].audit == "deny"
    assert "127.0.0.1" in lines[0].peer, f"the audit line must name the peer, got {lines[0].peer!r}"


def test_other_refusals_leave_no_audit_line(channel, caplog):
    """Negative control: only refusals of who the caller is are audit events."""
    caplog.set_level(logging.INFO, logger="gpuplane.audit")
    _refusal(channel, b"queue")
    assert not [r for r in caplog.records if r.name == "gpuplane.audit"]


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1.0, 1e300])
def test_a_retry_delay_that_is_not_a_bounded_duration_is_refused_where_it_is_made(delay):
    with pytest.raises(ValueError, match="retry_after_s"):
        errors.ResourceExhausted("full", retry_after_s=delay)


def test_every_domain_error_keeps_its_error_info_and_only_resource_exhausted_gets_retry_info():
    for exc in REFUSALS.values():
        kinds = {d.type_url.rsplit(".", 1)[-1] for d in status_for(exc).details}
        assert "ErrorInfo" in kinds
        assert ("RetryInfo" in kinds) == isinstance(exc, errors.ResourceExhausted)
