"""Prefix caching on the paged KV, end to end: `--streams` concurrent gRPC streams (default 32)
sharing a `--prefix`-token system prompt (default 2,000) with a `--suffix`-token suffix each
(default 64), greedy, `--new` tokens each. Two worker processes (bench/_served.py, `python -m
gpu_worker serve`), one after the other, clients in this process: the defaults (prefix cache on)
and `--no-prefix-cache` (every prompt prefilled whole).

Each side gets the same trace: one warm-up request with the shared prompt (its own suffix) so the
cache holds the prefix, `--warmup-rounds` unmeasured rounds of the pattern (the step plans of
its chunk shapes), then `--trials` measured rounds. Every suffix is unique per stream, per round
and per trial, so the shared prefix is the only thing a request can hit. Per round: TTFT of each
stream (from its send to its first token), and the deltas of GetStats' scheduler counters over
the round: `prefill_tokens` (prompt tokens computed), `prefix_cache_hit_tokens` and
`prefix_cache_queried_tokens`. Medians and spreads over the trials.

Targets (MISSED: exit status 1): TTFT p50 without caching >= 5x TTFT p50 with it (median over
the trials of each trial's p50); prefill tokens computed with caching <= 1/20 of without (summed
over the trials); every stream's tokens identical on both sides; zero lost streams (every stream
ends with `length` and all its tokens), each side; ledger within 1 % of the device after each
side's run.

    python bench/prefix_cache_bench.py                                 # H200: 8b-int4
    python bench/prefix_cache_bench.py --backend sim --config tiny --streams 8 --prefix 512 \\
        --suffix 16 --new 4 --trials 3                                     # smoke test
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench._served import ledger_error, served_worker
from bench.batching_bench import spread
from bench.record import add_record_flag
from bench.serving_bench import pct, unique_prompt
from bench.targets import Targets
from gpu_worker.edge.client import WorkerClient
from gpu_worker.models.configs import get_config

TTFT_RATIO = 5.0            # uncached TTFT p50 / cached TTFT p50, at least
PREFILL_SHARE = 1 / 20      # cached prefill tokens / uncached prefill tokens, at most
LEDGER_PCT = 1.0
COUNTERS = ("prefill_tokens", "prefix_cache_hit_tokens", "prefix_cache_queried_tokens")
UNCACHED = {"--no-prefix-cache": (None, "the other side: every prompt prefilled whole")}


def stream_tokens(client: WorkerClient, prompt: list[int], new: int) -> dict:
    """One Generate: its tokens, TTFT (send to first token, seconds) and finish reason."""
    t0 = time.perf_counter()
    first, tokens, reason = float("nan"), [], ""
    for message in client.generate_stream("m", prompt, new, timeout=900):
        if message.tokens and not tokens:
            first = time.perf_counter() - t0
        tokens.extend(int(t) for t in message.tokens)
        if message.done:
            reason = message.finish_reason
    return {"tokens": tokens, "ttft": first, "reason": reason, "want": new}


def run_streams(client: WorkerClient, prompts: list[list[int]], new: int) -> dict:
    """Every prompt on its own client thread at once; results in prompt order (None: raised)."""
    results: list[dict | None] = [None] * len(prompts)
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            results[i] = stream_tokens(client, prompts[i], new)
        except Exception as exc:  # noqa: BLE001 - a lost stream is a result here
            errors.append(repr(exc))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    tokens = sum(len(r["tokens"]) for r in done)
    lost = sum(1 for r in results
               if r is None or r["reason"] != "length" or len(r["tokens"]) != r["want"])
    return {"results": results, "wall": wall, "tokens": tokens, "rate": tokens / wall,
            "lost": lost, "errors": errors[:3], "ttft": [r["ttft"] for r in done]}


def counters(client: WorkerClient, names: tuple[str, ...]) -> dict[str, int]:
    s = client.stats().scheduler
    return {n: int(getattr(s, n)) for n in names}


def serve_side(args, name: str, changed: dict, warmup: list[list[int]],
               rounds: list[list[list[int]]], names: tuple[str, ...],
               reference: tuple[list[list[int]], int] | None = None) -> dict:
    """One worker process: the warm-up requests one by one, then each round's streams at once
    (the last `args.trials` rounds are the measured ones). Per round: run_streams' result and
    `delta`, the counters `names` over the round. `ledger`: ledger_error after the run;
    `block_tokens`: the worker's KV block size. With `reference` (prompts, wave): those prompts
    again after the rounds, `wave` streams at a time, as `reference`: each stream's tokens and
    the preemptions over the pass."""
    with served_worker(args.backend, changed) as (client, _):
        client.load_model("m", "decoder", args.config, 1)
        for prompt in warmup:
            stream_tokens(client, prompt, args.new)
        runs = []
        for k, prompts in enumerate(rounds):
            before = counters(client, names)
            r = run_streams(client, prompts, args.new)
            after = counters(client, names)
            r["delta"] = {n: after[n] - before[n] for n in names}
            trial = k - (len(rounds) - args.trials) + 1       # < 1: a warm-up round
            print(f"{name} {f'trial {trial}' if trial >= 1 else 'warm-up'}: "
                  f"{len(prompts)} streams, {r['rate']:.1f} tok/s, TTFT p50/p99 "
                  f"{pct(r['ttft'], .5) * 1e3:.1f}/{pct(r['ttft'], .99) * 1e3:.1f} ms, lost "
                  f"{r['lost']} {r['errors'] or ''}; "
                  + ", ".join(f"{n} {v}" for n, v in r["delta"].items()), flush=True)
            if trial >= 1:
                runs.append(r)
        ref = None
        if reference is not None:
            ref_prompts, wave = reference
            before = counters(client, ("preemptions",))["preemptions"]
            tokens = []
            for at in range(0, len(ref_prompts), wave):
                tokens += [x["tokens"] if x is not None else None for x in
                           run_streams(client, ref_prompts[at:at + wave], args.new)["results"]]
            ref = {"tokens": tokens, "preemptions":
                   counters(client, ("preemptions",))["preemptions"] - before}
            print(f"{name} reference: {len(ref_prompts)} streams {wave} at a time, "
                  f"{ref['preemptions']} preemptions", flush=True)
        time.sleep(1.0)          # completed releases settle before the ledger is compared
        return {"runs": runs, "ledger": ledger_error(client), "reference": ref,
                "block_tokens": client.stats().scheduler.kv_block_tokens}


def identical(a: dict, b: dict) -> tuple[bool, str]:
    """Whether every stream of every trial got the same tokens on both sides; the first that
    did not, named."""
    for t, (ra, rb) in enumerate(zip(a["runs"], b["runs"], strict=True)):
        for s, (x, y) in enumerate(zip(ra["results"], rb["results"], strict=True)):
            if x is None or y is None or x["tokens"] != y["tokens"]:
                return False, f"trial {t + 1} stream {s} differs"
    return True, "every stream, every trial"


def trial_p50(side: dict) -> list[float]:
    return [pct(r["ttft"], .5) for r in side["runs"]]


def total(side: dict, counter: str) -> int:
    return sum(r["delta"][counter] for r in side["runs"])


def prompts(args, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The trace both sides get: the warm-up request, then every round's prompts (the shared
    prefix + a suffix keyed by round and stream: none shares a block past the prefix)."""
    prefix = unique_prompt(args.prefix, vocab, "system")
    warmup = [prefix + unique_prompt(args.suffix, vocab, "warmup")]
    rounds = [[prefix + unique_prompt(args.suffix, vocab, f"suffix:{k}:{s}")
               for s in range(args.streams)] for k in range(args.warmup_rounds + args.trials)]
    return warmup, rounds


