"""Embed batching: embeddings/s with concurrent gRPC clients, batched vs one at a time, and the
encoder's batch against a PyTorch fp16 peer of the same shapes at the same batch, in one run.

1. Two worker processes in turn (`python -m gpu_worker serve`), identical but for
   `--embed-max-batch`: the default batcher (64, wait `--wait-ms`) and 1 (one sequence per
   encoder launch, the behaviour before batching). `--clients` threads, each with its own channel,
   send `--requests` Embed calls of one sequence each (lengths drawn from [min-len, max-len]);
   embeddings/s = sequences / wall seconds of the timed phase (after a warm-up that builds the
   plans). Every batched result is compared with the one-at-a-time result of the same request.
2. In this process (cuda only): the encoder at the batch size the batched server ran most
   (`runtime.embed` of one padded batch; no gRPC) against a PyTorch fp16 encoder of the same
   shapes (BERT-style post-LN, exact GELU, padding mask, masked mean pooling), both on batches of
   the same sequences, median of `--reps` timed batches each (after warm-up; cuda synchronized).

Targets (cuda): batched >= 3x one-at-a-time embeddings/s at 32 clients (gathering ~32 callers
per launch must beat 32 launches by far more than the gRPC cost they share); our encoder batch
>= 0.5x the PyTorch peer's sequences/s (int4 weights dequantized per call and an f32 attention
kernel against cuBLAS fp16 and SDPA: within 2x is the bar, so batching, not the kernels, decides
the served throughput). On `--backend sim` the figures print as a smoke test, without targets
but the equality of results.

    python bench/embed_batch_bench.py                         # GPU: small-encoder, 32 clients
    python bench/embed_batch_bench.py --backend sim --config tiny-encoder --clients 8 --requests 80
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import peer as bench_peer
from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker.edge.client import WorkerClient
from gpu_worker.models.configs import CONFIGS, ModelConfig
from gpu_worker.stack.processes import Stack


def workload(cfg: ModelConfig, n: int, lo: int, hi: int, seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    hi = min(hi, cfg.max_context)
    return [rng.integers(1, cfg.vocab_size, int(rng.integers(lo, hi + 1))).tolist()
            for _ in range(n)]


def serve_and_measure(args, root: pathlib.Path, max_batch: int,
                      requests: list[list[int]]) -> dict:
    """One worker process with --embed-max-batch `max_batch`; the clients' timed phase."""
    extra = ["--embed-max-batch", str(max_batch), "--embed-batch-wait-ms", str(args.wait_ms),
             "--max-plans", str(args.max_plans)]
    with Stack(root / f"batch{max_batch}") as stack:
        worker = stack.start_worker("embed", backend=args.backend,
                                    cache_dir=root / "kernels", extra=extra)
        with WorkerClient(worker.address, deadline_s=600.0) as admin:
            admin.load_model("enc", "encoder", args.config, 1)
            results: list[np.ndarray | None] = [None] * len(requests)
            per_client = [list(range(c, len(requests), args.clients)) for c in range(args.clients)]
            errors: list[BaseException] = []

            def client(indices: list[int], barrier: threading.Barrier, record: bool) -> None:
                try:
                    with WorkerClient(worker.address, deadline_s=600.0) as own:
                        barrier.wait()
                        for i in indices:
                            out = own.embed("enc", [requests[i]])
                            if record:
                                results[i] = out[0]
                except BaseException as exc:  # noqa: BLE001 - reported after the phase
                    errors.append(exc)

            def phase(indices_per_client: list[list[int]], record: bool) -> float:
                barrier = threading.Barrier(len(indices_per_client) + 1)
                threads = [threading.Thread(target=client, args=(ix, barrier, record))
                           for ix in indices_per_client]
                for t in threads:
                    t.start()
                barrier.wait()
                started = time.perf_counter()
                for t in threads:
                    t.join()
                return time.perf_counter() - started

            phase([ix[:args.warmup] for ix in per_client], record=False)   # plans built
            before = admin.stats()
            seconds = phase(per_client, record=True)
            after = admin.stats()
            if errors:
                raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    b0, b1 = before.embed_batch, after.embed_batch
    batches = b1.batches - b0.batches
    r = {"max_batch": max_batch, "seconds": seconds, "per_s": len(requests) / seconds,
         "batches": batches, "mean_batch": (b1.sequences - b0.sequences) / max(1, batches),
         "peak": b1.peak_batch_sequences,
         "padding": (b1.padded_tokens - b0.padded_tokens) / max(1, b1.tokens - b0.tokens),
         "plan_misses": after.plans.misses - before.plans.misses, "results": results}
    print(f"  --embed-max-batch {max_batch:>3}: {r['per_s']:9.1f} embeddings/s "
          f"({len(requests)} in {seconds:.2f} s), {batches} batches, mean "
          f"{r['mean_batch']:.1f} / peak {r['peak']} sequences per batch, padded/real tokens "
          f"{r['padding']:.2f}, plan misses {r['plan_misses']}", flush=True)
    return r


