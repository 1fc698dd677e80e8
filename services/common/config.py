"""Configuration: command-line flags whose defaults come from `GPUPLANE_*` environment variables.

The environment is read only here, at the edge; the rest of the code receives plain values.
Precedence: flag > environment variable > built-in default.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

VAR_DIR = os.environ.get("GPUPLANE_VAR_DIR", "./var")
# The largest byte size any flag takes: 1 EiB, far past any device or disk, and far enough below
# 2^63 that sums of a few such values still fit the int64 of every proto field.
MAX_BYTES = 1 << 60


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
    try:
        value = type(raw) if raw not in (None, "") else default
    except (argparse.ArgumentTypeError, ValueError) as err:
        # Read while the parser is built: say which variable is wrong, not a traceback.
        print(f"error: {env}={raw!r}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    parser.add_argument(
        flag, default=value, type=type, help=f"{help} (env {env}, default {default!r})", **kwargs
    )


SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                "0": False, "false": False, "no": False, "off": False}


def env_switch(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, env: str,
               default: bool, help: str) -> None:
    """Add `--name` / `--no-name` whose default is `$env` (1/0, true/false, yes/no, on/off) when
    set, else `default`; a bad value exits 2 naming the variable."""
    raw = os.environ.get(env, "")
    value = default
    if raw.strip():
        word = raw.strip().lower()
        if word not in SWITCH_WORDS:
            print(f"error: {env}={raw!r}: not a switch (use 1/0, true/false, yes/no, on/off)",
                  file=sys.stderr)
            raise SystemExit(2)
        value = SWITCH_WORDS[word]
    parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                        help=f"{help} (env {env}, default {default!r})")


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
                scaled = float(number) * units[suffix]
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 256MiB)") from None
            if not math.isfinite(scaled):
                raise argparse.ArgumentTypeError(
                    f"not a byte size: {text!r} is not finite (try 256MiB)")
            value = int(scaled) if abs(scaled) <= 2 * MAX_BYTES else 2 * MAX_BYTES
            break
    else:
        try:
            value = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 256MiB)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte size cannot be negative: {text!r}")
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"byte size {text!r} exceeds the bound of 1 EiB (2^60)")
    return value


def bounded_number(low: float, high: float, what: str, low_open: bool = True,
                   integer: bool = False) -> Callable[[str], float]:
    """An argparse type for a finite number in (low, high] (or [low, high] with
    `low_open=False`): inf, nan and values such as 1e300 are refused at parse time, naming the
    bound, before anything is built from them."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
        if not ok:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number in {span}")
        if integer:
            if value != int(value):
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
            return int(value)
        return value
    parse.__name__ = what  # argparse's own messages (and the help) name the type by it
    return parse


def env_int(name: str, default: int) -> int:
    """Read an integer environment variable with a clear error when it is malformed."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
