"""Memory held by a call, as the tests that bound it measure it."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def peak_while(call: Callable[[], T]) -> tuple[T, int]:
    """``call()``'s result and the peak bytes Python held while it ran (tracemalloc)."""
    tracemalloc.start()
    try:
        return call(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
