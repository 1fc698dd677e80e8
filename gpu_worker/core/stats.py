"""The worker's GetStats figures, gathered from the device, the models' executors and the compiler.

Keys are worker.proto GetStatsResponse field names (tests/execution/test_runtime.py pins that), so
the servicer converts the dict without a mapping table.
"""
from __future__ import annotations

from gpu_worker.engines.scheduler.histogram import STEP_BUCKETS, Histogram


def worker_stats(device, executors: list, compiler, reclaimer, budget, variant_bound: int) -> dict:
    """Nested dict of every figure GetStats reports, summed (or maxed) over the loaded models."""
    kc = {"entries": 0, "hits": 0, "misses": 0, "evictions": 0, "max_variants_per_node": 0,
          "workspace_bytes": 0, "variant_bound": variant_bound}
    plans = {"entries": 0, "evictions": 0, "hits": 0, "misses": 0, "graph_bytes": 0,
             "activation_bytes": 0}
    replays = 0
    for ex in executors:
        for key, value in ex.kernels.stats().items():
            if key == "max_variants_per_node":
                kc[key] = max(kc[key], value)
            elif key in kc and key != "variant_bound":
                kc[key] += value
        for key, value in ex.plans.stats().items():
            plans[key] += value
        replays += ex.replays()
    used, _ = device.truth()
    ledger = device.ledger.total_committed()
    w = device.weights.stats()
    a = device.arena.stats()
    gate = device.gate.stats
    comp = compiler.stats()
    return {
        "backend": device.backend.name,
        "device_name": device.info.name,
        "device_total_bytes": device.info.total_bytes,
        "device_used_bytes": used,
        "ledger_bytes": ledger,
        "unaccounted_bytes": device.unaccounted_bytes(),
        "zones": device.ledger.snapshot(),
        "kernel_cache": kc,
        "plans": plans,
        "weights": {"page_ins": w.get("page_ins", 0), "hits": w.get("hits", 0),
                    "evictions": w.get("evictions", 0), "hit_rate": w.get("hit_rate", 0.0),
                    "bytes_copied": w.get("bytes_copied", 0),
                    "resident_bytes": w.get("resident_bytes", 0),
                    "budget_bytes": w.get("budget_bytes", 0) or 0,
                    "host_bytes": w.get("host_bytes", 0),
                    "host_budget_bytes": w.get("host_budget_bytes", 0) or 0},
        "reclaim": reclaimer.stats() if reclaimer else {},
        "compile": dict(comp),
        "capture": {"captures": gate.captures,
                    "invalidations": device.capture_invalidations,
                    "gate_waits": gate.writer_waits, "replays": replays},
        "arena": {"reserved_bytes": a.get("reserved", 0),
                  "committed_bytes": a.get("committed", 0),
                  "peak_committed_bytes": a.get("peak_committed", 0),
                  "pooled_bytes": a.get("pooled_bytes", 0),
                  "quarantined_bytes": a.get("quarantined_bytes", 0),
                  "commits": a.get("commits", 0), "releases": a.get("releases", 0),
                  "faults": device.bookkeeping_faults()},
        "governor_connected": bool(budget.connected()) if budget else False,
    }


SCHEDULER_FIELDS = ("running", "waiting", "peak_batch_size", "steps", "preemptions",
                    "kv_block_tokens", "kv_blocks_total", "kv_blocks_used", "prefill_tokens",
                    "decode_tokens", "kv_committed_bytes", "finished", "cancelled", "rejected",
                    "prefix_cache_hit_tokens", "prefix_cache_queried_tokens", "kv_blocks_cached",
                    "kv_swapped_out_blocks", "kv_swapped_in_blocks", "kv_swap_outs",
                    "kv_swap_ins", "kv_swap_declined", "kv_swap_refused", "kv_swap_failed",
                    "kv_swap_host_bytes", "kv_swap_host_budget_bytes", "step_host_us",
                    "step_wait_us", "step_device_us", "kv_blocks_demoted", "kv_blocks_promoted",
                    "kv_host_cached_blocks", "kv_host_cached_bytes")
SCHEDULER_MAXED = ("peak_batch_size", "kv_block_tokens")


def scheduler_stats(schedulers: list) -> dict[str, int]:
    """GetStatsResponse.scheduler: summed over the decoders (maxed where a sum means nothing).

    The host KV tier is one pinned budget for the whole worker (HostKVBudget), shared by every
    decoder's swapper: `kv_swap_host_budget_bytes` is its limit, counted once however many
    decoders book in it (0 with no host tier, or no decoder loaded)."""
    out = dict.fromkeys(SCHEDULER_FIELDS, 0)
    budgets: dict[int, int] = {}
    for sched in schedulers:
        for key, value in sched.stats().items():
            if key in SCHEDULER_MAXED:
                out[key] = max(out[key], int(value))
            elif key in out:
                out[key] += int(value)
        budget = getattr(getattr(sched, "kv_swap", None), "budget", None)
        if budget is not None:
            budgets[id(budget)] = int(budget.limit_bytes)
    out["kv_swap_host_budget_bytes"] = sum(budgets.values())
    return out


def scheduler_histograms(schedulers: list) -> dict[str, Histogram]:
    """Time to first token, time per output token, queue time and the engine step's wall, host
    and device times, merged over the decoders."""
    out = {"ttft_seconds": Histogram(), "tpot_seconds": Histogram(), "queue_seconds": Histogram(),
           "step_seconds": Histogram(STEP_BUCKETS), "step_host_seconds": Histogram(STEP_BUCKETS),
           "step_device_seconds": Histogram(STEP_BUCKETS)}
    for sched in schedulers:
        for name, hist in sched.histograms().items():
            out[name].merge(hist)
    return out
