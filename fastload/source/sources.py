"""The Sources of one reader: one :class:`~fastload.source.core.Source` per protocol, made on first use."""

from __future__ import annotations

import threading
from typing import Any

from fastload.config import Settings
from fastload.source.core import Source


class Sources:
    """One Source per protocol, sharing storage options, settings and a stop event.

    Args:
        stop: Set to end these Sources' requests: none starts or retries after it, waits
            for a slot end, requests on fsspec's event loop are cancelled (staging's Ctrl-C).
    """

    def __init__(self, storage_options: dict[str, Any], settings: Settings, stop: threading.Event) -> None:
        self.storage_options = storage_options
        self.settings = settings
        self.stop = stop
        self._lock = threading.Lock()
        self._by_protocol: dict[str, Source] = {}

    def of(self, url: str) -> Source:
        """The Source for ``url``'s filesystem (one per protocol, reused)."""
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        with self._lock:
            src = self._by_protocol.get(protocol)
            if src is None:
                src = self._by_protocol[protocol] = Source(url, self.storage_options, self.settings, self.stop)
        return src

    def lister(self, url: str) -> Source:
        """A new Source rooted at ``url`` (a Source lists from the root it was made with)."""
        return Source(url, self.storage_options, self.settings, self.stop)