def device_side(args, cfg: ModelConfig, batch: int, pool: list[list[int]],
                kernels: pathlib.Path) -> dict:
    """Ours (runtime.embed of one padded batch, in process) vs the PyTorch peer, same batches."""
    import torch

    from gpu_worker import WorkerConfig, WorkerRuntime
    batches = [pool[i:i + batch] for i in range(0, len(pool) - batch + 1, batch)][:args.reps]
    rt = WorkerRuntime(WorkerConfig(backend="cuda", cache_dir=kernels, max_plans=args.max_plans,
                                    embed_batch_wait_ms=0.0, embed_max_batch=batch)).start()
    try:
        rt.load_model("enc", "encoder", args.config, 1)
        for b in batches:           # every shape warm, as the peer's graphs are
            rt.embed("enc", b)
        ours = []
        for b in batches:
            t0 = time.perf_counter()
            rt.embed("enc", b)      # returns host results: synchronized
            ours.append(time.perf_counter() - t0)
    finally:
        rt.close()
    peer = bench_peer.PeerEncoder(cfg)     # captured per (batch, seq), as ours is
    tensors = []
    for b in batches:
        longest = max(map(len, b))
        toks = torch.zeros((len(b), longest), dtype=torch.long)
        for i, s in enumerate(b):
            toks[i, :len(s)] = torch.tensor(s)
        tensors.append((toks.cuda(), torch.tensor([len(s) for s in b], device="cuda")))
    with torch.inference_mode():
        for toks, lens in tensors:               # capture every shape first (ours are warm too)
            peer.embed_captured(toks, lens)
        torch.cuda.synchronize()
        theirs = []
        for toks, lens in tensors:
            t0 = time.perf_counter()
            peer.embed_captured(toks, lens).float().cpu()     # host results, as ours
            theirs.append(time.perf_counter() - t0)
    r = {"batch": batch, "ours": batch / statistics.median(ours),
         "peer": batch / statistics.median(theirs)}
    print(f"  batch {batch}: ours {r['ours']:9.1f} seq/s (median {statistics.median(ours) * 1e3:.2f}"
          f" ms), PyTorch fp16 {r['peer']:9.1f} seq/s (median "
          f"{statistics.median(theirs) * 1e3:.2f} ms), {len(batches)} batches each", flush=True)
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda", choices=("cuda", "sim"))
    p.add_argument("--config", default="small-encoder")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=2048, help="timed Embed calls in all")
    p.add_argument("--warmup", type=int, default=4, help="untimed calls per client first")
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--wait-ms", type=float, default=2.0)
    p.add_argument("--max-plans", type=int, default=16,
                   help="both servers: the batch x seq ladder of this traffic fits")
    p.add_argument("--reps", type=int, default=30, help="device-side timed batches per side")
    add_record_flag(p)
    args = p.parse_args()
    cfg = CONFIGS[args.config]
    t = Targets("embed_batch", args=args)
    requests = workload(cfg, args.requests, args.min_len, args.max_len)
    print(f"== {args.clients} clients, {args.requests} Embed calls of one sequence "
          f"({args.min_len}..{args.max_len} tokens), {args.config}, backend {args.backend}",
          flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="embed-batch-bench-")
    root = pathlib.Path(tmp.name)   # its kernels/ cache serves both servers and the device side
    batched = serve_and_measure(args, root, 64, requests)
    single = serve_and_measure(args, root, 1, requests)
    worst = max(float(np.max(np.abs(a - b)))
                for a, b in zip(batched["results"], single["results"], strict=True))
    t.require("batched results equal one-at-a-time results", worst <= 2e-3,
              f"max abs difference {worst:.2e} (bound 2e-3: fp16 activations)")
    ratio = batched["per_s"] / single["per_s"]
    if args.backend != "cuda":
        print(f"batched / one-at-a-time: {ratio:.2f}x (sim: informational, no target)")
        return t.exit_code()
    t.check(f"batched / one-at-a-time embeddings/s at {args.clients} clients", ratio, ">=", 3.0)
    batch = max(1, round(batched["mean_batch"]))   # the batch the server ran, on average
    pool = workload(cfg, batch * (args.reps + 3), args.min_len, args.max_len, seed=12)
    dev = device_side(args, cfg, batch, pool, root / "kernels")
    tmp.cleanup()
    t.check(f"encoder / PyTorch fp16 sequences/s at batch {batch}", dev["ours"] / dev["peer"],
            ">=", 0.5, unit="ratio", peer=dev["peer"])
    return t.exit_code()


if __name__ == "__main__":
    sys.exit(main())
