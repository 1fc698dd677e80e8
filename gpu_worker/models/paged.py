"""The decoder over the paged KV pool: batched decode graphs on a ladder and prefill chunks, each
ending in the `sample` op (i13 contract). The StepRunner of gpu_worker/scheduler.

Two graph shapes, both reading K/V only through block tables into the one `kv.pool` state tensor
(the model's KVBlockPool, bound at its fixed base address, so captured graphs stay valid as the
pool grows and shrinks):
- decode(B), B on DECODE_LADDER: row r is decode slot r of its group (64 slots), at
  `positions[r]`; its token and block table row are read from the slot state on the device and
  the sampled token is written back there in place, so step n's token feeds step n+1 without the
  host. Slots without a decoding sequence are padding rows (position -1: no KV written, their
  slot's token becomes -1, which the embedding reads as a zero row). The shapes do not depend on
  any context length, so each (B, group) is captured once and replayed.
- prefill(S): one chunk of one sequence (S = the chunk bucketed onto PREFILL_LADDER, at most the
  prefill chunk), positions start..start+n-1 (padding rows -1), attending causally to the
  sequence's earlier blocks; `last_index` picks the last real row for the sampler.
Sampling is per row on the device: greedy at temperature <= 0, else top-k/top-p with a
counter-based hash of (seed, position), so a row's token depends on nothing else in the batch.
A layer is the single-sequence decoder's fused layer (gpu_worker/models/decoder.py) with the
paged `qkv_rope_append_paged`: 10 nodes (int4) or 9 (fp16 weights) per layer, not 18.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from gpu_worker.config import DEFAULT_PREFILL_CHUNK
from gpu_worker.engines.scheduler.kv_pool import KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.runner import DecodeRow
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from gpu_worker.execution.layout import plan_layout
from gpu_worker.execution.plans import seq_bucket
from gpu_worker.execution.staging import StepStaging
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.decoder import check_prompt
from gpu_worker.models.graph import Graph, GraphBuilder
from gpu_worker.models.weights import fuse_linears, generate
from services.common.errors import InvalidArgument

# Fine above 16 so a batch pays for at most 7 padding rows (33 runs at 40, not 64), like the
# public engines' 8-apart graph sizes (research/SERVING.md); 11 graphs at --max-batch-size 64.
DECODE_LADDER = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
GROUP = DECODE_LADDER[-1]      # decode slots per group: one decode graph covers one group
# Prefill chunk buckets: powers of two to 256 rows, then every PREFILL_STEP rows. A chunk's
# linears compute every row of its bucket (cuBLAS's M is the graph's), so on powers of two a
# served chunk ran 35-40 % padding rows (bench/serving_model.py over serving_bench's traffic);
# 128 apart, 6-8 %. The buckets' graphs share one activation arena (class_arena.py), so more of
# them cost no activation memory.
PREFILL_STEP = 128
PREFILL_LADDER = (16, 32, 64, 128, 256) + tuple(range(384, 8192 + 1, PREFILL_STEP))
POOL = "kv.pool"
SLOT_TOKENS = "decode.slot_tokens"    # int32 [slots]: each slot's next input token, on the device
SLOT_TABLES = "decode.slot_tables"    # int32 [slots, max_blocks]: each slot's block table


def _group_tokens(g: int) -> str:
    return f"decode.tokens.{g}"


def _group_table(g: int) -> str:
    return f"decode.table.{g}"


def decode_bucket(b: int) -> int:
    """The smallest ladder size >= b (b <= 64)."""
    for size in DECODE_LADDER:
        if size >= b:
            return size
    raise ValueError(f"a decode batch has at most {DECODE_LADDER[-1]} rows, got {b}")


def build_paged_graph(cfg: ModelConfig, geo: KVGeometry, capacity_blocks: int, rows: int,
                      phase: str, group: int = 0) -> Graph:
    """`phase` "decode" (rows = batch size) or "prefill" (rows = chunk bucket, one sequence).

    A decode graph reads its tokens and block tables from the slot state of decode group
    `group` (rows = its first `rows` slots) and its `sample` writes the next tokens back there:
    the next step's graph reads them without the host (DESIGN 6.1)."""
    assert phase in ("prefill", "decode"), phase
    h, hd, kvd = cfg.hidden, cfg.head_dim, cfg.kv_heads * cfg.head_dim
    g = GraphBuilder()
    t, n, w = g.tensor, g.node, g.weight
    mb = geo.max_blocks

    def linear(name: str, x: str, out: str, out_dim: int, in_dim: int) -> None:
        g.linear(name, x, out, rows, out_dim, in_dim, cfg.weight_format)

    if phase == "decode":
        tokens = t(_group_tokens(group), (rows,), "i32", "state")
        table = t(_group_table(group), (rows, mb), "i32", "state")
    else:
        tokens = t("tokens", (rows,), "i32", "input")
        table = t("block_table", (1, mb), "i32", "input")
    positions = t("positions", (rows,), "i32", "input")   # -1: a padding row
    if phase == "prefill":
        start = t("start", (1,), "i32", "input")
        chunk_len = t("chunk_len", (1,), "i32", "input")
    pool = t(POOL, (capacity_blocks, cfg.layers, 2, geo.block_tokens, cfg.kv_heads, hd), "f16",
             kind="state")
    # the residual stream: one tensor, updated in place by the wo and w_down linears
    x = t("x", (rows, h))
    n("embed", "embedding", (tokens,), (x,), (w("embed", (cfg.vocab_size, h), "f16"),))
    rope = (w("rope.inv_freq", (hd // 2,), "f32"),) if cfg.rope_scaling is not None else ()
    paged = {"layers": cfg.layers, "kv_heads": cfg.kv_heads, "head_dim": hd,
             "block_tokens": geo.block_tokens, "max_blocks": mb}
    act = g.linear_input_dtype(rows, cfg.weight_format)   # what the linears read without a cast
    qkv_width = h + 2 * kvd
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        n(p + "attn_norm", "rmsnorm", (x,), (t(p + "h", (rows, h), act),),
          (w(p + "attn_norm.w", (h,), "f32"),), eps=cfg.eps)
        linear(p + "wqkv", p + "h", p + "qkv", qkv_width, h)   # rows: q | k | v
        # bias (Qwen2), rotary on q and k, K/V into the pool, q in fp16: one kernel
        bias = (w(p + "wqkv.b", (qkv_width,), "f32"),) if cfg.qkv_bias else ()
        q16 = t(p + "q16", (rows, h), "f16")
        n(p + "qkv_rope", "qkv_rope_append_paged", (p + "qkv", positions, table), (q16, pool),
          bias + rope, layer=layer, heads=cfg.heads, theta=cfg.rope_theta, bias=cfg.qkv_bias,
          **paged)
        a = t(p + "a", (rows, h), "f16")
        if phase == "decode":
            n(p + "attn", "flash_attention_decode_paged", (q16, pool, positions, table), (a,),
              layer=layer, heads=cfg.heads, **paged)
        else:
            n(p + "attn", "flash_attention_prefill_paged", (q16, pool, start, chunk_len, table),
              (a,), layer=layer, heads=cfg.heads, **paged)
        g.residual_linear(p + "wo", a, x, rows, h, h, cfg.weight_format, p + "res_attn")
        n(p + "mlp_norm", "rmsnorm", (x,), (t(p + "h2", (rows, h), act),),
          (w(p + "mlp_norm.w", (h,), "f32"),), eps=cfg.eps)
        linear(p + "w_gateup", p + "h2", p + "gu", 2 * cfg.ffn, h)   # rows: gate | up
        n(p + "silu_mul", "silu_mul", (p + "gu",), (t(p + "m", (rows, cfg.ffn), act),))
        g.residual_linear(p + "w_down", p + "m", x, rows, h, cfg.ffn, cfg.weight_format,
                          p + "res_mlp")
    out_rows, sample_pos = rows, positions
    if phase == "prefill":
        idx = t("last_index", (1,), "i32", "input")
        # no kernel: the executor points x.last at the chunk's last real row, the rest is eager
        n("last_row", "select_row", (x, idx), (t("x.last", (1, h)),))
        x, out_rows = "x.last", 1
        sample_pos = t("last_position", (1,), "i32", "input")
    n("final_norm", "rmsnorm", (x,), (t("hf", (out_rows, h), g.linear_input_dtype(
        out_rows, cfg.weight_format)),), (w("final_norm.w", (h,), "f32"),), eps=cfg.eps)
    g.linear("lm_head", "hf", "logits", out_rows, cfg.vocab_size, h, cfg.weight_format)
    knobs = (t("temperature", (out_rows,), "f32", "input"), t("top_p", (out_rows,), "f32", "input"),
             t("top_k", (out_rows,), "i32", "input"), t("seed", (out_rows,), "i32", "input"))
    if phase == "decode":   # in place: the embedding read these slots' tokens before
        n("sample", "sample", ("logits", sample_pos, *knobs), (tokens,))
        return g.build(outputs=("logits",))
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
    """Host-token decode inputs (rows padded to the ladder with position -1 rows, the tables
    copied per step): what bench/scheduler_host_bench.py's host-only runner measures. The model
    itself no longer builds these: its decode graphs read tokens and tables from the decode
    slots on the device (PagedDecoderModel.decode)."""
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


class StepHandle:
    """One launched step: its tokens come back through pinned memory after its end event."""

    def __init__(self, model: PagedDecoderModel, parity: int, slots: int, readback: np.ndarray) -> None:
        self._model, self._parity, self._slots, self._readback = model, parity, slots, readback
        self.device_s = 0.0           # the step's span on the stream (after `tokens`)
        self._tokens: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        """Each slot's token after the step (int32 [slots]); waits for the step's end event
        (an event wait, never a device-wide synchronize)."""
        if self._tokens is None:
            device = self._model.executor.device
            start, end = self._model._events[self._parity]
            device.wait_event(end)
            self._tokens = self._readback.view(np.int32)[:self._slots].copy()
            self.device_s = device.event_elapsed_s(start, end)
        return self._tokens


class PagedDecoderModel:
    """A loaded decoder whose sequences share one paged KV pool; the scheduler's StepRunner.

    Decode slots: a running sequence holds a slot s; row s of group s // 64's decode graphs is
    its row, its table row and its next input token live on the device at slot s (SLOT_TABLES,
    SLOT_TOKENS), and the decode graph's `sample` writes the next token there in place. So a
    step needs from the host only the positions, the sampling knobs and the table entries that
    changed, staged through pinned memory; its tokens come back through one pinned readback per
    step, read after the next step is launched (gpu_worker/engines/scheduler/scheduler.py).

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
        self.prefill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        if self.prefill_chunk < 1:
            raise InvalidArgument(f"prefill chunk must be >= 1 token, got {self.prefill_chunk}")
        # capacity: the flag's bytes, or every sequence of a full batch at max_context
        full = max_batch_size * self.geometry.max_blocks
        self.capacity_blocks = (max(1, pool_bytes // self.geometry.block_bytes) if pool_bytes
                                else full)
        self.pool: KVBlockPool | None = None
        self.slots = max(1, max_batch_size)
        self.groups = -(-self.slots // GROUP)
        # One decode graph per ladder rung a batch can reach (per decode group), bounded by the
        # rungs, not by --max-plans: otherwise a step's prefill chunk evicts the decode graph
        # the next step replays (gpu_worker/execution/plans.py, the plan-class bound).
        rungs = DECODE_LADDER.index(decode_bucket(min(self.slots, GROUP))) + 1
        executor.plans.bound_class("paged_decode", rungs * self.groups)
        # Likewise one prefill graph per chunk bucket a step can use (the ladder's rungs below
        # the chunk, and the chunk): under --max-plans (2) a serving worker's chunks of mixed
        # lengths evicted one another every few steps, each eviction a stream synchronize and
        # each return a capture (a py-spy profile of 64 streams on the H200).
        executor.plans.bound_class("paged_prefill", self.prefill_buckets())
        executor.arenas.share("paged_prefill", lambda: plan_layout(
            self._graph(self._prefill_rows(self.prefill_chunk), "prefill")()).nbytes)
        n = self.groups * GROUP
        self._temperature = np.zeros(n, np.float32)     # per-slot sampling knobs (host)
        self._top_p = np.ones(n, np.float32)
        self._top_k = np.zeros(n, np.int32)
        self._seed = np.zeros(n, np.int32)
        self._tables: dict[int, tuple[np.ndarray, int, int]] = {}   # slot -> (row, lo, hi) dirty
        self._tokens: dict[int, int] = {}                           # slot -> host-known token
        self._staging: StepStaging | None = None
        self._events: list[tuple[object, object]] = []
        self._parity = 0
        self._in_step = self._decoded = False

    # -- load ------------------------------------------------------------------------------------
    def load(self) -> None:
        source = self.weights() if self.weights is not None else generate(self.cfg, self.seed)
        for key, host in fuse_linears(self.cfg, source):   # wqkv and w_gateup, concatenated
            self.executor.add_weight(key, host)
        self.pool = KVBlockPool(self.executor.device.arena, self.geometry, self.capacity_blocks)
        self.executor.bind_state(POOL, self.pool.base)
        device = self.executor.device
        self._ensure_slots()
        self._staging = StepStaging(device)
        self._events = [(device.create_event(timing=True), device.create_event(timing=True))
                        for _ in range(2)]
        device.synchronize(device.stream)
        self.executor.ensure_resident()

    def _ensure_slots(self) -> None:
        """The slots' device state (tokens, block tables), made at load and again on the first
        step after `release_slots`. It lives with the plans that bake its addresses (zone
        activations), not in kv, so an idle decoder gives its whole kv zone back."""
        if self.executor.has_state(SLOT_TOKENS):
            return
        device, n, mb = self.executor.device, self.groups * GROUP, self.geometry.max_blocks
        self.executor.add_state(SLOT_TOKENS, n * 4, "activations")
        self.executor.add_state(SLOT_TABLES, n * mb * 4, "activations")
        tokens, tables = self.executor.state_ptr(SLOT_TOKENS), self.executor.state_ptr(SLOT_TABLES)
        device.memset(tokens, 0, n * 4)
        device.memset(tables, 0, n * mb * 4)        # unused entries name block 0, never read
        for g in range(self.groups):
            self.executor.bind_state(_group_tokens(g), tokens + g * GROUP * 4)
            self.executor.bind_state(_group_table(g), tables + g * GROUP * mb * 4)

    def release_slots(self) -> int:
        """An idle decoder's caches go (the reclaim order's idle plans): its slot state too, once
        every plan that baked its addresses is evicted. The caller holds the model lock and no
        sequence holds a slot. Returns the bytes released."""
        assert not self._in_step, "release_slots() inside a step"
        if not self.executor.has_state(SLOT_TOKENS) or self.executor.plans.keys():
            return 0
        return self.executor.drop_state(SLOT_TOKENS) + self.executor.drop_state(SLOT_TABLES)

    def close(self) -> None:
        device = self.executor.device
        if self._staging is not None:
            device.synchronize(device.stream)
            self._staging.close()
            self._staging = None
        for pair in self._events:
            for event in pair:
                device.destroy_event(event)
        self._events = []
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
    def _graph(self, rows: int, phase: str, group: int = 0) -> Callable[[], Graph]:
        return lambda: build_paged_graph(self.cfg, self.geometry, self.capacity_blocks, rows, phase,
                                         group)

    def _prefill_rows(self, n: int) -> int:
        return min(seq_bucket(n, PREFILL_LADDER), max(self.prefill_chunk, n))

    def prefill_buckets(self) -> int:
        """Distinct row counts of the prefill graphs a chunk of 1..prefill_chunk tokens uses."""
        return sum(1 for r in PREFILL_LADDER if r < self.prefill_chunk) + 1

    def assign(self, slot: int, sampling: SamplingParams) -> None:
        """`slot` now holds a sequence sampled with `sampling` (its knobs for every decode)."""
        self._temperature[slot], self._top_p[slot] = sampling.temperature, sampling.top_p
        self._top_k[slot], self._seed[slot] = sampling.top_k, sampling.seed

    def write_table(self, slot: int, row: np.ndarray, lo: int, hi: int) -> None:
        """Entries [lo, hi) of `slot`'s table row changed (to row[lo:hi]); staged with the next
        decode. Only what changed goes up: a step's host work does not grow with context."""
        if hi <= lo:
            return
        prev = self._tables.get(slot)
        if prev is not None:
            lo, hi = min(lo, prev[1]), max(hi, prev[2])
        self._tables[slot] = (row, lo, hi)

    def set_token(self, slot: int, token: int) -> None:
        """`slot`'s next input is `token`, known on the host (a preempted sequence resuming)."""
        self._tokens[slot] = int(token)

    def move_slot(self, src: int, dst: int) -> None:
        """Slot `src`'s sequence moves to the free slot `dst` (the scheduler keeps its running
        sequences on the lowest slots, so a decode's rung covers few padding rows): its token
        and table row are copied on the device, behind the steps already queued (the token the
        last of them sampled comes along), its knobs and pending host writes re-keyed. Two
        device-to-device copies; inside a step, before its decode."""
        assert self._in_step and not self._decoded, "move_slot() inside a step, before decode()"
        device, mb = self.executor.device, self.geometry.max_blocks
        tokens, tables = self.executor.state_ptr(SLOT_TOKENS), self.executor.state_ptr(SLOT_TABLES)
        device.copy_device_async(tokens + dst * 4, tokens + src * 4, 4)
        device.copy_device_async(tables + dst * mb * 4, tables + src * mb * 4, mb * 4)
        for knob in (self._temperature, self._top_p, self._top_k, self._seed):
            knob[dst] = knob[src]
        for pending in (self._tables, self._tokens):
            if src in pending:
                pending[dst] = pending.pop(src)

    def begin_step(self) -> None:
        assert self._staging is not None, "load() first"
        assert not self._in_step, "begin_step() twice"
        self._ensure_slots()
        self._staging.begin(self._parity)
        self.executor.device.record_event(self._events[self._parity][0])
        self._in_step, self._decoded = True, False

    def _flush_tables(self) -> None:
        if not self._tables:
            return
        device, mb = self.executor.device, self.geometry.max_blocks
        base = self.executor.state_ptr(SLOT_TABLES)
        for slot, (row, lo, hi) in self._tables.items():
            region = self._staging.take((hi - lo) * 4)
            region.view(np.int32)[:] = row[lo:hi]
            device.copy_to_device_async(base + (slot * mb + lo) * 4, region)
        self._tables.clear()

    def decode(self, rows: list[tuple[int, int]]) -> int:
        """Enqueue one decode of the slots in `rows` ((slot, position) pairs): per group, the
        smallest rung covering its highest slot; other slots of the rung are padding rows. Runs
        before the step's prefills: a padding row's sample writes -1 to its slot, and a prefill
        finishing in this step writes its slot's first token after it. Returns the graph rows
        run (the rungs' sum)."""
        assert self._in_step and not self._decoded, "decode() once per step, before prefills"
        self._decoded = True
        self._flush_tables()
        by_group: dict[int, list[tuple[int, int]]] = {}
        for slot, position in rows:
            by_group.setdefault(slot // GROUP, []).append((slot - slot // GROUP * GROUP, position))
        take = self._staging.take
        graph_rows = 0
        for g, local in sorted(by_group.items()):
            size = decode_bucket(max(s for s, _ in local) + 1)
            pos = np.full(size, -1, np.int32)
            idx, at = zip(*local)
            pos[list(idx)] = at
            lo = g * GROUP
            inputs = {"positions": pos, "temperature": self._temperature[lo:lo + size],
                      "top_p": self._top_p[lo:lo + size], "top_k": self._top_k[lo:lo + size],
                      "seed": self._seed[lo:lo + size]}
            key = ("paged_decode", size) if g == 0 else ("paged_decode", size, g)
            self.executor.launch(key, self._graph(size, "decode", g), inputs, take,
                                 capture=self.capture)
            graph_rows += size
        return graph_rows

    def prefill(self, slot: int, tokens: list[int], start: int, table: np.ndarray,
                sampling: SamplingParams = GREEDY, sample: bool = True) -> int:
        """Enqueue one chunk of `slot`'s sequence; when `sample`, the token sampled after its
        last position becomes the slot's next input on the device (and comes back with the
        step's readback). Returns the chunk's graph rows (its PREFILL_LADDER bucket)."""
        assert self._in_step, "prefill() inside a step"
        self._decoded = True      # a decode after a prefill would overwrite its sampled token
        rows = self._prefill_rows(len(tokens))
        device = self.executor.device
        dst = self.executor.state_ptr(SLOT_TOKENS) + slot * 4

        def keep_token(plan) -> None:
            device.copy_device_async(dst, plan.ptr("next_token"), 4)
        self.executor.launch(("paged_prefill", rows), self._graph(rows, "prefill"),
                             prefill_inputs(tokens, start, table, rows, sampling),
                             self._staging.take, capture=self.capture,
                             after=keep_token if sample else None)
        return rows

    def end_step(self) -> StepHandle:
        """Enqueue the host-known tokens, the readback of every slot's token and the step's end
        event; returns the handle to read them (after the next step is launched, to overlap)."""
        assert self._in_step, "end_step() without begin_step()"
        device, staging = self.executor.device, self._staging
        self._flush_tables()
        base = self.executor.state_ptr(SLOT_TOKENS)
        for slot, token in self._tokens.items():
            region = staging.take(4)
            region.view(np.int32)[0] = token
            device.copy_to_device_async(base + slot * 4, region)
        self._tokens.clear()
        readback = staging.take(self.slots * 4)
        device.copy_from_device_async(readback, base)
        end = self._events[self._parity][1]
        device.record_event(end)
        staging.end(end)
        handle = StepHandle(self, self._parity, self.slots, readback)
        self._parity ^= 1
        self._in_step = False
        return handle

    def _prefill_sync(self, tokens: list[int], start: int, table, output: str | None) -> np.ndarray | None:
        """One chunk run to completion, its `output` (if any) read back (the single-sequence
        helpers)."""
        rows = self._prefill_rows(len(tokens))
        out = self.executor.run(("paged_prefill", rows), self._graph(rows, "prefill"),
                                prefill_inputs(tokens, start, table, rows, GREEDY),
                                (output,) if output else (), capture=self.capture)
        return out[output][0] if output else None

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
                out = self._prefill_sync(chunk, s, table, "logits" if last else None)
            return np.asarray(out)
        finally:
            self.pool.free(blocks)
