"""services.governor.metrics and the serve CLI's flags."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.governor.__main__ import _parser, main
from services.governor.ledger import DeviceSpec, Ledger
from services.governor.metrics import LedgerCollector
from services.governor.store import Store

MIB = 1 << 20


def test_metrics_expose_per_device_and_zone_figures_read_at_scrape_time():
    ledger = Ledger(Store(":memory:"))
    ledger.register("w1", DeviceSpec("GPU-m", 2000 * MIB, 1000 * MIB))
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger))
    ledger.acquire("w1", "", "kv", 64 * MIB)
    ledger.heartbeat("w1", "", 700 * MIB, 0, {"context": (500 * MIB, 500 * MIB)})
    value = registry.get_sample_value
    assert value("gpuplane_governor_zone_leased_bytes", {"device": "GPU-m", "zone": "kv"}) \
        == 64 * MIB, "leased bytes per zone must be exported after the lease, not a stale copy"
    assert value("gpuplane_governor_zone_committed_bytes",
                 {"device": "GPU-m", "zone": "context"}) == 500 * MIB
    assert value("gpuplane_governor_device_unaccounted_bytes", {"device": "GPU-m"}) == 200 * MIB
    assert value("gpuplane_governor_acquired_total") == 1
    assert "gpuplane_governor_device_budget_bytes" in generate_latest(registry).decode()


def test_serve_flags_map_one_to_one_and_reject_malformed_zone_budgets(monkeypatch, capsys):
    monkeypatch.setenv("GPUPLANE_GOVERNOR_LEASE_TTL_SECONDS", "7")
    args = _parser().parse_args(["serve", "--zone-budget", "kv=8GiB", "--zone-budget",
                                 "weights=1GiB", "--transient-headroom", "512MiB"])
    assert dict(args.zone_budget) == {"kv": 8 << 30, "weights": 1 << 30}
    assert args.transient_headroom == 512 * MIB and args.lease_ttl_seconds == 7.0, \
        "the environment must supply defaults"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--zone-budget", "kv"])
    assert main(["serve", "--zone-budget", "foreign=1GiB", "--db", ":memory:"]) == 2, \
        "a zone that cannot be leased must be refused before serving"
    assert "foreign" in capsys.readouterr().err
