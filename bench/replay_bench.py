"""DESIGN 1.1 replay: 12 prompts of 469..5502 tokens, ascending then descending, through a decoder
that fills a large part of the device, once with the default per-node variant bound and once with
it lifted (GPUPLANE_KERNEL_VARIANTS_PER_NODE=1000), in one run.

Per request: device memory (cuMemGetInfo and nvidia-smi), ledger, latency, OOM. Summary per bound:
peak vs steady state (mean of the last four requests), descending peak vs ascending peak, growth
through the second half of the ascending pass (retention), ledger vs device, and the ratio of the
two bounds side by side. The targets (no OOM, peak within 10 % of steady, descending peak <= ascending
peak, second-half growth <= 10 %, ledger within 1 % of the device) apply to the first bound of
`--bounds` (the default bound); the later ones are the control that shows the failure. A target
MISSED makes the exit status 1.

By default every prompt length is its own prefill shape (`--bucketing off`), which is the traffic
that broke the original system; `--bucketing on` runs the product path (lengths rounded up onto the
plan ladder, at most five shapes here).

    python bench/replay_bench.py                      # GPU: 8b-int4, bounds 16 and 1000
    python bench/replay_bench.py --backend sim --config small --lengths 40,90,130,200
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.config import DEFAULT_VARIANTS_PER_NODE
from gpu_worker.device.backend import DeviceError
from services.common.errors import ResourceExhausted

LENGTHS = (469, 812, 1103, 1577, 1902, 2311, 2756, 3190, 3688, 4207, 4861, 5502)
GiB = float(1 << 30)


def nvidia_smi_used(ordinal: int) -> int | None:
    """Device-used bytes as nvidia-smi reports them (None where there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", str(ordinal)], capture_output=True, text=True, check=False)
    try:
        return int(out.stdout.strip().splitlines()[0]) << 20
    except (ValueError, IndexError):
        return None


def run_bound(args: argparse.Namespace, bound: int) -> dict:
    rt = WorkerRuntime(WorkerConfig(backend=args.backend, batching=False, variants_per_node=bound,
                                    max_plans=args.max_plans)).start()
    try:
        t0 = time.perf_counter()
        rt.load_model("replay", "decoder", args.config, 1)
        loaded = rt._get("replay")
        loaded.model.bucketed = args.bucketing == "on"
        dev = rt.device
        print(f"\n== bound {bound}: {args.config} loaded in {time.perf_counter() - t0:.1f} s, "
              f"device used {dev.truth()[0] / GiB:.2f} GiB, ledger {dev.ledger.total_committed() / GiB:.2f} GiB",
              flush=True)
        print(f"{'pass':>5} {'len':>5} {'seconds':>8} {'cuMemGetInfo':>12} {'nvidia-smi':>10} "
              f"{'ledger':>8} {'workspace':>9} {'variants':>8} {'oom':>4}", flush=True)
        rows = []
        lengths = [int(x) for x in args.lengths.split(",")]
        vocab = loaded.cfg.vocab_size
        for pass_name, order in (("asc", lengths), ("desc", lengths[::-1])):
            for n in order:
                prompt = [(i * 7919 + n) % vocab for i in range(n)]
                start = time.perf_counter()
                oom = False
                try:
                    list(rt.generate("replay", prompt, args.new_tokens))
                except (ResourceExhausted, DeviceError) as exc:
                    oom = True
                    print(f"   OOM/refused at {n}: {exc}", flush=True)
                seconds = time.perf_counter() - start
                dev.synchronize()
                used, _ = dev.truth()
                smi = nvidia_smi_used(dev.info.ordinal)
                ledger = dev.ledger.total_committed()
                ks = loaded.executor.kernels.stats()
                rows.append({"pass_": pass_name, "n": n, "seconds": seconds, "used": used,
                             "smi": smi, "ledger": ledger, "workspace": ks["workspace_bytes"],
                             "variants": ks["max_variants_per_node"], "oom": oom})
                print(f"{pass_name:>5} {n:>5} {seconds:>8.2f} {used / GiB:>11.2f}G "
                      f"{(smi / GiB if smi is not None else float('nan')):>9.2f}G {ledger / GiB:>7.2f}G "
                      f"{ks['workspace_bytes'] / GiB:>8.2f}G {ks['max_variants_per_node']:>8} "
                      f"{'yes' if oom else '':>4}", flush=True)
        return summarize(bound, rows)
    finally:
        rt.close()


def summarize(bound: int, rows: list[dict]) -> dict:
    used = [r["used"] for r in rows]
    steady = sum(used[-4:]) / 4
    asc = max(r["used"] for r in rows if r["pass_"] == "asc")
    desc = max(r["used"] for r in rows if r["pass_"] == "desc")
    ledger_err = max(abs(r["used"] - r["ledger"]) / r["used"] for r in rows)
    # Retention shows as growth through the ascending pass; a bounded cache plateaus once its
    # LRUs are full. Compare the end of the ascending pass with its middle.
    asc_used = [r["used"] for r in rows if r["pass_"] == "asc"]
    growth = asc_used[-1] / asc_used[len(asc_used) // 2]
    s = {"bound": bound, "peak": max(used), "steady": steady, "asc_peak": asc, "desc_peak": desc,
         "ooms": sum(r["oom"] for r in rows), "ledger_err": ledger_err, "growth": growth,
         "mean_seconds": sum(r["seconds"] for r in rows) / len(rows)}
    print(f"-- bound {bound}: peak {s['peak'] / GiB:.2f} GiB, steady {steady / GiB:.2f} GiB "
          f"(peak/steady {s['peak'] / steady:.3f}), asc peak {asc / GiB:.2f} GiB, desc peak "
          f"{desc / GiB:.2f} GiB, second-half growth {growth:.3f}, OOMs {s['ooms']}, max |device - ledger| / device {ledger_err:.4f}, "
          f"mean latency {s['mean_seconds']:.2f} s", flush=True)
    return s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--config", default="8b-int4")
    p.add_argument("--bounds", default=f"{DEFAULT_VARIANTS_PER_NODE},1000",
                   help="per-node variant bounds, run in this order (the first: the default)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--max-plans", type=int, default=2)
    p.add_argument("--bucketing", choices=("on", "off"), default="off")
    p.add_argument("--prefill-chunk", type=int, default=8192,
                   help="GPUPLANE_PREFILL_CHUNK for the run; 8192 (above every length) keeps one "
                        "prefill shape per length, the traffic DESIGN 1.1 describes")
    add_record_flag(p)
    args = p.parse_args()
    os.environ["GPUPLANE_PREFILL_CHUNK"] = str(args.prefill_chunk)
    results = [run_bound(args, int(b)) for b in args.bounds.split(",")]
    print("\n== side by side", flush=True)
    base = results[0]
    for r in results:
        print(f"bound {r['bound']:>5}: peak {r['peak'] / GiB:7.2f} GiB ({r['peak'] / base['peak']:.2f}x "
              f"of bound {base['bound']}), OOMs {r['ooms']}, peak/steady {r['peak'] / r['steady']:.3f}, "
              f"desc/asc {r['desc_peak'] / r['asc_peak']:.3f}, growth {r['growth']:.3f}, ledger err {r['ledger_err']:.4f}",
              flush=True)
    targets = Targets("replay_bench", args=args)
    b = f"bound {base['bound']}"
    targets.check(f"{b} OOMs", base["ooms"], "<=", 0, fmt="d")
    targets.check(f"{b} peak/steady", base["peak"] / base["steady"], "<=", 1.10, fmt=".3f")
    targets.check(f"{b} desc/asc peak", base["desc_peak"] / base["asc_peak"], "<=", 1.0, fmt=".3f")
    targets.check(f"{b} second-half growth", base["growth"], "<=", 1.10, fmt=".3f")
    targets.check(f"{b} max |device - ledger| / device", base["ledger_err"], "<=", 0.01, fmt=".4f")
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
