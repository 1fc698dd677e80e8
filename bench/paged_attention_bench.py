"""Paged KV attention (gpu_worker.kernels.paged_attention) against the contiguous flash kernels,
side by side, for each block size; and the sampler.

1. Decode, batch 32, 32 heads / 8 KV heads / head_dim 128, every sequence at `ctx` keys: the
   paged split-K decode (blocks scattered over the pool by a random table) at block_tokens
   16/32/64/128 against flash_attention's contiguous decode on the same lengths.
   Target: the best block size costs <= 1.15x the contiguous decode at ctx 4096.
2. Prefill chunk of 2048 tokens after 2048 cached ones (keys 0..4095), same heads: paged at each
   block size against the contiguous flash prefill with the same prefix.
   Target: the best block size <= 1.15x contiguous.
   The block size printed as "fastest overall" minimises decode (batch 32, ctx 4096) + prefill
   time, weighted equally.
3. Sampling, vocab 128256, batch 1/32/64: greedy, temperature only, top-k 50 + top-p 0.9 (info).

Timing as bench/attention_bench.py: one CUDA graph of `--reps` launches, median of `--trials`
replays / reps. A missed target prints MISSED and the process exits 1.

    python3 bench/paged_attention_bench.py [--reps 20 --trials 7]      # on the GPU machine
    python3 bench/paged_attention_bench.py --backend sim --small        # smoke run
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._kernel_bench import kernel_bench_parser, open_bench_device
from bench.attention_bench import ours
from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker.kernels import (
    FLASH_ATTENTION_COMBINE,
    FLASH_ATTENTION_DECODE_SPLIT,
    FLASH_ATTENTION_PREFILL,
    flash_decode_splits,
    flash_decode_workspace_bytes,
    launch_flash_attention_decode,
    launch_flash_attention_prefill,
)
from gpu_worker.kernels.paged_attention import (
    FLASH_COMBINE_PAGED,
    FLASH_DECODE_SPLIT_PAGED,
    FLASH_PREFILL_PAGED,
    launch_flash_decode_paged,
    launch_flash_prefill_paged,
    paged_decode_span,
    paged_decode_splits,
)
from gpu_worker.kernels.sampling import SAMPLE, launch_sample
from gpu_worker.kernels.selfcheck import KernelHarness

HEADS, KVH, HD = 32, 8, 128
BLOCKS = (16, 32, 64, 128)
TARGET = 1.15


class Bench:
    def __init__(self, h: KernelHarness, reps: int, trials: int) -> None:
        self.h, self.dev, self.reps, self.trials = h, h.device, reps, trials
        self.rng = np.random.default_rng(0)
        self._noise = self.rng.standard_normal(1 << 20, dtype=np.float32).astype(np.float16)

    def f16(self, n: int) -> int:
        """n random-ish fp16 values (a random 1M tile repeated: cheap to make, same timing)."""
        return self.h.put(np.resize(self._noise, n))

    def buf(self, nbytes: int) -> int:
        return self.h.put(np.zeros(nbytes, np.uint8))

    def time(self, launch) -> float:
        return ours(self.dev, launch, self.reps, self.trials)

    def contiguous_decode(self, batch: int, ctx: int) -> float:
        h, dev, row = self.h, self.dev, KVH * HD
        max_len = ctx + 1
        splits = flash_decode_splits(max_len, batch, HEADS, KVH)
        kc, vc = self.f16(batch * max_len * row), self.f16(batch * max_len * row)
        q, out = self.f16(batch * HEADS * HD), self.buf(2 * batch * HEADS * HD)
        ws = self.buf(flash_decode_workspace_bytes(batch=batch, heads=HEADS, head_dim=HD, splits=splits))
        lens = h.put(np.full(batch, ctx, np.int32))
        fs, fc = h.function(FLASH_ATTENTION_DECODE_SPLIT), h.function(FLASH_ATTENTION_COMBINE)
        return self.time(lambda s: launch_flash_attention_decode(
            dev, fs, fc, out, ws, q, kc, vc, lens, batch, HEADS, KVH, HD, HEADS * HD, row,
            max_len * row, 0, max_len, splits, stream=s))

    def _pool(self, tokens: int, bt: int, rows: int) -> tuple[int, int, int]:
        """(pool, table, max_blocks): `rows` sequences of `tokens`, blocks scattered at random."""
        max_blocks = -(-tokens // bt)
        blocks = rows * max_blocks
        pool = self.f16(blocks * 2 * bt * KVH * HD)
        table = self.rng.permutation(blocks).astype(np.int32).reshape(rows, max_blocks)
        return pool, self.h.put(table), max_blocks

    def paged_decode(self, batch: int, ctx: int, bt: int) -> float:
        h, dev = self.h, self.dev
        pool, table, max_blocks = self._pool(ctx + 1, bt, batch)
        span = paged_decode_span(max_blocks, bt, batch, HEADS, KVH)
        splits = paged_decode_splits(max_blocks, bt, span)
        q, out = self.f16(batch * HEADS * HD), self.buf(2 * batch * HEADS * HD)
        ws = self.buf(flash_decode_workspace_bytes(batch=batch, heads=HEADS, head_dim=HD, splits=splits))
        pos = h.put(np.full(batch, ctx - 1, np.int32))   # ctx keys: positions 0..ctx-1
        fs, fc = h.function(FLASH_DECODE_SPLIT_PAGED), h.function(FLASH_COMBINE_PAGED)
        t = self.time(lambda s: launch_flash_decode_paged(
            dev, fs, fc, out, ws, q, pool, pos, table, batch, HEADS, KVH, HD, 0, 1, bt, max_blocks,
            span=span, stream=s))
        self.h.close()
        return t

    def contiguous_prefill(self, past: int, chunk: int) -> float:
        dev, f, row = self.dev, self.h.function(FLASH_ATTENTION_PREFILL), KVH * HD
        total = past + chunk
        q, out = self.f16(chunk * HEADS * HD), self.buf(2 * chunk * HEADS * HD)
        k, v = self.f16(total * row), self.f16(total * row)
        # the chunk's own K/V sit in the cache after the prefix: k/v point at the cache start
        return self.time(lambda s: launch_flash_attention_prefill(
            dev, f, out, q, k, v, 0, 0, 1, chunk, HEADS, KVH, HD, HEADS * HD, row, total * row,
            past, stream=s))

    def paged_prefill(self, past: int, chunk: int, bt: int) -> float:
        h, dev = self.h, self.dev
        pool, table, max_blocks = self._pool(past + chunk, bt, 1)
        q, out = self.f16(chunk * HEADS * HD), self.buf(2 * chunk * HEADS * HD)
        start, n = h.put(np.array([past], np.int32)), h.put(np.array([chunk], np.int32))
        f = h.function(FLASH_PREFILL_PAGED)
        t = self.time(lambda s: launch_flash_prefill_paged(
            dev, f, out, q, pool, start, n, table, chunk, HEADS, KVH, HD, 0, 1, bt, max_blocks,
            stream=s))
        self.h.close()
        return t

    def sample(self, batch: int, vocab: int, mode: str) -> float:
        h, dev = self.h, self.dev
        logits = h.put(self.rng.standard_normal((batch, vocab), dtype=np.float32) * 3)
        temp = {"greedy": 0.0, "temperature": 0.8, "top-k+top-p": 0.8}[mode]
        k, p = (50, 0.9) if mode == "top-k+top-p" else (0, 1.0)
        cols = [h.put(np.arange(batch, dtype=np.int32)), h.put(np.full(batch, temp, np.float32)),
                h.put(np.full(batch, p, np.float32)), h.put(np.full(batch, k, np.int32)),
                h.put(np.arange(batch, dtype=np.int32))]
        out, f = self.buf(4 * batch), h.function(SAMPLE)
        t = self.time(lambda s: launch_sample(dev, f, out, logits, *cols, batch, vocab, stream=s))
        self.h.close()
        return t


def main() -> int:
    ap = kernel_bench_parser(__doc__)
    add_record_flag(ap)
    args = ap.parse_args()
    s = 16 if args.small else 1
    dev, compiler = open_bench_device(args)
    targets = Targets("paged_attention_bench", args=args)
    batch = max(2, 32 // s)
    with KernelHarness(dev, compiler) as h:
        b = Bench(h, args.reps, args.trials)
        print(f"\n[1] decode, batch {batch}, {HEADS}/{KVH}/{HD}: paged / contiguous (us)")
        print(f"{'ctx':>6} {'contig':>8} " + " ".join(f"{'bt' + str(bt):>8}" for bt in BLOCKS)
              + " " + " ".join(f"{'r' + str(bt):>6}" for bt in BLOCKS))
        decode_at: dict[int, float] = {}
        for ctx in (1024, 4096):
            ctx = max(64, ctx // s)
            base = b.contiguous_decode(batch, ctx)
            h.close()
            paged = {bt: b.paged_decode(batch, ctx, bt) for bt in BLOCKS}
            print(f"{ctx:6d} {base * 1e6:8.1f} " + " ".join(f"{paged[bt] * 1e6:8.1f}" for bt in BLOCKS)
                  + " " + " ".join(f"{paged[bt] / base:6.2f}" for bt in BLOCKS), flush=True)
            if ctx == max(64, 4096 // s):
                decode_at = paged
                targets.check("paged decode (best block) / contiguous at ctx 4096",
                              min(paged.values()) / base, "<=", TARGET)

        past, chunk = max(64, 2048 // s), max(64, 2048 // s)
        print(f"\n[2] prefill chunk {chunk} after {past} cached tokens: paged / contiguous (ms)")
        base = b.contiguous_prefill(past, chunk)
        h.close()
        paged_p = {bt: b.paged_prefill(past, chunk, bt) for bt in BLOCKS}
        print(f"contiguous {base * 1e3:.3f}  " + "  ".join(
            f"bt{bt} {paged_p[bt] * 1e3:.3f} ({paged_p[bt] / base:.2f}x)" for bt in BLOCKS), flush=True)
        targets.check("paged prefill (best block) / contiguous", min(paged_p.values()) / base,
                      "<=", TARGET)
        best = min(BLOCKS, key=lambda bt: decode_at[bt] / min(decode_at.values())
                   + paged_p[bt] / min(paged_p.values()))
        print(f"fastest decode block: {min(BLOCKS, key=decode_at.get)}, fastest prefill block: "
              f"{min(BLOCKS, key=paged_p.get)}, fastest overall: {best}")

        vocab = 128256 // (s * s)
        print(f"\n[3] sampling, vocab {vocab} (us per call)")
        for bsz in (1, 32, 64):
            row = "  ".join(f"{mode} {b.sample(bsz, vocab, mode) * 1e6:8.1f}"
                            for mode in ("greedy", "temperature", "top-k+top-p"))
            print(f"batch {bsz:3d}: {row}", flush=True)
    dev.close()
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
