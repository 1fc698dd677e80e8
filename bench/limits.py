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
rotating out of L2, as the kernel benchmarks time theirs; beside it, a plain read-only launch
(bench/stream_read.cu, through CuPy) and torch.sum reading the bytes. A launch's ramp and tail
are a larger part of a short one: on the H100 a copy moving 67 MB runs at 0.90 of the 1 GiB
copy's rate; the plain read reads 67 MB at 1.07 of that copy's rate, torch.sum at 0.83
(docs/kernels.md, "The copy limit at a launch's bytes").

    python bench/limits.py [--record [DIR]]
    python bench/limits.py --same-bytes 33554432,67108864 [--record [DIR]]   # also same_bytes
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

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
    """What plain launches reach on `nbytes` each (GB/s, medians over the trials)."""
    nbytes: int
    memcpy_gbs: float          # torch copy_ (a memcpy node in the graph) moving nbytes
    kernel_gbs: float          # torch.neg(src, out=dst), an SM kernel, moving nbytes
    sum_gbs: float             # torch.sum reading nbytes (information: a read-only reduction)
    read_gbs: float | None = None   # gp_stream_read reading nbytes (None without CuPy)

    @property
    def copy_gbs(self) -> float:
        """The limit: the faster of the two copies (which one is faster depends on the size)."""
        return max(self.memcpy_gbs, self.kernel_gbs)

    def line(self, copy_1gib_gbs: float | None = None) -> str:
        of = f" ({self.copy_gbs / copy_1gib_gbs:.2f} of the 1 GiB copy)" if copy_1gib_gbs else ""
        read = "" if self.read_gbs is None else f"a plain read {self.read_gbs:,.0f}, "
        return (f"{self.nbytes / 1e6:,.1f} MB a launch: copy {self.copy_gbs:,.0f} GB/s{of} "
                f"(memcpy {self.memcpy_gbs:,.0f}, kernel {self.kernel_gbs:,.0f}); "
                f"{read}torch.sum reading them {self.sum_gbs:,.0f}")


def same_bytes(nbytes: int, trials: int = 5) -> SameBytes | None:
    """The copy limit for a kernel whose one launch reads `nbytes` (None without torch or a
    device): launches of a copy moving `nbytes` (half read, half written) as a memcpy and as a
    kernel, and of torch.sum reading them, each through `rotation(nbytes)` buffers, at least 16
    launches a graph."""
    from bench import peer
    if not peer.available():
        return None
    torch = peer.torch
    count = rotation(nbytes)
    launches = max(16, 2 * count)
    half = nbytes // 4                      # fp16 elements in half the bytes
    moved = 4 * half

    def rate(op, elems: int, pairs: bool) -> float:
        bufs = [torch.empty(elems, dtype=torch.float16, device="cuda").normal_()
                for _ in range(count)]
        outs = [torch.empty_like(x) for x in bufs] if pairs else [None] * count
        ops = [functools.partial(op, outs[i % count], bufs[i % count]) if pairs
               else functools.partial(op, bufs[i % count]) for i in range(launches)]
        return statistics.median([moved / t / 1e9 for t in _graph_timed(torch, ops, trials)])

    read = _stream_read(torch)
    found = SameBytes(nbytes, rate(lambda d, s: d.copy_(s), half, True),
                      rate(lambda d, s: torch.neg(s, out=d), half, True),
                      rate(lambda x: torch.sum(x, dtype=torch.float32), 2 * half, False),
                      None if read is None else max(rate(fn, 2 * half, False) for fn in read))
    torch.cuda.empty_cache()
    return found


STREAM_READ = Path(__file__).with_name("stream_read.cu")
STREAM_READ_UNROLL = (2, 4)   # 16-byte loads in flight a thread; the faster of the two is taken


