"""Reserve, write and publish: payloads encoded, counted against the limit, written
(appended to this process's pack, or beside their final name and renamed into
place), then published in the index.

* **Atomic.** A small payload is appended to this process's pack (:mod:`.packs`);
  a larger one is written to a ``.part`` file and renamed to its ``.flp`` name in
  the same folder. Only then is it published with ``add`` (first writer wins; a
  loser deletes its own file or punches its range out). A reader never finds a
  half-written payload through the index; a crash leaves at most an orphan file or
  unreferenced pack bytes, which ``check`` reclaims.
* **Bounded.** A byte counter is reserved atomically before each write, with a
  reservation record that the publishing transaction turns into the entry's bytes,
  or that a failed write gives back; the counter covers published entries plus
  writes in flight, and never passes the limit.
* **Full disk.** ENOSPC while writing a payload, or SQLite's "database or disk is
  full" while indexing it, is a :class:`CacheFullError` (the reader then streams);
  the half-written file is removed and nothing is published.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastload import codec
from fastload.cache import keys, packs
from fastload.cache.base import IN_FLIGHT, in_flight_on
from fastload.cache.disk import cannot_write, reserve_bytes, room
from fastload.cache.entry import Entry, aligned, record
from fastload.cache.reads import CacheReads
from fastload.cache.repair import LOW_WATERMARK
from fastload.config import format_size
from fastload.errors import CacheError, CacheFullError, CacheLimitError


class CacheWrites(CacheReads):
    """Reserve, write and publish (a part of :class:`fastload.cache.Cache`)."""

    def put(self, key: str, raw: bytes, *, url: str, block: int = 0, meta: dict[str, Any] | None = None) -> Entry:
        """Store ``raw`` under ``key`` atomically; returns the (possibly pre-existing) entry.

        Raises:
            CacheLimitError: The payload alone is larger than the cache limit.
            CacheFullError: The disk is full.
        """
        return self.put_many([(key, raw, url, block)], meta=meta)[0]

    def put_many(self, items: Sequence[tuple[str, bytes, str, int]], *, meta: dict[str, Any] | None = None,
                 rows: Mapping[str, Any] | None = None, looked_up: bool = False) -> list[Entry]:
        """Store many ``(key, raw, url, block)`` blocks; returns each one's (possibly pre-existing) entry.

        Each payload is published atomically as :meth:`put` does, but the batch costs
        two index transactions (reserve all, publish all) instead of two per block:
        per-entry transactions were most of a cold miss's CPU (benchmarks/peers).
        A batch larger than half the limit is stored one block at a time, so it
        never has to evict its own entries to fit.

        Args:
            rows: Other index rows (the pins of the batch's objects) to set in the
                first publishing transaction, or in one of their own when every
                block is cached already: one transaction less per batch.
            looked_up: The caller found these keys missing just before it fetched them, under
                their markers (the fetch layer): they are not looked up again (a cold batch's
                second index query: 9% of a cold s3:// epoch's CPU, benchmarks/percore/profile_cold.py).
                One stored meanwhile all the same is written again and loses to the first (add_many).

        Raises:
            CacheLimitError: One payload alone is larger than the cache limit.
            CacheFullError: The disk is full (nothing of the batch is published then).
        """
        s = self.settings
        limit = s.cache_limit_bytes
        out: list[Entry | None] = [None] * len(items) if looked_up else self.entries_for([key for key, *_ in items])
        todo = list({items[i][0]: i for i, e in enumerate(out) if e is None}.values())
        payloads: dict[int, codec.Encoded] = {}
        for i in todo:  # only blocks not cached yet: an LZ4 attempt costs ~30 us per 100 KB
            _, raw, url, block = items[i]
            payload = codec.encode_parts(raw, chunk_bytes=s.chunk_bytes, level=s.lz4_level, min_saving=s.min_saving,
                                         meta=meta, placed=True)
            need = _charged(len(payload), len(payload) <= s.pack_max_bytes)
            if need > limit:
                raise CacheLimitError(
                    f"cache limit {format_size(limit)} is smaller than item {url!r} block {block} "
                    f"({format_size(need)}); fix: raise --cache-limit / FASTLOAD_CACHE_LIMIT, or lower FASTLOAD_BLOCK_SIZE"
                )
            payloads[i] = payload
        try:
            if len(todo) > 1 and sum(len(payloads[i]) for i in todo) > self.limit_bytes() // 2:
                for k, i in enumerate(todo):
                    out[i] = self._publish([(items[i], payloads[i])], rows if k == 0 else None)[0]
            elif todo:
                for i, entry in zip(todo, self._publish([(items[i], payloads[i]) for i in todo], rows)):
                    out[i] = entry
            elif rows:
                with self.index.transact():
                    for name, value in rows.items():
                        self.index.set(name, value)
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

    def _publish(self, batch: list[tuple[tuple[str, bytes, str, int], codec.Encoded]],
                 rows: Mapping[str, Any] | None = None) -> list[Entry]:
        """Reserve, write and index payloads of distinct keys; the first writer of a key wins.

        Payloads of at most ``pack_max_bytes`` are appended to this process's pack
        (:mod:`fastload.cache.packs`), the rest written as files of their own.
        """
        url0 = batch[0][0][2]
        pack = self._pack_writer(url0)
        small = [pack is not None and len(payload) <= self.settings.pack_max_bytes for _, payload in batch]
        total = sum(_charged(len(payload), k) for k, (_, payload) in zip(small, batch))
        token = self._reserve(total, url0)
        packed: list[codec.Encoded] = []  # the payloads appended to the pack, in batch order
        appended: list[tuple[str, int]] = []  # their pack locations
        files: list[str] = []  # whole files this call wrote
        entries: list[Entry] = []
        won: set[tuple[str, int | None]] = set()
        committed = False
        lost = 0
        try:
            if pack is not None and any(small):
                packed = [payload for k, (_, payload) in zip(small, batch) if k]
                try:
                    locations = pack.append([p.parts for p in packed])
                except OSError as err:
                    raise self._write_error(err, url0) from err
                if locations is None:  # packs turned out unusable here: whole files
                    small = [False] * len(batch)
                appended = locations or []
            where = iter(appended)
            now = time.time()
            for k, ((key, raw, url, block), payload) in zip(small, batch):
                offset: int | None = None
                if k:
                    rel, offset = next(where)
                else:
                    rel = f"{key[:2]}/{key}-{uuid.uuid4().hex[:12]}.flp"
                    self._write_file(rel, payload, url)
                    files.append(rel)
                # A packed entry records when it was written: its pack's mtime is not its own.
                entries.append(Entry(key, rel, len(payload), len(raw), payload.codec, payload.checksum, url, block,
                                     payload.stored_checksum(), offset, now if k else None))
            with self.index.transact():
                if rows:
                    self.index.set_many(rows)
                # No last-use record (keys.LAST_USE) yet: until its first touch an entry's
                # write time is its last use (evict), one index write less per put.
                added = self.index.add_many([(keys.entry(e.key), record(e)) for e in entries])
                for e in entries:
                    if keys.entry(e.key) in added:
                        won.add(e.location)
                    else:
                        lost += e.charged
                self._count([e for e in entries if e.location in won], 1)
                # Reserved as packed but written whole (packs unusable): the difference goes back.
                excess = total - sum(e.charged for e in entries)
                if excess:
                    self.index.incr(keys.BYTES, -excess)
                if lost:  # the losers' bytes are still on the disk: they stay reserved until freed
                    self.index.set(token, lost)
                else:
                    self.index.delete(token)  # the reserved bytes are now the entries'
            committed = True  # only once COMMIT succeeded (it fails on a full disk)
        finally:
            # Bytes first, then the reservation: disk use never exceeds the counter
            # (tests/reliability/test_concurrency.py: four processes racing for the same keys).
            for rel in files:
                if (rel, None) not in won:
                    (self.data_dir / rel).unlink(missing_ok=True)
            if pack is not None and appended:
                unpublished = [(loc, len(p)) for loc, p in zip(appended, packed) if loc not in won]
                pack.give_back([loc for loc, _ in unpublished], [n for _, n in unpublished])
                pack.done([loc for loc in appended if loc in won])
            IN_FLIGHT.pop(token, None)
            if not committed:
                self._release(token, total)
            elif lost:
                self._release(token, lost)
        out = []
        for e in entries:
            if e.location in won:
                out.append(self._remember(e))
            else:  # another writer published it first: serve theirs
                out.append(self._forget(e.key) or e)
        return out

    def _pack_writer(self, url: str) -> packs.PackWriter | None:
        """This process's pack writer, or None when payloads get files of their own."""
        if self.settings.pack_max_bytes <= 0:
            return None
        writer = packs.writer(self.data_dir / packs.FOLDER)
        try:
            return writer if writer.ready() else None
        except OSError as err:
            raise self._write_error(err, url) from err

    def _write_error(self, err: OSError, url: str) -> CacheError:
        if cannot_write(err):
            return self.unwritable_error(err, f"caching {url!r}")
        return CacheError(f"cannot write cache entry for {url!r} under {self.root}: {err}")

    def _write_file(self, rel: str, payload: codec.Encoded, url: str) -> None:
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
                    packs.write_all(fd, payload.parts, 0)
                finally:
                    os.close(fd)
                os.replace(tmp, final)
                return
            except FileNotFoundError as err:  # the folder was removed under us (by hand): make it again
                tmp.unlink(missing_ok=True)
                self._dirs.discard(folder)
                if attempt == 2:
                    raise self._write_error(err, url) from err
            except OSError as err:
                tmp.unlink(missing_ok=True)
                raise self._write_error(err, url) from err

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
        token = keys.reservation(os.getpid(), uuid.uuid4().hex)
        deadline = time.monotonic() + self.settings.lock_timeout_s
        while True:
            try:
                reserved = self._try_reserve(token, n, url)
            except BaseException:
                # Its COMMIT can fail (a full disk): then nothing is reserved, and nothing may
                # stay in flight either, or this process's room on that disk shrinks for good.
                IN_FLIGHT.pop(token, None)
                raise
            if reserved is None:
                return token
            limit = reserved
            if not self.evict(int(min(limit - n, LOW_WATERMARK * limit))):
                # Everything left is other writers' bytes in flight: wait for them.
                time.sleep(0.01)
            if time.monotonic() > deadline:
                raise CacheFullError(
                    f"could not free {format_size(n)} for {url!r} in the cache at {self.root} within "
                    f"{self.settings.lock_timeout_s:.0f} s (limit {format_size(limit)}, all of it in use by "
                    "writes in flight); fix: raise --cache-limit / FASTLOAD_CACHE_LIMIT"
                )

    def _try_reserve(self, token: str, n: int, url: str) -> int | None:
        """Reserve ``n`` bytes under ``token`` if they fit now (None); else the limit in force."""
        with self.index.transact():
            # Inside the transaction: a free-space reading taken before another
            # writer's reservation landed would let both spend the same space
            # (statvfs is a microsecond syscall). Writes still in flight are not on
            # the disk yet, so their bytes come off what it shows as free.
            room = self._room()
            if room is not None:
                room -= in_flight_on(self.device)
            used = self.index.get(keys.BYTES, 0)
            limit = self._capped(used, room)
            if n > limit:  # even an empty cache could not take it: the disk keeps its reserve
                raise CacheFullError(
                    f"disk under {self.root} has room for {format_size(max(0, used + (room or 0)))} of cache "
                    f"(its free space less the {format_size(reserve_bytes(self.data_dir, self.settings.disk_reserve_bytes))} it "
                    f"keeps free) but {url!r} needs {format_size(n)}; fix: free space there, lower "
                    "FASTLOAD_DISK_RESERVE (0 turns the reserve off), or move FASTLOAD_CACHE_DIR"
                )
            if used + n <= limit:
                self.index.incr(keys.BYTES, n)
                self.index.set(token, n)
                self.register_writer()
                IN_FLIGHT[token] = (self.device, n)  # inside: no other writer sees the room without it
                fits = True
            else:
                fits = False
        if fits:
            self.registered_writer()
            return None
        return limit

    def _release(self, token: str, n: int) -> None:
        """Give back a reservation whose write was not published."""
        IN_FLIGHT.pop(token, None)
        try:
            with self.index.transact():
                if self.index.pop(token, None) is not None:
                    self.index.incr(keys.BYTES, -n)
        except sqlite3.OperationalError as err:
            # Left behind, the reservation is returned by the next eviction or check().
            if not cannot_write(err):
                raise


def _charged(n: int, packed: bool) -> int:
    """Bytes a payload of ``n`` counts against the limit: a packed one its aligned range."""
    return aligned(n) if packed else n
