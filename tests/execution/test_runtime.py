"""WorkerRuntime (interface 6) on the sim backend: models, generate/embed, stats, trim, errors."""
from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.core.loader import ModelLoader
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from services.common.errors import AlreadyExists, InvalidArgument, NotFound
from tests.tokens import assert_greedy_tokens_of

# Above 16 rows the linears round x and W to fp16 (the reference does too), so an f32
# summation-order difference that crosses an fp16 rounding boundary moves a value by 2^-11 relative.
ATOL = 1e-3


@pytest.fixture
def runtime(kernel_cache_dir):
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir)).start()
    yield rt
    rt.close()


def test_runtime_generates_the_reference_tokens_and_streams_one_token_per_item(runtime):
    result = runtime.load_model("dec", "decoder", "tiny", 11)
    assert result.info.vocab_size == 1024 and result.info.max_context == 1024
    chunks = list(runtime.generate("dec", [4, 8, 15, 16, 23, 42], 5))
    assert all(len(c) == 1 for c in chunks)
    want = R.DecoderReference(CONFIGS["tiny"], W.load_host(CONFIGS["tiny"], 11)).generate(
        [4, 8, 15, 16, 23, 42], 5)
    assert [c[0] for c in chunks] == want, "runtime tokens differ from the reference"


def test_runtime_embeds_with_the_encoder(runtime):
    runtime.load_model("enc", "encoder", "tiny", 2)
    seqs = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]
    got = runtime.embed("enc", seqs)
    want = R.EncoderReference(CONFIGS["tiny-encoder"], W.load_host(CONFIGS["tiny-encoder"], 2)).embed(
        np.array(seqs))
    # the encoder rounds its tensor-core operands to fp16 where the reference does not: one fp16
    # ulp at |x| ~ 2 is 2e-3 (the gap was 0.95e-3 with f32 sums and 1.02e-3 with exact ones)
    assert got.shape == (2, 64) and np.allclose(got, want, atol=2 * ATOL)


def test_runtime_refuses_bad_requests_with_domain_errors(runtime):
    runtime.load_model("dec", "decoder", "tiny", 1)
    with pytest.raises(AlreadyExists):
        runtime.load_model("dec", "decoder", "tiny", 1)
    with pytest.raises(InvalidArgument):
        runtime.load_model("x", "decoder", "no-such-size", 1)
    with pytest.raises(InvalidArgument):
        runtime.load_model("x", "vision", "tiny", 1)
    with pytest.raises(NotFound):
        runtime.generate("nope", [1], 1)
    with pytest.raises(InvalidArgument):
        runtime.generate("dec", [1, 99999], 1)            # raised before any streaming
    with pytest.raises(InvalidArgument):
        runtime.embed("dec", [[1, 2]])                     # a decoder cannot embed
    with pytest.raises(NotFound):
        runtime.unload_model("nope")
    assert [m.model_id for m in runtime.list_models()] == ["dec"]


def test_runtime_stats_use_the_worker_proto_field_names(runtime):
    from gpuplane.worker.v1 import worker_pb2
    runtime.load_model("dec", "decoder", "tiny", 1)
    list(runtime.generate("dec", [1, 2, 3], 4))
    stats = runtime.stats()
    fields = worker_pb2.GetStatsResponse.DESCRIPTOR.fields_by_name
    assert set(stats) == set(fields), f"stats keys differ from GetStatsResponse: {set(stats) ^ set(fields)}"
    for key, value in stats.items():
        if isinstance(value, dict) and key != "zones":
            nested = set(fields[key].message_type.fields_by_name)
            assert set(value) == nested, f"stats[{key!r}] keys differ from the proto: {set(value) ^ nested}"
    assert stats["backend"] == "sim" and stats["kernel_cache"]["entries"] > 0
    assert stats["plans"]["entries"] == 2 and stats["kernel_cache"]["variant_bound"] == 16
    assert stats["capture"]["replays"] >= 3 and len(stats["zones"]) == 8
    assert stats["arena"]["faults"] == 0, "arena/ledger bookkeeping faults must stay zero"
    from gpu_worker.edge.messages import stats_message
    msg = stats_message(stats)
    assert msg.kernel_cache.entries == stats["kernel_cache"]["entries"] and len(msg.zones) == 8


