"""Device-layer benchmark (GPU, cuda backend). Prints ratios measured side by side in one run.

1. Page-in throughput of weight slots (map at the stable address + pinned H2D on the copy stream)
   against the plain pinned H2D copy limit, same bytes, same run.
2. Weight offload under a budget holding 60 % of the weights, sweeping the layers in order (a
   decode step): VMM slots (packed in the arena, scan-resistant residency) against a
   cudaMalloc/cudaFree baseline (cuMemAlloc per page-in, cuMemFree per eviction, same residency
   policy, same committed-byte budget). Reports allocator time, page_ins, hits, hit rate,
   evictions and granule overhead.

    python3 bench/device_bench.py [--total-mib 4096] [--sweeps 6]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.device import Device
from gpu_worker.device.cuda_backend import CudaBackend, _drv, check
from gpu_worker.device.residency import ResidencyPolicy

MiB = 1 << 20


def layer_sizes(total: int, layers: int) -> list[int]:
    """Per-layer weights with the odd sizes real models have (not granule multiples)."""
    rng = np.random.default_rng(0)
    fracs = rng.uniform(0.5, 1.5, layers * 4)
    sizes = (fracs / fracs.sum() * total).astype(np.int64)
    return [int(s) // 256 * 256 + 256 for s in sizes]


def bench_page_in(dev: Device, nbytes: int, reps: int) -> dict:
    be = dev.backend
    host = be.alloc_pinned(nbytes)
    host[:] = 7
    dst = dev.arena.alloc(nbytes, "scratch", role="kv")
    be.copy_h2d_async(dst.ptr, host, dev.copy_stream)  # warm
    dev.synchronize(dev.copy_stream)
    t0 = time.perf_counter()
    for _ in range(reps):
        be.copy_h2d_async(dst.ptr, host, dev.copy_stream)
    dev.synchronize(dev.copy_stream)
    h2d = nbytes * reps / (time.perf_counter() - t0)
    dev.arena.free(dst)
    be.free_pinned(host)

    chunk = 64 * MiB
    keys = [f"pagein/{i}" for i in range(nbytes // chunk)]
    for k in keys:
        dev.weights.add(k, np.full(chunk, 3, dtype=np.uint8))
    dev.weights.ensure_resident(keys)  # warm: first mapping
    dev.synchronize()
    best = 0.0
    for _ in range(reps):
        for k in keys:
            dev.weights.evict(k)
        dev.synchronize()
        dev.synchronize(dev.copy_stream)
        dev.arena.collect()
        t0 = time.perf_counter()
        dev.weights.ensure_resident(keys)
        dev.synchronize()
        best = max(best, len(keys) * chunk / (time.perf_counter() - t0))
    for k in keys:
        dev.weights.remove(k)
    dev.synchronize()
    dev.synchronize(dev.copy_stream)
    dev.arena.collect()
    return {"pinned_h2d_GBps": h2d / 1e9, "page_in_GBps": best / 1e9, "ratio": best / h2d}


def bench_vmm_offload(dev: Device, sizes: list[int], sweeps: int, budget: int) -> dict:
    w = dev.weights
    keys = [f"layer/{i}" for i in range(len(sizes))]
    for k, n in zip(keys, sizes):
        w.add(k, np.full(n, 1, dtype=np.uint8))
    w.set_budget(budget)
    before = {k: w.counters[k] for k in w.counters}
    d0, t_wall = dev.arena.driver_seconds, time.perf_counter()
    peak_committed = 0
    for _ in range(sweeps):
        for i in range(0, len(keys), 4):  # one layer = 4 weights
            w.ensure_resident(keys[i:i + 4])
            peak_committed = max(peak_committed, dev.arena.zone_live_bytes("weights"))
        dev.synchronize()
    wall = time.perf_counter() - t_wall
    c = {k: w.counters[k] - before[k] for k in w.counters}
    resident = sum(s.nbytes for s in (w.get(k) for k in keys) if s.state in ("resident", "pending"))
    committed = dev.arena.zone_live_bytes("weights")
    out = {
        "allocator_ms (cuMemAlloc/cuMemFree)": 0.0,
        "vmm_driver_ms (create/map/unmap/release)": (dev.arena.driver_seconds - d0) * 1e3,
        "wall_ms": wall * 1e3,
        "page_ins": c["page_ins"], "hits": c["hits"], "evictions": c["evictions"],
        "hit_rate": c["hits"] / max(1, c["hits"] + c["misses"]),
        "granule_overhead": (committed - resident) / max(1, resident),
        "peak_committed_MiB": peak_committed / MiB,
    }
    for k in keys:
        w.remove(k)
    w.set_budget(None)
    dev.synchronize()
    dev.synchronize(dev.copy_stream)
    dev.arena.collect()
    return out


def bench_malloc_offload(dev: Device, sizes: list[int], sweeps: int, budget: int) -> dict:
    """The baseline of DESIGN 1.5: cuMemAlloc on page-in, cuMemFree on eviction."""
    d = _drv()
    be, g = dev.backend, dev.info.granule_bytes
    hosts = [be.alloc_pinned(n) for n in sizes]
    for h in hosts:
        h[:] = 1
    policy = ResidencyPolicy(budget)
    policy.window = len(sizes)
    ptrs: dict[int, int] = {}
    alloc_s = 0.0
    page_ins = hits = evictions = 0
    rounded = [-(-n // g) * g for n in sizes]  # what cudaMalloc pays per weight
    used = 0
    t_wall = time.perf_counter()
    for _ in range(sweeps):
        for i in range(0, len(sizes), 4):
            need = {str(j) for j in range(i, min(i + 4, len(sizes)))}
            for j in range(i, min(i + 4, len(sizes))):
                if j in ptrs:
                    hits += 1
                    policy.touch(str(j))
                    continue
                while used + rounded[j] > budget:
                    v = int(policy.victim(exclude=need))
                    t0 = time.perf_counter()
                    check(d.cuMemFree(ptrs.pop(v)), "cuMemFree")
                    alloc_s += time.perf_counter() - t0
                    used -= rounded[v]
                    policy.evicted(str(v))
                    evictions += 1
                t0 = time.perf_counter()
                p = int(check(d.cuMemAlloc(sizes[j]), "cuMemAlloc"))
                alloc_s += time.perf_counter() - t0
                ptrs[j] = p
                used += rounded[j]
                be.copy_h2d_async(p, hosts[j], dev.copy_stream)
                policy.admit(str(j), sizes[j])
                page_ins += 1
        dev.synchronize(dev.copy_stream)
    wall = time.perf_counter() - t_wall
    resident = sum(sizes[j] for j in ptrs)
    out = {
        "allocator_ms (cuMemAlloc/cuMemFree)": alloc_s * 1e3,
        "vmm_driver_ms (create/map/unmap/release)": 0.0,
        "wall_ms": wall * 1e3,
        "page_ins": page_ins, "hits": hits, "evictions": evictions,
        "hit_rate": hits / max(1, hits + page_ins),
        "granule_overhead": (used - resident) / max(1, resident),
        "peak_committed_MiB": used / MiB,
    }
    for p in ptrs.values():
        check(d.cuMemFree(p), "cuMemFree")
    for h in hosts:
        be.free_pinned(h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mib", type=int, default=4096, help="total weight bytes")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--sweeps", type=int, default=6)
    ap.add_argument("--pagein-mib", type=int, default=2048)
    args = ap.parse_args()
    dev = Device(CudaBackend(0))
    print(f"device: {dev.info.name} ({dev.info.arch}), granule {dev.info.granule_bytes // MiB} MiB")
    r = bench_page_in(dev, args.pagein_mib * MiB, reps=5)
    print(f"page-in: {r['page_in_GBps']:.1f} GB/s vs pinned H2D {r['pinned_h2d_GBps']:.1f} GB/s "
          f"-> ratio {r['ratio']:.2f} (target >= 0.80)")
    sizes = layer_sizes(args.total_mib * MiB, args.layers)
    budget = int(0.6 * sum(sizes))
    vmm = bench_vmm_offload(dev, sizes, args.sweeps, budget)
    base = bench_malloc_offload(dev, sizes, args.sweeps, budget)
    print(f"offload: {len(sizes)} weights, {sum(sizes) / MiB:.0f} MiB, budget {budget / MiB:.0f} MiB "
          f"(60 %), {args.sweeps} sweeps")
    print(f"{'metric':44s} {'VMM slots':>12s} {'cudaMalloc':>12s}")
    for k in vmm:
        a, b = vmm[k], base[k]
        fmt = "{:12.3f}" if isinstance(a, float) else "{:12d}"
        print(f"{k:44s} {fmt.format(a)} {fmt.format(b)}")
    print(f"wall-time ratio VMM/cudaMalloc: {vmm['wall_ms'] / base['wall_ms']:.2f}")
    dev.close()


if __name__ == "__main__":
    main()
