"""gil_handoff_bench runs on any host: its figures are recorded under the names docs quote."""
from __future__ import annotations

import json

from bench import gil_handoff_bench


def test_every_pairing_is_recorded_with_the_target(tmp_path) -> None:
    gil_handoff_bench.main(["--calls", "40", "--trials", "1", "--call-bytes", "4096",
                            "--record", str(tmp_path)])
    [path] = tmp_path.glob("*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    names = {r["metric"] for r in rows}
    for ms in ("0.2", "5"):
        for how in ("hands the GIL over", "keeps the GIL"):
            for who in ("alone", "another thread busy"):
                name = f"a call that {how}, {who}, switch interval {ms} ms"
                assert name in names, name
    [target] = [r for r in rows if r.get("target")]
    assert target["metric"] == "a call that keeps the GIL, busy / alone, switch interval 0.2 ms"
    assert all(r["value"] > 0 for r in rows)
