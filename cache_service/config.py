"""Server configuration: one frozen object, built from flags whose defaults come from GPUPLANE_CACHE_*."""
from __future__ import annotations

import argparse
import os
import pathlib
from dataclasses import dataclass, field

from cache_service.claims import DEFAULT_MAX_TTL_S, DEFAULT_MAX_WAIT_S, DEFAULT_MAX_WAITERS
from cache_service.hot_tier import DEFAULT_HOT_BYTES
from cache_service.store import DEFAULT_BUDGET_BYTES, DEFAULT_MAX_ARTIFACT_BYTES, StoreConfig
from services.common import security
from services.common.config import VAR_DIR, env_flag, parse_bytes
from services.common.server import MAX_MESSAGE_BYTES

MESSAGE_ENVELOPE_BYTES = 1 << 20  # key, metadata and protobuf framing around an artifact

# Loopback by default: a laptop run must not expose an unauthenticated write path. Pods pass
# --listen=0.0.0.0:PORT (deploy/).
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_DB = pathlib.Path(VAR_DIR) / "kernel_cache.sqlite"


@dataclass(frozen=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    db: pathlib.Path = DEFAULT_DB
    store: StoreConfig = field(default_factory=StoreConfig)
    write_token: str | None = None
    metrics_port: int = 0  # 0 = no /metrics endpoint
    maintenance_s: float = 30.0  # prune, persist access times, vacuum, truncate the WAL
    security: security.ServerSecurity = field(default_factory=security.ServerSecurity)
    max_claim_ttl_s: float = DEFAULT_MAX_TTL_S  # longest single-flight claim a worker may take
    max_claim_wait_s: float = DEFAULT_MAX_WAIT_S  # longest one Claim call waits server-side
    # Claim calls waiting at once; below the server's 32 threads, so the holder's Store that
    # wakes them always finds a thread.
    max_claim_waiters: int = DEFAULT_MAX_WAITERS

    def __post_init__(self) -> None:
        # An artifact must fit in one message with its envelope, or gRPC refuses it with
        # RESOURCE_EXHAUSTED before our INVALID_ARGUMENT can explain why.
        limit = MAX_MESSAGE_BYTES - MESSAGE_ENVELOPE_BYTES
        if self.store.max_artifact_bytes > limit:
            raise ValueError(f"max artifact size {self.store.max_artifact_bytes} must stay below "
                             f"{limit} (the {MAX_MESSAGE_BYTES}-byte gRPC message limit)")
        if self.maintenance_s <= 0:
            raise ValueError("maintenance_s must be positive")
        if self.max_claim_ttl_s <= 0 or self.max_claim_wait_s < 0:
            raise ValueError("max_claim_ttl_s must be positive and max_claim_wait_s not negative")
        if not 0 <= self.max_claim_waiters <= 24:
            raise ValueError("max_claim_waiters must be in [0, 24]: waiters may not take the "
                             "threads (32) that the Stores waking them need")


def parse_namespace_budget(text: str) -> tuple[str, int]:
    ns, sep, size = text.partition("=")
    if not sep or not ns:
        raise argparse.ArgumentTypeError(f"expected NS=BYTES (e.g. prod=128MiB), got {text!r}")
    return ns.strip(), parse_bytes(size)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    env_flag(parser, "--listen", "GPUPLANE_CACHE_LISTEN", DEFAULT_LISTEN, "HOST:PORT to serve on")
    env_flag(parser, "--db", "GPUPLANE_CACHE_DB", DEFAULT_DB, "SQLite file (local disk, never NFS)",
             type=pathlib.Path)
    env_flag(parser, "--budget-bytes", "GPUPLANE_CACHE_BUDGET_BYTES", DEFAULT_BUDGET_BYTES,
             "global LRU byte budget, e.g. 256MiB (0 = unbounded)", type=parse_bytes)
    env_flag(parser, "--write-token", "GPUPLANE_CACHE_WRITE_TOKEN", None,
             "bearer token that Store and Prune require (reads stay open)")
    # Repeatable flag; the env default is a comma-separated list of NS=BYTES.
    raw = os.environ.get("GPUPLANE_CACHE_NAMESPACE_BUDGETS", "")
    defaults = [parse_namespace_budget(t) for t in raw.split(",") if t.strip()]
    parser.add_argument("--namespace-budget", action="append", type=parse_namespace_budget,
                        default=None, metavar="NS=BYTES",
                        help="per-namespace budget, repeatable (env GPUPLANE_CACHE_NAMESPACE_BUDGETS"
                             f"=ns=bytes,...; default {defaults or 'none'})")
    parser.set_defaults(namespace_budget_env=defaults)
    env_flag(parser, "--metrics-port", "GPUPLANE_CACHE_METRICS_PORT", 0,
             "Prometheus /metrics port (0 = off)", type=int)
    env_flag(parser, "--low-watermark", "GPUPLANE_CACHE_LOW_WATERMARK", 0.9,
             "fraction of a budget that pruning goes down to", type=float)
    env_flag(parser, "--max-artifact-bytes", "GPUPLANE_CACHE_MAX_ARTIFACT_BYTES",
             DEFAULT_MAX_ARTIFACT_BYTES, "largest artifact accepted", type=parse_bytes)
    env_flag(parser, "--hot-bytes", "GPUPLANE_CACHE_HOT_BYTES", DEFAULT_HOT_BYTES,
             "in-memory tier of verified artifacts, e.g. 64MiB (0 = off)", type=parse_bytes)
    env_flag(parser, "--maintenance-s", "GPUPLANE_CACHE_MAINTENANCE_S", 30.0,
             "seconds between maintenance passes", type=float)
    security.add_server_flags(parser, "CACHE")
    env_flag(parser, "--max-claim-ttl-s", "GPUPLANE_CACHE_MAX_CLAIM_TTL_S", DEFAULT_MAX_TTL_S,
             "longest single-flight compile claim a worker may take", type=float)
    env_flag(parser, "--max-claim-wait-s", "GPUPLANE_CACHE_MAX_CLAIM_WAIT_S", DEFAULT_MAX_WAIT_S,
             "longest one Claim call waits on the server (clients loop)", type=float)
    env_flag(parser, "--max-claim-waiters", "GPUPLANE_CACHE_MAX_CLAIM_WAITERS",
             DEFAULT_MAX_WAITERS, "Claim calls that may wait at once (the rest poll)", type=int)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    budgets = dict(args.namespace_budget if args.namespace_budget is not None
                   else args.namespace_budget_env)
    return ServerConfig(
        listen=args.listen, db=args.db, write_token=args.write_token or None,
        metrics_port=args.metrics_port, maintenance_s=args.maintenance_s,
        security=security.server_security_from_args(args),
        max_claim_ttl_s=args.max_claim_ttl_s, max_claim_wait_s=args.max_claim_wait_s,
        max_claim_waiters=args.max_claim_waiters,
        store=StoreConfig(budget_bytes=args.budget_bytes, namespace_budgets=budgets,
                          low_watermark=args.low_watermark,
                          max_artifact_bytes=args.max_artifact_bytes,
                          hot_bytes=args.hot_bytes),
    )
