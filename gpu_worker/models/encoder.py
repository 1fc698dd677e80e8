"""The BERT-style encoder as a graph: token + position embeddings, post-LN layers with
bidirectional attention and a GELU MLP, mean pooling over the sequence -> (batch, hidden).

Sequences of different lengths run as one batch padded to (batch, seq): the graph's `lengths`
input (batch,) i32 holds each row's real length, the attention of every query of row b sees only
keys [0, lengths[b]) and mean pooling averages only its first lengths[b] positions, so padding
changes no real row's result (padded positions compute finite values nobody reads; a padded
batch row has length 0 and pools to zeros). Both masks read `lengths` from device memory, so one
captured plan serves every mix of lengths up to its shape.

Shapes: `bucketed` (what the worker runs) pads the batch to a power of two and the sequence to
the plan ladder (at least ENCODER_MIN_SEQ, so every graph has more than FUSED_MAX_ROWS rows and
every linear takes the tensor-core path: a sequence's numerics do not depend on what shares its
batch); unbucketed, a plan is exact in (batch, longest sequence), the traffic of DESIGN 1.1.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from gpu_worker.execution.plans import seq_bucket
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.graph import Graph, GraphBuilder
from gpu_worker.models.weights import generate
from services.common.errors import InvalidArgument

ENCODER_MIN_SEQ = 32
# A bucketed plan has more rows than the int4 linear's fused crossover (linear.int4_path: up to
# 64 rows read f32 x with the packed weight, more run on tensor cores in fp16), so every bucketed
# shape takes the tensor-core path and padding changes no real row's rounding. A short lone
# request pads to a few more rows (batch 4 x 32 tokens): one launch-bound plan either way.
ENCODER_MIN_ROWS = 128


def batch_bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1): the batch ladder of bucketed plans."""
    if n < 1:
        raise ValueError(f"batch must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def padded_shape(lengths: list[int], max_context: int, bucketed: bool = True) -> tuple[int, int]:
    """(batch, seq) of the plan that runs sequences of these lengths as one batch."""
    longest = max(lengths)
    if not bucketed:
        return len(lengths), longest
    seq = min(seq_bucket(max(longest, ENCODER_MIN_SEQ)), max_context)
    return max(batch_bucket(len(lengths)), batch_bucket(-(-ENCODER_MIN_ROWS // seq))), seq


def build_encoder_graph(cfg: ModelConfig, batch: int, seq: int) -> Graph:
    h, rows = cfg.hidden, batch * seq
    g = GraphBuilder()
    t, n, w = g.tensor, g.node, g.weight

    def linear(name: str, x: str, out: str, out_dim: int, in_dim: int) -> None:
        g.linear(name, x, out, rows, out_dim, in_dim, cfg.weight_format)
        if cfg.linear_bias:  # BERT checkpoints: added in place
            n(name + "_bias", "bias_add", (out,), (out,), (w(name + ".b", (out_dim,), "f32"),))

    def layernorm(name: str, x: str, out: str, wname: str) -> None:
        n(name, "layernorm", (x,), (t(out, (rows, h)),),
          (w(wname + ".w", (h,), "f32"), w(wname + ".b", (h,), "f32")), eps=cfg.eps)

    tokens = t("tokens", (rows,), "i32", "input")
    positions = t("positions", (rows,), "i32", "input")
    lengths = t("lengths", (batch,), "i32", "input")   # real tokens per row: the padding mask
    n("embed", "embedding", (tokens,), (t("e.tok", (rows, h)),), (w("embed", (cfg.vocab_size, h), "f16"),))
    n("pos_embed", "embedding", (positions,), (t("e.pos", (rows, h)),),
      (w("pos_embed", (cfg.max_context, h), "f16"),))
    n("embed_add", "add", ("e.tok", "e.pos"), (t("e.sum", (rows, h)),))
    layernorm("embed_norm", "e.sum", "x.0", "embed_norm")
    x = "x.0"
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        linear(p + "wq", x, p + "q", h, h)
        linear(p + "wk", x, p + "k", h, h)
        linear(p + "wv", x, p + "v", h, h)
        n(p + "attn", "attention_bidirectional", (p + "q", p + "k", p + "v", lengths),
          (t(p + "a", (rows, h)),),
          batch=batch, seq=seq, heads=cfg.heads, head_dim=cfg.head_dim)
        linear(p + "wo", p + "a", p + "o", h, h)
        n(p + "res_attn", "add", (x, p + "o"), (t(p + "r1", (rows, h)),))
        layernorm(p + "attn_norm", p + "r1", p + "x1", p + "attn_norm")
        linear(p + "w_up", p + "x1", p + "u", cfg.ffn, h)
        n(p + "gelu", "gelu", (p + "u",), (t(p + "g", (rows, cfg.ffn)),), exact=cfg.gelu_exact)
        linear(p + "w_down", p + "g", p + "d", h, cfg.ffn)
        n(p + "res_mlp", "add", (p + "x1", p + "d"), (t(p + "r2", (rows, h)),))
        x_next = f"x.{layer + 1}"
        layernorm(p + "mlp_norm", p + "r2", x_next, p + "mlp_norm")
        x = x_next
    n("pool", "mean_pool", (x, lengths), (t("pooled", (batch, h)),), batch=batch, seq=seq)
    return g.build(outputs=("pooled",))


class EncoderModel:
    """A loaded encoder: one plan per (batch, seq) shape, bounded by the plan LRU; `bucketed`
    puts the shapes on a ladder (see the module doc)."""

    family = "encoder"

    def __init__(self, executor, cfg: ModelConfig, seed: int, capture: bool = True,
                 weights: Callable[[], Iterator[tuple[str, np.ndarray]]] | None = None,
                 normalize: bool = False, bucketed: bool = False) -> None:
        self.executor, self.cfg, self.seed, self.capture = executor, cfg, seed, capture
        self.bucketed = bucketed
        # a checkpoint's streaming loader (gpu_worker/checkpoints); None: weights from the seed
        self.weights = weights
        self.normalize = normalize  # sentence-transformers' Normalize module: unit-length output

    def load(self) -> None:
        source = self.weights() if self.weights is not None else generate(self.cfg, self.seed)
        for key, host in source:
            self.executor.add_weight(key, host)
        self.executor.ensure_resident()

    def check(self, sequences: list[list[int]]) -> None:
        """INVALID_ARGUMENT for a request the encoder cannot run; lengths may differ."""
        if not sequences:
            raise InvalidArgument("send at least one non-empty token sequence")
        for i, s in enumerate(sequences):
            if not s:
                raise InvalidArgument(f"sequence {i} is empty: send at least one token",
                                      sequence=i)
            if len(s) > self.cfg.max_context:
                raise InvalidArgument(f"{len(s)} tokens exceed the context of "
                                      f"{self.cfg.max_context}", sequence=i)
        for s in sequences:
            bad = [t for t in s if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise InvalidArgument(f"token {bad[0]} is outside the vocabulary "
                                      f"(0..{self.cfg.vocab_size - 1})", token=int(bad[0]))

    def embed(self, sequences: list[list[int]]) -> np.ndarray:
        """(len(sequences), hidden) float32 mean-pooled embeddings, one batch padded to one plan
        shape; each row is what that sequence gets alone."""
        self.check(sequences)
        lengths = [len(s) for s in sequences]
        batch, seq = padded_shape(lengths, self.cfg.max_context, self.bucketed)
        tokens = np.zeros((batch, seq), np.int32)   # token 0 in the padding: in every vocabulary
        for i, s in enumerate(sequences):
            tokens[i, :len(s)] = s
        positions = np.tile(np.arange(seq, dtype=np.int32), batch)
        lens = np.zeros(batch, np.int32)
        lens[:len(lengths)] = lengths
        out = self.executor.run(
            ("encode", batch, seq), lambda: build_encoder_graph(self.cfg, batch, seq),
            {"tokens": tokens.reshape(-1), "positions": positions, "lengths": lens}, ("pooled",),
            capture=self.capture)
        pooled = out["pooled"][:len(sequences)]
        if self.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled
