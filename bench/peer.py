"""The PyTorch peer every benchmark that compares with PyTorch uses (DESIGN 6.5, issue 21).

What a competent PyTorch user would write for each shape family, in fp16 with fp32 accumulation
(cuBLAS), random weights of the worker's config shapes:
- `PeerDecoder`: fused QKV and fused gate/up matmuls; a static KV cache per layer laid out
  (B, kv_heads, ctx, head_dim), the layout `scaled_dot_product_attention(..., enable_gqa=True)`
  reads without repeating KV heads; decode steps captured as one CUDA graph per batch size
  (`DecodeGraph`); prefill as one causal SDPA (flash) over the prompt, eager or captured per length.
- `PeerEncoder`: bidirectional SDPA with a key-padding mask, fused QKV, GELU FFN, post-LayerNorm.
- `PeerServer`: a continuous-batching loop over `PeerDecoder` (a slot per stream; a finished
  request's slot takes the stream's next request, prefilled eagerly into that slot's cache row,
  while the other rows keep decoding in the captured graph) for end-to-end comparisons against the
  same request trace as the worker.
- `capture(fn)`: the one place CUDA graphs are captured (side-stream warm-up, then capture).

What the peer does not do, and a reader should know: it masks the whole static context (the
graph's KV reads are ctx-sized, not length-sized) and it does not page KV. A peer that did would be
a serving engine, not plain PyTorch.

torch is an optional, bench-only import: nothing here is imported by the worker. The module runs
on CPU too (no graphs there), which the tests use to check the peer's numerics.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

try:
    import torch
    import torch.nn.functional as F
except ImportError:          # the worker's environment has no torch; callers check `available()`
    torch = None
    F = None


def available(cuda: bool = True) -> bool:
    """torch importable (and a CUDA device present when `cuda`)."""
    return torch is not None and (not cuda or torch.cuda.is_available())


def why_unavailable() -> str:
    if torch is None:
        return "torch is not importable: no PyTorch peer in this run"
    return "no CUDA device: no PyTorch peer in this run"


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Captured:
    """A callable captured once as a CUDA graph: `replay()` reruns it on the same static inputs
    and refreshes `out` in place. Inputs are updated by the caller with in-place copies."""

    def __init__(self, fn: Callable[[], object], warmup: int = 3) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):        # warm-up off the capture stream (cuBLAS, allocator)
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()
        torch.cuda.synchronize()

    def replay(self):
        self.graph.replay()
        return self.out


def capture(fn: Callable[[], object], warmup: int = 3) -> Captured:
    return Captured(fn, warmup)


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class PeerDecoder:
    """Llama-style decoder in fp16 at `cfg`'s shapes, static KV of `ctx` tokens per row."""

    def __init__(self, cfg, ctx: int, device: str = "cuda", seed: int = 0,
                 dtype=None) -> None:
        self.cfg, self.ctx, self.device = cfg, ctx, torch.device(device)
        self.dtype = dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        g = torch.Generator(device=self.device).manual_seed(seed)
        h, hd, kvh, heads, ffn = cfg.hidden, cfg.head_dim, cfg.kv_heads, cfg.heads, cfg.ffn
        self.h, self.hd, self.kvh, self.heads, self.ffn = h, hd, kvh, heads, ffn

        def w(*shape):
            return (torch.randn(*shape, device=self.device, generator=g) / shape[-1] ** 0.5
                    ).to(self.dtype)

        one = torch.ones(h, device=self.device, dtype=self.dtype)
        self.layers = [{"n1": one, "n2": one, "wqkv": w((heads + 2 * kvh) * hd, h),
                        "wo": w(h, heads * hd), "wgu": w(2 * ffn, h), "wd": w(h, ffn)}
                       for _ in range(cfg.layers)]
        self.emb, self.nf, self.head = w(cfg.vocab_size, h), one, w(cfg.vocab_size, h)
        self.inv = cfg.rope_theta ** (-torch.arange(0, hd // 2, device=self.device,
                                                    dtype=torch.float32) * 2 / hd)
        self.keys = torch.arange(ctx, device=self.device)

    def weight_bytes(self) -> int:
        tensors = [t for ly in self.layers for t in ly.values()] + [self.emb, self.nf, self.head]
        return sum(t.numel() * t.element_size() for t in tensors)

    def new_cache(self, batch: int) -> list[tuple]:
        shape = (batch, self.kvh, self.ctx, self.hd)
        return [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                 torch.zeros(shape, device=self.device, dtype=self.dtype))
                for _ in self.layers]

    def _rope(self, x, pos):                   # x (..., H, hd) with pos broadcast over heads
        ang = pos.float()[..., None, None] * self.inv
        c, s = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        half = self.hd // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def _mlp(self, x, ly):
        gu = _rms(x, ly["n2"], self.cfg.eps) @ ly["wgu"].T
        return x + (F.silu(gu[..., :self.ffn]) * gu[..., self.ffn:]) @ ly["wd"].T

    def decode(self, tok, pos, cache):
        """One step for B rows: tok, pos (B,) long on the device; returns the next tokens (B,).
        Host-sync free, so it can be captured."""
        b, hd, heads, kvh = tok.shape[0], self.hd, self.heads, self.kvh
        rows = torch.arange(b, device=self.device)
        mask = (self.keys[None, :] <= pos[:, None]).view(b, 1, 1, self.ctx)
        x = self.emb[tok]
        for ly, (kc, vc) in zip(self.layers, cache, strict=True):
            qkv = _rms(x, ly["n1"], self.cfg.eps) @ ly["wqkv"].T
            q = self._rope(qkv[:, :heads * hd].view(b, heads, hd), pos)
            k = self._rope(qkv[:, heads * hd:(heads + kvh) * hd].view(b, kvh, hd), pos)
            v = qkv[:, (heads + kvh) * hd:].view(b, kvh, hd)
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            att = F.scaled_dot_product_attention(q.view(b, heads, 1, hd), kc, vc,
                                                 attn_mask=mask, enable_gqa=True)
            x = self._mlp(x + att.reshape(b, heads * hd) @ ly["wo"].T, ly)
        return torch.argmax(_rms(x, self.nf, self.cfg.eps) @ self.head.T, -1)

    def prefill(self, tokens, cache=None, row: int = 0):
        """Causal prefill of one prompt (tokens (n,) long); writes K/V into `cache[row, :, :n]`
        when a cache is given. Returns the next token (1,) (argmax of the last row's logits)."""
        n, hd, heads, kvh = tokens.shape[0], self.hd, self.heads, self.kvh
        pos = torch.arange(n, device=self.device)
        x = self.emb[tokens]
        for i, ly in enumerate(self.layers):
            qkv = _rms(x, ly["n1"], self.cfg.eps) @ ly["wqkv"].T
            q = self._rope(qkv[:, :heads * hd].view(n, heads, hd), pos).transpose(0, 1)
            k = self._rope(qkv[:, heads * hd:(heads + kvh) * hd].view(n, kvh, hd),
                           pos).transpose(0, 1)
            v = qkv[:, (heads + kvh) * hd:].view(n, kvh, hd).transpose(0, 1)
            if cache is not None:
                cache[i][0][row, :, :n] = k
                cache[i][1][row, :, :n] = v
            att = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                 enable_gqa=True)
            x = self._mlp(x + att[0].transpose(0, 1).reshape(n, heads * hd) @ ly["wo"].T, ly)
        return torch.argmax(_rms(x[-1:], self.nf, self.cfg.eps) @ self.head.T, -1)


