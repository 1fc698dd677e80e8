"""Waiting for a condition another thread or process will make true (never a bare sleep as proof)."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_until(predicate: Callable[[], object], timeout: float = 5.0,
               interval: float = 0.001) -> bool:
    """Poll `predicate` until true or `timeout` seconds pass; the last answer is returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def eventually(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition",
               interval: float = 0.02) -> None:
    """Like wait_until, but fails the test naming `what`."""
    if not wait_until(predicate, timeout, interval):
        pytest.fail(f"timed out waiting for: {what}")
