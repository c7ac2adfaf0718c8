"""The local cache: payload files on disk, indexed by diskcache.

Layout under ``Settings.cache_dir`` (created with mode 0700)::

    index/          diskcache (SQLite, WAL): entry records, byte counter, manifests
    data/ab/<key>-<nonce>.flp   payload files (codec.py format)
    data/ab/<pid>-<nonce>.part  payload writes in progress
    tmp/            other temp files (diagnose's disk probe)
    evict.lock      flock taken while evicting (released by the kernel if we die)

Contracts (DESIGN.md, "Contracts that matter"):

* **Atomic writes.** A payload is written to a ``.part`` file, renamed to
  its ``.flp`` name in the same folder, and only then published in the index with ``add`` (first writer
  wins; a loser deletes its own file). A reader therefore never finds a
  half-written file through the index, and a crash leaves at most an orphan
  file, which :meth:`Cache.check` deletes.
* **Checked reads.** Every read checks the stored size and an xxh3 checksum of
  the stored bytes (header included), then the header against the index. A bad
  or missing payload is dropped, counted (``corrupt`` in the index and
  ``cache_corrupt`` in the loader's stats) and reported as a miss, so the
  caller refetches it.
* **Identity.** Keys are hashes of (URL, size, version, block); file names are
  hashes too, so a remote name like ``../../x`` never reaches a path.
* **Bounded.** A byte counter is reserved atomically before each write, with a
  reservation record (``r:<pid>:<nonce>``) that the publishing transaction
  turns into the entry's bytes, or that a failed write gives back. The counter
  therefore always covers published entries plus writes in flight, and never
  passes the limit; payload bytes on disk exceed it by at most the one entry
  an evictor has dropped but not yet unlinked (tests/reliability/
  test_concurrency.py: 4 processes x 2 workers). When a write would pass the
  limit, one process at a time (under ``evict.lock``) scans the index and
  deletes least-recently-used entries down to 90% of the limit. The scan costs
  O(entries) but runs once per ~10% of the limit written, so the amortised
  cost per write is small; a read costs one index lookup, plus one small index
  write at most every ``ATIME_RESOLUTION_S`` per entry (LRU resolution). A
  writer that dies leaves its reservation behind; the next eviction returns
  the reservations of dead processes.
* **Full disk.** ENOSPC while writing a payload, or SQLite's "database or disk
  is full" while indexing it, is a :class:`CacheFullError` (the reader then
  streams); the half-written file is removed and nothing is published.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache

from fastload import codec, gather
from fastload.cache_disk import (
    KIND_WORDS,
    ReadOnlyIndex,
    cannot_write,
    disk_full,
    reserve_bytes,
    room,
    unwritable_kind,
)
from fastload.config import Settings, format_size
from fastload.errors import (
    CacheError,
    CacheFullError,
    CacheLimitError,
    CacheReadOnlyError,
    CodecError,
)
from fastload.stats import current_collector

_log = logging.getLogger("fastload")

ATIME_RESOLUTION_S = 10.0
LOW_WATERMARK = 0.9
_BYTES = "bytes"
_CORRUPT = "corrupt"
_RESERVED = "r:"
# Reservations this process holds for writes in flight (token -> bytes); any other
# reservation under our PID was left behind by a failed release (a full disk) and is stale.
# Their bytes are not on the disk yet, so the disk's free space does not show them: the
# reserve check takes them off (tests/reliability/test_disk_full.py::test_default_limit_keeps_a_free_margin).
_IN_FLIGHT: dict[str, int] = {}


MEMO_MAX = 1 << 20  # entries remembered per Cache (about 300 B each)


def entry_key(url: str, size: int, version: str, block: int, block_bytes: int) -> str:
    """The cache key of one block of one remote object version."""
    ident = f"{url}\0{size}\0{version}\0{block}\0{block_bytes}".encode()
    return hashlib.sha256(ident).hexdigest()[:40]


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


class Cache:
    """A bounded, process-safe payload cache.

    Args:
        settings: Directory, limit and codec settings.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.root = self.settings.cache_dir
        self.data_dir = self.root / "data"
        self.tmp_dir = self.root / "tmp"
        self.index: _GatedIndex | ReadOnlyIndex
        # Why this cache cannot store (None: it can): "read-only" or "full". It then
        # serves what it holds from a read-only index (cache_disk.py), and callers stream.
        self.unwritable: str | None = None
        try:
            for folder in (self.root, self.data_dir, self.tmp_dir):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.root.stat().st_mode & 0o777 != 0o700:
                os.chmod(self.root, 0o700)  # mkdir's mode is filtered by the umask
            self._open_index()
        except (OSError, sqlite3.Error) as err:
            kind = unwritable_kind(err, self.root)
            try:
                if kind is None:
                    raise
                self.index = ReadOnlyIndex(self.root / "index", KIND_WORDS[kind])
                self.unwritable = kind
            except (OSError, sqlite3.Error):
                error = CacheReadOnlyError if kind == "read-only" else CacheFullError if kind == "full" else CacheError
                fix = "remount it read-write" if kind == "read-only" else "free space there"
                raise error(f"cache dir {self.root} cannot be created or opened ({err}); fix: {fix}, or set "
                            "FASTLOAD_CACHE_DIR to a writable folder") from err
        self._lock_path = self.root / "evict.lock"
        self._touched: dict[str, float] = {}
        # Entries this process has looked up or written. Safe to reuse: a payload's
        # name carries a nonce and every read checks its bytes, so a memo gone stale
        # (evicted, refetched elsewhere) finds its file missing and is looked up again.
        self._memo: dict[str, Entry] = {}
        self._dirs: set[str] = set()  # data/ fan-out folders known to exist
        self.corrupt_seen = 0

    def _open_index(self) -> None:
        # SQLite checkpoints its write-ahead log only once it holds 1,000 pages (4 MB), and
        # never shrinks it: on a 3 MB disk the log took 2.9 MB and the payloads were evicted
        # for it. On a small disk the log is checkpointed (and truncated) at 1% of the disk.
        try:
            st = os.statvfs(self.root)
            pages = max(16, min(1000, st.f_blocks * st.f_frsize // 100 // 4096))
        except OSError:
            pages = 1000
        self._diskcache = diskcache.Cache(str(self.root / "index"), eviction_policy="none", size_limit=2**62, timeout=60,
                                          sqlite_wal_autocheckpoint=pages, sqlite_journal_size_limit=pages * 4096)
        self.index = _GatedIndex(self._diskcache)
        self.unwritable = None

    def _reopen_writable(self) -> bool:
        """Open the index read-write again (space was freed); False if it still cannot be."""
        try:
            self._open_index()
        except (OSError, sqlite3.Error) as err:
            if unwritable_kind(err, self.root) is None:
                raise
            return False
        return True

    def unwritable_error(self, err: BaseException, what: str) -> CacheFullError:
        """The error for a write that failed because the disk is full or read-only."""
        if self.unwritable == "read-only" or unwritable_kind(err, self.root) == "read-only":
            return CacheReadOnlyError(
                f"cache dir {self.root} is read-only ({err}) while {what}; it serves what it holds and does not store "
                "more; fix: remount it read-write, or set FASTLOAD_CACHE_DIR to a writable folder for new data"
            )
        return CacheFullError(
            f"disk under {self.root} is full while {what} ({err}); fix: free space, lower "
            "--cache-limit below the free space, or move FASTLOAD_CACHE_DIR"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    def close(self) -> None:
        self.index.close()

    # -- reads ---------------------------------------------------------------

    def entry(self, key: str) -> Entry | None:
        """The index record for ``key``, or None."""
        entry = self._memo.get(key)
        if entry is None:
            rec = self.index.get("e:" + key)
            if rec is None:
                return None
            entry = self._remember(Entry(key, *rec))
        return entry

    def entries_for(self, keys: Sequence[str]) -> list[Entry | None]:
        """The index records of many keys: one index query per 500 keys not yet known here.

        One SQLite lookup per key was half the time of a warm epoch (80-100 us each,
        benchmarks/peers/results/profile.md).
        """
        memo = self._memo
        todo = [k for k in dict.fromkeys(keys) if k not in memo]
        if todo:
            for name, rec in self.index.get_many(["e:" + k for k in todo]).items():
                self._remember(Entry(name[2:], *rec))
        return [memo.get(k) for k in keys]

    @property
    def known(self) -> Mapping[str, Entry]:
        """Entries this process has written or looked up (they may have gone since)."""
        return self._memo

    def _remember(self, entry: Entry) -> Entry:
        if len(self._memo) >= MEMO_MAX:
            self._memo.clear()  # bounded memory; the index still has every entry
        self._memo[entry.key] = entry
        return entry

    def _forget(self, key: str) -> Entry | None:
        """Drop the memo of ``key`` and return its current index record, if any."""
        self._memo.pop(key, None)
        return self.entry(key)

    def get(self, key: str) -> bytes | None:
        """Return the raw bytes for ``key``, or None on a miss or a dropped bad entry."""
        checked = self._checked_payload(key)
        if checked is None:
            return None
        entry, payload, info = checked
        try:
            # Bytes identical to those written decode to what was encoded, so the
            # second hash (of the larger raw bytes) is only needed for old entries.
            return codec.decode(payload, verify=entry.stored_checksum is None, info=info)
        except CodecError as err:
            self._corrupt(entry, str(err))
            return None

    def read_payload(self, key: str) -> bytes | None:
        """The stored payload of ``key`` (codec.py format, still compressed), checked as
        :meth:`get` checks it; None on a miss or a dropped bad entry. For consumers that
        decode elsewhere (the GPU's LZ4 inflate in pipelines/array.py).

        An entry without a stored checksum is decoded here once, raw checksum
        verified, as :meth:`get` does: nvCOMP reports no bad chunk (DALI's inflate
        never reads its per-chunk statuses and zero-fills short outputs), so its
        raw checksum is the only thing that would catch a flip, and only the host
        can check it."""
        checked = self._checked_payload(key)
        if checked is None:
            return None
        entry, payload, info = checked
        if entry.stored_checksum is None:
            try:
                codec.decode(payload, info=info)
            except CodecError as err:
                self._corrupt(entry, str(err))
                return None
        return payload

    def _checked_payload(self, key: str) -> tuple[Entry, bytes, codec.PayloadInfo] | None:
        entry = self.entry(key)
        payload = None
        for _ in range(2):  # twice: the entry may have been rewritten since this process looked it up
            if entry is None:
                return None
            try:
                with open(self.data_dir / entry.path, "rb") as f:
                    payload = f.read()
                break
            except FileNotFoundError:
                entry = self._missing(entry)
        if entry is None or payload is None:
            return None
        try:
            if len(payload) != entry.stored:
                raise CodecError(f"payload is {len(payload)} B, index says {entry.stored} B")
            if entry.stored_checksum is not None and codec.checksum(payload) != entry.stored_checksum:
                raise CodecError("stored checksum mismatch: the payload file changed on disk")
            info = codec.parse_header(payload)
            if info.checksum != entry.checksum or info.raw_size != entry.raw or info.codec != entry.codec:
                raise CodecError("payload header disagrees with the index")
        except CodecError as err:
            self._corrupt(entry, str(err))
            return None
        self._touch(key)
        return entry, payload, info

    def read_into(self, requests: Sequence[tuple[str, Sequence[tuple[int, int, int]]]], out: Any) -> list[int]:
        """Copy byte ranges of many entries' raw bytes into ``out``, as one batch.

        Each entry is checked exactly as :meth:`get` checks it, by
        :func:`fastload.gather.gather` (C with the GIL released, or its
        pure-Python fallback), and read once however many ranges it serves.

        Args:
            requests: ``(key, copies)`` pairs; a copy ``(src, length, dst)`` puts
                ``raw[src:src+length]`` at byte ``dst`` of ``out``.
            out: A writable, C-contiguous buffer (numpy array, bytearray, or the
                numpy view of a pinned tensor).

        Returns:
            The positions in ``requests`` that missed: not cached, or bad and
            dropped (counted, as in :meth:`get`). The caller fetches those.
        """
        missed: list[int] = []
        hits: list[str] = []
        entries = self.entries_for([key for key, _ in requests])
        todo = list(range(len(requests)))
        for _ in range(2):  # twice: entries may have been rewritten since this process looked them up
            where: list[int] = []
            jobs: list[gather.Job] = []
            for i in todo:
                e, copies = entries[i], requests[i][1]
                if e is None:
                    missed.append(i)
                elif any(src + n > e.raw for src, n, _ in copies):
                    self._corrupt(e, f"index says {e.raw} B, fewer than the block holds")
                    missed.append(i)
                else:
                    path = str(self.data_dir / e.path)
                    jobs.append(gather.Job(path, e.stored, e.raw, e.codec, e.checksum, e.stored_checksum, copies))
                    where.append(i)
            todo = []
            for i, res in zip(where, gather.gather(jobs, out)):
                e = entries[i]
                assert e is not None
                if res is None:
                    hits.append(e.key)
                elif res[0] == "oserror":
                    raise OSError(res[1], os.strerror(res[1]), str(self.data_dir / e.path))
                elif res[0] == "corrupt":  # dropped and refetched, as in get()
                    self._corrupt(e, res[1])
                    missed.append(i)
                elif (current := self._missing(e)) is not None:
                    entries[i] = current
                    todo.append(i)
                else:
                    missed.append(i)
            if not todo:
                break
        missed += todo
        self._touch_many(hits)
        return sorted(missed)

    def contains(self, key: str) -> bool:
        """Cheap validity check (index record + file of the right size), no checksum."""
        entry = self.entry(key)
        if entry is None:
            return False
        try:
            return (self.data_dir / entry.path).stat().st_size == entry.stored
        except FileNotFoundError:
            return False

    def _touch(self, key: str) -> None:
        # Remember our own last write per key, so a hot read path costs no extra lookup.
        now = time.time()
        if now - self._touched.get(key, 0.0) > ATIME_RESOLUTION_S:
            self._touched[key] = now
            try:
                self.index.set("t:" + key, now)
            except sqlite3.OperationalError as err:
                # LRU order is advisory: a full disk must not turn a cache hit into a crash.
                if not cannot_write(err):
                    raise

    def _touch_many(self, keys: list[str]) -> None:
        # One index transaction for the batch's LRU writes, not one per key.
        now = time.time()
        if not any(now - self._touched.get(k, 0.0) > ATIME_RESOLUTION_S for k in keys):
            return
        try:
            with self.index.transact():
                for key in keys:
                    self._touch(key)
        except sqlite3.OperationalError as err:
            if not cannot_write(err):  # LRU order is advisory, as in _touch
                raise

    def _missing(self, entry: Entry) -> Entry | None:
        """A payload file that is gone: evicted (a miss), rewritten (returns the new entry
        to read instead), or deleted under its live entry (dropped and counted)."""
        current = self._forget(entry.key)
        if current is not None and current.path == entry.path:
            self._corrupt(entry, "payload file is missing")
            return None
        return current

    def _corrupt(self, entry: Entry, why: str) -> None:
        try:
            self.drop(entry.key, path=entry.path)
            self.index.incr(_CORRUPT)
        except sqlite3.OperationalError as err:
            # On a full disk the index cannot record the drop; the caller still
            # treats it as a miss and refetches, and the next read re-detects it.
            if not cannot_write(err):
                raise
        self.corrupt_seen += 1
        current_collector().count("cache_corrupt")
        _log.warning(
            "cache entry for %s (block %d) was bad and is dropped; it will be refetched: %s", entry.url, entry.block, why
        )

    # -- writes --------------------------------------------------------------

    def put(self, key: str, raw: bytes, *, url: str, block: int = 0, meta: dict[str, Any] | None = None) -> Entry:
        """Store ``raw`` under ``key`` atomically; returns the (possibly pre-existing) entry.

        Raises:
            CacheLimitError: The payload alone is larger than the cache limit.
            CacheFullError: The disk is full.
        """
        return self.put_many([(key, raw, url, block)], meta=meta)[0]

    def put_many(self, items: Sequence[tuple[str, bytes, str, int]], *, meta: dict[str, Any] | None = None) -> list[Entry]:
        """Store many ``(key, raw, url, block)`` blocks; returns each one's (possibly pre-existing) entry.

        Each payload is published atomically as :meth:`put` does, but the batch costs
        two index transactions (reserve all, publish all) instead of two per block:
        per-entry transactions were most of a cold miss's CPU (benchmarks/peers).
        A batch larger than half the limit is stored one block at a time, so it
        never has to evict its own entries to fit.

        Raises:
            CacheLimitError: One payload alone is larger than the cache limit.
            CacheFullError: The disk is full (nothing of the batch is published then).
        """
        s = self.settings
        limit = s.cache_limit_bytes
        out = self.entries_for([key for key, *_ in items])
        todo = list({items[i][0]: i for i, e in enumerate(out) if e is None}.values())
        payloads: dict[int, bytes] = {}
        for i in todo:  # only blocks not cached yet: an LZ4 attempt costs ~30 us per 100 KB
            _, raw, url, block = items[i]
            payload = codec.encode(raw, chunk_bytes=s.chunk_bytes, level=s.lz4_level, min_saving=s.min_saving, meta=meta)
            if len(payload) > limit:
                raise CacheLimitError(
                    f"cache limit {format_size(limit)} is smaller than item {url!r} block {block} "
                    f"({format_size(len(payload))}); fix: raise --cache-limit / FASTLOAD_CACHE_LIMIT, or lower FASTLOAD_BLOCK_SIZE"
                )
            payloads[i] = payload
        try:
            if len(todo) > 1 and sum(len(payloads[i]) for i in todo) > self.limit_bytes() // 2:
                for i in todo:
                    out[i] = self._publish([(items[i], payloads[i])])[0]
            elif todo:
                for i, entry in zip(todo, self._publish([(items[i], payloads[i]) for i in todo])):
                    out[i] = entry
        except sqlite3.OperationalError as err:
            # SQLite reports ENOSPC as "database or disk is full"; it used to escape
            # as a crash mid-epoch (tests/reliability/test_disk_full.py).
            if not cannot_write(err):
                raise
            raise self.unwritable_error(err, f"indexing {items[0][2]!r}") from err
        for i, e in enumerate(out):
            if e is None:  # a duplicate key within the batch
                out[i] = self.entry(items[i][0])
        return [e for e in out if e is not None]

    def _publish(self, batch: list[tuple[tuple[str, bytes, str, int], bytes]]) -> list[Entry]:
        """Reserve, write and index payloads of distinct keys; the first writer of a key wins."""
        total = sum(len(payload) for _, payload in batch)
        token = self._reserve(total, batch[0][0][2])
        written: list[str] = []
        entries: list[Entry] = []
        won: set[int] = set()
        committed = False
        lost = 0
        try:
            for (key, raw, url, block), payload in batch:
                rel = f"{key[:2]}/{key}-{uuid.uuid4().hex[:12]}.flp"
                self._write_file(rel, payload, url)
                written.append(rel)
                info = codec.parse_header(payload)
                entries.append(Entry(key, rel, len(payload), len(raw), info.codec, info.checksum, url, block,
                                     codec.checksum(payload)))
            now = time.time()
            with self.index.transact():
                for i, e in enumerate(entries):
                    # No "t:" (last use) record yet: until its first touch an entry's
                    # file mtime is its last use (evict), one index write less per put.
                    if self.index.add("e:" + e.key, _record(e)):
                        won.add(i)
                    else:
                        lost += e.stored
                if lost:  # the losers' files are still on the disk: their bytes stay reserved until unlinked
                    self.index.set(token, lost)
                else:
                    self.index.delete(token)  # the reserved bytes are now the entries'
            committed = True  # only once COMMIT succeeded (it fails on a full disk)
        finally:
            # Files first, then the reservation: disk use never exceeds the counter
            # (tests/reliability/test_concurrency.py: four processes racing for the same keys).
            for i, rel in enumerate(written):
                if not committed or i not in won:
                    (self.data_dir / rel).unlink(missing_ok=True)
            _IN_FLIGHT.pop(token, None)
            if not committed:
                self._release(token, total)
            elif lost:
                self._release(token, lost)
        out = []
        for i, e in enumerate(entries):
            if i in won:
                self._touched[e.key] = now
                out.append(self._remember(e))
            else:  # another writer published it first: serve theirs
                out.append(self._forget(e.key) or e)
        return out

    def _write_file(self, rel: str, payload: bytes, url: str) -> None:
        final = self.data_dir / rel
        folder = rel.split("/", 1)[0]
        # Written next to its final name: a rename between two folders takes the
        # file system's rename lock, and writer threads spun on it (perf: 8% of a
        # cold epoch's CPU). tmp/ keeps other temp files (diagnose's disk probe).
        tmp = self.data_dir / folder / f"{os.getpid()}-{uuid.uuid4().hex}.part"
        for attempt in (1, 2):
            try:
                if folder not in self._dirs:  # a mkdir per put cost 70 us
                    (self.data_dir / folder).mkdir(mode=0o700, exist_ok=True)
                    self._dirs.add(folder)
                # No fsync: it halved staging throughput (benchmarks/cache), and it is not
                # needed for safety: a file torn by a power loss fails its checksum on
                # read and is refetched. rename() alone keeps readers off partial files.
                # os.open/os.write: open()'s buffered file object cost more than the write.
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    view = memoryview(payload)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
                os.replace(tmp, final)
                return
            except FileNotFoundError as err:  # the folder was removed under us (by hand): make it again
                tmp.unlink(missing_ok=True)
                self._dirs.discard(folder)
                if attempt == 2:
                    raise CacheError(f"cannot write cache entry for {url!r} under {self.root}: {err}") from err
            except OSError as err:
                tmp.unlink(missing_ok=True)
                if cannot_write(err):
                    raise self.unwritable_error(err, f"caching {url!r}") from err
                raise CacheError(f"cannot write cache entry for {url!r} under {self.root}: {err}") from err

    def limit_bytes(self) -> int:
        """The limit in force: ``cache_limit_bytes``, capped so that the disk keeps its reserve
        free (``Settings.disk_reserve_bytes``; docs/cache.md, "Size limit and eviction")."""
        return self._capped(self.volume(), self._room())

    def _capped(self, used: int, room: int | None) -> int:
        # The cache may hold what it holds plus the disk's room: evicting frees disk space.
        limit = self.settings.cache_limit_bytes
        return limit if room is None else max(0, min(limit, used + room))

    def _room(self) -> int | None:
        return room(self.data_dir, self.settings.disk_reserve_bytes)

    def _reserve(self, n: int, url: str) -> str:
        """Count ``n`` bytes against the limit (evicting if needed); returns the reservation key."""
        token = f"{_RESERVED}{os.getpid()}:{uuid.uuid4().hex}"
        deadline = time.monotonic() + self.settings.lock_timeout_s
        while True:
            with self.index.transact():
                # Inside the transaction: a free-space reading taken before another
                # writer's reservation landed would let both spend the same space
                # (statvfs is a microsecond syscall). Writes still in flight are not on
                # the disk yet, so their bytes come off what it shows as free.
                room = self._room()
                if room is not None:
                    room -= sum(list(_IN_FLIGHT.values()))  # a copy: other threads add and remove
                used = self.index.get(_BYTES, 0)
                limit = self._capped(used, room)
                if n > limit:  # even an empty cache could not take it: the disk keeps its reserve
                    raise CacheFullError(
                        f"disk under {self.root} has room for {format_size(max(0, used + (room or 0)))} of cache "
                        f"(its free space less the {format_size(reserve_bytes(self.data_dir, self.settings.disk_reserve_bytes))} it "
                        f"keeps free) but {url!r} needs {format_size(n)}; fix: free space there, lower "
                        "FASTLOAD_DISK_RESERVE (0 turns the reserve off), or move FASTLOAD_CACHE_DIR"
                    )
                if used + n <= limit:
                    self.index.incr(_BYTES, n)
                    self.index.set(token, n)
                    _IN_FLIGHT[token] = n
                    return token
            if not self.evict(int(min(limit - n, LOW_WATERMARK * limit))):
                # Everything left is other writers' bytes in flight: wait for them.
                time.sleep(0.01)
            if time.monotonic() > deadline:
                raise CacheFullError(
                    f"could not free {format_size(n)} for {url!r} in the cache at {self.root} within "
                    f"{self.settings.lock_timeout_s:.0f} s (limit {format_size(limit)}, all of it in use by "
                    "writes in flight); fix: raise --cache-limit / FASTLOAD_CACHE_LIMIT"
                )

    def _release(self, token: str, n: int) -> None:
        """Give back a reservation whose write was not published."""
        try:
            with self.index.transact():
                if self.index.pop(token, None) is not None:
                    self.index.incr(_BYTES, -n)
        except sqlite3.OperationalError as err:
            # Left behind, the reservation is returned by the next eviction or check().
            if not cannot_write(err):
                raise

    # -- eviction and maintenance ---------------------------------------------

    def entries(self) -> Iterator[Entry]:
        """Every entry in the index (a snapshot scan)."""
        for k in list(self.index.iterkeys()):
            if isinstance(k, str) and k.startswith("e:"):
                rec = self.index.get(k)
                if rec is not None:
                    yield Entry(k[2:], *rec)

    def drop(self, key: str, *, path: str | None = None) -> bool:
        """Delete one entry (index record first, then the file); with ``path``, only that version of it."""
        self._memo.pop(key, None)
        with self.index.transact():
            rec = self.index.get("e:" + key)
            if rec is not None and path is not None and rec[0] != path:
                rec = None  # rewritten since it was read: the new version is not the bad one
            if rec is not None:
                self.index.delete("e:" + key)
                self.index.pop("t:" + key, None)
                self.index.incr(_BYTES, -rec[1])
        if rec is None:
            return False
        (self.data_dir / rec[0]).unlink(missing_ok=True)
        return True

    def evict(self, to_bytes: int) -> int:
        """Delete least-recently-used entries until at most ``to_bytes`` remain; returns bytes freed.

        On a full disk the index cannot record a delete (SQLite needs space to write
        one), so the payload files of those entries go first; with that space back the
        index drops their records (tests/reliability/test_disk_full.py).
        """
        self._refuse_if_read_only("evict from it")
        if self.unwritable is None:
            try:
                return self._evict(to_bytes)
            except sqlite3.OperationalError as err:
                if not disk_full(err):
                    raise
        with self._flock():
            gone = self._unlink_lru(to_bytes)
            if self.unwritable is not None and not self._reopen_writable():
                raise CacheFullError(
                    f"disk under {self.root} is still full after deleting {len(gone)} cached payloads "
                    f"({format_size(sum(e.stored for e in gone))}); fix: evict to a lower size, `fastload clear`, "
                    "or free space there"
                )
            for e in gone:
                self.drop(e.key, path=e.path)
        self.compact()
        return sum(e.stored for e in gone) + self._evict(to_bytes)

    def _evict(self, to_bytes: int) -> int:
        with self._flock():
            # No recount from the published records here: it used to forget the
            # bytes of writes in flight, which then landed past the limit (one entry
            # per concurrent writer). Only dead writers' reservations are returned.
            freed = self._return_dead_reservations()
            if self.volume() <= to_bytes:
                return freed
            entries = list(self.entries())
            atimes = {e.key: self.index.get("t:" + e.key) or _written(self.data_dir / e.path) for e in entries}
            for e in sorted(entries, key=lambda e: atimes[e.key]):
                if self.volume() <= to_bytes:
                    break
                if self.drop(e.key):
                    freed += e.stored
            return freed

    def compact(self) -> None:
        """Give the index's write-ahead log back to the disk (best effort).

        SQLite's WAL only grows until a checkpoint truncates it; on a small disk it held
        2 MB of a 3 MB tmpfs after a full-disk epoch (tests/reliability/test_disk_full.py).
        """
        if isinstance(self.index, _GatedIndex):  # not the read-only index
            try:
                with _FORK_GATE.shared(), self.index.writing():
                    self._diskcache._sql("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            except sqlite3.Error as err:
                _log.info("cache index not compacted: %s", err)

    def _refuse_if_read_only(self, what: str) -> None:
        if self.unwritable == "read-only":
            raise CacheReadOnlyError(f"cache dir {self.root} is read-only; cannot {what}; fix: remount it read-write")

    def _unlink_lru(self, to_bytes: int) -> list[Entry]:
        """Delete least-recently-used payload files (not their records) until ``to_bytes`` remain."""
        entries = list(self.entries())
        atimes = {e.key: self.index.get("t:" + e.key) or _written(self.data_dir / e.path) for e in entries}
        left, gone = sum(e.stored for e in entries), []
        for e in sorted(entries, key=lambda e: atimes[e.key]):
            if left <= to_bytes:
                break
            (self.data_dir / e.path).unlink(missing_ok=True)
            left -= e.stored
            gone.append(e)
        return gone

    def _reservations(self) -> list[tuple[str, int]]:
        out = []
        for k in list(self.index.iterkeys()):
            if isinstance(k, str) and k.startswith(_RESERVED):
                n = self.index.get(k)
                if n is not None:
                    out.append((k, int(n)))
        return out

    def _return_dead_reservations(self) -> int:
        """Return reservations of dead writers, and our own that no write holds any more."""
        freed, me = 0, str(os.getpid())
        for token, n in self._reservations():
            pid = token.split(":")[1]
            if (pid == me and token not in _IN_FLIGHT) or (pid != me and not _alive(pid)):
                with self.index.transact():
                    if self.index.pop(token, None) is not None:
                        self.index.incr(_BYTES, -n)
                        freed += n
        return freed

    def _flock(self) -> _FileLock:
        return _FileLock(self._lock_path, self.settings.lock_timeout_s)

    def volume(self) -> int:
        """Payload bytes currently accounted for."""
        return int(self.index.get(_BYTES, 0))

    def corrupt_count(self) -> int:
        """Bad entries detected and dropped, over the cache's lifetime."""
        return int(self.index.get(_CORRUPT, 0))

    def check(self, max_tmp_age_s: float = 3600.0) -> dict[str, int]:
        """Repair after crashes: remove orphan payloads and stale temp files, recount bytes.

        A cache that cannot be written (read-only, or a full disk) is left as it is.
        """
        if self.unwritable is not None:
            return {"orphans": 0, "stale_tmp": 0, "bytes": self.volume()}
        with self._flock():
            known = {e.path for e in self.entries()}
            orphans = 0
            cutoff = time.time() - 60
            # Files come and go under other processes while we scan: a vanished
            # file is skipped (tests/reliability/test_stage_kill.py races four stagers).
            for path in self.data_dir.glob("*/*.flp"):
                rel = f"{path.parent.name}/{path.name}"
                if rel not in known and _mtime(path) < cutoff:
                    path.unlink(missing_ok=True)
                    orphans += 1
            stale = 0
            for path in self.temp_files():
                pid = path.name.split("-", 1)[0]
                if not _alive(pid) or _mtime(path) < time.time() - max_tmp_age_s:
                    path.unlink(missing_ok=True)
                    stale += 1
            self._return_dead_reservations()
            # One transaction, so no write publishes or reserves between the two sums;
            # live reservations stay counted (their writes are still coming).
            with self.index.transact():
                total = sum(e.stored for e in self.entries()) + sum(n for _, n in self._reservations())
                self.index.set(_BYTES, total)
        return {"orphans": orphans, "stale_tmp": stale, "bytes": total}

    def clear(self) -> None:
        """Delete every entry, manifest and payload file.

        On a full disk the payload files go first (the index needs space to record
        the deletes); with that space back the index is cleared.
        """
        self._refuse_if_read_only("clear it")
        try:
            self._clear()
        except sqlite3.OperationalError as err:
            if not cannot_write(err):
                raise
            for path in [*self.data_dir.glob("*/*.flp"), *self.temp_files()]:
                path.unlink(missing_ok=True)
            if self.unwritable is not None and not self._reopen_writable():
                raise CacheFullError(f"disk under {self.root} is still full after deleting every cached payload; "
                                     "fix: free space there (other files fill it)") from err
            self._clear()
        self.compact()

    def _clear(self) -> None:
        with self._flock():
            self._memo.clear()
            self.index.clear()
            for path in self.data_dir.glob("*/*.flp"):
                path.unlink(missing_ok=True)
            for path in self.temp_files():
                path.unlink(missing_ok=True)

    def temp_files(self) -> list[Path]:
        """Files being written (``<pid>-<nonce>.part``, next to the payloads and in ``tmp/``)."""
        return [*self.data_dir.glob("*/*.part"), *self.tmp_dir.glob("*.part")]


def _record(entry: Entry) -> tuple[Any, ...]:
    """An entry as its index record (the fields after the key)."""
    return (entry.path, entry.stored, entry.raw, entry.codec, entry.checksum, entry.url, entry.block, entry.stored_checksum)


def _written(path: Path) -> float:
    """A payload's mtime: its last use until a read records one (0.0 if gone: evict it first)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _alive(pid: str) -> bool:
    """Whether the writer ``pid`` can still write: a zombie cannot.

    A SIGKILLed DataLoader worker is reparented to PID 1, and in a container that
    init may never reap it; ``kill(pid, 0)`` still succeeds on the zombie, so its
    reservations would be counted forever (tests/unit/test_cache.py::test_a_zombie_writer_is_dead).
    """
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except OSError:  # no /proc (not Linux), or it went away: kill() is the answer
        return True
    # The state letter follows the command name, which may itself hold ") ".
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] not in ("Z", "X")


class _ForkGate:
    """Index operations hold it (shared, re-entrant per thread); ``fork()`` waits for them.

    SQLite keeps its lock bookkeeping in process memory. A child forked while a
    thread of its parent was inside an index write inherits "this process holds
    the write lock" with no thread left to release it, so every write in the
    child is SQLITE_BUSY until diskcache's 60 s timeout: a DataLoader worker
    forked while an abandoned epoch's read-ahead threads were still caching hung
    for 60 s and died (tests/reliability/test_hostile_input.py, corrupt JPEG).
    ``os.register_at_fork`` makes the forking thread wait (``WAIT_S`` at most, then
    it warns and forks) until no index operation is in flight. Operations take
    milliseconds; a longer wait means a gc finalizer blocked inside one.
    """

    WAIT_S = 5.0

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._forking = False
        self._depth = threading.local()

    def enter(self) -> None:
        """Start an index operation (nested calls, e.g. get inside transact, never wait)."""
        depth = self._depth
        n = getattr(depth, "n", 0)
        if n == 0:
            with self._cond:
                while self._forking:
                    self._cond.wait()
                self._active += 1
        depth.n = n + 1

    def try_enter(self) -> bool:
        """:meth:`enter` without waiting for a fork (False: do not operate)."""
        depth = self._depth
        n = getattr(depth, "n", 0)
        if n == 0:
            # A timeout, not a block: a finalizer may run in the very thread that holds
            # the lock (a gc pass inside enter(), or in the forking thread).
            if not self._cond.acquire(timeout=0.05):
                return False
            try:
                if self._forking:
                    return False
                self._active += 1
            finally:
                self._cond.release()
        depth.n = n + 1
        return True

    def leave(self) -> None:
        depth = self._depth
        depth.n -= 1
        if depth.n == 0:
            with self._cond:
                self._active -= 1
                if self._forking and not self._active:
                    self._cond.notify_all()

    @contextmanager
    def shared(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def before_fork(self) -> None:
        with self._cond:
            self._forking = True
            deadline = time.monotonic() + self.WAIT_S
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._active:
                _log.warning(
                    "forking with %d cache index operation(s) in flight after %.0f s; the child "
                    "may find the index locked", self._active, self.WAIT_S,
                )

    def after_fork_parent(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def after_fork_child(self) -> None:
        self._reset()  # the child has one thread and no operation in flight


_FORK_GATE = _ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_FORK_GATE.before_fork,
        after_in_parent=_FORK_GATE.after_fork_parent,
        after_in_child=_FORK_GATE.after_fork_child,
    )


# One lock per cache folder per process, taken around index writes: threads of one
# process then queue on it instead of in SQLite's busy handler, whose sleeps (1 to
# 100 ms) put a put's p99 at ~480 ms with 16 writer threads (benchmarks/peers).
_WRITE_LOCKS: dict[Path, threading.RLock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def _write_lock(root: Path) -> threading.RLock:
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(root.resolve(), threading.RLock())


def _reset_write_locks() -> None:
    global _WRITE_LOCKS_GUARD
    _WRITE_LOCKS_GUARD = threading.Lock()
    for root in _WRITE_LOCKS:
        _WRITE_LOCKS[root] = threading.RLock()  # a forked child holds none of its parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_write_locks)


class _GatedIndex:
    """The diskcache index: every call, whole transaction, connection open and close
    inside :data:`_FORK_GATE`; each thread's connection closed when the thread ends;
    writes under the process's write lock of this cache."""

    def __init__(self, inner: diskcache.Cache) -> None:
        self._inner = inner
        self._thread = threading.local()
        self._root = Path(inner.directory).parent.resolve()
        _write_lock(self._root)  # registered, so a forked child gets its own

    def bind_thread(self) -> None:
        # diskcache opens one SQLite connection per thread and keeps it in a reference
        # cycle, so a thread that exits leaves its connection (2 fds and its page
        # cache) until a full gc: the loader reads from a fresh thread pool each epoch,
        # +8 fds and ~1 MB RSS per epoch (tests/reliability/test_soak.py). A closer in
        # our own thread-local dies with the thread and closes that connection.
        if getattr(self._thread, "closer", None) is None:
            with _FORK_GATE.shared():  # opening runs PRAGMAs
                con = getattr(self._inner, "_con", None)  # diskcache's per-thread connection
            self._thread.closer = _ConnectionCloser(con) if isinstance(con, sqlite3.Connection) else False

    def writing(self) -> threading.RLock:
        """This process's write lock of the cache (a forked child gets a fresh one)."""
        return _WRITE_LOCKS[self._root]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        return _gated_call(self, attr)

    @contextmanager
    def transact(self, retry: bool = False) -> Iterator[None]:
        self.bind_thread()
        with self.writing(), _FORK_GATE.shared(), self._inner.transact(retry):
            yield

    def get_many(self, keys: Sequence[str]) -> dict[str, Any]:
        """The values of many str keys that are present, in one query per ``_IN_CHUNK`` keys.

        Reads diskcache's own table and decodes with its own ``Disk.fetch``, as
        ``diskcache.Cache.get`` does for str keys (no expiry, no statistics here).
        """
        self.bind_thread()
        inner, out = self._inner, {}
        with _FORK_GATE.shared():
            for i in range(0, len(keys), _IN_CHUNK):
                part = list(keys[i : i + _IN_CHUNK])
                marks = ",".join("?" * len(part))
                rows = inner._sql(f"SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND key IN ({marks})", part)
                for key, mode, filename, value in rows.fetchall():
                    try:
                        out[key] = inner._disk.fetch(mode, filename, value, False)
                    except OSError:
                        pass  # deleted since the query, as diskcache's get treats it
        return out

    def close(self) -> None:
        with _FORK_GATE.shared():  # no bind_thread: it would open a connection to close it
            self._inner.close()

    def iterkeys(self, reverse: bool = False) -> Iterator[Any]:
        # Materialised inside the gate: a generator would read outside it.
        self.bind_thread()
        with _FORK_GATE.shared():
            return iter(list(self._inner.iterkeys(reverse)))


_IN_CHUNK = 500  # keys per SELECT ... IN (...): below SQLite's oldest variable limit (999)


def _gated_call(index: _GatedIndex, fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        index.bind_thread()
        _FORK_GATE.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _FORK_GATE.leave()

    return call


def _gated_method(name: str, write: bool) -> Any:
    # The hot calls as plain methods: __getattr__ builds a closure per access.
    def method(self: _GatedIndex, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._thread, "closer", None) is None:
            self.bind_thread()
        lock = self.writing() if write else None
        if lock is not None:
            lock.acquire()
        _FORK_GATE.enter()
        try:
            return getattr(self._inner, name)(*args, **kwargs)
        finally:
            _FORK_GATE.leave()
            if lock is not None:
                lock.release()

    method.__name__ = name
    return method


for _name in ("get", "set", "add", "delete", "pop", "incr"):
    setattr(_GatedIndex, _name, _gated_method(_name, write=_name != "get"))


class _ConnectionCloser:
    """Closes one thread's SQLite connection when that thread's locals are freed."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self.con = con
        self.pid = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self.pid:
            # A forked child drops its parent's threads (and their locals) before the
            # at-fork hooks run: the parent's connection is not the child's to close.
            return
        # Closing the last connection checkpoints the WAL: that takes locks too. Never
        # wait here (see try_enter); a connection left open is closed by the gc later.
        if not _FORK_GATE.try_enter():
            return
        try:
            self.con.close()
        except sqlite3.Error:
            pass  # freed from another thread (a gc pass): the gc closes it then
        finally:
            _FORK_GATE.leave()


class _FileLock:
    """An flock with a bounded wait; the kernel releases it if the holder dies."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self._fd = -1

    def __enter__(self) -> _FileLock:
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self._fd)
                    raise CacheError(f"cache lock {self.path} held for over {self.timeout_s:.0f} s by another process") from None
                time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
