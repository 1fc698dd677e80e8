"""Diverse (batch, seq) embedding traffic through the encoder, with the plan and variant bounds
(defaults: 2 plans, 4 variants per node) and without them (1000 / 1000), in one run.

Per bound: device memory after every request, its peak vs the steady state (mean of the last
quarter), plans and variants held, and whether plans evicted and rebuilt give bit-identical
embeddings (every shape seen twice is compared with its first result).

    python bench/encoder_bench.py                       # GPU: large-encoder, 120 requests
    python bench/encoder_bench.py --backend sim --config tiny-encoder --requests 30
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.device.backend import DeviceError
from services.common.errors import ResourceExhausted

GiB = float(1 << 30)


def traffic(n: int, seed: int, max_seq: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    shapes = [(int(b), int(s)) for b, s in zip(rng.choice([1, 2, 4, 8, 16], 40),
                                               rng.integers(8, max_seq, 40))]
    return [shapes[int(i)] for i in rng.integers(0, len(shapes), n)]


def run(args: argparse.Namespace, plans: int, variants: int) -> dict:
    rt = WorkerRuntime(WorkerConfig(backend=args.backend, max_plans=plans,
                                    variants_per_node=variants)).start()
    try:
        rt.load_model("enc", "encoder", args.config, 1)
        cfg = rt._get("enc").cfg
        dev = rt.device
        first: dict[tuple[int, int], np.ndarray] = {}
        used, mismatches, compared, ooms = [], 0, 0, 0
        start = time.perf_counter()
        for i, (batch, seq) in enumerate(traffic(args.requests, 7, min(args.max_seq, cfg.max_context))):
            seqs = [[(b * 131 + t * 17) % cfg.vocab_size for t in range(seq)] for b in range(batch)]
            try:
                out = rt.embed("enc", seqs)
            except (ResourceExhausted, DeviceError) as exc:
                ooms += 1
                print(f"   OOM/refused at {(batch, seq)}: {exc}", flush=True)
                continue
            if (batch, seq) in first:
                compared += 1
                mismatches += int(not np.array_equal(first[(batch, seq)], out))
            else:
                first[(batch, seq)] = out
            dev.synchronize()
            used.append(dev.truth()[0])
            if i % 10 == 0:
                st = rt.stats()
                print(f"  req {i:>4} {(batch, seq)!s:>12}: device {used[-1] / GiB:6.2f} GiB, "
                      f"ledger {st['ledger_bytes'] / GiB:6.2f} GiB, plans {st['plans']['entries']}, "
                      f"max variants/node {st['kernel_cache']['max_variants_per_node']}", flush=True)
        seconds = time.perf_counter() - start
        tail = used[-max(1, len(used) // 4):]
        r = {"plans": plans, "variants": variants, "peak": max(used), "steady": sum(tail) / len(tail),
                 "compared": compared, "mismatches": mismatches, "ooms": ooms, "seconds": seconds,
                 "distinct": len(first), "stats": rt.stats()}
        print(f"-- plans {plans}, variants {variants}: peak {r['peak'] / GiB:.2f} GiB, steady "
              f"{r['steady'] / GiB:.2f} GiB, {len(first)} distinct shapes, {compared} repeats compared, "
              f"{mismatches} not bit-identical, OOMs {ooms}, {seconds:.1f} s", flush=True)
        return r
    finally:
        rt.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--config", default="large-encoder")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--max-seq", type=int, default=512)
    add_record_flag(p)
    args = p.parse_args()
    targets = Targets("encoder_bench", args=args)
    bounded = run(args, 2, 4)
    unbounded = run(args, 1000, 1000)
    print("\n== side by side", flush=True)
    for r in (bounded, unbounded):
        print(f"plans {r['plans']:>4} variants {r['variants']:>4}: peak {r['peak'] / GiB:7.2f} GiB "
              f"({r['peak'] / bounded['peak']:.2f}x of bounded), peak/steady {r['peak'] / r['steady']:.3f}, "
              f"rebuilt bit-identical {r['compared'] - r['mismatches']}/{r['compared']}, OOMs {r['ooms']}",
              flush=True)
        name = f"plans {r['plans']} variants {r['variants']}"
        targets.figure(f"{name}: peak device memory", r["peak"] / GiB, "GiB")
        targets.require(f"{name}: rebuilt plans bit-identical", r["mismatches"] == 0,
                        f"{r['compared'] - r['mismatches']}/{r['compared']}")
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
