"""Per-RPC authorization: every service declares RPC -> `Rule`; one interceptor enforces them.

Hazard: a call that reaches a handler has already changed state by the time anyone checks who
made it. Contract: with a role mapping or bearer tokens configured, the interceptor decides before
the handler runs, from the peer's certificate (or token) and the method's rule:
- deny by default: an RPC of a served service missing from its table is refused;
- a caller without an identity is refused UNAUTHENTICATED, one with the wrong role or acting on
  another worker's id PERMISSION_DENIED, and the handler never runs (nothing changes);
- each refusal, each call of an admin RPC and each admin call on another worker's id leaves
  exactly one line on the `gpuplane.audit` logger.
Health and reflection are public (Kubernetes probes and grpcurl carry no identity).
With neither roles nor tokens, no interceptor is installed: behaviour and cost are as before.
Cost: one dict lookup, one auth-context read and a few glob matches per call (~10 us).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.errors import GpuplaneError, PermissionDenied, Unauthenticated
from services.common.identity import (
    AUTH_HEADER,
    ROLES,
    SAN_PROPERTY,
    Level,
    Principal,
    RoleMap,
    Tokens,
    certificate_identities,
)

audit = logging.getLogger("gpuplane.audit")

# A handler's own refusals (the ledger: a lease that is not the caller's) are audited as well.
AUDITED_REFUSALS = (PermissionDenied, Unauthenticated)
PUBLIC_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                   "grpc.reflection.v1.ServerReflection")


@dataclass(frozen=True)
class Rule:
    """What a method needs: a level, and optionally the request field naming the worker the call
    acts on (a caller below admin may act only on a worker id its identity speaks for)."""

    level: Level
    owner_field: str = ""


def table(service: str, rules: Mapping[str, Rule]) -> dict[str, Rule]:
    """Short method names of `service` -> full gRPC method paths ('/pkg.Service/Method')."""
    return {f"/{service}/{method}": rule for method, rule in rules.items()}


@dataclass(frozen=True)
class Policy:
    """Roles by identity glob, bearer tokens, and the role (if any) of a caller with no identity."""

    roles: RoleMap = field(default_factory=RoleMap)
    tokens: Tokens = field(default_factory=Tokens)
    anonymous_role: str | None = None

    def __post_init__(self) -> None:
        if self.anonymous_role is not None and self.anonymous_role not in ROLES:
            raise ValueError(f"anonymous role {self.anonymous_role!r} is not one of {list(ROLES)}")

    @property
    def enforcing(self) -> bool:
        return bool(self.roles) or bool(self.tokens)

    def principal(self, sans: tuple[str | bytes, ...], metadata: Any) -> Principal:
        """The caller named by its certificate's SANs and (with tokens configured) its token."""
        identities = list(certificate_identities(sans))
        token = self.tokens.identify(metadata) if self.tokens else None
        if token:
            identities.append(token)
        if not identities:
            roles = frozenset({self.anonymous_role}) if self.anonymous_role else frozenset()
            return Principal((), roles)
        return Principal(tuple(identities), self.roles.roles_of(identities))

    @staticmethod
    def authorize(method: str, rule: Rule | None, who: Principal, request: Any) -> None:
        """Raise Unauthenticated / PermissionDenied unless `who` may call `method` with `request`."""
        if rule is None:
            raise PermissionDenied(f"{method} has no authorization rule: denied by default")
        if who.level < rule.level:
            need = rule.level.name.lower()
            if not who.authenticated:
                raise Unauthenticated(f"{method} needs an identity ({need}): present a client "
                                      "certificate or a bearer token")
            raise PermissionDenied(f"{method} needs role {need}; {who.name} has "
                                   f"{', '.join(sorted(who.roles)) or 'no role'}")
        if rule.owner_field and who.level < Level.ADMIN:
            target = getattr(request, rule.owner_field)
            if target not in who.subjects:
                raise PermissionDenied(f"{who.name} may act only on its own worker id, not "
                                       f"{target!r}", worker_id=target)


