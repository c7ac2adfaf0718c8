"""Eviction and repair: LRU eviction under the evict lock, dead writers' reservations,
crash repair (:meth:`CacheRepair.check`), clearing, and the byte counter's readings.

Eviction: when a write would pass the limit, one process at a time (under
``evict.lock``) scans the index and deletes least-recently-used entries down to
``LOW_WATERMARK`` of the limit. The scan costs O(entries) but runs once per ~10% of
the limit written. On a full disk the payload files go first (SQLite needs space to
record a delete), then their records.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from fastload.cache import keys, packs
from fastload.cache.base import IN_FLIGHT, CacheBase
from fastload.cache.disk import cannot_write, disk_full
from fastload.cache.entry import Entry, location
from fastload.cache.index import GatedIndex
from fastload.config import format_size
from fastload.errors import CacheFullError

_log = logging.getLogger("fastload")

LOW_WATERMARK = 0.9


class CacheRepair(CacheBase):
    """Eviction, repair and the byte counter (a part of :class:`fastload.cache.Cache`)."""

    def entries(self) -> Iterator[Entry]:
        """Every entry in the index (a snapshot: one query)."""
        cut = len(keys.ENTRY)
        for k, rec in self.index.scan(keys.ENTRY):
            yield Entry.from_record(k[cut:], rec)

    def drop(self, key: str, *, version: Entry | None = None) -> bool:
        """Delete one entry (index record first, then its bytes); with ``version``, only
        if the index still holds that version of it."""
        self._memo.pop(key, None)
        with self.index.transact():
            rec = self.index.get(keys.entry(key))
            if rec is not None and version is not None and location(rec) != version.location:
                rec = None  # rewritten since it was read: the new version is not the bad one
            if rec is not None:
                gone = Entry.from_record(key, rec)
                self.index.delete(keys.entry(key))
                self.index.pop(keys.last_use(key), None)
                self.index.incr(keys.BYTES, -gone.charged)
                self._count([gone], -1)
        if rec is None:
            return False
        self._free(gone)
        return True

    def drop_entries(self, gone: Sequence[Entry]) -> int:
        """Delete these entries (``fastload clear URL``); returns how many the index held.

        On a full disk the index cannot record a delete, so their payload bytes go
        first; with that space back the index drops their records, as :meth:`evict` does
        (tests/reliability/test_disk_full.py).
        """
        self._refuse_if_read_only("clear entries from it")
        dropped = 0
        if self.unwritable is None:
            try:
                for e in gone:
                    dropped += self.drop(e.key)
                return dropped
            except sqlite3.OperationalError as err:
                if not disk_full(err):
                    raise
        for e in gone:
            self._free(e)
        if self.unwritable is not None and not self._reopen_writable():
            raise CacheFullError(f"disk under {self.root} is still full after deleting {len(gone)} cached payloads "
                                 "of the dataset; fix: `fastload clear`, evict to a lower size, or free space there")
        dropped += sum(self.drop(e.key) for e in gone)
        self.compact()
        return dropped

    def _free(self, e: Entry) -> None:
        """Give a dropped entry's bytes back to the disk: unlink its file, or punch its
        range out of its pack (readers of it then find zeros, and re-check the index)."""
        if e.offset is None:
            (self.data_dir / e.path).unlink(missing_ok=True)
            return
        try:
            packs.release(self.data_dir / e.path, e.offset, e.charged)
        except OSError as err:  # the probe found punching works here; say so if it stopped
            _log.warning("cache pack %s: could not free %d B at %d (%s); `fastload cache` (check) recounts",
                         e.path, e.charged, e.offset, err)

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
                self.drop(e.key, version=e)
        self.compact()
        return sum(e.charged for e in gone) + self._evict(to_bytes)

    def _evict(self, to_bytes: int) -> int:
        self.flush_recency()  # this process's own reads count in its LRU order
        with self._flock():
            # No recount from the published records here: it used to forget the
            # bytes of writes in flight, which then landed past the limit (one entry
            # per concurrent writer). Only dead writers' reservations are returned.
            freed = self._return_dead_reservations()
            if self.volume() <= to_bytes:
                return freed
            closed = self._closed_packs()  # before the scan: no entry lands in them after it
            entries = self._lru_order()
            dropped = set()
            for e in entries:
                if self.volume() <= to_bytes:
                    break
                if self.drop(e.key, version=e):
                    freed += e.charged
                    dropped.add(e.key)
            live = {e.path for e in entries if e.offset is not None and e.key not in dropped}
            for rel in closed - live:  # a closed pack no entry refers to, and its clock
                (self.data_dir / rel).unlink(missing_ok=True)
                self.index.delete(keys.last_use(rel))
            return freed

    def _written(self, e: Entry) -> float:
        """An entry's last use until a read records one (0.0 if its file is gone: evict it first)."""
        return e.published if e.published is not None else _written(self.data_dir / e.path)

    def _closed_packs(self) -> set[str]:
        """Packs (relative to data/) that get no more entries: sealed, or their writer is dead."""
        folder = self.data_dir / packs.FOLDER
        if not folder.is_dir():
            return set()
        return {f"{packs.FOLDER}/{p.name}" for p in folder.glob("*" + packs.SUFFIX)
                if packs.is_sealed(p) or not _alive(packs.owner(p.name))}

    def _repair_packs(self, closed: set[str], entries: Sequence[Entry]) -> tuple[int, int]:
        """Closed packs: unlink those no entry refers to; punch out the unreferenced ranges of
        the rest and cut their unreferenced tail (a SIGKILL mid-append leaves one).
        Returns (packs removed, bytes reclaimed)."""
        live: dict[str, list[tuple[int, int]]] = {}
        for e in entries:
            if e.offset is not None and e.path in closed:
                live.setdefault(e.path, []).append((e.offset, e.charged))
        removed = reclaimed = 0
        for rel in closed:
            path = self.data_dir / rel
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            if rel not in live:
                path.unlink(missing_ok=True)
                removed += 1
                reclaimed += size
                continue
            holes, end = packs.gaps(size, live[rel])
            try:
                packs.punch_at(path, holes)
                if end < size:
                    os.truncate(path, end)
            except OSError as err:
                _log.info("cache pack %s not repaired: %s", rel, err)
                continue
            reclaimed += sum(n for _, n in holes) + max(0, size - end)
        return removed, reclaimed

    def compact(self) -> None:
        """Give the index's write-ahead log back to the disk (best effort).

        SQLite's WAL only grows until a checkpoint truncates it; on a small disk it held
        2 MB of a 3 MB tmpfs after a full-disk epoch (tests/reliability/test_disk_full.py).
        """
        if isinstance(self.index, GatedIndex):  # not the read-only index
            try:
                self.index.checkpoint()
            except sqlite3.Error as err:
                _log.info("cache index not compacted: %s", err)

    def _lru_order(self) -> list[Entry]:
        """Every entry, least recently used first (its last read, else when it was written): the one
        LRU scan, for eviction and for a full disk's unlinking alike."""
        entries = list(self.entries())
        cut = len(keys.LAST_USE)
        used = {k[cut:]: t for k, t in self.index.scan(keys.LAST_USE)}
        # A packed entry's last use is its pack's (Entry.clock) or, from before packs had
        # clocks, its own; ties within a pack go oldest-written first.
        atimes = {e.key: (max(used.get(e.clock, 0.0), used.get(e.key, 0.0)) or self._written(e), self._written(e))
                  for e in entries}
        return sorted(entries, key=lambda e: atimes[e.key])

    def _unlink_lru(self, to_bytes: int) -> list[Entry]:
        """Delete least-recently-used payload files (not their records) until ``to_bytes`` remain."""
        entries = self._lru_order()
        left, gone = sum(e.charged for e in entries), []
        for e in entries:
            if left <= to_bytes:
                break
            self._free(e)
            left -= e.charged
            gone.append(e)
        return gone

    def _reservations(self) -> list[tuple[str, int]]:
        return [(k, int(n)) for k, n in self.index.scan(keys.RESERVATION)]

    def _return_dead_reservations(self) -> int:
        """Return reservations of dead writers, and our own that no write holds any more."""
        freed, me = 0, str(os.getpid())
        for token, n in self._reservations():
            pid = keys.reservation_pid(token)
            if (pid == me and token not in IN_FLIGHT) or (pid != me and not _alive(pid)):
                with self.index.transact():
                    if self.index.pop(token, None) is not None:
                        self.index.incr(keys.BYTES, -n)
                        freed += n
        return freed

    def _count(self, entries: Sequence[Entry], sign: int) -> None:
        """Add (``sign`` 1) or take off (-1) these entries in the index's totals, inside the
        caller's transaction. A cache whose totals were never counted (made before they were
        kept) is counted whole by :meth:`totals` first."""
        if not entries:
            return
        self.index.incr(keys.CHANGES, len(entries))
        if self.index.get(keys.ENTRIES) is None:
            return  # not counted yet: totals() counts every entry, these included
        self.index.incr(keys.ENTRIES, sign * len(entries))
        self.index.incr(keys.STORED, sign * sum(e.stored for e in entries))
        self.index.incr(keys.RAW, sign * sum(e.raw for e in entries))

    def totals(self) -> dict[str, int]:
        """The entries' count and their stored and raw bytes, and the changes counter, from the
        index's totals: no scan (`fastload info` at a million entries took 10 s with one). A
        cache made before totals were kept is counted once, here (and recorded when writable)."""
        names = (*keys.TOTALS, keys.CHANGES)
        got = self.index.get_many(names)
        if keys.ENTRIES not in got:
            if self.unwritable is not None:
                got = _totals(list(self.entries()))
            else:
                with self.index.transact():  # no write lands between the count and its record
                    got = self.index.get_many(names)
                    if keys.ENTRIES not in got:
                        got = _totals(list(self.entries())) | {keys.CHANGES: got.get(keys.CHANGES, 0)}
                        self.index.set_many(got)
        return {name: int(got.get(name, 0)) for name in names}

    def volume(self) -> int:
        """Payload bytes currently accounted for."""
        return int(self.index.get(keys.BYTES, 0))

    def corrupt_count(self) -> int:
        """Bad entries detected and dropped, over the cache's lifetime."""
        return int(self.index.get(keys.CORRUPT, 0))

    def crashed_writers(self) -> list[str]:
        """Writer rows (keys.writer) of processes that are gone: they ended mid-write, without
        their clean end; also the PIDs of dead writers' reservations. Two small queries."""
        rows = [k for k, _ in self.index.scan(keys.WRITER)] + [k for k, _ in self._reservations()]
        return [k for k in rows if not _alive(k.split(":")[1])]

    def recover(self) -> dict[str, int] | None:
        """:meth:`check`, only when a writer crashed since the last one (:meth:`crashed_writers`);
        None when none did. A rerun of `fastload cache` then costs what it stages, not a scan of
        everything the cache holds (27.6 s of a 100k rerun before; issue 31)."""
        crashed = self.crashed_writers()
        if not crashed or self.unwritable is not None:
            return None
        _log.info("cache %s: %d writer(s) ended without closing it (a crash or a kill); repairing", self.root, len(crashed))
        found = self.check()
        with self.index.transact():
            for k in crashed:
                if keys.of(keys.WRITER, k) is not None:
                    self.index.delete(k)
        return found

    def check(self, max_tmp_age_s: float = 3600.0) -> dict[str, int]:
        """Repair after crashes: remove orphan payloads and stale temp files, reclaim the
        unreferenced bytes of closed packs (and packs with no entry), recount bytes.

        A cache that cannot be written (read-only, or a full disk) is left as it is.
        """
        if self.unwritable is not None:
            return {"orphans": 0, "stale_tmp": 0, "packs_removed": 0, "pack_bytes_reclaimed": 0, "bytes": self.volume()}
        with self._flock():
            closed = self._closed_packs()  # before the scan, as in _evict
            entries = list(self.entries())
            removed, reclaimed = self._repair_packs(closed, entries)
            known = {e.path for e in entries}
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
                entries = list(self.entries())
                total = sum(e.charged for e in entries) + sum(n for _, n in self._reservations())
                self.index.set(keys.BYTES, total)
                self.index.set_many(_totals(entries))
        return {"orphans": orphans, "stale_tmp": stale, "packs_removed": removed, "pack_bytes_reclaimed": reclaimed,
                "bytes": total}

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
            for path in self._payload_files():
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
            for path in self._payload_files():
                path.unlink(missing_ok=True)

    def _payload_files(self) -> list[Path]:
        """Every file that holds payload bytes: whole payloads, packs, writes in progress."""
        return [*self.data_dir.glob("*/*.flp"), *self.data_dir.glob(f"{packs.FOLDER}/*{packs.SUFFIX}"), *self.temp_files()]

    def disk_use(self) -> dict[str, int]:
        """Bytes the cache takes on its disk: its payload files' allocated blocks (a pack's
        punched-out holes take none), and its index (SQLite's file and write-ahead log)."""
        payload = 0
        for folder in _subfolders(self.data_dir):
            for f in _files(folder):
                try:
                    payload += f.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:
                    continue  # evicted while we looked
        index = 0
        for f in _files(self.root / "index"):
            try:
                index += f.stat().st_size
            except FileNotFoundError:
                continue
        return {"payload": payload, "index": index}

    def temp_files(self) -> list[Path]:
        """Files being written (``<pid>-<nonce>.part``, next to the payloads and in ``tmp/``)."""
        return [*self.data_dir.glob("*/*.part"), *self.tmp_dir.glob("*.part")]


def _subfolders(path: Path) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _files(path: Path | str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _totals(entries: Sequence[Entry]) -> dict[str, int]:
    return {keys.ENTRIES: len(entries), keys.STORED: sum(e.stored for e in entries), keys.RAW: sum(e.raw for e in entries)}


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

