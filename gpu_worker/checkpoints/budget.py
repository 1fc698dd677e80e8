"""Can this host hold what a load pins, and how many cores may the load convert on? The memory is
checked after every tensor is validated, before the first byte is converted.

Hazard: a real checkpoint larger than the host's memory is found by the allocator, as a worker
killed minutes into the load (the weight slots keep a pinned host copy of every weight).
Contract: `check_host` refuses, with RESOURCE_EXHAUSTED (zone "host"), a load whose `host_bytes`
(every weight's pinned copy plus the loader's pipeline, from the validated config) exceeds the
limit: by default the machine's physical memory, or its cgroup's memory limit where lower.
Memory already taken by other models is not subtracted: this refuses what can never fit, not
what does not fit now. A config.json that merely claims large shapes never gets here: its tensors
are checked against the files first (loader.py), and schema.py bounds every dimension.
Cost: arithmetic over the weight list (at most MAX_LAYERS x ~20 entries).
`host_cpus()` is the CPU side: os.cpu_count() is the node's count in a container, so a worker
under a Kubernetes CPU limit of 8 on a 128-core node would start 16 loader threads that the
quota then throttles, each GIL hand-off waiting for a core.
"""
from __future__ import annotations

import math
import os

from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.weights import weight_sizes
from services.common.errors import ResourceExhausted

SCRATCH_BYTES = 16 << 20   # the quantizer's per-thread scratch (~13 MiB), rounded up
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"                    # v2: "<quota> <period>" or "max ..."
_CGROUP_CPU_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us",      # v1: quota (-1: none), period
                  "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def host_bytes(cfg: ModelConfig, threads: int, lookahead: int, chunk_elems: int) -> int:
    """Peak host memory of loading `cfg`: every weight's pinned copy, plus the loader's window
    (`lookahead` + 1 converted tensors, taken as the heaviest run of twice as many consecutive
    entries of the load order, an int4 linear being two), plus per thread one staged chunk of
    `chunk_elems` (at most 4 bytes each) and the quantizer's scratch."""
    sizes = weight_sizes(cfg)
    span = 2 * (lookahead + 1)
    window = run = sum(sizes[:span])
    for i in range(span, len(sizes)):
        run += sizes[i] - sizes[i - span]
        window = max(window, run)
    return sum(sizes) + window + threads * (4 * chunk_elems + SCRATCH_BYTES)


def host_memory_limit() -> int:
    """The machine's physical memory, or its cgroup's memory limit where lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():   # "max": no limit
            limit = min(limit, int(text))
    return limit


def check_host(cfg: ModelConfig, need: int, limit: int | None = None) -> None:
    """Refuse a load whose `need` (host_bytes) exceeds `limit` (default: host_memory_limit())."""
    limit = host_memory_limit() if limit is None else limit
    if need > limit:
        raise ResourceExhausted(
            f"loading {cfg.name} ({cfg.weight_format}) needs about {need / 2**30:.1f} GiB of host "
            f"memory (the pinned weights and the loader's pipeline), more than this host's "
            f"{limit / 2**30:.1f} GiB: use a larger host, or weight_format 'int4' if this was "
            "'fp16'", asked_bytes=need, free_bytes=limit, zone="host")


def _read_words(path: str) -> list[str]:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().split()
    except OSError:
        return []


def cgroup_cpu_quota() -> float | None:
    """The cgroup's CPU limit in cores (quota / period; v2, else v1), None where there is none."""
    words = _read_words(_CGROUP_CPU_MAX)
    if len(words) == 2 and words[0] != "max":
        quota, period = words
    else:
        quota, period = (_read_words(path)[:1] for path in _CGROUP_CPU_V1)
        quota, period = (quota[0] if quota else ""), (period[0] if period else "")
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0:
        return None   # no limit ("max", -1) or no cgroup file
    return int(quota) / int(period)


def host_cpus() -> int:
    """The cores this process may use: its CPU affinity, or its cgroup's CPU limit (rounded up)
    where lower."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity call on this platform
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)
