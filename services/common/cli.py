"""The edge of every command-line entry point: exit codes, and output piped into `head`."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable


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
