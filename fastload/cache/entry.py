"""An entry of the cache: the index record of one stored payload (``e:<key>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    """An index record: where a payload lives and what it must decode to.

    Attributes:
        key: The cache key.
        path: Payload file, relative to ``data/``.
        stored: Payload size on disk.
        raw: Decoded size.
        codec: ``codec.RAW`` or ``codec.LZ4``.
        checksum: xxh3_64 of the raw bytes.
        url: The remote URL (for listings and messages; never a path).
        block: Block index within the remote object.
        stored_checksum: xxh3_64 of the whole stored payload; None for entries
            written before it was recorded (they are checked as before).
    """

    key: str
    path: str
    stored: int
    raw: int
    codec: int
    checksum: int
    url: str
    block: int
    # The raw checksum alone missed flips that leave the decoded bytes intact: the
    # header's reserved and chunk-size fields, and LZ4 match offsets that point at
    # equal bytes (tests/reliability/test_bit_rot.py flips every byte).
    stored_checksum: int | None = None


    @classmethod
    def from_record(cls, key: str, rec: tuple[Any, ...]) -> Entry:
        """The entry of cache key ``key`` from its index record."""
        return cls(key, *rec)


def record(entry: Entry) -> tuple[Any, ...]:
    """An entry as its index record (the fields after the key)."""
    return (entry.path, entry.stored, entry.raw, entry.codec, entry.checksum, entry.url, entry.block, entry.stored_checksum)
