"""The local cache: payload files on disk, indexed by diskcache.

Layout under ``Settings.cache_dir`` (created with mode 0700)::

    index/          diskcache (SQLite, WAL): entry records, byte counter, manifests
    data/ab/<key>-<nonce>.flp   payload files (codec.py format)
    tmp/            writes in progress
    evict.lock      flock taken while evicting (released by the kernel if we die)

Contracts (DESIGN.md, "Contracts that matter"):

* **Atomic writes.** A payload is written to ``tmp/``, renamed into
  ``data/``, and only then published in the index with ``add`` (first writer
  wins; a loser deletes its own file). A reader therefore never finds a
  half-written file through the index, and a crash leaves at most an orphan
  file, which :meth:`Cache.check` deletes.
* **Checked reads.** Every read checks the stored size, the header and the
  xxh3 checksum. A bad or missing payload is dropped, counted (``corrupt``) and
  reported as a miss, so the caller refetches it.
* **Identity.** Keys are hashes of (URL, size, version, block); file names are
  hashes too, so a remote name like ``../../x`` never reaches a path.
* **Bounded.** A byte counter is reserved atomically before each write. When a
  write would pass the limit, one process at a time (under ``evict.lock``) scans
  the index and deletes least-recently-used entries down to 90% of the limit.
  The scan costs O(entries) but runs once per ~10% of the limit written, so
  the amortised cost per write is small; a read costs one index lookup, plus
  one small index write at most every ``ATIME_RESOLUTION_S`` per entry (LRU
  resolution). Concurrent writers can overshoot the limit by at most one entry
  each until the next eviction.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache

from fastload import codec
from fastload.config import Settings, format_size
from fastload.errors import CacheError, CacheFullError, CacheLimitError, CodecError

_log = logging.getLogger("fastload")

ATIME_RESOLUTION_S = 10.0
LOW_WATERMARK = 0.9
_BYTES = "bytes"
_CORRUPT = "corrupt"


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
    """

    key: str
    path: str
    stored: int
    raw: int
    codec: int
    checksum: int
    url: str
    block: int


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
        try:
            for folder in (self.root, self.data_dir, self.tmp_dir):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)  # mkdir's mode is filtered by the umask
            self.index = diskcache.Cache(str(self.root / "index"), eviction_policy="none", size_limit=2**62, timeout=60)
        except OSError as err:
            raise CacheError(f"cache dir {self.root} cannot be created or opened ({err}); fix: set FASTLOAD_CACHE_DIR to a writable folder") from err
        self._lock_path = self.root / "evict.lock"
        self._touched: dict[str, float] = {}
        self.corrupt_seen = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    def close(self) -> None:
        self.index.close()

    # -- reads ---------------------------------------------------------------

    def entry(self, key: str) -> Entry | None:
        """The index record for ``key``, or None."""
        rec = self.index.get("e:" + key)
        return Entry(key, *rec) if rec is not None else None

    def get(self, key: str) -> bytes | None:
        """Return the raw bytes for ``key``, or None on a miss or a dropped bad entry."""
        entry = self.entry(key)
        if entry is None:
            return None
        try:
            with open(self.data_dir / entry.path, "rb") as f:
                payload = f.read()
        except FileNotFoundError:
            # Evicted by another process between lookup and open, or deleted by hand.
            if self.index.get("e:" + key) is not None:
                self._corrupt(entry, "payload file is missing")
            return None
        try:
            if len(payload) != entry.stored:
                raise CodecError(f"payload is {len(payload)} B, index says {entry.stored} B")
            info = codec.parse_header(payload)
            if info.checksum != entry.checksum or info.raw_size != entry.raw:
                raise CodecError("payload header disagrees with the index")
            raw = codec.decode(payload, info=info)
        except CodecError as err:
            self._corrupt(entry, str(err))
            return None
        self._touch(key)
        return raw

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
            self.index.set("t:" + key, now)

    def _corrupt(self, entry: Entry, why: str) -> None:
        self.drop(entry.key)
        self.index.incr(_CORRUPT)
        self.corrupt_seen += 1
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
        s = self.settings
        payload = codec.encode(raw, chunk_bytes=s.chunk_bytes, level=s.lz4_level, min_saving=s.min_saving, meta=meta)
        n = len(payload)
        if n > s.cache_limit_bytes:
            raise CacheLimitError(
                f"cache limit {format_size(s.cache_limit_bytes)} is smaller than item {url!r} block {block} "
                f"({format_size(n)}); fix: raise --cache-limit / FASTLOAD_CACHE_LIMIT, or lower FASTLOAD_BLOCK_SIZE"
            )
        existing = self.entry(key)
        if existing is not None:
            return existing
        self._reserve(n)
        published = False
        try:
            rel = f"{key[:2]}/{key}-{uuid.uuid4().hex[:12]}.flp"
            self._write_file(rel, payload, url)
            info = codec.parse_header(payload)
            rec = (rel, n, len(raw), info.codec, info.checksum, url, block)
            with self.index.transact():
                published = self.index.add("e:" + key, rec)
                if published:
                    self.index.set("t:" + key, time.time())
            if not published:
                (self.data_dir / rel).unlink(missing_ok=True)
                return self.entry(key) or Entry(key, *rec)
            return Entry(key, *rec)
        finally:
            if not published:
                self.index.incr(_BYTES, -n)

    def _write_file(self, rel: str, payload: bytes, url: str) -> None:
        final = self.data_dir / rel
        tmp = self.tmp_dir / f"{os.getpid()}-{uuid.uuid4().hex}.part"
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            # No fsync: it halved staging throughput (benchmarks/cache), and it is not
            # needed for safety: a file torn by a power loss fails its checksum on
            # read and is refetched. rename() alone keeps readers off partial files.
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, final)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheFullError(
                    f"disk under {self.root} is full while caching {url!r} ({err}); fix: free space, lower "
                    "--cache-limit below the free space, or move FASTLOAD_CACHE_DIR"
                ) from err
            raise CacheError(f"cannot write cache entry for {url!r} under {self.root}: {err}") from err

    def _reserve(self, n: int) -> None:
        limit = self.settings.cache_limit_bytes
        deadline = time.monotonic() + self.settings.lock_timeout_s
        while True:
            with self.index.transact():
                if self.index.get(_BYTES, 0) + n <= limit:
                    self.index.incr(_BYTES, n)
                    return
            self.evict(int(min(limit - n, LOW_WATERMARK * limit)))
            if time.monotonic() > deadline:
                raise CacheFullError(f"could not free {format_size(n)} in the cache at {self.root} within the lock timeout")

    # -- eviction and maintenance ---------------------------------------------

    def entries(self) -> Iterator[Entry]:
        """Every entry in the index (a snapshot scan)."""
        for k in list(self.index.iterkeys()):
            if isinstance(k, str) and k.startswith("e:"):
                rec = self.index.get(k)
                if rec is not None:
                    yield Entry(k[2:], *rec)

    def drop(self, key: str) -> bool:
        """Delete one entry (index record first, then the file)."""
        with self.index.transact():
            rec = self.index.pop("e:" + key, None)
            self.index.pop("t:" + key, None)
            if rec is not None:
                self.index.incr(_BYTES, -rec[1])
        if rec is None:
            return False
        (self.data_dir / rec[0]).unlink(missing_ok=True)
        return True

    def evict(self, to_bytes: int) -> int:
        """Delete least-recently-used entries until at most ``to_bytes`` remain; returns bytes freed."""
        with self._flock():
            entries = list(self.entries())
            total = sum(e.stored for e in entries)
            # Recount from the published records while we hold the lock: it repairs
            # drift left by crashed writers. Writes in flight elsewhere drop out of
            # the count until the next eviction, which bounds the overshoot to one
            # entry per concurrent writer.
            self.index.set(_BYTES, total)
            if total <= to_bytes:
                return 0
            atimes = {e.key: self.index.get("t:" + e.key, 0.0) for e in entries}
            freed = 0
            for e in sorted(entries, key=lambda e: atimes[e.key]):
                if total - freed <= to_bytes:
                    break
                if self.drop(e.key):
                    freed += e.stored
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
        """Repair after crashes: remove orphan payloads and stale temp files, recount bytes."""
        with self._flock():
            known = {e.path for e in self.entries()}
            orphans = 0
            cutoff = time.time() - 60
            # Files come and go under other processes while we scan: a vanished
            # file is skipped (tests/integration/test_stage_kill.py races four stagers).
            for path in self.data_dir.glob("*/*.flp"):
                rel = f"{path.parent.name}/{path.name}"
                if rel not in known and _mtime(path) < cutoff:
                    path.unlink(missing_ok=True)
                    orphans += 1
            stale = 0
            for path in self.tmp_dir.glob("*.part"):
                pid = path.name.split("-", 1)[0]
                if not _alive(pid) or _mtime(path) < time.time() - max_tmp_age_s:
                    path.unlink(missing_ok=True)
                    stale += 1
            total = sum(e.stored for e in self.entries())
            self.index.set(_BYTES, total)
        return {"orphans": orphans, "stale_tmp": stale, "bytes": total}

    def clear(self) -> None:
        """Delete every entry, manifest and payload file."""
        with self._flock():
            self.index.clear()
            for path in self.data_dir.glob("*/*.flp"):
                path.unlink(missing_ok=True)
            for path in self.tmp_dir.glob("*.part"):
                path.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


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
