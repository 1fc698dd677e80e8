"""The BERT-style encoder as a graph: token + position embeddings, post-LN layers with
bidirectional attention and a GELU MLP, mean pooling over the sequence -> (batch, hidden).

Sequences in one call share a length (the Embed RPC's contract), so a plan is exact in
(batch, seq); there is no padding and no mask.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from gpu_worker.graph import Graph, GraphBuilder
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.weights import generate
from services.common.errors import InvalidArgument


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
        n(p + "attn", "attention_bidirectional", (p + "q", p + "k", p + "v"), (t(p + "a", (rows, h)),),
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
    n("pool", "mean_pool", (x,), (t("pooled", (batch, h)),), batch=batch, seq=seq)
    return g.build(outputs=("pooled",))


class EncoderModel:
    """A loaded encoder: one plan per exact (batch, seq), bounded by the plan LRU."""

    family = "encoder"

    def __init__(self, executor, cfg: ModelConfig, seed: int, capture: bool = True,
                 weights: Callable[[], Iterator[tuple[str, np.ndarray]]] | None = None,
                 normalize: bool = False) -> None:
        self.executor, self.cfg, self.seed, self.capture = executor, cfg, seed, capture
        # a checkpoint's streaming loader (gpu_worker/checkpoints); None: weights from the seed
        self.weights = weights
        self.normalize = normalize  # sentence-transformers' Normalize module: unit-length output

    def load(self) -> None:
        source = self.weights() if self.weights is not None else generate(self.cfg, self.seed)
        for key, host in source:
            self.executor.add_weight(key, host)
        self.executor.ensure_resident()

    def check(self, sequences: list[list[int]]) -> None:
        if not sequences or not sequences[0]:
            raise InvalidArgument("send at least one non-empty token sequence")
        if len({len(s) for s in sequences}) != 1:
            raise InvalidArgument("sequences have different lengths: pad them to one length")
        if len(sequences[0]) > self.cfg.max_context:
            raise InvalidArgument(f"{len(sequences[0])} tokens exceed the context of "
                                  f"{self.cfg.max_context}")
        for s in sequences:
            bad = [t for t in s if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise InvalidArgument(f"token {bad[0]} is outside the vocabulary "
                                      f"(0..{self.cfg.vocab_size - 1})", token=int(bad[0]))

    def embed(self, sequences: list[list[int]]) -> np.ndarray:
        """(batch, hidden) float32 mean-pooled embeddings."""
        self.check(sequences)
        batch, seq = len(sequences), len(sequences[0])
        tokens = np.asarray(sequences, np.int32).reshape(-1)
        positions = np.tile(np.arange(seq, dtype=np.int32), batch)
        out = self.executor.run(
            ("encode", batch, seq), lambda: build_encoder_graph(self.cfg, batch, seq),
            {"tokens": tokens, "positions": positions}, ("pooled",), capture=self.capture)
        pooled = out["pooled"]
        if self.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled
