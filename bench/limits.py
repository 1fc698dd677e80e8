"""The device's limits, measured in the run that divides by them (DESIGN 6.5, issue 21).

- `copy`: device-to-device copy of a 1 GiB buffer into another (read + write counted: 2 GiB moved
  per copy), far above the H200's 60 MB L2, so it measures HBM, not the cache.
- `h2d`: pinned host to device, 1 GiB.
- `tflops`: fp16 tensor-core matmul (cuBLAS, fp32 accumulation), 8192^3, the operands rotating
  through buffers several times the L2.
Each is the median of `trials` timed windows (CUDA events); the spread is printed with it. Every
GPU benchmark calls `measure()` first and divides its "fraction of the limit" figures by the
result, and records the limits next to its figures.

`rotation(nbytes)` says how many buffers of `nbytes` a kernel benchmark rotates through so that
no replay finds its working set in L2.

`same_bytes(nbytes)` is the limit for a kernel whose one launch reads `nbytes`: a plain copy
moving that many bytes (half read, half written), one launch after another in a CUDA graph and
rotating out of L2, as the kernel benchmarks time theirs. A launch's ramp and tail are a larger
part of a short one: on the H100 a copy moving 67 MB runs at 0.78 of the 1 GiB copy's rate and
one moving 134 MB at 0.86 (docs/kernels.md, "The copy limit at a launch's bytes").

    python bench/limits.py [--record [DIR]]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

L2_BYTES = 60 << 20           # H200; a working set below this measures L2, not HBM
ROTATE_FACTOR = 4             # rotate through at least this many L2s of distinct data
GiB = 1 << 30


def rotation(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """Buffers of `nbytes` to rotate through so the set is >= ROTATE_FACTOR x L2 (at least 2)."""
    return max(2, math.ceil(ROTATE_FACTOR * l2_bytes / max(1, nbytes)))


@dataclass(frozen=True)
class Limits:
    copy_gbs: float            # D2D, read + write counted, GB/s (1e9)
    h2d_gbs: float             # pinned H2D, GB/s
    tflops: float              # fp16 tensor-core matmul, TFLOP/s
    spread: dict               # name -> (min, max) over the trials

    def lines(self) -> list[str]:
        s = self.spread
        return [(f"limit copy (D2D 1 GiB, read+write): {self.copy_gbs:,.0f} GB/s "
                 f"(trials {s['copy'][0]:,.0f}-{s['copy'][1]:,.0f})"),
                (f"limit h2d (pinned, 1 GiB): {self.h2d_gbs:,.1f} GB/s "
                 f"(trials {s['h2d'][0]:,.1f}-{s['h2d'][1]:,.1f})"),
                (f"limit fp16 tensor-core matmul (8192^3): {self.tflops:,.0f} TFLOP/s "
                 f"(trials {s['tflops'][0]:,.0f}-{s['tflops'][1]:,.0f})")]

    def record(self, targets) -> None:
        """Record the limits as figures of the bench that measured them."""
        targets.figure("limit: D2D copy 1 GiB (read+write)", self.copy_gbs, "GB/s")
        targets.figure("limit: pinned H2D 1 GiB", self.h2d_gbs, "GB/s")
        targets.figure("limit: fp16 tensor-core matmul 8192^3", self.tflops, "TFLOP/s")


def _timed(torch, fn, reps: int, trials: int) -> list[float]:
    """Seconds per call of `fn`, one figure per trial (CUDA events around `reps` calls)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        out.append(start.elapsed_time(stop) / 1e3 / reps)
    return out


