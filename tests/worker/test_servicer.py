"""WorkerService over a real gRPC server: results, status codes, cancellation, concurrency."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from gpuplane.worker.v1 import worker_pb2, worker_pb2_grpc

from gpu_worker.edge.client import WorkerClient
from gpu_worker.models.configs import get_config
from gpu_worker.models.encoder import padded_shape
from gpu_worker.models.reference import DecoderReference, EncoderReference
from gpu_worker.models.weights import load_host
from services.common.zones import zone_name

from .conftest import DECODER, ENCODER, SEED

CFG = get_config("tiny", "decoder")


def _reference_tokens(prompt: list[int], n: int) -> list[int]:
    return DecoderReference(CFG, load_host(CFG, SEED)).generate(prompt, n)


def _zones(client: WorkerClient) -> dict[str, tuple[int, int]]:
    return {zone_name(z.zone): (z.committed_bytes, z.content_bytes) for z in client.stats().zones}


def _state(client: WorkerClient) -> tuple:
    """What a refused request must leave unchanged: the models, the ledger and every zone."""
    s = client.stats()
    models = sorted((m.model_id, m.family, m.config) for m in client.list_models())
    zones = sorted((z.zone, z.committed_bytes, z.content_bytes) for z in s.zones)
    return models, s.ledger_bytes, zones


def _assert_refused(client: WorkerClient, call: Callable[[], object], code: grpc.StatusCode,
                    what: str) -> grpc.RpcError:
    before = _state(client)
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (list, dict)):
            list(result)  # a stream reports its status when read
    assert caught.value.code() == code, f"{what}: expected {code.name}, got {caught.value.code().name}"
    assert caught.value.details(), f"{what}: the status carries no message for the caller"
    assert "Traceback" not in caught.value.details(), f"{what}: a stack trace reached the client"
    assert _state(client) == before, f"{what}: a refused request changed the worker's state"
    return caught.value


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_generate_streams_the_reference_models_greedy_tokens(worker: WorkerClient) -> None:
    prompt = [5, 17, 300, 42, 9, 1000, 3]
    result = worker.generate(DECODER, prompt, 6)
    assert result.tokens == _reference_tokens(prompt, 6), "served tokens differ from the NumPy reference"
    assert result.first_token_seconds > 0, "the first message does not carry the first-token time"


def test_generate_streams_tokens_as_they_are_produced_then_done(worker: WorkerClient) -> None:
    messages = list(worker.generate_stream(DECODER, [1, 2, 3, 4], 5))
    with_tokens = [m for m in messages if m.tokens]
    assert len(with_tokens) >= 2, "tokens arrived in one message: Generate does not stream"
    assert messages[0].prompt_tokens == 4, "the first message does not echo the prompt length"
    assert messages[-1].done, "the stream does not end with a done message"
    assert sum(len(m.tokens) for m in messages) == 5, "the stream did not produce max_new_tokens tokens"


def test_unknown_model_is_not_found_and_changes_nothing(worker: WorkerClient) -> None:
    _assert_refused(worker, lambda: worker.generate_stream("no-such-model", [1, 2], 2),
                    grpc.StatusCode.NOT_FOUND, "Generate on an unknown model")
    _assert_refused(worker, lambda: worker.embed("no-such-model", [[1, 2]]),
                    grpc.StatusCode.NOT_FOUND, "Embed on an unknown model")
    _assert_refused(worker, lambda: worker.unload_model("no-such-model"),
                    grpc.StatusCode.NOT_FOUND, "UnloadModel of an unknown model")


def test_empty_prompt_is_invalid_argument_and_changes_nothing(worker: WorkerClient) -> None:
    _assert_refused(worker, lambda: worker.generate_stream(DECODER, [], 2),
                    grpc.StatusCode.INVALID_ARGUMENT, "an empty prompt")


def test_out_of_vocabulary_prompt_is_invalid_argument_and_changes_nothing(worker: WorkerClient) -> None:
    for bad in ([1, CFG.vocab_size], [-1, 2]):
        _assert_refused(worker, lambda bad=bad: worker.generate_stream(DECODER, bad, 2),
                        grpc.StatusCode.INVALID_ARGUMENT, f"out-of-vocabulary prompt {bad}")
    _assert_refused(worker, lambda: worker.embed(ENCODER, [[1, 10**6]]),
                    grpc.StatusCode.INVALID_ARGUMENT, "out-of-vocabulary embed sequence")


def test_absurd_max_new_tokens_is_invalid_argument_and_changes_nothing(worker: WorkerClient) -> None:
    for bad in (0, -5, 2**31 - 1):
        _assert_refused(worker, lambda bad=bad: worker.generate_stream(DECODER, [1, 2], bad),
                        grpc.StatusCode.INVALID_ARGUMENT, f"max_new_tokens={bad}")


def test_prompt_longer_than_the_context_is_invalid_argument_and_changes_nothing(
        worker: WorkerClient) -> None:
    _assert_refused(worker, lambda: worker.generate_stream(DECODER, [1] * (CFG.max_context + 1), 1),
                    grpc.StatusCode.INVALID_ARGUMENT, "a prompt longer than the context")
    _assert_refused(worker, lambda: worker.generate_stream(DECODER, [1] * (CFG.max_context - 2), 8),
                    grpc.StatusCode.INVALID_ARGUMENT, "prompt + max_new_tokens past the context")


def test_bad_load_requests_are_invalid_argument_and_change_nothing(worker: WorkerClient) -> None:
    _assert_refused(worker, lambda: worker.load_model("m", "transformer", "tiny", 0),
                    grpc.StatusCode.INVALID_ARGUMENT, "an unknown family")
    _assert_refused(worker, lambda: worker.load_model("m", "decoder", "no-such-size", 0),
                    grpc.StatusCode.INVALID_ARGUMENT, "an unknown config")
    _assert_refused(worker, lambda: worker.load_model("", "decoder", "tiny", 0),
                    grpc.StatusCode.INVALID_ARGUMENT, "an empty model id")
    _assert_refused(worker, lambda: worker.load_model(DECODER, "decoder", "tiny", 0),
                    grpc.StatusCode.ALREADY_EXISTS, "a model id already loaded")


def test_a_model_that_does_not_fit_is_resource_exhausted_with_details_and_changes_nothing(
        worker: WorkerClient) -> None:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    error = _assert_refused(worker, lambda: worker.load_model("huge", "decoder", "large", 0),
                            grpc.StatusCode.RESOURCE_EXHAUSTED, "a model larger than the device")
    status = rpc_status.from_call(error)
    assert status is not None, "RESOURCE_EXHAUSTED carries no google.rpc.Status details"
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert infos and int(infos[0].metadata["asked_bytes"]) > 0, \
        "the refusal does not say how many bytes were asked"


def test_embed_returns_the_reference_embeddings_one_per_sequence(worker: WorkerClient) -> None:
    cfg = get_config("tiny", "encoder")
    sequences = [[1, 2, 3, 4, 5], [900, 800, 700, 600, 500], [7, 7, 7, 7, 7]]
    got = worker.embed(ENCODER, sequences)
    batch, seq = padded_shape([5, 5, 5], cfg.max_context)   # the worker's padded plan
    want = EncoderReference(cfg, load_host(cfg, SEED)).embed(sequences, rows=batch * seq)
    assert got.shape == (3, cfg.hidden), "one embedding per sequence of the model's width"
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4,
                               err_msg="served embeddings differ from the NumPy reference")


def test_embed_of_empty_batches_or_sequences_is_invalid_argument(worker: WorkerClient) -> None:
    _assert_refused(worker, lambda: worker.embed(ENCODER, [[1, 2, 3], []]),
                    grpc.StatusCode.INVALID_ARGUMENT, "an empty sequence")
    _assert_refused(worker, lambda: worker.embed(ENCODER, []),
                    grpc.StatusCode.INVALID_ARGUMENT, "an empty batch")


def _replays(client: WorkerClient) -> int:
    return client.stats().capture.replays


def _assert_request_stopped(worker: WorkerClient, prompt: list[int], baseline: dict, what: str) -> None:
    """The abandoned request stops stepping, frees its model for the next caller, and leaves the
    ledger as it was (a decoder's KV cache is booked at load, so a request adds nothing)."""
    started = time.perf_counter()
    # Same shapes as the warm-up, so the warm plans and variants are the baseline's. This call
    # queues on the model lock: once it returns, the abandoned request has let go of the model.
    assert len(worker.generate(DECODER, prompt, 2).tokens) == 2, f"{what}: the model is stuck"
    assert time.perf_counter() - started < 30, f"{what}: the next request waited for the dead one"
    stopped_at = _replays(worker)
    time.sleep(0.3)
    assert _replays(worker) == stopped_at, f"{what}: decode steps continued after the request ended"
    assert _wait_for(lambda: _zones(worker) == baseline), \
        f"{what}: memory not back to its state before the request: {_zones(worker)} != {baseline}"


def test_a_client_that_disconnects_mid_stream_stops_its_request_and_frees_its_memory(
        worker: WorkerClient) -> None:
    prompt = list(range(1, 40))
    # warm this shape's kernels and plans (caches stay booked), twice: the second hits the
    # prefix cache and warms the shorter prefill every later request with this prompt runs
    for _ in range(2):
        worker.generate(DECODER, prompt, 2)
    baseline = _zones(worker)
    before = _replays(worker)
    asked = CFG.max_context - len(prompt) - 1
    # A plain channel: its call object can be cancelled, as a client process dying would.
    with grpc.insecure_channel(worker.target) as channel:
        stream = worker_pb2_grpc.WorkerServiceStub(channel).Generate(
            worker_pb2.GenerateRequest(model_id=DECODER, prompt_tokens=prompt, max_new_tokens=asked),
            timeout=300)
        assert next(stream).tokens, "the stream produced no token before the disconnect"
        stream.cancel()
    _assert_request_stopped(worker, prompt, baseline, "after a disconnect")
    assert _replays(worker) - before < asked - 1, "the disconnected request ran to completion"


def test_a_deadline_that_passes_mid_stream_cancels_the_request_and_frees_its_memory(
        worker: WorkerClient) -> None:
    prompt = list(range(1, 40))
    for _ in range(2):       # the whole prompt, then the prefix cache's shorter prefill
        worker.generate(DECODER, prompt, 2)
    baseline = _zones(worker)
    before = _replays(worker)
    asked = CFG.max_context - len(prompt) - 1
    with pytest.raises(grpc.RpcError) as caught:
        worker.generate(DECODER, prompt, asked, timeout=1.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline did not end the call"
    _assert_request_stopped(worker, prompt, baseline, "after the deadline")
    assert _replays(worker) - before < asked - 1, "the expired request ran to completion"


def test_many_concurrent_clients_each_get_their_own_correct_results(worker: WorkerClient) -> None:
    """Decoder and encoder requests and stats polls at once: captures on one model run beside
    launches, syncs and reads on the other, all through the capture gate."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, CFG.vocab_size, int(n)).tolist() for n in rng.integers(3, 60, 8)]
    want = {i: _reference_tokens(p, 4) for i, p in enumerate(prompts)}
    enc = get_config("tiny", "encoder")
    batches = [rng.integers(1, enc.vocab_size, (2, int(n))).tolist() for n in (5, 9, 17, 33)]
    reference = EncoderReference(enc, load_host(enc, SEED))
    # batched or not, every padded plan has more than 16 rows: the same (tensor-core) rounding
    want_embed = [reference.embed(b, rows=int(np.prod(padded_shape([len(s) for s in b], 1024))))
                  for b in batches]
    jobs = len(prompts) + len(batches) + 2
    start = threading.Barrier(jobs)

    def one(i: int) -> object:
        with WorkerClient(worker.target, deadline_s=120.0) as own:
            start.wait()
            if i < len(prompts):
                return own.generate(DECODER, prompts[i], 4).tokens
            if i < len(prompts) + len(batches):
                return own.embed(ENCODER, batches[i - len(prompts)])
            return [own.stats().ledger_bytes for _ in range(10)]

    with ThreadPoolExecutor(jobs) as pool:
        got = list(pool.map(one, range(jobs)))
    wrong = [i for i in range(len(prompts)) if got[i] != want[i]]
    assert not wrong, f"concurrent requests {wrong} got another request's or wrong tokens"
    for k, expected in enumerate(want_embed):
        np.testing.assert_allclose(got[len(prompts) + k], expected, rtol=1e-3, atol=1e-4,
                                   err_msg=f"concurrent embed batch {k} is wrong")


def test_get_stats_reports_the_ledger_caches_plans_and_compiles(worker: WorkerClient) -> None:
    worker.generate(DECODER, [1, 2, 3], 2)
    s = worker.stats()
    assert s.backend == "sim", "stats do not name the backend"
    assert s.device_total_bytes > 0 and s.device_used_bytes > 0, "device truth missing from stats"
    zones = {zone_name(z.zone): z for z in s.zones}
    # Slots are packed into shared granules, so committed bytes may sit with another zone;
    # the content axis always names the weights.
    assert zones["weights"].content_bytes > 0, "loaded weights are not in the ledger"
    assert s.ledger_bytes == sum(z.committed_bytes for z in s.zones), \
        "ledger_bytes is not the sum of the zones' committed bytes"
    assert s.kernel_cache.entries > 0 and s.kernel_cache.max_variants_per_node >= 1, \
        "kernel cache counters missing"
    assert s.kernel_cache.max_variants_per_node <= s.kernel_cache.variant_bound, \
        "a node holds more kernel variants than the bound"
    assert s.plans.entries >= 1, "plan counters missing"
    assert s.compile.compiled + s.compile.local_hits + s.compile.memo_hits > 0, "compile counters missing"


def test_trim_drops_caches_toward_the_target_and_serving_still_works(worker: WorkerClient) -> None:
    worker.generate(DECODER, [4, 5, 6], 2)
    before = worker.stats().ledger_bytes
    reply = worker.trim(0)
    assert reply.ledger_bytes == worker.stats().ledger_bytes, "Trim reports a ledger it does not have"
    assert reply.freed_bytes > 0 and reply.ledger_bytes < before, "Trim to 0 dropped nothing"
    assert worker.generate(DECODER, [1, 2, 3], 3).tokens == _reference_tokens([1, 2, 3], 3), \
        "the worker serves wrong tokens after a trim"
    _assert_refused(worker, lambda: worker.trim(-1), grpc.StatusCode.INVALID_ARGUMENT,
                    "a negative trim target")


def test_unload_frees_the_models_memory_and_forgets_it(worker: WorkerClient) -> None:
    # Content, not committed bytes: a tiny model can fit in granules already committed.
    def content() -> int:
        return sum(z.content_bytes for z in worker.stats().zones)

    before = content()
    loaded = worker.load_model("transient-model", "decoder", "tiny", 11)
    assert loaded.model.weight_bytes > 0 and loaded.model.vocab_size == CFG.vocab_size, \
        "LoadModel does not describe the model"
    assert content() >= before + loaded.model.weight_bytes, "a loaded model's weights are not booked"
    freed = worker.unload_model("transient-model")
    assert freed >= loaded.model.weight_bytes, "UnloadModel reports less than the weights freed"
    assert "transient-model" not in [m.model_id for m in worker.list_models()], "unloaded model listed"
    assert _wait_for(lambda: content() <= before), "unload left memory booked"
    _assert_refused(worker, lambda: worker.generate_stream("transient-model", [1], 1),
                    grpc.StatusCode.NOT_FOUND, "Generate on an unloaded model")


def test_stats_mapping_accepts_every_zone_spelling_and_ignores_unknown_keys() -> None:
    from gpuplane.governor.v1 import governor_pb2

    from gpu_worker.edge.messages import stats_message

    as_tuples = stats_message({"backend": "sim", "ledger_bytes": np.int64(7), "future_field": 1,
                               "zones": {"kv": (4, 3), "weights": (2, 1)},
                               "plans": {"entries": 2, "evictions": 5, "unknown": 9},
                               "weights": {"hit_rate": np.float32(0.5)}})
    as_dicts = stats_message({"backend": "sim", "ledger_bytes": 7,
                              "zones": [{"zone": "weights", "committed_bytes": 2, "content_bytes": 1},
                                        {"zone": "kv", "committed_bytes": 4, "content_bytes": 3}],
                              "plans": {"entries": 2, "evictions": 5},
                              "weights": {"hit_rate": 0.5}})
    assert as_tuples == as_dicts, "the two zone spellings map to different messages"
    assert [z.zone for z in as_tuples.zones] == [governor_pb2.ZONE_WEIGHTS, governor_pb2.ZONE_KV], \
        "zones are not in the proto enum's order"
    assert (as_tuples.plans.evictions, as_tuples.weights.hit_rate) == (5, 0.5), "nested fields lost"


def test_first_token_seconds_is_the_servers_time_to_the_first_token(worker: WorkerClient,
                                                                    monkeypatch) -> None:
    """GenerateResponse.first_token_seconds: request to first token, measured on the server
    (a slow prefill shows in it; the decode steps after the first token do not)."""
    from gpu_worker.models.paged import PagedDecoderModel
    slow_prefill, real_prefill = 0.3, PagedDecoderModel.prefill

    def prefill(self, *args, **kwargs):   # the prompt is one chunk: one slow call
        time.sleep(slow_prefill)
        return real_prefill(self, *args, **kwargs)
    monkeypatch.setattr(PagedDecoderModel, "prefill", prefill)
    started = time.perf_counter()
    result = worker.generate(DECODER, [3, 1, 4, 1, 5], 8)
    total = time.perf_counter() - started
    assert result.tokens == _reference_tokens([3, 1, 4, 1, 5], 8)
    assert slow_prefill <= result.first_token_seconds < total, \
        f"first_token_seconds={result.first_token_seconds:.3f} for a {slow_prefill}s prefill, {total:.3f}s total"
    assert result.first_token_seconds <= result.client_first_token_seconds, \
        "the server's first-token time exceeds what the client saw"


def test_offload_pages_a_model_out_and_the_next_generate_wakes_it_with_the_same_tokens(
        worker: WorkerClient) -> None:
    prompt = [9, 8, 7, 6]
    want = worker.generate(DECODER, prompt, 4).tokens
    reply = worker.offload_model(DECODER)
    assert reply.model.model_id == DECODER and reply.model.state == "offloaded"
    assert reply.model.resident_bytes == 0 and reply.freed_bytes >= reply.model.weight_bytes
    listed = {m.model_id: m for m in worker.list_models()}
    assert listed[DECODER].state == "offloaded" and listed[ENCODER].state == "resident"
    assert worker.generate(DECODER, prompt, 4).tokens == want, "the woken model differs"
    woken = {m.model_id: m for m in worker.list_models()}[DECODER]
    assert woken.state == "resident" and woken.resident_bytes == woken.weight_bytes


def test_offload_of_an_unknown_or_unnamed_model_is_refused_and_changes_nothing(
        worker: WorkerClient) -> None:
    _assert_refused(worker, lambda: worker.offload_model("no-such-model"),
                    grpc.StatusCode.NOT_FOUND, "OffloadModel of an unknown model")
    _assert_refused(worker, lambda: worker.offload_model(""),
                    grpc.StatusCode.INVALID_ARGUMENT, "OffloadModel without a model id")
