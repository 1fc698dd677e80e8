"""Device cases for the encoder's padding masks, run on the sim backend by the CPU tests and on
the cuda backend by the GPU tests (as selfcheck.CASES are), in the encoder graph's own layout.

A padded encoder batch is (batch, seq) rows with `lengths` (batch,) i32 real tokens per row:
- attention_prefill, not causal, lens = lengths: every query of row b (padded ones too) sees keys
  [0, lengths[b]) of row b; q, k, v are separate (batch*seq, heads*head_dim) buffers
  (kv_batch_stride = seq * width), as the graph's linears write them;
- mean_pool with lens = lengths: row b averages its first lengths[b] positions (0: zeros).
The padded positions hold huge values (POISON) so any read of them moves the result far outside
the tolerance, rather than by a little that a tolerance could hide.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.attention import ATTENTION_PREFILL, launch_attention_prefill
from gpu_worker.kernels.reduce import MEAN_POOL, launch_mean_pool
from gpu_worker.kernels.selfcheck import Case, KernelHarness, Outcome

POISON = 3.0e4


def _poisoned(rng: np.random.Generator, lengths: list[int], seq: int, width: int) -> np.ndarray:
    x = rng.standard_normal((len(lengths), seq, width)).astype(np.float32)
    for b, n in enumerate(lengths):
        x[b, n:] = POISON
    return x


def encoder_attention_case(h: KernelHarness, rng, seq: int, heads: int, head_dim: int,
                           lengths: list[int]) -> Outcome:
    batch, width = len(lengths), heads * head_dim
    q = rng.standard_normal((batch, seq, width)).astype(np.float32)
    k, v = _poisoned(rng, lengths, seq, width), _poisoned(rng, lengths, seq, width)
    out = h.put(np.full((batch * seq, width), np.nan, np.float32))
    launch_attention_prefill(h.device, h.function(ATTENTION_PREFILL), out, h.put(q), h.put(k),
                             h.put(v), h.put(np.asarray(lengths, np.int32)), 0, batch, seq, heads,
                             heads, head_dim, width, width, seq * width, causal=False)
    want = np.stack([
        ref.attention(q[b].reshape(seq, heads, head_dim), k[b].reshape(seq, heads, head_dim),
                      v[b].reshape(seq, heads, head_dim), np.arange(seq), False,
                      n_valid=n).reshape(seq, width)
        for b, n in enumerate(lengths)]).reshape(batch * seq, width)
    return Outcome(h.get(out, want.shape), want, 1e-4, 2e-5)


def encoder_pool_case(h: KernelHarness, rng, seq: int, hidden: int,
                      lengths: list[int]) -> Outcome:
    batch = len(lengths)
    x = _poisoned(rng, lengths, seq, hidden)
    out = h.put(np.full((batch, hidden), np.nan, np.float32))
    launch_mean_pool(h.device, h.function(MEAN_POOL), out, h.put(x),
                     h.put(np.asarray(lengths, np.int32)), batch, seq, hidden)
    want = ref.mean_pool(x, np.asarray(lengths))
    return Outcome(h.get(out, (batch, hidden)), want, 1e-5, 1e-6)


def _lengths(batch: int, seq: int) -> list[int]:
    """Every kind of row: full, one token, empty (a padded batch row), and ragged ones."""
    fixed = [seq, 1, 0, seq - 1]
    return (fixed + [(b * 97 + 5) % seq + 1 for b in range(batch)])[:batch]


# Small shapes for the CPU suite (sim); the GPU suite adds the production shapes below.
ENCODER_CASES: list[Case] = [
    Case("attention_prefill", encoder_attention_case,
         {"seq": 33, "heads": 4, "head_dim": 16, "lengths": [33, 1, 0, 20]}),
    Case("attention_prefill", encoder_attention_case,
         {"seq": 300, "heads": 2, "head_dim": 64, "lengths": [300, 257, 3]}),
    Case("mean_pool", encoder_pool_case, {"seq": 32, "hidden": 64, "lengths": [32, 1, 0, 17]}),
]

# small-encoder (6 heads x 64, hidden 384) and large-encoder (16 heads x 64, hidden 1024) at
# batch and seq rungs of the worker's ladder (gpu_worker.models.encoder.padded_shape).
ENCODER_MODEL_CASES: list[Case] = [
    Case("attention_prefill", encoder_attention_case,
         {"seq": 256, "heads": 6, "head_dim": 64, "lengths": _lengths(16, 256)}),
    Case("attention_prefill", encoder_attention_case,
         {"seq": 512, "heads": 16, "head_dim": 64, "lengths": _lengths(8, 512)}),
    Case("mean_pool", encoder_pool_case, {"seq": 256, "hidden": 384, "lengths": _lengths(64, 256)}),
    Case("mean_pool", encoder_pool_case,
         {"seq": 512, "hidden": 1024, "lengths": _lengths(64, 512)}),
]
