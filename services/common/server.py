"""One way to start a gpuplane gRPC server.

`create_server(...)` binds, registers the servicers with health (overall and per service) and
reflection, installs the tracing and error interceptors, starts, and returns a `RunningServer`
with the bound port (pass port 0 in tests). `RunningServer.stop()` drains gracefully: health
flips to NOT_SERVING first, so load balancers and Kubernetes readiness probes stop sending new
calls before in-flight ones are cut off.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from services.common.authz import AuthorizationInterceptor, Rule
from services.common.interceptors import ErrorInterceptor
from services.common.security import ServerSecurity
from services.common.telemetry import is_recording, server_tracing_interceptor
from services.common.tls import server_credentials

log = logging.getLogger(__name__)

# Kernel artifacts (CUBIN of a large module) and embedding batches are the biggest messages. 64 MiB
# leaves room for a batch of CUBINs while still refusing a runaway request before it is buffered.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# How long in-flight calls get to finish after SIGTERM. Kubernetes' terminationGracePeriodSeconds
# (deploy/) is set longer than this plus the preStop pause, so the kubelet never SIGKILLs a drain.
DEFAULT_GRACE_SECONDS = 10.0


@dataclass
class ServiceRegistration:
    """A servicer and how to add it: `add(servicer, server)` and its full service name."""

    full_name: str
    servicer: object
    add: Callable[[object, grpc.Server], None]


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: list[str]
    health_port: int = 0  # the plaintext health-only port (--health-listen), 0 when none
    on_stop: list[Callable[[], None]] = field(default_factory=list)
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        """Flip health to NOT_SERVING, stop accepting calls, wait up to `grace` for in-flight ones."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        for hook in self.on_stop:
            try:
                hook()
            except Exception:  # shutdown must finish
                log.exception("stop hook failed")
        log.info("server stopped", extra={"port": self.port})

    def wait(self) -> None:
        self.server.wait_for_termination()

    def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING, overall and per service, from any thread: for a
        server that is up but cannot take work (a worker refused its governor registration).
        After stop() it does nothing (draining stays NOT_SERVING)."""
        if self._stopped.is_set():
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def serve_until_signalled(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        """Block until SIGTERM or SIGINT, then drain. Call from the main thread."""
        done = threading.Event()

        def _on_signal(signum: int, _frame: object) -> None:
            log.info("signal received, draining", extra={"signal": signal.Signals(signum).name})
            done.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        # Wake up regularly: a signal delivered to a native thread (NVRTC, gRPC core) only sets
        # Python's pending flag, and a main thread blocked in an untimed wait never runs the handler.
        while not done.wait(0.25):
            pass
        self.stop(grace)


def create_server(
    listen: str,
    services: list[ServiceRegistration],
    tracer_provider: TracerProvider,
    max_workers: int = 32,
    extra_interceptors: list[grpc.ServerInterceptor] | None = None,
    security: ServerSecurity | None = None,
    access: Mapping[str, Rule] | None = None,
) -> RunningServer:
    """Bind `listen` (HOST:PORT, port 0 = any free port), register `services`, start serving.

    `security` adds TLS (mutual with a client CA) and, when it maps roles or tokens, enforces
    `access` (full method path -> Rule, see services.common.authz) on every call."""
    security = security or ServerSecurity()
    # Tracing is outermost so its span sees the status the error interceptor sets; it is left out
    # when the provider exports nowhere (OTEL_TRACES_EXPORTER=none), see telemetry._silent.
    tracing = [server_tracing_interceptor(tracer_provider)] if is_recording(tracer_provider) else []
    interceptors: list[grpc.ServerInterceptor] = [
        *tracing,
        *(extra_interceptors or []),
        ErrorInterceptor(),
    ]
    if security.policy.enforcing:
        # Inside the error interceptor, which maps its refusals to status codes.
        interceptors.append(AuthorizationInterceptor(security.policy, access or {}))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.full_name for s in services]
    for s in services:
        s.add(s.servicer, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    if security.tls is not None:
        port = server.add_secure_port(listen, server_credentials(security.tls))
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind {listen!r}: is the port already in use?")
    health_only, health_port = None, 0
    if security.health_listen:
        health_only, health_port = _health_server(security.health_listen, health_servicer)
    server.start()
    if health_only is not None:
        health_only.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("server started", extra={
        "listen": listen, "port": port, "services": names, "health_port": health_port,
        "tls": "off" if security.tls is None else ("mutual" if security.tls.mutual else "server"),
        "authorization": security.policy.enforcing})
    running = RunningServer(server=server, port=port, health=health_servicer, service_names=names,
                            health_port=health_port)
    if health_only is not None:
        running.on_stop.append(lambda: health_only.stop(0).wait())
    return running


def _health_server(listen: str, servicer: health.HealthServicer) -> tuple[grpc.Server, int]:
    """A plaintext server with only the shared health servicer: Kubernetes' native gRPC probe
    cannot speak TLS, and this port reveals nothing but SERVING / NOT_SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
                         options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind the health port {listen!r}: is it already in use?")
    return server, port
