"""Paged decode attention split by the actual length, against the copy bandwidth.

Llama-3-8B shapes (32 q heads, 8 KV heads, head_dim 128), block_tokens 16, a table of 8192 tokens
per row, every row at `ctx` keys. Each timed graph cycles over `layers` layers of the pool so the
KV read by consecutive launches is never L2-resident (the working set is >= 256 MB, the L2 60 MB).
A figure is the median over `--trials` replays of the graph of `--reps` launches, each replay timed
by timing events around it (the device's time, as bench/limits.py times the copies it is divided
by; bench/_kernel_bench.median_replay), divided by reps. At batch 1 a row is the median of that
over `--placements` pools (3), each allocated, filled and captured afresh, one after another: a
short launch's time moves between pools and over time more than a median of replays shows (the
library's row at 16,384 keys took 31.7 and 29.5 us in two processes a minute apart on one H100,
timing events); the slowest over the fastest is a recorded figure. Bytes counted: the K and V of every row's keys (the KV a decode must read); GB/s against a
device-to-device copy of 1 GiB (read + write) measured at the start of the same run
(bench/limits.py; without torch, a graph of cuMemcpyAsync nodes through the device layer, printed
as such).

1. batch 1/8/32/64 x ctx 1024/8192 as the decode graph runs it (the one-kernel cluster decode where
   paged_attention.cluster_decode holds, batch 1 here, then also the split and combine kernels,
   its time over theirs recorded; elsewhere those at the default span) and, same
   run, the span the old rule gave (the split count from the maximum context and the batch);
   at batch 1 also at target_ctx(1), in a table that holds it.
2. the span swept (64/128/256/512/1024) at batch 1/8/32/64, ctx 1024 and 8192 (batch 1: and
   target_ctx(1)).
3. the empty blocks' cost: batch 64 at ctx 1024 in an 8192-token table against a 1024-token one.
4. with `--cuda-core`: the lane-group split block (GP_FD_MMA=0, the library's before the
   tensor-core block) at the default span, same rows as [1]; its time over the library's is
   recorded. `--build NAME=MACRO:V,...` times other builds the same way and at spans 64-512 at
   batch 1 and 8, printed only: GP_FD_* macros build the split kernel
   (paged_attention.decode_split_build); a build naming a GP_FDC_* macro (decode_cluster_build,
   e.g. GP_FDC_WARPS:8 or GP_FDC_CTAS:16; GP_FDC_PARTS:1, the decode in one cluster a row and
   head block) runs as the graph runs it, its cluster kernel where cluster_decode holds. Every build's output must
   agree with the library's within the kernels' tolerance, or the run stops.
5. with `--carveout PCT[:split|combine]` (repeatable): the library build with the split's, the
   combine's or both kernels' preferred shared-memory carveout at PCT % (Device.set_shared_carveout;
   the default is no preference), same rows as [1]; its time over the library's is recorded.

6. the copy limit at each row's bytes (bench/limits.same_bytes): a copy moving the KV bytes one
   decode reads, launches back to back in a CUDA graph rotating out of L2 (and a plain read and
   torch.sum of them, information), and the library's decode as a fraction of the copy and of
   the plain read (a read-only launch reads faster than a copy moves the same bytes: 1.07x at
   67 MB on the H100).
7. at batch 1, a read of the same bytes in the decode's order (bench/limits.head_order_read):
   rows of 8 KV heads' 256-byte pieces, CTA (r, h) reading head h's pieces of the r-th row range,
   at the cluster decode's 64 CTAs and at 2 CTAs of 1,024 threads an SM; recorded figures
   without a target, beside the decode's fraction of each: whether the pool's layout, not the
   kernel, holds the batch-1 decode below the contiguous read.
8. at batch 1's target row, `--placement-check` fresh pools (4), each pool's graph timed three
   times in a row: the slowest over the fastest within a pool (time alone) and across the pools'
   first figures (placement too), both recorded: which one moves the row between runs.

Target (bench/targets.py, DECODE_ATTENTION_OF_COPY): at every batch the library's decode reads a
KV larger than the L2 at >= 0.8 of a copy of the same bytes, at `target_ctx(batch)`: ctx 8192,
or at batch 1 (33.5 MB at 8192 keys, under the L2) the smallest power of two above it whose KV
is larger (16384: 67 MB); that row is added to [1] and [2]. The divisor is the copy of the same
bytes, not the 1 GiB copy, because a decode is one launch and a short launch pays its ramp and
tail (on the H100 a copy moving 67 MB runs at 0.90 of the 1 GiB copy's rate); the fraction of the 1 GiB copy stays a recorded figure on every row. Without torch the target falls back to the
1 GiB copy (printed as such). A miss prints MISSED and the process exits 1. Every other row,
batch 1 at 8192 keys among them, is a recorded figure without a target.

    python3 bench/decode_attention_bench.py [--reps 20 --trials 7] [--cuda-core] [--no-sweep]
        [--build NAME=GP_FD_X:1 ...] [--carveout PCT[:split|combine]] [--json OUT.json] [--record [DIR]]

`--profile CTX[,CTX]` times nothing: it launches the library's batch-1 decode eagerly, 8 times
at each context (no graph, no limits), a target for Nsight Compute:

    ncu -k regex:gp_flash_decode_paged_cluster --launch-skip 2 --launch-count 6 --set full \
        --clock-control none python3 bench/decode_attention_bench.py --profile 1024,16384
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._kernel_bench import device_clock, kernel_bench_parser, median_replay, open_bench_device
from bench.limits import L2_BYTES, SameBytes, head_order_read, same_bytes
from bench.limits import measure as measure_limits
from bench.record import add_record_flag
from bench.targets import DECODE_ATTENTION_CTX, DECODE_ATTENTION_OF_COPY, Targets
from gpu_worker.kernels.common import sm_count
from gpu_worker.kernels.paged_attention import (
    CLUSTER_DECODE_CTAS,
    CLUSTER_DECODE_PARTS,
    CLUSTER_DECODE_RING,
    CLUSTER_DECODE_THREADS,
    CLUSTER_DECODE_TMA,
    FLASH_COMBINE_PAGED,
    MAX_DECODE_SPLITS,
    cluster_decode,
    cluster_decode_ring_bytes,
    cluster_decode_shape,
    cluster_decode_workspace_bytes,
    decode_cluster_build,
    decode_split_build,
    launch_flash_decode_paged,
    paged_decode_span,
    paged_decode_splits,
    paged_decode_workspace_bytes,
)
from gpu_worker.kernels.selfcheck import KernelHarness
from gpu_worker.kernels.selfcheck.flash import ATOL, RTOL

HEADS, KVH, HD, BT, TABLE = 32, 8, 128, 16, 8192
GiB = 1 << 30
WORKING_SET = 256 << 20


def kv_bytes(batch: int, ctx: int) -> int:
    """The K and V bytes one decode reads: every row's `ctx` keys, fp16."""
    return batch * ctx * KVH * HD * 2 * 2


