"""The transformers peer (issue 21): Hugging Face `LlamaForCausalLM` at the worker's config shapes,
measured the way bench/peer.py's `PeerDecoder` is, so the faster of the two becomes the peer.

What a competent transformers user would write for fast batched decode (transformers' "Optimizing
inference" guide, the `StaticCache` + custom decoding loop recipe): random weights of the config's
shapes in fp16, `attn_implementation="sdpa"`, a `StaticCache(config=..., max_cache_len=ctx)`
filled by one eager prefill of `start` tokens per row (the cache allocates itself lazily on its
first update, and the guide does not compile the prefill), then a one-token decode function
compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs) and called
once per step with the previous step's tokens and the cache position.

Same method as `bench.peer.decode_rate`: per batch, `trials` windows of `steps` decode steps from
context `start`, the host reading each step's tokens; aggregate tokens/s per trial; medians and
spreads printed. Compilation (one graph per batch size) happens in untimed warm-up steps.

transformers is optional: when it is not importable (or torch has no CUDA device) this prints why
and measures nothing; `python bench/transformers_peer.py` then exits 0.

    python bench/transformers_peer.py --record                 # H200: 8b-int4 shapes, both peers
    python bench/transformers_peer.py --batches 1,8 --trials 3 # quicker
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import peer as bench_peer

BATCHES = (1, 8, 32, 64)


def why_unavailable() -> str | None:
    """None when the transformers peer can run here, else the reason it cannot."""
    if not bench_peer.available():
        return bench_peer.why_unavailable()
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"transformers is not importable ({exc}): no transformers peer in this run"
    return None


def llama_config(cfg, ctx: int):
    """A `LlamaConfig` of the worker config's shapes (rope theta and eps do not change speed,
    but are carried for fidelity)."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden,
                       intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
                       num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       head_dim=cfg.head_dim, rms_norm_eps=cfg.eps,
                       max_position_embeddings=max(ctx, cfg.max_context),
                       tie_word_embeddings=False, attn_implementation="sdpa")


def build_model(cfg, ctx: int, device: str = "cuda"):
    """Random-weight `LlamaForCausalLM` on `device` (fp16 on the GPU, fp32 elsewhere: the CPU
    tests), eval mode, sdpa attention."""
    torch = bench_peer.torch
    from transformers import LlamaForCausalLM
    old = torch.get_default_dtype()
    if device == "cuda":
        torch.set_default_dtype(torch.float16)   # built in fp16: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(cfg, ctx))
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _decode_one(model, tok, cache_position, cache):
    """One step for B rows at one shared position: (B, 1) tokens in, (B, 1) argmax out."""
    b = tok.shape[0]
    logits = model(tok, position_ids=cache_position[None, :].expand(b, 1),
                   cache_position=cache_position, past_key_values=cache, use_cache=True,
                   return_dict=False)[0]
    return logits[:, -1].argmax(-1, keepdim=True)


def _advance(step, model, tok, pos, cache):
    """One compiled step; the output is cloned out of the CUDA graph's pool (the next replay
    overwrites it) and the cache position moves on."""
    bench_peer.torch.compiler.cudagraph_mark_step_begin()
    nxt = step(model, tok, pos, cache).clone()
    pos.add_(1)
    return nxt


