"""Checked reads: index lookups (batched, with a per-process memo), payload reads
checked against the index, batch reads into one buffer (:mod:`fastload.cache.gather`), and
the LRU's last uses (held in memory, written in batches).

Every read checks the stored size and an xxh3 checksum of the stored bytes (header
included), then the header against the index. A bad or missing payload is dropped,
counted (``corrupt`` in the index, ``cache_corrupt`` in the loader's stats) and
reported as a miss, so the caller refetches it.
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fastload import codec
from fastload.cache import gather, keys
from fastload.cache.base import MEMO_EVICT
from fastload.cache.disk import cannot_write
from fastload.cache.entry import STORED_SQL, Entry
from fastload.cache.held import hook_exit
from fastload.cache.repair import CacheRepair
from fastload.cache.rows import Rows
from fastload.errors import CodecError
from fastload.stats import current_collector

_log = logging.getLogger("fastload")

# Last uses are held in memory, one per clock (a pack, or a whole-file entry: Entry.clock),
# and written in one transaction once this many are held, or once the oldest held is this
# old (and at close and at a clean exit). A write per read (at most one per entry per 10 s
# and process, before) made the first warm pass of a process cost 15.7 us per object against
# 4.2 for the next (read_into, 10k entries of 4 KiB); a row per entry, batched, still 2.5.
RECENCY_FLUSH_KEYS = 8192
RECENCY_FLUSH_S = 30.0


class CacheReads(CacheRepair):
    """Checked reads (a part of :class:`fastload.cache.Cache`)."""

    def entry(self, key: str) -> Entry | None:
        """The index record for ``key``, or None."""
        entry = self._memo.get(key)
        if entry is None:
            rec = self.index.get(keys.entry(key))
            if rec is None:
                return None
            entry = self._remember(Entry.from_record(key, rec))
        return entry

    def entries_for(self, names: Sequence[str]) -> list[Entry | None]:
        """The index records of many cache keys: one index query per 500 not yet known here.

        One SQLite lookup per key was half the time of a warm epoch (80-100 us each,
        benchmarks/peers/results/profile.md).
        """
        memo = self._memo
        found = [memo.get(k) for k in names]
        # Keyed by the caller's own strings (Identity's keys), and remembered under them: the
        # memo's key is then the very object the next look-up brings, found by identity rather
        # than compared character by character in a second string. Read at random over 100k
        # entries, each object a look-up touches is a cache miss: memo look-ups cost about twice
        # their cost at 10k per key (issue 31; tests/unit/test_cache_memo.py).
        todo = {keys.entry(k): k for k, e in zip(names, found) if e is None}
        if todo:
            got = {}
            for name, rec in self.index.get_many(list(todo)).items():
                key = todo[name]
                # From this dict, not the memo: the memo may be full (MEMO_MAX) or off (staging).
                got[key] = self._remember(Entry.from_record(key, rec))
            found = [e if e is not None else got.get(k) for k, e in zip(names, found)]
        return found

    def present(self, names: Sequence[str]) -> set[str]:
        """Those cache keys the index holds (known here, else one query per 500), decoding no
        record: staging checks a dataset's entries this way (a rerun of 100k spent ~1.5 s
        decoding records it only needed to find)."""
        memo = self._memo
        found = {k for k in names if k in memo}
        todo = [keys.entry(k) for k in dict.fromkeys(names) if k not in found]
        cut = len(keys.ENTRY)
        return found | {name[cut:] for name in self.index.present(todo)}

    def stored_bytes(self, names: Sequence[str]) -> int:
        """The stored bytes of those cache keys the index holds (one query per 500 not known here)."""
        memo = self._memo
        total = sum(memo[k].stored for k in set(names) if k in memo)
        todo = [keys.entry(k) for k in dict.fromkeys(names) if k not in memo]
        return total + sum(self.index.select(STORED_SQL, todo).values())

    @property
    def known(self) -> Mapping[str, Entry]:
        """Entries this process has written or looked up (they may have gone since)."""
        return self._memo

    def forget(self, keys: Sequence[str]) -> None:
        """Drop these keys' entries from the memo: for a caller that keeps them itself (a dataset's
        rows, fastload.cache.rows). At a million samples the memo's entries took 440 MB beside them."""
        memo = self._memo
        for key in keys:
            memo.pop(key, None)

    def _remember(self, entry: Entry) -> Entry:
        memo = self._memo
        if len(memo) >= self.memo_max:
            if self.memo_max <= 0:
                return entry
            # The oldest eighth goes, not the whole memo: emptied at its bound, a dataset larger
            # than the memo found none of a batch known for the next MEMO_MAX entries, and its
            # fetch ahead then held a marker and queried the index for every item
            # (tests/unit/test_cache_memo.py).
            for key in list(itertools.islice(memo, max(1, self.memo_max // MEMO_EVICT))):
                del memo[key]
        memo[entry.key] = entry
        return entry

    def _forget(self, key: str) -> Entry | None:
        """Drop the memo of ``key`` and return its current index record, if any."""
        self._memo.pop(key, None)
        return self.entry(key)

    def get(self, key: str) -> bytes | None:
        """Return the raw bytes for ``key``, or None on a miss or a dropped bad entry."""
        entry = self.entry(key)
        if entry is not None and entry.codec == codec.RAW and entry.stored_checksum is not None:
            body = self._raw_body(entry)
            if body is not None:
                self._touch((entry,))
                return body
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

    def _raw_body(self, entry: Entry) -> bytes | None:
        """A RAW entry's bytes, read into their own object (no copy out of the payload:
        a third of a warm 110 KB ``fastload.open``), checked as :meth:`_checked_payload`
        checks them: the stored checksum over head and body, the head against the index.
        None when anything is off; :meth:`get` then takes the full path, which tells a
        raced eviction from a bad entry."""
        head_bytes, base = entry.stored - entry.raw, entry.offset or 0
        if head_bytes < codec.HEADER_BYTES:
            return None
        try:
            fd = os.open(self.data_prefix + entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            head = os.pread(fd, head_bytes, base)
            body = os.pread(fd, entry.raw, base + head_bytes)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(body) != entry.raw or codec.checksum_parts(head, body) != entry.stored_checksum:
            return None
        return body if codec.raw_head_agrees(head, entry.raw, entry.checksum) else None

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
        for _ in range(2):  # twice: the entry may have been rewritten since this process looked it up
            if entry is None:
                return None
            try:
                payload = gather.read_payload_file(self.data_prefix + entry.path, entry.stored, entry.offset)
            except FileNotFoundError:
                entry = self._recheck(entry, "payload file is missing")
                continue
            try:
                if len(payload) != entry.stored:
                    raise CodecError(f"payload is {len(payload)} B, index says {entry.stored} B")
                if entry.stored_checksum is not None and codec.checksum(payload) != entry.stored_checksum:
                    raise CodecError("stored checksum mismatch: the payload file changed on disk")
                info = codec.parse_header(payload)
                if info.checksum != entry.checksum or info.raw_size != entry.raw or info.codec != entry.codec:
                    raise CodecError("payload header disagrees with the index")
            except CodecError as err:
                entry = self._recheck(entry, str(err))
                continue
            self._touch((entry,))
            return entry, payload, info
        return None

    def read_into(self, requests: Sequence[tuple[str, Sequence[tuple[int, int, int]]]], out: Any,
                  entries: list[Entry | None] | None = None) -> list[int]:
        """Copy byte ranges of many entries' raw bytes into ``out``, as one batch.

        Each entry is checked exactly as :meth:`get` checks it, by
        :func:`fastload.cache.gather.gather` (C with the GIL released, or its
        pure-Python fallback), and read once however many ranges it serves.

        Args:
            requests: ``(key, copies)`` pairs; a copy ``(src, length, dst)`` puts
                ``raw[src:src+length]`` at byte ``dst`` of ``out``.
            out: A writable, C-contiguous buffer (numpy array, bytearray, or the
                numpy view of a pinned tensor).
            entries: The caller's own record of these keys' entries, one per request
                (None where it has none: looked up here), as a dataset keeps its samples'
                (fastload.read.located). Updated in place: the entry each request was read
                from (a rewritten one's new entry), None where it missed.

        Returns:
            The positions in ``requests`` that missed: not cached, or bad and
            dropped (counted, as in :meth:`get`). The caller fetches those.
        """
        missed: list[int] = []
        hits: list[Entry] = []
        if entries is None:
            entries = self.entries_for([key for key, _ in requests])
        elif unknown := [i for i, e in enumerate(entries) if e is None]:  # `is`: an Entry's __eq__ is Python
            for i, e in zip(unknown, self.entries_for([requests[i][0] for i in unknown])):
                entries[i] = e
        todo = list(range(len(requests)))
        for _ in range(2):  # twice: entries may have been rewritten since this process looked them up
            where: list[int] = []
            jobs: list[gather.Job] = []
            for i in todo:
                e, copies = entries[i], requests[i][1]
                if e is None:
                    missed.append(i)
                elif (copies[0][0] + copies[0][1] > e.raw if len(copies) == 1  # a sample's one copy: no generator
                      else any(src + n > e.raw for src, n, _ in copies)):
                    self._corrupt(e, f"index says {e.raw} B, fewer than the block holds")
                    missed.append(i)
                else:
                    path = self.data_prefix + e.path
                    jobs.append(gather.Job(path, e.stored, e.raw, e.codec, e.checksum, e.stored_checksum, copies, e.offset))
                    where.append(i)
            todo = []
            for i, res in zip(where, gather.gather(jobs, out)):
                e = entries[i]
                assert e is not None
                if res is None:
                    hits.append(e)
                elif res[0] == "oserror":
                    raise OSError(res[1], os.strerror(res[1]), str(self.data_dir / e.path))
                elif (current := self._recheck(e, res[1] if res[0] == "corrupt" else "payload file is missing")) is not None:
                    entries[i] = current
                    todo.append(i)
                else:
                    missed.append(i)
            if not todo:
                break
        missed += todo
        for i in missed:
            entries[i] = None
        self._touch(hits)
        return sorted(missed)

    def read_rows(self, rows: Rows, picks: np.ndarray, dsts: np.ndarray, out: Any) -> list[int]:
        """:meth:`read_into` of whole payloads described by ``rows`` (fastload.cache.rows): row
        ``picks[j]`` read whole to byte ``dsts[j]`` of ``out``, looked up by no key.

        Returns the positions in ``picks`` that failed (gone, rewritten or bad since the row was
        put): their rows are emptied, and the caller reads them the usual way (:meth:`read_into`:
        looked up again, dropped and counted if bad) and puts the entries it finds.
        """
        failed = gather.gather_rows(rows.paths, rows.table, picks, dsts, out)
        bad = []
        for j, res in failed:
            if res is not None and res[0] == "oserror":
                path = rows.paths[int(rows.table[picks[j], gather.ROW_PATH]) - 1]
                raise OSError(res[1], os.strerror(res[1]), os.fsdecode(path))
            bad.append(j)
        if bad:
            rows.put([int(picks[j]) for j in bad], [None] * len(bad))
        ids = rows.table[np.delete(picks, bad) if bad else picks, gather.ROW_PATH]
        self._touch_clocks([rows.clocks[k - 1] for k in np.unique(ids).tolist() if k])
        return bad

    def contains(self, key: str) -> bool:
        """Cheap validity check (index record + file of the right size, or a pack that
        reaches its end), no checksum."""
        entry = self.entry(key)
        if entry is None:
            return False
        try:
            size = (self.data_dir / entry.path).stat().st_size
            return size == entry.stored if entry.offset is None else size >= entry.offset + entry.stored
        except FileNotFoundError:
            return False

    def _touch(self, entries: Sequence[Entry]) -> None:
        """Hold these entries' last use in memory, under their clocks (Entry.clock); written
        in batches (RECENCY_FLUSH_*)."""
        self._touch_clocks([e.clock for e in entries])

    def _touch_clocks(self, clocks: Sequence[str]) -> None:
        if not clocks:
            return
        now, held = time.time(), self._held
        if not held.clocks:
            held.since = now
            hook_exit()
        held.clocks.update(dict.fromkeys(clocks, now))
        if len(held.clocks) >= RECENCY_FLUSH_KEYS or now - held.since > RECENCY_FLUSH_S:
            self.flush_recency()

    def _recheck(self, entry: Entry, why: str) -> Entry | None:
        """A payload that is gone or failed its checks, looked up again before it is called
        bad: evicted meanwhile (a miss; a packed one reads as zeros once punched out),
        rewritten (returns the new entry to read instead), or bad under its live entry
        (dropped and counted: returns None)."""
        current = self._forget(entry.key)
        if current is not None and current.location == entry.location:
            self._corrupt(entry, why)
            return None
        return current

    def _corrupt(self, entry: Entry, why: str) -> None:
        try:
            self.drop(entry.key, version=entry)
            self.index.incr(keys.CORRUPT)
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

