"""bench/peer.py on CPU (skipped without torch): the peer's decode, prefill and serving loop agree,
so a speed comparison against it compares with a correct model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bench import peer
from gpu_worker.models.configs import get_config


def greedy_by_prefill(model, prompt, new):
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(model.prefill(torch.tensor(seq))[0]))
    return seq[len(prompt):]


def test_decode_from_a_prefilled_cache_equals_prefilling_the_longer_prompt():
    model = peer.PeerDecoder(get_config("tiny"), ctx=64, device="cpu")
    prompt = [5, 17, 300, 2, 9, 41]
    want = greedy_by_prefill(model, prompt, 5)
    cache = model.new_cache(2)
    first = model.prefill(torch.tensor(prompt), cache, row=1)
    tok = torch.tensor([0, int(first[0])])
    pos = torch.tensor([0, len(prompt)])
    got = [int(first[0])]
    for _ in range(4):
        tok = model.decode(tok, pos, cache)
        pos = pos + 1
        got.append(int(tok[1]))
    assert got == want, "the static-cache decode must continue the prefill exactly"


def test_the_serving_loop_gives_every_request_its_tokens_and_the_same_tokens_as_solo():
    model = peer.PeerDecoder(get_config("tiny"), ctx=64, device="cpu")
    trace = [[([1, 2, 3], 4), ([7, 8], 3)], [([9, 10, 11, 12, 13], 6)]]
    server = peer.PeerServer(model, streams=2)
    r = server.run(trace)
    assert r["tokens"] == 4 + 3 + 6, "every request gets exactly its new tokens"
    assert len(r["ttft"]) == 3 and all(t >= 0 for t in r["ttft"])
    want = [[greedy_by_prefill(model, p, n) for p, n in work] for work in trace]
    assert r["sequences"] == want, "a request's tokens must not depend on what shares its batch"


def test_the_encoder_ignores_padding():
    enc = peer.PeerEncoder(get_config("tiny-encoder"), device="cpu")
    a = enc.embed(torch.tensor([[3, 4, 5, 0, 0]]), torch.tensor([3]))
    b = enc.embed(torch.tensor([[3, 4, 5]]), torch.tensor([3]))
    assert torch.allclose(a, b, atol=1e-5), "padded positions must not change the embedding"


def test_the_open_loop_serving_loop_queues_arrivals_for_a_free_row_and_keeps_their_tokens():
    model = peer.PeerDecoder(get_config("tiny"), ctx=64, device="cpu")
    # three requests at once on two rows: the third waits for a row; the last arrives later,
    # when nothing runs (the loop sleeps until it)
    requests = [(0.0, [1, 2, 3], 4), (0.0, [7, 8], 3), (0.0, [9, 10, 11, 12], 5),
                (0.2, [4, 5], 1)]
    server = peer.PeerServer(model, streams=2)
    r = server.run_arrivals(requests)
    assert r["tokens"] == 4 + 3 + 5 + 1, "every request gets exactly its new tokens"
    assert r["sequences"] == [greedy_by_prefill(model, p, n) for _, p, n in requests], \
        "a request's tokens must not depend on when it arrived or what shared its batch"
    assert len(r["ttft"]) == 4 and all(t >= 0 for t in r["ttft"]), "TTFT counts from arrival"
    assert r["wall"] >= 0.2, "the late request was served before it arrived"
