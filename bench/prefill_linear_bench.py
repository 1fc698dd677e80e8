"""The prefill's int4 linears at Llama-3-8B shapes (execution/ops.py's tensor-core path: each tile
of weight rows dequantized to fp16 by int4_dequant_f16, then one cuBLAS GEMM) against PyTorch
fp16 `x @ W^T` with the weight already fp16, and the dequantization alone against the copy rate.

[1] int4_dequant_f16 alone over each weight (qkv, wo, gate_up, w_down) in tiles of the default
    size, for every words-per-thread build (half.DEQUANT_WORDS_CHOICES, each first checked bit
    for bit against the reference): microseconds, and the bytes it moves (int4 + scales read,
    fp16 written) per second as a fraction of this run's D2D copy rate (read + write counted:
    the same bytes-per-second meaning). The dequantization runs over every weight once per
    prefill chunk, whatever the chunk's length: it is the fixed cost of a chunk.
[2] the whole linear at 128 / 384 / 512 / 1152 / 2048 rows (buckets of the paged prefill's
    ladder, 128 rows apart) with tiles of 8 / 16 / 32 / 64 MiB (the library build) against
    torch, and one layer's four linears summed per row count: what a chunk's linears cost a
    layer (x 32 layers: a chunk of the 8b-int4 model), and the cost of one more row between
    row counts (PREFILL_LADDER assumes a chunk's cost grows with its bucket's rows).

Timing, the same on both sides: one CUDA graph of `--reps` launches replayed `--trials` times,
the median replay / reps (bench/attention_bench.ours); each launch takes the next of enough
copies of the weight (bench/limits.rotation, >= 4 x L2) that every launch reads it from HBM,
ours and torch's alike. No targets here (prefill_bench holds the prefill's); the figures are
recorded with `--record`.

    python3 bench/prefill_linear_bench.py [--reps 10 --trials 5 --record]   # on the GPU machine
    python3 bench/prefill_linear_bench.py --backend sim --small             # smoke run, no GPU
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import limits as bench_limits
from bench._kernel_bench import kernel_bench_parser, open_kernel_bench
from bench.attention_bench import ours
from bench.int4_batched_bench import tensor_launcher, torch_matmul
from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker.config import DEFAULT_DEQUANT_TILE_BYTES
from gpu_worker.kernels.half import DEQUANT_WORDS, DEQUANT_WORDS_CHOICES, dequant_build
from gpu_worker.kernels.selfcheck import KernelHarness, int4_dequant_f16_case

MiB = 1 << 20
# (name, n, k): one decoder layer's linears as the prefill graph runs them (qkv and gate/up fused)
SHAPES = (("qkv", 6144, 4096), ("wo", 4096, 4096), ("gate_up", 28672, 4096),
          ("w_down", 4096, 14336))
ROWS = (128, 384, 512, 1152, 2048)
TILE_MIB = (8, 16, 32, 64)
LAYERS = 32


def int4_bytes(n: int, k: int) -> int:
    """Packed weight + fp16 scales of an (n, k) int4 weight (K a multiple of 32)."""
    return n * k // 2 + n * (k // 32) * 2


def exact_builds(h, rng, targets: Targets) -> list[int]:
    """The words-per-thread builds whose tile is bit-exact against the reference (a tile that
    ends mid-pass, K % 32 != 0, scales from subnormal up); each is a printed requirement, and
    only these are timed."""
    exact = []
    for words in DEQUANT_WORDS_CHOICES:
        failure = int4_dequant_f16_case(h, rng, 301, 4104, row0=7, rows=250, wide=True,
                                        words=words).failure()
        if targets.require(f"int4_dequant_f16 with {words} words a thread is bit-exact",
                           failure is None, failure or ""):
            exact.append(words)
    return exact


def main(argv: list[str] | None = None) -> int:
    ap = kernel_bench_parser(__doc__)
    add_record_flag(ap)
    args = ap.parse_args(argv)
    div = 32 if args.small else 1
    limits, dev, compiler, targets = open_kernel_bench(args, "prefill_linear_bench")
    copy = limits.copy_gbs * 1e9 if limits else float("nan")
    rng = np.random.default_rng(0)
    shapes = [(name, max(64, n // div), max(128, k // div // 128 * 128)) for name, n, k in SHAPES]
    rows_list = [max(2, r // div) for r in ROWS]
    tiles = [t * MiB // div for t in TILE_MIB]
    default_tile = DEFAULT_DEQUANT_TILE_BYTES // div
    layer = {(r, t): 0.0 for r in rows_list for t in tiles}
    layer_torch = {r: 0.0 for r in rows_list}
    have_torch = args.backend == "cuda"
    linear_lines: list[str] = []
    with KernelHarness(dev, compiler) as h:
        builds = exact_builds(h, rng, targets)
        x16 = h.put(rng.standard_normal((max(rows_list), max(k for _, _, k in shapes)))
                    .astype(np.float16))
        y = h.put(np.zeros((max(rows_list), max(n for _, n, _ in shapes)), np.float32))
        tile = h.put(np.zeros(max(tiles) // 2, np.float16))
        print(f"\n[1] int4_dequant_f16 alone, {default_tile / MiB:g} MiB tiles: us, and int4 read "
              "+ fp16 written per second as a fraction of copy, per words-a-thread build "
              f"(library: {DEQUANT_WORDS})", flush=True)
        for name, n, k in shapes:
            moved = int4_bytes(n, k) + 2 * n * k
            copies = bench_limits.rotation(int4_bytes(n, k)) if not args.small else 1
            weights = [(h.put(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)),
                        h.put((rng.random((n, k // 32), dtype=np.float32) * 0.01).astype(np.float16)))
                       for _ in range(copies)]
            line = f"  {name:8s} {n:6d} x {k:6d}:"
            for words in builds:
                kdef = dequant_build(words)
                t = ours(dev, tensor_launcher(dev, h.function(kdef), weights, x16, y, tile,
                                              default_tile, 0, n, k, dequant=kdef, gemm=False),
                         args.reps, args.trials)
                line += f"  w{words} {t * 1e6:7.1f} us {moved / t / copy:5.2f}"
                targets.figure(f"int4_dequant_f16 {name} {n}x{k}, {words} words a thread", t * 1e6,
                               "us")
                if words == DEQUANT_WORDS and limits:
                    targets.figure(f"int4_dequant_f16 {name} {n}x{k}: fraction of copy",
                                   moved / t / copy, "ratio")
            print(line, flush=True)
            for rows in rows_list:
                line = f"  {name:8s} {n:6d} x {k:6d}, m={rows:5d}:"
                for tb in tiles:
                    launch = tensor_launcher(dev, h.function(dequant_build(DEQUANT_WORDS)), weights,
                                             x16, y, tile, tb, rows, n, k)
                    t = ours(dev, launch, args.reps, args.trials)
                    layer[rows, tb] += t
                    line += f" {tb / MiB:3g} MiB {t * 1e6:7.1f} us"
                if have_torch:
                    tt = torch_matmul(rows, n, k, args.reps, args.trials)
                    have_torch = tt is not None
                if have_torch:
                    layer_torch[rows] += tt
                    line += f"  torch {tt * 1e6:7.1f} us"
                linear_lines.append(line)
    print("\n[2] the whole linear (x16 in; dequant tiles + cuBLAS), us per tile size; torch fp16",
          *linear_lines, sep="\n", flush=True)
    print(f"\n    one layer's four linears (qkv + wo + gate_up + w_down), per tile size; x {LAYERS} "
          "layers in ms: a prefill chunk's linears", flush=True)
    for i, rows in enumerate(rows_list):
        line = f"  m={rows:5d}:"
        if i:
            prev = rows_list[i - 1]
            per_row = (layer[rows, default_tile] - layer[prev, default_tile]) / (rows - prev)
            line += f" (+{per_row * 1e6:6.2f} us a row from m={prev})"
        for tb in tiles:
            t = layer[rows, tb]
            line += f" {tb / MiB:3g} MiB {t * 1e6:7.1f} us ({t * LAYERS * 1e3:5.2f} ms)"
            if tb == default_tile:
                targets.figure(f"prefill linears of one layer, {rows} rows, {tb / MiB:g} MiB tiles",
                               t * 1e6, "us", peer=layer_torch[rows] * 1e6 if have_torch else None)
        if have_torch:
            tt = layer_torch[rows]
            line += (f"  torch {tt * 1e6:7.1f} us ({tt * LAYERS * 1e3:5.2f} ms); ours / torch at "
                     f"{default_tile / MiB:g} MiB {layer[rows, default_tile] / tt:4.2f}x")
        print(line, flush=True)
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
