"""RunningServer.set_serving: a server that is up but cannot take work says so on grpc.health.v1,
overall and per service, on the thread-pool and the aio server alike."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from services.common.aio_server import create_aio_server
from services.common.server import ServiceRegistration, create_server

SERVICE = "gpuplane.test.v1.Standing"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, \
    health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("create", [create_server, create_aio_server], ids=["sync", "aio"])
def test_set_serving_flips_overall_and_per_service_health_and_does_nothing_after_stop(create):
    handler = grpc.method_handlers_generic_handler(SERVICE, {})
    running = create("127.0.0.1:0", [ServiceRegistration(
        SERVICE, object(), lambda _s, server: server.add_generic_rpc_handlers((handler,)))],
        TracerProvider())
    channel = grpc.insecure_channel(running.address)
    health = health_pb2_grpc.HealthStub(channel)

    def statuses() -> list[int]:
        return [health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                for name in ("", SERVICE)]

    try:
        assert statuses() == [SERVING, SERVING], "negative control: a started server serves"
        running.set_serving(False)
        assert statuses() == [NOT_SERVING, NOT_SERVING]
        running.set_serving(True)
        assert statuses() == [SERVING, SERVING]
    finally:
        channel.close()
        running.stop(grace=0)
    running.set_serving(True)  # after stop: no error, and nothing to flip back
