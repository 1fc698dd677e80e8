"""Shared by the cold-start benchmarks: a real kernel cache service, fresh child processes, and
interleaved runs of the three cache tiers, printed side by side with ratios.

Tiers (each run is a fresh process, so the in-process memo is always cold):
  cold    no caches: empty local directory, no cache service
  local   the local disk cache warm (a directory filled by an earlier process), no service
  shared  only the shared cache service warm: empty local directory (a second "host")
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable

TIERS = ("cold", "local", "shared")
WRITE_TOKEN = "bench-token"


def start_service(db: pathlib.Path) -> tuple[object, str]:
    """A real cache_service server on loopback port 0 (SQLite at `db`); returns (server, target)."""
    from prometheus_client import CollectorRegistry

    from cache_service.config import ServerConfig
    from cache_service.server import start_cache_server

    config = ServerConfig(
        listen="127.0.0.1:0", db=db, write_token=WRITE_TOKEN, maintenance_s=3600.0
    )
    server = start_cache_server(config, registry=CollectorRegistry())
    return server, f"127.0.0.1:{server.port}"


def run_child(script: str, args: list[str], timeout: float = 600.0) -> dict:
    """Run `script --child ARGS` in a fresh interpreter; its last stdout line is a JSON result."""
    proc = subprocess.run(
        [sys.executable, script, "--child", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interleaved(
    rounds: int,
    run_tier: Callable[[str, pathlib.Path], dict],
    scratch: pathlib.Path,
) -> dict[str, list[dict]]:
    """Run every tier once per round, in order, so drift (thermal, other tenants) hits all alike."""
    results: dict[str, list[dict]] = {tier: [] for tier in TIERS}
    for r in range(rounds):
        for tier in TIERS:
            fresh_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{tier}-{r}-", dir=scratch))
            results[tier].append(run_tier(tier, fresh_dir))
    return results


def seed_and_run_tiers(
    script: str, common: list[str], scratch: pathlib.Path, target: str, rounds: int
) -> tuple[dict, dict[str, list[dict]]]:
    """One seed run fills a warm local dir and the service; then every tier, interleaved."""
    warm_dir = scratch / "warm-local"
    seed = run_child(script, [*common, "--cache-dir", str(warm_dir), "--remote", target])

    def run_tier(tier: str, fresh_dir: pathlib.Path) -> dict:
        if tier == "cold":
            return run_child(script, [*common, "--cache-dir", str(fresh_dir)])
        if tier == "local":
            return run_child(script, [*common, "--cache-dir", str(warm_dir)])
        return run_child(script, [*common, "--cache-dir", str(fresh_dir), "--remote", target])

    return seed, interleaved(rounds, run_tier, scratch)


def _fmt(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def report(results: dict[str, list[dict]], metric: str, label: str, extra: list[str]) -> str:
    """A table of median/min of `metric` per tier, the `extra` fields of each tier's last run, and
    the ratios of the medians against `cold`."""
    med = {t: statistics.median(r[metric] for r in results[t]) for t in TIERS}
    low = {t: min(r[metric] for r in results[t]) for t in TIERS}
    lines = [f"{'tier':<8} {'median ' + label:>18} {'min':>10} {'runs':>5}  last run"]
    for t in TIERS:
        last = results[t][-1]
        cols = "  ".join(f"{k}={_fmt(last.get(k))}" for k in extra)
        lines.append(
            f"{t:<8} {med[t] * 1e3:>15.1f} ms {low[t] * 1e3:>7.1f} ms {len(results[t]):>5}  {cols}"
        )
    lines.append(
        f"ratio local/cold  = {med['local'] / med['cold']:.3f}  "
        f"(cold is {med['cold'] / med['local']:.1f}x local)"
    )
    lines.append(
        f"ratio shared/cold = {med['shared'] / med['cold']:.3f}  "
        f"(cold is {med['cold'] / med['shared']:.1f}x shared)"
    )
    return "\n".join(lines)
