"""The `gpuplane` command line against a real worker: one call per command, errors as exit codes."""
from __future__ import annotations

import json

import pytest

from gpu_worker.edge.client import WorkerClient
from gpu_worker.edge.user_cli import main

from .conftest import DECODER, ENCODER


def _run(worker: WorkerClient, capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["--worker", worker.target, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_prints_the_same_tokens_the_client_gets(worker: WorkerClient, capsys) -> None:
    want = worker.generate(DECODER, [1, 2, 3], 4).tokens
    code, out, _ = _run(worker, capsys, "generate", "--model-id", DECODER, "--tokens", "1,2,3",
                        "--max-new-tokens", "4", "--json")
    assert code == 0, "gpuplane generate failed"
    assert json.loads(out)["tokens"] == want, "the CLI printed other tokens than the service produced"


def test_stats_prints_the_zones_and_caches(worker: WorkerClient, capsys) -> None:
    code, out, _ = _run(worker, capsys, "stats")
    assert code == 0 and "weights" in out and "kernel cache:" in out, f"stats output incomplete:\n{out}"
    code, out, _ = _run(worker, capsys, "stats", "--json")
    assert code == 0 and json.loads(out)["backend"] == "sim", "stats --json is not the stats message"


def test_embed_and_models_commands_work(worker: WorkerClient, capsys) -> None:
    code, out, _ = _run(worker, capsys, "embed", "--model-id", ENCODER, "--tokens", "1,2",
                        "--tokens", "3,4", "--json")
    assert code == 0 and len(json.loads(out)) == 2, "embed did not print one vector per sequence"
    code, out, _ = _run(worker, capsys, "models")
    assert code == 0 and DECODER in out and ENCODER in out, "models does not list the loaded models"


def test_a_refused_call_exits_1_with_the_status_name(worker: WorkerClient, capsys) -> None:
    code, _, err = _run(worker, capsys, "generate", "--model-id", "nope", "--tokens", "1")
    assert code == 1, "a refused call did not exit 1"
    assert "NOT_FOUND" in err, f"the status is not named for the user: {err!r}"


def test_resources_prints_the_governors_ledger_per_worker_and_zone(tmp_path, capsys) -> None:
    import grpc
    from gpuplane.governor.v1 import governor_pb2, governor_pb2_grpc
    from opentelemetry.sdk.trace import TracerProvider

    from services.governor.server import start_governor

    server, _ = start_governor("127.0.0.1:0", tmp_path / "governor.db", tracer_provider=TracerProvider())
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = governor_pb2_grpc.GovernorServiceStub(channel)
            stub.RegisterWorker(governor_pb2.RegisterWorkerRequest(
                worker_id="cli-worker", host="h", device=governor_pb2.Device(
                    uuid="GPU-cli", total_bytes=8 << 30, free_bytes=8 << 30, granule_bytes=2 << 20)),
                timeout=5)
            stub.Acquire(governor_pb2.AcquireRequest(worker_id="cli-worker", device_uuid="GPU-cli",
                                                     zone=governor_pb2.ZONE_KV, bytes=64 << 20),
                         timeout=5)
        assert main(["--governor", server.address, "resources"]) == 0, "resources failed"
        out = capsys.readouterr().out
        assert "GPU-cli" in out and "cli-worker" in out, f"resources lacks the device or worker:\n{out}"
        assert main(["--governor", server.address, "resources", "--json"]) == 0
        devices = json.loads(capsys.readouterr().out)["devices"]
        assert int(devices[0]["leased_bytes"]) == 64 << 20, "resources --json misreports the lease"
    finally:
        server.stop(grace=1.0)


def test_offload_prints_the_new_state_and_models_shows_it(worker: WorkerClient, capsys) -> None:
    code, out, _ = _run(worker, capsys, "offload", "--model-id", ENCODER)
    assert code == 0 and "state offloaded" in out, f"offload output: {out!r}"
    code, out, _ = _run(worker, capsys, "models")
    line = next(x for x in out.splitlines() if x.startswith(ENCODER))
    assert "offloaded" in line, f"models does not show the state: {line!r}"
    worker.embed(ENCODER, [[1, 2]])                      # wakes it
    code, out, _ = _run(worker, capsys, "models", "--json")
    state = {m["model_id"]: m["state"] for m in json.loads(out)}
    assert state[ENCODER] == "resident"


def test_load_help_explains_the_model_flags_and_lists_every_config(capsys) -> None:
    from gpu_worker.models.configs import CONFIGS

    with pytest.raises(SystemExit):
        main(["load", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--model-id", "--family", "--config", "--seed", "--checkpoint", "--weight-format"):
        assert f"{flag} " in text, f"load --help lacks {flag}"
    assert "the name later commands use for this model" in text, "--model-id is not explained"
    for name in CONFIGS:
        assert name in text, f"load --help does not list the config {name}"
    assert "{int4,fp16}" in text and "{,int4" not in text, "--weight-format shows an empty choice"


def test_weight_format_without_a_checkpoint_is_a_usage_error(worker: WorkerClient, capsys) -> None:
    code, _, err = _run(worker, capsys, "load", "--model-id", "x", "--weight-format", "fp16")
    assert code == 2 and err.startswith("gpuplane load: error: --weight-format applies to "), err


def test_a_missing_prompt_is_a_usage_error_in_the_common_format(worker: WorkerClient, capsys) -> None:
    code, _, err = _run(worker, capsys, "generate", "--model-id", DECODER)
    assert code == 2, "a command that cannot run must exit 2 (usage)"
    assert err.startswith("gpuplane generate: error: give a prompt"), err


def test_stats_prints_sizes_for_people_and_explains_content_above_committed(
        worker: WorkerClient, capsys) -> None:
    stats = worker.stats()
    code, out, _ = _run(worker, capsys, "stats")
    assert code == 0 and " MiB" in out, f"stats printed no human-readable sizes:\n{out}"
    above = [z for z in stats.zones if z.content_bytes > z.committed_bytes]
    marked = [line for line in out.splitlines() if "above committed*" in line]
    assert len(marked) == len(above), "every zone with content above committed, and only those, " \
        "must be marked"
    assert ("* content above committed: the arena carves" in out) == bool(above), \
        "the mark must be explained exactly when it is shown"


def test_zone_rows_mark_only_content_above_committed_and_explain_it_once() -> None:
    from gpuplane.governor.v1 import governor_pb2

    from services.governor.report import CONTENT_ABOVE_COMMITTED, zone_rows

    flat = [governor_pb2.ZoneUsage(zone=governor_pb2.ZONE_KV, committed_bytes=4 << 20,
                                   content_bytes=3 << 20)]
    assert zone_rows(flat) == [
        "kv           committed     4.0 MiB  content     3.0 MiB"], "negative control: no mark"
    shared = flat + [governor_pb2.ZoneUsage(zone=governor_pb2.ZONE_WORKSPACE,
                                            committed_bytes=2 << 20, content_bytes=(2 << 20) + 512)]
    rows = zone_rows(shared)
    assert rows[1].endswith("(content 512 B above committed*)") and rows[-1] == CONTENT_ABOVE_COMMITTED
    assert len(rows) == 3, "the explanation is printed once, after the zones"


def test_json_output_carries_sizes_as_numbers_for_machines(worker: WorkerClient, capsys) -> None:
    code, out, _ = _run(worker, capsys, "stats", "--json")
    stats = json.loads(out)
    assert code == 0 and isinstance(stats["device_used_bytes"], int), \
        "--json must print sizes as numbers, not the quoted int64 of proto3 JSON"
    assert all(isinstance(z["committed_bytes"], int) for z in stats["zones"])
    code, out, _ = _run(worker, capsys, "trim", "--target-bytes", "1GiB", "--json")
    assert code == 0 and isinstance(json.loads(out)["ledger_bytes"], int), "trim ignores --json"


def test_both_resources_commands_print_one_rendering_of_the_ledger(tmp_path, capsys) -> None:
    """`gpuplane resources` and `python -m services.governor resources` share one view."""
    import subprocess
    import sys

    import grpc
    from gpuplane.governor.v1 import governor_pb2 as pb
    from gpuplane.governor.v1 import governor_pb2_grpc

    from gpu_worker.edge.user_cli import main
    from services.governor.server import start_governor
    from tests.governor.test_servicer import register
    server, _ = start_governor("127.0.0.1:0", tmp_path / "gov.sqlite")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = governor_pb2_grpc.GovernorServiceStub(channel)
            register(stub, "w1")
            stub.Acquire(pb.AcquireRequest(worker_id="w1", zone=pb.ZONE_KV, bytes=8 << 20),
                         timeout=5)
        assert main(["--governor", server.address, "resources"]) == 0
        ours = capsys.readouterr().out
        theirs = subprocess.run([sys.executable, "-m", "services.governor", "resources",
                                 "--target", server.address], capture_output=True, text=True,
                                check=True, timeout=60).stdout
    finally:
        server.stop(grace=0)
    assert "worker w1" in ours and "kv" in ours, f"the ledger was not printed: {ours!r}"
    assert ours == theirs, "the two resources commands disagree"
