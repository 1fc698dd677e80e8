"""What the kernel microbenchmarks share (attention, int4_batched, paged_attention, kernels): the
command line that picks the backend, the launches per timed graph and the smoke-size shapes, and
the device and NVRTC compiler they time on (a fresh disk cache: a benchmark compiles its own), and
how they time a graph (timing events around each replay, on our side and torch's alike)."""
from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench import limits as bench_limits
from bench.targets import Targets
from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device


def kernel_bench_parser(doc: str, trials: bool = True) -> argparse.ArgumentParser:
    """--backend, --reps, --small, and --trials unless the benchmark counts its samples itself."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    if trials:
        ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run on the sim)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch every kernel serialized (Device.dependent_launch off)")
    return ap


def open_bench_device(args: argparse.Namespace) -> tuple[object, KernelCompiler]:
    """The device `args.backend` names and a compiler for its arch; prints what the run is."""
    dev = open_device(args.backend)
    dev.dependent_launch = dev.dependent_launch and not getattr(args, "no_pdl", False)
    compiler = KernelCompiler(dev.info.arch, cache_dir=Path(tempfile.mkdtemp()))
    trials = f", trials {args.trials} (median)" if hasattr(args, "trials") else ""
    print(f"device: {dev.info.name} ({dev.info.arch}), backend {args.backend}, "
          f"reps {args.reps}{trials}, dependent launch {'on' if dev.dependent_launch else 'off'}",
          flush=True)
    return dev, compiler


def open_kernel_bench(args: argparse.Namespace, name: str):
    """(limits, device, compiler, targets) of a kernel benchmark's run: the device's limits
    measured first (cuda only, else None) and recorded as figures of `name`, then the device."""
    limits = bench_limits.measure() if args.backend == "cuda" else None
    targets = Targets(name, args=args)
    if limits:
        limits.record(targets)
    dev, compiler = open_bench_device(args)
    return limits, dev, compiler, targets


# -- timing a graph ------------------------------------------------------------------------------
# A clock runs `fn` (which enqueues device work on the timed stream) between two timing events and
# returns the device's seconds between them: no graph launch, wake-up or synchronization latency,
# which the host's wall clock around a replay adds to every replay (a fixed cost that weighs most on
# a graph of short launches: ten 30 us decodes). bench/limits.py times the copies that the
# benchmarks divide by the same way.
Clock = Callable[[Callable[[], None]], float]


def device_clock(dev) -> Clock:
    """Timing events on `dev`'s stream (the sim backend's: the wall time between reaching them)."""
    def seconds(fn: Callable[[], None]) -> float:
        start, stop = dev.create_event(timing=True), dev.create_event(timing=True)
        try:
            dev.record_event(start)
            fn()
            dev.record_event(stop)
            dev.wait_event(stop)
            return dev.event_elapsed_s(start, stop)
        finally:
            dev.destroy_event(start)
            dev.destroy_event(stop)
    return seconds


def torch_clock() -> Clock:
    """torch.cuda timing events on torch's current stream (where a torch graph replays)."""
    from bench import peer as bench_peer
    torch = bench_peer.torch

    def seconds(fn: Callable[[], None]) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3
    return seconds


def median_replay(replay: Callable[[], None], clock: Clock, trials: int, reps: int = 1) -> float:
    """Seconds a launch: a graph of `reps` launches replayed once warm, then `trials` replays each
    timed by `clock`; the median replay / reps."""
    clock(replay)
    return statistics.median(clock(replay) for _ in range(trials)) / reps
