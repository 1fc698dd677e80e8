"""Kernel library benchmark (GPU, cuda backend). Prints ratios measured side by side in one run.

1. Roofline: a device-to-device copy of 1 GiB (read + write bytes per second).
2. Linears (1 row) at the 8b-int4 model's shapes: the fused int4 GEMV's weight bandwidth as a
   fraction of the copy bandwidth, and its speedup over the workspace path (dequant + matmul).
   Information: the GEMV serves only weights whose K is not a multiple of 128 (the tensor-core
   kernels take every other decode linear); the decode step's 1-row target is
   int4_batched_bench's ("decode step int4 linears at 1 row").
3. The fused/workspace crossover over the row count (checks linear.FUSED_MAX_ROWS).
4. matmul_nt (fp32 SIMT tiles) against torch.matmul fp32 and fp16 (cuBLAS), when torch is present.
5. Attention: the f32-q prefill over lengths (against torch scaled_dot_product_attention fp32 when
   present). Decode attention over the fp16 KV cache (flash split-K) is bench/attention_bench.py's.

Every int4 linear timing rotates through enough copies of its weight (bench/limits.rotation,
>= 4 x L2) that each launch reads it from HBM; fractions of copy divide by the D2D copy limit of
this run (bench/limits.py, when torch is importable; else the device layer's 1 GiB copy).

Same method on both sides: each timing (ours, and torch's cuBLAS / SDPA peers) captures `--reps`
launches into one CUDA graph (ours through the device layer, torch through torch.cuda.CUDAGraph),
replays it once warm, then times `--samples` replays by timing events around each (the device's
time: bench/_kernel_bench.median_replay); the figure is the median replay / reps. Launch and
synchronization latency are excluded on both sides.

Target (MISSED: exit status 1): at every row count up to FUSED_MAX_ROWS the fused int4 kernel is
faster than the dequant-workspace path (the crossover the threshold claims).

    python3 bench/kernels_bench.py [--reps 20]            # on the GPU machine
    python3 bench/kernels_bench.py --backend sim --small  # smoke run of the code path, no GPU
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import limits as bench_limits
from bench._kernel_bench import (
    device_clock,
    kernel_bench_parser,
    median_replay,
    open_bench_device,
    torch_clock,
)
from bench.limits import rotation
from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker.kernels import (
    ATTENTION_PREFILL,
    FUSED_MAX_ROWS,
    INT4_DEQUANT,
    INT4_MATMUL,
    MATMUL_NT,
    MATMUL_NT_LARGE,
    launch_attention_prefill,
    launch_int4_dequant,
    launch_int4_matmul,
    launch_matmul_nt,
    launch_matmul_nt_large,
)
from gpu_worker.kernels.selfcheck import KernelHarness

GiB = 1 << 30


SAMPLES = 5  # timed replays per figure (median), --samples


def timed(dev, launch, reps: int, samples: int = SAMPLES) -> float:
    """Seconds per launch: one graph of `reps` launches (median replay / reps)."""
    launch(dev.stream)
    dev.synchronize()
    with dev.capture() as cap:
        for _ in range(reps):
            launch(cap.stream)
    try:
        return median_replay(lambda: dev.replay(cap.graph_exec), device_clock(dev), samples, reps)
    finally:
        dev.destroy_graph_exec(cap.graph_exec)


def torch_timed(fn, reps: int, samples: int = SAMPLES) -> float | None:
    """Seconds per call of a torch op, timed as `timed` times ours: `reps` calls captured into one
    torch.cuda.CUDAGraph, median replay / reps. None without torch or when the op cannot be
    captured (printed)."""
    from bench import peer as bench_peer
    if not bench_peer.available():
        return None

    def run():
        for _ in range(reps):
            fn()
    try:
        graph = bench_peer.capture(run, warmup=1)
    except RuntimeError as exc:
        print(f"    torch peer could not be captured: {exc}", flush=True)
        return None
    try:
        return median_replay(graph.replay, torch_clock(), samples, reps)
    finally:
        del graph


class Bench:
    def __init__(self, h: KernelHarness, reps: int, samples: int = SAMPLES,
                 small: bool = False) -> None:
        self.h, self.dev, self.reps, self.samples, self.small = h, h.device, reps, samples, small
        self.rng = np.random.default_rng(0)

    def buf(self, nbytes: int) -> int:
        return self.h.put(np.zeros(nbytes, np.uint8))

    def rand_f32(self, *shape: int) -> int:
        return self.h.put(self.rng.standard_normal(shape, dtype=np.float32))

    def int4_weight(self, n: int, k: int) -> tuple[int, int, int]:
        kb = -(-k // 32)
        packed = self.h.put(self.rng.integers(0, 256, (n, kb * 16), dtype=np.uint8))
        scales = self.h.put((self.rng.uniform(0.5, 1.5, (n, kb)) / 64).astype(np.float16))
        return packed, scales, self.int4_bytes(n, k)

    def copy_bandwidth(self, nbytes: int) -> float:
        src, dst = self.buf(nbytes), self.buf(nbytes)
        be = self.dev.backend
        t = timed(self.dev, lambda s: be.copy_d2d_async(dst, src, nbytes, s),
                  max(2, self.reps // 4), self.samples)
        return 2 * nbytes / t

    def linear_times(self, m: int, n: int, k: int) -> tuple[float, float, int]:
        """(fused seconds, dequant+matmul seconds, weight bytes) for y = x @ W^T. Each launch
        takes the next of `rotation(weight bytes)` weight copies and a graph holds at least one
        launch per copy, so no replay finds its weight in L2 (wq's 9 MB would stay there)."""
        h, dev = self.h, self.dev
        weights = [self.int4_weight(n, k) for _ in range(1 if self.small else rotation(
            self.int4_bytes(n, k)))]
        wbytes = weights[0][2]
        reps = max(self.reps, len(weights))
        x, y = self.rand_f32(m, k), self.buf(4 * m * n)
        x16 = self.h.put(self.rng.standard_normal((m, k)).astype(np.float16))   # the GEMV reads fp16
        ws = self.buf(INT4_DEQUANT.workspace_bytes(n=n, k=k))
        fi, fd, fm = h.function(INT4_MATMUL), h.function(INT4_DEQUANT), h.function(MATMUL_NT)
        turn = itertools.count()

        def fused_one(s):
            packed, scales, _ = weights[next(turn) % len(weights)]
            launch_int4_matmul(dev, fi, y, x16, packed, scales, 0, m, n, k, stream=s)

        def two_step(s):
            packed, scales, _ = weights[next(turn) % len(weights)]
            launch_int4_dequant(dev, fd, ws, packed, scales, n, k, stream=s)
            launch_matmul_nt(dev, fm, y, x, ws, 0, m, n, k, stream=s)
        fused = timed(dev, fused_one, reps, self.samples)
        return fused, timed(dev, two_step, reps, self.samples), wbytes

    @staticmethod
    def int4_bytes(n: int, k: int) -> int:
        return n * -(-k // 32) * 18

    def matmul_time(self, m: int, n: int, k: int, large: bool = False) -> float:
        dev, f = self.dev, self.h.function(MATMUL_NT_LARGE if large else MATMUL_NT)
        launch = launch_matmul_nt_large if large else launch_matmul_nt
        x, w, y = self.rand_f32(m, k), self.rand_f32(n, k), self.buf(4 * m * n)
        return timed(dev, lambda s: launch(dev, f, y, x, w, 0, m, n, k, stream=s),
                     self.reps, self.samples)

    def prefill_time(self, tokens: int, heads: int, kv_heads: int, hd: int) -> float:
        dev, f = self.dev, self.h.function(ATTENTION_PREFILL)
        q, out = self.rand_f32(tokens, heads * hd), self.buf(4 * tokens * heads * hd)
        kc, vc = self.rand_f32(tokens, kv_heads * hd), self.rand_f32(tokens, kv_heads * hd)
        w = kv_heads * hd
        return timed(dev, lambda s: launch_attention_prefill(
            dev, f, out, q, kc, vc, 0, 0, 1, tokens, heads, kv_heads, hd, heads * hd, w, tokens * w,
            stream=s), max(1, self.reps // 4), self.samples)


def torch_matmul(m: int, n: int, k: int, dtype: str, reps: int, samples: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    dt = getattr(torch, dtype)
    a, b = torch.randn(m, k, device="cuda", dtype=dt), torch.randn(n, k, device="cuda", dtype=dt)
    return torch_timed(lambda: a @ b.T, reps, samples)


def torch_prefill(tokens: int, heads: int, kv_heads: int, hd: int, reps: int,
                  samples: int) -> float | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    q = torch.randn(1, heads, tokens, hd, device="cuda")
    k = torch.randn(1, kv_heads, tokens, hd, device="cuda")
    v = torch.randn_like(k)
    return torch_timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True), reps, samples)


def main() -> int:
    ap = kernel_bench_parser(__doc__, trials=False)
    ap.add_argument("--samples", type=int, default=SAMPLES,
                    help="timed replays per figure (median)")
    ap.add_argument("--linear-only", action="store_true",
                    help="sections [1]-[3] only (copy bandwidth and the int4 linears)")
    add_record_flag(ap)
    args = ap.parse_args()
    targets = Targets("kernels_bench", args=args)
    s = 16 if args.small else 1  # shape divisor
    lim = bench_limits.measure() if args.backend == "cuda" else None
    if lim:
        lim.record(targets)
    dev, compiler = open_bench_device(args)
    with KernelHarness(dev, compiler) as h:
        b = Bench(h, args.reps, args.samples, small=args.small)
        own = b.copy_bandwidth(GiB // s)
        # the limit of this run (bench/limits.py) when torch is here, else the device layer's
        copy = lim.copy_gbs * 1e9 if lim else own
        print(f"\n[1] d2d copy: {own / 1e9:.0f} GB/s through the device layer (read + write); "
              f"the copy limit divided by below: {copy / 1e9:.0f} GB/s"
              + (" (bench/limits.py)" if lim else " (the device layer's)"))
        targets.figure("d2d copy 1 GiB through the device layer (read+write)", own / 1e9, "GB/s")

        print("\n[2] decode linears, 1 row, 8b-int4 shapes: fused int4 vs workspace path")
        print(f"{'weight':>10} {'n x k':>14} {'fused us':>9} {'GB/s':>6} {'of copy':>7} "
              f"{'dequant us':>10} {'speedup':>7}")
        for name, n, k in (("wq", 4096, 4096), ("w_gate", 14336, 4096), ("w_down", 4096, 14336),
                           ("lm_head", 128256, 4096)):
            n, k = max(32, n // s), max(32, k // s)
            fused, two, wbytes = b.linear_times(1, n, k)
            print(f"{name:>10} {f'{n}x{k}':>14} {fused * 1e6:9.1f} {wbytes / fused / 1e9:6.0f} "
                  f"{wbytes / fused / copy:7.2f} {two * 1e6:10.1f} {two / fused:7.1f}x")
            if not args.small:   # small shapes are launch-bound: no bandwidth figure
                targets.figure(f"int4 GEMV (int4_matmul) {name}, 1 row: fraction of copy",
                               wbytes / fused / copy, "fraction", limit=copy / 1e9)

        print(f"\n[3] fused vs workspace path by rows (n = k = {4096 // s}); "
              f"FUSED_MAX_ROWS = {FUSED_MAX_ROWS}")
        print(f"{'rows':>6} {'fused us':>9} {'dequant us':>10} {'fused/dequant':>13}")
        worst = 0.0  # the largest fused/dequant time ratio at rows <= FUSED_MAX_ROWS
        for m in (1, 4, 16, 32, 64, 256, 1024):
            fused, two, _ = b.linear_times(m, 4096 // s, 4096 // s)
            print(f"{m:6d} {fused * 1e6:9.1f} {two * 1e6:10.1f} {fused / two:13.2f}")
            if m <= FUSED_MAX_ROWS:
                worst = max(worst, fused / two)
        targets.check(f"fused/dequant time at rows <= FUSED_MAX_ROWS ({FUSED_MAX_ROWS}), worst",
                      worst, "<", 1.0)

        if not args.linear_only:
            print("\n[4] matmul_nt (64x64 tiles) and matmul_nt_large (128x128) fp32 vs torch (cuBLAS)")
            print("    ratio = torch time / matmul_nt time (< 1: cuBLAS is faster)")
            print(f"{'m x n x k':>18} {'64 TFLOP/s':>10} {'128 TFLOP/s':>11} {'torch fp32':>10} "
                  f"{'ratio':>6} {'torch fp16':>10} {'ratio':>6}")
            for m, n, k in ((512, 4096, 4096), (2048, 14336, 4096), (5502, 4096, 4096)):
                m, n, k = m // s, n // s, k // s
                flops = 2.0 * m * n * k
                ours = b.matmul_time(m, n, k)
                large = b.matmul_time(m, n, k, large=True)
                row = f"{f'{m}x{n}x{k}':>18} {flops / ours / 1e12:10.1f} {flops / large / 1e12:11.1f}"
                peers = {}
                for dt in ("float32", "float16"):
                    t = (torch_matmul(m, n, k, dt, args.reps, args.samples)
                         if args.backend == "cuda" else None)
                    peers[dt] = t
                    row += f" {'-':>10} {'-':>6}" if t is None else \
                        f" {flops / t / 1e12:10.1f} {t / ours:6.2f}"
                print(row)
                shape = f"{m}x{n}x{k}"
                for tiles, t in (("64x64", ours), ("128x128", large)):
                    f32 = peers["float32"]
                    targets.figure(f"matmul_nt {tiles} fp32 {shape}", flops / t / 1e12, "TFLOP/s",
                                   peer=None if f32 is None else flops / f32 / 1e12)

            # [5a] (f32-KV decode attention, single pass vs split-K) is gone with those kernels
            # (issue 12 part C): decode attention over the fp16 cache is bench/attention_bench.py's.
            print("\n[5b] attention prefill, causal (32 heads, 8 KV heads, head_dim 128) vs torch SDPA fp32")
            print(f"{'tokens':>7} {'ours ms':>8} {'torch ms':>9} {'ours/torch':>10}")
            for tokens in (128, 512, 2048):
                tokens = max(8, tokens // s)
                t = b.prefill_time(tokens, 32, 8, 128)
                tt = (torch_prefill(tokens, 32, 8, 128, max(1, args.reps // 4), args.samples)
                      if args.backend == "cuda" else None)
                print(f"{tokens:7d} {t * 1e3:8.2f} " +
                      (f"{'-':>9} {'-':>10}" if tt is None else f"{tt * 1e3:9.2f} {t / tt:10.1f}"))
                targets.figure(f"attention prefill fp32, {tokens} tokens", t * 1e3, "ms",
                               peer=None if tt is None else tt * 1e3)
    dev.close()
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
