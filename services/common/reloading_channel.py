"""A client channel that follows its certificate files: rotation for the caller's side of mTLS.

Hazard: gRPC's channel credentials are fixed when a channel opens, so a long-lived worker would
keep presenting the certificate it started with; once that expires, every reconnection fails.
Contract: `ReloadingChannel` looks at the (mtime, size) of its CA, certificate and key at most
once per `check_interval_s`, on a call; when they changed and the new pair loads, later calls go
through a new channel (a new connection, handshaken with the new certificate). Calls in flight keep
the previous channel, which is closed only at the rotation after next (or on close), so a stream
running across a rotation completes. A pair that does not load (half-written) keeps the current
channel, and the next check tries again. Stubs made once keep working: their multicallables
resolve the current channel on each call.
Cost: a clock read per call, three stat calls per interval.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import grpc

from services.common.errors import InvalidArgument
from services.common.tls import ChannelTLS

log = logging.getLogger(__name__)


class ReloadingChannel(grpc.Channel):
    """A grpc.Channel over `open(credentials)`, reopened when `tls`'s files change."""

    def __init__(self, open_: Callable[[grpc.ChannelCredentials], grpc.Channel], tls: ChannelTLS,
                 check_interval_s: float = 1.0) -> None:
        self._open, self._tls, self.check_interval_s = open_, tls, check_interval_s
        self._lock = threading.Lock()
        self._stamp = tls.stamp()
        self._channel = open_(tls.credentials())
        self._retired: list[grpc.Channel] = []  # the previous channel, for calls still in flight
        self._next_check = time.monotonic() + check_interval_s
        self.reloads = 0

    def current(self) -> grpc.Channel:
        """The channel new calls use, reopened first when the files changed."""
        now = time.monotonic()
        if now >= self._next_check:
            with self._lock:
                if now >= self._next_check:
                    self._next_check = now + self.check_interval_s
                    self._maybe_reload()
        return self._channel

    def _maybe_reload(self) -> None:
        stamp = self._tls.stamp()
        if stamp == self._stamp:
            return
        try:
            credentials = self._tls.credentials()
        except InvalidArgument as err:
            log.warning("client TLS files changed but cannot be loaded; keeping the current "
                        "certificate", extra={"reason": err.message})
            return
        self._retired.append(self._channel)
        if len(self._retired) > 1:
            self._retired.pop(0).close()
        self._channel, self._stamp = self._open(credentials), stamp
        self.reloads += 1
        log.info("client TLS certificate reloaded", extra={"cert": self._tls.cert_file,
                                                           "reloads": self.reloads})

    def _multicallable(self, kind: str, method: str, *args: Any, **kwargs: Any) -> _Dispatch:
        return _Dispatch(self, kind, method, args, kwargs)

    def unary_unary(self, method, *args, **kwargs):  # type: ignore[override]
        return self._multicallable("unary_unary", method, *args, **kwargs)

    def unary_stream(self, method, *args, **kwargs):  # type: ignore[override]
        return self._multicallable("unary_stream", method, *args, **kwargs)

    def stream_unary(self, method, *args, **kwargs):  # type: ignore[override]
        return self._multicallable("stream_unary", method, *args, **kwargs)

    def stream_stream(self, method, *args, **kwargs):  # type: ignore[override]
        return self._multicallable("stream_stream", method, *args, **kwargs)

    def subscribe(self, callback, try_to_connect=False):  # type: ignore[override]
        self.current().subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):  # type: ignore[override]
        self._channel.unsubscribe(callback)

    def close(self) -> None:
        with self._lock:
            for channel in (*self._retired, self._channel):
                channel.close()
            self._retired.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Dispatch:
    """A multicallable that resolves the owner's current channel on each call."""

    def __init__(self, owner: ReloadingChannel, kind: str, method: str, args: tuple,
                 kwargs: dict) -> None:
        self._owner, self._kind, self._method, self._args, self._kwargs = (
            owner, kind, method, args, kwargs)
        self._bound: tuple[grpc.Channel, Any] | None = None

    def _target(self) -> Any:
        channel = self._owner.current()
        bound = self._bound
        if bound is None or bound[0] is not channel:
            bound = (channel, getattr(channel, self._kind)(self._method, *self._args,
                                                            **self._kwargs))
            self._bound = bound
        return bound[1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def with_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._target().with_call(*args, **kwargs)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return self._target().future(*args, **kwargs)
