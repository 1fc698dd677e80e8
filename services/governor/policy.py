"""Zones and the admission policy of the governor: small, frozen, validated values.

The environment and flags are read only in `__main__`; everything here receives plain values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument
from services.common.zones import ZONES

# The order is the proto enum's (services/common/zones.py); "foreign" is report-only, never leased.
LEASABLE_ZONES: frozenset[str] = frozenset(ZONES) - {"foreign"}

# Zones whose contents a worker can drop on request (offloaded weights, warm plans, kernel variants,
# captured graphs): reported as reclaimable in a refusal. kv holds live sequences, scratch and
# transient are short-lived, context is the driver's.
EVICTABLE_ZONES: frozenset[str] = frozenset({"weights", "activations", "graphs", "workspace"})

# Zones whose heartbeat figures may name cached bytes: committed bytes the worker gives back at
# once without harming live work (kv: finished sequences' cached prefix blocks). Reported as
# reclaimable in a refusal, apart from the bytes in use, and asked back first.
CACHED_ZONES: frozenset[str] = frozenset({"kv"})

# ---- bounds (docs/governor.md, "Bounds") ---------------------------------------------------------
# Every size a caller or an operator gives is checked against these before any work, so no figure
# can overflow the int64 of a report: a device of MAX_DEVICE_BYTES reported by thousands of workers
# in every zone still sums far below 2^63.
MAX_DEVICE_BYTES = 1 << 50       # 1 PiB: any byte figure of a request (an H200 has ~2^37)
MAX_ID_CHARS = 128               # worker_id, device uuid, lease_id, incarnation
MAX_TEXT_CHARS = 256             # host, device name
MAX_LEASE_TTL_S = 86_400.0       # a day: --lease-ttl-seconds
MAX_DEVICE_TTL_S = 30 * 86_400.0  # a month: --device-ttl-seconds
MAX_WINDOW_S = 86_400.0          # the unaccounted alert's window


def _check_seconds(what: str, value: float, high: float) -> None:
    if not (math.isfinite(value) and 0 < value <= high):
        raise InvalidArgument(f"{what} must be a finite number of seconds in (0, {high:g}], "
                              f"got {value!r}")


def _check_bytes(what: str, value: int, low: int = 0) -> None:
    if not low <= value <= MAX_DEVICE_BYTES:
        raise InvalidArgument(f"{what}={value} is not in [{low}, {MAX_DEVICE_BYTES}] bytes "
                              "(the bound is 1 PiB)")


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
    lease_ttl_s: a worker silent for this long loses its leases (and its worker id).
    unaccounted_alert_bytes: growth of unaccounted bytes over `unaccounted_window_s` that raises
        the alert.
    device_ttl_s: a device with no registered worker is forgotten after this long (its row, its
        budget, its last device truth); the next registration on it measures it afresh.
    Every duration is finite and positive and every size at most MAX_DEVICE_BYTES
    (InvalidArgument otherwise), so nothing built from a policy can overflow or never expire.
    """

    budget_fraction: float = 0.90
    zone_budgets: dict[str, int] = field(default_factory=dict)
    lending: bool = True
    transient_headroom_bytes: int = 0
    lease_ttl_s: float = 30.0
    unaccounted_alert_bytes: int = 256 << 20
    unaccounted_window_s: float = 120.0
    device_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0.0 < self.budget_fraction <= 1.0:  # also refuses nan
            raise InvalidArgument(f"budget fraction {self.budget_fraction} is not in (0, 1]")
        for zone, nbytes in self.zone_budgets.items():
            check_zone(zone)
            if zone == "transient":
                raise InvalidArgument("the transient zone's share is --transient-headroom")
            if nbytes <= 0:
                raise InvalidArgument(f"zone budget {zone}={nbytes} must be positive")
            _check_bytes(f"zone budget {zone}", nbytes)
        if self.transient_headroom_bytes < 0:
            raise InvalidArgument("transient headroom cannot be negative")
        _check_bytes("transient headroom", self.transient_headroom_bytes)
        _check_bytes("unaccounted alert", self.unaccounted_alert_bytes)
        _check_seconds("lease TTL", self.lease_ttl_s, MAX_LEASE_TTL_S)
        _check_seconds("device TTL", self.device_ttl_s, MAX_DEVICE_TTL_S)
        _check_seconds("unaccounted window", self.unaccounted_window_s, MAX_WINDOW_S)

    def zone_caps(self) -> dict[str, int]:
        """Zones whose leases together may never exceed their share: every zone budget while
        lending is off, none while it is on (a share is then a floor the zone can reclaim, and
        a zone may borrow beyond it)."""
        return {} if self.lending else dict(self.zone_budgets)
