"""The governor's ledger as text: what `gpuplane resources` and `python -m services.governor
resources` both print (one rendering, so the two commands never disagree)."""
from __future__ import annotations

from typing import Any

from services.common.cli import human_bytes
from services.common.zones import zone_name

CONTENT_ABOVE_COMMITTED = (
    "  * content above committed: the arena carves allocations at byte granularity and books\n"
    "    each granule's committed bytes once, to the zone that mapped it first; small\n"
    "    allocations, workspaces above all, also sit in granules another zone pays for")


def kv_split(z: Any) -> str:
    """Zone kv's committed bytes as in use (live sequences) and cached (reclaimable at once)."""
    cached = z.cached_bytes
    return (f"in use {human_bytes(max(0, z.committed_bytes - cached))}, "
            f"cached {human_bytes(cached)}")


def zone_rows(zones: Any, leased: bool = False) -> list[str]:
    """One line per zone (ZoneUsage); a `*` marks content above committed, explained once.
    Zone kv also shows its committed bytes in use and cached (in the governor's view always,
    elsewhere when some are cached)."""
    rows, marked = [], False
    for z in zones:
        line = (f"{zone_name(z.zone):<12} committed {human_bytes(z.committed_bytes):>11}  "
                f"content {human_bytes(z.content_bytes):>11}")
        if leased:
            line += f"  leased {human_bytes(z.leased_bytes):>11}"
        if zone_name(z.zone) == "kv" and (leased or z.cached_bytes):
            line += f"  ({kv_split(z)})"
        if z.content_bytes > z.committed_bytes:
            marked = True
            line += (f"  (content {human_bytes(z.content_bytes - z.committed_bytes)} "
                     "above committed*)")
        rows.append(line)
    return rows + ([CONTENT_ABOVE_COMMITTED] if marked else [])


def resource_lines(reply: Any) -> list[str]:
    """GetResourcesResponse -> lines: each device, its zones' shares, each worker and its zones."""
    lines: list[str] = []
    for d in reply.devices:
        alert = "  ALERT: unaccounted is growing" if d.unaccounted_alert else ""
        lines.append(f"device {d.uuid} {d.name}: budget {human_bytes(d.budget_bytes)}, leased "
                     f"{human_bytes(d.leased_bytes)}, used {human_bytes(d.device_used_bytes)}, "
                     f"ledger {human_bytes(d.ledger_bytes)}, unaccounted "
                     f"{human_bytes(d.unaccounted_bytes)}{alert}")
        for z in d.zones:
            if z.leased_bytes or z.committed_bytes or z.budget_bytes:
                kv = f"  ({kv_split(z)})" if zone_name(z.zone) == "kv" else ""
                lines.append(f"  zone {zone_name(z.zone):12s} leased {human_bytes(z.leased_bytes):>10}"
                             f"  committed {human_bytes(z.committed_bytes):>10}  budget "
                             f"{human_bytes(z.budget_bytes):>10}  borrowed "
                             f"{human_bytes(z.borrowed_bytes):>10}{kv}")
        for w in d.workers:
            lines.append(f"  worker {w.worker_id} ({w.host}): leased {human_bytes(w.leased_bytes)}, "
                         f"committed {human_bytes(w.committed_bytes)}, content "
                         f"{human_bytes(w.content_bytes)}; host tier (pinned): weights "
                         f"{human_bytes(w.host_weights_bytes)}, kv {human_bytes(w.host_kv_bytes)}")
            lines.extend(f"    {row}" for row in zone_rows(w.zones, leased=True))
    return lines
