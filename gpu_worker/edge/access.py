"""Who may call which WorkerService RPC (enforced by services.common.authz).

Loading, unloading, offloading and trimming change what a GPU holds and are admin calls (audit-logged even when
allowed); inference and the read-only views are for clients and above.
"""
from __future__ import annotations

from services.common.authz import Rule
from services.common.identity import Level

ACCESS = {
    "LoadModel": Rule(Level.ADMIN),
    "UnloadModel": Rule(Level.ADMIN),
    "Trim": Rule(Level.ADMIN),
    "OffloadModel": Rule(Level.ADMIN),
    "Generate": Rule(Level.CLIENT),
    "Embed": Rule(Level.CLIENT),
    "ListModels": Rule(Level.CLIENT),
    "GetStats": Rule(Level.CLIENT),
}
