"""`create_aio_server`: `create_server`'s contract on a `grpc.aio` server (one event loop).

Why: the sync server hands every call from gRPC's poller thread to a pool thread and back, and
the GIL hand-offs cost more than a small handler does. On one event loop a call is a task: no
thread hop. Measured on the governor (2-core VM, 32 closed-loop clients, docs/governor.md):
server CPU ~370 us per call against ~450-670 us on the sync server.
Contract: the same as `create_server` - health (overall and per service), reflection, tracing
(when recording), error mapping, authorization, TLS, the plaintext health-only port, and a
`RunningServer` whose `stop()` flips health to NOT_SERVING before draining in-flight calls.
Servicers must be async (coroutines, async generators for server streaming).
Hazard: every call runs on the loop, in its own thread: a handler that blocks (a lock held for
long, a sleep, an fsync per call) stalls every other call. Quick domain calls run inline; anything
that may wait goes to a thread (`asyncio.to_thread` / `loop.run_in_executor`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AioHealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from services.common.aio_interceptors import AioAuthorizationInterceptor, AioErrorInterceptor
from services.common.authz import Rule
from services.common.security import ServerSecurity
from services.common.server import (
    DEFAULT_GRACE_SECONDS,
    MAX_MESSAGE_BYTES,
    RunningServer,
    ServiceRegistration,
)
from services.common.telemetry import aio_server_tracing_interceptor, is_recording
from services.common.tls import server_credentials

log = logging.getLogger(__name__)
T = TypeVar("T")


def _options(max_receive_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0)]


@dataclass
class AioRunningServer(RunningServer):
    """A `RunningServer` whose server lives on an event loop in its own thread."""

    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    health_only: grpc.aio.Server | None = None
    _ended: threading.Event = field(default_factory=threading.Event)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the server's loop from any other thread; its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.run(self._drain(grace))
        for hook in self.on_stop:
            try:
                hook()
            except Exception:  # shutdown must finish
                log.exception("stop hook failed")
        assert self.loop is not None and self.thread is not None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self._ended.set()
        log.info("server stopped", extra={"port": self.port})

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def _drain(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_only is not None:
            await self.health_only.stop(0)

    def wait(self) -> None:
        self._ended.wait()

    def set_serving(self, serving: bool) -> None:
        if self._stopped.is_set():
            return
        self.run(self._set_serving(serving), timeout=5)


class _WrappingRegistrar:
    """What the generated `add_*_to_server` functions register on: the server, with every method
    handler passed through `wrappers` (innermost first) on its way in."""

    def __init__(self, server: grpc.aio.Server, wrappers: list[Callable[[str, Any], Any]]) -> None:
        self._server = server
        self._wrappers = wrappers

    def _wrap(self, method: str, handler: Any) -> Any:
        for wrap in self._wrappers:
            handler = wrap(method, handler)
        return handler

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self._wrap(f"/{service}/{name}", h) for name, h in handlers.items()})

    def add_generic_rpc_handlers(self, generic_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_WrappedGeneric(g, self._wrap) for g in generic_handlers))


class _WrappedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose answers are wrapped, once per method (gRPC asks on every call
    that no registered handler serves)."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Callable[[str, Any], Any]) -> None:
        self._inner = inner
        self._wrap = wrap
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (inner's handler, ours)

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(details)
        if handler is None:
            return None
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(details.method, handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped


def _loop_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="grpc-aio", daemon=True)
    thread.start()
    started.wait()
    return loop, thread


def create_aio_server(
    listen: str,
    services: list[ServiceRegistration],
    tracer_provider: TracerProvider,
    security: ServerSecurity | None = None,
    access: Mapping[str, Rule] | None = None,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> AioRunningServer:
    """`create_server` for async servicers: bind `listen`, register, serve on a loop thread.

    `max_receive_bytes`: gRPC refuses a larger request (RESOURCE_EXHAUSTED from gRPC itself,
    before any handler or interceptor, so without rich details) without parsing it."""
    security = security or ServerSecurity()
    loop, thread = _loop_thread()
    try:
        return asyncio.run_coroutine_threadsafe(
            _start(listen, services, tracer_provider, security, access or {}, loop, thread,
                   max_receive_bytes), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        raise


async def _start(listen: str, services: list[ServiceRegistration], tracer_provider: TracerProvider,
                 security: ServerSecurity, access: Mapping[str, Rule],
                 loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 max_receive_bytes: int = MAX_MESSAGE_BYTES) -> AioRunningServer:
    # Same order as create_server: tracing outermost, then errors, then authorization. Tracing
    # stays an interceptor (OpenTelemetry's, only when spans are recorded); errors and
    # authorization wrap each handler once as it is registered (aio_interceptors says why).
    interceptors = [aio_server_tracing_interceptor(tracer_provider)] \
        if is_recording(tracer_provider) else []
    wrappers: list[Callable[[str, Any], Any]] = []
    if security.policy.enforcing:
        wrappers.append(AioAuthorizationInterceptor(security.policy, access).wrap)
    wrappers.append(AioErrorInterceptor.wrap)
    server = grpc.aio.server(interceptors=interceptors, options=_options(max_receive_bytes))
    registrar = _WrappingRegistrar(server, wrappers)
    health = AioHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, registrar)
    names = [s.full_name for s in services]
    for s in services:
        s.add(s.servicer, registrar)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        registrar)
    try:  # grpc.aio raises RuntimeError where the sync server returns port 0
        if security.tls is not None:
            port = server.add_secure_port(listen, server_credentials(security.tls))
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"could not bind {listen!r}: is the port already in use?")
    health_only, health_port = None, 0
    if security.health_listen:
        # Plaintext and health only: Kubernetes' gRPC probe cannot speak TLS (see server.py).
        health_only = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health, health_only)
        try:
            health_port = health_only.add_insecure_port(security.health_listen)
        except RuntimeError:
            health_port = 0
        if health_port == 0:
            raise OSError(f"could not bind the health port {security.health_listen!r}: "
                          "is it already in use?")
    await server.start()
    if health_only is not None:
        await health_only.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("server started", extra={
        "listen": listen, "port": port, "services": names, "health_port": health_port,
        "tls": "off" if security.tls is None else ("mutual" if security.tls.mutual else "server"),
        "authorization": security.policy.enforcing, "flavour": "aio"})
    return AioRunningServer(server=server, port=port, health=health, service_names=names,
                            health_port=health_port, loop=loop, thread=thread,
                            health_only=health_only)
