"""Who may call which GovernorService RPC (enforced by services.common.authz when roles are set).

Every mutation is for workers, and a worker only on its own worker id: the lease calls carry the
worker id too, and the ledger already refuses a lease that is not that worker's, so checking the
id covers the leases. An admin may act on any worker (to deregister a dead one by hand).
"""
from __future__ import annotations

from services.common.authz import Rule
from services.common.identity import Level

_OWN = Rule(Level.WORKER, owner_field="worker_id")

ACCESS = {
    "RegisterWorker": _OWN,
    "DeregisterWorker": _OWN,
    "Acquire": _OWN,
    "Resize": _OWN,
    "Release": _OWN,
    "Heartbeat": _OWN,
    "GetResources": Rule(Level.AUTHENTICATED),
    "WatchResources": Rule(Level.AUTHENTICATED),
}
