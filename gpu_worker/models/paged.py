"""The decoder over the paged KV pool: batched decode graphs on a ladder and prefill chunks, each
ending in the `sample` op (i13 contract). The StepRunner of gpu_worker/scheduler.

Two graph shapes, both reading K/V only through block tables into the one `kv.pool` state tensor
(the model's KVBlockPool, bound at its fixed base address, so captured graphs stay valid as the
pool grows and shrinks):
- decode(B), B on DECODE_LADDER: one token per row, row r at `positions[r]` through its table
  row; a batch of b < B rows is padded with position -1 rows (no KV written, output ignored). The
  shapes do not depend on any context length, so each B is captured once and replayed.
- prefill(S): one chunk of one sequence (S = the chunk bucketed onto the plan ladder, at most the
  prefill chunk), positions start..start+n-1 (padding rows -1), attending causally to the
  sequence's earlier blocks; `last_index` picks the last real row for the sampler.
Sampling is per row on the device: greedy at temperature <= 0, else top-k/top-p with a
counter-based hash of (seed, position), so a row's token depends on nothing else in the batch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from gpu_worker.execution.plans import seq_bucket
from gpu_worker.models.graph import Graph, GraphBuilder
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.decoder import check_prompt, prefill_chunk_from_env
from gpu_worker.models.weights import generate
from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from gpu_worker.engines.scheduler.scheduler import DecodeRow
from services.common.errors import InvalidArgument

DECODE_LADDER = (1, 2, 4, 8, 16, 32, 64)
POOL = "kv.pool"


def decode_bucket(b: int) -> int:
    """The smallest ladder size >= b (b <= 64)."""
    for size in DECODE_LADDER:
        if size >= b:
            return size
    raise ValueError(f"a decode batch has at most {DECODE_LADDER[-1]} rows, got {b}")


def build_paged_graph(cfg: ModelConfig, geo: KVGeometry, capacity_blocks: int, rows: int,
                      phase: str) -> Graph:
    """`phase` "decode" (rows = batch size) or "prefill" (rows = chunk bucket, one sequence)."""
    assert phase in ("prefill", "decode"), phase
    h, hd, kvd = cfg.hidden, cfg.head_dim, cfg.kv_heads * cfg.head_dim
    g = GraphBuilder()
    t, n, w = g.tensor, g.node, g.weight
    mb = geo.max_blocks

    def linear(name: str, x: str, out: str, out_dim: int, in_dim: int) -> None:
        g.linear(name, x, out, rows, out_dim, in_dim, cfg.weight_format)

    tokens = t("tokens", (rows,), "i32", "input")
    positions = t("positions", (rows,), "i32", "input")   # -1: a padding row
    table_rows = rows if phase == "decode" else 1
    table = t("block_table", (table_rows, mb), "i32", "input")
    if phase == "prefill":
        start = t("start", (1,), "i32", "input")
        chunk_len = t("chunk_len", (1,), "i32", "input")
    pool = t(POOL, (capacity_blocks, cfg.layers, 2, geo.block_tokens, cfg.kv_heads, hd), "f16",
             kind="state")
    n("embed", "embedding", (tokens,), (t("x.0", (rows, h)),),
      (w("embed", (cfg.vocab_size, h), "f16"),))
    x = "x.0"
    rope = (w("rope.inv_freq", (hd // 2,), "f32"),) if cfg.rope_scaling is not None else ()
    paged = {"layers": cfg.layers, "kv_heads": cfg.kv_heads, "head_dim": hd,
             "block_tokens": geo.block_tokens, "max_blocks": mb}
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        n(p + "attn_norm", "rmsnorm", (x,), (t(p + "h", (rows, h)),),
          (w(p + "attn_norm.w", (h,), "f32"),), eps=cfg.eps)
        linear(p + "wq", p + "h", p + "q", h, h)
        linear(p + "wk", p + "h", p + "k", kvd, h)
        linear(p + "wv", p + "h", p + "v", kvd, h)
        if cfg.qkv_bias:
            for lin, out, dim in (("wq", "q", h), ("wk", "k", kvd), ("wv", "v", kvd)):
                n(p + lin + "_bias", "bias_add", (p + out,), (p + out,),
                  (w(p + lin + ".b", (dim,), "f32"),))
        n(p + "rope_q", "rotary_rows", (p + "q", positions), (p + "q",), rope,
          heads=cfg.heads, head_dim=hd, theta=cfg.rope_theta)
        n(p + "rope_k", "rotary_rows", (p + "k", positions), (p + "k",), rope,
          heads=cfg.kv_heads, head_dim=hd, theta=cfg.rope_theta)
        n(p + "kv_append", "kv_append_paged", (p + "k", p + "v", positions, table), (pool,),
          layer=layer, **paged)
        q16 = t(p + "q16", (rows, h), "f16")
        n(p + "q_cast", "to_f16", (p + "q",), (q16,))
        a = t(p + "a", (rows, h), "f16")
        if phase == "decode":
            n(p + "attn", "flash_attention_decode_paged", (q16, pool, positions, table), (a,),
              layer=layer, heads=cfg.heads, **paged)
        else:
            n(p + "attn", "flash_attention_prefill_paged", (q16, pool, start, chunk_len, table),
              (a,), layer=layer, heads=cfg.heads, **paged)
        linear(p + "wo", a, p + "o", h, h)
        n(p + "res_attn", "add", (x, p + "o"), (t(p + "x1", (rows, h)),))
        n(p + "mlp_norm", "rmsnorm", (p + "x1",), (t(p + "h2", (rows, h)),),
          (w(p + "mlp_norm.w", (h,), "f32"),), eps=cfg.eps)
        linear(p + "w_gate", p + "h2", p + "g", cfg.ffn, h)
        linear(p + "w_up", p + "h2", p + "u", cfg.ffn, h)
        n(p + "silu_mul", "silu_mul", (p + "g", p + "u"), (t(p + "m", (rows, cfg.ffn)),))
        linear(p + "w_down", p + "m", p + "d", h, cfg.ffn)
        x_next = f"x.{layer + 1}"
        n(p + "res_mlp", "add", (p + "x1", p + "d"), (t(x_next, (rows, h)),))
        x = x_next
    out_rows, sample_pos = rows, positions
    if phase == "prefill":
        idx = t("last_index", (1,), "i32", "input")
        # no kernel: the executor points x.last at the chunk's last real row, the rest is eager
        n("last_row", "select_row", (x, idx), (t("x.last", (1, h)),))
        x, out_rows = "x.last", 1
        sample_pos = t("last_position", (1,), "i32", "input")
    n("final_norm", "rmsnorm", (x,), (t("hf", (out_rows, h)),), (w("final_norm.w", (h,), "f32"),),
      eps=cfg.eps)
    g.linear("lm_head", "hf", "logits", out_rows, cfg.vocab_size, h, cfg.weight_format)
    knobs = (t("temperature", (out_rows,), "f32", "input"), t("top_p", (out_rows,), "f32", "input"),
             t("top_k", (out_rows,), "i32", "input"), t("seed", (out_rows,), "i32", "input"))
    n("sample", "sample", ("logits", sample_pos, *knobs), (t("next_token", (out_rows,), "i32"),))
    return g.build(outputs=("next_token", "logits"))


def prefill_inputs(tokens: list[int], start: int, table, rows: int,
                   sampling: SamplingParams) -> dict[str, np.ndarray]:
    """A prefill chunk's graph inputs: `tokens` at positions start.. padded to `rows` (padding
    rows at position -1), the sequence's block table row."""
    n = len(tokens)
    tok = np.zeros(rows, np.int32)
    tok[:n] = tokens
    pos = np.full(rows, -1, np.int32)
    pos[:n] = np.arange(start, start + n, dtype=np.int32)
    return {"tokens": tok, "positions": pos, "block_table": np.array([table], np.int32),
            "start": np.array([start], np.int32), "chunk_len": np.array([n], np.int32),
            "last_index": np.array([n - 1], np.int32),
            "last_position": np.array([start + n - 1], np.int32), **_knobs([sampling])}


