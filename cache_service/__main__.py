"""python -m cache_service serve|stats|lookup|prune: the server and the operators' CLI.

Each command maps its flags one to one onto one RPC (or, for `serve`, onto ServerConfig). Errors
become exit codes only here: 0 ok, 1 not found (lookup miss), 2 usage, 3 RPC failed.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

from cache_service.auth import bearer_metadata
from cache_service.config import DEFAULT_TARGET, add_serve_flags, server_config_from_args
from services.common import cli, security
from services.common.channels import open_channel
from services.common.config import env_flag, parse_bytes
from services.common.errors import GpuplaneError
from services.common.logs import configure_logging

EXIT_OK, EXIT_MISS, EXIT_USAGE, EXIT_RPC = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cache_service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_flags(sub.add_parser("serve", help="run the kernel cache server"))
    for name, text in (("stats", "print the cache's stats"),
                       ("lookup", "fetch one artifact (metadata; --out writes its bytes)"),
                       ("prune", "evict LRU entries down to a target (a write: needs the token)")):
        p = sub.add_parser(name, help=text)
        env_flag(p, "--target", "GPUPLANE_CACHE_TARGET", DEFAULT_TARGET, "server HOST:PORT")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        env_flag(p, "--timeout", "GPUPLANE_CACHE_CLI_TIMEOUT", 10.0, "RPC deadline in seconds",
                 type=float)
        security.add_client_flags(p, "CLI")
        if name == "lookup":
            p.add_argument("key")
            p.add_argument("--namespace", default="")
            p.add_argument("--out", help="write the artifact's bytes to this file")
        if name == "prune":
            p.add_argument("--target-bytes", type=parse_bytes, default=0,
                           help="prune down to this size (default 0 = each budget's low watermark)")
            env_flag(p, "--write-token", "GPUPLANE_CACHE_WRITE_TOKEN", None, "write bearer token")
    return parser


def _to_dict(message: Any) -> dict[str, Any]:
    """Fields in declaration order, numbers as numbers (proto3 JSON would quote int64), enums by
    name, bytes as their length: an operator's view, not a wire format."""
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None:
            if f.is_repeated:
                out[f.name] = [_to_dict(v) for v in value]
            elif message.HasField(f.name):
                out[f.name] = _to_dict(value)
        elif f.enum_type is not None:
            out[f.name] = f.enum_type.values_by_number[value].name
        elif f.type == f.TYPE_BYTES:
            out[f"{f.name}_bytes"] = len(value)
        else:
            out[f.name] = value
    return out


def _print(message: Any, as_json: bool) -> None:
    fields = _to_dict(message)
    if as_json:
        print(json.dumps(fields, indent=2, sort_keys=True))
        return
    for name, value in fields.items():
        if isinstance(value, list):
            for item in value:
                print(f"{name}: " + " ".join(f"{k}={v}" for k, v in item.items()))
        else:
            print(f"{name}: {value}")


def _serve(args: argparse.Namespace) -> int:
    from cache_service.server import start_cache_server  # heavy imports only for the server

    configure_logging("kernel-cache")
    try:
        config = server_config_from_args(args)
        server = start_cache_server(config)
    except GpuplaneError as err:  # inconsistent flags, TLS files that cannot be read
        print(f"error: {err.message}", file=sys.stderr)
        return EXIT_USAGE
    print(f"kernel cache listening on port {server.port}", file=sys.stderr, flush=True)
    server.running.serve_until_signalled()
    return EXIT_OK


def _client_command(args: argparse.Namespace) -> int:
    try:
        tls = security.channel_tls_from_args(args)
    except GpuplaneError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return EXIT_USAGE
    channel = open_channel(args.target, "gpuplane.kernelcache.v1.KernelCacheService",
                           idempotent_methods=("Lookup", "GetStats"), tls=tls)
    stub = pb_grpc.KernelCacheServiceStub(channel)
    try:
        if args.command == "stats":
            _print(stub.GetStats(pb.GetStatsRequest(), timeout=args.timeout), args.json)
        elif args.command == "prune":
            response = stub.Prune(pb.PruneRequest(target_bytes=args.target_bytes),
                                  timeout=args.timeout,
                                  metadata=bearer_metadata(args.write_token) or None)
            _print(response, args.json)
        else:
            response = stub.Lookup(pb.LookupRequest(key=args.key, namespace=args.namespace),
                                   timeout=args.timeout)
            if args.out and response.found:
                with open(args.out, "wb") as f:
                    f.write(response.artifact.data)
            _print(response, args.json)  # metadata and data_bytes; the bytes go to --out
            return EXIT_OK if response.found else EXIT_MISS
        return EXIT_OK
    except grpc.RpcError as exc:
        print(f"{args.command} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_RPC
    finally:
        channel.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _client_command(args)


if __name__ == "__main__":
    cli.run(main)
