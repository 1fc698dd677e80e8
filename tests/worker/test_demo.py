"""`make run` end to end on the sim backend, shortened: the report it writes must tell the truth."""
from __future__ import annotations

import json
import pathlib

import pytest

from gpu_worker.stack.demo import INCIDENT_LENGTHS, main, prompt_lengths

pytestmark = pytest.mark.slow


def test_prompt_lengths_keep_the_incidents_shape_and_fit_the_context() -> None:
    full = prompt_lengths(1024, 8)
    assert len(full) == 12 and full == sorted(full), "the replay is not 12 ascending lengths"
    assert full[-1] + 8 <= 1024, "the longest prompt plus its new tokens overflows the context"
    assert full[0] / full[-1] == pytest.approx(INCIDENT_LENGTHS[0] / INCIDENT_LENGTHS[-1], rel=0.05), \
        "the lengths are not the incident's, scaled"
    short = prompt_lengths(1024, 8, 3)
    assert short[0] == full[0] and short[-1] == full[-1] and len(short) == 3, \
        "a shortened replay lost the shortest or the longest length"


def test_the_demo_replays_warms_a_second_host_reports_and_stops_cleanly(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--backend", "sim", "--var-dir", str(tmp_path), "--requests", "3",
                 "--max-new-tokens", "2"]) == 0, "the demo failed"
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (tmp_path / "report" / "memory.png").stat().st_size > 0, "no plot written"
    rows = report["requests"]
    assert [r["prompt_tokens"] for r in rows] == report["prompt_lengths"] + \
        report["prompt_lengths"][::-1], "the replay is not ascending then descending"
    assert len(rows) == len(out.split(" asc ")) - 1 + len(out.split(" desc ")) - 1, \
        "the printed table does not have a row per request"
    assert report["host_b"]["compiled"] == 0 and report["host_b"]["compile_remote_hits"] > 0, \
        "the second host did not warm from the shared cache"
    assert report["summary"]["peak_descending_bytes"] <= report["summary"]["peak_ascending_bytes"], \
        "memory grew on the descending pass"
    assert all(r["governor_connected"] for r in rows), "the worker was not booking with the governor"
    assert "exit codes: host-b 0, host-a 0, cache 0, governor 0" in out, \
        f"the stack did not stop cleanly:\n{out[-400:]}"
