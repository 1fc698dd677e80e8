"""fp16 attention kernels (gpu_worker.kernels.flash_attention) against their peers, side by side.

1. Roofline: a device-to-device copy of 1 GiB (read + write bytes per second).
2. Split-K decode over an fp16 KV cache (32 heads, 8 KV heads, head_dim 128): KV bytes read per
   second as a fraction of the copy. Target: >= 0.60 of the copy at 8k context, batch 1.
3. Causal prefill (32 / 8 / 128, and head_dim 64) against torch scaled_dot_product_attention fp16
   (its K/V expanded to 32 heads before timing, torch's fastest path). Target: ours / SDPA <= 1.5
   at 2048 and 5502 tokens.

Timing, the same on every side: one CUDA graph of `--reps` launches (ours through the device
layer, torch through torch.cuda.graph; the copy the same way), replayed `--trials` times, each
replay timed by the wall clock between synchronisations; the statistic is the median replay / reps.
A missed target prints MISSED and the process exits 1.

    python3 bench/attention_bench.py [--reps 20 --trials 7]        # on the GPU machine
    python3 bench/attention_bench.py --backend sim --small          # smoke run of the code path
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._kernel_bench import kernel_bench_parser, open_bench_device
from gpu_worker.kernels import (
    FLASH_ATTENTION_COMBINE,
    FLASH_ATTENTION_DECODE_SPLIT,
    FLASH_ATTENTION_PREFILL,
    flash_decode_splits,
    flash_decode_workspace_bytes,
    launch_flash_attention_decode,
    launch_flash_attention_prefill,
)
from gpu_worker.kernels.selfcheck import KernelHarness

GiB = 1 << 30
DECODE_TARGET = 0.60    # of the copy bandwidth, at 8k context
PREFILL_TARGET = 1.5    # ours / SDPA, at 2048 and 5502 tokens


def median_replay(replay: Callable[[], None], sync: Callable[[], None], reps: int,
                  trials: int) -> float:
    """Seconds per launch: the median over `trials` timed replays of a graph of `reps` launches."""
    replay()
    sync()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        replay()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / reps


def ours(dev, launch: Callable[[object], None], reps: int, trials: int) -> float:
    launch(dev.stream)  # warm (module loads, first-launch costs) outside the graph
    dev.synchronize()
    with dev.capture() as cap:
        for _ in range(reps):
            launch(cap.stream)
    try:
        return median_replay(lambda: dev.replay(cap.graph_exec), dev.synchronize, reps, trials)
    finally:
        dev.destroy_graph_exec(cap.graph_exec)


def torch_sdpa(tokens: int, heads: int, hd: int, reps: int, trials: int) -> float | None:
    """torch SDPA fp16 causal, K/V already at `heads` heads, by CUDA graph replay; None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    q, k, v = (torch.randn(1, heads, tokens, hd, device="cuda", dtype=torch.float16) for _ in "qkv")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return median_replay(graph.replay, torch.cuda.synchronize, reps, trials)


