"""Outgoing channels: deadlines on every call, retries of idempotent calls on UNAVAILABLE.

Retries are declared in the channel's service config (gRPC's own retry machinery), listed per
method by the caller, so a non-idempotent call (a Store, an Acquire) is never silently repeated.
"""
from __future__ import annotations

import json
from collections.abc import Iterable

import grpc
from opentelemetry.sdk.trace import TracerProvider

from services.common.server import MAX_MESSAGE_BYTES
from services.common.telemetry import traced_channel


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
    metadata_token: str | None = None,
) -> grpc.Channel:
    """A traced insecure channel to `target` with retry config for `idempotent_methods`."""
    options = [
        ("grpc.service_config", service_config(service, idempotent_methods)),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Reconnect quickly after a peer restarts instead of backing off for up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    channel = grpc.insecure_channel(target, options=options)
    return traced_channel(channel, tracer_provider)
