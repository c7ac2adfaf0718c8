"""The local cache: payload files on disk, indexed by one SQLite table.

The package splits the cache along its jobs; :class:`Cache` combines them::

    keys.py     the cache key, and the index's key namespaces (their one owner)
    entry.py    Entry: the index record of one payload (a file, or a range of a pack)
    base.py     folders, the index opened read-write (or read-only), disk-refusal errors
    reads.py    checked reads: lookups + memo, payload checks, read_into, last use
    writes.py   reserve, write and publish
    packs.py    pack files: small payloads appended per writing process, holes punched
    rows.py     Rows: entries as rows of numbers by a caller's index (read_rows, gather.gather_rows)
    repair.py   eviction, dead reservations, check (recover: only after a crash), clear, the byte counter
    held.py     what a process holds until it writes it: last uses, its writer row
    index.py    the index (one SQLite table) and its concurrency: fork gate, write locks, connections, flock
    migrate.py  an index of the old format (before issue 25) read once into the new one
    disk.py     the disk: room less the reserve, full vs read-only, the read-only index

Layout under ``Settings.cache_dir`` (created with mode 0700)::

    index/fastload.db  the index, SQLite (WAL), one table ``idx`` (key TEXT PRIMARY KEY,
                    value: an int or float as itself, else JSON text): entry records, byte
                    counter, pins, manifests (namespaces: keys.py)
    data/ab/<key>-<nonce>.flp   payload files (codec.py format), one per payload larger
                                than Settings.pack_max_bytes
    data/ab/<pid>-<nonce>.part  payload writes in progress
    data/packs/<pid>-<nonce>.pack  small payloads (codec.py format each), appended by
                                process <pid> at 64 B-aligned offsets (packs.py)
    tmp/            other temp files (diagnose's disk probe)
    evict.lock      flock taken while evicting (released by the kernel if we die)

Contracts (DESIGN.md, "Contracts that matter"):

* **Atomic writes.** A payload is written to a ``.part`` file, renamed to
  its ``.flp`` name in the same folder, or appended to its process's pack, and
  only then published in the index with ``add`` (first writer wins; a loser
  deletes its file or punches its range out). A reader therefore never finds a
  half-written payload through the index, and a crash leaves at most an orphan
  file or unreferenced pack bytes, which :meth:`Cache.check` reclaims.
* **Checked reads.** Every read checks the stored size and an xxh3 checksum of
  the stored bytes (header included), then the header against the index. A bad
  or missing payload is looked up again first (an eviction may have raced the
  read: a miss), then dropped, counted (``corrupt`` in the index and
  ``cache_corrupt`` in the loader's stats) and reported as a miss, so the
  caller refetches it.
* **Identity.** Keys are hashes of (URL, size, version, block); file names are
  hashes too, so a remote name like ``../../x`` never reaches a path.
* **Bounded.** A byte counter is reserved atomically before each write, with a
  reservation record (``r:<pid>:<nonce>``) that the publishing transaction
  turns into the entry's bytes, or that a failed write gives back. The counter
  therefore always covers published entries plus writes in flight, and never
  passes the limit (a packed entry counts its aligned range, and dropping it
  punches that range's blocks out of the pack); payload bytes on disk exceed it
  by at most the one entry an evictor has dropped but not yet freed, plus the
  partly shared blocks at the ends of each pack's live entries (tests/reliability/
  test_concurrency.py: 4 processes x 2 workers). When a write would pass the
  limit, one process at a time (under ``evict.lock``) scans the index and
  deletes least-recently-used entries down to 90% of the limit. The scan costs
  O(entries) but runs once per ~10% of the limit written, so the amortised
  cost per write is small; a read costs one index lookup (batched per 500) and
  no write: last uses are held in memory and written in batches (reads.py). A
  writer that dies leaves its reservation behind; the next eviction returns
  the reservations of dead processes.
* **Full disk.** ENOSPC while writing a payload, or SQLite's "database or disk
  is full" while indexing it, is a :class:`CacheFullError` (the reader then
  streams); the half-written file is removed and nothing is published.

Layer: imports only fastload.stats and the ground (config, codec, errors); it never asks a
Source; imported by fastload.fetch, fastload.read, the faces and the CLI.
"""

from __future__ import annotations

from fastload.cache.base import MEMO_MAX
from fastload.cache.disk import cannot_write
from fastload.cache.entry import Entry, record
from fastload.cache.keys import entry_key
from fastload.cache.repair import LOW_WATERMARK
from fastload.cache.writes import CacheWrites

__all__ = ["LOW_WATERMARK", "MEMO_MAX", "Cache", "Entry", "cannot_write", "entry_key", "record"]


class Cache(CacheWrites):
    """A bounded, process-safe payload cache.

    Args:
        settings: Directory, limit and codec settings.
    """
