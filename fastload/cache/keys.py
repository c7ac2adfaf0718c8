"""The cache's keys: the key of a cached block, and the index's key namespaces.

This module is the one owner of the index's key names; every other module builds
and parses them through it. The index (one SQLite table, index.py) holds str keys, each in
one namespace named by a short prefix (str keys, not tuples: a tuple key would cost an
encoding per lookup):

=========================  =========================================  ==================
key                        value                                      written by
=========================  =========================================  ==================
``e:<key>``                an entry's record (:mod:`.entry`)          the cache's publish
``t:<key>``, ``t:<pack>``  the last use (time.time()) of a whole-file  reads, held in memory
                           entry, or of any entry of a pack (its      and written in batches
                           path: Entry.clock); absent until a read    (reads.py)
                           (the write time stands in)
``w:<pid>``                a process writes here (time); removed at   the cache's reserve
                           its clean end, so a dead one's says it
                           crashed (repair.py ``recover``)
``r:<pid>:<nonce>``        bytes reserved by a write in flight        the cache's reserve
``u:<url>``                a pin: (size, version) of a remote object  Identity.pin
``m:<root>\\x1f<pattern>``  a manifest: {"created", "chunks",         Identity.save_manifest
                           "count", "block_bytes"}; one recorded
                           before chunks holds its rows ("items")
``l:<root>\\x1f<pat.>\\x1f<n>``  chunk n of a manifest's rows (10,000      Identity.save_manifest
                           [url, size, version] each)
``p:m:<root>\\x1f<pat.>``   staging of that manifest under way (time)  stage.py
``x:<url>\\x1f<size>\\x1f<ver>``  a tar shard's member index             TarDataset
``n:<root>``               nodes the dataset was last split over      fastload.read.partition
``s:<root>\x1f<pattern>``  a manifest's summary: {"items",            Identity.save_manifest,
                           "remote_bytes", "block_bytes", "created";  Identity.summarise
                           once counted: "cached_items",
                           "stored_bytes", "changes"}
``bytes``                  bytes counted against the limit            reserve, drop, check
``entries``, ``stored``,   the entries' count and their stored and    publish, drop, check
``raw``                    raw bytes (`fastload info` reads these)
``changes``                entries published or dropped, over the     publish, drop
                           cache's life (a summary counted at the
                           same value is exact still)
``corrupt``                bad entries dropped, over the cache's life the cache's reads
=========================  =========================================  ==================
"""

from __future__ import annotations

import hashlib

ENTRY = "e:"
LAST_USE = "t:"
RESERVATION = "r:"
WRITER = "w:"
PIN = "u:"
MANIFEST = "m:"
MANIFEST_CHUNK = "l:"
STAGING = "p:"
TAR_INDEX = "x:"
PARTITION = "n:"
SUMMARY = "s:"
BYTES = "bytes"
ENTRIES = "entries"
STORED = "stored"
RAW = "raw"
CHANGES = "changes"
TOTALS = (ENTRIES, STORED, RAW)
CORRUPT = "corrupt"
_SEP = "\x1f"


def entry_key(url: str, size: int, version: str, block: int, block_bytes: int) -> str:
    """The cache key of one block of one remote object version.

    An object no larger than one block is the same bytes under any block size, so its
    key leaves the block size out: staged with ``--block-size 1MiB``, it is a hit for a
    reader with the default 8 MiB blocks (issue 24; tests/unit/test_block_sizes.py).
    """
    if 0 <= size <= block_bytes:
        block_bytes = 0
    ident = f"{url}\0{size}\0{version}\0{block}\0{block_bytes}".encode()
    return hashlib.sha256(ident).hexdigest()[:40]


def entry(key: str) -> str:
    """The index key of the entry record of cache key ``key``."""
    return ENTRY + key


def last_use(clock: str) -> str:
    """The index key of the last use recorded under ``clock`` (Entry.clock: a cache key, or a pack's path)."""
    return LAST_USE + clock


def reservation(pid: int, nonce: str) -> str:
    """The index key of one reservation of process ``pid``."""
    return f"{RESERVATION}{pid}:{nonce}"


def reservation_pid(name: str) -> str:
    """The writer's PID (as text) of reservation key ``name``."""
    return name.split(":")[1]


def writer(pid: int) -> str:
    """The index key that says process ``pid`` writes to the cache."""
    return f"{WRITER}{pid}"


def pin(url: str) -> str:
    """The index key of the pin of ``url``."""
    return PIN + url


def manifest(root: str, pattern: str | None) -> str:
    """The index key of the manifest of ``root`` listed with ``pattern``."""
    return f"{MANIFEST}{root}{_SEP}{pattern or ''}"


def manifest_chunks(root: str, pattern: str | None) -> str:
    """The namespace of the chunks of the manifest of ``root`` listed with ``pattern``."""
    return f"{MANIFEST_CHUNK}{root}{_SEP}{pattern or ''}{_SEP}"


def manifest_chunk(root: str, pattern: str | None, n: int) -> str:
    """The index key of chunk ``n`` of that manifest (zero-padded: the keys sort in chunk order)."""
    return f"{manifest_chunks(root, pattern)}{n:08d}"


def manifest_parts(name: str) -> tuple[str, str | None]:
    """``(root, pattern)`` of manifest (or summary) key ``name`` (pattern None when there was none)."""
    root, _, pattern = name[2:].partition(_SEP)
    return root, pattern or None


def summary(root: str, pattern: str | None) -> str:
    """The index key of the summary of the manifest of ``root`` listed with ``pattern``."""
    return SUMMARY + manifest(root, pattern)[len(MANIFEST) :]


def staging(root: str, pattern: str | None) -> str:
    """The index key that marks staging of that manifest as under way."""
    return STAGING + manifest(root, pattern)


def tar_index(url: str, size: int, version: str) -> str:
    """The index key of the member index of one tar shard version."""
    return f"{TAR_INDEX}{url}{_SEP}{size}{_SEP}{version}"


def partition(root: str) -> str:
    """The index key of the node count ``root`` was last split over (fastload.read.partition)."""
    return PARTITION + root


def of(namespace: str, name: object) -> str | None:
    """What follows ``namespace`` in index key ``name``, or None when ``name`` is not in it."""
    if isinstance(name, str) and name.startswith(namespace):
        return name[len(namespace) :]
    return None
