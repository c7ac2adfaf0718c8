"""Which collector is active: the one code records into without holding a reference.

Vocabulary:

* *active collector*: what :func:`current_collector` returns to the code running
  now (a ContextVar, so per thread and per asyncio task). The
  :class:`~fastload.loader.dataloader.DataLoader` makes its collector the active one
  of the code that iterates it, from its first ``next()`` until the pass ends, and
  of its ``read_batch`` threads while they read; :func:`use_collector` does so for
  a ``with`` body.
* *default collector*: the process-wide collector (:func:`default_collector`)
  that is active outside any loader, so direct dataset use is counted too; each
  forked child starts a fresh one.
* *pass*: one iteration of a loader (an epoch, say). Its *loop scope*
  (:class:`_LoopScope`) is what it makes active and what to put back when it ends;
  every live pass is *watched* and told to *recheck* the ContextVar whenever any
  scope is entered or left (:func:`_switched`).
* :func:`record_cache`: a cache read or a miss's fetch, recorded into the active
  collector.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from fastload.stats.collect import StatsCollector

__all__ = ["current_collector", "default_collector", "record_cache", "use_collector"]


_DEFAULT = StatsCollector()


class _LoopScope:
    """What a loader's pass makes active: its collector, and what to put back at the end."""

    __slots__ = ("collector", "outer")

    def __init__(self, collector: StatsCollector, outer: StatsCollector | None) -> None:
        self.collector = collector
        self.outer = outer


_ACTIVE: ContextVar[StatsCollector | _LoopScope | None] = ContextVar(
    "fastload_active_collector", default=None
)


def default_collector() -> StatsCollector:
    """Return the process-wide collector used when no loader is active."""
    return _DEFAULT


def current_collector() -> StatsCollector:
    """Return the active collector: the running loader's, else :func:`default_collector`.

    Cheap enough to call per item (one ``ContextVar.get``).
    """
    v = _ACTIVE.get()
    if v is None:
        return _DEFAULT
    return v.collector if type(v) is _LoopScope else v  # type: ignore[union-attr,return-value]


@contextmanager
def use_collector(collector: StatsCollector) -> Iterator[StatsCollector]:
    """Make ``collector`` the active collector of this thread for the ``with`` body."""
    token = _ACTIVE.set(collector)
    _switched()
    try:
        yield collector
    finally:
        _ACTIVE.reset(token)
        _switched()


# A loader's pass enters its scope once and leaves it set between batches, instead of
# setting and resetting the ContextVar around every batch; and it does not even check
# the ContextVar per batch: entering or leaving any scope tells every live pass to
# check before its next batch. Each per-batch step cost ~1% of throughput at batch
# size 1 (benchmarks/loader/bench.py, stats case).
_PASSES: weakref.WeakSet[Any] = weakref.WeakSet()  # objects with a recheck() method
# Adding to a WeakSet while another thread iterates it raises. Re-entrant: a pass's
# finaliser, run by the GC inside one of these sections, leaves its scope (_switched).
_PASSES_LOCK = threading.RLock()


def _watch(loader_pass: Any) -> None:
    with _PASSES_LOCK:
        _PASSES.add(loader_pass)


def _switched() -> None:
    with _PASSES_LOCK:
        passes = list(_PASSES)
    for p in passes:
        p.recheck()


def _enter_loop(collector: StatsCollector) -> _LoopScope:
    cur = _ACTIVE.get()
    # Inside another loader's scope, inherit what it will put back: loader scopes
    # are re-entered on their next batch, so they are never restored.
    scope = _LoopScope(collector, cur.outer if type(cur) is _LoopScope else cur)  # type: ignore[union-attr,arg-type]
    _ACTIVE.set(scope)
    _switched()
    return scope


def _leave_loop(scope: _LoopScope) -> None:
    # A no-op in any other context (a finaliser run by another thread, say).
    if _ACTIVE.get() is scope:
        _ACTIVE.set(scope.outer)
        _switched()


def _reset_after_fork() -> None:
    # A worker forked while another thread held the default collector's lock would
    # deadlock on its first record; and the parent's counts are not the child's.
    global _DEFAULT, _PASSES, _PASSES_LOCK
    _DEFAULT = StatsCollector()
    _ACTIVE.set(None)
    _PASSES, _PASSES_LOCK = weakref.WeakSet(), threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def record_cache(hit: bool, items: int, nbytes: int, t0: float) -> None:
    """Count ``items`` blocks read from the cache (``hit``, op ``cache_read``) or fetched
    on a miss (op ``fetch``) since ``t0``, in the running loader's collector (else the process default)."""
    collector = current_collector()
    collector.add("cache_read" if hit else "fetch", items=items, bytes=nbytes, seconds=time.perf_counter() - t0)
    collector.count("cache_hit" if hit else "cache_miss", items)
