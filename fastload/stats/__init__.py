"""Per-op counters and timers, and the data-stall fraction.

Every op of the pipeline (a timed piece of work: fetch, decode, collate...) records
what it did into a :class:`StatsCollector`: items, bytes and busy seconds per *op*,
plus plain event counters such as ``cache_hit``. The
:class:`~fastload.loader.dataloader.DataLoader` owns one collector and makes it the
*active* collector of the code that iterates it, so code deep inside a dataset or
the cache reader records without holding a reference::

    from fastload.stats import current_collector

    col = current_collector()
    col.add("cache_read", items=1, bytes=len(payload), seconds=dt)
    col.count("cache_hit")
    with col.timer("decode", items=1, bytes=len(raw)):
        image = decode(raw)

Outside any loader, :func:`current_collector` returns a process-wide default
collector (:func:`default_collector`), so direct dataset use is counted too.

The parts, each with its vocabulary in its docstring, lowest first:

* :mod:`fastload.stats.report`: the report: a snapshot (:class:`LoaderStats`,
  one :class:`OpStats` per op), its JSON ``as_dict`` and its printed table, and the
  cold/warm :func:`regime`.
* :mod:`fastload.stats.collect`: the collection: :class:`StatsCollector`, per-thread
  shards merged when a snapshot is taken.
* :mod:`fastload.stats.active`: which collector is active (:func:`current_collector`,
  :func:`use_collector`, a loader pass's scope, the reset after fork), and
  :func:`record_cache`, which records into it.

Layer: this package sits above :mod:`fastload.transport` (it imports
:mod:`fastload.transport.hostlimit` for the host limits a snapshot shows, and
:mod:`fastload.config`) and below the packages that record into it and read it:
fastload.cache, fetch, read, device, loader, pipelines and diagnose.
"""

from __future__ import annotations

from fastload.stats.active import current_collector, default_collector, record_cache, use_collector
from fastload.stats.collect import StatsCollector
from fastload.stats.report import OPS, WARM_HIT_RATE, LoaderStats, OpStats, regime

__all__ = [
    "LoaderStats",
    "OPS",
    "OpStats",
    "StatsCollector",
    "WARM_HIT_RATE",
    "current_collector",
    "default_collector",
    "record_cache",
    "regime",
    "use_collector",
]
