"""What a cache holds of one object, as the tests that check a torn or changed object read it."""

from __future__ import annotations

from fastload.cache import Cache
from fastload.config import Settings


def cached_blocks(settings: Settings, url: str) -> dict[int, bytes]:
    """Each cached block of ``url``, by block index."""
    cache = Cache(settings)
    try:
        return {e.block: cache.get(e.key) or b"" for e in list(cache.entries()) if e.url == url}
    finally:
        cache.close()
