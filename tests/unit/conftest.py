"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """cpushim runs on asyncio (uvloop is an asyncio loop too): no trio runs."""
    return "asyncio"