def target_ctx(batch: int) -> int:
    """The context the target is checked at: DECODE_ATTENTION_CTX, doubled until the KV a decode
    reads is larger than the L2 (the issue's "over KV larger than L2"; a smaller read is bound by
    the two kernels' launch and tail latency, a few microseconds of HBM time)."""
    ctx = DECODE_ATTENTION_CTX
    while kv_bytes(batch, ctx) <= L2_BYTES:
        ctx *= 2
    return ctx


def contexts(batch: int) -> tuple[int, ...]:
    """The contexts [1] and [2] time at `batch`: 1024, 8192 and the target's."""
    return tuple(sorted({1024, DECODE_ATTENTION_CTX, target_ctx(batch)}))


def old_span(batch: int, max_len: int = TABLE) -> int:
    """The span the old rule gave (before the split by length): splits for ~4 blocks per SM (132) from max_len."""
    blocks = batch * KVH
    splits = max(1, min(64, -(-4 * 132 // blocks), max_len // 128))
    span = -(-max_len // splits)
    return -(-span // 16) * 16


class Bench:
    def __init__(self, h: KernelHarness, reps: int, trials: int) -> None:
        self.h, self.dev, self.reps, self.trials = h, h.device, reps, trials
        self.noise = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32).astype(np.float16)

    def _time(self, launches, again: int = 0) -> list[float]:
        """Seconds a launch: `reps` launches cycling over `launches` in one graph, timed by events
        around each replay (bench/_kernel_bench.median_replay); then `again` more figures of the
        same graph, one after another."""
        dev = self.dev
        launches[0](dev.stream)
        dev.synchronize()
        with dev.capture() as cap:
            for i in range(self.reps):
                launches[i % len(launches)](cap.stream)
        try:
            return [median_replay(lambda: dev.replay(cap.graph_exec), device_clock(dev),
                                  self.trials, self.reps) for _ in range(1 + again)]
        finally:
            dev.destroy_graph_exec(cap.graph_exec)

    def copy_bandwidth(self, nbytes: int) -> float:
        h = self.h
        src, dst = h.put(np.zeros(nbytes, np.uint8)), h.put(np.zeros(nbytes, np.uint8))
        be = self.dev.backend
        t = self._time([lambda s: be.copy_d2d_async(dst, src, nbytes, s)])[0]
        h.close()
        return 2 * nbytes / t

    def decode(self, batch: int, ctx: int, span: int, table_tokens: int = TABLE,
               build: dict[str, int] | None = None,
               carveout: tuple[int, str] | None = None,
               library: bool = False, again: int = 0) -> tuple[float, int, np.ndarray, list[float]]:
        """(seconds per decode, KV bytes read per decode, the last decode's output, `again` more
        figures of the same pool's graph timed after the first); `library`:
        the decode as the graph runs it (the one-kernel cluster decode where cluster_decode
        holds), else the split and combine kernels at `span`; `build`: GP_FD_* macros for the
        split kernel, GP_FDC_* (and GP_FD_*) for the cluster kernel; `carveout`:
        (percent, "split" / "combine" / "both"), those kernels' preferred shared-memory carveout
        while timed (Device.set_shared_carveout), back to no preference after."""
        h, dev = self.h, self.dev
        max_blocks = table_tokens // BT
        used = -(-ctx // BT)
        nbytes = kv_bytes(batch, ctx)
        layers = max(1, min(64, -(-WORKING_SET // nbytes)))
        capacity = batch * used
        plane = BT * KVH * HD
        pool = h.put(np.resize(self.noise, capacity * layers * 2 * plane))
        rng = np.random.default_rng(1)
        table = np.zeros((batch, max_blocks), np.int32)
        table[:, :used] = rng.permutation(capacity).astype(np.int32).reshape(batch, used)
        tp = h.put(table)
        pos = h.put(np.full(batch, ctx - 1, np.int32))
        q = h.put(np.resize(self.noise, batch * HEADS * HD))
        out = h.put(np.zeros(batch * HEADS * HD, np.float16))
        splits = paged_decode_splits(max_blocks, BT, span)
        ws = h.put(np.zeros(paged_decode_workspace_bytes(batch=batch, heads=HEADS, head_dim=HD,
                                                         splits=splits) // 4, np.float32))
        # the cluster decode's counters start at zero, as the kernel cache's workspaces do
        cws = h.put(np.zeros(cluster_decode_workspace_bytes(batch=batch, heads=HEADS,
                                                            kv_heads=KVH) // 4, np.uint32))
        split_defines = {k: v for k, v in (build or {}).items() if not k.startswith("GP_FDC_")}
        fs, fc = h.function(decode_split_build(**split_defines)), h.function(FLASH_COMBINE_PAGED)
        cluster = decode_cluster_build(**(build or {}))
        fcl = h.function(cluster.kernel) if library else None

        def one(layer):
            return lambda s: launch_flash_decode_paged(
                dev, fs, fc, out, ws, q, pool, pos, tp, batch, HEADS, KVH, HD, layer, layers, BT,
                max_blocks, span=span, stream=s, cluster_function=fcl, cluster_launch=cluster,
                cluster_workspace=cws, pool_blocks=capacity)

        percent, which = carveout or (-1, "")
        carved = [f for f, name in ((fs, "split"), (fc, "combine")) if which in (name, "both")]
        for f in carved:
            dev.set_shared_carveout(f, percent)
        try:
            t, *retimed = self._time([one(i) for i in range(layers)], again)
        finally:
            for f in carved:
                dev.set_shared_carveout(f, -1)
        got = h.get(out, (batch * HEADS * HD,), np.float16)
        h.close()
        return t, nbytes, got, retimed


def parse_args(argv: list[str] | None = None):
    ap = kernel_bench_parser(__doc__)
    ap.add_argument("--json", default="")
    ap.add_argument("--cuda-core", action="store_true",
                    help="also time the lane-group split block (section [4])")
    ap.add_argument("--no-sweep", action="store_true", help="skip the span sweep (section [2])")
    ap.add_argument("--carveout", action="append", default=[], type=parse_carveout,
                    metavar="PCT[:split|combine]", help="also time the library build with the "
                    "split's, the combine's or both kernels' (the default) preferred "
                    "shared-memory carveout at PCT percent ([5]; repeatable)")
    ap.add_argument("--build", action="append", default=[], type=parse_build,
                    metavar="NAME=MACRO:V[,MACRO:V]", help="also time this split build ([4])")
    ap.add_argument("--placements", type=int, default=3, metavar="N",
                    help="batch 1's rows: the median over N pools, each allocated and timed "
                    "afresh (a short launch's time moves between pools and over time; default 3)")
    ap.add_argument("--placement-check", type=int, default=4, metavar="POOLS",
                    help="[8]: batch 1 at its target row on POOLS fresh pools, each pool's graph "
                    "timed 3 times in a row: time's spread against placement's (0: skip)")
    ap.add_argument("--profile", default="", metavar="CTX[,CTX]",
                    help="only launch the library's batch-1 decode eagerly at these contexts, 8 "
                    "times each, for ncu (no timing, no limits)")
    add_record_flag(ap)
    return ap.parse_args(argv)


def parse_build(text: str) -> tuple[str, dict[str, int]]:
    """`lanes=GP_FD_MMA:0` -> ("lanes", {"GP_FD_MMA": 0})."""
    name, _, macros = text.partition("=")
    try:
        return name, {m: int(v) for m, v in (item.split(":") for item in macros.split(","))}
    except ValueError:
        raise SystemExit(f"--build {text!r}: want NAME=MACRO:INT[,MACRO:INT]") from None


def parse_carveout(text: str) -> tuple[int, str]:
    """`100` -> (100, "both"), `100:split` -> (100, "split")."""
    pct, _, which = text.partition(":")
    which = which or "both"
    try:
        percent = int(pct)
    except ValueError:
        percent = -2
    if not 0 <= percent <= 100 or which not in ("both", "split", "combine"):
        raise SystemExit(f"--carveout {text!r}: want PCT[:split|combine], PCT 0..100")
    return percent, which


def carveout_label(carveout: tuple[int, str]) -> str:
    percent, which = carveout
    return f"carveout {percent} %" + ("" if which == "both" else f" on the {which}")


def decode_name(batch: int, ctx: int) -> str:
    return f"paged decode batch {batch}, {ctx} keys"


def record_rows(targets: Targets, rows: list[dict], copy_gbs: float,
                same: dict[int, SameBytes] | None = None) -> None:
    """The record's figures from the printed rows: per library row its time, its fraction of the
    1 GiB copy and, where `same` (bench/limits.same_bytes, by KV bytes) has its bytes, its
    fraction of a copy of the same bytes with that copy's and torch.sum's rates; the target at
    target_ctx(batch) is on the copy of the same bytes, or on the 1 GiB copy without it. Also its
    time over the old rule's where both ran, and the empty blocks' cost; the span sweep stays
    printed only (a shape study, not a figure). A row timed over several placements (batch 1,
    `--placements`) is their median, and the slowest over the fastest is a figure too."""
    new = {(r["batch"], r["ctx"]): r for r in rows if r["section"] == "new"}
    old = {(r["batch"], r["ctx"]): r for r in rows if r["section"] == "old"}
    lanes = {(r["batch"], r["ctx"]): r for r in rows if r["section"] == "lanes"}
    two = {(r["batch"], r["ctx"]): r for r in rows if r["section"] == "two"}
    carve = [r for r in rows if r["section"] == "carveout"]
    for (batch, ctx), r in sorted(new.items()):
        name = decode_name(batch, ctx)
        targets.figure(f"{name}: time", r["us"], "us")
        placed = r.get("placements_us", [])
        if len(placed) > 1:
            targets.figure(f"{name}: slowest / fastest of {len(placed)} placements",
                           max(placed) / min(placed), "ratio")
        limit = (same or {}).get(kv_bytes(batch, ctx))
        target = ctx == target_ctx(batch)
        if target and limit is None:
            targets.check(f"{name}: fraction of copy", r["of_copy"], ">=",
                          DECODE_ATTENTION_OF_COPY, unit="fraction", limit=copy_gbs)
        else:
            targets.figure(f"{name}: fraction of copy", r["of_copy"], "fraction", limit=copy_gbs)
        if limit is not None:
            of_same = r["GBps"] / limit.copy_gbs
            if target:
                targets.check(f"{name}: fraction of a copy of the same bytes", of_same, ">=",
                              DECODE_ATTENTION_OF_COPY, unit="fraction", limit=limit.copy_gbs)
            else:
                targets.figure(f"{name}: fraction of a copy of the same bytes", of_same,
                               "fraction", limit=limit.copy_gbs)
            targets.figure(f"{name}: copy of the same bytes", limit.copy_gbs, "GB/s")
            targets.figure(f"{name}: torch.sum of the same bytes", limit.sum_gbs, "GB/s")
            if limit.read_gbs is not None:
                targets.figure(f"{name}: a plain read of the same bytes", limit.read_gbs, "GB/s")
                targets.figure(f"{name}: fraction of a plain read of the same bytes",
                               r["GBps"] / limit.read_gbs, "fraction", limit=limit.read_gbs)
        if (batch, ctx) in old:
            targets.figure(f"{name}: span rule / old rule time", r["us"] / old[batch, ctx]["us"],
                           "ratio")
        if (batch, ctx) in two:
            targets.figure(f"{name}: one kernel / split + combine time",
                           r["us"] / two[batch, ctx]["us"], "ratio")
        if (batch, ctx) in lanes:
            targets.figure(f"{name}: lane-group block / tensor-core block time",
                           lanes[batch, ctx]["us"] / r["us"], "ratio")
        for c in carve:
            if (c["batch"], c["ctx"]) == (batch, ctx):
                targets.figure(f"{name}: {carveout_label(c['carveout'])} / no preference time",
                               c["us"] / r["us"], "ratio")
    empty = [r for r in rows if r["section"] == "empty"]
    if len(empty) == 2:
        full, tight = empty
        targets.figure(f"empty blocks: batch {full['batch']}, {full['ctx']} keys, table "
                       f"{full['table']} - table {tight['table']}", full["us"] - tight["us"], "us")


def same_bytes_limits(rows: list[dict], trials: int, copy_gbs: float) -> dict[int, SameBytes]:
    """[6]: bench/limits.same_bytes at every library row's KV bytes, printed with the row's
    fraction of it."""
    print("\n[6] the copy limit at each decode's bytes (bench/limits.same_bytes)")
    same: dict[int, SameBytes] = {}
    for r in rows:
        if r["section"] != "new":
            continue
        nbytes = kv_bytes(r["batch"], r["ctx"])
        if nbytes not in same:
            same[nbytes] = same_bytes(nbytes, trials)
        limit = same[nbytes]
        read = "" if limit.read_gbs is None else f", {r['GBps'] / limit.read_gbs:.2f} of the read"
        print(f"   batch {r['batch']:>2} ctx {r['ctx']:>5}: {limit.line(copy_gbs)}; the decode "
              f"{r['GBps'] / limit.copy_gbs:.2f} of that copy{read}", flush=True)
    return same


def head_order_limits(rows: list[dict], trials: int, sms: int, targets: Targets) -> None:
    """[7]: bench/limits.head_order_read at each batch-1 library row's KV bytes (one layer's K
    and V: 2 x ctx rows of KVH pieces), printed and recorded with the row's fraction of it."""
    grids = (CLUSTER_DECODE_CTAS, max(CLUSTER_DECODE_CTAS, 2 * sms // KVH))
    printed = False
    for r in rows:
        if r["section"] != "new" or r["batch"] != 1:
            continue
        found = head_order_read(kv_bytes(1, r["ctx"]), grids, KVH, trials)
        if found is None:
            return
        if not printed:
            print(f"\n[7] batch 1: a read of the same bytes in the decode's order ({KVH} heads' "
                  f"256-byte pieces a row; CTAs a head: {' / '.join(map(str, grids))})")
            printed = True
        print(f"   ctx {r['ctx']:>5}: " + ", ".join(
            f"{ranks * KVH} CTAs {gbs:,.0f} GB/s (the decode {r['GBps'] / gbs:.2f} of it)"
            for ranks, gbs in found.items()), flush=True)
        for ranks, gbs in found.items():
            name = f"paged decode batch 1, {r['ctx']} keys: a read in the decode's order, {ranks * KVH} CTAs"
            targets.figure(name, gbs, "GB/s")
            targets.figure(f"{name}, the decode's fraction", r["GBps"] / gbs, "fraction")


def placement_check(b: Bench, targets: Targets, pools: int, again: int = 2) -> None:
    """[8] where batch 1's spread comes from, at target_ctx(1): `pools` fresh pools one after
    another, each pool's graph timed 1 + `again` times in a row. The slowest over the fastest
    within a pool (the widest of the pools) is what time alone moves; across the pools' first
    figures, what a placement adds. Both recorded."""
    ctx = target_ctx(1)
    table = max(TABLE, ctx)
    span = paged_decode_span(table // BT, BT, 1, HEADS, KVH)
    print(f"\n[8] batch 1, ctx {ctx}: {pools} fresh pools, each pool's graph timed {1 + again} "
          f"times in a row")
    runs = []
    for p in range(pools):
        t, _, _, retimed = b.decode(1, ctx, span, table, library=True, again=again)
        runs.append([t, *retimed])
        print(f"   pool {p}: " + " ".join(f"{x * 1e6:6.1f}" for x in runs[-1]) + " us", flush=True)
    within = max(max(r) / min(r) for r in runs)
    across = max(r[0] for r in runs) / min(r[0] for r in runs)
    print(f"   slowest / fastest: within a pool up to {within:.3f}, across the pools {across:.3f}")
    name = decode_name(1, ctx)
    targets.figure(f"{name}: slowest / fastest of one pool's graph timed {1 + again} times "
                   f"(the widest of {pools} pools)", within, "ratio")
    targets.figure(f"{name}: slowest / fastest of {pools} pools' first figures", across, "ratio")


def profile(b: Bench, contexts: list[int]) -> None:
    """Eager launches of the library's batch-1 decode (ncu's target): Bench.decode with each
    recorded launch run 8 times on the device's stream instead of captured and timed."""
    def eager(launches, again: int = 0) -> list[float]:
        for i in range(8):
            launches[i % len(launches)](b.dev.stream)
        b.dev.synchronize()
        return [float("nan")] * (1 + again)

    b._time = eager
    for ctx in contexts:
        table = max(TABLE, ctx)      # a table that holds the row, as the timed rows use
        b.decode(1, ctx, paged_decode_span(table // BT, BT, 1), table, library=True)
        print(f"launched the library's decode at batch 1, ctx {ctx}, 8 times", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.placements < 1:
        raise SystemExit(f"--placements {args.placements}: want 1 or more")
    if args.placement_check < 0:
        raise SystemExit(f"--placement-check {args.placement_check}: want 0 (skip) or more pools")
    dev, compiler = open_bench_device(args)
    if args.profile:
        profile(Bench(KernelHarness(dev, compiler), 1, 1),
                [int(c) for c in args.profile.split(",")])
        return 0
    targets = Targets("decode_attention_bench", args=args)
    limits = measure_limits() if args.backend == "cuda" else None
    h = KernelHarness(dev, compiler)
    b = Bench(h, args.reps, args.trials)
    rows: list[dict] = []
    memcpy = b.copy_bandwidth(GiB)
    if limits:
        limits.record(targets)
        copy = limits.copy_gbs * 1e9
        print(f"d2d copy 1 GiB (read + write): limit {copy / 1e9:.0f} GB/s (bench/limits.py); "
              f"graph of cuMemcpyAsync {memcpy / 1e9:.0f} GB/s (information)")
    else:
        copy = memcpy
        print(f"d2d copy 1 GiB (read + write): graph of cuMemcpyAsync {memcpy / 1e9:.0f} GB/s "
              f"(no torch limits: this is the limit)")

    outputs: dict[tuple[int, int], np.ndarray] = {}

    def row(section, batch, ctx, sp, table=TABLE, build=None, carveout=None) -> dict:
        # a build of the cluster kernel runs as the graph would run it; others, the split kernel
        library = section == "new" or any(k.startswith("GP_FDC_") for k in build or {})
        times = []
        for _ in range(args.placements if batch == 1 else 1):   # each a fresh pool
            t, nbytes, got, _ = b.decode(batch, ctx, sp, table, build, carveout, library=library)
            times.append(t)
        t = statistics.median(times)
        if section == "new":
            outputs[batch, ctx] = got.astype(np.float32)
        elif (build is not None or section == "two") and (batch, ctx) in outputs:
            want = outputs[batch, ctx]
            err = np.abs(got.astype(np.float32) - want)
            if not np.all(err <= ATOL + RTOL * np.abs(want)):
                raise SystemExit(f"build {section} at batch {batch}, ctx {ctx}: output differs "
                                 f"from the library build's by up to {err.max():.3g}")
        r = {"section": section, "batch": batch, "ctx": ctx, "span": sp, "table": table,
             "carveout": carveout, "us": t * 1e6, "GBps": nbytes / t / 1e9, "of_copy": nbytes / t / copy,
             "placements_us": [x * 1e6 for x in times]}
        rows.append(r)
        spread = (f" (median of {len(times)} placements, {min(times) * 1e6:.1f}-{max(times) * 1e6:.1f})"
                  if len(times) > 1 else "")
        print(f"{section:>8} batch {batch:>2} ctx {ctx:>5} span {sp:>5} table {table:>5}: "
              f"{r['us']:8.1f} us {r['GBps']:7.0f} GB/s {r['of_copy']:5.2f} of copy{spread}", flush=True)
        return r

    sms = sm_count(dev)
    fcl = h.function(decode_cluster_build().kernel)
    ring = cluster_decode_ring_bytes(CLUSTER_DECODE_THREADS // 32, CLUSTER_DECODE_RING, HD, CLUSTER_DECODE_TMA)
    fits = {s: dev.max_active_clusters(fcl, CLUSTER_DECODE_THREADS, s, ring) for s in range(1, 9)}
    units = KVH * -(-HEADS // KVH // 4)
    shapes = {p: cluster_decode_shape(units, lambda s: fits[s], parts=p) for p in (1, 2, 4)}
    print(f"clusters of s CTAs one wave holds (the cluster kernel, {CLUSTER_DECODE_THREADS} "
          f"threads): {fits}; batch 1 at up to 1 / 2 / 4 parts runs (CTAs a cluster, parts) "
          f"{shapes[1]} / {shapes[2]} / {shapes[4]} (the library: up to {CLUSTER_DECODE_PARTS})")
    print("\n[1] the library's decode (the one-kernel cluster decode where cluster_decode holds, "
          "then also the split and combine kernels) and the old rule's span")
    for batch in (1, 8, 32, 64):
        for ctx in contexts(batch):
            table = max(TABLE, ctx)   # a longer context: a table that holds it
            span = paged_decode_span(table // BT, BT, batch, HEADS, KVH)
            new = row("new", batch, ctx, span, table)
            if cluster_decode(batch, HEADS, KVH, HD, sms):   # the library ran one kernel
                two = row("two", batch, ctx, span, table)
                print(f"{'':>6} one kernel / split + combine time {new['us'] / two['us']:.2f}")
            if table == TABLE and old_span(batch) != span:
                old = row("old", batch, ctx, old_span(batch))
                print(f"{'':>6} new/old time {new['us'] / old['us']:.2f}")
    print("\n[2] span sweep")
    for batch in () if args.no_sweep else (1, 8, 32, 64):
        for ctx in contexts(batch):
            table = max(TABLE, ctx)
            span = paged_decode_span(table // BT, BT, batch, HEADS, KVH)
            for sp in (64, 128, 256, 512, 1024):
                if sp != span and paged_decode_splits(table // BT, BT, sp) <= MAX_DECODE_SPLITS:
                    row("span", batch, ctx, sp, table)
    print("\n[3] empty blocks: batch 64, ctx 1024, table 8192 vs 1024")
    span = paged_decode_span(TABLE // BT, BT, 64, HEADS, KVH)
    full = row("empty", 64, 1024, span, TABLE)
    tight = row("empty", 64, 1024, span, 1024)
    print(f"{'':>6} cost of the empty blocks: {full['us'] - tight['us']:.1f} us per decode")
    builds = ([("lanes", {"GP_FD_MMA": 0})] if args.cuda_core else []) + args.build
    for name, build in builds:
        print(f"\n[4] build {name} ({build}) at the default span; at batch 1 and 8 also other spans")
        cluster_only = all(k.startswith("GP_FDC_") for k in build)
        for batch in (1, 8, 32, 64):
            one_kernel = (any(k.startswith("GP_FDC_") for k in build)
                          and cluster_decode(batch, HEADS, KVH, HD, sms))   # no span
            if cluster_only and not one_kernel:
                continue   # the library's split kernel: nothing of the build runs
            for ctx in contexts(batch):
                table = max(TABLE, ctx)
                span = paged_decode_span(table // BT, BT, batch, HEADS, KVH)
                other = row(name, batch, ctx, span, table, build=build)
                new = next(r for r in rows if r["section"] == "new" and r["batch"] == batch
                           and r["ctx"] == ctx)
                print(f"{'':>8} {name} / library time {other['us'] / new['us']:.2f}")
                if name != "lanes" and batch <= 8 and not one_kernel:
                    for sp in (64, 128, 256, 512):
                        if sp != span and paged_decode_splits(table // BT, BT, sp) <= MAX_DECODE_SPLITS:
                            row(name + "-span", batch, ctx, sp, table, build=build)
    for carveout in args.carveout:
        print(f"\n[5] the library build, {carveout_label(carveout)}")
        for batch in (1, 8, 32, 64):
            for ctx in contexts(batch):
                table = max(TABLE, ctx)
                span = paged_decode_span(table // BT, BT, batch, HEADS, KVH)
                other = row("carveout", batch, ctx, span, table, carveout=carveout)
                new = next(r for r in rows if r["section"] == "new" and r["batch"] == batch
                           and r["ctx"] == ctx)
                print(f"{'':>8} carveout / library time {other['us'] / new['us']:.2f}")
    if args.placement_check:
        placement_check(b, targets, args.placement_check)
    same = same_bytes_limits(rows, args.trials, limits.copy_gbs) if limits else {}
    if not same:
        print("\n[6] no copy of the same bytes (no torch): the target is on the 1 GiB copy")
    record_rows(targets, rows, copy / 1e9, same)
    if limits:
        head_order_limits(rows, args.trials, sm_count(dev), targets)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"copy_GBps": copy / 1e9, "memcpy_graph_GBps": memcpy / 1e9, "rows": rows,
             "same_bytes": {str(k): vars(v) for k, v in same.items()}}, indent=1))
    dev.close()
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
