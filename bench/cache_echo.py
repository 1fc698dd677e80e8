"""The transport's own ceiling for a kernel cache hit: a bare gRPC server that returns N bytes.

    python bench/cache_echo.py HOST:PORT

A bench instrument, never a cache: two unary methods behind a generic handler, no protobuf, no
interceptors, no store. `Bytes` takes the decimal byte count as its request and answers that many
bytes (built once per count and reused, as the hot tier reuses an artifact's bytes); `Empty`
answers nothing. It runs as its own process with the cache server's threading model and process
settings (a sync server on a 32-thread pool, the same message limits, large blocks kept in the
malloc heap), so what `cache_service_bench.py --ceiling` measures against it is what Python gRPC
alone costs to move a hit's bytes on the same clients: no change to the cache service can make a
hit cheaper than `Bytes` of the same size.
"""
from __future__ import annotations

import pathlib
import sys
import threading
from concurrent import futures

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVICE = "gpuplane.bench.CacheEcho"
BYTES_METHOD = f"/{SERVICE}/Bytes"
EMPTY_METHOD = f"/{SERVICE}/Empty"
MAX_REPLY_BYTES = 64 << 20  # the cache server's message limit (services.common.server)


class _Replies:
    """One immutable reply per requested size, built on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_size: dict[int, bytes] = {}

    def bytes(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            size = int(request)
        except ValueError:
            size = -1
        if not 0 <= size <= MAX_REPLY_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request must be a byte count in [0, {MAX_REPLY_BYTES}]")
        with self._lock:
            reply = self._by_size.get(size)
            if reply is None:
                reply = self._by_size[size] = bytes(range(256)) * (size // 256) + b"\0" * (size % 256)
        return reply

    @staticmethod
    def empty(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""


def start(listen: str) -> tuple[grpc.Server, int]:
    """Serve `Bytes` and `Empty` on `listen` (port 0 = any free port); returns (server, port)."""
    replies = _Replies()
    handlers = {"Bytes": grpc.unary_unary_rpc_method_handler(replies.bytes),
                "Empty": grpc.unary_unary_rpc_method_handler(replies.empty)}
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpc"),
        options=[("grpc.max_receive_message_length", MAX_REPLY_BYTES),
                 ("grpc.max_send_message_length", MAX_REPLY_BYTES),
                 ("grpc.so_reuseport", 0)])
    # Registered the way generated code registers a servicer (generic and registered handlers),
    # so that the call is matched to its handler on the same path as the cache's Lookup.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
    port = server.add_insecure_port(listen)
    server.start()
    return server, port


if __name__ == "__main__":
    from cache_service.malloc import keep_large_blocks_in_heap

    keep_large_blocks_in_heap()  # as start_cache_server does: a process setting, not the service
    _server, _port = start(sys.argv[1])
    print(f"cache echo listening on port {_port}", flush=True)
    _server.wait_for_termination()
