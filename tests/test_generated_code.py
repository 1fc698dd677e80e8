"""The committed code in gen/ is exactly what `make proto` produces from protos/."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_has_not_drifted_from_the_protos(tmp_path: pathlib.Path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True, capture_output=True,
    )
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(ROOT / "gen"): p.read_bytes()
        for p in (ROOT / "gen").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert fresh.keys() == committed.keys(), "run `make proto`: files added or removed in protos/"
    stale = [str(k) for k in fresh if fresh[k] != committed[k]]
    assert not stale, f"run `make proto`: gen/ is stale for {stale}"


def test_every_enum_starts_with_unspecified():
    from gpuplane.governor.v1 import governor_pb2
    from gpuplane.kernelcache.v1 import kernel_cache_pb2
    from gpuplane.worker.v1 import worker_pb2

    for module in (governor_pb2, kernel_cache_pb2, worker_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values[0].name.endswith("_UNSPECIFIED") and enum.values[0].number == 0, enum.name
