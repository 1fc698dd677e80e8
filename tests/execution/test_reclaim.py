"""Issue 14 on the sim backend: offload and wake, the one reclaim order, idle-only stripping,
failed page-ins, the weight and pinned host budgets (WorkerRuntime with real NVRTC)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker import WorkerConfig, WorkerRuntime
from gpu_worker.core.reclaim import STEPS
from gpu_worker.device.backend import DeviceError
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

PROMPT = [4, 8, 15, 16, 23, 42]


def reference_tokens(seed: int, n: int = 4, config: str = "tiny") -> list[int]:
    cfg = CONFIGS[config]
    return R.DecoderReference(cfg, W.load_host(cfg, seed)).generate(PROMPT, n)


def tokens(rt: WorkerRuntime, model_id: str, n: int = 4) -> list[int]:
    return [c[0] for c in rt.generate(model_id, PROMPT, n)]


def info(rt: WorkerRuntime, model_id: str):
    return next(m for m in rt.list_models() if m.model_id == model_id)


def plan_count(rt: WorkerRuntime, model_id: str) -> int:
    return rt._get(model_id).executor.plans.stats()["entries"]


@pytest.fixture
def runtime(kernel_cache_dir):
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir)).start()
    yield rt
    rt.close()


def test_offload_then_wake_gives_identical_tokens(runtime):
    runtime.load_model("dec", "decoder", "tiny", 3)
    first = tokens(runtime, "dec")
    assert first == reference_tokens(3)
    content_before = runtime.device.ledger.snapshot()["weights"][1]
    assert plan_count(runtime, "dec") > 0
    offloaded, freed = runtime.offload_model("dec")
    assert offloaded.state == "offloaded" and offloaded.resident_bytes == 0
    assert freed >= offloaded.weight_bytes, "the reply does not count the weights it paged out"
    assert plan_count(runtime, "dec") == 0, "offload keeps the model's plans"
    assert runtime._get("dec").executor.kernels.stats()["entries"] == 0, "offload keeps variants"
    # Content, not committed bytes: a tiny model's weights share their edge granules with its KV.
    assert runtime.device.ledger.snapshot()["weights"][1] == content_before - offloaded.weight_bytes
    assert tokens(runtime, "dec") == first, "the woken model generates other tokens"
    woken = info(runtime, "dec")
    assert woken.state == "resident" and woken.resident_bytes == woken.weight_bytes
    assert runtime.stats()["arena"]["faults"] == 0


def test_an_offloaded_encoder_wakes_on_embed_with_identical_embeddings(runtime):
    runtime.load_model("enc", "encoder", "tiny", 2)
    seqs = [[1, 2, 3, 4], [9, 8, 7, 6]]
    before = runtime.embed("enc", seqs)
    runtime.offload_model("enc")
    assert info(runtime, "enc").state == "offloaded"
    np.testing.assert_array_equal(runtime.embed("enc", seqs), before)
    assert info(runtime, "enc").state == "resident"


def test_offload_refuses_unknown_models_and_changes_nothing(runtime):
    runtime.load_model("dec", "decoder", "tiny", 1)
    snapshot = runtime.device.ledger.snapshot()
    with pytest.raises(NotFound):
        runtime.offload_model("nope")
    assert runtime.device.ledger.snapshot() == snapshot
    assert info(runtime, "dec").state == "resident"


def test_the_reclaim_order_drops_plans_of_idle_models_before_any_weights(runtime):
    for model_id, seed in (("a", 1), ("b", 2)):
        runtime.load_model(model_id, "decoder", "tiny", seed)
        tokens(runtime, model_id)
    small = runtime.reclaimer.reclaim(1)
    assert [s.step for s in small.steps] == ["completed_releases", "cached_kv", "idle_plans"], small
    assert small.steps[2].freed_bytes > 0 and small.freed_bytes >= 1
    assert all(info(runtime, m).state == "resident" for m in ("a", "b")), \
        "weights went although dropping plans already freed enough"
    everything = runtime.reclaimer.reclaim(1 << 40)
    assert [s.step for s in everything.steps] == list(STEPS), "the steps ran out of order"
    weights = everything.steps[STEPS.index("idle_weights")]
    assert set(weights.models) == {"a", "b"}
    assert all(info(runtime, m).state == "offloaded" for m in ("a", "b"))
    assert runtime.device.ledger.snapshot()["weights"][1] == 0
    stats = runtime.stats()["reclaim"]
    assert stats["idle_plans_bytes"] > 0 and stats["rounds"] == 2
    for model_id, seed in (("a", 1), ("b", 2)):
        assert tokens(runtime, model_id) == reference_tokens(seed), f"{model_id} woke wrong"


def test_a_busy_model_is_never_stripped_only_its_newest_sequence_preempted(runtime):
    """A decoder with a running sequence keeps its weights and plans through the whole order; the
    last step preempts the sequence (its KV goes) and its stream continues with the same tokens."""
    runtime.load_model("busy", "decoder", "tiny", 5)
    runtime.load_model("idle", "decoder", "tiny", 6)
    tokens(runtime, "busy")
    tokens(runtime, "idle")
    stream = runtime.generate("busy", PROMPT, 300)
    got = [next(stream)[0]]           # the engine runs it, its weights pinned between steps
    assert runtime._get("busy").busy()
    report = runtime.reclaimer.reclaim(1 << 40)
    stripped = [s for s in report.steps if s.step != "kv_preemption" and "busy" in s.models]
    assert not stripped, report
    assert "busy" in report.steps[STEPS.index("kv_preemption")].models, report
    assert "idle" in report.steps[STEPS.index("idle_weights")].models
    assert info(runtime, "busy").state == "resident", "a running model lost its weights"
    got += [c[0] for c in stream]
    cfg = CONFIGS["tiny"]
    want = R.DecoderReference(cfg, W.load_host(cfg, 5)).generate(PROMPT, 300)
    assert got == want, "the preempted stream changed its tokens"
    assert runtime.stats()["scheduler"]["preemptions"] >= 1
    with pytest.raises(FailedPrecondition, match="in use"):   # pinned slots are never paged out
        keys = runtime._get("busy").executor._slot_keys()
        runtime.device.weights.pin(keys)
        try:
            runtime.device.weights.page_out(keys)
        finally:
            runtime.device.weights.unpin(keys)


def test_a_failed_page_in_leaves_nothing_mapped_to_wrong_bytes(runtime):
    runtime.load_model("dec", "decoder", "tiny", 7)
    runtime.offload_model("dec")
    runtime.device.backend.fail_next("copy_h2d_async")
    with pytest.raises(DeviceError):
        list(runtime.generate("dec", PROMPT, 2))
    runtime.device.synchronize()
    runtime.device.arena.collect()
    slots = runtime.device.weights
    keys = runtime._get("dec").executor._slot_keys()
    poisoned = [k for k in keys if slots.get(k).state == "poisoned"]
    assert len(poisoned) == 1, "the failed copy did not poison exactly its slot"
    # Its pages are gone: nothing the next request could read holds stale or partial bytes.
    assert slots.resident_bytes(poisoned) == 0
    with pytest.raises(FailedPrecondition, match="poisoned"):
        list(runtime.generate("dec", PROMPT, 2))
    assert info(runtime, "dec").state in ("partial", "offloaded")
    runtime.unload_model("dec")
    assert runtime.device.ledger.snapshot()["weights"] == (0, 0)


def test_a_model_too_large_to_stream_through_the_weight_budget_is_refused_and_changes_nothing(
        kernel_cache_dir):
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    weight_budget_bytes=2 << 20)).start()
    try:
        before = rt.device.ledger.snapshot()
        with pytest.raises(ResourceExhausted, match="weight budget") as e:
            rt.load_model("big", "decoder", "tiny", 1)
        assert e.value.zone == "weights" and e.value.asked_bytes > 2 << 20
        assert rt.list_models() == [] and rt.device.ledger.snapshot() == before
    finally:
        rt.close()


def test_exhausting_the_pinned_host_budget_is_a_clear_error_that_changes_nothing(
        kernel_cache_dir):
    rt = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=kernel_cache_dir,
                                    host_pinned_budget_bytes=100_000)).start()
    try:
        before = rt.device.ledger.snapshot()
        with pytest.raises(ResourceExhausted, match="pinned host"):
            rt.load_model("dec", "decoder", "tiny", 1)
        assert rt.list_models() == [] and rt.device.ledger.snapshot() == before
        assert rt.device.weights.stats()["host_bytes"] == 0, "a refused load kept pinned copies"
    finally:
        rt.close()


def test_budgets_must_be_positive():
    with pytest.raises(InvalidArgument):
        WorkerRuntime(WorkerConfig(backend="sim", weight_budget_bytes=0))
    with pytest.raises(InvalidArgument):
        WorkerRuntime(WorkerConfig(backend="sim", host_pinned_budget_bytes=-1))


def test_reclaims_racing_requests_never_deadlock_and_never_change_a_token(runtime):
    """Two models serve requests on two threads while a third thread keeps running the whole
    reclaim order (as governor asks would) and offloading them: each request still gives the
    reference tokens (a model is stripped only between its requests), and everything finishes."""
    import threading

    seeds = {"a": 11, "b": 12}
    for model_id, seed in seeds.items():
        runtime.load_model(model_id, "decoder", "tiny", seed)
    want = {m: reference_tokens(s, 3) for m, s in seeds.items()}
    errors: list[BaseException] = []
    done = threading.Event()
    wrong: list[str] = []

    def serve(model_id: str) -> None:
        try:
            for _ in range(6):
                if tokens(runtime, model_id, 3) != want[model_id]:
                    wrong.append(model_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def strip() -> None:
        try:
            i = 0
            while not done.is_set():
                runtime.reclaimer.reclaim(1 << 40, reason="governor")
                runtime.offload_model("ab"[i % 2])
                i += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    servers = [threading.Thread(target=serve, args=(m,)) for m in seeds]
    stripper = threading.Thread(target=strip)
    for t in (*servers, stripper):
        t.start()
    for t in servers:
        t.join(timeout=120)
    done.set()
    stripper.join(timeout=30)
    assert not any(t.is_alive() for t in (*servers, stripper)), "a thread hung: deadlock"
    assert not errors, f"a thread failed: {errors[:1]}"
    assert not wrong, f"models {wrong} gave other tokens after being stripped"
    assert runtime.stats()["reclaim"]["rounds"] > 0 and runtime.stats()["arena"]["faults"] == 0
