"""`python -m gpu_worker serve` flags: flag > GPUPLANE_WORKER_* environment > built-in default."""
from __future__ import annotations

import pytest

from gpu_worker.__main__ import build_parser


def test_serve_flags_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPLANE_WORKER_LISTEN", "0.0.0.0:6000")
    monkeypatch.setenv("GPUPLANE_WORKER_BACKEND", "sim")
    monkeypatch.setenv("GPUPLANE_WORKER_GOVERNOR", "gov:1")
    monkeypatch.setenv("GPUPLANE_WORKER_CACHE", "cache:2")
    monkeypatch.setenv("GPUPLANE_KERNEL_VARIANTS_PER_NODE", "9")
    args = build_parser().parse_args(["serve"])
    assert (args.listen, args.backend, args.governor, args.cache, args.variants_per_node) == \
        ("0.0.0.0:6000", "sim", "gov:1", "cache:2", 9), "environment defaults were not applied"


def test_a_flag_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPLANE_WORKER_BACKEND", "sim")
    args = build_parser().parse_args(["serve", "--backend", "cuda", "--max-plans", "3"])
    assert args.backend == "cuda" and args.max_plans == 3, "a flag did not override the environment"


def test_with_nothing_configured_the_worker_runs_alone_with_the_auto_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPUPLANE_WORKER_BACKEND", "GPUPLANE_WORKER_GOVERNOR", "GPUPLANE_WORKER_CACHE"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["serve"])
    assert (args.backend, args.governor, args.cache) == ("auto", "", ""), \
        "the defaults do not run one worker with nothing else installed"


def test_an_unknown_backend_is_refused_at_the_command_line() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--backend", "opencl"])



def test_cache_namespace_and_max_plan_bytes_reach_the_runtime_config(monkeypatch) -> None:
    from gpu_worker.__main__ import worker_config
    monkeypatch.setenv("GPUPLANE_WORKER_CACHE_NAMESPACE", "team-a")
    args = build_parser().parse_args(["serve", "--max-plan-bytes", "1048576"])
    config = worker_config(args)
    assert (config.cache_namespace, config.max_plan_bytes) == ("team-a", 1 << 20)
    assert worker_config(build_parser().parse_args(["serve", "--max-plan-bytes", "0"])).max_plan_bytes \
        is None, "0 must mean no byte bound"


def test_memory_budget_flags_reach_the_runtime_config_and_zero_means_none(monkeypatch) -> None:
    from gpu_worker.__main__ import worker_config
    monkeypatch.setenv("GPUPLANE_WORKER_WEIGHT_BUDGET_BYTES", str(40 << 20))
    args = build_parser().parse_args(["serve", "--host-pinned-budget-bytes", str(1 << 30),
                                      "--lease-chunk-bytes", str(2 << 20)])
    config = worker_config(args)
    assert (config.weight_budget_bytes, config.host_pinned_budget_bytes,
            config.lease_chunk_bytes) == (40 << 20, 1 << 30, 2 << 20)
    monkeypatch.delenv("GPUPLANE_WORKER_WEIGHT_BUDGET_BYTES")
    config = worker_config(build_parser().parse_args(["serve"]))
    assert (config.weight_budget_bytes, config.host_pinned_budget_bytes) == (None, None), \
        "0 must mean no budget"


def test_a_negative_budget_or_empty_lease_chunk_is_refused_before_the_worker_starts() -> None:
    from gpu_worker.__main__ import flag_problem
    assert "weight-budget" in flag_problem(build_parser().parse_args(
        ["serve", "--weight-budget-bytes", "-1"]))
    assert "lease-chunk" in flag_problem(build_parser().parse_args(
        ["serve", "--lease-chunk-bytes", "0"]))
    assert flag_problem(build_parser().parse_args(["serve"])) == ""


def test_embed_batching_flags_reach_the_runtime_config_from_flag_or_environment(monkeypatch) -> None:
    from gpu_worker.__main__ import worker_config
    monkeypatch.setenv("GPUPLANE_EMBED_MAX_BATCH", "8")
    args = build_parser().parse_args(["serve", "--embed-batch-wait-ms", "0.5",
                                      "--embed-max-batch-tokens", "4096"])
    config = worker_config(args)
    assert (config.embed_batch_wait_ms, config.embed_max_batch,
            config.embed_max_batch_tokens) == (0.5, 8, 4096)
    monkeypatch.delenv("GPUPLANE_EMBED_MAX_BATCH")
    config = worker_config(build_parser().parse_args(["serve"]))
    assert (config.embed_batch_wait_ms, config.embed_max_batch) == (2.0, 64), "the defaults"


