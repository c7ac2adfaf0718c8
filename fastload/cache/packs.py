"""Pack files: small payloads appended to one file per writing process.

A payload of at most ``Settings.pack_max_bytes`` is appended to a pack of the
process that writes it, ``data/packs/<pid>-<nonce>.pack``, at an offset aligned
to :data:`~fastload.cache.entry.PACK_ALIGN`, instead of getting a temp file, a
rename and an inode of its own (a cold epoch of 110 KB objects spent 8-12% of its
CPU in ext4's inode allocation, benchmarks/peers/results/profile.md). Its entry
records (pack, offset, length). Larger payloads keep whole files.

Why 1 MiB (the default threshold): CPU per ``put_many`` payload, a file each vs a
pack, on this repo's 2-core ext4 machine (32-payload batches, raw payloads):
16 KB 0.127 -> 0.048 ms, 110 KB 0.228 -> 0.100 ms, 1 MiB 1.57 -> 1.33 ms; warm
``read_into`` of the same payloads costs the same from either (0.029 ms at 110 KB).
Below 1 MiB the per-file costs dominate; above it the bytes do, and a block of a
large object keeps its own file.

Contracts (the cache's, kept for packed entries):

* **Atomic.** A payload's bytes are written (``pwrite``) before the transaction
  that publishes its entry. A crash leaves unreferenced bytes, never a
  referenced half entry; offsets are never reused, so a stale location holds
  zeros or nothing, never another entry's bytes (a read that finds them re-checks
  the index: a miss, not corruption).
* **One appender per pack.** A process appends only to packs it created
  (:func:`writer` is per PID: a forked DataLoader worker opens its own); every
  other reader uses ``pread``. The writer opens its pack per batch and keeps no
  descriptor, so nothing is inherited and a remount is never blocked.
* **Bounded.** A packed entry is charged its aligned length
  (:attr:`~fastload.cache.entry.Entry.charged`). Dropping it punches its blocks
  out of the pack (``fallocate(PUNCH_HOLE | KEEP_SIZE)``), so the disk follows
  the byte counter. A file system without hole punching (probed on each new
  pack) gets whole files instead, and says so once in the log.
* **Sealed packs.** A writer moves to a new pack once its pack holds
  :data:`ROTATE_BYTES`; the old one is *sealed* (mode :data:`SEALED_MODE`) once
  no write into it is still waiting for its transaction. A sealed pack, or one
  whose writer is dead, gets no more entries: eviction unlinks it once no entry
  refers to it, and ``check`` punches out its unreferenced ranges and truncates
  its unreferenced tail (what a SIGKILL mid-append leaves).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fastload.cache.entry import aligned

_log = logging.getLogger("fastload")

FOLDER = "packs"  # under data/
SUFFIX = ".pack"
ROTATE_BYTES = 256 * 1024**2
# A pack's mode says whether its writer may still append: OPEN_MODE, or SEALED_MODE
# (owner-execute set; the owner keeps the write permission that punching needs).
OPEN_MODE = 0o600
SEALED_MODE = 0o700
_KEEP_SIZE, _PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h
BLOCK = 4096  # what punching frees whole: ext4's and XFS's block, tmpfs's page


def _bind_fallocate() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):  # not glibc/Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _bind_fallocate()


def punch(fd: int, offset: int, length: int) -> None:
    """Free the disk blocks of ``[offset, offset + length)`` of ``fd``'s file; its size stays.

    Raises:
        OSError: The file system cannot (EOPNOTSUPP), or the call failed.
    """
    if length <= 0:
        return
    if _FALLOCATE is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available on this system")
    if _FALLOCATE(fd, _KEEP_SIZE | _PUNCH_HOLE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch_at(path: Path, ranges: Iterable[tuple[int, int]]) -> None:
    """Punch ``(offset, length)`` ranges out of the pack at ``path`` (gone already: nothing to do)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        for offset, length in ranges:
            punch(fd, offset, length)
    finally:
        os.close(fd)


def release(path: Path, offset: int, length: int) -> None:
    """Punch a dropped entry's ``[offset, offset + length)`` out of the pack at ``path``,
    widened to whole :data:`BLOCK` s where the rest of a boundary block already reads as
    zeros (a neighbour dropped before, padding).

    Entries are 64 B aligned, so a range shares its first and last blocks with neighbours;
    punching only the range would zero its part of them and keep both allocated until a
    repair. Punching bytes that read as zeros changes nothing a reader can see, and frees
    the block. The last block is widened only when the file already extends past it: a
    pack is appended in order, so bytes there are final, never a write still to come.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        start, end = offset, offset + length
        head, tail = start - start % BLOCK, -(-end // BLOCK) * BLOCK
        if head < start and _zeros(os.pread(fd, start - head, head), start - head):
            start = head
        if end < tail <= os.fstat(fd).st_size and _zeros(os.pread(fd, tail - end, end), tail - end):
            end = tail
        punch(fd, start, end - start)
    finally:
        os.close(fd)


def _zeros(data: bytes, n: int) -> bool:
    return len(data) == n and not data.strip(b"\0")


def owner(name: str) -> str:
    """The writer's PID (as text) of pack file ``name``."""
    return name.split("-", 1)[0]


def is_sealed(path: Path) -> bool:
    """Whether the pack at ``path`` is sealed (its writer appends no more); False if it is gone."""
    try:
        return bool(path.stat().st_mode & 0o100)
    except FileNotFoundError:
        return False


def gaps(size: int, live: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], int]:
    """The ranges of a pack of ``size`` bytes that no live ``(offset, charged)`` extent
    covers, and the end of the last live extent (the size it may be cut to)."""
    out, at = [], 0
    for offset, length in sorted(live):
        if offset > at:
            out.append((at, offset - at))
        at = max(at, offset + length)
    return out, at


