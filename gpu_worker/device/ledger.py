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

from services.common.errors import InvalidArgument
from services.governor.client import BudgetOwner, LocalBudget
from services.governor.policy import LEASABLE_ZONES, check_zone
from services.governor.policy import ZONES as _GOVERNOR_ZONES

# The zones a worker books, in the proto enum's order (the governor's list less report-only ones).
ZONES: tuple[str, ...] = tuple(z for z in _GOVERNOR_ZONES if z in LEASABLE_ZONES)


def local_budget(budget_bytes: int) -> BudgetOwner:
    """Admission against a fixed budget in this process: the worker's budget with no governor."""
    return LocalBudget(budget_bytes)


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
