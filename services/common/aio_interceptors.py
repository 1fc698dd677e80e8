"""The error and authorization interceptors for a `grpc.aio` server (services.common.aio_server).

Same contract as their sync originals, whose logic they reuse rather than copy: domain errors
become the status `interceptors.status_for` builds (details included), anything unexpected is
INTERNAL with a reference id, and authorization (`authz.AuthorizationInterceptor.check`) decides
before the handler runs, auditing each refusal. Only the wrapping differs: handlers are
coroutines (unary) or async generators (server streaming), and aborting is awaited.

They wrap each method's handler once, when it is registered (`wrap(method, handler)`, applied by
`aio_server`), not per call: a `grpc.aio.ServerInterceptor` is awaited on every call to find the
handler (two coroutines and a partial in gRPC's chain, then ours), ~5 us of the governor's CPU
per call for a lookup whose answer never changes. What runs per call is the same wrapper.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from grpc_status import rpc_status

from services.common import errors
from services.common.authz import (
    AUDITED_REFUSALS,
    PUBLIC_SERVICES,
    AuthorizationInterceptor,
    Policy,
    Rule,
    audit_call,
    audit_unaudited,
)
from services.common.interceptors import status_for

log = logging.getLogger("services.common.interceptors")  # one logger for both flavours


def _already_aborted(context: grpc.aio.ServicerContext) -> bool:
    code = context.code()
    return code is not None and code != grpc.StatusCode.OK


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, errors.GpuplaneError):
        audit_unaudited(exc, method, context)
        log.info("request refused", extra={"method": method, "code": exc.code, "reason": exc.message})
        status = rpc_status.to_status(status_for(exc))
        # As in the sync flavour: tracing records the status from these, not from the abort.
        context.set_code(status.code)
        context.set_details(status.details)
        await context.abort_with_status(status)
    ref = uuid.uuid4().hex[:12]
    log.error("unexpected error", exc_info=exc, extra={"method": method, "ref": ref})
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (ref {ref}; see the server log)")


def _rewrap(handler: Any, unary: Callable | None, stream: Callable | None) -> Any:
    if unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_stream_rpc_method_handler(
        stream, handler.request_deserializer, handler.response_serializer)


class AioErrorInterceptor:
    """Maps exceptions escaping async unary and server-streaming handlers to status codes."""

    @staticmethod
    def wrap(method: str, handler: Any) -> Any:
        """`handler` of `method` with its errors mapped; other kinds of handler unchanged."""
        if not (handler.unary_unary or handler.unary_stream):
            return handler
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner(request, context)
                except Exception as exc:  # the mapping point: every error becomes a status
                    if _already_aborted(context):
                        raise
                    await _abort(context, exc, method)

            return _rewrap(handler, unary_unary, None)
        inner_stream = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in inner_stream(request, context):
                    yield item
            except Exception as exc:
                if _already_aborted(context):
                    raise
                await _abort(context, exc, method)

        return _rewrap(handler, None, unary_stream)


class AioAuthorizationInterceptor:
    """Enforces `rules` with `policy` on an aio server; wrap inside AioErrorInterceptor."""

    def __init__(self, policy: Policy, rules: Mapping[str, Rule]) -> None:
        self._gate = AuthorizationInterceptor(policy, rules)  # its checks and principal cache

    def wrap(self, method: str, handler: Any) -> Any:
        """`handler` of `method` behind the authorization check; public services unchanged."""
        if method.split("/")[1] in PUBLIC_SERVICES:
            return handler
        rule = self._gate.rules.get(method)
        check = self._gate.check
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                who = check(method, rule, request, context)
                try:
                    return await inner(request, context)
                except AUDITED_REFUSALS as exc:  # the domain's own refusals are audited too
                    audit_call("deny", method, who, context, exc)
                    raise

            return _rewrap(handler, unary_unary, None)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request: Any,
                                   context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                who = check(method, rule, request, context)
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except AUDITED_REFUSALS as exc:
                    audit_call("deny", method, who, context, exc)
                    raise

            return _rewrap(handler, None, unary_stream)

        # No gpuplane RPC streams its requests; refuse rather than pass one through unchecked.
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            check(method, None, request, context)

        return _rewrap(handler, refuse, None)
