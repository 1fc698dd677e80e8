"""Where a paged decode step's device time goes: per kernel family, per batch, and the gaps.

The server's decode path in-process (PagedDecoderModel + Scheduler, the worker's defaults but
one thread): `--batches` sequences of a `--prompt`-token prompt each are prefilled, then
`--steps` pure decode steps are traced with CUPTI (torch.profiler, which sees every kernel of
the process, graph nodes included). Two traces per batch: launches serialized
(Device.dependent_launch off: each kernel's duration is its own work) for the per-family split,
and the library's default (dependent launch on) for the step span only, since an early-launched
kernel's duration includes its wait for the one before it.

Per step, printed and recorded: the span (first kernel start to last kernel end), the kernel
time by family (int4 linears by shape from their launch order, attention, norms, qkv rope + append,
SiLU, sampling, embedding) and the gaps (span minus the kernels' busy time: launch latency
between graph nodes). No targets: the issues' targets are in batching_bench and
int4_batched_bench; this says where to look.

    python bench/step_anatomy_bench.py [--batches 1,8,32,64 --prompt 512 --split-carveout PCT
        --record]   # on the GPU machine
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.engines.scheduler.sampling import GREEDY
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.kernels.paged_attention import FLASH_DECODE_SPLIT_PAGED
from gpu_worker.models.configs import get_config
from gpu_worker.models.paged import PagedDecoderModel

FAMILIES = (("gp_int4", "int4 linears"), ("gp_flash_decode", "attention"),
            ("gp_flash_combine", "attention"), ("gp_rmsnorm", "rmsnorm"),
            ("gp_qkv_rope", "qkv rope + append"), ("gp_silu", "silu x up"),
            ("gp_sample", "sample"), ("gp_embedding", "embedding"))


def family(name: str) -> str:
    return next((f for prefix, f in FAMILIES if name.startswith(prefix)), "other: " + name[:40])


LAYER_LINEARS = ("wqkv", "wo", "w_gateup", "w_down")   # a decoder layer's int4 linears, in order


def linear_names(step: list[dict], cfg) -> list[str]:
    """The decode linear each int4 kernel of a step ran, by launch order: a step is its layers'
    LAYER_LINEARS in turn, then lm_head, whatever kernel serves each (rows, xa, xk, async ...:
    a persistent grid or a cluster split says nothing of N). A step of any other count of int4
    kernels is named "int4 (unclassified)" throughout."""
    int4 = sorted((k for k in step if k["name"].startswith("gp_int4")), key=lambda e: e["ts"])
    if len(int4) != len(LAYER_LINEARS) * cfg.layers + 1:
        return ["int4 (unclassified)"] * len(int4)
    return [*LAYER_LINEARS * cfg.layers, "lm_head"]


def trace(sched: Scheduler, dev, steps: int) -> list[dict]:
    """The kernels of `steps` scheduler steps, from a CUPTI trace (chrome-trace events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            sched.step()
        dev.synchronize_device()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    events = json.loads(Path(path).read_text())["traceEvents"]
    os.unlink(path)
    return [e for e in events if e.get("cat") == "kernel"]


def split_steps(kernels: list[dict]) -> list[list[dict]]:
    """Kernels grouped into steps: a step starts at each embedding gather (the graph's first)."""
    steps: list[list[dict]] = []
    for k in sorted(kernels, key=lambda e: e["ts"]):
        if k["name"].startswith("gp_embedding") or not steps:
            steps.append([])
        steps[-1].append(k)
    return [s for s in steps if any(k["name"].startswith("gp_sample") for k in s)]


def busy_us(kernels: list[dict]) -> float:
    """The union of the kernels' intervals (overlapping kernels counted once)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda e: e["ts"]):
        s, e = k["ts"], k["ts"] + k["dur"]
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def span_us(step: list[dict]) -> float:
    return max(k["ts"] + k["dur"] for k in step) - min(k["ts"] for k in step)


def decoding(model: PagedDecoderModel, batch: int, prompt: int, steps: int, cfg) -> Scheduler:
    """A scheduler with `batch` sequences past their prefill, `steps` + a margin left to decode."""
    sched = Scheduler(model, model.pool, thread=False, max_batch_size=max(batch, 1),
                      max_step_tokens=2048)
    seqs = [sched.submit([(i * 131 + j * 7 + 1) % cfg.vocab_size for j in range(prompt)],
                         steps * 3 + 8, GREEDY) for i in range(batch)]
    for _ in range(10_000):
        if all(len(s.generated) >= 2 for s in seqs):
            break
        sched.step()
    for _ in range(3):   # past any step that still mixes a prefill chunk
        sched.step()
    return sched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="8b-int4")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12, help="decode steps traced per mode")
    ap.add_argument("--split-carveout", type=int, default=None, metavar="PCT",
                    help="the decode split kernel's preferred shared-memory carveout "
                         "(Device.set_shared_carveout), set before any graph is captured")
    add_record_flag(ap)
    args = ap.parse_args()
    try:
        import torch  # noqa: F401  (CUPTI through torch.profiler)
    except ImportError:
        print("step_anatomy_bench needs torch (torch.profiler) on the GPU machine")
        return 2
    targets = Targets("step_anatomy_bench", args=args)
    cfg = get_config(args.config)
    dev = open_device("cuda")
    compiler = KernelCompiler(dev.info.arch, cache_dir=Path(tempfile.mkdtemp()))
    batches = [int(b) for b in args.batches.split(",")]
    executor = ModelExecutor(dev, compiler)
    model = PagedDecoderModel(executor, cfg, 0, max_batch_size=max(batches))
    model.load()
    # figures of another prompt or carveout than the defaults say so in their names
    variant = ((f", prompt {args.prompt}" if args.prompt != 512 else "")
               + (f", split carveout {args.split_carveout} %"
                  if args.split_carveout is not None else ""))
    if args.split_carveout is not None:
        dev.set_shared_carveout(executor.function(FLASH_DECODE_SPLIT_PAGED), args.split_carveout)
    carved = "" if args.split_carveout is None else f", split carveout {args.split_carveout} %"
    print(f"device {dev.info.name}, {args.config}, prompt {args.prompt}, {args.steps} steps per "
          f"trace{carved}", flush=True)
    for b in batches:
        spans, fams, shapes = {}, collections.defaultdict(list), collections.defaultdict(list)
        for pdl in (False, True):
            dev.dependent_launch = pdl
            sched = decoding(model, b, args.prompt, args.steps, cfg)
            try:
                steps = split_steps(trace(sched, dev, args.steps))[1:]   # the first may be partial
            finally:
                sched.close()
            spans[pdl] = statistics.median(span_us(s) for s in steps)
            if pdl:
                continue
            for s in steps:
                per_f, per_shape = collections.Counter(), collections.Counter()
                for k in s:
                    per_f[family(k["name"])] += k["dur"]
                int4 = sorted((k for k in s if k["name"].startswith("gp_int4")),
                              key=lambda e: e["ts"])
                for k, name in zip(int4, linear_names(s, cfg), strict=True):
                    per_shape[name] += k["dur"]
                per_f["gaps"] = span_us(s) - busy_us(s)
                for f, v in per_f.items():
                    fams[f].append(v)
                for n, v in per_shape.items():
                    shapes[n].append(v)
            nodes = statistics.median(len(s) for s in steps)
        print(f"\nbatch {b}: step span {spans[False]:.0f} us serialized, {spans[True]:.0f} us with "
              f"dependent launch ({nodes:.0f} kernels a step)", flush=True)
        targets.figure(f"decode step span, batch {b}{variant}, serialized", spans[False], "us")
        targets.figure(f"decode step span, batch {b}{variant}, dependent launch", spans[True],
                       "us")
        for f, vs in sorted(fams.items(), key=lambda kv: -statistics.median(kv[1])):
            v = statistics.median(vs)
            print(f"  {f:<24} {v:8.0f} us  {v / spans[False]:5.1%}", flush=True)
            targets.figure(f"decode step {f}, batch {b}{variant}", v, "us")
        for n, vs in sorted(shapes.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"    {n:<22} {statistics.median(vs):8.0f} us", flush=True)
            targets.figure(f"decode step int4 {n}, batch {b}{variant}", statistics.median(vs),
                           "us")
    dev.close()
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
