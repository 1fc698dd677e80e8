"""Configuration: command-line flags whose defaults come from `GPUPLANE_*` environment variables.

The environment is read only here, at the edge; the rest of the code receives plain values.
Precedence: flag > environment variable > built-in default.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

VAR_DIR = os.environ.get("GPUPLANE_VAR_DIR", "./var")


def env_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    env: str,
    default: Any,
    help: str,
    type: Callable[[str], Any] = str,
    **kwargs: Any,
) -> None:
    """Add `flag` whose default is `$env` when set, else `default`; the help text names both."""
    raw = os.environ.get(env)
    value = type(raw) if raw not in (None, "") else default
    parser.add_argument(
        flag, default=value, type=type, help=f"{help} (env {env}, default {default!r})", **kwargs
    )


def parse_bytes(text: str) -> int:
    """Parse '256MiB', '2GiB', '1048576' or '0' into bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 1000, "mb": 1000**2, "gb": 1000**3, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30,
             "b": 1}
    s = str(text).strip().lower().replace("_", "")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            number = s[: -len(suffix)].strip()
            try:
                value = int(float(number) * units[suffix])
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 256MiB)") from None
            break
    else:
        try:
            value = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 256MiB)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte size cannot be negative: {text!r}")
    return value


def env_int(name: str, default: int) -> int:
    """Read an integer environment variable with a clear error when it is malformed."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
