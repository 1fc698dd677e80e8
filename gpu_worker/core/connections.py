"""What a worker runtime connects to when it starts: the budget owner, the reclaim policy wired to
every refusal and governor ask, and the kernel compiler with its shared cache.

Each piece is optional in the configuration (no `governor`: a local budget; no `cache`: local
compiles) and each is made only when configured, so the core imports no grpc unless a client
needs it.
"""
from __future__ import annotations

from collections.abc import Callable

from gpu_worker.config import WorkerConfig
from gpu_worker.core.reclaim import Reclaimer


def open_budget(cfg: WorkerConfig, backend):
    """The governor client registering this device, or None (book against a local budget)."""
    if not cfg.governor:
        return None
    from services.governor.client import DeviceDescription, GovernorClient
    free, total = backend.mem_get_info()
    info = backend.info
    return GovernorClient(cfg.governor, cfg.worker_id,
                          DeviceDescription(info.uuid, info.name, total, free, info.granule_bytes),
                          chunk_bytes=cfg.lease_chunk_bytes, tracer_provider=cfg.tracer_provider,
                          tls=cfg.tls, token=cfg.governor_token)


def wire_reclaim(cfg: WorkerConfig, device, budget, candidates: Callable[[], list],
                 kv_host=None) -> Reclaimer:
    """One reclaim policy answers the arena's refusals and the governor's asks; the weight budget
    becomes the smaller of the flag and the governor's weights cap; each report carries the host
    tier (`kv_host`: the worker's HostKVTier, or None)."""
    # A peer asked by the governor gives back on its next heartbeat (2 s by default).
    peer_wait = 2.5 * budget.heartbeat_s if budget is not None else 0.0
    reclaimer = Reclaimer(device, candidates, cfg.worker_id, peer_wait)
    device.arena.reclaimer = reclaimer.on_refusal
    if budget is not None:  # a reclaim ask is answered before the leases go back
        budget.on_reclaim = reclaimer.on_governor_ask
        # a cached-only ask stops after the cached KV step: no live sequence, plans or weights
        budget.on_reclaim_cached = reclaimer.on_governor_cached_ask
        # Each report tells the governor how much of zone kv is cached (issue 26): the bytes the
        # decoders' pools could decommit now without touching a block in use.
        budget.kv_cached = lambda: sum(m.kv_cached_bytes() for m in candidates()
                                       if not m.closed and hasattr(m, "kv_cached_bytes"))
        weights = device.weights
        # The host tier beside the device zones (issue 26: every byte on both tiers booked):
        # the weights' pinned host copies and the host KV budget's bytes in use.
        budget.host_tier = lambda: (weights.stats()["host_bytes"],
                                    kv_host.budget.in_use if kv_host is not None else 0)
        budget.on_caps = lambda caps: weights.set_budget(caps.get("weights"), "governor")
        budget.deliver_caps()   # the registration's; later ones come by heartbeat
    return reclaimer


def open_compiler(cfg: WorkerConfig, arch: str):
    """(the kernel cache client or None, the compiler). The compiler's spans sit between the
    worker's request span and the cache service's span, so they come from the worker's provider
    or the trace breaks in two."""
    from gpu_worker.compile import KernelCompiler
    cache_client = None
    if cfg.cache:
        from cache_service.client import KernelCacheClient
        cache_client = KernelCacheClient(cfg.cache, write_token=cfg.cache_write_token,
                                         tracer_provider=cfg.tracer_provider, tls=cfg.tls)
    compiler = KernelCompiler(arch, cache_dir=cfg.cache_dir, remote=cache_client,
                              namespace=cfg.cache_namespace, tracer_provider=cfg.tracer_provider)
    return cache_client, compiler