def test_unload_and_trim_give_the_memory_back(runtime):
    baseline = runtime.device.ledger.snapshot()
    runtime.load_model("enc", "encoder", "tiny", 1)
    runtime.embed("enc", [[1, 2, 3] * 10])
    freed, _ = runtime.trim(0)
    assert freed > 0 and runtime.stats()["plans"]["entries"] == 0
    assert runtime.unload_model("enc") > 0
    after = runtime.device.ledger.snapshot()
    for zone in ("weights", "workspace", "activations", "graphs", "kv"):
        assert after[zone][1] == baseline[zone][1], f"{zone} content left after unload"


def test_unload_answers_only_after_every_byte_of_the_model_is_released(runtime):
    """A release fenced on the copy stream must not outlive the unload's reply (it did in CI: a
    loaded 2-core machine let the copy stream lag the compute stream's sync)."""
    def held() -> int:     # booked bytes less the arena's pool of reusable handles
        return runtime.device.ledger.total_committed() - runtime.device.arena.stats()["pooled_bytes"]

    before = held()
    runtime.load_model("dec", "decoder", "tiny", 3)
    list(runtime.generate("dec", [1, 2, 3], 4))
    # keep the copy stream busy past the compute stream's sync, as a loaded host does
    runtime.device.copy_stream.submit("work", lambda: time.sleep(0.3))
    runtime.unload_model("dec")
    assert runtime.device.queue.pending() == 0, "a release of the unloaded model is still queued"
    assert held() == before


def test_a_failed_load_answers_only_after_every_byte_it_booked_is_released(runtime, monkeypatch):
    """Like unload: a load that fails after its weights paged in (on the copy stream) must not
    leave their releases queued behind its error."""
    from gpu_worker.models.paged import PagedDecoderModel
    real_load = PagedDecoderModel.load

    def load_then_fail(model):
        real_load(model)
        runtime.device.copy_stream.submit("work", lambda: time.sleep(0.3))   # a lagging copy stream
        raise RuntimeError("the load failed after its page-ins")

    monkeypatch.setattr(PagedDecoderModel, "load", load_then_fail)
    before = runtime.device.ledger.total_committed() - runtime.device.arena.stats()["pooled_bytes"]
    with pytest.raises(RuntimeError):
        runtime.load_model("dec", "decoder", "tiny", 3)
    assert runtime.device.queue.pending() == 0, "a release of the failed load is still queued"
    held = runtime.device.ledger.total_committed() - runtime.device.arena.stats()["pooled_bytes"]
    assert held == before and runtime.list_models() == []


def test_concurrent_requests_on_one_model_are_serialized_and_each_correct(runtime):
    import threading
    runtime.load_model("dec", "decoder", "tiny", 5)
    runtime.load_model("enc", "encoder", "tiny", 5)
    host = W.load_host(CONFIGS["tiny"], 5)
    prompts = [[(i * k + 3) % 1024 for i in range(5 + 9 * k)] for k in range(1, 5)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            results[k] = [c[0] for c in runtime.generate("dec", prompts[k], 6)]
            runtime.embed("enc", [[1, 2, 3, k]])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for k in range(4):   # another sequence's KV would move logits far beyond a near-tie
        assert len(results[k]) == 6
        assert_greedy_tokens_of(R.DecoderReference(CONFIGS["tiny"], host), prompts[k], results[k],
                                what=f"request {k}: ")
    assert runtime.device.backend.invalidations == 0, "a capture was invalidated under concurrency"


def test_runtime_books_through_a_real_governor_when_one_is_configured(kernel_cache_dir, tmp_path):
    from services.governor.server import start_governor
    server, _ledger = start_governor("127.0.0.1:0", tmp_path / "governor.db")
    try:
        rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                        governor=f"127.0.0.1:{server.port}",
                                        worker_id="w-exec-test")).start()
        try:
            rt.load_model("dec", "decoder", "tiny", 1)
            stream = rt.generate("dec", [1, 2, 3], 300)
            next(stream)                 # the sequence runs: its KV blocks are committed
            stats = rt.stats()
            assert stats["governor_connected"], "the runtime should hold leases from the governor"
            assert rt.budget.used().get("kv", 0) > 0, "KV bytes must be reserved through the governor"
            stream.close()
            deadline = time.monotonic() + 10
            while rt.budget.used().get("kv", 0) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert rt.budget.used().get("kv", 0) == 0, "the idle pool gave its KV back"
        finally:
            rt.close()
    finally:
        server.stop()


