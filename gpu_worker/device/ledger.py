"""The device's ledger: every byte this worker holds, by zone, on two axes.

- committed: granule-rounded bytes the device pays for (physical handles, graph memory, context);
- content: the bytes callers asked for.

Committed bytes are admitted through a BudgetOwner (interface (2): the governor client in chunked
leases, or a LocalBudget with no governor) *before* the device is touched, so a refusal changes
nothing. Underflow (releasing more than was booked) is a bookkeeping bug: it is counted as a fault,
clamped, and must stay zero.
"""
from __future__ import annotations

import threading
from typing import Protocol

from services.common.errors import InvalidArgument

ZONES: tuple[str, ...] = (
    "weights", "kv", "workspace", "activations", "graphs", "scratch", "transient", "context")


class BudgetOwner(Protocol):
    """Interface (2); services.governor.client provides GovernorClient and LocalBudget."""

    def reserve(self, zone: str, nbytes: int) -> None: ...
    def adopt(self, zone: str, nbytes: int) -> None: ...
    def release(self, zone: str, nbytes: int) -> None: ...
    def report(self, zones: dict[str, tuple[int, int]], device_used_bytes: int,
               process_used_bytes: int) -> None: ...
    def connected(self) -> bool: ...
    def close(self) -> None: ...


def local_budget(budget_bytes: int) -> BudgetOwner:
    """Admission against a fixed budget in this process: the worker's budget with no governor."""
    from services.governor.client import LocalBudget

    return LocalBudget(budget_bytes)


def check_zone(zone: str) -> str:
    if zone not in ZONES:
        raise InvalidArgument(f"zone {zone!r} is not one of {', '.join(ZONES)}", zone=zone)
    return zone


class Ledger:
    def __init__(self, budget: BudgetOwner) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._committed = dict.fromkeys(ZONES, 0)
        self._content = dict.fromkeys(ZONES, 0)
        self.fault_underflow = 0

    def commit(self, zone: str, nbytes: int) -> None:
        """Admit `nbytes` committed bytes in `zone`; raises ResourceExhausted and books nothing."""
        check_zone(zone)
        if nbytes < 0:
            raise InvalidArgument(f"cannot commit a negative byte count ({nbytes})")
        if nbytes == 0:
            return
        self.budget.reserve(zone, nbytes)
        with self._lock:
            self._committed[zone] += nbytes

    def adopt(self, zone: str, nbytes: int) -> None:
        """Book bytes the device already spent (the context baseline); the budget cannot refuse."""
        check_zone(zone)
        if nbytes <= 0:
            return
        self.budget.adopt(zone, nbytes)
        with self._lock:
            self._committed[zone] += nbytes

    def uncommit(self, zone: str, nbytes: int) -> None:
        check_zone(zone)
        if nbytes <= 0:
            return
        with self._lock:
            if nbytes > self._committed[zone]:
                self.fault_underflow += 1
                nbytes = self._committed[zone]
            self._committed[zone] -= nbytes
        if nbytes:
            self.budget.release(zone, nbytes)

    def add_content(self, zone: str, nbytes: int) -> None:
        check_zone(zone)
        with self._lock:
            self._content[zone] += nbytes

    def remove_content(self, zone: str, nbytes: int) -> None:
        check_zone(zone)
        with self._lock:
            if nbytes > self._content[zone]:
                self.fault_underflow += 1
                nbytes = self._content[zone]
            self._content[zone] -= nbytes

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """zone -> (committed, content)."""
        with self._lock:
            return {z: (self._committed[z], self._content[z]) for z in ZONES}

    def total_committed(self) -> int:
        with self._lock:
            return sum(self._committed.values())

    def report(self, device_used_bytes: int, process_used_bytes: int) -> None:
        """Hand the latest zones and the device truth to the budget owner (next heartbeat)."""
        self.budget.report(self.snapshot(), device_used_bytes, process_used_bytes)
