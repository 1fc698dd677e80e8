"""The one place where domain errors become gRPC status codes.

Handlers raise `services.common.errors` exceptions; this interceptor aborts the call with the
matching code. Every domain error carries google.rpc.ErrorInfo in the rich status;
`ResourceExhausted` also carries RetryInfo (when to try again) and, when a quota applies (it names
violations or reclaimable memory), QuotaFailure, so a caller can see what was asked, what is free
and what could be reclaimed.
A refusal of who the caller is (UNAUTHENTICATED, PERMISSION_DENIED) leaves one line with the peer
address on the `gpuplane.audit` logger, whether the authorization interceptor or a handler refused
(`authz.audit_unaudited`).
Anything unexpected is logged with its traceback and returned as INTERNAL with a short reference
id: never UNKNOWN, never a stack trace to the client.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common import errors
from services.common.authz import audit_unaudited

log = logging.getLogger(__name__)


def status_for(exc: errors.GpuplaneError) -> status_pb2.Status:
    """The google.rpc.Status a domain error travels as."""
    code = getattr(code_pb2, exc.code)
    status = status_pb2.Status(code=code, message=exc.message)
    info = error_details_pb2.ErrorInfo(
        reason=type(exc).__name__, domain="gpuplane",
        metadata={k: str(v) for k, v in (exc.details or {}).items()},
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    status.details.append(detail)
    if isinstance(exc, errors.ResourceExhausted):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
        retry = any_pb2.Any()
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        status.details.append(retry)
    if isinstance(exc, errors.ResourceExhausted) and (exc.violations or exc.reclaimable):
        quota = error_details_pb2.QuotaFailure()
        for v in exc.violations:
            quota.violations.add(subject=v.subject, description=v.description)
        for hint in exc.reclaimable:
            quota.violations.add(
                subject=f"reclaimable:worker/{hint.worker_id}/zone/{hint.zone}",
                description=f"{hint.bytes} bytes could be given back"
                + (f", {hint.cached_bytes} of them cached" if hint.cached_bytes else ""),
            )
        packed = any_pb2.Any()
        packed.Pack(quota)
        status.details.append(packed)
    return status


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, errors.GpuplaneError):
        audit_unaudited(exc, method, context)
        log.info("request refused", extra={"method": method, "code": exc.code, "reason": exc.message})
        status = rpc_status.to_status(status_for(exc))
        # Set code and details first: tracing wrappers record the status on the span from these
        # calls, while abort_with_status alone passes them by.
        context.set_code(status.code)
        context.set_details(status.details)
        context.abort_with_status(status)
    ref = uuid.uuid4().hex[:12]
    log.error("unexpected error", exc_info=exc, extra={"method": method, "ref": ref})
    context.abort(grpc.StatusCode.INTERNAL, f"internal error (ref {ref}; see the server log)")


def _already_aborted(context: grpc.ServicerContext) -> bool:
    # context.abort() raises a bare Exception after setting the code; let it through untouched.
    code = context.code() if hasattr(context, "code") else None
    return code is not None and code != grpc.StatusCode.OK


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions escaping unary and server-streaming handlers to status codes."""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return inner(request, context)
                except Exception as exc:  # the mapping point: every error becomes a status
                    if _already_aborted(context):
                        raise
                    _abort(context, exc, method)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_stream(request, context)
                except Exception as exc:
                    if _already_aborted(context):
                        raise
                    _abort(context, exc, method)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler
