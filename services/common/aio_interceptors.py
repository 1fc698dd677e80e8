"""The error and authorization interceptors for a `grpc.aio` server (services.common.aio_server).

Same contract as their sync originals, whose logic they reuse rather than copy: domain errors
become the status `interceptors.status_for` builds (details included), anything unexpected is
INTERNAL with a reference id, and authorization (`authz.AuthorizationInterceptor.check`) decides
before the handler runs, auditing each refusal. Only the wrapping differs: handlers are
coroutines (unary) or async generators (server streaming), and aborting is awaited.
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
)
from services.common.interceptors import status_for

log = logging.getLogger("services.common.interceptors")  # one logger for both flavours


def _already_aborted(context: grpc.aio.ServicerContext) -> bool:
    code = context.code()
    return code is not None and code != grpc.StatusCode.OK


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, errors.GpuplaneError):
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


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping async unary and server-streaming handlers to status codes."""

    def __init__(self) -> None:
        # Per method: gRPC's handler and our wrapper of it (both the same on every call).
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(details.method, handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(method: str, handler: Any) -> Any:
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


class AioAuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Enforces `rules` with `policy` on an aio server; install inside AioErrorInterceptor."""

    def __init__(self, policy: Policy, rules: Mapping[str, Rule]) -> None:
        self._gate = AuthorizationInterceptor(policy, rules)  # its checks and principal cache
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.split("/")[1] in PUBLIC_SERVICES:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: Any) -> Any:
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
