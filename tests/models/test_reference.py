"""The NumPy reference models are self-consistent (they are the executor's oracle)."""
from __future__ import annotations

import numpy as np

from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS


def test_decoder_reference_incremental_decode_matches_a_full_forward():
    cfg = CONFIGS["tiny"]
    host = W.load_host(cfg, 7)
    prompt = list(range(5, 40))
    # f32 linears: the prefill's fp16 operand rounding is the executor's, not the math's
    full = R.DecoderReference(cfg, host, fp16=False).forward(prompt + [3, 4], 0)
    inc = R.DecoderReference(cfg, host, fp16=False)
    inc.forward(prompt, 0)
    inc.forward([3], len(prompt))
    last = inc.forward([4], len(prompt) + 1)
    assert np.allclose(full[-1], last[-1], atol=1e-4), "KV-cached decode differs from a full forward"


def test_decoder_reference_is_deterministic_and_depends_on_the_prompt():
    cfg = CONFIGS["tiny"]
    host = W.load_host(cfg, 7)
    a = R.DecoderReference(cfg, host).generate([1, 2, 3], 6)
    assert a == R.DecoderReference(cfg, host).generate([1, 2, 3], 6)
    assert len(a) == 6 and all(0 <= t < cfg.vocab_size for t in a)
    assert a != R.DecoderReference(cfg, host).generate([9, 8, 7, 6], 6), "output ignores the prompt"


def test_encoder_reference_is_per_sequence_and_shape_independent():
    cfg = CONFIGS["tiny-encoder"]
    enc = R.EncoderReference(cfg, W.load_host(cfg, 1), fp16=False)
    seqs = (np.arange(40).reshape(4, 10) * 7) % cfg.vocab_size
    batch = enc.embed(seqs)
    assert batch.shape == (4, cfg.hidden)
    assert np.allclose(batch[2], enc.embed(seqs[2:3])[0], atol=1e-5), "batching changed an embedding"