# One payload as its parts (codec.Encoded.parts), written one after another.
Payload = Sequence[bytes | memoryview]


def write_all(fd: int, parts: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``parts`` one after another at ``offset`` of ``fd``: one ``pwritev`` (no joined copy),
    continued where the kernel wrote less."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class PackWriter:
    """The packs one process appends to in one cache (see :func:`writer`)."""

    def __init__(self, folder: Path, rotate_bytes: int | None = None) -> None:
        self.folder = folder
        self.rotate_bytes = ROTATE_BYTES if rotate_bytes is None else rotate_bytes
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._rel: str | None = None  # the pack appended to now, relative to data/
        self._tail = 0
        self._pending: dict[str, int] = {}  # pack -> appends not yet published or given back
        self.usable: bool | None = None  # None: not known until the first pack is made

    def ready(self) -> bool:
        """Whether payloads can be packed here (makes the first pack, probing hole punching)."""
        with self._lock:
            if self.usable is None or (self.usable and self._rel is None):
                self._start_pack()
            return bool(self.usable)

    def append(self, payloads: Sequence[Payload]) -> list[tuple[str, int]] | None:
        """Write ``payloads`` (each as its parts) to this process's pack; their ``(pack, offset)``, or None when
        packs cannot be used here (the caller writes whole files).

        Each location is pending until :meth:`done` (published) or :meth:`give_back`.

        Raises:
            OSError: The write failed (nothing of it stays pending).
        """
        for attempt in (1, 2):
            with self._lock:
                sizes = [sum(len(part) for part in p) for p in payloads]
                total = sum(aligned(n) for n in sizes)
                # A new pack: the first, after one failed to start (ENOSPC), or at the rotation size.
                if self.usable is None or self._rel is None or (self._tail and self._tail + total > self.rotate_bytes):
                    self._start_pack()
                if not self.usable or self._rel is None:
                    return None
                rel, at = self._rel, self._tail
                self._tail += total
                self._pending[rel] = self._pending.get(rel, 0) + len(payloads)
            out = []
            for n in sizes:
                out.append((rel, at))
                at += aligned(n)
            try:
                self._write(rel, out, payloads)
                return out
            except FileNotFoundError:
                # Deleted under us (`fastload clear` from another process, or by hand):
                # start a new pack, once.
                self.done(out)
                with self._lock:
                    if self._rel == rel:
                        self._rel, self.usable = None, None
                if attempt == 2:
                    raise
            except BaseException:
                self.give_back(out, sizes)
                raise
        return None  # not reached

    def _write(self, rel: str, out: Sequence[tuple[str, int]], payloads: Sequence[Payload]) -> None:
        fd = os.open(self.folder.parent / rel, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for (_, offset), payload in zip(out, payloads):
                write_all(fd, payload, offset)
        finally:
            os.close(fd)

    def done(self, locations: Iterable[tuple[str, int]]) -> None:
        """These appends are published (or given back): a rotated pack may now be sealed."""
        with self._lock:
            for rel, _ in locations:
                left = self._pending[rel] = self._pending.get(rel, 1) - 1
                if left <= 0:
                    del self._pending[rel]
                    if rel != self._rel:
                        self._seal(rel)

    def give_back(self, locations: Sequence[tuple[str, int]], sizes: Sequence[int]) -> None:
        """Punch out appends that will not be published (a failed write, a lost race)."""
        try:
            by_pack: dict[str, list[tuple[int, int]]] = {}
            for (rel, offset), n in zip(locations, sizes):
                by_pack.setdefault(rel, []).append((offset, aligned(n)))
            for rel, ranges in by_pack.items():
                punch_at(self.folder.parent / rel, ranges)
        except OSError as err:  # check() reclaims them once this pack is sealed or its writer gone
            _log.info("unpublished bytes in cache pack not punched out now: %s", err)
        finally:
            self.done(locations)

    def _start_pack(self) -> None:
        """Move to a new pack (lock held); seal the old one if nothing is pending in it."""
        old = self._rel
        self._rel, self._tail = None, 0
        if old is not None and not self._pending.get(old):
            self._seal(old)
        name = f"{FOLDER}/{self.pid}-{uuid.uuid4().hex[:16]}{SUFFIX}"
        path = self.folder.parent / name
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, OPEN_MODE)
        try:
            punch(fd, 0, BLOCK)  # beyond the end of an empty file: a probe that changes nothing
        except OSError as err:
            os.close(fd)
            path.unlink(missing_ok=True)
            if self.usable is not False:
                _log.warning("the file system under %s cannot punch holes (%s); small cache payloads are stored "
                             "as whole files there", self.folder, err)
            self.usable = False
            return
        os.close(fd)
        self._rel, self.usable = name, True

    def _seal(self, rel: str) -> None:
        try:
            os.chmod(self.folder.parent / rel, SEALED_MODE)
        except FileNotFoundError:
            pass  # evicted whole already


_WRITERS: dict[Path, PackWriter] = {}
_WRITERS_GUARD = threading.Lock()


def writer(folder: Path) -> PackWriter:
    """This process's pack writer for the packs folder ``folder`` (a forked child gets its own)."""
    with _WRITERS_GUARD:
        w = _WRITERS.get(folder)
        if w is None or w.pid != os.getpid():
            w = _WRITERS[folder] = PackWriter(folder)
        return w


def _after_fork_child() -> None:
    global _WRITERS_GUARD
    _WRITERS_GUARD = threading.Lock()  # a parent's thread may have held it
    _WRITERS.clear()  # never append to the parent's packs


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)
