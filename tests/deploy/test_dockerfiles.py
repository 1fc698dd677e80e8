"""Container files: the properties the manifests rely on, read from the Dockerfiles themselves.

No image is built here (CI has no container daemon and no base-image registry); these checks keep
the Dockerfiles and the rendered pods in agreement: user, ports, entry module, base, pins.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from deploy import render as deploy_render

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {  # image -> (entry module, gRPC port, base image pattern)
    "worker": ("gpu_worker", 50071, r"nvidia/cuda:[\d.]+-runtime-"),
    "cache": ("cache_service", 50051, r"python:3\.1[1-9][\w.-]*-slim"),
    "governor": ("services.governor", 50061, r"python:3\.1[1-9][\w.-]*-slim"),
}


def instructions(image: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/<image>.Dockerfile, continuation lines joined."""
    text = (ROOT / "deploy" / f"{image}.Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage(image: str) -> list[tuple[str, str]]:
    steps = instructions(image)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def base_image(image: str) -> str:
    steps = instructions(image)
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    ref = final_stage(image)[0][1].split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_image_runs_as_a_numeric_non_root_user(image):
    users = [a for w, a in final_stage(image) if w == "USER"]
    assert users, f"{image}: the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, (
        f"{image}: USER {users[-1]} must be numeric and non-zero so runAsNonRoot can verify it"
    )


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_image_starts_from_the_agreed_base(image):
    assert re.match(IMAGES[image][2], base_image(image)), f"{image}: base {base_image(image)}"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_image_installs_only_from_package_registries_with_exact_pins(image):
    steps = instructions(image)
    for word, args in steps:
        assert not (word == "ADD" and re.search(r"https?://", args)), f"{image}: ADD of a URL"
        if word == "RUN":
            assert not re.search(r"\b(curl|wget)\b|https?://", args), f"{image}: download in {args}"
            if "pip install" in args:
                assert "-c constraints.txt" in args, f"{image}: pip must use constraints.txt"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_image_runs_its_service_module(image):
    module, port, _ = IMAGES[image]
    (entry,) = [json.loads(a) for w, a in final_stage(image) if w == "ENTRYPOINT"]
    assert entry == ["python", "-m", module], f"{image}: ENTRYPOINT {entry}"
    package = ROOT / module.replace(".", "/")
    copied = " ".join(a for w, a in instructions(image) if w == "COPY")
    assert f"{module.split('.')[0]}/" in copied, f"{image}: {module} is never copied in"
    assert (package / "__main__.py").is_file(), f"{image}: {module} has no __main__.py to run"
    (exposed,) = [shlex.split(a) for w, a in final_stage(image) if w == "EXPOSE"]
    assert {str(port), "9090"} <= set(exposed), f"{image}: EXPOSE {exposed}"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_image_has_a_dockerignore_that_keeps_the_venv_out(image):
    lines = (ROOT / "deploy" / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    assert patterns[0] == "**", f"{image}: the context must start from nothing and allow-list"
    for kept_out in (".venv", "var", ".git", "tests"):
        assert not any(p.startswith(f"!{kept_out}") for p in patterns), f"{image}: {kept_out}"


def test_the_pods_run_as_the_user_their_image_declares(kubectl):
    docs = [d for d in yaml.safe_load_all(deploy_render.render("prod")) if d]
    for d in docs:
        if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}:
            spec = d["spec"]["template"]["spec"]
            (c,) = spec["containers"]
            image = c["image"].split("/")[-1].split(":")[0]
            uid = [a for w, a in final_stage(image) if w == "USER"][-1].split(":")[0]
            assert spec["securityContext"]["runAsUser"] == int(uid), (
                f"{image}: pod uid {spec['securityContext']['runAsUser']} != image uid {uid}; "
                "files the image owns would be unreadable"
            )
            assert c["args"][0] == "serve", f"{image}: the container runs `python -m ... serve`"
