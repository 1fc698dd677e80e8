"""The Llama-style decoder as a graph: RMSNorm, rotary, GQA with a KV cache, SiLU-gated MLP.

Two graph shapes per model:
- prefill(S), run as chunked prefill: a prompt of L <= C tokens (C = the prefill chunk,
  `--prefill-chunk`, default 2048) runs once at S = L bucketed onto the plan ladder; a longer
  prompt runs in ceil(L / C) chunks of S = C against the KV cache, the last one padded. Each chunk
  appends its keys to the cache at `start` and attends to the cache rows [0, start + t] of its
  token t (no more than `chunk_len` real rows: padding never reaches a real position), and
  `last_index` picks row L-1 of the last chunk. So every prompt length uses one of a handful of
  plan shapes (the ladder up to C), no prompt pads by more than one chunk (5502 tokens run as
  3 x 2048 instead of 8192), and activation memory is bounded by the chunk, not the prompt;
- decode: one token whose position is read from device memory (`start`), so the captured
  graph does not depend on the KV length and replays for every step.
The KV cache is fp16 (KV_DTYPE): half the bytes per token of context of the f32 activations.
Attention at head_dim 64 or 128 (every config but `tiny`) runs the tensor-core kernels of
gpu_worker.kernels.flash_attention: FlashAttention-style prefill per chunk, split-K decode; q
comes in fp16 and the output stays fp16 (the prefill wo linear's tensor-core operand as it is;
widened to f32 for decode's fused GEMV). Other head dims keep the f32-q `_kv16` kernels.
Both end in greedy argmax, so a step returns one int32 to the host.
A layer is few nodes (docs/kernels.md "Fewer nodes per step"): q/k/v and gate/up are one
linear each (weights concatenated at load: weights.fuse_linears), one `qkv_rope_append` kernel
adds the biases, rotates q and k, appends K/V and writes q in attention's dtype, the norms and
SiLU write the dtype the next linear reads, and the residual stream `x` is one tensor updated
in place (GraphBuilder.residual_linear: in the linear's epilogue, or in the next norm).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from gpu_worker.config import DEFAULT_PREFILL_CHUNK
from gpu_worker.execution.plans import seq_bucket
from gpu_worker.kernels.flash_attention import HEAD_DIMS as FLASH_HEAD_DIMS
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.graph import DTYPE_BYTES, Graph, GraphBuilder
from gpu_worker.models.weights import fuse_linears, generate
from services.common.errors import InvalidArgument

KV_DTYPE = "f16"    # the KV cache: fp16 (attention reads it into f32 arithmetic)


def uses_flash_attention(cfg: ModelConfig) -> bool:
    """Whether the decoder's attention runs the fp16 tensor-core kernels (head_dim 64 or 128)
    or, for other head dims (the `tiny` config's 16), the f32-q kernels over the fp16 cache."""
    return cfg.head_dim in FLASH_HEAD_DIMS


def kv_state_names(layer: int) -> tuple[str, str]:
    return f"kv.{layer}.k", f"kv.{layer}.v"


def build_decoder_graph(cfg: ModelConfig, seq: int, phase: str) -> Graph:
    """`phase` "prefill" (seq = bucket) or "decode" (seq must be 1)."""
    assert phase in ("prefill", "decode"), phase
    assert phase == "prefill" or seq == 1, "decode runs one token"
    h, hd, kvd = cfg.hidden, cfg.head_dim, cfg.kv_heads * cfg.head_dim
    flash = uses_flash_attention(cfg)
    g = GraphBuilder()
    t, n, w = g.tensor, g.node, g.weight

    def linear(name: str, x: str, out: str, out_dim: int, in_dim: int) -> None:
        g.linear(name, x, out, seq, out_dim, in_dim, cfg.weight_format)

    tokens = t("tokens", (seq,), "i32", "input")
    start = t("start", (1,), "i32", "input")    # position of the first token, read on device
    if phase == "prefill":
        chunk_len = t("chunk_len", (1,), "i32", "input")   # real (unpadded) tokens in this chunk
    # the residual stream: one tensor, updated in place by the wo and w_down linears
    x = t("x", (seq, h))
    n("embed", "embedding", (tokens,), (x,), (w("embed", (cfg.vocab_size, h), "f16"),))
    # llama3 rope scaling: the rescaled frequency table replaces theta's formula
    rope = (w("rope.inv_freq", (hd // 2,), "f32"),) if cfg.rope_scaling is not None else ()
    act = g.linear_input_dtype(seq, cfg.weight_format)   # what the linears read without a cast
    qkv_width = h + 2 * kvd
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        kc, vc = kv_state_names(layer)
        t(kc, (cfg.max_context, cfg.kv_heads, hd), KV_DTYPE, kind="state")
        t(vc, (cfg.max_context, cfg.kv_heads, hd), KV_DTYPE, kind="state")
        n(p + "attn_norm", "rmsnorm", (x,), (t(p + "h", (seq, h), act),),
          (w(p + "attn_norm.w", (h,), "f32"),), eps=cfg.eps)
        linear(p + "wqkv", p + "h", p + "qkv", qkv_width, h)   # rows: q | k | v
        # bias (Qwen2), rotary on q and k, K/V into the cache at `start`, q in the dtype the
        # attention reads (fp16 for the flash kernels): one kernel
        bias = (w(p + "wqkv.b", (qkv_width,), "f32"),) if cfg.qkv_bias else ()
        q = t(p + "q", (seq, h), "f16" if flash else "f32")
        n(p + "qkv_rope", "qkv_rope_append", (p + "qkv", start), (q, kc, vc), bias + rope,
          heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=hd, theta=cfg.rope_theta,
          max_context=cfg.max_context, bias=cfg.qkv_bias)
        attrs = {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": hd,
                 "max_context": cfg.max_context}
        # flash: fp16 out, which the wo linear reads as it is (every linear reads fp16 x)
        a = t(p + "a", (seq, h), "f16" if flash else "f32")
        if phase == "prefill":
            # against the cache: earlier chunks' keys are there, this chunk's were just appended
            n(p + "attn", ("flash_" if flash else "") + "attention_prefill_cached",
              (q, kc, vc, start, chunk_len), (a,), **attrs)
        else:
            n(p + "attn", ("flash_" if flash else "") + "attention_decode", (q, kc, vc, start),
              (a,), **attrs)
        g.residual_linear(p + "wo", a, x, seq, h, h, cfg.weight_format, p + "res_attn")
        n(p + "mlp_norm", "rmsnorm", (x,), (t(p + "h2", (seq, h), act),),
          (w(p + "mlp_norm.w", (h,), "f32"),), eps=cfg.eps)
        linear(p + "w_gateup", p + "h2", p + "gu", 2 * cfg.ffn, h)   # rows: gate | up
        n(p + "silu_mul", "silu_mul", (p + "gu",), (t(p + "m", (seq, cfg.ffn), act),))
        g.residual_linear(p + "w_down", p + "m", x, seq, h, cfg.ffn, cfg.weight_format,
                          p + "res_mlp")
    last = x
    if phase == "prefill":
        idx = t("last_index", (1,), "i32", "input")
        # no kernel: the executor points x.last at row last_index of x and runs the rest eagerly
        n("last_row", "select_row", (x, idx), (t("x.last", (1, h)),))
        last = "x.last"
    n("final_norm", "rmsnorm", (last,), (t("hf", (1, h), g.linear_input_dtype(1, cfg.weight_format)),),
      (w("final_norm.w", (h,), "f32"),), eps=cfg.eps)
    g.linear("lm_head", "hf", "logits", 1, cfg.vocab_size, h, cfg.weight_format)
    n("argmax", "argmax", ("logits",), (t("next_token", (1,), "i32"),))
    return g.build(outputs=("next_token", "logits"))


def check_prompt(cfg: ModelConfig, prompt: list[int], max_new_tokens: int) -> None:
    """INVALID_ARGUMENT unless the prompt is non-empty, in the vocabulary, and fits the context
    with max_new_tokens >= 1 more (every decoder path, single-sequence or paged)."""
    if not prompt:
        raise InvalidArgument("the prompt is empty: send at least one token")
    if max_new_tokens < 1 or len(prompt) + max_new_tokens > cfg.max_context:  # O(1) before the scan
        raise InvalidArgument(
            f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} must fit the "
            f"context of {cfg.max_context} tokens (and max_new_tokens >= 1)",
            prompt_tokens=len(prompt), max_context=cfg.max_context)
    bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise InvalidArgument(f"token {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})",
                              token=int(bad[0]), vocab_size=cfg.vocab_size)


class DecoderModel:
    """A loaded decoder: weights in VMM slots, one sequence's KV cache in the `kv` zone, greedy
    generation through the executor's plans (prefill bucketed, decode from one captured graph).

    One sequence at a time owns the KV cache; the runtime serializes calls per model.
    """

    family = "decoder"

    def __init__(self, executor, cfg: ModelConfig, seed: int, capture: bool = True,
                 bucketed: bool = True, prefill_chunk: int | None = None,
                 weights: Callable[[], Iterator[tuple[str, np.ndarray]]] | None = None) -> None:
        self.executor, self.cfg, self.seed, self.capture = executor, cfg, seed, capture
        # a checkpoint's streaming loader (gpu_worker/checkpoints); None: weights from the seed
        self.weights = weights
        # False: one prefill shape per prompt length (the unbucketed traffic of DESIGN 1.1,
        # for the replay benchmark); True: lengths rounded up onto the plan ladder.
        self.bucketed = bucketed
        self.prefill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        if self.prefill_chunk < 1:
            raise InvalidArgument(f"prefill chunk must be >= 1 token, got {self.prefill_chunk}")

    def _prefill_len(self, n: int) -> int:
        return min(seq_bucket(n), self.cfg.max_context) if self.bucketed else n

    def prefill_chunks(self, n: int) -> list[tuple[int, int, int]]:
        """(start, real tokens, plan rows) of each chunk of an n-token prompt."""
        c = self.prefill_chunk
        if n <= c:
            return [(0, n, self._prefill_len(n))]
        # unbucketed: the last chunk runs at its own length (one shape per length, DESIGN 1.1)
        return [(s, min(c, n - s), c if self.bucketed else min(c, n - s)) for s in range(0, n, c)]

    def load(self) -> None:
        source = self.weights() if self.weights is not None else generate(self.cfg, self.seed)
        for key, host in fuse_linears(self.cfg, source):   # wqkv and w_gateup, concatenated
            self.executor.add_weight(key, host)
        per_layer = self.cfg.max_context * self.cfg.kv_heads * self.cfg.head_dim * DTYPE_BYTES[KV_DTYPE]
        for layer in range(self.cfg.layers):
            for name in kv_state_names(layer):
                self.executor.add_state(name, per_layer, "kv")
        self.executor.ensure_resident()

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        check_prompt(self.cfg, prompt, max_new_tokens)

    def prefill(self, prompt: list[int]) -> int:
        """Run the prompt into the KV cache, chunk by chunk; the first generated token."""
        return int(self._prefill(prompt, "next_token")[0])

    def _prefill(self, prompt: list[int], output: str) -> np.ndarray:
        chunks = self.prefill_chunks(len(prompt))
        out: dict[str, np.ndarray] = {}
        for i, (start, real, seq) in enumerate(chunks):
            tokens = np.zeros(seq, np.int32)
            tokens[:real] = prompt[start:start + real]
            last = i == len(chunks) - 1
            out = self.executor.run(
                ("prefill", 1, seq),
                lambda seq=seq: build_decoder_graph(self.cfg, seq, "prefill"),
                {"tokens": tokens, "start": np.array([start], np.int32),
                 "chunk_len": np.array([real], np.int32),
                 "last_index": np.array([real - 1], np.int32)},
                (output,) if last else (), capture=self.capture)
        return out[output]

    def decode(self, token: int, position: int) -> int:
        """One step: `token` at `position` (its KV row); the next token."""
        out = self.executor.run(
            ("decode", 1, 1), lambda: build_decoder_graph(self.cfg, 1, "decode"),
            {"tokens": np.array([token], np.int32), "start": np.array([position], np.int32)},
            ("next_token",), capture=self.capture)
        return int(out["next_token"][0])

    def logits(self, prompt: list[int]) -> np.ndarray:
        """Logits of the prompt's last position (a prefill that reads `logits` back)."""
        return self._prefill(prompt, "logits")[0]

    def generate(self, prompt: list[int], max_new_tokens: int,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[int]:
        """Yield tokens one at a time, greedily; stops early when `cancelled()` turns true."""
        self.check(prompt, max_new_tokens)
        token = self.prefill(prompt)
        yield token
        position = len(prompt)
        for _ in range(max_new_tokens - 1):
            if cancelled():
                return
            token = self.decode(token, position)
            position += 1
            yield token