def decode_inputs(rows: list[DecodeRow], max_blocks: int) -> tuple[int, dict[str, np.ndarray]]:
    """A decode step's ladder size and graph inputs: one row per sequence, padded to the ladder
    with position -1 rows. Built once per step on the host, so its cost is paid by every step."""
    b = len(rows)
    size = decode_bucket(b)
    pad = size - b
    table = np.zeros((size, max_blocks), np.int32)   # padding rows: all zeros, never read
    for i, r in enumerate(rows):
        table[i] = r.table
    inputs = {
        "tokens": np.array([r.token for r in rows] + [0] * pad, np.int32),
        "positions": np.array([r.position for r in rows] + [-1] * pad, np.int32),
        "block_table": table,
        **_knobs([r.sampling for r in rows] + [GREEDY] * pad)}
    return size, inputs


def _knobs(params: list[SamplingParams]) -> dict[str, np.ndarray]:
    return {"temperature": np.array([p.temperature for p in params], np.float32),
            "top_p": np.array([p.top_p for p in params], np.float32),
            "top_k": np.array([p.top_k for p in params], np.int32),
            "seed": np.array([p.seed for p in params], np.int32)}


class PagedDecoderModel:
    """A loaded decoder whose sequences share one paged KV pool; the scheduler's StepRunner.

    Calls come from the model's engine thread under the model's request lock."""

    family = "decoder"

    def __init__(self, executor, cfg: ModelConfig, seed: int, *, block_tokens: int = 16,
                 pool_bytes: int = 0, max_batch_size: int = 64, capture: bool = True,
                 prefill_chunk: int | None = None,
                 weights: Callable[[], Iterator[tuple[str, np.ndarray]]] | None = None) -> None:
        self.executor, self.cfg, self.seed, self.capture = executor, cfg, seed, capture
        self.weights = weights
        self.geometry = KVGeometry(cfg.layers, cfg.kv_heads, cfg.head_dim, block_tokens,
                                   cfg.max_context)
        self.prefill_chunk = prefill_chunk_from_env() if prefill_chunk is None else prefill_chunk
        if self.prefill_chunk < 1:
            raise InvalidArgument(f"prefill chunk must be >= 1 token, got {self.prefill_chunk}")
        # capacity: the flag's bytes, or every sequence of a full batch at max_context
        full = max_batch_size * self.geometry.max_blocks
        self.capacity_blocks = (max(1, pool_bytes // self.geometry.block_bytes) if pool_bytes
                                else full)
        self.pool: KVBlockPool | None = None
        # One decode graph per ladder rung a batch can reach, bounded by the rungs, not by
        # --max-plans: otherwise a step's prefill chunk evicts the decode graph the next step
        # replays (gpu_worker/execution/plans.py, the plan-class bound).
        rungs = DECODE_LADDER.index(decode_bucket(min(max_batch_size, DECODE_LADDER[-1]))) + 1
        executor.plans.bound_class("paged_decode", rungs)

    # -- load ------------------------------------------------------------------------------------
    def load(self) -> None:
        source = self.weights() if self.weights is not None else generate(self.cfg, self.seed)
        for key, host in source:
            self.executor.add_weight(key, host)
        self.pool = KVBlockPool(self.executor.device.arena, self.geometry, self.capacity_blocks)
        self.executor.bind_state(POOL, self.pool.base)
        self.executor.ensure_resident()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def settle(self) -> None:
        """The engine went idle: wait for this model's stream (a stream sync, never a device-wide
        one) so the releases fenced on it (the pool's top granules, evicted plans) complete now,
        and an idle worker holds no pending release."""
        device = self.executor.device
        device.synchronize(device.stream)
        device.queue.drain()      # per-event waits (a release may be fenced on the copy stream)

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        check_prompt(self.cfg, prompt, max_new_tokens)

    # -- StepRunner --------------------------------------------------------------------------------
    def _graph(self, rows: int, phase: str) -> Callable[[], Graph]:
        return lambda: build_paged_graph(self.cfg, self.geometry, self.capacity_blocks, rows, phase)

    def _prefill_rows(self, n: int) -> int:
        return min(seq_bucket(n), max(self.prefill_chunk, n))

    def prefill(self, tokens: list[int], start: int, table: list[int],
                sampling: SamplingParams = GREEDY, sample: bool = True,
                output: str = "next_token") -> int | np.ndarray | None:
        rows = self._prefill_rows(len(tokens))
        out = self.executor.run(("paged_prefill", rows), self._graph(rows, "prefill"),
                                prefill_inputs(tokens, start, table, rows, sampling),
                                (output,) if sample else (), capture=self.capture)
        if not sample:
            return None
        return int(out[output][0]) if output == "next_token" else out[output][0]

    def decode(self, rows: list[DecodeRow]) -> list[int]:
        size, inputs = decode_inputs(rows, self.geometry.max_blocks)
        out = self.executor.run(("paged_decode", size), self._graph(size, "decode"), inputs,
                                ("next_token",), capture=self.capture)
        return [int(t) for t in out["next_token"][:len(rows)]]

    # -- single-sequence helpers (checkpoint goldens, CLI checks) ---------------------------------
    def logits(self, prompt: list[int]) -> np.ndarray:
        """Logits after the prompt's last position, through a temporary block table."""
        assert self.pool is not None, "load() first"
        blocks = self.pool.allocate(self.geometry.blocks_for(len(prompt)))
        if blocks is None:
            raise InvalidArgument("the KV pool cannot hold this prompt")
        table = blocks + [0] * (self.geometry.max_blocks - len(blocks))
        try:
            out = None
            for s in range(0, len(prompt), self.prefill_chunk):
                chunk = prompt[s:s + self.prefill_chunk]
                last = s + len(chunk) == len(prompt)
                out = self.prefill(chunk, s, table, GREEDY, sample=last, output="logits")
            return np.asarray(out)
        finally:
            self.pool.free(blocks)
