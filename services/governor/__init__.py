"""The memory governor: the single budget owner and unified ledger of each GPU (DESIGN 2.7).

Public surface: `Ledger` and `Policy` (domain core, no grpc), `start_governor` (a running
server), and the worker's side in `services.governor.client` (BudgetOwner, LocalBudget,
GovernorClient, DeviceDescription).
"""
from services.governor.ledger import DeviceSpec, Lease, Ledger
from services.governor.policy import ZONES, Policy

__all__ = ["ZONES", "DeviceSpec", "Lease", "Ledger", "Policy"]