def test_runtime_spans_carry_the_model_and_shape(kernel_cache_dir):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    tracer_provider=provider)).start()
    try:
        rt.load_model("enc", "encoder", "tiny", 1)
        rt.embed("enc", [[1, 2, 3], [4, 5, 6]])
    finally:
        rt.close()
    spans = {s.name: dict(s.attributes) for s in exporter.get_finished_spans()}
    assert spans["worker.embed"] == {"model": "enc", "batch": 2, "seq": 3}, spans
    assert spans["worker.load_model"]["config"] == "tiny"


def test_two_models_of_one_config_keep_their_own_weights(runtime):
    runtime.load_model("a", "decoder", "tiny", 1)
    runtime.load_model("b", "decoder", "tiny", 2)
    prompt = [5, 6, 7, 8]
    for model_id, seed in (("a", 1), ("b", 2), ("a", 1)):
        want = R.DecoderReference(CONFIGS["tiny"], W.load_host(CONFIGS["tiny"], seed)).generate(prompt, 4)
        got = [c[0] for c in runtime.generate(model_id, prompt, 4)]
        assert got == want, f"model {model_id} ran with another model's weights"


@pytest.mark.parametrize("probe", ["content", "granules", "content-unprobed"])
def test_a_second_model_loads_under_an_exact_budget_by_paging_out_the_idle_first(
        runtime, probe, monkeypatch):
    """Issue 14 (replacing issue 11's refusal): under a budget with only the second model's probe
    free, the second load reclaims the idle first model's caches and weights instead of being
    refused; each model's next request pages its weights back in and gives the reference tokens;
    never a fault. "content-unprobed" skips the admission probe, so the commit-time refusals alone
    drive the reclaim."""
    from tests.scenarios import second_model_under_an_exact_budget
    if probe == "content-unprobed":
        monkeypatch.setattr(ModelLoader, "admit", lambda self, cfg, model_id: None)
    outcome = second_model_under_an_exact_budget(runtime, probe.split("-")[0],
                                                 kv_at_load=probe != "content-unprobed")
    assert outcome == "loaded", "the idle first model could have been paged out"
    reclaim = runtime.stats()["reclaim"]
    if probe.startswith("content"):  # content bytes cannot hold the granule-rounded commits
        assert reclaim["rounds"] > 0 and reclaim["idle_plans_bytes"] + reclaim["idle_weights_bytes"] > 0, \
            f"the load fit without reclaiming anything: the test proves nothing ({reclaim})"
    cfg = CONFIGS["small"]
    assert [c[0] for c in runtime.generate("a", [5, 6, 7, 8, 9, 10], 4)] == \
        R.DecoderReference(cfg, W.load_host(cfg, 1)).generate([5, 6, 7, 8, 9, 10], 4)
    assert runtime.stats()["arena"]["faults"] == 0