def test_a_negative_embed_wait_or_empty_embed_batch_is_refused_before_the_worker_starts() -> None:
    from gpu_worker.__main__ import flag_problem
    for flags in (["--embed-batch-wait-ms", "-1"], ["--embed-max-batch", "0"],
                  ["--embed-max-batch-tokens", "0"]):
        assert "embed" in flag_problem(build_parser().parse_args(["serve", *flags])), flags


def test_an_abbreviated_serve_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--max-batch", "8"])
    assert exit_.value.code == 2, "an abbreviation of --max-batch-size was accepted"


def test_min_prefill_share_and_prefill_order_reach_every_decoders_scheduler(monkeypatch,
                                                                           kernels) -> None:
    """--min-prefill-share (GPUPLANE_MIN_PREFILL_SHARE) is the scheduler's prefill floor and
    --prefill-order (GPUPLANE_PREFILL_ORDER) its order; a floor below 1 and an unknown order
    are refused."""
    from gpu_worker import WorkerRuntime
    from gpu_worker.__main__ import worker_config
    from services.common.errors import InvalidArgument
    monkeypatch.setenv("GPUPLANE_MIN_PREFILL_SHARE", "1024")
    monkeypatch.setenv("GPUPLANE_PREFILL_ORDER", "fair")     # not the default
    config = worker_config(build_parser().parse_args(["serve", "--backend", "sim",
                                                      "--cache-dir", str(kernels)]))
    assert (config.min_prefill_share, config.prefill_order) == (1024, "fair")
    runtime = WorkerRuntime(config).start()
    try:
        runtime.load_model("m", "decoder", "tiny", 1)
        scheduler = runtime._get("m").scheduler
        assert (scheduler.min_prefill_share, scheduler.prefill_order) == (1024, "fair")
    finally:
        runtime.close()
    with pytest.raises(InvalidArgument, match="min_prefill_share"):
        worker_config(build_parser().parse_args(["serve", "--min-prefill-share", "0"]))
    assert worker_config(build_parser().parse_args(
        ["serve", "--prefill-order", "shortest"])).prefill_order == "shortest", \
        "the flag beats the env"


