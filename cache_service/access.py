"""Who may call which KernelCacheService RPC (enforced by services.common.authz).

The cache serves code that workers execute, so a write is a poisoning risk: Store is for workers,
Prune (which evicts what every host relies on) for admins; reads for any authenticated caller.
"""
from __future__ import annotations

from services.common.authz import Rule
from services.common.identity import Level

ACCESS = {
    "Store": Rule(Level.WORKER),
    # A claim promises a Store (others wait for it): only a caller that may store may claim.
    "Claim": Rule(Level.WORKER),
    "ReleaseClaim": Rule(Level.WORKER),
    "Prune": Rule(Level.ADMIN),
    "Lookup": Rule(Level.AUTHENTICATED),
    "BatchLookup": Rule(Level.AUTHENTICATED),
    "GetStats": Rule(Level.AUTHENTICATED),
}