def test_arena_faults_count_unaccounted_device_memory_not_only_underflows(runtime):
    """ArenaStats.faults: underflows + 1 while unaccounted is beyond max(1 %, one granule)."""
    runtime.load_model("dec", "decoder", "tiny", 1)
    assert runtime.stats()["arena"]["faults"] == 0
    backend = runtime.device.backend
    used, _ = runtime.device.truth()
    hidden = backend.create_physical(max(4 * backend.info.granule_bytes,
                                         -(-used // 50 // backend.info.granule_bytes) * backend.info.granule_bytes))
    try:
        stats = runtime.stats()
        assert stats["unaccounted_bytes"] > 0, "an unbooked physical allocation must show as unaccounted"
        assert stats["arena"]["faults"] == 1, "unaccounted memory beyond tolerance is a fault"
    finally:
        backend.release_physical(hidden)
    assert runtime.stats()["arena"]["faults"] == 0


def test_a_model_load_loads_the_whole_kernel_set_so_no_request_compiles_or_loads_a_module(runtime):
    """"No request pays a compile stall": every module is compiled and loaded at LoadModel."""
    runtime.load_model("dec", "decoder", "tiny", 1)
    runtime.load_model("enc", "encoder", "tiny", 1)
    compiled = runtime.compiler.stats()["compiled"]
    loads = runtime.device.backend.calls["load_module"]
    assert loads > 0, "the sim backend did not count module loads: the test proves nothing"
    list(runtime.generate("dec", list(range(1, 40)), 3))      # new prefill and decode shapes
    list(runtime.generate("dec", list(range(1, 300)), 2))
    runtime.embed("enc", [[1, 2, 3], [4, 5, 6]])
    assert runtime.compiler.stats()["compiled"] == compiled, "a request compiled a kernel"
    assert runtime.device.backend.calls["load_module"] == loads, "a request loaded a module"


def test_kernels_from_cache_counts_the_modules_a_load_took_from_a_cache(tmp_path):
    from gpu_worker.kernels import ALL_SOURCES
    modules = len(ALL_SOURCES)
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path / "cold")).start()
    try:
        cold = rt.load_model("a", "decoder", "tiny", 1)
        assert (cold.kernels_compiled, cold.kernels_from_cache) == (modules, 0), "empty disk cache"
        warm = rt.load_model("b", "decoder", "tiny", 2)
        assert (warm.kernels_compiled, warm.kernels_from_cache) == (0, modules), "in-process memo"
    finally:
        rt.close()
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path / "cold")).start()
    try:
        disk = rt.load_model("a", "decoder", "tiny", 1)
        assert (disk.kernels_compiled, disk.kernels_from_cache) == (0, modules), "disk cache"
    finally:
        rt.close()
    # Two loads at once on a cold cache: each counts only its own modules, and the process
    # compiled each module once (a derived "modules - compiled delta" miscounts both).
    import threading
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path / "cold2")).start()
    try:
        results = {}
        threads = [threading.Thread(target=lambda m=m: results.__setitem__(
            m, rt.load_model(m, "decoder", "tiny", 1))) for m in ("x", "y")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r.kernels_compiled + r.kernels_from_cache == modules for r in results.values())
        assert sum(r.kernels_compiled for r in results.values()) == modules
    finally:
        rt.close()


def test_trim_stops_at_its_target_and_reaches_it_when_it_can(runtime):
    for model_id in ("a", "b"):
        runtime.load_model(model_id, "decoder", "tiny", 1)
        list(runtime.generate(model_id, [1, 2, 3, 4], 2))
    plans = {m: runtime._models[m].executor.plans.stats()["entries"] for m in ("a", "b")}
    assert all(plans.values()), plans
    ledger = runtime.device.ledger.total_committed()
    freed, after = runtime.trim(ledger)
    assert (freed, after) == (0, ledger), "a trim to the current ledger dropped something"
    freed, after = runtime.trim(ledger - 1)
    assert freed > 0 and after <= ledger - 1, "trim did not reach a reachable target"
    assert runtime._models["b"].executor.plans.stats()["entries"] == plans["b"], \
        "trim dropped the second model's plans after the first was enough"
    freed, after = runtime.trim(0)
    assert runtime._models["b"].executor.plans.stats()["entries"] == 0
    assert runtime.device.arena.stats()["pooled_bytes"] == 0, "trim to 0 kept retained handles"
    assert [c[0] for c in runtime.generate("a", [1, 2, 3, 4], 2)] == \
        R.DecoderReference(CONFIGS["tiny"], W.load_host(CONFIGS["tiny"], 1)).generate([1, 2, 3, 4], 2)


