"""An entry of the cache: the index record of one stored payload (``e:<key>``).

A payload is a whole file (``path`` = ``ab/<key>-<nonce>.flp``, ``offset`` None) or a
range of a pack file (``path`` = ``packs/<pid>-<nonce>.pack``, ``offset`` = where it
starts, aligned to :data:`PACK_ALIGN`; :mod:`fastload.cache.packs`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

# Packed payloads start on a multiple of 64 B. On file-system blocks (4 KiB, before) a 4 KiB
# object (4,096 B + its header) took 8 KiB of disk: 2x its payload (issue 31). Dropping one
# punches its range out; the blocks it shares with a live neighbour stay until that one goes
# too (packs.release frees a shared block once the rest of it reads as zeros).
PACK_ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`PACK_ALIGN`."""
    return -(-n // PACK_ALIGN) * PACK_ALIGN


# Slots: a process keeps an Entry per object it reads (reads.py's memo), and a warm epoch
# reads six fields of it per object, at random over all of them. No __dict__ is one object
# less to hold and to fetch from memory; with the pack path shared (from_record) and the key
# shared with the caller's (entries_for), a remembered entry took 437 B, not 656 (100k
# entries, tracemalloc; tests/unit/test_cache_memo.py).
@dataclass(frozen=True, slots=True)
class Entry:
    """An index record: where a payload lives and what it must decode to.

    Attributes:
        key: The cache key.
        path: Payload file (or pack), relative to ``data/``.
        stored: Payload size (its length in a pack).
        raw: Decoded size.
        codec: ``codec.RAW`` or ``codec.LZ4``.
        checksum: xxh3_64 of the raw bytes.
        url: The remote URL (for listings and messages; never a path).
        block: Block index within the remote object.
        stored_checksum: xxh3_64 of the whole stored payload; None for entries
            written before it was recorded (they are checked as before).
        offset: Where the payload starts in its pack; None for a whole file.
        published: When a packed entry was written (its last use until a read
            records one; a whole file's mtime is that); None for a whole file.
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
    offset: int | None = None
    published: float | None = None

    @property
    def location(self) -> tuple[str, int | None]:
        """Where its bytes are: (path, offset). A rewritten entry has a new one."""
        return self.path, self.offset

    @property
    def clock(self) -> str:
        """The name its last use is recorded under (keys.last_use): its pack's path, shared by
        the pack's entries, or its own key. One clock per pack makes a warm epoch's recency a
        few rows per flush instead of one per object (reads.py)."""
        return self.path if self.offset is not None else self.key

    @property
    def charged(self) -> int:
        """Bytes counted against the limit: the payload, or in a pack its aligned range."""
        return self.stored if self.offset is None else aligned(self.stored)

    @classmethod
    def from_record(cls, key: str, rec: tuple[Any, ...]) -> Entry:
        """The entry of cache key ``key`` from its index record.

        A pack's path is interned: its thousands of entries then share one string, not a
        copy each from the record's JSON (and the memory they are read from stays small)."""
        if len(rec) > 8:
            return cls(key, sys.intern(rec[0]), *rec[1:])
        return cls(key, *rec)


def record(entry: Entry) -> tuple[Any, ...]:
    """An entry as its index record (the fields after the key)."""
    rec = (entry.path, entry.stored, entry.raw, entry.codec, entry.checksum, entry.url, entry.block, entry.stored_checksum)
    return rec if entry.offset is None else (*rec, entry.offset, entry.published)  # whole files keep the old shape


# The stored size in an entry record's index column (its JSON text: [path, stored, ...]),
# read in SQL without decoding the record: SQLite casts the text after the first comma to
# its leading integer. A JSON decode per record was most of a rerun's check of 100k staged
# entries. The path, the record's first field, holds no comma: its names are hashes and PIDs.
STORED_SQL = "CAST(substr(value, instr(value, ',') + 1) AS INTEGER)"


def location(rec: tuple[Any, ...]) -> tuple[str, int | None]:
    """:attr:`Entry.location` of an index record."""
    return rec[0], (rec[8] if len(rec) > 8 else None)
