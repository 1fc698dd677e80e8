"""Continuous batching: aggregate decode tokens/s at batch 1, 8, 32 and 64 through the worker's
gRPC Generate, against a PyTorch fp16 decoder with one CUDA graph per batch size, in one run.

Ours: a worker on loopback (the product path: servicer, scheduler, paged KV, sample op), B
concurrent Generate streams of the same prompt length and output length. The decode window of a
trial runs from the moment the last stream received its first token (every prefill done) to the
moment the first stream ends; the figure is the tokens all streams received inside it, per second.
The peer: the same shapes in fp16, a static (B, context) KV cache, B rows per step from one
captured graph, the host reading each step's B tokens (as a server does); the window is
`--new` - 1 steps after the prefill length. Both sides: `--trials` trials per batch, median.

Targets (MISSED: exit status 1): at each batch every stream equals the batch-1 stream (same prompt,
greedy); with the peer, ours/peer >= 2 at batch 8 and >= 1 at 1, 32 and 64 (issue 13). Without a
peer (no torch, or `--backend sim`) only the identity targets are printed.

    python bench/batching_bench.py                                   # H200: 8b-int4
    python bench/batching_bench.py --backend sim --config tiny --batches 1,4 --prompt 16 --new 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.targets import Targets
from gpu_worker.edge.client import WorkerClient
from gpu_worker.models.configs import get_config
from gpu_worker.core.runtime import WorkerConfig, WorkerRuntime
from gpu_worker.edge.servicer import serve_worker

TARGET_RATIO = {1: 1.0, 8: 2.0, 32: 1.0, 64: 1.0}


def _stream(client: WorkerClient, prompt: list[int], new: int, out: dict, i: int) -> None:
    first = end = 0.0
    stamps: list[float] = []
    tokens: list[int] = []
    for message in client.generate_stream("m", prompt, new, timeout=600):
        now = time.perf_counter()
        for t in message.tokens:
            tokens.append(int(t))
            stamps.append(now)
        if message.tokens and not first:
            first = now
    end = time.perf_counter()
    out[i] = (tokens, stamps, first, end)


def ours(args: argparse.Namespace) -> dict:
    batches = args.batches
    rt = WorkerRuntime(WorkerConfig(backend=args.backend, max_batch_size=max(batches),
                                    max_plans=len(batches) + 2,
                                    kv_block_tokens=args.block_tokens)).start()
    server = serve_worker(rt, "127.0.0.1:0", None, max_workers=max(batches) + 8)
    client = WorkerClient(f"127.0.0.1:{server.port}", deadline_s=600)
    try:
        client.load_model("m", "decoder", args.config, 1)
        cfg = get_config(args.config)
        prompt = [(i * 31 + 7) % cfg.vocab_size for i in range(args.prompt)]
        rates: dict[int, list[float]] = {b: [] for b in batches}
        same: dict[int, bool] = {}
        solo = client.generate("m", prompt, args.new).tokens
        for b in batches:
            same[b] = True
            for trial in range(args.trials + 1):          # trial 0 warms the batch's plans
                out: dict = {}
                threads = [threading.Thread(target=_stream, args=(client, prompt, args.new, out, i))
                           for i in range(b)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                same[b] &= all(out[i][0] == solo for i in range(b))
                start = max(out[i][2] for i in range(b))
                stop = min(out[i][3] for i in range(b))
                inside = sum(1 for i in range(b) for s in out[i][1] if start < s <= stop)
                if trial == 0:
                    continue
                rate = inside / (stop - start) if stop > start and inside else float("nan")
                rates[b].append(rate)
                print(f"gpuplane {args.config} batch {b:>2} trial {trial}: {rate:9.1f} tokens/s "
                      f"({inside} tokens in {stop - start:.3f} s)", flush=True)
        stats = client.stats().scheduler
        print(f"scheduler: steps {stats.steps}, peak batch {stats.peak_batch_size}, preemptions "
              f"{stats.preemptions}, kv blocks used {stats.kv_blocks_used}/{stats.kv_blocks_total}",
              flush=True)
        return {"rate": {b: statistics.median(r) for b, r in rates.items()}, "same": same,
                "cfg": cfg}
    finally:
        client.close()
        server.stop(0)


def torch_peer(cfg, args: argparse.Namespace) -> dict[int, float] | None:
    try:
        import torch
    except ImportError:
        print("torch is not importable: no PyTorch peer in this run", flush=True)
        return None
    if not torch.cuda.is_available():
        print("no CUDA device: no PyTorch peer in this run", flush=True)
        return None
    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    h, hd, kvh, heads, ffn, L = cfg.hidden, cfg.head_dim, cfg.kv_heads, cfg.heads, cfg.ffn, cfg.layers
    ctx = args.prompt + args.new + 8

    def w(*shape):
        return (torch.randn(*shape, device=dev, generator=g, dtype=torch.float32)
                / shape[-1] ** 0.5).to(dt)

    weights = [{"n1": torch.ones(h, device=dev, dtype=dt), "n2": torch.ones(h, device=dev, dtype=dt),
                "wqkv": w((heads + 2 * kvh) * hd, h), "wo": w(h, h), "wgu": w(2 * ffn, h),
                "wd": w(h, ffn)} for _ in range(L)]
    emb, nf, head = w(cfg.vocab_size, h), torch.ones(h, device=dev, dtype=dt), w(cfg.vocab_size, h)
    inv = cfg.rope_theta ** (-torch.arange(0, hd // 2, device=dev, dtype=torch.float32) * 2 / hd)
    keys = torch.arange(ctx, device=dev)
    out: dict[int, float] = {}

    def rms(x, wt):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + cfg.eps)).to(dt) * wt

    def rope(x, pos):                     # x (B, H, hd), pos (B,)
        ang = pos.float()[:, None, None] * inv[None, None, :]
        c, s = ang.cos().to(dt), ang.sin().to(dt)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    for b in args.batches:
        kc = [torch.randn(b, ctx, kvh, hd, device=dev, dtype=dt, generator=g) for _ in range(L)]
        vc = [torch.randn(b, ctx, kvh, hd, device=dev, dtype=dt, generator=g) for _ in range(L)]
        rows = torch.arange(b, device=dev)

        def step(tok, pos, kc=kc, vc=vc, rows=rows, b=b):
            x = emb[tok]                                         # (B, h)
            mask = (keys[None, :] <= pos[:, None]).view(b, 1, 1, ctx)
            for ly, k_cache, v_cache in zip(weights, kc, vc, strict=True):
                qkv = rms(x, ly["n1"]) @ ly["wqkv"].T
                q = rope(qkv[:, : heads * hd].view(b, heads, hd), pos)
                k = rope(qkv[:, heads * hd:(heads + kvh) * hd].view(b, kvh, hd), pos)
                v = qkv[:, (heads + kvh) * hd:].view(b, kvh, hd)
                k_cache[rows, pos] = k
                v_cache[rows, pos] = v
                kk = k_cache.repeat_interleave(heads // kvh, 2).transpose(1, 2)   # (B, H, ctx, hd)
                vv = v_cache.repeat_interleave(heads // kvh, 2).transpose(1, 2)
                att = torch.nn.functional.scaled_dot_product_attention(
                    q.view(b, heads, 1, hd), kk, vv, attn_mask=mask)
                x = x + att.reshape(b, h) @ ly["wo"].T
                gu = rms(x, ly["n2"]) @ ly["wgu"].T
                x = x + (torch.nn.functional.silu(gu[:, :ffn]) * gu[:, ffn:]) @ ly["wd"].T
            return torch.argmax(rms(x, nf) @ head.T, -1)

        tok = torch.zeros(b, dtype=torch.long, device=dev)
        pos = torch.full((b,), args.prompt, dtype=torch.long, device=dev)
        runs = []
        with torch.inference_mode():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step(tok, pos)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                nxt = step(tok, pos)
            torch.cuda.synchronize()
            for _ in range(args.trials):
                pos.fill_(args.prompt)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.new - 1):
                    graph.replay()
                    tok.copy_(nxt)
                    pos.add_(1)
                    tok.tolist()                  # the host reads each step's tokens
                torch.cuda.synchronize()
                runs.append(b * (args.new - 1) / (time.perf_counter() - start))
        out[b] = statistics.median(runs)
        print(f"pytorch {cfg.name} fp16 graph batch {b:>2}: {out[b]:9.1f} tokens/s "
              f"(median of {args.trials})", flush=True)
        del kc, vc, graph
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--config", default="8b-int4")
    p.add_argument("--batches", default="1,8,32,64",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of every stream")
    p.add_argument("--new", type=int, default=128, help="output tokens of every stream")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args()
    targets = Targets("batching_bench")
    mine = ours(args)
    peer = None
    if not args.no_torch and args.backend != "sim":
        try:
            peer = torch_peer(mine["cfg"], args)
        except Exception as exc:  # noqa: BLE001 - the peer is a comparison, not the subject
            print(f"PyTorch peer failed: {exc!r}", flush=True)
    print(f"\n== side by side (aggregate decode tokens/s, median of {args.trials})", flush=True)
    for b in args.batches:
        line = f"batch {b:>2}: gpuplane {mine['rate'][b]:9.1f}"
        if peer:
            line += f", pytorch fp16 graph {peer[b]:9.1f}, ratio {mine['rate'][b] / peer[b]:.2f}x"
        print(line, flush=True)
    for b in args.batches:
        targets.require(f"batch {b}: every stream equals the solo stream", mine["same"][b])
    if peer:
        for b in args.batches:
            bound = TARGET_RATIO.get(b, 1.0)
            targets.check(f"batch {b}: gpuplane / pytorch fp16 graph", mine["rate"][b] / peer[b],
                          ">=", bound)
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
