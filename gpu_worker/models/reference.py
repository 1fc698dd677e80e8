"""NumPy reference forwards for the two model families: the correctness oracle for the executor.

float32 throughout, except that every int4 linear rounds x and its dequantized W to fp16 and
accumulates in f32, as every int4 kernel does (kernels.reference.int4_matmul), the decoder's KV
cache holds K and V rounded to fp16, and at head_dim 64 or 128 (the tensor-core attention of the decoder) q and the
attention output are rounded to fp16 too (`fp16=False` turns all of it off). With fp16 weights
(`weight_format: fp16`) every linear, 1 row included, is cuBLAS's: x rounded to fp16, W as stored,
f32 accumulation; `fp16=False` then multiplies the f32 x by the fp16 weights. The
operations are spelled out one function each so a kernel's NumPy reference and this model agree
on conventions: rotary pairs (i, i + d/2) ("rotate half"), GQA head h reads KV head
h // (heads // kv_heads), softmax scale 1/sqrt(head_dim), tanh-approximated GELU, post-LN encoder.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.kernels.flash_attention import HEAD_DIMS as FLASH_HEAD_DIMS
from gpu_worker.kernels.reference import matmul_nt
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.weights import dequantize


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rope_tables(positions: np.ndarray, head_dim: int, theta: float,
                inv_freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    # float64 angles, as the rotary kernel forms them (gpu_worker/kernels/rotary.py).
    inv = np.float64(theta) ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    if inv_freq is not None:  # llama3 scaling: the model's f32 table, as the kernel reads it
        inv = np.asarray(inv_freq, np.float32).astype(np.float64)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, theta: float,
         inv_freq: np.ndarray | None = None) -> np.ndarray:
    """x: (seq, heads, head_dim) rotated at `positions` (seq,)."""
    half = x.shape[-1] // 2
    cos, sin = rope_tables(positions, x.shape[-1], theta, inv_freq)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def f16(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16 (nearest even), back in f32."""
    return x.astype(np.float16).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu(x: np.ndarray, exact: bool = False) -> np.ndarray:
    if exact:  # the erf form of BERT checkpoints
        from math import erf
        return 0.5 * x * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / np.sqrt(2.0)))
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, causal: bool) -> np.ndarray:
    """q (s, H, d), k/v (t, KV, d); key j is visible to query i when j <= q_pos[i] (causal)."""
    _, heads, d = q.shape
    group = heads // k.shape[1]
    kk = np.repeat(k, group, axis=1)  # (t, H, d)
    vv = np.repeat(v, group, axis=1)
    scores = np.einsum("shd,thd->hst", q, kk) / np.float32(np.sqrt(d))
    if causal:
        mask = np.arange(k.shape[0])[None, :] > q_pos[:, None]
        scores = np.where(mask[None], np.float32(-np.inf), scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hst,thd->shd", p, vv).astype(np.float32)


class Linears(dict):
    """Dequantized (or fp16) weights by key, in f32; `mm(x, key, rows)` multiplies as the
    executor does: fp16 operands and f32 sums at every row count (`rows` does not change the
    numerics: a row's result is independent of its batch)."""

    def __init__(self, weights: dict[str, np.ndarray], fp16: bool = True,
                 weight_format: str = "int4") -> None:
        super().__init__(weights)
        self.fp16 = fp16        # False: f32 everywhere (the math's own invariants, no rounding)
        self.weight_format = weight_format
        self._f16: dict[str, np.ndarray] = {}

    def mm(self, x: np.ndarray, key: str, rows: int) -> np.ndarray:
        del rows
        if not self.fp16:
            return matmul_nt(x, self[key])
        if self.weight_format == "fp16":   # W is fp16 already: round x only
            return matmul_nt(f16(x), self[key])
        if key not in self._f16:
            self._f16[key] = self[key].astype(np.float16).astype(np.float32)
        return matmul_nt(f16(x), self._f16[key])


def _linears(cfg: ModelConfig, w: dict[str, np.ndarray], fp16: bool) -> Linears:
    def weight(key: str) -> np.ndarray:
        if cfg.weight_format == "fp16":
            return w[key + ".h"].astype(np.float32)
        return dequantize(w[key + ".q"], w[key + ".s"])
    keys = [f"layers.{layer}.{lin}" for layer in range(cfg.layers) for lin in cfg.linear_shapes()]
    keys += ["lm_head"] if cfg.family == "decoder" else []
    return Linears({key: weight(key) for key in keys}, fp16, cfg.weight_format)


class DecoderReference:
    """Llama-style decoder with a KV cache: prefill any prompt, then decode greedily."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], fp16: bool = True) -> None:
        """`fp16=False`: every linear in f32 (not what the executor computes above 16 rows)."""
        self.cfg, self.w, self.lin = cfg, weights, _linears(cfg, weights, fp16)
        # the tensor-core attention reads q in fp16 and writes fp16 (decoder.uses_flash_attention)
        self.fp16_attention = fp16 and cfg.head_dim in FLASH_HEAD_DIMS
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        """Run `tokens` at positions start.. appending to the KV cache; logits (len, vocab)."""
        cfg, w, lin = self.cfg, self.w, self.lin
        if start == 0:
            self.k = [np.zeros((0, cfg.kv_heads, cfg.head_dim), np.float32)] * cfg.layers
            self.v = list(self.k)
        pos = np.arange(start, start + len(tokens))
        rows = len(tokens)   # the executor's graph has at least as many (padding): same path

        def mm(x: np.ndarray, key: str) -> np.ndarray:
            return lin.mm(x, key, rows)

        flash = self.fp16_attention
        x = w["embed"][np.asarray(tokens)].astype(np.float32)
        for layer in range(cfg.layers):
            p = f"layers.{layer}."
            h = rmsnorm(x, w[p + "attn_norm.w"], cfg.eps)
            q = mm(h, p + "wq").reshape(len(tokens), cfg.heads, cfg.head_dim)
            k = mm(h, p + "wk").reshape(len(tokens), cfg.kv_heads, cfg.head_dim)
            v = mm(h, p + "wv").reshape(len(tokens), cfg.kv_heads, cfg.head_dim)
            if cfg.qkv_bias:
                q = q + w[p + "wq.b"].reshape(cfg.heads, cfg.head_dim)
                k = k + w[p + "wk.b"].reshape(cfg.kv_heads, cfg.head_dim)
                v = v + w[p + "wv.b"].reshape(cfg.kv_heads, cfg.head_dim)
            table = w.get("rope.inv_freq")
            q, k = rope(q, pos, cfg.rope_theta, table), rope(k, pos, cfg.rope_theta, table)
            if self.lin.fp16:   # the cache holds fp16: what attention reads back is rounded
                k, v = f16(k), f16(v)
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])
            if flash:
                q = f16(q)
            a = attention(q, self.k[layer], self.v[layer], pos, causal=True)
            if flash:
                a = f16(a)
            x = x + mm(a.reshape(len(tokens), cfg.hidden), p + "wo")
            h = rmsnorm(x, w[p + "mlp_norm.w"], cfg.eps)
            m = silu(mm(h, p + "w_gate")) * mm(h, p + "w_up")
            x = x + mm(m, p + "w_down")
        x = rmsnorm(x, w["final_norm.w"], cfg.eps)
        return lin.mm(x, "lm_head", 1).astype(np.float32)   # the graph's lm_head has 1 row

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        logits = self.forward(prompt, 0)[-1]
        out: list[int] = []
        pos = len(prompt)
        for _ in range(max_new_tokens):
            tok = int(np.argmax(logits))
            out.append(tok)
            if len(out) == max_new_tokens:
                break
            logits = self.forward([tok], pos)[-1]
            pos += 1
        return out


class EncoderReference:
    """BERT-style post-LN encoder; mean-pooled embeddings (batch, hidden)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], fp16: bool = True) -> None:
        self.cfg, self.w, self.lin = cfg, weights, _linears(cfg, weights, fp16)
        # the tensor-core attention reads q in fp16 and writes fp16 (decoder.uses_flash_attention)
        self.fp16_attention = fp16 and cfg.head_dim in FLASH_HEAD_DIMS

    def embed(self, sequences, rows: int | None = None) -> np.ndarray:
        """One embedding per sequence, each computed alone (lengths may differ). `rows`: the
        executor graph's row count, which picks its linear path (default batch * longest: an
        exact-shape plan; a padded batch has more)."""
        cfg, w, lin = self.cfg, self.w, self.lin
        seqs = [np.asarray(s) for s in sequences]
        out = np.empty((len(seqs), cfg.hidden), np.float32)
        if rows is None:   # the encoder graph runs the whole batch at once
            rows = len(seqs) * max((len(s) for s in seqs), default=0)

        def mm(x: np.ndarray, key: str) -> np.ndarray:
            return lin.mm(x, key, rows)

        for b, toks in enumerate(seqs):
            pos = np.arange(len(toks))
            x = w["embed"][toks].astype(np.float32) + w["pos_embed"][pos].astype(np.float32)
            x = layernorm(x, w["embed_norm.w"], w["embed_norm.b"], cfg.eps)
            for layer in range(cfg.layers):
                p = f"layers.{layer}."

                def f(name: str, h: np.ndarray, p: str = p) -> np.ndarray:
                    y = mm(h, p + name)
                    return y + w[p + name + ".b"] if cfg.linear_bias else y
                shp = (len(toks), cfg.heads, cfg.head_dim)
                q, k, v = f("wq", x).reshape(shp), f("wk", x).reshape(shp), f("wv", x).reshape(shp)
                a = attention(q, k, v, pos, causal=False).reshape(len(toks), cfg.hidden)
                x = layernorm(x + f("wo", a), w[p + "attn_norm.w"], w[p + "attn_norm.b"], cfg.eps)
                m = f("w_down", gelu(f("w_up", x), cfg.gelu_exact))
                x = layernorm(x + m, w[p + "mlp_norm.w"], w[p + "mlp_norm.b"], cfg.eps)
            out[b] = x.mean(axis=0)
        return out
