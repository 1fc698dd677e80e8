from __future__ import annotations

import pytest

from tests.governor.ledgers import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()
