"""serving_bench's traffic replayed through the real Scheduler with no device, each step's device
time modeled from a step-trace fit: what a scheduling policy, or a cheaper prefill chunk, would do
to aggregate tok/s and TTFT, in seconds on a CPU. A model, not a measurement: it records nothing.

    python bench/serving_model.py [--concurrency 32,64,128] [--prefill-order shortest]
    python bench/serving_model.py --fit steps.jsonl      # costs fitted from a worker's --step-trace
    python bench/serving_model.py --chunk-scale 0.5      # what if a chunk's fixed cost halved
    python bench/serving_model.py --packed               # what if a step's chunks ran as one pass
    python bench/serving_model.py --fold                 # what if its decode rows rode that pass
    python bench/serving_model.py --decode-scale 0.8     # what if the decode pass were 20 % faster
    python bench/serving_model.py --ladder pow2          # prefill buckets of powers of two

Model: a step's device time is bench/step_trace_fit.py's terms,
    decode_pass * [decode rows > 0] + per_decode_row * decode rows
    + per_chunk * prefill chunks + per_prefill_row * prefill graph rows,
where a chunk's graph rows are its bucket on `--ladder` (the paged decoder's PREFILL_LADDER by
default: its linears compute every row of the bucket), with the coefficients of `--fit FILE`
or `H200_COSTS` (fitted on the H200 at 64 streams). The
device is taken as the bottleneck, as it was there (~100 % busy; the host 1.8 ms of a 12.4 ms
step), so a level's time is the sum of its steps. The Scheduler is the worker's, on a sim
device's arena with a host-only runner (bench/scheduler_host_bench.HostOnlyRunner), the 8b-int4
block geometry and the worker's defaults unless a flag says otherwise.

Traffic, as serving_bench sends it (its `trace` and `arrival_trace`, the same seeds):
- burst levels: N streams, each its requests back to back; a stream's next request is submitted
  at the first step after its previous one finished (the client's round trip is not modeled);
- the open loop (`--arrival-rate R` > 0): Poisson arrivals on the modeled clock; an idle engine
  jumps to the next arrival.
TTFT is modeled from a request's submission to the end of the step its first token came from.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import step_trace_fit
from bench.scheduler_host_bench import HostOnlyRunner
from bench.serving_bench import arrival_trace, trace
from gpu_worker.config import (
    DEFAULT_MIN_PREFILL_SHARE,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PREFILL_ORDER,
)
from gpu_worker.device import Device
from gpu_worker.device.sim_backend import SimBackend
from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.runner import HostStepRunner
from gpu_worker.engines.scheduler.scheduler import PREFILL_ORDERS, Scheduler
from gpu_worker.execution.plans import SEQ_LADDER, seq_bucket
from gpu_worker.models.configs import get_config
from gpu_worker.models.paged import PREFILL_LADDER, decode_bucket

MODEL = "8b-int4"


@dataclass(frozen=True)
class StepCosts:
    """Seconds per term of a step (bench/step_trace_fit.TERMS), and the measured decode pass
    per decode graph rung where there is one (`rungs`: rung -> seconds): a pass costs its rung,
    not its rows (the int4 linears compute 64 rows of x from 33 rows up, for one)."""
    decode_pass: float
    per_decode_row: float
    per_chunk: float
    per_prefill_row: float
    rungs: tuple[tuple[int, float], ...] = ()
    linears: tuple[tuple[int, float], ...] = ()   # the decode pass's int4 linears by rung

    def fold_saving(self, record: dict) -> float:
        """What riding a prefill pass saves a step's decode rows (`--fold`): their rung's
        linears, less the prefill pass's cost of as many more rows (attention, norms and
        sampling stay). Zero for a step without both, or without `linears`."""
        rows = record["decode_rows"]
        if not rows or not record["chunks"] or not self.linears:
            return 0.0
        rung = decode_bucket(record.get("decode_graph_rows", rows))
        return max(0.0, dict(self.linears)[rung] - self.per_prefill_row * rows)

    def decode_s(self, record: dict) -> float:
        rows = record["decode_rows"]
        if not rows:
            return 0.0
        rung = decode_bucket(record.get("decode_graph_rows", rows))
        return dict(self.rungs).get(rung, self.decode_pass + self.per_decode_row * rows)

    def step_s(self, record: dict, packed: bool = False, fold: bool = False) -> float:
        """One traced step's modeled device seconds; `packed`: its chunks as one pass; `fold`:
        its decode rows in a prefill pass (fold_saving)."""
        chunks = record["chunks"]
        n = min(1, len(chunks)) if packed else len(chunks)
        return (self.decode_s(record) + self.per_chunk * n
                + self.per_prefill_row * step_trace_fit.prefill_rows(record)
                - (self.fold_saving(record) if fold else 0.0))

    def scaled(self, chunk: float = 1.0, decode: float = 1.0) -> StepCosts:
        """A what-if: each chunk's fixed cost times `chunk`, the decode pass times `decode`."""
        return replace(self, per_chunk=self.per_chunk * chunk,
                       decode_pass=self.decode_pass * decode,
                       per_decode_row=self.per_decode_row * decode,
                       rungs=tuple((r, t * decode) for r, t in self.rungs),
                       linears=tuple((r, t * decode) for r, t in self.linears))

    @classmethod
    def fitted(cls, path: pathlib.Path, skip: int = 50) -> StepCosts:
        """The fit of a worker's --step-trace file, with the median decode-only step per rung."""
        records = step_trace_fit.load(path, skip)
        coef, _ = step_trace_fit.fit(records)
        by_rung: dict[int, list[float]] = {}
        for r in records:
            if r["decode_rows"] and not r["chunks"]:
                rung = decode_bucket(r.get("decode_graph_rows", r["decode_rows"]))
                by_rung.setdefault(rung, []).append(r["device_us"] / 1e6)
        return cls(*(float(c) / 1e6 for c in coef),
                   rungs=tuple((k, statistics.median(v)) for k, v in sorted(by_rung.items())),
                   linears=DECODE_LINEARS)   # a trace times steps, not their linears


