"""services.common.cli and every CLI's edge: one parser class, one error format, one set of exit
codes; a reader that closes the pipe early is not an error."""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from services.common import cli


def test_output_piped_into_a_reader_that_stops_early_exits_quietly():
    program = (
        "from services.common import cli\n"
        "def main():\n"
        "    for i in range(200000):\n"
        "        print('line', i)\n"
        "    return 0\n"
        "cli.run(main)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert writer.stdout is not None
    writer.stdout.readline()
    writer.stdout.close()  # what `| head -1` does
    _, err = writer.communicate(timeout=30)
    assert writer.returncode == 0, err.decode()
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err.decode()


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from cache_service.__main__ import _parser as cache_parser
    from gpu_worker.edge.user_cli import build_parser as user_parser
    from services.governor.__main__ import _parser as governor_parser

    return {"gpuplane": user_parser(), "python -m cache_service": cache_parser(),
            "python -m services.governor": governor_parser()}


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_human_bytes_uses_binary_units_and_keeps_small_and_negative_figures_exact():
    assert cli.human_bytes(0) == "0 B" and cli.human_bytes(1023) == "1023 B"
    assert cli.human_bytes(1536) == "1.5 KiB"
    assert cli.human_bytes(298 << 20) == "298.0 MiB"
    assert cli.human_bytes(3 << 30) == "3.0 GiB"
    assert cli.human_bytes(-(2 << 20)) == "-2.0 MiB", "an unaccounted deficit lost its sign"


@pytest.mark.parametrize("prog", ["gpuplane", "python -m cache_service", "python -m services.governor"])
def test_every_flag_of_every_command_has_help_and_no_choice_is_empty(prog):
    parser = _parsers()[prog]
    for name, command in {"": parser, **_commands(parser)}.items():
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction) or action.dest == "help":
                continue
            where = f"{prog} {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{where} has no help text"
            assert "" not in (action.choices or []), f"{where} offers an empty choice"


@pytest.mark.parametrize("prog,argv,flag,abbreviation,value", [
    ("gpuplane", ["load", "--model-id", "m"], "--family", "--fam", "encoder"),
    ("python -m cache_service", ["prune"], "--target-bytes", "--target-b", "1MiB"),
    ("python -m services.governor", ["resources"], "--device", "--dev", "GPU-0"),
])
def test_abbreviated_flags_are_refused_as_usage_errors(prog, argv, flag, abbreviation, value,
                                                       capsys):
    parser = _parsers()[prog]
    parser.parse_args([*argv, flag, value])  # control: the full flag parses
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*argv, abbreviation, value])
    assert exit_.value.code == cli.EXIT_USAGE, f"{prog} accepted {abbreviation} for {flag}"
    assert f"unrecognized arguments: {abbreviation}" in capsys.readouterr().err


def _closed_port() -> str:
    with socket.socket() as s:  # bound and closed: nothing listens there now
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("argv,prefix,hint", [
    (["--worker", "{addr}", "models"], "gpuplane models: error: UNAVAILABLE",
     "pass --worker HOST:PORT or set $GPUPLANE_WORKER"),
    (["--governor", "{addr}", "resources"], "gpuplane resources: error: UNAVAILABLE",
     "pass --governor HOST:PORT or set $GPUPLANE_GOVERNOR"),
])
def test_a_refused_connection_exits_4_naming_the_flag_and_the_variable(argv, prefix, hint, capsys):
    from gpu_worker.edge.user_cli import main

    addr = _closed_port()
    code = main([a.format(addr=addr) for a in argv])
    err = capsys.readouterr().err
    assert code == cli.EXIT_UNREACHABLE, f"a refused connection exited {code}, not 4"
    assert err.startswith(prefix), f"not the common error format: {err!r}"
    assert hint in err and addr in err, f"no hint naming the address and the flag: {err!r}"


def test_the_cache_and_governor_clis_give_the_same_hint_with_their_own_flag(capsys):
    from cache_service.__main__ import main as cache_main
    from services.governor.__main__ import main as governor_main

    addr = _closed_port()
    assert cache_main(["stats", "--target", addr, "--timeout", "20"]) == cli.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.startswith("python -m cache_service stats: error: UNAVAILABLE")
    assert "pass --target HOST:PORT or set $GPUPLANE_CACHE_TARGET" in err, err
    assert governor_main(["resources", "--target", addr]) == cli.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.startswith("python -m services.governor resources: error: UNAVAILABLE")
    assert "pass --target HOST:PORT or set $GPUPLANE_GOVERNOR" in err, err


def test_help_names_the_exit_codes(capsys):
    for prog, parser in _parsers().items():
        for name, command in _commands(parser).items():
            assert cli.EXIT_CODES_HELP in command.format_help().replace("\n", " ").replace(
                "  ", " "), f"{prog} {name} --help does not list the exit codes"
