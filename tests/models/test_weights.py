"""Deterministic weights and int4 block quantization."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS, get_config
from services.common.errors import InvalidArgument


def test_weights_are_a_pure_function_of_the_seed():
    cfg = CONFIGS["tiny"]
    a, b, c = W.load_host(cfg, 3), W.load_host(cfg, 3), W.load_host(cfg, 4)
    assert all(np.array_equal(a[k], b[k]) for k in a), "same seed gave different weights"
    assert not np.array_equal(a["layers.0.wq.q"], c["layers.0.wq.q"]), "seed is ignored"


def test_weight_bytes_match_the_generated_tensors():
    for name in ("tiny", "tiny-encoder", "small"):
        cfg = CONFIGS[name]
        host = W.load_host(cfg, 1)
        assert sum(a.nbytes for a in host.values()) == cfg.weight_bytes(), name
        assert list(host) == W.weight_names(cfg), f"{name}: weight_names out of step with generate"


def test_int4_quantization_round_trips_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 96)).astype(np.float32)
    q = W.quantize(w)
    assert q.packed.shape == (16, 48) and q.scales.shape == (16, 3) and q.scales.dtype == np.float16
    step = np.repeat(q.scales.astype(np.float32), 32, axis=1)
    assert np.all(np.abs(q.dequantize() - w) <= step * 0.5 + 1e-3 * np.abs(w)), "int4 error too large"


def test_int4_packing_puts_even_elements_in_the_low_nibble():
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 7.0, -7.0
    q = W.quantize(w)
    assert q.packed[0, 0] == (7 + 8) | ((-7 + 8) << 4), "nibble order differs from the layout note"


def test_tiny_configs_meet_the_ci_minimums():
    for name in ("tiny", "tiny-encoder"):
        cfg = CONFIGS[name]
        assert cfg.vocab_size >= 1024 and cfg.max_context >= 1024, f"{name} below the CI minimum"
    assert CONFIGS["large"].weight_bytes() > 30 << 30, "large must fill tens of GiB"


def test_unknown_config_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        get_config("huge")
    with pytest.raises(InvalidArgument):
        get_config("tiny", family="encoder-ish")
    assert get_config("tiny", family="encoder").name == "tiny-encoder"


@pytest.mark.parametrize("name", ["tiny", "small", "tiny-encoder"])
def test_weight_sizes_match_the_generated_tensors_without_generating_them(name):
    cfg = CONFIGS[name]
    assert W.weight_sizes(cfg) == [a.nbytes for _, a in W.generate(cfg, 0)]
    assert sum(W.weight_sizes(cfg)) == cfg.weight_bytes()


def test_weights_do_not_depend_on_how_many_threads_draw_them(monkeypatch):
    cfg = CONFIGS["small"]
    monkeypatch.setattr(W, "GENERATE_THREADS", 1)
    serial = list(W.generate(cfg, 7))
    monkeypatch.setattr(W, "GENERATE_THREADS", 4)
    monkeypatch.setattr(W, "GENERATE_AHEAD", 1)
    threaded = list(W.generate(cfg, 7))
    assert [k for k, _ in threaded] == [k for k, _ in serial] == W.weight_names(cfg)
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(serial, threaded))


def test_a_linear_draws_exactly_the_bytes_generator_bytes_would():
    """The fast raw draw must not change any model's weights (checkpoints, references)."""
    for n in (8, 4096, 3 * 1024 * 1024):
        fast, slow = W._rng(1, "x"), W._rng(1, "x")
        assert np.array_equal(W._random_bytes(fast, n), np.frombuffer(slow.bytes(n), np.uint8))
        assert np.array_equal(fast.uniform(size=4), slow.uniform(size=4)), "state diverged"


def test_a_consumer_that_stops_early_leaves_no_thread_behind():
    import threading
    gen = W.generate(CONFIGS["small"], 2)
    next(gen)
    gen.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("weights")]