def report(args, targets: Targets, cached: dict, uncached: dict) -> None:
    for name, side in (("cached", cached), ("uncached", uncached)):
        ttft = [t for r in side["runs"] for t in r["ttft"]]
        print(f"{name}: TTFT p50 per trial (ms) {spread([x * 1e3 for x in trial_p50(side)])}; all "
              f"streams p50/p99 {pct(ttft, .5) * 1e3:.1f}/{pct(ttft, .99) * 1e3:.1f} ms; prefill "
              f"tokens {total(side, 'prefill_tokens')}, hit/queried "
              f"{total(side, 'prefix_cache_hit_tokens')}/"
              f"{total(side, 'prefix_cache_queried_tokens')}", flush=True)
        targets.figure(f"{name}: TTFT p50", statistics.median(trial_p50(side)), "s")
        targets.figure(f"{name}: TTFT p99", pct(ttft, .99), "s")
        targets.figure(f"{name}: prefill tokens computed", total(side, "prefill_tokens"), "tokens")
        targets.figure(f"{name}: prefix cache hit tokens", total(side, "prefix_cache_hit_tokens"),
                       "tokens")
    block_tokens = cached["block_tokens"]
    expect = args.trials * args.streams * (args.prefix // block_tokens) * block_tokens
    print(f"expected hit tokens with caching: {expect} (the prefix's full {block_tokens}-token "
          f"blocks, every stream of every trial)", flush=True)
    ratio = statistics.median(trial_p50(uncached)) / statistics.median(trial_p50(cached))
    targets.check(f"{args.streams} streams: TTFT p50 uncached / cached", ratio, ">=", TTFT_RATIO,
                  unit="ratio")
    share = total(cached, "prefill_tokens") / max(1, total(uncached, "prefill_tokens"))
    targets.check("prefill tokens computed: cached / uncached", share, "<=", PREFILL_SHARE, ".4f",
                  unit="ratio")
    same, detail = identical(cached, uncached)
    targets.require("tokens identical with caching on and off (greedy)", same, detail)
    for name, side in (("cached", cached), ("uncached", uncached)):
        side_targets(targets, name, side)


def side_targets(targets: Targets, name: str, side: dict) -> None:
    """Every side's own targets: zero lost streams, the ledger within LEDGER_PCT."""
    lost = sum(r["lost"] for r in side["runs"])
    targets.require(f"{name}: zero lost streams", lost == 0, f"{lost} lost")
    targets.check(f"{name}: ledger vs device after the run (%)", 100 * side["ledger"], "<=",
                  LEDGER_PCT, unit="%")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--config", default="8b-int4")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams per round")
    p.add_argument("--prefix", type=int, default=2000, help="tokens of the shared system prompt")
    p.add_argument("--suffix", type=int, default=64, help="tokens of each stream's own suffix")
    p.add_argument("--new", type=int, default=32, help="new tokens per stream (greedy)")
    p.add_argument("--trials", type=int, default=3, help="measured rounds per side (median)")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="unmeasured rounds of the pattern first (their own suffixes: the step "
                        "plans of its chunk shapes), each side")
    add_record_flag(p)
    return p


def main() -> int:
    args = parser().parse_args()
    if min(args.streams, args.prefix, args.suffix, args.new, args.trials) < 1:
        parser().error("--streams, --prefix, --suffix, --new and --trials must be >= 1")
    targets = Targets("prefix_cache_bench", args=args)
    warmup, rounds = prompts(args, get_config(args.config).vocab_size)
    cached = serve_side(args, "cached", {}, warmup, rounds, COUNTERS)
    uncached = serve_side(args, "uncached", UNCACHED, warmup, rounds, COUNTERS)
    report(args, targets, cached, uncached)
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
