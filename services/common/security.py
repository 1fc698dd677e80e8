"""The security flags every service shares, parsed into `ServerSecurity` and `ChannelTLS`.

Server: --tls-cert, --tls-key, --tls-client-ca (mutual TLS), --role ROLE=GLOB (repeatable),
--token NAME=SECRET (repeatable), --health-listen (a plaintext, health-only port for probes that
cannot speak TLS, such as Kubernetes' native gRPC probe). Client (the worker's outgoing calls and
the operator CLIs): --tls-ca, --tls-cert, --tls-key. Every flag has a `GPUPLANE_<SERVICE>_*`
environment default; repeatable ones take a space-separated list there. Plaintext and no roles are
the default, so one laptop needs none of this.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from services.common.authz import Policy
from services.common.config import env_flag
from services.common.errors import InvalidArgument
from services.common.identity import RoleMap, Tokens, parse_role, parse_token
from services.common.tls import ChannelTLS, ServerTLS

T = TypeVar("T")


@dataclass(frozen=True)
class ServerSecurity:
    """How a server authenticates and authorizes callers; the default is plaintext and open."""

    tls: ServerTLS | None = None
    policy: Policy = field(default_factory=Policy)
    health_listen: str = ""


def _env_list(env: str) -> list[str]:
    return os.environ.get(env, "").split()


def _checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` for argparse: its InvalidArgument becomes a usage error with the same message."""
    def wrapped(text: str) -> T:
        try:
            return parse(text)
        except InvalidArgument as err:
            raise argparse.ArgumentTypeError(err.message) from None
    return wrapped


def add_server_flags(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Add the server security flags with `GPUPLANE_<prefix>_*` defaults."""
    g = parser.add_argument_group("security (default: plaintext, every caller allowed)")
    env_flag(g, "--tls-cert", f"GPUPLANE_{prefix}_TLS_CERT", "",
             "PEM certificate chain to serve TLS with (re-read when the file changes)")
    env_flag(g, "--tls-key", f"GPUPLANE_{prefix}_TLS_KEY", "", "PEM private key of --tls-cert")
    env_flag(g, "--tls-client-ca", f"GPUPLANE_{prefix}_TLS_CLIENT_CA", "",
             "PEM CA bundle: require client certificates signed by it (mutual TLS)")
    roles_env, tokens_env = f"GPUPLANE_{prefix}_ROLES", f"GPUPLANE_{prefix}_TOKENS"
    # Repeatable flags replace (not extend) their environment default: flag > env > none.
    try:
        parser.set_defaults(role_env=[parse_role(r) for r in _env_list(roles_env)],
                            token_env=[parse_token(t) for t in _env_list(tokens_env)])
    except InvalidArgument as err:
        parser.error(f"{roles_env} or {tokens_env}: {err.message}")
    g.add_argument("--role", action="append", type=_checked(parse_role), metavar="ROLE=GLOB",
                   help="map identities matching GLOB to ROLE (client, worker, admin); repeat; "
                        f"turns on per-RPC authorization (env {roles_env}, space-separated)")
    g.add_argument("--token", action="append", type=_checked(parse_token), metavar="NAME=SECRET",
                   help="a bearer token naming its caller token:NAME; repeat "
                        f"(env {tokens_env}, space-separated; prefer the env: argv is visible)")
    env_flag(g, "--health-listen", f"GPUPLANE_{prefix}_HEALTH_LISTEN", "",
             "HOST:PORT of a plaintext port serving only grpc.health.v1 (for probes)")


def server_security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """ServerSecurity from parsed flags; raises InvalidArgument on an inconsistent set."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidArgument("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise InvalidArgument("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca or None) \
        if args.tls_cert else None
    roles = args.role if args.role is not None else args.role_env
    tokens = args.token if args.token is not None else args.token_env
    policy = Policy(RoleMap.of(roles), Tokens(dict(tokens)))
    return ServerSecurity(tls, policy, args.health_listen)


def add_client_flags(parser: argparse.ArgumentParser, prefix: str, pair: bool = True) -> None:
    """--tls-ca (and, unless the server flags already add them, --tls-cert/--tls-key)."""
    env_flag(parser, "--tls-ca", f"GPUPLANE_{prefix}_TLS_CA", "",
             "PEM CA bundle that signs the servers called: turns TLS on for outgoing calls")
    if pair:
        env_flag(parser, "--tls-cert", f"GPUPLANE_{prefix}_TLS_CERT", "",
                 "PEM client certificate for mutual TLS")
        env_flag(parser, "--tls-key", f"GPUPLANE_{prefix}_TLS_KEY", "", "PEM key of --tls-cert")


def channel_tls_from_args(args: argparse.Namespace) -> ChannelTLS | None:
    """ChannelTLS when --tls-ca is given (outgoing calls use TLS), else None (plaintext)."""
    if not args.tls_ca:
        if getattr(args, "tls_cert", "") and not hasattr(args, "tls_client_ca"):
            raise InvalidArgument("--tls-cert for outgoing calls needs --tls-ca")
        return None
    return ChannelTLS(args.tls_ca, args.tls_cert or None, args.tls_key or None)
