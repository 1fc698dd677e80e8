"""Fixtures: a real kernel cache server on a loopback port (port 0) over a fresh SQLite file."""
from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from cache_service.config import ServerConfig
from cache_service.server import CacheServer, start_cache_server
from cache_service.store import StoreConfig
from tests.cache_service.cache_helpers import TOKEN


@pytest.fixture
def start_server(tmp_path: pathlib.Path) -> Iterator[Callable[..., CacheServer]]:
    started: list[CacheServer] = []

    def start(write_token: str | None = TOKEN, maintenance_s: float = 3600,
              **store: object) -> CacheServer:
        config = ServerConfig(listen="127.0.0.1:0", db=tmp_path / f"cache{len(started)}.sqlite",
                              store=StoreConfig(**store), write_token=write_token,
                              maintenance_s=maintenance_s)
        server = start_cache_server(config, TracerProvider(), CollectorRegistry())
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace=0.5)


@pytest.fixture
def server(start_server: Callable[..., CacheServer]) -> CacheServer:
    return start_server()
