"""Memory zones: one spelling in Python ("kv") for the proto's enum (ZONE_KV), shared by every service.

The tuple's order is the `gpuplane.governor.v1.Zone` enum's (value = index + 1), pinned by
tests/common/test_zones.py against the generated code; "foreign" is report-only and never leased.
"""
from __future__ import annotations

from services.common.errors import InvalidArgument

ZONES: tuple[str, ...] = (
    "weights", "kv", "workspace", "activations", "graphs", "scratch", "transient", "context",
    "foreign",
)


def zone_name(value: int) -> str:
    """Proto enum value -> zone name; ZONE_UNSPECIFIED and unknown values are a bad request."""
    if not 1 <= value <= len(ZONES):
        raise InvalidArgument(f"zone is unspecified or unknown (enum value {value}); "
                              f"use one of ZONE_{', ZONE_'.join(z.upper() for z in ZONES)}")
    return ZONES[value - 1]


def zone_value(name: str) -> int:
    """Zone name -> proto enum value; an unknown name is a bad request."""
    if name not in ZONES:
        raise InvalidArgument(f"zone {name!r} is unknown; use one of {', '.join(ZONES)}")
    return ZONES.index(name) + 1
