"""The write token, as one bearer-token mapping of the shared authorization policy.

The cache serves code that workers execute, so an unauthenticated write is a poisoning hole, not a
nuisance. `--write-token` names its holder `token:cache-writer` with the admin role (Store and
Prune, as before). With no role mapping configured, callers without a credential keep the client
role, so reads stay open as they always were; once roles are mapped, reads need an identity too.
"""
from __future__ import annotations

from dataclasses import replace

from services.common.authz import Policy
from services.common.identity import RoleMap, Tokens, bearer_metadata
from services.common.security import ServerSecurity

WRITER = "cache-writer"

__all__ = ["WRITER", "bearer_metadata", "with_write_token"]


def with_write_token(security: ServerSecurity, token: str | None) -> ServerSecurity:
    """`security` plus the legacy write token (unchanged when there is none)."""
    if not token:
        return security
    policy = security.policy
    roles = RoleMap.of([*((r, g) for r, globs in policy.roles.globs.items() for g in globs),
                        ("admin", f"token:{WRITER}")])
    anonymous = policy.anonymous_role if policy.roles else "client"
    return replace(security, policy=Policy(roles, Tokens({**policy.tokens.secrets, WRITER: token}),
                                           anonymous))
