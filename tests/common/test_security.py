"""The shared security flags: environment defaults, precedence, and refusals of sets that cannot work."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from services.common import security
from services.common.errors import InvalidArgument


def parse(argv: list[str], prefix: str = "GOVERNOR") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    security.add_server_flags(parser, prefix)
    return parser.parse_args(argv)


def test_plaintext_and_no_authorization_are_the_default():
    sec = security.server_security_from_args(parse([]))
    assert sec.tls is None and not sec.policy.enforcing and not sec.health_listen


def test_roles_and_tokens_come_from_the_environment_and_flags_replace_them(monkeypatch):
    monkeypatch.setenv("GPUPLANE_GOVERNOR_ROLES", "worker=spiffe://w/* admin=spiffe://a/*")
    monkeypatch.setenv("GPUPLANE_GOVERNOR_TOKENS", "ops=s1")
    sec = security.server_security_from_args(parse([]))
    assert dict(sec.policy.roles.globs) == {"worker": ("spiffe://w/*",), "admin": ("spiffe://a/*",)}
    assert dict(sec.policy.tokens.secrets) == {"ops": "s1"}
    sec = security.server_security_from_args(parse(["--role", "client=x"]))
    assert dict(sec.policy.roles.globs) == {"client": ("x",)}, "a flag must replace the env list"


def test_a_certificate_without_its_key_or_a_client_ca_without_a_certificate_is_refused():
    with pytest.raises(InvalidArgument, match="go together"):
        security.server_security_from_args(parse(["--tls-cert", "c.pem"]))
    with pytest.raises(InvalidArgument, match="needs --tls-cert"):
        security.server_security_from_args(parse(["--tls-client-ca", "ca.pem"]))


def test_a_role_outside_client_worker_admin_is_a_usage_error_in_a_flag_or_the_env(
        capsys, monkeypatch):
    with pytest.raises(SystemExit) as done:
        parse(["--role", "root=*"])
    assert done.value.code == 2 and "ROLE=GLOB" in capsys.readouterr().err
    monkeypatch.setenv("GPUPLANE_GOVERNOR_ROLES", "worker")
    with pytest.raises(SystemExit) as done:
        parse([])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "GPUPLANE_GOVERNOR_ROLES" in err, err


def test_a_server_given_missing_certificate_files_exits_2_with_the_path(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "services.governor", "serve", "--listen", "127.0.0.1:0",
         "--db", str(tmp_path / "g.sqlite"), "--tls-cert", str(tmp_path / "nope.pem"),
         "--tls-key", str(tmp_path / "nope-key.pem")],
        check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "nope.pem" in done.stderr, \
        f"a governor without its certificate started or did not name the file: {done.stderr}"
    assert "Traceback" not in done.stderr, "a configuration error must be a message, not a crash"


def test_the_operator_cli_reaches_a_mutual_tls_governor_with_an_admin_certificate(tmp_path, ca):
    from opentelemetry.sdk.trace import TracerProvider

    from services.common.authz import Policy
    from services.common.identity import RoleMap
    from services.common.tls import ServerTLS
    from services.governor.server import start_governor

    leaf, admin = ca.issue("gov"), ca.issue("ops", uris=("spiffe://gpuplane/admin/ops",))
    sec = security.ServerSecurity(ServerTLS(str(leaf.cert), str(leaf.key), str(ca.ca_file)),
                                  Policy(RoleMap.of([("admin", "spiffe://gpuplane/admin/*")])))
    server, _ = start_governor("127.0.0.1:0", tmp_path / "g.sqlite",
                               tracer_provider=TracerProvider(), security=sec)
    try:
        base = [sys.executable, "-m", "services.governor", "resources", "--target",
                f"localhost:{server.port}", "--json"]
        plain = subprocess.run(base, check=False, capture_output=True, text=True, timeout=60)
        assert plain.returncode == 4 and "UNAVAILABLE" in plain.stderr, "plaintext got through"
        tls = ["--tls-ca", str(ca.ca_file), "--tls-cert", str(admin.cert), "--tls-key",
               str(admin.key)]
        done = subprocess.run(base + tls, check=False, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"the admin's resources call failed: {done.stderr}"
    finally:
        server.stop(grace=0)