def audit_call(decision: str, method: str, who: Principal | None, context: grpc.ServicerContext,
           exc: GpuplaneError | None = None) -> None:
    audit.info("rpc %s", "refused" if exc else "allowed", extra={
        "audit": decision, "method": method, "identity": who.name if who else "unknown",
        "roles": sorted(who.roles) if who else [], "peer": context.peer(),
        "code": exc.code if exc else "OK", "reason": exc.message if exc else ""})
    if exc is not None:
        exc.audited = True  # type: ignore[attr-defined]  # so the error mapping adds no second line


def audit_unaudited(exc: GpuplaneError, method: str, context: grpc.ServicerContext) -> None:
    """The audit line of a refusal of who the caller is that no authorization check wrote: a
    handler's own UNAUTHENTICATED / PERMISSION_DENIED on a server without roles or tokens (the
    error interceptors call this, so every refusal leaves exactly one line with the peer)."""
    # The mark lives from the authorization check's line to this mapping of the same raise: an
    # exception object raised again (a module-level constant) is audited again.
    if not isinstance(exc, AUDITED_REFUSALS):
        return
    if not exc.__dict__.pop("audited", False):
        audit_call("deny", method, None, context, exc)
        exc.__dict__.pop("audited", None)


class AuthorizationInterceptor(grpc.ServerInterceptor):
    """Enforces `rules` (full method path -> Rule) with `policy`. Install inside the error
    interceptor, which turns the refusals into status codes."""

    def __init__(self, policy: Policy, rules: Mapping[str, Rule]) -> None:
        self.policy = policy
        self.rules = dict(rules)
        # Per method: the handler gRPC gave and our wrapper of it. Both are the same on every
        # call, and building a wrapper per call costs as much as the check itself.
        self._wrapped: dict[str, tuple[Any, Any]] = {}
        # (SANs, authorization header) -> Principal: a worker's every call is the same caller,
        # so the parse and the glob matches are paid once. Bounded: cleared when full.
        self._principals: dict[tuple[Any, ...], Principal] = {}

    def _principal(self, context: grpc.ServicerContext) -> Principal:
        sans = tuple(context.peer_identities() or ()) \
            if context.peer_identity_key() == SAN_PROPERTY else ()
        metadata = context.invocation_metadata() if self.policy.tokens else ()
        header = tuple(v for k, v in metadata if k == AUTH_HEADER)
        key = (sans, header)
        who = self._principals.get(key)
        if who is None:
            who = self.policy.principal(sans, metadata)  # raises on a wrong token: not cached
            if len(self._principals) >= 4096:
                self._principals.clear()
            self._principals[key] = who
        return who

    def check(self, method: str, rule: Rule | None, request: Any,
              context: grpc.ServicerContext) -> Principal:
        """Raise (and audit) unless the caller of `context` may call `method` with `request`;
        returns the caller. Shared with the asyncio flavour (services.common.aio_server)."""
        who = None
        try:
            who = self._principal(context)
            self.policy.authorize(method, rule, who, request)
        except GpuplaneError as exc:
            audit_call("deny", method, who, context, exc)
            raise
        # Admin calls leave a line too: admin RPCs, and an admin acting on another worker's id.
        if rule is not None and (rule.level >= Level.ADMIN or (
                rule.owner_field and getattr(request, rule.owner_field) not in who.subjects)):
            audit_call("allow", method, who, context)
        return who

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method.split("/")[1] in PUBLIC_SERVICES:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: Any) -> Any:
        rule = self.rules.get(method)
        check = self.check
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                who = check(method, rule, request, context)
                try:
                    return inner(request, context)
                except AUDITED_REFUSALS as exc:  # the domain's own refusals are audited too
                    audit_call("deny", method, who, context, exc)
                    raise

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                who = check(method, rule, request, context)
                try:
                    yield from inner_stream(request, context)
                except AUDITED_REFUSALS as exc:
                    audit_call("deny", method, who, context, exc)
                    raise

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer)
        # No gpuplane RPC streams its requests; refuse rather than pass one through unchecked.
        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            check(method, None, request, context)

        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer)
