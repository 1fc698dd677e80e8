"""Serving under mixed traffic (issue 13): B concurrent gRPC clients, each sending Generate
requests back to back with mixed prompt lengths (`--prompt-range`, default 128-2048) and output
lengths (`--new-range`, default 64-512), against the worker's continuous-batching scheduler.

Per concurrency B: aggregate output tokens/s over the run (every token every stream received,
over the wall time from the first request to the last stream's end), TTFT and time per output
token p50/p99, peak KV blocks used, preemptions; in the same run the PyTorch fp16 CUDA-graph peer
of bench/batching_bench.py at the same batch sizes, decoding at the mean lengths.

Targets (MISSED: exit status 1), issue 13: aggregate tok/s >= 2x the peer at 8 streams and >= the
peer at 32 and 64; TTFT p99 at 32 streams within 2x (the unloaded TTFT of the longest prompt +
the unloaded TTFT of one prefill chunk); zero lost streams (every request ends with
`finish_reason` `length` and all its tokens); ledger within 1 % of the device after the run.

    python bench/serving_bench.py                                      # H200: 8b-int4
    python bench/serving_bench.py --backend sim --config tiny --concurrency 1,4 \\
        --requests 2 --prompt-range 8,40 --new-range 4,12                 # smoke test
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.batching_bench import torch_peer
from bench.pressure_bench import ledger_error
from bench.targets import Targets
from gpu_worker.edge.client import WorkerClient
from gpu_worker.models.configs import get_config
from gpu_worker.core.runtime import WorkerConfig, WorkerRuntime
from gpu_worker.edge.servicer import serve_worker

TARGET_RATIO = {8: 2.0, 32: 1.0, 64: 1.0}
TTFT_STREAMS = 32


def _pair(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(","))
    return lo, hi


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def one_request(client: WorkerClient, prompt: list[int], new: int) -> dict:
    """Stream one Generate; TTFT, mean time per output token, tokens and the finish reason."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    reason = ""
    for message in client.generate_stream("m", prompt, new, timeout=900):
        now = time.perf_counter()
        stamps.extend(now for _ in message.tokens)
        if message.done:
            reason = message.finish_reason
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return {"ttft": stamps[0] - t0 if stamps else float("nan"), "tpot": tpot,
            "tokens": len(stamps), "want": new, "reason": reason}


def run_level(client: WorkerClient, cfg, streams: int, args, rng: random.Random) -> dict:
    """`streams` clients, `args.requests` requests each, back to back."""
    jobs = [[(rng.randint(*args.prompt_range), rng.randint(*args.new_range))
             for _ in range(args.requests)] for _ in range(streams)]
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client_loop(work: list[tuple[int, int]]) -> None:
        for n, new in work:
            prompt = [rng_token(i, n, cfg.vocab_size) for i in range(n)]
            try:
                r = one_request(client, prompt, new)
            except Exception as exc:  # noqa: BLE001 - a lost stream is a result here
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                results.append(r)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(w,)) for w in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    lost = len(errors) + sum(1 for r in results if r["reason"] != "length" or r["tokens"] != r["want"])
    return {"rate": tokens / wall, "wall": wall, "tokens": tokens, "lost": lost, "errors": errors[:3],
            "ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results]}


def rng_token(i: int, n: int, vocab: int) -> int:
    return (i * 31 + n * 7 + 3) % vocab


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--config", default="8b-int4")
    p.add_argument("--concurrency", default="1,8,32,64",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    p.add_argument("--prompt-range", type=_pair, default=(128, 2048))
    p.add_argument("--new-range", type=_pair, default=(64, 512))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=1, help="peer trials per batch (median)")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args()
    targets = Targets("serving_bench")
    cfg = get_config(args.config)
    top = max(args.concurrency)
    rt = WorkerRuntime(WorkerConfig(backend=args.backend, max_batch_size=top,
                                    max_plans=len(args.concurrency) + 6)).start()
    server = serve_worker(rt, "127.0.0.1:0", None, max_workers=top + 8)
    client = WorkerClient(f"127.0.0.1:{server.port}", deadline_s=900)
    levels: dict[int, dict] = {}
    try:
        client.load_model("m", "decoder", args.config, 1)
        longest = args.prompt_range[1]
        chunk = min(longest, rt.config.max_step_tokens)
        one_request(client, [rng_token(i, longest, cfg.vocab_size) for i in range(longest)], 2)
        unloaded = {n: statistics.median(
            one_request(client, [rng_token(i, n, cfg.vocab_size) for i in range(n)], 2)["ttft"]
            for _ in range(3)) for n in sorted({longest, chunk})}
        ttft_bound = 2 * (unloaded[longest] + unloaded[chunk])
        print(f"unloaded TTFT: longest prompt ({longest}) {unloaded[longest] * 1e3:.1f} ms, one "
              f"chunk ({chunk}) {unloaded[chunk] * 1e3:.1f} ms", flush=True)
        rng = random.Random(args.seed)
        for b in args.concurrency:
            r = levels[b] = run_level(client, cfg, b, args, rng)
            s = client.stats().scheduler
            print(f"gpuplane {args.config} {b:>2} streams: {r['rate']:9.1f} tok/s ({r['tokens']} "
                  f"tokens in {r['wall']:.1f} s); TTFT p50/p99 {pct(r['ttft'], .5) * 1e3:.0f}/"
                  f"{pct(r['ttft'], .99) * 1e3:.0f} ms; TPOT p50/p99 {pct(r['tpot'], .5) * 1e3:.1f}/"
                  f"{pct(r['tpot'], .99) * 1e3:.1f} ms; preemptions so far {s.preemptions}, peak "
                  f"batch {s.peak_batch_size}, lost {r['lost']} "
                  f"{r['errors'] or ''}", flush=True)
        err = ledger_error(rt)
    finally:
        client.close()
        server.stop(0)
        rt.close()
    peer = None
    if not args.no_torch and args.backend != "sim":
        mean_prompt, mean_new = (sum(args.prompt_range) // 2, sum(args.new_range) // 2)
        peer_args = argparse.Namespace(batches=args.concurrency, prompt=mean_prompt, new=mean_new,
                                       trials=args.trials)
        try:
            peer = torch_peer(cfg, peer_args)
        except Exception as exc:  # noqa: BLE001 - the peer is a comparison, not the subject
            print(f"PyTorch peer failed: {exc!r}", flush=True)
    print("\n== side by side (aggregate output tokens/s)", flush=True)
    for b in args.concurrency:
        line = f"{b:>2} streams: gpuplane {levels[b]['rate']:9.1f}"
        if peer:
            line += f", pytorch fp16 graph {peer[b]:9.1f}, ratio {levels[b]['rate'] / peer[b]:.2f}x"
        print(line, flush=True)
    for b in args.concurrency:
        targets.require(f"{b} streams: zero lost streams", levels[b]["lost"] == 0,
                        f"{levels[b]['lost']} lost")
    if TTFT_STREAMS in levels:
        targets.check(f"TTFT p99 at {TTFT_STREAMS} streams (s) vs 2x (longest + one chunk)",
                      pct(levels[TTFT_STREAMS]["ttft"], .99), "<=", ttft_bound, ".3f")
    targets.check("ledger vs device after the run (%)", 100 * err, "<=", 1.0)
    if peer:
        for b in args.concurrency:
            if b in TARGET_RATIO:
                targets.check(f"{b} streams: gpuplane / pytorch fp16 graph",
                              levels[b]["rate"] / peer[b], ">=", TARGET_RATIO[b])
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
