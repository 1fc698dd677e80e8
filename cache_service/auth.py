"""Write credentials: the cache serves code that workers execute, so an unauthenticated write is a
poisoning hole, not a nuisance. With a token configured, every write (Store, Prune) must carry
`authorization: Bearer <token>` metadata; reads stay open. Compared in constant time."""
from __future__ import annotations

import hmac
from collections.abc import Iterable

from services.common.errors import PermissionDenied, Unauthenticated

AUTH_HEADER = "authorization"


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends for `token` (none when there is no token)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


class WriteGuard:
    """Checks a call's metadata against the configured write token (None: writes are open)."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        if self._token is None:
            return
        values = [v for k, v in (metadata or ()) if k.lower() == AUTH_HEADER]
        if not values:
            raise Unauthenticated("writes need `authorization: Bearer <token>` metadata "
                                  "(the server was started with --write-token)")
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        scheme, _, presented = value.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise Unauthenticated("authorization metadata must be `Bearer <token>`")
        if not hmac.compare_digest(presented.strip().encode(), self._token):
            raise PermissionDenied("the write token is wrong")