# The decode step's int4 linears by rung, ms (int4_batched_bench, H200, 2026-12-04: 1 / 2 / 8 / 16
# / 32 / 64 rows recorded; 4 and 24 between their neighbours; 40 and 48 the 48-row figure of
# `0c64bc6`, when they ran the 4-x-tile build; 56 the 64-row one).
DECODE_LINEARS = tuple((r, ms / 1e3) for r, ms in (
    (1, 1.93), (2, 2.00), (4, 2.15), (8, 2.44), (16, 3.60), (24, 3.55), (32, 3.50), (40, 5.10),
    (48, 5.10), (56, 5.06), (64, 5.06)))

# The fit of the step trace of serving_bench at 64 streams, H200, commit 7144f3b, 2026-12-04
# (docs/scheduler.md, "Mixed traffic"). That trace had chunk tokens, not graph rows: its 28.5 us
# a prefill token is taken as 21.0 us a graph row, the same total over that level's chunks on
# the buckets of then (powers of two: 188,192 rows for 138,961 tokens in this model's replay).
# The modeled 64-stream level of the scheduler of then (`--ladder pow2`, prompts split to fill
# a step) gives 2,820 tok/s against the 2,842 serving_bench measured.
# Its decode-only steps by rung (median ms, contexts of ~1,300 tokens) are `rungs`: with them
# the model is 3 % low at 32 streams (2,434 against 2,513.5) and 0.4 % at 64.
H200_COSTS = StepCosts(decode_pass=3.1e-3, per_decode_row=0.11e-3, per_chunk=9.2e-3,
                       per_prefill_row=28.5e-6 * 138_961 / 188_192,
                       rungs=tuple((r, ms / 1e3) for r, ms in (
                           (1, 2.52), (2, 2.64), (4, 2.90), (8, 3.58), (16, 4.93), (24, 5.07),
                           (32, 5.97), (40, 7.70), (48, 8.06), (56, 8.89), (64, 9.40))),
                       linears=DECODE_LINEARS)
LADDERS = {"worker": PREFILL_LADDER, "pow2": SEQ_LADDER}


class BucketedRunner(HostStepRunner):
    """The host-only runner with the paged decoder's answer to `prefill`: the chunk's graph
    rows, its bucket on `ladder` (PagedDecoderModel._prefill_rows)."""

    def __init__(self, inner, slots: int, ladder: tuple[int, ...], chunk: int) -> None:
        super().__init__(inner, slots)
        self.ladder, self.chunk = ladder, chunk

    def prefill(self, slot, tokens, start, table, sampling, sample) -> int:
        super().prefill(slot, tokens, start, table, sampling, sample)
        return min(seq_bucket(len(tokens), self.ladder), max(self.chunk, len(tokens)))


