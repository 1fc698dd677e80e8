"""CLI: `python -m services.governor serve ...` and `python -m services.governor resources ...`.

Failures print `python -m services.governor COMMAND: error: ...` and exit with the codes of
services.common.cli (2 usage, 3 the call failed, 4 no server answered).
"""
from __future__ import annotations

import argparse
import gc
import json

import grpc

from services.common import cli, security
from services.common.cli import Endpoint
from services.common.config import VAR_DIR, bounded_number, env_flag, parse_bytes
from services.common.logs import configure_logging
from services.governor.policy import MAX_DEVICE_BYTES, MAX_DEVICE_TTL_S, MAX_LEASE_TTL_S

MIB = 1 << 20
PROG = "python -m services.governor"


def _device_bytes(text: str) -> int:
    """parse_bytes, bounded like every byte figure of the governor (1 PiB)."""
    value = parse_bytes(text)
    if value > MAX_DEVICE_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} exceeds the bound of 1 PiB (2^50 bytes)")
    return value


def _zone_budget(text: str) -> tuple[str, int]:
    zone, sep, size = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"zone budget {text!r} is not ZONE=BYTES (try kv=8GiB)")
    return zone.strip().lower(), _device_bytes(size)


def _parser() -> argparse.ArgumentParser:
    parser = cli.Parser(prog=PROG, description="The memory governor: its server and its CLI.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the governor", description="run the governor")
    env_flag(serve, "--listen", "GPUPLANE_GOVERNOR_LISTEN", "127.0.0.1:50061", "HOST:PORT to serve")
    env_flag(serve, "--db", "GPUPLANE_GOVERNOR_DB", f"{VAR_DIR}/governor.sqlite", "SQLite file")
    env_flag(serve, "--lease-ttl-seconds", "GPUPLANE_GOVERNOR_LEASE_TTL_SECONDS", 30.0,
             f"a worker silent this long loses its leases and its id, in (0, {MAX_LEASE_TTL_S:g}]",
             type=bounded_number(0, MAX_LEASE_TTL_S, "--lease-ttl-seconds"))
    env_flag(serve, "--device-ttl-seconds", "GPUPLANE_GOVERNOR_DEVICE_TTL_SECONDS", 600.0,
             f"a device with no worker is forgotten after this long, in (0, {MAX_DEVICE_TTL_S:g}]",
             type=bounded_number(0, MAX_DEVICE_TTL_S, "--device-ttl-seconds"))
    env_flag(serve, "--budget-fraction", "GPUPLANE_GOVERNOR_BUDGET_FRACTION", 0.9,
             "device budget as a fraction of free memory at registration, in (0, 1]",
             type=bounded_number(0, 1, "--budget-fraction"))
    serve.add_argument("--zone-budget", action="append", type=_zone_budget, default=[],
                       metavar="ZONE=BYTES", help="a zone's share of the device budget (repeat)")
    env_flag(serve, "--transient-headroom", "GPUPLANE_GOVERNOR_TRANSIENT_HEADROOM", 0,
             "bytes kept free for the transient zone", type=_device_bytes)
    serve.add_argument("--no-lending", action="store_true",
                       help="zone budgets are hard caps (default: unused budget is lent)")
    env_flag(serve, "--unaccounted-alert", "GPUPLANE_GOVERNOR_UNACCOUNTED_ALERT", 256 * MIB,
             "growth of unaccounted bytes that raises the alert", type=_device_bytes)
    env_flag(serve, "--metrics-port", "GPUPLANE_GOVERNOR_METRICS_PORT", 0,
             "Prometheus port (0 = off)",
             type=bounded_number(0, 65535, "--metrics-port", low_open=False, integer=True))
    serve.add_argument("--durable", action="store_true",
                       help="fsync every change (synchronous=FULL): survives power loss too")
    security.add_server_flags(serve, "GOVERNOR")
    res = sub.add_parser("resources", help="print the ledger of every device",
                         description="print the ledger of every device")
    env_flag(res, "--target", "GPUPLANE_GOVERNOR", "127.0.0.1:50061", "governor HOST:PORT")
    res.add_argument("--device", default="", help="one device uuid (default: all)")
    res.add_argument("--json", action="store_true", help="print JSON (sizes in bytes)")
    security.add_client_flags(res, "CLI")
    return parser


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, gRPC, protobuf descriptors, the loaded ledger: ~50k)
    out of the cycle collector's reach. They live as long as the process, yet a full collection
    walks them all: 50-90 ms with every call on the event loop stalled (2-core VM, 2026-12-01,
    docs/governor.md). Frozen, a full collection walks only what calls left behind."""
    gc.collect()
    gc.freeze()


def serve(args: argparse.Namespace) -> int:
    from prometheus_client import REGISTRY

    from services.common.errors import GpuplaneError
    from services.common.metrics import start_metrics_endpoint
    from services.governor.metrics import LedgerCollector
    from services.governor.policy import Policy
    from services.governor.server import start_governor

    configure_logging("governor")
    try:
        policy = Policy(budget_fraction=args.budget_fraction, zone_budgets=dict(args.zone_budget),
                        lending=not args.no_lending,
                        transient_headroom_bytes=args.transient_headroom,
                        lease_ttl_s=args.lease_ttl_seconds,
                        unaccounted_alert_bytes=args.unaccounted_alert,
                        device_ttl_s=args.device_ttl_seconds)
        server_security = security.server_security_from_args(args)
    except GpuplaneError as err:
        return cli.fail(f"{PROG} serve", err.message, cli.EXIT_USAGE)
    try:
        server, ledger = start_governor(args.listen, args.db, policy, durable=args.durable,
                                        security=server_security)
    except GpuplaneError as err:  # e.g. TLS files that cannot be read
        return cli.fail(f"{PROG} serve", err.message, cli.EXIT_USAGE)
    REGISTRY.register(LedgerCollector(ledger))
    start_metrics_endpoint(args.metrics_port)
    freeze_startup_heap()
    print(f"governor listening on port {server.port}", flush=True)
    server.serve_until_signalled()
    return 0


def resources(args: argparse.Namespace) -> int:
    from gpuplane.governor.v1 import governor_pb2, governor_pb2_grpc

    from services.common.channels import open_channel
    from services.common.errors import GpuplaneError
    from services.governor.servicer import SERVICE_NAME

    try:
        tls = security.channel_tls_from_args(args)
    except GpuplaneError as err:
        return cli.fail(f"{PROG} resources", err.message, cli.EXIT_USAGE)
    channel = open_channel(args.target, SERVICE_NAME, ["GetResources"], tls=tls)
    try:
        reply = governor_pb2_grpc.GovernorServiceStub(channel).GetResources(
            governor_pb2.GetResourcesRequest(device_uuid=args.device), timeout=5.0)
    except grpc.RpcError as err:
        return cli.rpc_failure(f"{PROG} resources", err,
                               Endpoint(args.target, "--target", "GPUPLANE_GOVERNOR", "governor"))
    finally:
        channel.close()
    if args.json:
        print(json.dumps(cli.message_dict(reply), indent=2))
        return 0
    from services.governor.report import resource_lines
    print("\n".join(resource_lines(reply)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return serve(args) if args.command == "serve" else resources(args)


if __name__ == "__main__":
    cli.run(main)
