"""The `gpuplane` command line against a real worker: one call per command, errors as exit codes."""
from __future__ import annotations

import json

import pytest

from gpu_worker.client import WorkerClient
from gpu_worker.user_cli import main

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