@dataclass
class Level:
    """One replay's outcome: modeled seconds and what the steps carried."""
    name: str
    seconds: float = 0.0
    steps: int = 0
    prefill_steps: int = 0
    chunks: int = 0
    prompts: int = 0
    requested: int = 0        # new tokens the trace asked for
    tokens: int = 0           # new tokens the scheduler generated (== requested: none lost)
    ttft: list[float] | None = None
    tpot: list[float] | None = None

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def line(self) -> str:
        return (f"  {self.name:>10s}: {self.rate:8,.0f} tok/s modeled ({self.seconds:6.2f} s), "
                f"{self.steps:5d} steps, {self.prefill_steps:4d} with prefill, {self.chunks:4d} "
                f"chunks for {self.prompts:4d} prompts; TTFT p50 {pct(self.ttft, 50):6.3f} s, "
                f"p99 {pct(self.ttft, 99):6.3f} s; TPOT p99 {pct(self.tpot, 99) * 1e3:5.1f} ms")


def pct(values: list[float] | None, q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; NaN when there are none."""
    v = sorted(values or [])
    return v[min(len(v) - 1, int(q / 100 * len(v)))] if v else float("nan")


class Replay:
    """A Scheduler over a host-only runner whose steps advance a modeled clock."""

    def __init__(self, args: argparse.Namespace, costs: StepCosts, pool_prompts: int) -> None:
        cfg = get_config(MODEL, "decoder")
        self.geo = KVGeometry(layers=1, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                              block_tokens=16, max_context=cfg.max_context)
        self.dev = Device(SimBackend(granule_bytes=2 << 20))
        need = self.geo.blocks_for(args.prompt_range[1] + args.new_range[1] + 1)
        self.pool = KVBlockPool(self.dev.arena, self.geo, pool_prompts * need)
        self.costs, self.packed, self.fold, self.clock = costs, args.packed, args.fold, 0.0
        self.records: list[dict] = []
        runner = BucketedRunner(HostOnlyRunner(self.geo, args.prefill_chunk), args.max_batch_size,
                                LADDERS[args.ladder], args.prefill_chunk)
        self.sched = Scheduler(runner, self.pool,
                               thread=False, max_batch_size=args.max_batch_size,
                               max_step_tokens=args.max_step_tokens,
                               min_prefill_share=args.min_prefill_share,
                               prefill_order=args.prefill_order, step_trace=self._traced)
        self.first: dict[int, float] = {}      # id(sequence) -> modeled time of its first token
        self.last: dict[int, float] = {}       # id(sequence) -> modeled time it finished
        self.live: dict[int, tuple[object, float]] = {}   # id -> (sequence, submitted at)

    def _traced(self, record: dict) -> None:
        self.records.append(record)
        self.clock += self.costs.step_s(record, self.packed, self.fold)

    def submit(self, n: int, new: int, rng: random.Random) -> object:
        seq = self.sched.submit([rng.randrange(1000) for _ in range(n)], new)
        self.live[id(seq)] = (seq, self.clock)
        return seq

    def step(self) -> None:
        self.sched.step()
        for key, (seq, _) in self.live.items():
            if key not in self.first and seq.generated:
                self.first[key] = self.clock
            if key not in self.last and seq.state == "finished":
                self.last[key] = self.clock

    def close(self, level: Level) -> Level:
        for _ in range(3):      # the last read-back
            self.sched.step()
        self.sched.close()
        self.dev.close()
        level.seconds = self.clock
        level.steps = len(self.records)
        level.prefill_steps = sum(1 for r in self.records if r["chunks"])
        level.chunks = sum(len(r["chunks"]) for r in self.records)
        level.tokens = sum(len(seq.generated) for seq, _ in self.live.values())
        level.ttft = [self.first[k] - at for k, (_, at) in self.live.items() if k in self.first]
        level.tpot = [(self.last[k] - self.first[k]) / (len(seq.generated) - 1)
                      for k, (seq, _) in self.live.items()
                      if k in self.last and k in self.first and len(seq.generated) > 1]
        return level


def burst(args: argparse.Namespace, costs: StepCosts, streams: int) -> Level:
    """serving_bench's burst level of `streams` clients, each its requests back to back."""
    jobs = trace(streams, args, args.seed)
    replay, rng = Replay(args, costs, streams), random.Random(0)
    level = Level(f"{streams} streams", prompts=sum(map(len, jobs)),
                  requested=sum(new for job in jobs for _, new in job))
    current = {s: replay.submit(*job[0], rng) for s, job in enumerate(jobs)}
    sent = dict.fromkeys(current, 1)
    while current:
        replay.step()
        for s, seq in list(current.items()):
            if seq.state == "finished":
                if sent[s] < len(jobs[s]):
                    current[s] = replay.submit(*jobs[s][sent[s]], rng)
                    sent[s] += 1
                else:
                    del current[s]
    return replay.close(level)


def open_loop(args: argparse.Namespace, costs: StepCosts) -> Level:
    """serving_bench's open loop: its Poisson arrivals on the modeled clock."""
    arrivals = arrival_trace(args.arrival_requests, args.arrival_rate, args, args.seed)
    replay, rng = Replay(args, costs, len(arrivals)), random.Random(0)
    level = Level(f"{args.arrival_rate:g} req/s", prompts=len(arrivals),
                  requested=sum(new for _, _, new in arrivals))
    pending, live = list(arrivals), []
    while pending or live:
        if not live and pending and pending[0][0] > replay.clock:
            replay.clock = pending[0][0]          # idle: the next arrival
        while pending and pending[0][0] <= replay.clock:
            _, n, new = pending.pop(0)
            live.append(replay.submit(n, new, rng))
        replay.step()
        live = [seq for seq in live if seq.state != "finished"]
    return replay.close(level)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="32,64,128")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream (serving_bench)")
    ap.add_argument("--prompt-range", type=lambda s: tuple(map(int, s.split(","))),
                    default=(128, 2048))
    ap.add_argument("--new-range", type=lambda s: tuple(map(int, s.split(","))),
                    default=(64, 512))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arrival-rate", type=float, default=2.0, help="0: no open loop")
    ap.add_argument("--arrival-requests", type=int, default=80)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-step-tokens", type=int, default=2048)
    ap.add_argument("--min-prefill-share", type=int, default=DEFAULT_MIN_PREFILL_SHARE)
    ap.add_argument("--prefill-order", default=DEFAULT_PREFILL_ORDER, choices=PREFILL_ORDERS)
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    ap.add_argument("--ladder", default="worker", choices=sorted(LADDERS),
                    help="prefill chunk buckets: the worker's PREFILL_LADDER, or powers of two")
    ap.add_argument("--fit", type=pathlib.Path, default=None, metavar="FILE",
                    help="fit the step costs on a worker's --step-trace file")
    ap.add_argument("--chunk-scale", type=float, default=1.0,
                    help="scale each chunk's fixed cost (what if the dequantization were faster)")
    ap.add_argument("--decode-scale", type=float, default=1.0,
                    help="scale the decode pass and per-row costs (what if the decode kernels "
                         "were faster)")
    ap.add_argument("--fold", action="store_true",
                    help="a step's decode rows ride its prefill pass: their linears cost prefill "
                         "rows, not the decode pass's (its attention, norms, sampling stay)")
    ap.add_argument("--packed", action="store_true",
                    help="one fixed chunk cost per step, however many chunks it carries")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Level]:
    args = parse_args(argv)
    costs = StepCosts.fitted(args.fit) if args.fit else H200_COSTS
    costs = costs.scaled(chunk=args.chunk_scale, decode=args.decode_scale)
    decode = (f"decode pass by rung {', '.join(f'{r}: {t * 1e3:.2f}' for r, t in costs.rungs)} "
              "ms, else " if costs.rungs else "")
    print(f"modeled step costs: {decode}decode pass {costs.decode_pass * 1e3:.2f} ms + "
          f"{costs.per_decode_row * 1e3:.3f} ms a decode row + {costs.per_chunk * 1e3:.2f} ms a "
          f"chunk{' (one a step: --packed)' if args.packed else ''} + "
          f"{'(decode rows in the prefill pass: --fold) ' if args.fold else ''}"
          f"{costs.per_prefill_row * 1e6:.1f} us a prefill row ({args.ladder} buckets); "
          f"--prefill-order "
          f"{args.prefill_order}, --max-step-tokens {args.max_step_tokens}, "
          f"--min-prefill-share {args.min_prefill_share}, chunk {args.prefill_chunk}", flush=True)
    levels = [burst(args, costs, int(c)) for c in args.concurrency.split(",") if c]
    if args.arrival_rate > 0:
        levels.append(open_loop(args, costs))
    for level in levels:
        print(level.line(), flush=True)
    return levels


if __name__ == "__main__":
    main()
