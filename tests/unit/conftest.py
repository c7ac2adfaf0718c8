"""Fixtures shared by unit tests: the batch-gather backend each test runs under."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from fastload.cache import gather

NATIVE = gather.backend() == "native"


@pytest.fixture(params=["python", "native"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per gather backend; "native" skips when fastload._native is
    missing, or fails under FASTLOAD_REQUIRE_NATIVE=1 (CI)."""
    if request.param == "native" and not NATIVE:
        if os.environ.get("FASTLOAD_REQUIRE_NATIVE") == "1":
            pytest.fail(f"fastload._native is required but unavailable: {gather.info()['reason']}")
        pytest.skip(f"fastload._native unavailable: {gather.info()['reason']}")
    with gather.use_backend(request.param):
        yield request.param
