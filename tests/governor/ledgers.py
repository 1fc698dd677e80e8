"""What the governor's ledger tests share: a clock the test moves, and a ledger over real SQLite."""
from __future__ import annotations

from services.governor.ledger import Ledger
from services.governor.policy import Policy
from services.governor.store import Store


class Clock:
    """time.monotonic for a ledger, moved by the test (`clock.now += ttl`)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path, clock, **policy) -> Ledger:
    """A ledger on a fresh database under `tmp_path`, budget_fraction 1.0 unless given."""
    policy.setdefault("budget_fraction", 1.0)
    return Ledger(Store(tmp_path / "gov.sqlite"), Policy(**policy), clock=clock)
