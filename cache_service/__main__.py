"""python -m cache_service serve|stats|list|lookup|prune: the server and the operators' CLI.

Each client command maps its flags one to one onto one RPC (or, for `serve`, onto ServerConfig;
for `list`, onto `store.read_entries` over the database file). Errors become exit codes only here,
those of services.common.cli: 0 ok, 1 not found (a lookup miss), 2 usage, 3 the call failed,
4 no server answered.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys
from typing import Any

import grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

from cache_service.auth import bearer_metadata
from cache_service.config import (
    DEFAULT_DB,
    DEFAULT_TARGET,
    add_serve_flags,
    server_config_from_args,
)
from services.common import cli, security
from services.common.channels import open_channel
from services.common.cli import Endpoint, human_bytes
from services.common.config import env_flag, parse_bytes
from services.common.errors import GpuplaneError, NotFound
from services.common.logs import configure_logging

PROG = "python -m cache_service"
EXIT_OK, EXIT_MISS, EXIT_USAGE, EXIT_RPC = cli.EXIT_OK, cli.EXIT_NOT_FOUND, cli.EXIT_USAGE, cli.EXIT_FAILED
EXIT_UNREACHABLE = cli.EXIT_UNREACHABLE


def _parser() -> argparse.ArgumentParser:
    parser = cli.Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_flags(sub.add_parser("serve", help="run the kernel cache server",
                                   description="run the kernel cache server"))
    for name, text in (("stats", "print the cache's stats"),
                       ("lookup", "fetch one artifact (metadata; --out writes its bytes)"),
                       ("prune", "evict LRU entries down to a target (a write: needs the token)")):
        p = sub.add_parser(name, help=text, description=text)
        env_flag(p, "--target", "GPUPLANE_CACHE_TARGET", DEFAULT_TARGET, "server HOST:PORT")
        p.add_argument("--json", action="store_true",
                       help="machine-readable output (sizes in bytes)")
        env_flag(p, "--timeout", "GPUPLANE_CACHE_CLI_TIMEOUT", 10.0, "RPC deadline in seconds",
                 type=float)
        security.add_client_flags(p, "CLI")
        if name == "lookup":
            p.add_argument("key", help="the artifact's cache key (see `list`)")
            p.add_argument("--namespace", default="",
                           help="the key's namespace (default: the default namespace)")
            p.add_argument("--out", metavar="FILE", help="write the artifact's bytes to this file")
        if name == "prune":
            p.add_argument("--target-bytes", type=parse_bytes, default=0, metavar="BYTES",
                           help="prune down to this size, e.g. 64MiB "
                                "(default 0 = each budget's low watermark)")
            env_flag(p, "--write-token", "GPUPLANE_CACHE_WRITE_TOKEN", None,
                     "write bearer token (set the variable rather than the flag: a command "
                     "line is visible to every local user)")
    text = ("list the entries of a database file, most recently used first (reads the file, "
            "also while a server serves it; last use as of its last maintenance pass)")
    p = sub.add_parser("list", help="list keys with size, kind and last use", description=text)
    env_flag(p, "--db", "GPUPLANE_CACHE_DB", str(DEFAULT_DB), "the server's SQLite file",
             type=pathlib.Path)
    p.add_argument("--namespace", default=None, help="only this namespace (default: all)")
    p.add_argument("--limit", type=int, default=0, metavar="N",
                   help="print the N most recently used only (default 0 = all)")
    p.add_argument("--json", action="store_true", help="machine-readable output (sizes in bytes)")
    return parser


def _budget(n: int) -> str:
    return human_bytes(n) if n else "unbounded"


def _stats_text(s: pb.GetStatsResponse) -> list[str]:
    c = s.claims
    lines = [
        (f"entries {s.entries}, {human_bytes(s.total_bytes)} of budget {_budget(s.budget_bytes)} "
        f"(pruned to {s.low_watermark:.0%}), database file {human_bytes(s.db_file_bytes)}, "
        f"largest artifact accepted {human_bytes(s.max_artifact_bytes)}"),
        (f"hits {s.hits}, misses {s.misses}, stores {s.stores}, evictions {s.evictions}; served "
        f"{human_bytes(s.bytes_served)}, compile time saved {s.compile_seconds_saved:.2f}s"),
        (f"in memory: {s.hot_entries} entries, {human_bytes(s.hot_bytes)} of "
        f"{human_bytes(s.hot_budget_bytes) if s.hot_budget_bytes else 'off'}, {s.hot_hits} hits"),
        (f"integrity: {s.corrupt} corrupt, {s.quarantined} quarantined, "
        f"{s.digest_conflicts} digest conflicts"),
        (f"claims: {c.granted} granted, {c.renewed} renewed, {c.waits} waits ({c.wait_hits} hits), "
        f"{c.expired} expired, {c.released} released; {c.active} active, {c.waiting} waiting"),
    ]
    for ns in s.namespaces:
        own = f"budget {human_bytes(ns.budget_bytes)}" if ns.budget_bytes else "global budget only"
        lines.append(f"namespace {ns.namespace}: {ns.entries} entries, "
                     f"{human_bytes(ns.total_bytes)} ({own})")
    return lines


def _lookup_text(r: pb.LookupResponse) -> list[str]:
    if not r.found:
        return ["not found"]
    a = r.artifact
    kind = pb.ArtifactKind.Name(a.kind).removeprefix("ARTIFACT_KIND_").lower()
    return [(f"found: {kind} {a.module_name} for {a.arch or '?'} (nvrtc {a.nvrtc_version or '?'}), "
            f"{human_bytes(len(a.data))}, sha256 {a.sha256}, compile {a.compile_seconds:.3f}s")]


def _print(message: Any, as_json: bool, text: list[str]) -> None:
    if as_json:
        print(json.dumps(cli.message_dict(message), indent=2, sort_keys=True))
    else:
        print("\n".join(text))


def _when(ts: float) -> str:
    if not ts:
        return "never"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _list(args: argparse.Namespace) -> int:
    from cache_service.store import read_entries  # sqlite only: no server, no channel

    prog = f"{PROG} list"
    try:
        entries = read_entries(args.db, args.namespace or None)
    except NotFound as err:
        return cli.fail(prog, err.message, cli.EXIT_NOT_FOUND)
    except GpuplaneError as err:
        return cli.fail(prog, err.message, cli.EXIT_USAGE)
    if args.limit > 0:
        entries = entries[:args.limit]
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=2))
        return EXIT_OK
    print(f"{'namespace':<12} {'kind':<5} {'arch':<7} {'size':>10} {'hits':>6}  "
          f"{'last use (UTC)':<20}  key")
    for e in entries:
        print(f"{e.namespace:<12} {e.kind:<5} {e.arch or '-':<7} {human_bytes(e.size):>10} "
              f"{e.hits:>6}  {_when(e.last_access):<20}  {e.key}")
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    from cache_service.server import start_cache_server  # heavy imports only for the server

    configure_logging("kernel-cache")
    try:
        config = server_config_from_args(args)
        server = start_cache_server(config)
    except GpuplaneError as err:  # inconsistent flags, TLS files that cannot be read
        return cli.fail(f"{PROG} serve", err.message, EXIT_USAGE)
    print(f"kernel cache listening on port {server.port}", file=sys.stderr, flush=True)
    server.running.serve_until_signalled()
    return EXIT_OK


def _client_command(args: argparse.Namespace) -> int:
    prog = f"{PROG} {args.command}"
    try:
        tls = security.channel_tls_from_args(args)
    except GpuplaneError as err:
        return cli.fail(prog, err.message, EXIT_USAGE)
    channel = open_channel(args.target, "gpuplane.kernelcache.v1.KernelCacheService",
                           idempotent_methods=("Lookup", "GetStats"), tls=tls)
    stub = pb_grpc.KernelCacheServiceStub(channel)
    try:
        if args.command == "stats":
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=args.timeout)
            _print(stats, args.json, _stats_text(stats))
        elif args.command == "prune":
            r = stub.Prune(pb.PruneRequest(target_bytes=args.target_bytes),
                           timeout=args.timeout, metadata=bearer_metadata(args.write_token) or None)
            _print(r, args.json, [(f"evicted {r.evicted_entries} entries, freed "
                                  f"{human_bytes(r.freed_bytes)}; {human_bytes(r.total_bytes)} left")])
        else:
            response = stub.Lookup(pb.LookupRequest(key=args.key, namespace=args.namespace),
                                   timeout=args.timeout)
            if args.out and response.found:
                with open(args.out, "wb") as f:
                    f.write(response.artifact.data)
            # metadata and data_bytes; the bytes go to --out
            _print(response, args.json, _lookup_text(response))
            return EXIT_OK if response.found else EXIT_MISS
        return EXIT_OK
    except grpc.RpcError as exc:
        return cli.rpc_failure(prog, exc, Endpoint(args.target, "--target", "GPUPLANE_CACHE_TARGET",
                                                   "kernel cache"))
    finally:
        channel.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "list":
        return _list(args)
    return _client_command(args)


if __name__ == "__main__":
    cli.run(main)
