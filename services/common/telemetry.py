"""OpenTelemetry tracing for servers and clients, configured from the standard OTEL_* variables.

Honoured: OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_EXPORTER (console | otlp |
none; default none), OTEL_EXPORTER_OTLP_ENDPOINT. Health checks are excluded from traces.
Tests pass their own TracerProvider (with an in-memory exporter) instead of the global one, so
three services in one process can each carry their own service name.
"""
from __future__ import annotations

import collections
import os
import weakref
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import (
    aio_server_interceptor,
    client_interceptor,
    grpcext,
    server_interceptor,
)
from opentelemetry.instrumentation.grpc.filters import any_of, health_check, negate, service_prefix
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

_configured: dict[str, TracerProvider] = {}
# Providers made with no exporter. Tracing one costs ~185 us per call on a 2-core host (495 vs
# 310 us p50 per unary call, 2026-11-29), most of a cache hit's budget, so servers and channels
# skip the interceptors when nothing would ever collect the spans. A WeakSet rather than ids: a
# dropped provider's id can be reused by a new, recording one.
_silent: weakref.WeakSet[TracerProvider] = weakref.WeakSet()


def _exporter_from_env() -> SpanExporter | None:
    name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if name in ("", "none"):
        return None
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_ENDPOINT itself
    raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not one of console, otlp, none")


def tracer_provider(service: str) -> TracerProvider:
    """The process's provider for `service`, made once from the environment and set as global."""
    if service in _configured:
        return _configured[service]
    name = os.environ.get("OTEL_SERVICE_NAME", service)
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES (pod name, node, ...) into the resource.
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    exporter = _exporter_from_env()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        _silent.add(provider)
    if not _configured:
        trace.set_tracer_provider(provider)
    _configured[service] = provider
    return provider


def is_recording(provider: object) -> bool:
    """False for the no-exporter providers made here and for the API's no-op/proxy providers."""
    return isinstance(provider, TracerProvider) and provider not in _silent


def _not_noise() -> Any:
    return negate(any_of(health_check(), service_prefix("grpc.reflection")))


def server_tracing_interceptor(provider: TracerProvider) -> grpc.ServerInterceptor:
    return server_interceptor(tracer_provider=provider, filter_=_not_noise())


def aio_server_tracing_interceptor(provider: TracerProvider) -> grpc.aio.ServerInterceptor:
    return aio_server_interceptor(tracer_provider=provider, filter_=_not_noise())


def traced_channel(channel: grpc.Channel, provider: TracerProvider | None) -> grpc.Channel:
    """Wrap `channel` so outgoing calls carry the current trace context in their metadata."""
    provider = provider or trace.get_tracer_provider()
    if not is_recording(provider):
        # No client spans, but the caller's trace context still travels, so a traced caller
        # behind an untraced hop keeps one trace.
        return grpc.intercept_channel(channel, _PropagateContext())
    # OTel's client interceptor implements its own grpcext interfaces, not grpc's:
    # grpc.intercept_channel rejects it with a TypeError, so wrap through grpcext.
    interceptor = client_interceptor(tracer_provider=provider, filter_=_not_noise())
    return grpcext.intercept_channel(channel, interceptor)


def trace_context_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context (W3C traceparent) as call metadata; empty outside any trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


class _PropagateContext(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Injects the current trace context (W3C traceparent) into outgoing metadata; no spans."""

    @staticmethod
    def _with_context(details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        context = trace_context_metadata()
        if not context:
            return details
        metadata = list(details.metadata or []) + list(context)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        return continuation(self._with_context(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[override]
        return continuation(self._with_context(details), request)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass
