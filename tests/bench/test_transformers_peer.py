"""bench/transformers_peer.py without a GPU: it says why it cannot run, and the faster peer is
picked per batch by median."""
from __future__ import annotations

from bench import transformers_peer


def test_without_torch_or_a_device_the_transformers_peer_names_why_and_measures_nothing():
    why = transformers_peer.why_unavailable()
    if why is None:     # a CUDA machine with transformers: nothing to check here
        return
    assert "transformers" in why or "torch" in why or "CUDA" in why, why
    assert transformers_peer.rates(None, [1], 8, 4, 1) is None, "no peer where it cannot run"


def test_the_faster_peer_per_batch_is_the_one_with_the_higher_median():
    shared = {1: [130.0, 132.0, 131.0], 64: [6000.0, 6100.0, 6200.0]}
    hf = {1: [150.0, 90.0, 151.0], 64: [5000.0, 5100.0, 5200.0]}
    best = transformers_peer.faster(shared, hf)
    assert best[1] == ("transformers", hf[1]), "batch 1: transformers' median 150 > 131"
    assert best[64] == ("shared peer", shared[64]), "batch 64: the shared peer's median is higher"


def test_without_transformers_figures_the_shared_peer_is_the_peer():
    shared = {8: [900.0, 930.0, 910.0]}
    assert transformers_peer.faster(shared, None) == {8: ("shared peer", shared[8])}


def test_the_static_cache_decode_loop_gives_the_no_cache_greedy_tokens_in_every_window():
    """On CPU, eagerly (the GPU run compiles the same step): every timed window restarts from a
    freshly prefilled cache, so its tokens are the plain greedy continuation of the prompt."""
    import pytest
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gpu_worker.models.configs import get_config
    model = transformers_peer.build_model(get_config("tiny"), 64, device="cpu")
    tokens: dict = {}
    transformers_peer.decode_rates(model, [2], 8, 5, 2, 64, tokens=tokens, compile=False)
    prompt = torch.randint(1, model.config.vocab_size, (2, 8),
                           generator=torch.Generator().manual_seed(2))
    seq = prompt
    with torch.inference_mode():
        for _ in range(6):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert tokens[2] == seq[:, 9:].tolist(), "the decode window must continue the prompt greedily"
