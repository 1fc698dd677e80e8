"""Prefill at the 8b-int4 shapes (Llama-3-8B) against plain PyTorch fp16 (SDPA causal + cuBLAS), in
the same run, plus the first token of the same prompts through WorkerService (issue 12). The
int4 linears alone (their dequantization, tile sizes, against torch) are bench/prefill_linear_bench.py.

[1] prefill of 469 / 2048 / 5502 tokens: ours through the executor (chunked prefill, captured
    plans, warm) vs the shared peer's fp16 prefill (bench/peer.py: SDPA causal with enable_gqa,
    last-row logits and argmax, the faster of eager and a CUDA graph per length); both timed from
    the host call to the token on the host, median of --reps.
[2] where the time goes: one prefill chunk of ours node by node (eager, synchronized after each
    node), summed per op.
[3] first token through WorkerService (a real gRPC server on loopback, the same runtime):
    Generate(max_new_tokens=1), client-side time to the first token, median of --reps.

Targets (issue 12, H200): prefill 5502 and 2048 within 1.5x the peer, 469 within 2x; first token
of the 5502-token prompt through gRPC within 2x the peer's prefill. A missed target prints MISSED
and the process exits 1.

    python3 bench/prefill_bench.py                      # GPU: 8b-int4
    python3 bench/prefill_bench.py --config small --lengths 100,600 --no-torch    # quicker
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


from bench.record import add_record_flag
from bench.targets import Targets

LENGTHS = (469, 2048, 5502)
TARGETS = {469: 2.0, 2048: 1.5, 5502: 1.5}     # ours / peer prefill time, at most
GRPC_TARGET = (5502, 2.0)                       # first token via gRPC / peer prefill, at most
LINEAR_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))   # (n, k): wq/wo, gate/up, down


def median_time(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- [1] the PyTorch peer -----------------------------------------------------------------------
def torch_peer(cfg, lengths: list[int], reps: int):
    """The shared peer's prefill (bench/peer.py: fused QKV and gate/up, SDPA causal with
    enable_gqa, flash) per length, eager and from a CUDA graph captured per length, as ours is;
    `{n: seconds}` of the faster of the two (host call to the token on the host), or None."""
    from bench import peer as bench_peer
    if not bench_peer.available():
        print(bench_peer.why_unavailable(), flush=True)
        return None
    torch = bench_peer.torch
    model = bench_peer.PeerDecoder(cfg, ctx=max(lengths))
    out = {}
    with torch.inference_mode():
        for n in lengths:
            host = torch.tensor([(i * 31 + 7) % cfg.vocab_size for i in range(n)]).pin_memory()
            static = host.to("cuda")
            graph = bench_peer.capture(lambda static=static: model.prefill(static))

            def eager(host=host):
                return int(model.prefill(host.to("cuda", non_blocking=True))[0])

            def captured(host=host, static=static, graph=graph):
                static.copy_(host, non_blocking=True)
                return int(graph.replay()[0])
            t_eager = median_time(eager, reps, torch.cuda.synchronize)
            t_graph = median_time(captured, reps, torch.cuda.synchronize)
            out[n] = min(t_eager, t_graph)
            print(f"  peer prefill {n:5d} tokens: eager {t_eager * 1e3:7.1f} ms, graph "
                  f"{t_graph * 1e3:7.1f} ms (the faster is the peer)", flush=True)
            del graph
    torch.cuda.empty_cache()
    return out


# -- [2] breakdown ------------------------------------------------------------------------------
def breakdown(rt, executor, key) -> None:
    from gpu_worker.execution.ops import OPS, LaunchContext

    plan = executor.plans.get(key)
    if plan is None:
        return
    device = rt.device
    per_op: dict[str, float] = {}
    for node, variant in plan.resolve():
        t0 = time.perf_counter()
        OPS[node.op].launch(LaunchContext(device, node, plan.graph, variant, plan.ptr, device.stream,
                                          executor.tile, executor.weight_tiled))
        device.synchronize()
        per_op[node.op] = per_op.get(node.op, 0.0) + time.perf_counter() - t0
    total = sum(per_op.values())
    print(f"\n[2] one prefill chunk {key} node by node (eager, synchronized per node): "
          f"{total * 1e3:.1f} ms")
    for op, t in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"  {op:26s} {t * 1e3:8.1f} ms  {100 * t / total:5.1f} %")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--config", default="8b-int4")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--skip", default="", help="comma list of sections to skip: grpc")
    add_record_flag(p)
    args = p.parse_args()
    targets = Targets("prefill_bench", args=args)
    lengths = [int(v) for v in args.lengths.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    from opentelemetry.sdk.trace import TracerProvider

    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.client import WorkerClient
    from gpu_worker.edge.servicer import serve_worker
    from gpu_worker.models.configs import CONFIGS

    cfg = CONFIGS[args.config]
    rt = WorkerRuntime(WorkerConfig(backend=args.backend, batching=False)).start()
    print(f"device: {rt.device.info.name}; config {cfg.name}; lengths {lengths}; reps {args.reps}",
          flush=True)
    server = None
    try:
        t0 = time.perf_counter()
        rt.load_model("m", "decoder", cfg.name, 1)
        print(f"\nloaded {cfg.name} in {time.perf_counter() - t0:.1f} s", flush=True)
        loaded = rt._get("m")
        model, executor = loaded.model, loaded.model.executor
        peer = None if args.no_torch else torch_peer(cfg, lengths, args.reps)
        prompts = {n: [(i * 31 + 7) % cfg.vocab_size for i in range(n)] for n in lengths}
        ours, theirs = {}, {}
        print(f"\n[1] prefill (host call to first token on the host), median of {args.reps}; "
              f"chunk {model.prefill_chunk}")
        for n in lengths:
            ours[n] = median_time(lambda n=n: model.prefill(prompts[n]), args.reps, lambda: None)
            line = (f"  {n:5d} tokens: gpuplane {ours[n] * 1e3:8.1f} ms "
                    f"(chunks {[c[2] for c in model.prefill_chunks(n)]})")
            targets.figure(f"gpuplane prefill {n} tokens", ours[n], "s",
                           peer=peer[n] if peer else None)
            if peer is not None:
                theirs[n] = peer[n]
                ratio = ours[n] / theirs[n]
                line += f", torch fp16 {theirs[n] * 1e3:7.1f} ms: {ratio:6.2f}x"
            print(line, flush=True)
            if peer is not None:
                targets.check(f"prefill {n}: gpuplane / pytorch fp16 time", ratio, "<=",
                              TARGETS.get(n, 2.0), unit="ratio", peer=theirs[n])
        longest = max(lengths)
        chunk_key = ("prefill", 1, model.prefill_chunks(longest)[-1][2])
        model.prefill(prompts[longest])
        breakdown(rt, executor, chunk_key)
        if "grpc" not in skip:
            server = serve_worker(rt, "127.0.0.1:0", TracerProvider())
            client = WorkerClient(server.address, deadline_s=600.0)
            print(f"\n[3] first token through WorkerService (gRPC, loopback), median of {args.reps}")
            for n in lengths:
                client.generate("m", prompts[n], 1)       # warm: plans captured
                times = [client.generate("m", prompts[n], 1).client_first_token_seconds
                         for _ in range(args.reps)]
                t = statistics.median(times)
                line = f"  {n:5d} tokens: first token {t * 1e3:8.1f} ms"
                if n in theirs:
                    line += f" = {t / theirs[n]:6.2f}x the peer's prefill"
                print(line, flush=True)
                targets.figure(f"first token via gRPC, {n} tokens", t, "s",
                               peer=theirs.get(n))
                if n in theirs and n == GRPC_TARGET[0]:
                    targets.check(f"first token {n} via gRPC / pytorch fp16 prefill",
                                  t / theirs[n], "<=", GRPC_TARGET[1], unit="ratio",
                                  peer=theirs[n])
            client.close()
    finally:
        if server is not None:
            server.stop(grace=5.0)            # closes the runtime too
        else:
            rt.close()
    if not theirs:
        print("\nno PyTorch peer in this run: no ratio checked", flush=True)
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