def decode_rates(model, batches, start: int, steps: int, trials: int, ctx: int,
                 warmup: int = 3, tokens: dict | None = None,
                 compile: bool = True) -> dict[int, list[float]]:
    """Aggregate decode tokens/s per trial at each batch size (see the module docstring).
    `tokens`, when given, receives each batch's last trial's tokens (rows x steps); `compile`
    False runs the same loop eagerly (the CPU tests)."""
    torch = bench_peer.torch
    dev = model.device
    from torch import _dynamo
    from transformers import StaticCache
    _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 4 * len(batches))
    step = (torch.compile(_decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
            if compile else _decode_one)
    out: dict[int, list[float]] = {}
    with torch.inference_mode():
        for b in batches:
            cache = StaticCache(config=model.config, max_cache_len=ctx)
            prompt = torch.randint(1, model.config.vocab_size, (b, start), device=dev,
                                   generator=torch.Generator(device=dev).manual_seed(b))

            def prefill(prompt=prompt, cache=cache):
                # a fresh cache every time: entries a previous window wrote past `start` change
                # the next window's tokens (the decode step reads them), not only its speed
                cache.reset()
                logits = model(prompt, cache_position=torch.arange(start, device=dev),
                               past_key_values=cache, use_cache=True, return_dict=False)[0]
                return logits[:, -1].argmax(-1, keepdim=True)
            first = prefill()
            pos = torch.tensor([start], device=dev)
            t0 = time.perf_counter()
            tok = first
            for _ in range(warmup):                 # compiles and captures this batch's graph
                tok = _advance(step, model, tok, pos, cache)
            bench_peer.synchronize(dev)
            print(f"  transformers batch {b:>2}: compiled and warm in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            rates = []
            for _ in range(trials):
                first = prefill()                   # untimed, as the shared peer's context
                pos.fill_(start)
                tok, seen = first, []
                bench_peer.synchronize(dev)
                t0 = time.perf_counter()
                for _ in range(steps):
                    tok = _advance(step, model, tok, pos, cache)
                    seen.append(tok.tolist())       # the host reads each step's tokens
                bench_peer.synchronize(dev)
                rates.append(b * steps / (time.perf_counter() - t0))
            out[b] = rates
            if tokens is not None:
                tokens[b] = [[t[0] for t in row] for row in zip(*seen)]
            del cache, prompt, prefill, first, tok
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def rates(cfg, batches, start: int, steps: int, trials: int) -> dict[int, list[float]] | None:
    """The transformers peer's rates, or None (printed why) when it cannot run here."""
    why = why_unavailable()
    if why:
        print(why, flush=True)
        return None
    import transformers
    ctx = start + steps + 8
    t0 = time.perf_counter()
    model = build_model(cfg, ctx)
    print(f"transformers {transformers.__version__} LlamaForCausalLM, {cfg.name} shapes, fp16, "
          f"attention {model.config._attn_implementation}, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    try:
        return decode_rates(model, batches, start, steps, trials, ctx)
    finally:
        del model
        bench_peer.torch.cuda.empty_cache()


def faster(shared: dict[int, list[float]], hf: dict[int, list[float]] | None
           ) -> dict[int, tuple[str, list[float]]]:
    """Per batch, the peer with the higher median rate: (name, its trials)."""
    best = {}
    for b, mine in shared.items():
        theirs = (hf or {}).get(b)
        if theirs and statistics.median(theirs) > statistics.median(mine):
            best[b] = ("transformers", theirs)
        else:
            best[b] = ("shared peer", mine)
    return best


def main() -> int:
    from bench.batching_bench import spread
    from bench.record import add_record_flag
    from bench.targets import Targets
    from gpu_worker.models.configs import get_config
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="8b-int4")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt", type=int, default=512, help="context at the window's start")
    p.add_argument("--new", type=int, default=128, help="decode steps + 1 (as batching_bench)")
    p.add_argument("--trials", type=int, default=3)
    add_record_flag(p)
    args = p.parse_args()
    targets = Targets("transformers_peer", args=args)
    if not bench_peer.available():
        print(bench_peer.why_unavailable(), flush=True)
        return targets.exit_code()
    cfg, steps = get_config(args.config), args.new - 1
    model = bench_peer.PeerDecoder(cfg, ctx=args.prompt + args.new + 8)
    shared = {b: bench_peer.decode_rate(model, b, args.prompt, steps, args.trials)
              for b in args.batches}
    del model
    bench_peer.torch.cuda.empty_cache()
    try:
        hf = rates(cfg, args.batches, args.prompt, steps, args.trials)
    except Exception as exc:  # noqa: BLE001 - a failed optional peer is reported, not fatal
        print(f"transformers peer failed: {exc!r}", flush=True)
        hf = None
    print(f"\n== decode tokens/s, {cfg.name} shapes fp16, from context {args.prompt}, "
          f"{steps} steps, {args.trials} trials", flush=True)
    for b, (name, best) in faster(shared, hf).items():
        line = f"batch {b:>2}: shared peer (CUDA graph) {spread(shared[b])}"
        if hf and b in hf:
            line += f"; transformers (static cache, compiled) {spread(hf[b])}"
            targets.figure(f"transformers static-cache compiled decode, batch {b}",
                           statistics.median(hf[b]), "tok/s")
        print(line + f"; the peer: {name}", flush=True)
        targets.figure(f"shared peer CUDA-graph decode, batch {b}",
                       statistics.median(shared[b]), "tok/s")
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
