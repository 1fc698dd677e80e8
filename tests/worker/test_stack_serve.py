"""`make serve` and `make run` tools (gpu_worker/stack): secrets stay off command lines, the serve
hints print the token once, the plot's axes keep the memory steps visible."""
from __future__ import annotations

import argparse
import pathlib
import socket

from cache_service.__main__ import EXIT_OK, EXIT_RPC
from cache_service.__main__ import main as cache_cli
from gpu_worker.stack.demo import (
    DEFAULT_PORTS,
    checkpoints_under,
    memory_limits,
    model_root_flags,
    port_for,
    serve_hints,
)
from gpu_worker.stack.processes import Stack

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "checkpoints" / "golden"
TOKEN = "0123456789abcdef0123456789abcdef"


def test_the_cache_write_token_reaches_the_service_through_its_environment_not_its_argv(
        tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GPUPLANE_CACHE_WRITE_TOKEN", raising=False)
    with Stack(tmp_path) as stack:
        cache = stack.start_cache(write_token=TOKEN)
        assert not any(TOKEN in a for a in cache.argv), f"the token is on a command line: {cache.argv}"
        cmdline = pathlib.Path(f"/proc/{cache.proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline, "ps would show the token to every local user"
        assert cache_cli(["prune", "--target", cache.address, "--timeout", "30"]) == EXIT_RPC, \
            "negative control: a write without the token must be refused"
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("GPUPLANE_CACHE_WRITE_TOKEN", TOKEN)
        assert cache_cli(["prune", "--target", cache.address, "--timeout", "30"]) == EXIT_OK, \
            "the service did not get the token through its environment"


def test_serve_hints_print_the_token_once_and_no_suggested_command_carries_it(tmp_path) -> None:
    text = serve_hints("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", tmp_path / "c.db", TOKEN,
                       str(GOLDEN))
    assert text.count(TOKEN) == 1, "the token must be printed exactly once"
    commands = [line for line in text.splitlines() if line.startswith("  .venv/")]
    assert commands and not any(TOKEN in c for c in commands), "a suggested command carries the token"
    assert "prune --target 127.0.0.1:3" in text and "export GPUPLANE_CACHE_WRITE_TOKEN=" in text
    assert "load --model-id ckpt --checkpoint bert-st" in text, "no checkpoint to try was named"


def test_model_root_is_passed_to_the_worker_and_its_checkpoints_are_found() -> None:
    args = argparse.Namespace(model_root=str(GOLDEN), serve=True)
    assert model_root_flags(args) == ["--model-root", str(GOLDEN)]
    assert model_root_flags(argparse.Namespace(model_root="", serve=True)) == [], \
        "no MODEL_ROOT must mean no --model-root flag"
    found = checkpoints_under(str(GOLDEN))
    assert {"llama-tied", "bert-st"} <= set(found) and "README.md" not in found


def test_serve_takes_a_free_port_when_a_default_port_is_taken() -> None:
    args = argparse.Namespace(serve=True)
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", DEFAULT_PORTS["worker"]))
            held.listen()
        except OSError:
            pass  # someone else holds it: taken either way
        assert port_for(args, "worker") is None, "a taken default port must fall back to a free one"
    assert port_for(argparse.Namespace(serve=False), "worker") is None, "make run always picks free ports"


def test_memory_axis_shows_a_2_mib_step_on_300_mib_and_a_flat_line_stays_flat() -> None:
    low, high = memory_limits([298.0, 300.0, 302.0, 304.0])
    assert low > 0, "the axis must not start at 0: a 2 MiB step on 300 MiB would be a pixel"
    assert 2.0 / (high - low) >= 0.1, "a 2 MiB step must take at least a tenth of the axis"
    low, high = memory_limits([300.0] * 5)
    assert high - low >= 8.0, "a flat line needs a span that shows it as flat, not as noise"