def _stream_read(torch) -> list | None:
    """One launcher of gp_stream_read per STREAM_READ_UNROLL build, each taking a CUDA tensor and
    launching on torch's current stream (so a torch graph captures it); None without CuPy."""
    try:
        import cupy
        import numpy as np
    except ImportError:
        return None
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    code = STREAM_READ.read_text()

    def launcher(unroll: int):
        fn = cupy.RawModule(code=code, options=(f"-DU={unroll}",)).get_function("gp_stream_read")

        def launch(buf) -> None:
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn((2 * sms,), (1024,), (np.uint64(buf.data_ptr()),
                                         np.uint64(buf.numel() * buf.element_size() // 16),
                                         np.uint64(out.data_ptr())))
        return launch
    return [launcher(u) for u in STREAM_READ_UNROLL]


def head_order_read(nbytes: int, grids: tuple[int, ...], heads: int = 8,
                    trials: int = 5) -> dict[int, float] | None:
    """GB/s of gp_head_read (stream_read.cu) reading `nbytes` in the paged decode's order: rows
    of `heads` 256-byte pieces (the pool's KV rows), CTA (r, h) reading piece h of the r-th of
    `ranks` row ranges, for each `ranks` of `grids` (8: the batch-1 cluster decode's 64 CTAs);
    launches rotating out of L2 as same_bytes' (None without torch, CuPy or a device). The
    yardstick's question: is its layout, not the decode, what holds a read of these bytes below
    the contiguous read?"""
    from bench import peer
    if not peer.available():
        return None
    try:
        import cupy
        import numpy as np
    except ImportError:
        return None
    torch = peer.torch
    count = rotation(nbytes)
    rows = nbytes // (256 * heads)
    bufs = [torch.empty(rows * heads * 128, dtype=torch.float16, device="cuda").normal_()
            for _ in range(count)]
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    fn = cupy.RawModule(code=STREAM_READ.read_text(), options=("-DU=4",)).get_function(
        "gp_head_read")

    def launch(ranks: int, buf) -> None:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            fn((ranks, heads), (1024,), (np.uint64(buf.data_ptr()), np.uint64(rows),
                                         np.int32(heads), np.uint64(out.data_ptr())))

    found = {}
    for ranks in grids:
        ops = [functools.partial(launch, ranks, bufs[i % count])
               for i in range(max(16, 2 * count))]
        found[ranks] = statistics.median([rows * heads * 256 / t / 1e9
                                          for t in _graph_timed(torch, ops, trials)])
    del bufs
    torch.cuda.empty_cache()
    return found


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


def main(argv: list[str] | None = None) -> int:
    from bench.record import add_record_flag
    from bench.targets import Targets
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--same-bytes", type=_sizes, default=(), metavar="N[,N...]",
                   help="also same_bytes at each of these bytes a launch")
    add_record_flag(p)
    args = p.parse_args(argv)
    targets = Targets("limits", args=args)
    limits = measure(args.trials)
    if limits is None:
        return 0
    limits.record(targets)
    for nbytes in args.same_bytes:
        found = same_bytes(nbytes, args.trials)
        print(found.line(limits.copy_gbs), flush=True)
        record_same_bytes(targets, found)
    return targets.exit_code()


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(v) for v in text.split(","))
    if any(n < 16 for n in sizes):
        raise argparse.ArgumentTypeError(f"bytes a launch must be at least 16: {text}")
    return sizes


def record_same_bytes(targets, found: SameBytes) -> None:
    """same_bytes' rates at one size as figures of the bench that measured them."""
    mb = f"{found.nbytes / 1e6:,.1f} MB a launch"
    targets.figure(f"same bytes: copy, {mb}", found.copy_gbs, "GB/s")
    targets.figure(f"same bytes: memcpy, {mb}", found.memcpy_gbs, "GB/s")
    targets.figure(f"same bytes: copy kernel, {mb}", found.kernel_gbs, "GB/s")
    targets.figure(f"same bytes: torch.sum, {mb}", found.sum_gbs, "GB/s")
    if found.read_gbs is not None:
        targets.figure(f"same bytes: plain read, {mb}", found.read_gbs, "GB/s")


if __name__ == "__main__":
    sys.exit(main())
