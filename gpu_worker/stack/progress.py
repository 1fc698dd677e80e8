"""A progress line for long steps: a spinner with elapsed seconds on a terminal, plain lines otherwise."""
from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def step(title: str, stream: TextIO = sys.stderr) -> Iterator[None]:
    """Show `title` while the block runs, then `title ... done (1.2s)` or `... FAILED`."""
    started = time.perf_counter()
    stop = threading.Event()
    spinner = None
    if stream.isatty():
        def spin() -> None:
            for frame in itertools.cycle("|/-\\"):
                if stop.wait(0.1):
                    return
                stream.write(f"\r{frame} {title} ... {time.perf_counter() - started:5.1f}s")
                stream.flush()

        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
    else:
        stream.write(f"{title} ...\n")
        stream.flush()
    outcome = "FAILED"
    try:
        yield
        outcome = "done"
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()
            stream.write("\r")
        stream.write(f"{title} ... {outcome} ({time.perf_counter() - started:.1f}s)\n")
        stream.flush()
