"""Domain spans of the worker (load, generate, embed), optional where OpenTelemetry is absent."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def span(provider: object, name: str, **attributes: object) -> Iterator[None]:
    """A span with domain attributes (model, shape) when OpenTelemetry is importable."""
    try:
        from opentelemetry import trace
    except ImportError:      # the GPU machine may lack the wheels: tracing is optional there
        yield
        return
    tracer = (provider or trace.get_tracer_provider()).get_tracer("gpu_worker.core.runtime")
    with tracer.start_as_current_span(name, attributes={k: v for k, v in attributes.items()
                                                        if v is not None}):
        yield
