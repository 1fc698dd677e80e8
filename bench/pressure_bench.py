"""Memory pressure (issue 14): waking an offloaded model, and decoding a model larger than its
weight budget through captured segments, each against pinned H2D measured in the same run.

One worker runtime, one decoder (default `8b-int4`, 4.9 GiB of weights):
1. Pinned H2D: `--h2d-mib` copied from pinned host memory on the copy stream, `--reps` times;
   the figure is the median rate. Every ratio below uses it.
2. Wake: generate once (plans captured), OffloadModel (weights to pinned host, caches dropped),
   then time the wake itself: from `ModelExecutor.resident()` entry (pin + page-in of every slot)
   until the copy and compute streams are idle; median of `--reps`. Target: wake <= 1.25x the
   model's slot bytes over the pinned H2D rate. The first token after a wake is printed too (it
   also recaptures the plans OffloadModel dropped).
3. Streaming decode: the slots' budget is lowered to `--budget-fraction` of the weights (never
   below the model's streaming floor; the same budget `--weight-budget-bytes` sets), so every
   plan runs as segments. Captured segments and eager launches, interleaved, `--trials` runs of
   `--steps` steps after `--warmup`; the figure is the median run. Targets: captured not
   slower than eager (>= 0.98 of its rate: through a budget a token is bound by its page-ins,
   which both modes issue alike, so graphs save launches the copies already hide; a strict
   "faster" would pass or fail on noise - 0.9994 on the H200 at df9a16f);
   captured tokens/s >= 80 % of what pinned H2D allows for the minimum bytes that must page per
   token (pinned rate / (slot weights - budget)): paging more than that is a cost, never an
   excuse; the bytes actually paged per token are printed beside the minimum; both modes' tokens identical to the unconstrained run of part
   2; resident weights (the slots' peak committed bytes) never above the budget; ledger against
   the device within 1 % (at the end of each part, releases collected).

The default model is `8b-int4` under a third of its weights; `--config large` runs the 70B-shaped
`large` (36.5 GiB of int4 weights) the same way (the same code path: weights > budget, segments,
prefetch; about a minute to draw its weights on 8 threads, 0.5 s a streamed token).

    python bench/pressure_bench.py                                   # GPU, 8b-int4 (~2-3 min)
    python bench/pressure_bench.py --config large --trials 1 --steps 4 --reps 2
    python bench/pressure_bench.py --backend sim --config small --steps 2 --trials 1 --reps 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.core.admission import streaming_floor_bytes

MiB = 1 << 20
MODES = ("captured", "eager")


def pinned_h2d(rt: WorkerRuntime, nbytes: int, reps: int) -> float:
    """Median pinned host -> device rate (bytes/s) on the copy stream, as page-ins copy."""
    dev = rt.device
    be = dev.backend
    host = be.alloc_pinned(nbytes)
    host[:] = 7
    dst = dev.arena.alloc(nbytes, "scratch", role="kv")
    try:
        be.copy_h2d_async(dst.ptr, host, dev.copy_stream)   # warm the path
        dev.synchronize(dev.copy_stream)
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            be.copy_h2d_async(dst.ptr, host, dev.copy_stream)
            dev.synchronize(dev.copy_stream)
            rates.append(nbytes / (time.perf_counter() - t0))
        return statistics.median(rates)
    finally:
        dev.arena.free(dst)
        dev.synchronize()
        dev.synchronize(dev.copy_stream)
        dev.arena.collect()
        be.free_pinned(host)


def idle(rt: WorkerRuntime) -> None:
    rt.device.synchronize()
    rt.device.synchronize(rt.device.copy_stream)
    rt.device.arena.collect()


def ledger_error(rt: WorkerRuntime) -> float:
    """|device use not explained by the ledger| / device use, streams idle and releases run."""
    idle(rt)
    used, _ = rt.device.truth()
    return abs(rt.device.unaccounted_bytes()) / max(1, used)


def wake(rt: WorkerRuntime, model_id: str, prompt: list[int], reps: int) -> dict:
    loaded = rt._get(model_id)
    slot_bytes = sum(int(rt.device.weights.get(k).nbytes) for k in loaded.executor._slot_keys())
    seconds, first_token = [], []
    for _ in range(reps):
        rt.offload_model(model_id)
        idle(rt)
        with loaded.lock:
            t0 = time.perf_counter()
            with loaded.executor.resident():
                rt.device.synchronize(rt.device.copy_stream)
                rt.device.synchronize()
                seconds.append(time.perf_counter() - t0)
        rt.offload_model(model_id)
        idle(rt)
        t0 = time.perf_counter()
        list(rt.generate(model_id, prompt, 1))   # one token: the stream ends (and unlocks) at it
        first_token.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds), "bytes": slot_bytes,
            "first_token_s": statistics.median(first_token)}


def driver_calls(rt: WorkerRuntime) -> tuple[int, str]:
    """Driver calls so far and how they were counted: the sim backend counts every call; on the
    device, the arena's and the slots' counters give the page-in path's (cuMemCreate, cuMemMap +
    cuMemSetAccess per mapping, cuMemUnmap + cuMemRelease per release, cuMemcpyHtoDAsync +
    cuEventRecord per page-in)."""
    calls = getattr(rt.device.backend, "calls", None)
    if calls is not None:
        return sum(calls.values()), "counted"
    a, w = rt.device.arena.counters, rt.device.weights.counters
    return (a["handles_created"] + 2 * a["commits"] + 2 * a["releases"] + 2 * w["page_ins"],
            "page-in path")


def decode_runs(rt: WorkerRuntime, model_id: str, prompt: list[int], args) -> dict:
    loaded = rt._get(model_id)
    model, weights = loaded.model, rt.device.weights
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with loaded.lock, loaded.executor.resident():
        for trial in range(args.trials):
            for mode in MODES:
                model.capture = mode == "captured"
                tok = model.prefill(prompt)
                seq, pos = [tok], len(prompt)
                for _ in range(args.warmup):
                    tok = model.decode(tok, pos)
                    pos += 1
                    seq.append(tok)
                idle(rt)
                s0, c0 = weights.stats(), driver_calls(rt)[0]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    tok = model.decode(tok, pos)
                    pos += 1
                    seq.append(tok)
                rt.device.synchronize()
                dt = time.perf_counter() - t0
                s1, (c1, how) = weights.stats(), driver_calls(rt)
                run = {"tokens_per_s": args.steps / dt, "tokens": seq,
                       "bytes_per_token": (s1["bytes_copied"] - s0["bytes_copied"]) / args.steps,
                       "page_ins_per_token": (s1["page_ins"] - s0["page_ins"]) / args.steps,
                       "driver_calls_per_token": (c1 - c0) / args.steps, "calls_counted": how,
                       # host time the page-ins spent in the driver and in our bookkeeping: the
                       # copies overlap compute only while the host issues them faster than H2D
                       "driver_ms_per_token": 1e3 * (s1["driver_seconds"] - s0["driver_seconds"])
                       / args.steps,
                       "bookkeeping_ms_per_token": 1e3 * (s1["bookkeeping_seconds"]
                                                          - s0["bookkeeping_seconds"]) / args.steps}
                runs[mode].append(run)
                print(f"{args.config} decode through the budget, {mode:>8} run {trial + 1}: "
                      f"{run['tokens_per_s']:7.2f} tokens/s, "
                      f"{run['bytes_per_token'] / MiB:8.1f} MiB paged/token, "
                      f"{run['page_ins_per_token']:6.1f} page-ins/token, "
                      f"{run['driver_calls_per_token']:7.1f} driver calls/token ({how}), "
                      f"host page-in time "
                      f"{run['driver_ms_per_token']:.1f} ms driver + "
                      f"{run['bookkeeping_ms_per_token']:.1f} ms bookkeeping per token",
                      flush=True)
    model.capture = rt.config.capture
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--config", default="8b-int4")
    ap.add_argument("--budget-fraction", type=float, default=1 / 3,
                    help="weight budget as a fraction of the model's weights (floored at the "
                         "smallest budget it can stream through)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="pinned H2D and wake samples")
    ap.add_argument("--h2d-mib", type=int, default=1024)
    add_record_flag(ap)
    args = ap.parse_args()
    targets = Targets("pressure_bench", args=args)
    # batching=False: the decode below drives one sequence's prefill/decode calls directly, the
    # path the streaming measurement is about (the scheduler adds nothing to a lone stream)
    rt = WorkerRuntime(WorkerConfig(backend=args.backend, batching=False)).start()
    try:
        t0 = time.perf_counter()
        rt.load_model("m", "decoder", args.config, 1)
        cfg = rt._get("m").cfg
        print(f"loaded {args.config} ({cfg.weight_bytes() / MiB:.1f} MiB of weights) in "
              f"{time.perf_counter() - t0:.1f} s on {rt.device.info.name}", flush=True)
        prompt = [(i * 31) % cfg.vocab_size for i in range(args.prompt)]
        # the unconstrained run: every weight resident, one captured graph per plan
        want = [c[0] for c in rt.generate("m", prompt, 1 + args.warmup + args.steps)]
        h2d = pinned_h2d(rt, min(args.h2d_mib * MiB, cfg.weight_bytes()), args.reps)
        print(f"pinned H2D: {h2d / 1e9:.2f} GB/s (median of {args.reps}, "
              f"{min(args.h2d_mib * MiB, cfg.weight_bytes()) / MiB:.0f} MiB)", flush=True)

        w = wake(rt, "m", prompt, args.reps)
        bound = w["bytes"] / h2d
        print(f"wake of the offloaded model: {w['seconds'] * 1e3:.1f} ms for "
              f"{w['bytes'] / MiB:.1f} MiB = {w['bytes'] / w['seconds'] / 1e9:.2f} GB/s "
              f"(bytes / pinned H2D: {bound * 1e3:.1f} ms); first token after a wake "
              f"{w['first_token_s'] * 1e3:.1f} ms", flush=True)
        targets.figure("pinned H2D (device layer, copy stream)", h2d / 1e9, "GB/s")
        targets.check("wake / (bytes over pinned H2D)", w["seconds"] / bound, "<=", 1.25,
                      unit="ratio", limit=h2d / 1e9)
        err = ledger_error(rt)
        targets.check("ledger vs device after the wakes (%)", 100 * err, "<=", 1.0)

        granule = rt.device.info.granule_bytes
        floor = streaming_floor_bytes(cfg, granule)
        budget = max(int(args.budget_fraction * cfg.weight_bytes()), floor)
        budget = -(-budget // granule) * granule
        rt.offload_model("m")
        rt.device.weights.set_budget(budget)
        rt.device.weights.peak_committed_bytes = 0
        print(f"weight budget {budget / MiB:.0f} MiB = {budget / cfg.weight_bytes():.2f} of the "
              f"weights (streaming floor {floor / MiB:.0f} MiB)", flush=True)
        runs = decode_runs(rt, "m", prompt, args)
        executor = rt._get("m").executor
        decode_plan = executor.plans.get(("decode", 1, 1))
        segments = decode_plan.streamed.schedule.segments if decode_plan.streamed else []
        streams = (decode_plan.streamed.schedule.streamed_bytes(executor.weight_cost)
                   if segments else 0)
        print(f"decode plan: {len(segments)} segments: "
              + ", ".join(f"{s.label} {s.cost / MiB:.0f} MiB{' kept' if s.stays else ''}"
                          for s in segments)
              + f"; the schedule streams {streams / MiB:.1f} MiB per run", flush=True)
        med = {m: statistics.median(r["tokens_per_s"] for r in runs[m]) for m in MODES}
        paged = statistics.median(r["bytes_per_token"] for r in runs["captured"])
        must = max(0, w["bytes"] - budget)       # the minimum that must page in per token
        allowed = h2d / must if must else float("nan")
        print(f"== streaming decode (median of {args.trials}): captured {med['captured']:.2f}, "
              f"eager {med['eager']:.2f} tokens/s; {paged / MiB:.1f} MiB paged per token vs "
              f"{must / MiB:.1f} MiB that must page (slot weights - budget: "
              f"{paged / must if must else float('nan'):.2f}x the minimum); pinned H2D allows "
              f"{allowed:.2f} tokens/s for the minimum", flush=True)
        targets.figure("streaming decode, captured", med["captured"], "tok/s", limit=allowed)
        targets.figure("bytes paged per token / minimum that must page",
                       paged / must if must else float("nan"), "ratio")
        per_token = {k: statistics.median(r[k] for r in runs["captured"])
                     for k in ("page_ins_per_token", "driver_calls_per_token",
                               "driver_ms_per_token")}
        groups = len(set(executor.slot_keys(executor.weight_keys())))
        print(f"per captured token: {per_token['page_ins_per_token']:.1f} page-ins "
              f"({groups} weight slots, {len(executor.weight_keys())} tensors), "
              f"{per_token['driver_calls_per_token']:.1f} driver calls, "
              f"{per_token['driver_ms_per_token']:.1f} ms in the driver", flush=True)
        targets.figure("page-ins per token, captured", per_token["page_ins_per_token"], "count")
        targets.figure("driver calls per token, captured", per_token["driver_calls_per_token"],
                       "count")
        targets.figure("host driver time per token, captured", per_token["driver_ms_per_token"],
                       "ms")
        stats = rt.device.weights.stats()
        print(f"weights: page-ins {stats['page_ins']}, hit rate {stats['hit_rate']:.3f}, "
              f"{stats['bytes_copied'] / 2**30:.2f} GiB copied, peak resident "
              f"{stats['peak_committed_bytes'] / MiB:.0f} MiB", flush=True)
        targets.require("streamed tokens identical to the unconstrained run",
                        all(r["tokens"] == want for m in MODES for r in runs[m]),
                        f"{args.trials} runs of each mode")
        targets.require("the model ran as segments", len(segments) > 1, f"{len(segments)}")
        targets.check("captured / eager tokens/s", med["captured"] / med["eager"], ">=", 0.98)
        targets.check("captured tokens/s / pinned-H2D-allowed for the minimum paging",
                      med["captured"] / allowed, ">=", 0.80, unit="fraction", limit=h2d / 1e9)
        targets.check("peak resident weights / budget", stats["peak_committed_bytes"] / budget,
                      "<=", 1.0)
        targets.check("ledger vs device after streaming (%)", 100 * ledger_error(rt), "<=", 1.0)
        targets.require("zero faults", rt.stats()["arena"]["faults"] == 0)
    finally:
        rt.close()
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