class Bench:
    def __init__(self, h: KernelHarness, reps: int, trials: int) -> None:
        self.h, self.dev, self.reps, self.trials = h, h.device, reps, trials
        self.rng = np.random.default_rng(0)

    def f16(self, *shape: int) -> int:
        return self.h.put(self.rng.standard_normal(shape, dtype=np.float32).astype(np.float16))

    def buf(self, nbytes: int) -> int:
        return self.h.put(np.zeros(nbytes, np.uint8))

    def copy_bandwidth(self, nbytes: int) -> float:
        src, dst, be = self.buf(nbytes), self.buf(nbytes), self.dev.backend
        t = ours(self.dev, lambda s: be.copy_d2d_async(dst, src, nbytes, s), max(2, self.reps // 4),
                 self.trials)
        return 2 * nbytes / t

    def decode(self, batch: int, length: int, heads: int, kv_heads: int, hd: int) -> tuple[float, int]:
        """(seconds, splits) of one split-K decode over `length` keys per sequence."""
        h, dev = self.h, self.dev
        splits = flash_decode_splits(length, batch, heads, kv_heads)
        row = kv_heads * hd
        kc, vc = self.f16(batch, length, row), self.f16(batch, length, row)
        q, out = self.f16(batch, heads * hd), self.buf(2 * batch * heads * hd)
        ws = self.buf(flash_decode_workspace_bytes(batch=batch, heads=heads, head_dim=hd,
                                                   splits=splits))
        lens = h.put(np.full(batch, length, np.int32))
        fs, fc = h.function(FLASH_ATTENTION_DECODE_SPLIT), h.function(FLASH_ATTENTION_COMBINE)
        t = ours(dev, lambda s: launch_flash_attention_decode(
            dev, fs, fc, out, ws, q, kc, vc, lens, batch, heads, kv_heads, hd, heads * hd, row,
            length * row, 0, length, splits, stream=s), self.reps, self.trials)
        return t, splits

    def prefill(self, tokens: int, heads: int, kv_heads: int, hd: int) -> float:
        dev, f = self.dev, self.h.function(FLASH_ATTENTION_PREFILL)
        q, out = self.f16(tokens, heads * hd), self.buf(2 * tokens * heads * hd)
        row = kv_heads * hd
        k, v = self.f16(tokens, row), self.f16(tokens, row)
        return ours(dev, lambda s: launch_flash_attention_prefill(
            dev, f, out, q, k, v, 0, 0, 1, tokens, heads, kv_heads, hd, heads * hd, row,
            tokens * row, stream=s), self.reps, self.trials)


def main() -> int:
    ap = kernel_bench_parser(__doc__)
    args = ap.parse_args()
    s = 16 if args.small else 1  # shape divisor
    dev, compiler = open_bench_device(args)
    missed: list[str] = []
    with KernelHarness(dev, compiler) as h:
        b = Bench(h, args.reps, args.trials)
        copy = b.copy_bandwidth(GiB // s)
        print(f"\n[1] d2d copy: {copy / 1e9:.0f} GB/s (read + write)")

        print("\n[2] split-K decode over fp16 KV (32 heads, 8 KV heads, head_dim 128); "
              f"target >= {DECODE_TARGET:.2f} of the copy at 8k, batch 1")
        print(f"{'batch':>5} {'kv len':>7} {'splits':>6} {'us':>8} {'KV GB/s':>8} {'of copy':>7}")
        for batch, length in ((1, 1024), (1, 4096), (1, 8192), (8, 8192)):
            length = max(64, length // s)
            t, splits = b.decode(batch, length, 32, 8, 128)
            kv_bytes = 2 * batch * length * 8 * 128 * 2
            frac = kv_bytes / t / copy
            verdict = ""
            if batch == 1 and length == max(64, 8192 // s):
                verdict = "ok" if frac >= DECODE_TARGET else "MISSED"
                if verdict == "MISSED":
                    missed.append(f"decode at 8k: {frac:.2f} of the copy < {DECODE_TARGET}")
            print(f"{batch:5d} {length:7d} {splits:6d} {t * 1e6:8.1f} {kv_bytes / t / 1e9:8.0f} "
                  f"{frac:7.2f} {verdict}")

        print("\n[3] causal prefill vs torch SDPA fp16 (same graph-replay timing); "
              f"target ours/SDPA <= {PREFILL_TARGET} at 2048 and 5502")
        print(f"{'tokens':>7} {'hd':>4} {'ours ms':>8} {'TFLOP/s':>8} {'sdpa ms':>8} {'TFLOP/s':>8} "
              f"{'ours/sdpa':>9}")
        for tokens, hd in ((469, 128), (2048, 128), (5502, 128), (2048, 64)):
            tokens = max(8, tokens // s)
            flops = 4.0 * 32 * hd * tokens * tokens / 2  # causal: half of QK^T and of PV
            t = b.prefill(tokens, 32, 8, hd)
            tt = torch_sdpa(tokens, 32, hd, args.reps, args.trials) if args.backend == "cuda" else None
            row = f"{tokens:7d} {hd:4d} {t * 1e3:8.3f} {flops / t / 1e12:8.0f} "
            if tt is None:
                print(row + f"{'-':>8} {'-':>8} {'-':>9}")
                continue
            ratio = t / tt
            verdict = ""
            if hd == 128 and tokens in (2048, 5502):
                verdict = "ok" if ratio <= PREFILL_TARGET else "MISSED"
                if verdict == "MISSED":
                    missed.append(f"prefill {tokens}: {ratio:.2f}x SDPA > {PREFILL_TARGET}")
            print(row + f"{tt * 1e3:8.3f} {flops / tt / 1e12:8.0f} {ratio:9.2f} {verdict}")
    dev.close()
    for m in missed:
        print(f"MISSED: {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
