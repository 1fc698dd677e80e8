"""Outgoing channels: deadlines on every call, retries of idempotent calls on UNAVAILABLE.

Retries are declared in the channel's service config (gRPC's own retry machinery), listed per
method by the caller, so a non-idempotent call (a Store, an Acquire) is never silently repeated.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from services.common.identity import bearer_metadata
from services.common.reloading_channel import ReloadingChannel
from services.common.server import MAX_MESSAGE_BYTES
from services.common.telemetry import _CallDetails as CallDetails
from services.common.telemetry import is_recording, trace_context_metadata, traced_channel
from services.common.tls import ChannelTLS


def service_config(service: str, idempotent_methods: Iterable[str]) -> str:
    methods = [{"service": service, "method": m} for m in idempotent_methods]
    config = {
        "methodConfig": [
            {
                "name": methods,
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
        if methods
        else []
    }
    return json.dumps(config)


def open_channel(
    target: str,
    service: str,
    idempotent_methods: Iterable[str] = (),
    tracer_provider: TracerProvider | None = None,
    metadata_token: str | None = None,  # a bearer token sent with every call
    tls: ChannelTLS | None = None,
    extra_options: Iterable[tuple[str, object]] = (),
) -> grpc.Channel:
    """A traced channel to `target` with retry config for `idempotent_methods`: plaintext, or TLS
    (mutual when `tls` carries a client pair) verifying the server against `tls.ca_file`."""
    channel = _plain_channel(target, service, idempotent_methods, tls, extra_options)
    if metadata_token:
        channel = grpc.intercept_channel(channel, _BearerToken(metadata_token))
    return traced_channel(channel, tracer_provider)


@dataclass(frozen=True)
class LeanChannel:
    """A channel whose caller sends `metadata()` with every call (the bearer token and, unless
    the channel makes spans, the current trace context) instead of a Python client interceptor
    adding them: each interceptor costs a call ~40-55 us of client CPU (the kernel cache client,
    docs/cache_service.md), a tenth of a small call's."""

    channel: grpc.Channel
    token: tuple[tuple[str, str], ...]
    propagate: bool  # the caller carries the trace context (no span interceptor on the channel)

    def metadata(self, extra: Iterable[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
        return (*self.token, *extra, *(trace_context_metadata() if self.propagate else ()))


def open_lean_channel(
    target: str,
    service: str,
    idempotent_methods: Iterable[str] = (),
    tracer_provider: TracerProvider | None = None,
    metadata_token: str | None = None,
    tls: ChannelTLS | None = None,
    extra_options: Iterable[tuple[str, object]] = (),
) -> LeanChannel:
    """`open_channel`'s channel for a hot path: the same options, TLS and spans (when a provider
    records them), but the token and the trace context travel in `LeanChannel.metadata()`."""
    channel = _plain_channel(target, service, idempotent_methods, tls, extra_options)
    provider = tracer_provider or trace.get_tracer_provider()
    if is_recording(provider):  # OTel's interceptor makes the spans and propagates their context
        return LeanChannel(traced_channel(channel, provider), bearer_metadata(metadata_token), False)
    return LeanChannel(channel, bearer_metadata(metadata_token), True)


def _plain_channel(target: str, service: str, idempotent_methods: Iterable[str],
                   tls: ChannelTLS | None, extra_options: Iterable[tuple[str, object]],
                   ) -> grpc.Channel:
    options = [
        ("grpc.service_config", service_config(service, idempotent_methods)),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Reconnect quickly after a peer restarts instead of backing off for up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        *extra_options,
    ]
    if tls is None:
        channel = grpc.insecure_channel(target, options=options)
    elif tls.cert_file:  # a client certificate: follow its renewals (reloading_channel)
        channel = ReloadingChannel(lambda creds: grpc.secure_channel(target, creds, options), tls)
    else:
        channel = grpc.secure_channel(target, tls.credentials(), options=options)
    return channel


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call (deployments without mutual TLS)."""

    def __init__(self, token: str) -> None:
        self.metadata = bearer_metadata(token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return CallDetails(details.method, details.timeout,
                            [*(details.metadata or ()), *self.metadata], details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[override]
        return continuation(self._with_token(details), request)
