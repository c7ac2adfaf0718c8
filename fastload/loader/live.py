"""Live stats: ``DataLoader(log_every=N, summary_writer=w)``.

Every N batches the loader's :meth:`~fastload.loader.dataloader.DataLoader.stats` is
snapshotted and the *interval* since the previous report (not the running
total, which hides a recent stall) is

* logged through :mod:`logging` (logger ``fastload.live``): one INFO line with
  batches/s, the data-stall fraction, the cache hit rate and the slowest op,
  and the full stats table at DEBUG. Asking for ``log_every`` is asking to see
  the lines, so when neither ``fastload.live`` nor ``fastload`` has a level of
  its own the logger is set to INFO, and while no handler of the user's would
  take the lines (none on ``fastload.live``, ``fastload`` or the root logger) they
  go to stderr;
* written as scalars to ``summary_writer`` when one is given: anything with
  ``add_scalar(tag, value, step)``, e.g. ``torch.utils.tensorboard.SummaryWriter``
  (fastload does not depend on tensorboard).

Scalars (``step`` is the number of batches the loader has handed out, over all
epochs): ``fastload/batches_per_s``, ``fastload/data_stall``,
``fastload/cache_hit_rate`` (when the interval read through the cache), and per
op ``fastload/<op>/items_per_s`` and ``fastload/<op>/MBps`` (per busy
second, as in the stats table).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

from fastload.stats import OPS, LoaderStats

__all__ = ["DEFAULT_WRITE_EVERY", "LiveStats", "interval"]

_log = logging.getLogger("fastload.live")


class _StderrUnlessHandled(logging.Handler):
    """Writes to stderr only while the user's logging config has no handler that
    would take the record, so a user who configures logging later sees each line once
    (tests/unit/test_live_stats.py::test_log_every_lines_reach_stderr_once)."""

    def emit(self, record: logging.LogRecord) -> None:
        logger: logging.Logger | None = _log
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return
            if not logger.propagate:
                break
            logger = logger.parent
        try:
            sys.stderr.write(self.format(record) + "\n")  # looked up per line: redirects work
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def _make_visible() -> None:
    # The default logging config (root at WARNING, no handlers) drops INFO lines.
    if _log.level == logging.NOTSET and logging.getLogger("fastload").level == logging.NOTSET:
        _log.setLevel(logging.INFO)
    if not any(isinstance(h, _StderrUnlessHandled) for h in _log.handlers):
        handler = _StderrUnlessHandled()
        handler.setFormatter(logging.Formatter("%(message)s"))
        _log.addHandler(handler)


#: Batches between writes to a summary writer when ``log_every`` is not given.
DEFAULT_WRITE_EVERY = 100


def interval(now: LoaderStats, before: LoaderStats | None) -> dict[str, Any]:
    """What happened between two snapshots of one loader, as plain numbers."""
    b = before or LoaderStats()
    batches = now.batches - b.batches
    wall = now.wall_seconds - b.wall_seconds
    wait = now.wait_seconds - b.wait_seconds
    hits = now.counters.get("cache_hit", 0) - b.counters.get("cache_hit", 0)
    misses = now.counters.get("cache_miss", 0) - b.counters.get("cache_miss", 0)
    ops = {}
    for name, s in now.ops.items():
        old = b.op(name)
        items, nbytes, secs = s.items - old.items, s.bytes - old.bytes, s.seconds - old.seconds
        if items or secs:
            ops[name] = {
                "items": items,
                "items_per_s": items / secs if secs > 0 else 0.0,
                "MBps": nbytes / secs / 1e6 if secs > 0 else 0.0,
            }
    return {
        "batches": batches,
        "batches_per_s": batches / wall if wall > 0 else 0.0,
        "data_stall": min(1.0, wait / wall) if wall > 0 else 0.0,
        "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
        "ops": ops,
    }


def _slowest(ops: dict[str, dict[str, Any]]) -> str | None:
    timed = {n: s for n, s in ops.items() if s["items_per_s"] > 0 and n in OPS and n != "assemble"}
    return min(timed, key=lambda n: timed[n]["items_per_s"]) if timed else None


class LiveStats:
    """Called by the loader's iterator after each batch; reports every ``every`` batches.

    Args:
        stats: Returns the loader's current :class:`LoaderStats` (a bound method is
            held weakly, so the reporter does not keep its loader alive).
        every: Batches between reports.
        log: Write an INFO line per report.
        writer: ``add_scalar(tag, value, step)`` target, or None.
    """

    def __init__(self, stats: Callable[[], LoaderStats], every: int, *, log: bool, writer: Any = None) -> None:
        if every < 1:
            raise ValueError(f"report interval {every} must be >= 1")
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"summary_writer {writer!r} has no add_scalar(tag, value, step) method")
        self._stats: Callable[[], Callable[[], LoaderStats] | None]
        if hasattr(stats, "__self__"):
            self._stats = weakref.WeakMethod(stats)  # type: ignore[arg-type]
        else:
            self._stats = lambda: stats
        self.every = every
        self.log = log
        if log:
            _make_visible()
        self.writer = writer
        self.step = 0
        self._last: LoaderStats | None = None

    def __call__(self) -> None:
        self.step += 1
        if self.step % self.every == 0:
            self.report()

    def report(self) -> dict[str, Any] | None:
        """Snapshot now, log and write the interval since the last report; returns it."""
        fn = self._stats()
        if fn is None:
            return None
        now = fn()
        iv = interval(now, self._last)
        self._last = now
        if self.log:
            slow = _slowest(iv["ops"])
            slow_text = f", slowest op {slow} {iv['ops'][slow]['items_per_s']:.0f} items/s" if slow else ""
            hit = iv["cache_hit_rate"]
            hit_text = "" if hit is None else f", cache hits {hit:.0%}"
            _log.info("fastload: batch %d: %.1f batches/s, data stall %.1f%%%s%s", self.step, iv["batches_per_s"],
                      100 * iv["data_stall"], hit_text, slow_text)
            _log.debug("fastload: stats at batch %d (totals)\n%s", self.step, now)
        if self.writer is not None:
            add = self.writer.add_scalar
            add("fastload/batches_per_s", iv["batches_per_s"], self.step)
            add("fastload/data_stall", iv["data_stall"], self.step)
            if iv["cache_hit_rate"] is not None:
                add("fastload/cache_hit_rate", iv["cache_hit_rate"], self.step)
            for name, s in iv["ops"].items():
                add(f"fastload/{name}/items_per_s", s["items_per_s"], self.step)
                add(f"fastload/{name}/MBps", s["MBps"], self.step)
        return iv
