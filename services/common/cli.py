"""The edge of every command-line entry point: one parser class, one error format, one set of exit
codes, sizes for people, and output piped into `head`.

Every gpuplane CLI (`gpuplane`, `python -m cache_service`, `python -m services.governor`,
`python -m gpu_worker`) exits with

    0  the command did what it says
    1  not found: what was asked for does not exist (a lookup miss; a NOT_FOUND status)
    2  usage: a flag, a combination of flags or a file that cannot work (argparse's own code)
    3  the call failed: the server answered with another error status
    4  unreachable: no server answered at the address (UNAVAILABLE)

and writes its failures to stderr as `PROG COMMAND: error: MESSAGE`, the format argparse itself
uses for usage errors, so a user sees one shape whichever layer refused.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_FAILED = 3
EXIT_UNREACHABLE = 4

EXIT_CODES_HELP = ("exit codes: 0 ok, 1 not found, 2 usage, 3 the call failed, "
                   "4 no server answered")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that refuses abbreviated flags (`--model` for `--model-id` would keep
    working until a second `--model...` flag made it ambiguous) and names the exit codes in
    `--help`. Subcommand parsers are of the same class (argparse makes them `type(self)`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("epilog", EXIT_CODES_HELP)
        super().__init__(*args, **kwargs)


class CommandError(Exception):
    """A command that cannot go on; `main` prints it with `fail` and exits with `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class Endpoint:
    """Where a command sends its calls, and how a user points it elsewhere (for the hint)."""

    address: str
    flag: str   # e.g. "--worker"
    env: str    # e.g. "GPUPLANE_WORKER"
    what: str   # e.g. "worker"


def fail(prog: str, message: str, code: int) -> int:
    """Print `PROG: error: MESSAGE` to stderr and return `code` (for `return fail(...)`)."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code


def rpc_failure(prog: str, exc: grpc.RpcError, endpoint: Endpoint | None = None) -> int:
    """Report a failed call: its status name and details; for UNAVAILABLE, where it went and how
    to point the command elsewhere. Returns the exit code."""
    status = exc.code()
    message = f"{status.name}: {exc.details()}"
    if status == grpc.StatusCode.UNAVAILABLE:
        if endpoint is not None:
            message += (f"\n  no {endpoint.what} answered at {endpoint.address}: pass "
                        f"{endpoint.flag} HOST:PORT or set ${endpoint.env}")
        return fail(prog, message, EXIT_UNREACHABLE)
    return fail(prog, message, EXIT_NOT_FOUND if status == grpc.StatusCode.NOT_FOUND
                else EXIT_FAILED)


_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', 312475648 -> '298.0 MiB', 17 -> '17 B'; negative figures keep their sign."""
    size = abs(n)
    for unit, name in _UNITS:
        if size >= unit:
            return f"{'-' if n < 0 else ''}{size / unit:.1f} {name}"
    return f"{int(n)} B"


def message_dict(message: Any) -> dict[str, Any]:
    """A response as `--json` prints it: every field in declaration order (unset ones too),
    numbers as numbers (proto3 JSON would quote int64 sizes), enums by name, bytes as their length
    (`data_bytes`). An operator's view, not a wire format."""
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None:
            if f.is_repeated:
                out[f.name] = [message_dict(v) for v in value]
            elif message.HasField(f.name):
                out[f.name] = message_dict(value)
        elif f.enum_type is not None:
            names = f.enum_type.values_by_number
            out[f.name] = ([names[v].name for v in value] if f.is_repeated else names[value].name)
        elif f.type == f.TYPE_BYTES:
            out[f"{f.name}_bytes"] = len(value)
        else:
            out[f.name] = list(value) if f.is_repeated else value
    return out


def run(main: Callable[[], int | None]) -> None:
    """Run `main` and exit with its code; a reader that closed the pipe early is not an error.

    Without this, `python -m cache_service stats | head -3` ends in a BrokenPipeError traceback
    when Python flushes stdout at exit.
    """
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush is quiet too
        code = 0
    sys.exit(code)
