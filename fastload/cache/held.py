"""What a process holds for a cache folder until it writes it: the last uses of what it read
(written in batches, reads.py) and its writer row (keys.writer: removed at its clean end,
so one left behind says the process crashed mid-write; repair.py ``recover``).

Held per cache folder and process, not per :class:`~fastload.cache.Cache` object: a Cache
made for one call and collected before the process ends (``fastload cache`` drops its
reader when ``stage`` returns) loses nothing. A clean end writes what is held, through
multiprocessing's finalizers: they run at the interpreter's exit and when a
multiprocessing child (a DataLoader worker) returns, which skips ``atexit``. A forked
child starts holding nothing: its parent writes what the parent held.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from fastload.cache import keys
from fastload.cache.index import INDEX_FILE, TABLE, UPSERT

_log = logging.getLogger("fastload")

_EXIT_TIMEOUT_S = 5.0  # a process's end waits this long at most for a busy index


@dataclass
class Held:
    """One cache folder's holdings in this process."""

    index_file: Path
    clocks: dict[str, float] = field(default_factory=dict)  # Entry.clock -> last use (time.time())
    since: float = 0.0  # when the oldest clock held was added
    writer: bool = False  # this process's writer row is in the index


_HELD: dict[Path, Held] = {}
_HOOKED_PID = 0


def held_for(root: Path) -> Held:
    """The holdings of the cache folder ``root`` in this process (one object per folder)."""
    root = root.resolve()
    held = _HELD.get(root)
    if held is None:
        held = _HELD[root] = Held(root / "index" / INDEX_FILE)
    return held


def hook_exit() -> None:
    """Have this process's clean end write what it holds (once per process)."""
    global _HOOKED_PID
    if _HOOKED_PID != os.getpid():
        _HOOKED_PID = os.getpid()
        multiprocessing.util.Finalize(None, finish_all, exitpriority=10)


def finish_all() -> None:
    """Write every folder's held last uses and remove this process's writer rows.

    At a process's end: its own short-lived connection, no fork gate or write lock (no
    other thread of ours writes now), a bounded wait, and never a new index: a cache folder
    deleted meanwhile stays deleted."""
    for held in list(_HELD.values()):
        if not held.clocks and not held.writer:
            continue
        try:
            con = sqlite3.connect(f"file:{held.index_file}?mode=rw", uri=True, timeout=_EXIT_TIMEOUT_S,
                                  isolation_level=None)
        except sqlite3.Error:
            continue  # the folder is gone, or cannot be written: nothing to keep
        try:
            # As the index's own connections (GatedIndex._connect): no fsync at commit. Without it each
            # DataLoader worker's end waited 1.5-6.6 ms for one, inside the epoch (torch joins them).
            con.execute("PRAGMA synchronous = NORMAL")
            con.execute("BEGIN IMMEDIATE")
            con.executemany(UPSERT, [(keys.last_use(c), t) for c, t in held.clocks.items()])
            if held.writer:
                con.execute(f"DELETE FROM {TABLE} WHERE key = ?", (keys.writer(os.getpid()),))
            con.execute("COMMIT")
            held.clocks.clear()
            held.writer = False
        except sqlite3.Error as err:  # at exit: say it, never raise
            _log.info("cache index %s: last uses or writer row not written at exit: %s", held.index_file, err)
        finally:
            con.close()


def _start_child() -> None:
    global _HOOKED_PID
    _HOOKED_PID = 0
    for held in _HELD.values():
        held.clocks.clear()
        held.writer = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_child)