def _graph_timed(torch, ops: list, trials: int) -> list[float]:
    """Seconds per op, one figure per trial: `ops` (one launch each) captured back to back in one
    CUDA graph, the graph replayed between CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for op in ops:
            op()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for op in ops:
            op()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        out.append(start.elapsed_time(stop) / 1e3 / len(ops))
    return out


@dataclass(frozen=True)
class SameBytes:
    """What plain kernels reach on launches of `nbytes` each (GB/s, medians over the trials)."""
    nbytes: int
    copy_gbs: float            # torch copy_ moving nbytes: nbytes / 2 read + nbytes / 2 written
    sum_gbs: float             # torch.sum reading nbytes (information: a read-only reduction)

    def line(self, copy_1gib_gbs: float | None = None) -> str:
        of = f" ({self.copy_gbs / copy_1gib_gbs:.2f} of the 1 GiB copy)" if copy_1gib_gbs else ""
        return (f"copy moving {self.nbytes / 1e6:,.1f} MB a launch: {self.copy_gbs:,.0f} GB/s{of}; "
                f"torch.sum reading them: {self.sum_gbs:,.0f} GB/s")


def same_bytes(nbytes: int, trials: int = 5) -> SameBytes | None:
    """The copy limit for a kernel whose one launch reads `nbytes` (None without torch or a
    device): launches of a copy moving `nbytes`, and of torch.sum reading them, each through
    `rotation(nbytes)` buffers, at least 16 launches a graph."""
    from bench import peer
    if not peer.available():
        return None
    torch = peer.torch
    count = rotation(nbytes)
    launches = max(16, 2 * count)
    moved = 4 * (nbytes // 4)
    copy = [moved / t / 1e9 for t in _copies_timed(torch, nbytes // 4, count, launches, trials)]
    read = [moved / t / 1e9 for t in _sums_timed(torch, nbytes // 2, count, launches, trials)]
    torch.cuda.empty_cache()
    return SameBytes(nbytes, statistics.median(copy), statistics.median(read))


def _copies_timed(torch, elems: int, count: int, launches: int, trials: int) -> list[float]:
    """Seconds per launch of `launches` copies of `elems` fp16 through `count` buffer pairs."""
    src = [torch.empty(elems, dtype=torch.float16, device="cuda").normal_() for _ in range(count)]
    dst = [torch.empty_like(s) for s in src]
    return _graph_timed(torch, [lambda i=i: dst[i % count].copy_(src[i % count])
                                for i in range(launches)], trials)


def _sums_timed(torch, elems: int, count: int, launches: int, trials: int) -> list[float]:
    """Seconds per launch of `launches` fp32 sums of `elems` fp16 through `count` buffers."""
    bufs = [torch.empty(elems, dtype=torch.float16, device="cuda").normal_() for _ in range(count)]
    return _graph_timed(torch, [lambda i=i: torch.sum(bufs[i % count], dtype=torch.float32)
                                for i in range(launches)], trials)


def _copy_rates(torch, nbytes: int, trials: int) -> tuple[list[float], list[float]]:
    """GB/s per trial: D2D (read + write counted) and pinned H2D, `nbytes` buffers."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    host = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=True)
    copy = [2 * nbytes / t / 1e9 for t in _timed(torch, lambda: dst.copy_(src), 5, trials)]
    h2d = [nbytes / t / 1e9
           for t in _timed(torch, lambda: dst.copy_(host, non_blocking=True), 2, trials)]
    return copy, h2d


def _matmul_rates(torch, trials: int, m: int = 8192) -> list[float]:
    """fp16 TFLOP/s per trial of m^3 matmuls rotating through operands larger than L2."""
    count = rotation(3 * m * m * 2)
    mats = [(torch.randn(m, m, device="cuda", dtype=torch.float16),
             torch.randn(m, m, device="cuda", dtype=torch.float16),
             torch.empty(m, m, device="cuda", dtype=torch.float16)) for _ in range(count)]
    turn = [0]

    def mm():
        a, b, c = mats[turn[0] % count]
        turn[0] += 1
        torch.matmul(a, b, out=c)
    return [2 * m ** 3 / t / 1e12 for t in _timed(torch, mm, 2 * count, trials)]


def measure(trials: int = 5, copy_bytes: int = GiB, quiet: bool = False) -> Limits | None:
    """The three limits on the current CUDA device (None without torch or a device)."""
    from bench import peer
    if not peer.available():
        if not quiet:
            print(f"limits: not measured ({peer.why_unavailable()})", flush=True)
        return None
    torch = peer.torch
    copy, h2d = _copy_rates(torch, copy_bytes, trials)
    tf = _matmul_rates(torch, trials)
    torch.cuda.empty_cache()
    limits = Limits(statistics.median(copy), statistics.median(h2d), statistics.median(tf),
                    {"copy": (min(copy), max(copy)), "h2d": (min(h2d), max(h2d)),
                     "tflops": (min(tf), max(tf))})
    if not quiet:
        for line in limits.lines():
            print(line, flush=True)
    return limits


def main() -> int:
    from bench.record import add_record_flag
    from bench.targets import Targets
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    add_record_flag(p)
    args = p.parse_args()
    targets = Targets("limits", args=args)
    limits = measure(args.trials)
    if limits is None:
        return 0
    limits.record(targets)
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
