"""deploy.render: every overlay renders with real kustomize and validates strictly offline."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy import render as deploy_render


def test_the_dev_and_prod_overlays_exist():
    assert {"dev", "prod"} <= set(deploy_render.overlays()), "deploy/overlays must hold dev and prod"


def test_every_overlay_renders_and_passes_strict_schema_validation(kubectl, tmp_path: Path):
    written = deploy_render.write_all(tmp_path, check=True)
    assert [p.name for p in written] == [f"{n}.yaml" for n in deploy_render.overlays()], (
        "write_all must write one file per overlay"
    )
    for path in written:
        kinds = {d["kind"] for d in yaml.safe_load_all(path.read_text()) if d}
        assert {"Deployment", "StatefulSet", "DaemonSet"} <= kinds, f"{path.name} lost a workload"
    assert not list(tmp_path.glob("*.tmp")), "a rendered file was left half-published"


def test_strict_validation_rejects_an_unknown_field(kubectl, tmp_path: Path):
    # Negative control: without it, a validator that accepts anything would pass the test above.
    docs = [d for d in yaml.safe_load_all(deploy_render.render("prod")) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    deployment["spec"]["replicsa"] = 3
    bad = tmp_path / "typo.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    with pytest.raises(deploy_render.RenderError, match="typo.yaml"):
        deploy_render.validate(bad)


def test_render_cli_writes_one_file_per_overlay(kubectl, tmp_path: Path, capsys):
    assert deploy_render.main(["--out", str(tmp_path / "m"), "--validate"]) == 0, "the CLI failed"
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == sorted(f"{n}.yaml" for n in deploy_render.overlays()), (
        "`make manifests` must leave exactly one <overlay>.yaml per overlay"
    )
    assert capsys.readouterr().out.count(".yaml") == len(names), "the CLI must print each path"


def test_an_unknown_overlay_is_refused_and_the_known_ones_are_named(kubectl):
    with pytest.raises(deploy_render.RenderError, match="prod"):
        deploy_render.render("staging")


def test_a_kustomize_error_surfaces_with_kustomize_s_message(kubectl, tmp_path: Path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(deploy_render.RenderError, match="missing.yaml"):
        deploy_render.render(tmp_path)
