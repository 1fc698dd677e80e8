"""Zones and the admission policy of the governor: small, frozen, validated values.

The environment and flags are read only in `__main__`; everything here receives plain values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.errors import InvalidArgument

# The order is the proto enum's (Zone = index + 1); "foreign" is report-only and never leased.
ZONES: tuple[str, ...] = (
    "weights", "kv", "workspace", "activations", "graphs", "scratch", "transient", "context",
    "foreign",
)
LEASABLE_ZONES: frozenset[str] = frozenset(ZONES) - {"foreign"}

# Zones whose contents a worker can drop on request (offloaded weights, warm plans, kernel variants,
# captured graphs): reported as reclaimable in a refusal. kv holds live sequences, scratch and
# transient are short-lived, context is the driver's.
EVICTABLE_ZONES: frozenset[str] = frozenset({"weights", "activations", "graphs", "workspace"})


def check_zone(zone: str, leasable: bool = True) -> str:
    """Return `zone` when it names a zone (a leasable one if asked), else raise InvalidArgument."""
    allowed = LEASABLE_ZONES if leasable else frozenset(ZONES)
    if zone not in allowed:
        raise InvalidArgument(
            f"zone {zone!r} is not one of {', '.join(sorted(allowed))}"
            + (" (foreign is report-only)" if zone == "foreign" else ""),
            zone=zone,
        )
    return zone


@dataclass(frozen=True)
class Policy:
    """How the governor sizes budgets and admits leases.

    budget_fraction: the device budget is this fraction of the free bytes the first worker of a
        device measured at registration.
    zone_budgets: optional per-zone shares of the device budget. With `lending` on, a zone may
        exceed its share by borrowing what other zones leave unused; the borrowed bytes are
        reclaimable. With `lending` off, a share is a hard cap.
    transient_headroom_bytes: kept free for the transient zone; other zones cannot lease into it.
    lease_ttl_s: a worker silent for this long loses its leases.
    unaccounted_alert_bytes: growth of unaccounted bytes over `unaccounted_window_s` that raises
        the alert.
    """

    budget_fraction: float = 0.90
    zone_budgets: dict[str, int] = field(default_factory=dict)
    lending: bool = True
    transient_headroom_bytes: int = 0
    lease_ttl_s: float = 30.0
    unaccounted_alert_bytes: int = 256 << 20
    unaccounted_window_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0.0 < self.budget_fraction <= 1.0:
            raise InvalidArgument(f"budget fraction {self.budget_fraction} is not in (0, 1]")
        for zone, nbytes in self.zone_budgets.items():
            check_zone(zone)
            if zone == "transient":
                raise InvalidArgument("the transient zone's share is --transient-headroom")
            if nbytes <= 0:
                raise InvalidArgument(f"zone budget {zone}={nbytes} must be positive")
        if self.transient_headroom_bytes < 0:
            raise InvalidArgument("transient headroom cannot be negative")
        if self.lease_ttl_s <= 0:
            raise InvalidArgument("lease TTL must be positive")

    def zone_caps(self) -> dict[str, int]:
        """Zones whose leases together may never exceed their share: every zone budget while
        lending is off, none while it is on (a share is then a floor the zone can reclaim, and
        a zone may borrow beyond it)."""
        return {} if self.lending else dict(self.zone_budgets)