def test_the_worker_stores_kernels_under_its_cache_namespace(tmp_path):
    """--cache-namespace: the worker's stores land in that namespace, so the cache service's
    per-namespace budget applies to worker traffic."""
    from prometheus_client import CollectorRegistry

    from cache_service.config import ServerConfig
    from cache_service.server import start_cache_server
    from gpu_worker.kernels import ALL_SOURCES
    cache = start_cache_server(ServerConfig(listen="127.0.0.1:0", db=tmp_path / "cache.db",
                                            write_token="t"), registry=CollectorRegistry())
    try:
        rt = WorkerRuntime(WorkerConfig(backend="sim", cache=cache.address, cache_write_token="t",
                                        cache_dir=tmp_path / "kernels", cache_namespace="team-a")).start()
        try:
            rt.load_model("dec", "decoder", "tiny", 1)
            assert rt.cache_client.flush(timeout=30.0), "the stores did not reach the cache service"
        finally:
            rt.close()
        namespaces = {ns.namespace: ns.entries for ns in cache.store.stats().namespaces}
        assert namespaces.get("team-a", 0) >= len(ALL_SOURCES), namespaces
        assert namespaces.get("", 0) == 0, f"worker stores escaped its namespace: {namespaces}"
    finally:
        cache.stop()


def test_the_decode_graph_survives_prefill_shapes_under_the_default_plan_bound(kernel_cache_dir):
    """Under the default --max-plans 2, a prompt prefilled in two chunk shapes (a full chunk, then
    the bucketed remainder) evicted the decode graph before every stream's decode: it was captured
    again for every request. The decode ladder is a plan class bounded by its rungs instead."""
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                         prefill_chunk=32)).start()
    try:
        _decode_graph_survives_prefill_shapes(runtime)
    finally:
        runtime.close()


def _decode_graph_survives_prefill_shapes(runtime):
    runtime.load_model("dec", "decoder", "tiny", 4)
    plans = runtime._get("dec").executor.plans
    assert plans.max_plans == 2
    list(runtime.generate("dec", [7] * 40, 4))          # chunks of 32 and 8 (bucket 16), decode(1)
    misses = plans.stats()["misses"]
    for _ in range(3):
        list(runtime.generate("dec", [8] * 40, 4))
        warm = plans.keys()
        assert ("paged_decode", 1) in warm, warm
    assert plans.stats()["misses"] == misses, "a warm shape was evicted and rebuilt"
    warm = plans.keys()
    assert sum(1 for k in warm if k[0] != "paged_decode") <= plans.max_plans


def test_an_idle_decoders_caches_take_its_slot_state_with_them_and_it_comes_back_unchanged(runtime):
    """The decode slots' device state lives with the plans whose graphs bake its addresses: the
    reclaim order's idle-plans step frees both, and the next request makes them again."""
    from gpu_worker.models.paged import SLOT_TOKENS
    runtime.load_model("dec", "decoder", "tiny", 3)
    first = [c[0] for c in runtime.generate("dec", [5, 6, 7, 8], 6)]
    loaded = runtime._get("dec")
    assert loaded.executor.has_state(SLOT_TOKENS), "a paged decoder keeps slot state at load"
    freed = loaded.drop_caches()
    assert freed > 0 and not loaded.executor.has_state(SLOT_TOKENS), \
        "dropping an idle decoder's caches kept its slot state"
    again = [c[0] for c in runtime.generate("dec", [5, 6, 7, 8], 6)]
    assert again == first, "tokens changed after the slot state was made again"
    assert loaded.executor.has_state(SLOT_TOKENS)
