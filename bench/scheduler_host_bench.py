"""Host cost of a continuous-batching decode step, without the device: the scheduler's own work
(reap, plan, reserve, stream the tokens) plus the paged decoder's input building
(`gpu_worker.models.paged.decode_inputs`), at the `8b-int4` decoder's block table width.

    .venv/bin/python bench/scheduler_host_bench.py [--batches 1,8,32,64] [--json out.json]

Why: every decode step pays this on the host before its graph replays, and the replay cannot
start earlier (the step's input tokens are the last step's outputs). On the H200 a batch-64 step
of 8b-int4 took ~33 ms and a batch-1 step ~5 ms (docs/scheduler.md), so a millisecond here is a
few percent of the step's time.

What runs: the real `Scheduler` and `KVBlockPool` (on a sim device's arena; the block geometry
keeps 8b-int4's 16-token blocks and 8192-token context, so tables are 512 entries wide, with one
layer so the pool's host memory stays small: a table's width does not depend on the layers).
The runner does what `PagedDecoderModel` does on the host and nothing on a device: it builds the
prefill and decode inputs with the real functions and returns a token per row.

Figures: median microseconds per decode-only step at each batch (and per row), over `--steps`
steps after the prompts are in. No target: `make bench-compare` prints these as tree/base ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker.device import Device
from gpu_worker.device.sim_backend import SimBackend
from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.runner import DecodeRow
from gpu_worker.engines.scheduler.sampling import GREEDY
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.models.configs import get_config
from gpu_worker.models.paged import decode_inputs, prefill_inputs


class HostOnlyRunner:
    """The paged decoder's host work per call (inputs built as for the device), no device."""

    def __init__(self, geometry: KVGeometry, prefill_chunk: int) -> None:
        self.geometry, self.prefill_chunk = geometry, prefill_chunk

    def prefill(self, tokens, start, table, sampling=GREEDY, sample=True):
        prefill_inputs(tokens, start, table, len(tokens), sampling)
        return (tokens[-1] + 1) % 1000 if sample else None

    def decode(self, rows: list[DecodeRow]) -> list[int]:
        decode_inputs(rows, self.geometry.max_blocks)
        return [(r.token + 1) % 1000 for r in rows]


def decode_step_us(dev: Device, geometry: KVGeometry, batch: int, prompt: int,
                   steps: int) -> float:
    """Median wall time of a decode-only step with `batch` running sequences."""
    capacity = batch * geometry.blocks_for(prompt + steps + 2)
    pool = KVBlockPool(dev.arena, geometry, capacity)
    sched = Scheduler(HostOnlyRunner(geometry, 2048), pool, thread=False,
                      max_batch_size=max(batch, 1), max_step_tokens=max(2048, batch))
    try:
        for i in range(batch):
            sched.submit([(i * 7 + k) % 1000 for k in range(prompt)], steps + 2)
        while sched.stats()["decode_tokens"] == 0:   # prompts in (one chunk each)
            sched.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            sched.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6
    finally:
        sched.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default="")
    add_record_flag(ap)
    args = ap.parse_args()
    targets = Targets("scheduler_host_bench", args=args)
    cfg = get_config("8b-int4", "decoder")
    geometry = KVGeometry(layers=1, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                          block_tokens=16, max_context=cfg.max_context)
    dev = Device(SimBackend(granule_bytes=2 << 20))
    print(f"scheduler + paged decoder host work per decode step (no device), table width "
          f"{geometry.max_blocks} blocks, prompt {args.prompt}, median of {args.steps} steps, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>6} {'us/step':>9} {'us/row':>8}")
    figures: dict[str, dict[str, float]] = {}
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            us = decode_step_us(dev, geometry, batch, args.prompt, args.steps)
            figures[f"batch_{batch}"] = {"step_us": us, "row_us": us / batch}
            print(f"{batch:>6} {us:>9.1f} {us / batch:>8.2f}", flush=True)
            targets.figure(f"host work per decode step, batch {batch}", us, "us")
    finally:
        dev.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loadavg": os.getloadavg()[0], **figures}, f, indent=1)
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
