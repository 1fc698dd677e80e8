"""The executor on the sim backend: NVRTC compiles every kernel for real, launches run the NumPy
kernels against simulated device memory, so use-after-free is observable (IllegalAddress)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_worker.device.backend import DeviceError, IllegalAddress
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.encoder import EncoderModel

# Above 16 rows the linears round x and W to fp16 (the reference does too), so an f32
# summation-order difference that crosses an fp16 rounding boundary moves a value by 2^-11 relative.
ATOL = 1e-3


def encoder(device, compiler, config="tiny-encoder", seed=1, **kw):
    ex = ModelExecutor(device, compiler, **kw)
    model = EncoderModel(ex, CONFIGS[config], seed)
    model.load()
    return ex, model, R.EncoderReference(CONFIGS[config], W.load_host(CONFIGS[config], seed))


def seqs(batch, seq, salt=0):
    return [[(b * 131 + t * 17 + salt) % 1024 for t in range(seq)] for b in range(batch)]


def zone_content(device, zone):
    return device.ledger.snapshot()[zone][1]


def test_kernel_variants_stay_bounded_under_24_distinct_shapes_with_correct_results(device, compiler):
    ex, model, ref = encoder(device, compiler, max_plans=2)
    shapes = [(b, s) for b in (1, 2, 3) for s in (5, 9, 17, 24, 31, 40, 48, 63)]
    assert len(set(shapes)) == 24
    for batch, seq in shapes:
        got = model.embed(seqs(batch, seq))
        want = ref.embed(np.array(seqs(batch, seq)))
        assert np.allclose(got, want, atol=ATOL), f"wrong embeddings at shape {(batch, seq)}"
        s = ex.kernels.stats()
        assert s["max_variants_per_node"] <= ex.kernels.bound, f"variant bound broken at {(batch, seq)}: {s}"
        shared = ex.shared_workspace_bytes() + device.blas_stats()["workspace_bytes"]
        assert zone_content(device, "workspace") == s["workspace_bytes"] + shared, \
            "the ledger's workspace zone must hold exactly the kernel cache's workspaces, the " \
            "model's dequantization tile and the device's BLAS workspace"
        assert ex.plans.stats()["entries"] <= 2, "plan bound broken"
        assert zone_content(device, "activations") == ex.plans.stats()["activation_bytes"], \
            "the ledger's activations zone must hold exactly the plans' arenas"
    assert ex.kernels.stats()["evictions"] > 0


def test_encoder_embeddings_match_the_reference(device, compiler):
    _, model, ref = encoder(device, compiler)
    batch = seqs(4, 33, salt=5)
    got = model.embed(batch)
    assert got.shape == (4, CONFIGS["tiny-encoder"].hidden) and got.dtype == np.float32
    assert np.allclose(got, ref.embed(np.array(batch)), atol=ATOL), "encoder embeddings diverged"


def test_a_plan_rebuilt_after_eviction_gives_bit_identical_output(device, compiler):
    ex, model, _ = encoder(device, compiler, max_plans=1, variants_per_node=1)
    first = model.embed(seqs(2, 30))
    model.embed(seqs(3, 21))                       # evicts the (2, 30) plan and its variants
    assert ("encode", 2, 30) not in ex.plans.keys(), "the LRU plan should have been evicted"  # noqa: SIM118 - PlanCache, not a dict
    again = model.embed(seqs(2, 30))
    assert np.array_equal(first, again), "a rebuilt plan changed the output bits"


def test_evicting_variants_without_workspaces_keeps_the_graphs_that_baked_them(device, compiler):
    # the encoder's ops own no workspace (the dequantization tile is the model's): an eviction
    # frees nothing, so plan A's graph stays valid and replays with the same bits
    ex, model, ref = encoder(device, compiler, config="small-encoder", variants_per_node=1)
    a, b = seqs(2, 20), seqs(1, 30, salt=3)
    first = model.embed(a)
    plan_a = ex.plans.get(("encode", 2, 20))
    graph = plan_a.graph_exec
    assert graph is not None
    model.embed(b)                                  # evicts every variant plan A's graph baked
    assert ex.kernels.stats()["evictions"] > 0 and ex.kernels.stats()["workspace_bytes"] == 0
    assert plan_a.graph_exec is graph, "a graph was reset though nothing it baked was freed"
    again = model.embed(a)                          # a replay of the same graph
    device.synchronize()
    assert np.array_equal(first, again) and np.allclose(first, ref.embed(np.array(a)), atol=ATOL)


def test_negative_control_replay_after_a_free_without_reset_is_a_use_after_free(device, compiler):
    ex, model, _ = encoder(device, compiler, config="small-encoder")
    model.embed(seqs(4, 200))                       # an activation arena of several granules
    plan = ex.plans.get(("encode", 4, 200))
    assert ex.tile is not None, "800 rows run on tensor cores, through the dequantization tile"
    # what freeing the scratch the graph baked, without resetting the graph first, would do
    for alloc in [ex.tile, plan.arena_alloc, *(a for _, v in plan.steps for a in v.workspaces.values())]:
        device.arena.free(alloc)
    ex.tile, plan.arena_alloc = None, None
    deadline = time.monotonic() + 10                # the fenced releases run once both streams pass
    while device.arena.stats()["pending_releases"] and time.monotonic() < deadline:
        device.synchronize(device.copy_stream)
        device.synchronize()
        device.arena.collect()
    assert device.arena.stats()["pending_releases"] == 0, "the freed workspaces were never unmapped"
    with pytest.raises(IllegalAddress):
        device.replay(plan.graph_exec)
        device.synchronize()


def test_two_throwing_runs_on_new_shapes_then_a_third_keep_the_plan_bound(device, compiler):
    ex, model, ref = encoder(device, compiler, max_plans=2)
    model.embed(seqs(1, 8))
    device.backend.fail_next("launch")              # fails inside the capture of a new plan
    with pytest.raises(DeviceError):
        model.embed(seqs(1, 9))
    device.backend.fail_next("instantiate")         # fails after the capture of another
    with pytest.raises(DeviceError):
        model.embed(seqs(1, 10))
    got = model.embed(seqs(1, 11))
    assert np.allclose(got, ref.embed(np.array(seqs(1, 11))), atol=ATOL)
    stats = ex.plans.stats()
    assert stats["entries"] <= 2, f"plan bound broken after throwing runs: {ex.plans.keys()}"
    assert zone_content(device, "activations") == stats["activation_bytes"], \
        "a plan outside the LRU still holds activations (zombie)"
    assert zone_content(device, "graphs") == stats["graph_bytes"], "a failed capture leaked graph memory"
    assert not device.backend.is_capturing(device.stream), "a failed capture left the stream capturing"


def test_trim_and_close_release_every_byte_the_model_booked(device, compiler):
    before = device.ledger.snapshot()
    ex, model, _ = encoder(device, compiler)
    model.embed(seqs(2, 12))
    assert ex.trim() > 0 and ex.plans.stats()["entries"] == 0 and ex.kernels.stats()["entries"] == 0
    model.embed(seqs(2, 12))                        # rebuilds on demand after a trim
    ex.close()
    device.synchronize()
    after = device.ledger.snapshot()
    for zone in ("workspace", "activations", "graphs", "kv"):
        assert after[zone][1] == before[zone][1], f"zone {zone} still holds content after close"


def test_eager_and_captured_runs_agree_bit_for_bit(device, compiler):
    _ex, model, _ = encoder(device, compiler)
    captured = model.embed(seqs(2, 16))
    model.capture = False
    eager = model.embed(seqs(2, 16))
    assert np.array_equal(captured, eager), "graph replay and eager launches differ"