def test_an_unknown_prefill_order_is_refused_by_the_flag_the_environment_and_the_config(
        monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_worker.__main__ import flag_problem
    from gpu_worker.config import WorkerConfig
    from services.common.errors import InvalidArgument
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--prefill-order", "sjf"])
    assert exit_.value.code == 2 and "fair" in capsys.readouterr().err
    monkeypatch.setenv("GPUPLANE_PREFILL_ORDER", "sjf")     # argparse checks no default
    assert "--prefill-order" in flag_problem(build_parser().parse_args(["serve"]))
    with pytest.raises(InvalidArgument, match="prefill_order='sjf': use fair or shortest"):
        WorkerConfig(prefill_order="sjf")


def test_the_prefix_cache_and_kv_swap_switches_default_to_the_environment(monkeypatch) -> None:
    """GPUPLANE_PREFIX_CACHE / GPUPLANE_KV_SWAP (1/0, true/false, yes/no, on/off) set the
    defaults; the flags beat them; a bad value exits 2 naming the variable."""
    from gpu_worker.__main__ import worker_config
    monkeypatch.setenv("GPUPLANE_PREFIX_CACHE", "off")
    monkeypatch.setenv("GPUPLANE_KV_SWAP", "no")
    config = worker_config(build_parser().parse_args(["serve"]))
    assert (config.prefix_cache, config.kv_swap) == (False, False)
    config = worker_config(build_parser().parse_args(["serve", "--prefix-cache", "--kv-swap"]))
    assert (config.prefix_cache, config.kv_swap) == (True, True)
    monkeypatch.delenv("GPUPLANE_PREFIX_CACHE")
    monkeypatch.delenv("GPUPLANE_KV_SWAP")
    config = worker_config(build_parser().parse_args(["serve", "--no-prefix-cache"]))
    assert (config.prefix_cache, config.kv_swap) == (False, True)
    monkeypatch.setenv("GPUPLANE_KV_SWAP", "maybe")
    with pytest.raises(SystemExit) as caught:
        build_parser()
    assert caught.value.code == 2


def test_no_kv_demote_keeps_swap_but_drops_evicted_cached_blocks(monkeypatch, kernels) -> None:
    """--no-kv-demote (GPUPLANE_KV_DEMOTE) turns off the demotion of evicted cached prefix
    blocks to pinned host and nothing else: the decoder still swaps preempted sequences."""
    from gpu_worker import WorkerRuntime
    from gpu_worker.__main__ import worker_config
    monkeypatch.setenv("GPUPLANE_KV_DEMOTE", "0")
    config = worker_config(build_parser().parse_args(["serve", "--backend", "sim",
                                                      "--cache-dir", str(kernels)]))
    assert (config.kv_swap, config.kv_demote) == (True, False)
    assert worker_config(build_parser().parse_args(["serve", "--kv-demote"])).kv_demote
    runtime = WorkerRuntime(config).start()
    try:
        runtime.load_model("m", "decoder", "tiny", 1)
        scheduler = runtime._get("m").scheduler
        assert scheduler.kv_swap is not None and scheduler.host_cache is None
    finally:
        runtime.close()


def test_no_dependent_launch_reaches_the_device_and_the_default_is_on_for_sm_90(monkeypatch,
                                                                               kernels) -> None:
    """--no-dependent-launch (GPUPLANE_DEPENDENT_LAUNCH) serializes every launch of the worker's
    device; by default an sm_90 device (the sim models an H200) launches with it."""
    from gpu_worker import WorkerRuntime
    from gpu_worker.__main__ import worker_config
    base = ["serve", "--backend", "sim", "--cache-dir", str(kernels)]
    on = worker_config(build_parser().parse_args(base))
    assert on.dependent_launch
    monkeypatch.setenv("GPUPLANE_DEPENDENT_LAUNCH", "0")
    off = worker_config(build_parser().parse_args(base))
    assert not off.dependent_launch
    assert worker_config(build_parser().parse_args([*base, "--dependent-launch"])).dependent_launch
    for config, want in ((on, True), (off, False)):
        runtime = WorkerRuntime(config).start()
        try:
            assert runtime.device.dependent_launch is want
        finally:
            runtime.close()


def test_the_gil_switch_interval_defaults_short_and_a_bad_value_is_refused(monkeypatch) -> None:
    from gpu_worker.__main__ import flag_problem
    from gpu_worker.config import DEFAULT_GIL_SWITCH_MS
    monkeypatch.delenv("GPUPLANE_WORKER_GIL_SWITCH_MS", raising=False)
    assert build_parser().parse_args(["serve"]).gil_switch_ms == DEFAULT_GIL_SWITCH_MS < 5, \
        "the worker must not keep Python's 5 ms: the edge's loop waits that long for each step"
    monkeypatch.setenv("GPUPLANE_WORKER_GIL_SWITCH_MS", "0.5")
    assert build_parser().parse_args(["serve"]).gil_switch_ms == 0.5
    for bad in ("0", "-1", "nan", "1000"):
        problem = flag_problem(build_parser().parse_args(["serve", "--gil-switch-ms", bad]))
        assert "--gil-switch-ms" in problem, bad


def test_a_served_worker_runs_with_the_gil_switch_interval_it_was_given(tmp_path) -> None:
    from gpu_worker.stack.processes import Stack
    with Stack(tmp_path) as stack:
        worker = stack.start_worker(backend="sim", extra=["--gil-switch-ms", "0.3",
                                                          "--stream-interval", "3",
                                                          "--no-enqueue-keeps-gil"])
        assert "worker serving (GIL switch interval 0.30 ms, stream interval 3, enqueues " \
               "release the GIL)" in worker.log_tail(), worker.log_tail()


def test_enqueues_keep_the_gil_unless_switched_off(monkeypatch) -> None:
    """--no-enqueue-keeps-gil (GPUPLANE_WORKER_ENQUEUE_KEEPS_GIL) reaches the config the
    runtime opens its backend with; the default keeps it (device/cuda_enqueue.py)."""
    from gpu_worker.__main__ import worker_config
    from gpu_worker.config import WorkerConfig
    monkeypatch.delenv("GPUPLANE_WORKER_ENQUEUE_KEEPS_GIL", raising=False)
    assert worker_config(build_parser().parse_args(["serve"])).enqueue_keeps_gil
    assert WorkerConfig().enqueue_keeps_gil
    assert not worker_config(build_parser().parse_args(
        ["serve", "--no-enqueue-keeps-gil"])).enqueue_keeps_gil
    monkeypatch.setenv("GPUPLANE_WORKER_ENQUEUE_KEEPS_GIL", "off")
    assert not worker_config(build_parser().parse_args(["serve"])).enqueue_keeps_gil
    assert worker_config(build_parser().parse_args(
        ["serve", "--enqueue-keeps-gil"])).enqueue_keeps_gil


def test_the_stream_interval_defaults_to_a_message_a_token_and_a_bad_value_is_refused(
        monkeypatch) -> None:
    from gpu_worker.__main__ import flag_problem
    monkeypatch.delenv("GPUPLANE_WORKER_STREAM_INTERVAL", raising=False)
    assert build_parser().parse_args(["serve"]).stream_interval == 1
    monkeypatch.setenv("GPUPLANE_WORKER_STREAM_INTERVAL", "4")
    assert build_parser().parse_args(["serve"]).stream_interval == 4
    for bad in (["--stream-interval", "0"], ["--stream-interval", "1025"],
                ["--stream-interval", "9", "--max-stream-buffer-tokens", "8"]):
        problem = flag_problem(build_parser().parse_args(["serve", *bad]))
        assert "--stream-interval" in problem, bad
