"""bench/cache_echo.py, the bare server `cache_service_bench.py --ceiling` measures against."""
from __future__ import annotations

import grpc
import pytest

from bench.cache_echo import BYTES_METHOD, EMPTY_METHOD, start
from bench.cache_service_bench import artifact, hit_response_bytes


@pytest.fixture
def channel():
    server, port = start("127.0.0.1:0")
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 64 << 20)]) as ch:
        yield ch
    server.stop(0)


def test_the_bare_server_answers_exactly_the_bytes_a_hit_of_each_size_sends(channel):
    for size in (16 << 10, 256 << 10, 4 << 20):
        wanted = hit_response_bytes(artifact(size, f"k{size}"))
        assert size < wanted < size + 512, "a hit's response is its bytes plus a little metadata"
        got = channel.unary_unary(BYTES_METHOD)(str(wanted).encode(), timeout=10)
        assert len(got) == wanted
    assert channel.unary_unary(EMPTY_METHOD)(b"", timeout=10) == b""


@pytest.mark.parametrize("request_bytes", [b"", b"-1", b"lots", str(65 << 20).encode()])
def test_a_byte_count_that_is_not_one_is_invalid_argument(channel, request_bytes):
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(BYTES_METHOD)(request_bytes, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
