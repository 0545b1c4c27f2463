"""What a suite that needs real parts of the machine does when they are missing: off CI it
skips with the reason; with ``CI=true`` it fails, so a CI machine cannot pass by skipping."""

from __future__ import annotations

import os

import pytest


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(suite: str, missing: list[str]) -> None:
    """Skip (off CI) or fail (on CI) when ``missing`` names anything."""
    if not missing:
        return
    reason = f"{suite} prerequisites missing: " + "; ".join(missing)
    if on_ci():
        pytest.fail(f"{reason} (CI=true: the {suite} tests are mandatory)", pytrace=False)
    pytest.skip(reason)