class DecodeGraph:
    """One batch size's decode step, captured: static tok/pos/cache; `step()` replays and feeds
    the sampled tokens back on the device (tok <- out, pos += 1), as an engine does."""

    def __init__(self, model: PeerDecoder, batch: int, start_pos: int = 0) -> None:
        self.model, self.batch = model, batch
        self.cache = model.new_cache(batch)
        self.tok = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.pos = torch.full((batch,), start_pos, dtype=torch.long, device=model.device)
        self.captured = model.device.type == "cuda"
        if self.captured:
            self._graph = capture(lambda: model.decode(self.tok, self.pos, self.cache))
            self.out = self._graph.out

    def step(self):
        if self.captured:
            self._graph.replay()
        else:
            self.out = self.model.decode(self.tok, self.pos, self.cache)
        self.tok.copy_(self.out)
        # idle rows keep stepping (a fixed batch): clamped so they never index past the cache
        self.pos.add_(1).clamp_(max=self.model.ctx - 1)
        return self.tok

    def release(self) -> None:
        self.cache = self._graph = self.out = None


def decode_rate(model: PeerDecoder, batch: int, start: int, steps: int, trials: int,
                eager: bool = False) -> list[float]:
    """Aggregate decode tokens/s at `batch` rows from context `start`: `trials` windows of `steps`
    steps, the host reading each step's tokens (as a server does). Captured unless `eager`."""
    rates = []
    with torch.inference_mode():
        if eager:
            cache = model.new_cache(batch)
            tok = torch.zeros(batch, dtype=torch.long, device=model.device)
            pos = torch.full((batch,), start, dtype=torch.long, device=model.device)

            def advance():
                tok.copy_(model.decode(tok, pos, cache))
                pos.add_(1)
                return tok
            advance()
        else:
            g = DecodeGraph(model, batch, start)
            pos, advance = g.pos, g.step
        for _ in range(trials):
            pos.fill_(start)
            synchronize(model.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                advance().tolist()
            synchronize(model.device)
            rates.append(batch * steps / (time.perf_counter() - t0))
        if not eager:
            g.release()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


# -- end-to-end serving over a trace -----------------------------------------------------------
@dataclass
class _Slot:
    work: list[tuple[list[int], int]]       # this stream's requests, in order
    started: float = 0.0
    first: float = 0.0
    got: int = 0
    want: int = 0
    seq: list[int] = field(default_factory=list)
    busy: bool = False
    results: list[dict] = field(default_factory=list)


class PeerServer:
    """Continuous batching over `PeerDecoder`: `streams` slots, each serving its client's requests
    back to back. A step prefills (eagerly, one prompt at a time, into its cache row) every slot
    that has just taken a request, then replays the batch's decode graph once for every row; the
    host reads each step's tokens. Rows without a request still compute (the graph has a fixed
    batch), as an engine padding to a captured batch size does."""

    def __init__(self, model: PeerDecoder, streams: int) -> None:
        self.model, self.streams = model, streams
        self.graph = DecodeGraph(model, streams)

    def run(self, trace: list[list[tuple[list[int], int]]]) -> dict:
        """trace[i]: stream i's (prompt tokens, new tokens) requests. Per request TTFT (from when
        its client sent it: the previous request's end) and tokens; aggregate tokens / wall."""
        assert len(trace) == self.streams, "one work list per stream"
        m, g = self.model, self.graph
        slots = [_Slot(list(w)) for w in trace]
        t0 = time.perf_counter()
        for s in slots:
            s.started = t0
        with torch.inference_mode():
            while True:
                for row, s in enumerate(slots):
                    if not s.busy and s.work:
                        prompt, s.want = s.work.pop(0)
                        toks = torch.tensor(prompt, dtype=torch.long, device=m.device)
                        first = m.prefill(toks, g.cache, row)
                        g.tok[row] = first[0]
                        g.pos[row] = len(prompt)
                        s.seq = first.tolist()             # the first token reaches the host
                        s.first, s.got, s.busy = time.perf_counter(), 1, True
                        self._finish_if_done(s)
                if not any(s.busy for s in slots):
                    break
                g.step()
                host = g.tok.tolist()                      # every row's token reaches the host
                now = time.perf_counter()
                for row, s in enumerate(slots):
                    if s.busy:
                        s.got += 1
                        s.seq.append(host[row])
                        self._finish_if_done(s, now)
        wall = time.perf_counter() - t0
        results = [r for s in slots for r in s.results]
        tokens = sum(r["tokens"] for r in results)
        return {"rate": tokens / wall, "wall": wall, "tokens": tokens,
                "ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results],
                "sequences": [[r["seq"] for r in s.results] for s in slots]}

    def run_arrivals(self, requests: list[tuple[float, list[int], int]]) -> dict:
        """Open loop: requests[i] = (arrival seconds after the start, prompt tokens, new tokens),
        in arrival order, sent at their time whatever the server is doing. A request that has
        arrived takes the lowest free slot (first come first served; it queues while all
        `streams` are busy). TTFT is from its arrival time, not from when a slot took it.
        Returns the same dict as `run`, with `sequences` and `arrival` in request order."""
        m, g = self.model, self.graph
        order = sorted(range(len(requests)), key=lambda i: requests[i][0])
        assert order == list(range(len(requests))), "requests in arrival order"
        slots: list[_Slot | None] = [None] * self.streams
        index: dict[int, int] = {}                     # id(slot) -> request index
        done: list[dict | None] = [None] * len(requests)
        nxt = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            while True:
                now = time.perf_counter() - t0
                for row in range(self.streams):
                    if slots[row] is not None or nxt >= len(requests) or \
                            requests[nxt][0] > now:
                        continue
                    arrival, prompt, want = requests[nxt]
                    s = _Slot([], started=t0 + arrival, want=want, busy=True)
                    index[id(s)] = nxt
                    nxt += 1
                    toks = torch.tensor(prompt, dtype=torch.long, device=m.device)
                    first = m.prefill(toks, g.cache, row)
                    g.tok[row] = first[0]
                    g.pos[row] = len(prompt)
                    s.seq = first.tolist()
                    s.first, s.got = time.perf_counter(), 1
                    slots[row] = s
                    now = time.perf_counter() - t0
                for row, s in enumerate(slots):
                    if s is not None and s.got >= s.want:
                        self._finish_if_done(s)
                        done[index.pop(id(s))] = s.results[-1]
                        slots[row] = None
                if not any(slots):
                    if nxt >= len(requests):
                        break
                    time.sleep(max(0.0, requests[nxt][0] - (time.perf_counter() - t0)))
                    continue
                g.step()
                host = g.tok.tolist()
                now_abs = time.perf_counter()
                for row, s in enumerate(slots):
                    if s is not None:
                        s.got += 1
                        s.seq.append(host[row])
                        if s.got >= s.want:
                            self._finish_if_done(s, now_abs)
                            done[index.pop(id(s))] = s.results[-1]
                            slots[row] = None
        wall = time.perf_counter() - t0
        results = [r for r in done if r is not None]
        tokens = sum(r["tokens"] for r in results)
        return {"rate": tokens / wall, "wall": wall, "tokens": tokens,
                "ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results],
                "arrival": [a for a, _, _ in requests],
                "sequences": [r["seq"] if r else None for r in done]}

    @staticmethod
    def _finish_if_done(s: _Slot, now: float | None = None) -> None:
        if s.got < s.want:
            return
        now = now or time.perf_counter()
        s.results.append({"ttft": s.first - s.started, "tokens": s.got, "seq": s.seq,
                          "tpot": (now - s.first) / max(1, s.got - 1)})
        s.busy, s.started = False, now

    def release(self) -> None:
        self.graph.release()


# -- encoder -----------------------------------------------------------------------------------
class PeerEncoder:
    """BERT-style encoder at `cfg`'s shapes (post-LayerNorm, GELU), fp16; mean-pooled embedding."""

    def __init__(self, cfg, device: str = "cuda", seed: int = 0) -> None:
        self.cfg, self.device = cfg, torch.device(device)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        g = torch.Generator(device=self.device).manual_seed(seed)
        h, ffn = cfg.hidden, cfg.ffn

        def w(*shape):
            return (torch.randn(*shape, device=self.device, generator=g) / shape[-1] ** 0.5
                    ).to(self.dtype)

        def zeros(n):
            return torch.zeros(n, device=self.device, dtype=self.dtype)

        one = torch.ones(h, device=self.device, dtype=self.dtype)
        self.tok, self.pos = w(cfg.vocab_size, h), w(cfg.max_context, h)
        self.layers = [{"wqkv": w(3 * h, h), "bqkv": zeros(3 * h), "wo": w(h, h), "bo": zeros(h),
                        "w1": w(ffn, h), "b1": zeros(ffn), "w2": w(h, ffn), "b2": zeros(h),
                        "g1": one, "z1": zeros(h), "g2": one, "z2": zeros(h)}
                       for _ in range(cfg.layers)]
        self.g0, self.z0 = one, zeros(h)
        self._graphs: dict[tuple[int, int], tuple] = {}

    def _ln(self, x, g, z):
        return F.layer_norm(x, (self.cfg.hidden,), g, z, self.cfg.eps)

    def embed(self, tokens, lengths):
        """tokens (B, S) long, lengths (B,) long: mean over the real tokens, (B, hidden)."""
        b, s = tokens.shape
        heads, h = self.cfg.heads, self.cfg.hidden
        hd = h // heads
        keep = torch.arange(s, device=self.device)[None, :] < lengths[:, None]
        mask = keep.view(b, 1, 1, s)
        x = self._ln(self.tok[tokens] + self.pos[:s][None], self.g0, self.z0)
        for ly in self.layers:
            qkv = (x @ ly["wqkv"].T + ly["bqkv"]).view(b, s, 3, heads, hd).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
            x = self._ln(x + att.transpose(1, 2).reshape(b, s, h) @ ly["wo"].T + ly["bo"],
                         ly["g1"], ly["z1"])
            f = F.gelu(x @ ly["w1"].T + ly["b1"]) @ ly["w2"].T + ly["b2"]
            x = self._ln(x + f, ly["g2"], ly["z2"])
        k = keep.to(x.dtype)[..., None]
        return (x * k).sum(1) / lengths[:, None].to(x.dtype)

    def embed_captured(self, tokens, lengths):
        """`embed` from a CUDA graph per (B, S), captured on first use (as the worker's plans)."""
        key = tuple(tokens.shape)
        if key not in self._graphs:
            st, sl = tokens.clone(), lengths.clone()
            self._graphs[key] = (st, sl, capture(lambda: self.embed(st, sl)))
        st, sl, graph = self._graphs[key]
        st.copy_(tokens)
        sl.copy_(lengths)
        return graph.replay()
