"""A certificate authority per test, for real TLS handshakes on loopback."""
from __future__ import annotations

import pathlib

import pytest

from tests.certs import CertificateAuthority


@pytest.fixture
def ca(tmp_path: pathlib.Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "pki", "gpuplane")


@pytest.fixture
def other_ca(tmp_path: pathlib.Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "other-pki", "intruder")
