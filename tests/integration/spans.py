"""Span assertion helpers: one in-memory exporter per service, traces joined across them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind


@dataclass
class Traced:
    """A TracerProvider per service name, each exporting synchronously into its own memory."""

    providers: dict[str, TracerProvider] = field(default_factory=dict)
    exporters: dict[str, InMemorySpanExporter] = field(default_factory=dict)

    def provider(self, service: str) -> TracerProvider:
        if service not in self.providers:
            provider = TracerProvider(resource=Resource.create({"service.name": service}))
            exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            self.providers[service], self.exporters[service] = provider, exporter
        return self.providers[service]

    def spans(self, service: str | None = None) -> list[tuple[str, ReadableSpan]]:
        services = [service] if service else list(self.exporters)
        return [(s, span) for s in services for span in self.exporters[s].get_finished_spans()]

    def clear(self) -> None:
        for exporter in self.exporters.values():
            exporter.clear()

    def shutdown(self) -> None:
        for provider in self.providers.values():
            provider.shutdown()


def rpc_span(traced: Traced, service: str, method: str, kind: SpanKind, trace_id: int | None = None,
             timeout_s: float = 5.0) -> ReadableSpan:
    """The finished span of `method` ("Service/Method" suffix) recorded by `service`, waiting for it:
    a server span ends just after its response reached the client."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [span for _, span in traced.spans(service)
                 if span.name.endswith(method) and span.kind == kind
                 and (trace_id is None or span.context.trace_id == trace_id)]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            names = sorted({f"{s}:{span.name}:{span.kind.name}" for s, span in traced.spans()})
            raise AssertionError(f"no {kind.name} span for {method} recorded by {service}; "
                                 f"recorded: {names}")
        time.sleep(0.02)


def trace_spans(traced: Traced, trace_id: int) -> list[tuple[str, ReadableSpan]]:
    return [(s, span) for s, span in traced.spans() if span.context.trace_id == trace_id]


def ancestors(traced: Traced, span: ReadableSpan) -> list[ReadableSpan]:
    """The chain of parents of `span` across every service's spans, nearest first."""
    by_id = {sp.context.span_id: sp for _, sp in traced.spans()}
    chain = []
    parent = span.parent
    while parent is not None and parent.span_id in by_id:
        node = by_id[parent.span_id]
        chain.append(node)
        parent = node.parent
    return chain


def assert_rpc_attributes(span: ReadableSpan, service: str, method: str, code: int = 0) -> None:
    attrs = span.attributes or {}
    assert attrs.get("rpc.system") == "grpc", f"{span.name}: rpc.system is {attrs.get('rpc.system')!r}"
    assert attrs.get("rpc.service") == service, f"{span.name}: rpc.service is {attrs.get('rpc.service')!r}"
    assert attrs.get("rpc.method") == method, f"{span.name}: rpc.method is {attrs.get('rpc.method')!r}"
    assert attrs.get("rpc.grpc.status_code") == code, \
        f"{span.name}: rpc.grpc.status_code is {attrs.get('rpc.grpc.status_code')!r}, expected {code}"
