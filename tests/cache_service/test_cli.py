"""python -m cache_service stats|lookup|prune: one RPC each, --json, exit codes at the edge."""
from __future__ import annotations

import json

import pytest

from cache_service.__main__ import EXIT_MISS, EXIT_OK, EXIT_RPC, main
from cache_service.client import KernelCacheClient
from tests.cache_service.cache_helpers import TOKEN, make_artifact


@pytest.fixture
def filled(server):
    client = KernelCacheClient(server.address, write_token=TOKEN)
    for i in range(3):
        client.store(f"k{i}", make_artifact(1000, i), namespace="prod")
    assert client.flush()
    client.close()
    return server


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_stats_json_prints_the_same_numbers_the_store_holds(filled, capsys):
    code, out = run(capsys, "stats", "--target", filled.address, "--json")
    stats = json.loads(out)
    assert code == EXIT_OK
    held = filled.store.stats()
    assert (stats["entries"], stats["total_bytes"]) == (held.entries, held.total_bytes), \
        "--json must print the store's numbers, as numbers"
    assert stats["namespaces"][0]["namespace"] == "prod"


def test_lookup_prints_metadata_writes_bytes_with_out_and_exits_1_on_a_miss(filled, capsys,
                                                                             tmp_path):
    out_file = tmp_path / "k1.bin"
    code, out = run(capsys, "lookup", "k1", "--namespace", "prod", "--target", filled.address,
                    "--json", "--out", str(out_file))
    meta = json.loads(out)
    assert code == EXIT_OK and meta["found"] and meta["artifact"]["module_name"] == "mod1"
    assert meta["artifact"]["data_bytes"] == 1000 and "data" not in meta["artifact"], \
        "artifact bytes must go to --out, not the terminal"
    assert out_file.read_bytes() == filled.store.lookup("k1", "prod").data
    code, _ = run(capsys, "lookup", "nope", "--target", filled.address)
    assert code == EXIT_MISS, "a miss must exit 1"


def test_prune_needs_the_write_token_and_evicts_to_the_target(filled, capsys):
    code, _ = run(capsys, "prune", "--target", filled.address, "--target-bytes", "1000")
    assert code == EXIT_RPC and filled.store.stats().entries == 3, "prune without token ran"
    code, out = run(capsys, "prune", "--target", filled.address, "--target-bytes", "1000",
                    "--write-token", TOKEN, "--json")
    assert code == EXIT_OK and json.loads(out)["evicted_entries"] == 2
    assert filled.store.stats().total_bytes == 1000


def test_serve_flags_take_gpuplane_cache_env_defaults_and_flags_win(monkeypatch):
    from cache_service.__main__ import _parser
    from cache_service.config import server_config_from_args

    monkeypatch.setenv("GPUPLANE_CACHE_BUDGET_BYTES", "64MiB")
    monkeypatch.setenv("GPUPLANE_CACHE_NAMESPACE_BUDGETS", "prod=8MiB,dev=1MiB")
    monkeypatch.setenv("GPUPLANE_CACHE_WRITE_TOKEN", "t")
    config = server_config_from_args(_parser().parse_args(["serve"]))
    assert config.store.budget_bytes == 64 << 20 and config.write_token == "t"
    assert dict(config.store.namespace_budgets) == {"prod": 8 << 20, "dev": 1 << 20}
    config = server_config_from_args(_parser().parse_args(
        ["serve", "--budget-bytes", "0", "--namespace-budget", "x=2MiB", "--db", "/tmp/c.db"]))
    assert config.store.budget_bytes == 0, "0 must mean unbounded, and the flag beats the env"
    assert dict(config.store.namespace_budgets) == {"x": 2 << 20}
    assert str(config.db) == "/tmp/c.db"


def test_serve_defaults_put_the_database_under_var_with_a_256_mib_budget(monkeypatch):
    from cache_service.__main__ import _parser
    from cache_service.config import server_config_from_args

    for name in ("GPUPLANE_CACHE_BUDGET_BYTES", "GPUPLANE_CACHE_DB", "GPUPLANE_CACHE_WRITE_TOKEN",
                 "GPUPLANE_CACHE_NAMESPACE_BUDGETS"):
        monkeypatch.delenv(name, raising=False)
    config = server_config_from_args(_parser().parse_args(["serve"]))
    assert config.store.budget_bytes == 256 << 20 and config.write_token is None
    assert config.db.name == "kernel_cache.sqlite" and config.db.parent.name == "var"


def test_hot_tier_and_claim_flags_take_env_defaults_and_refuse_waiters_that_could_starve_stores(
        monkeypatch):
    from cache_service.__main__ import _parser
    from cache_service.config import ServerConfig, server_config_from_args

    monkeypatch.setenv("GPUPLANE_CACHE_HOT_BYTES", "8MiB")
    monkeypatch.setenv("GPUPLANE_CACHE_MAX_CLAIM_TTL_S", "60")
    config = server_config_from_args(_parser().parse_args(["serve", "--max-claim-waiters", "4"]))
    assert config.store.hot_bytes == 8 << 20 and config.max_claim_ttl_s == 60.0
    assert config.max_claim_waiters == 4 and config.max_claim_wait_s == 5.0
    with pytest.raises(ValueError, match="max_claim_waiters"):
        ServerConfig(max_claim_waiters=32)  # every server thread waiting: no Store could wake them


def test_list_prints_every_key_with_size_kind_and_last_use_while_the_server_serves_the_file(
        filled, capsys):
    code, out = run(capsys, "list", "--db", str(filled.store.path))
    lines = out.splitlines()
    assert code == EXIT_OK and lines[0].split()[:4] == ["namespace", "kind", "arch", "size"]
    assert [line.split()[-1] for line in lines[1:]] == ["k2", "k1", "k0"], \
        "list must show every key, most recently used first"
    assert all("prod" in line and "cubin" in line and "1000 B" in line for line in lines[1:]), \
        f"a row lacks its namespace, kind or size:\n{out}"
    code, out = run(capsys, "list", "--db", str(filled.store.path), "--json", "--limit", "2")
    rows = json.loads(out)
    assert code == EXIT_OK and [r["key"] for r in rows] == ["k2", "k1"], "--limit keeps the newest"
    assert rows[0]["size"] == 1000 and rows[0]["last_access"] > 0, "--json sizes are bytes"


def test_list_of_a_missing_database_exits_1_and_names_the_flag(tmp_path, capsys):
    code = main(["list", "--db", str(tmp_path / "none.sqlite")])
    err = capsys.readouterr().err
    assert code == EXIT_MISS, "a missing database file is not found (1)"
    assert err.startswith("python -m cache_service list: error: no kernel cache database")
    assert "--db" in err and "GPUPLANE_CACHE_DB" in err, err


def test_stats_prints_sizes_for_people_and_json_keeps_bytes(filled, capsys):
    code, out = run(capsys, "stats", "--target", filled.address)
    assert code == EXIT_OK and "entries 3, 2.9 KiB of budget 256.0 MiB" in out, out
    assert "namespace prod: 3 entries, 2.9 KiB" in out, out
    assert "{" not in out and "total_bytes" not in out, f"stats printed a raw message:\n{out}"


def test_a_failed_call_uses_the_common_error_format(filled, capsys):
    code = main(["prune", "--target", filled.address])
    err = capsys.readouterr().err
    assert code == EXIT_RPC and err.startswith("python -m cache_service prune: error: UNAUTHENTICATED"), \
        err
