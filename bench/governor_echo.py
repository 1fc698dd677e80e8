"""The ceiling of any governor optimisation in Python: GovernorService on grpc.aio with no ledger.

    python bench/governor_echo.py HOST:PORT

A bench instrument, never a governor: it answers RegisterWorker, Acquire, Release and
DeregisterWorker with messages of the real ones' shape (a lease with a 16-hex-digit id) without
admitting, storing or intercepting anything. What `governor_bench.py --ceiling` measures against
it is what Python gRPC alone costs per call on the same clients: no change to the ledger, its
SQLite writes or the interceptors can make the governor faster than this.
"""
from __future__ import annotations

import asyncio
import itertools
import sys

import grpc
from gpuplane.governor.v1 import governor_pb2 as pb
from gpuplane.governor.v1 import governor_pb2_grpc


class EchoGovernor(governor_pb2_grpc.GovernorServiceServicer):
    def __init__(self) -> None:
        self._ids = itertools.count()

    async def RegisterWorker(self, request, context):
        return pb.RegisterWorkerResponse(lease_ttl_ms=30_000, device_budget_bytes=1 << 50)

    async def DeregisterWorker(self, request, context):
        return pb.DeregisterWorkerResponse()

    async def Acquire(self, request, context):
        return pb.AcquireResponse(lease=pb.Lease(
            lease_id=f"l-{next(self._ids):016x}", worker_id=request.worker_id,
            device_uuid=request.device_uuid or "GPU-bench", zone=request.zone, bytes=request.bytes,
            expires_at_unix_ms=0))

    async def Release(self, request, context):
        return pb.ReleaseResponse(released_bytes=0)


async def serve(listen: str) -> None:
    server = grpc.aio.server()
    governor_pb2_grpc.add_GovernorServiceServicer_to_server(EchoGovernor(), server)
    port = server.add_insecure_port(listen)
    await server.start()
    print(f"governor echo listening on port {port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
