"""Who is calling: a `Principal` from the peer's certificate or a bearer token, and its roles.

With mutual TLS a caller's identities are the subject alternative names of its verified
certificate (URIs such as `spiffe://gpuplane/worker/host-a` first, then DNS names). Without it, a
deployment may name callers by bearer token (`authorization: Bearer <secret>` metadata): the
token's name becomes the identity `token:<name>`. `--role ROLE=GLOB` maps identities to roles.

Roles are ordered: client < worker < admin, each allowed what the ones below it are. A caller
with an identity but no role is merely authenticated; a caller with neither is anonymous, and gets
`anonymous_role` when one is configured (the kernel cache's open reads).
"""
from __future__ import annotations

import fnmatch
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

from services.common.errors import InvalidArgument, PermissionDenied, Unauthenticated

AUTH_HEADER = "authorization"
TOKEN_PREFIX = "token:"


class Level(IntEnum):
    """What a caller may do, and what an RPC requires: higher includes lower."""

    PUBLIC = 0          # no identity needed (health, reflection)
    AUTHENTICATED = 1   # any caller with an identity
    CLIENT = 2
    WORKER = 3
    ADMIN = 4


ROLES = {"client": Level.CLIENT, "worker": Level.WORKER, "admin": Level.ADMIN}


@dataclass(frozen=True)
class Principal:
    """A caller: its identities (empty when anonymous) and the roles they map to."""

    identities: tuple[str, ...] = ()
    roles: frozenset[str] = frozenset()

    @property
    def authenticated(self) -> bool:
        return bool(self.identities)

    @property
    def name(self) -> str:
        return self.identities[0] if self.identities else "anonymous"

    @cached_property  # a principal is cached per caller and asked on every call
    def level(self) -> Level:
        best = Level.AUTHENTICATED if self.authenticated else Level.PUBLIC
        return max([best, *(ROLES[r] for r in self.roles)])

    @cached_property
    def subjects(self) -> frozenset[str]:
        """The names an identity speaks for: the last path segment of a URI
        (`spiffe://gpuplane/worker/host-a` -> `host-a`), the first label of a DNS name, a token's
        name. A worker identity may act only on the worker id equal to one of them."""
        out = set()
        for ident in self.identities:
            if ident.startswith(TOKEN_PREFIX):
                out.add(ident[len(TOKEN_PREFIX):])
            elif "://" in ident:
                out.add(ident.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1])
            else:
                out.add(ident.split(".", 1)[0])
        out.discard("")
        return frozenset(out)


ANONYMOUS = Principal()


def parse_role(text: str) -> tuple[str, str]:
    """'worker=spiffe://gpuplane/worker/*' -> ('worker', 'spiffe://gpuplane/worker/*')."""
    role, sep, glob = text.partition("=")
    role = role.strip().lower()
    if not sep or not glob.strip() or role not in ROLES:
        raise InvalidArgument(f"role mapping {text!r} is not ROLE=GLOB with ROLE one of "
                              f"{', '.join(ROLES)} (try worker=spiffe://gpuplane/worker/*)")
    return role, glob.strip()


def parse_token(text: str) -> tuple[str, str]:
    """'NAME=SECRET' -> ('NAME', 'SECRET'): the caller presenting SECRET is `token:NAME`."""
    name, sep, secret = text.partition("=")
    if not sep or not name.strip() or not secret:
        raise InvalidArgument("a bearer token is NAME=SECRET (the caller becomes token:NAME)")
    return name.strip(), secret


@dataclass(frozen=True)
class RoleMap:
    """Role -> identity globs (fnmatch, case-sensitive)."""

    globs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> RoleMap:
        globs: dict[str, tuple[str, ...]] = {}
        for role, glob in pairs:
            if role not in ROLES:
                raise InvalidArgument(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
            globs[role] = (*globs.get(role, ()), glob)
        return cls(globs)

    def __bool__(self) -> bool:
        return bool(self.globs)

    def roles_of(self, identities: Iterable[str]) -> frozenset[str]:
        idents = list(identities)
        return frozenset(role for role, globs in self.globs.items()
                         if any(fnmatch.fnmatchcase(i, g) for i in idents for g in globs))


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode(errors="replace")


# gRPC's peer identity property of a TLS peer whose certificate has subject alternative names
# (URIs, DNS names, IPs, in certificate order). Without SANs gRPC falls back to the common name,
# which is not an identity here: identities are SANs, as in SPIFFE.
SAN_PROPERTY = "x509_subject_alternative_name"


def certificate_identities(sans: Iterable[str | bytes]) -> tuple[str, ...]:
    """The SANs of a verified peer certificate, URIs (SPIFFE ids) first, then the others."""
    names = [_text(v) for v in sans]
    return tuple(dict.fromkeys([*(n for n in names if "://" in n),
                                *(n for n in names if "://" not in n)]))


@dataclass(frozen=True)
class Tokens:
    """Bearer token name -> secret, compared in constant time."""

    secrets: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.secrets)

    def identify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """`token:NAME` for a known token, None when none is presented; a wrong one is refused."""
        values = [_text(v) for k, v in (metadata or ()) if k.lower() == AUTH_HEADER]
        if not values:
            return None
        scheme, _, presented = values[0].partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Unauthenticated("authorization metadata must be `Bearer <token>`")
        found = None
        for name, secret in self.secrets.items():
            # Compare against every secret so the time taken does not say which one matched.
            if hmac.compare_digest(presented.strip().encode(), secret.encode()):
                found = name
        if found is None:
            raise PermissionDenied("the bearer token is not one this server knows")
        return TOKEN_PREFIX + found


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends for `token` (none when there is no token)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()
