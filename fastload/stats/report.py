"""The report: what a snapshot of a loader's counters is, as JSON and as a table.

Vocabulary:

* *op*: a timed piece of work of the pipeline (``fetch``, ``cache_read``,
  ``decode``...); :class:`OpStats` is what one op did (items, bytes, busy seconds).
  Op names are free-form; the canonical ones, in table order, are :data:`OPS`. The
  loader itself records ``assemble`` (time producing a batch's samples:
  ``__getitem__`` or ``read_batch``, which *contains* the ops ``fetch``,
  ``cache_read`` and ``decode`` that datasets record), ``collate``, ``pin`` (the
  host copy into a pinned slot of the device prefetcher) and ``h2d``.
* *counter*: a plain event count such as ``cache_hit``.
* *snapshot*: a :class:`LoaderStats`, immutable; :meth:`LoaderStats.as_dict` is its
  JSON form and ``str()`` its printed table.
* *data-stall fraction*: the share of the loop's wall time the consumer waited
  for data.
* *regime*: a pass is ``"cold"`` or ``"warm"`` by its cache hit rate
  (:func:`regime`, the one definition; the threshold is :data:`WARM_HIT_RATE`).

Collecting the numbers is :mod:`fastload.stats.collect`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastload.config import deprecated

__all__ = ["LoaderStats", "OPS", "OpStats", "WARM_HIT_RATE", "regime"]

#: Canonical op names, in the order the table prints them. Other names are allowed
#: and print after these, sorted.
OPS: tuple[str, ...] = ("fetch", "cache_read", "decode", "assemble", "collate", "pin", "h2d")
OPS_MEANING = "the timed pieces of work; 'stage' now means pre-staging only"


@dataclass(frozen=True)
class OpStats:
    """What one op did.

    Attributes:
        items: Items (samples, batches or requests; the op decides) processed.
        bytes: Bytes produced or moved by the op.
        seconds: Busy seconds, summed over every thread that ran the op, so it can
            exceed wall time when the op runs in parallel.
    """

    items: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def items_per_s(self) -> float:
        """Items per busy second (per thread, not aggregate); 0.0 when nothing was timed."""
        return self.items / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Bytes per busy second (per thread, not aggregate); 0.0 when nothing was timed."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


_ZERO = OpStats()

#: A pass (an epoch, say) is warm from this cache hit rate up, else cold (:func:`regime`).
WARM_HIT_RATE = 0.5


def regime(hit_rate: float | None, fresh: bool | None = None) -> str | None:
    """``"cold"`` or ``"warm"``: the one definition (``loader.stats()``, bench, diagnose's verdict).

    A pass is cold when fewer than WARM_HIT_RATE of its reads were cache hits (most of
    its bytes were fetched from the remote), else warm. With no read counted
    (``hit_rate`` None) a pass over a ``fresh`` (empty) cache is cold, any other warm;
    None when that is not known either.

    >>> regime(0.2), regime(0.5), regime(None, fresh=True), regime(None)
    ('cold', 'warm', 'cold', None)
    """
    if hit_rate is None:
        return None if fresh is None else ("cold" if fresh else "warm")
    return "cold" if hit_rate < WARM_HIT_RATE else "warm"


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a loader's counters; ``str()`` renders it as a table.

    Attributes:
        ops: Op name -> :class:`OpStats`.
        counters: Event name -> count (``cache_hit``, ``cache_miss``, ``oversize_batch``...).
        batches: Batches handed to the consumer.
        wait_seconds: Seconds the consumer spent inside ``next()`` waiting for a batch
            (when batches come faster than 100 us apart, timed on a random sample of
            them and scaled: fastload.loader.iterator).
        wall_seconds: Seconds from the start of each epoch's iteration to the most recent
            batch, summed over epochs: the training loop's wall time.
        concurrency: Host -> its request limits (:mod:`fastload.transport.hostlimit`), over this
            process and the loader's worker processes, each of which has its own:
            ``limit`` (requests in flight the controllers settled on, summed over the
            processes), ``cap`` (``max_requests``: a cap *per process*), ``peak`` (the most
            in flight at once in one process), ``cuts`` (congestion signals, summed),
            ``last_cut``, and ``processes``: ``{"main" | "worker N": {limit, cap, peak,
            cuts, last_cut}}``, each process's own (:func:`fastload.transport.hostlimit.combine_limits`).
        read_threads: The read_batch pool's threads (0: samples are read in the calling
            thread or in worker processes).
        batches_in_flight: Index batches handed to reading and not yet returned, when
            the snapshot was taken: the read_batch pool's, or those torch sent its workers.
        fetches_in_flight: ``ahead`` (fetches started before their read asked) and
            ``fetching`` (asked for by a read) at that moment, summed over the processes,
            and ``processes``: each one's own (a worker's as of its latest batch);
            empty for a dataset without a fastload cache.
    """

    ops: Mapping[str, OpStats] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)
    batches: int = 0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    concurrency: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    read_threads: int = 0
    batches_in_flight: int = 0
    fetches_in_flight: Mapping[str, Any] = field(default_factory=dict)

    def op(self, name: str) -> OpStats:
        """Return the stats of op ``name`` (all zero if it never recorded)."""
        return self.ops.get(name, _ZERO)

    @property
    def stages(self) -> Mapping[str, OpStats]:
        """:attr:`ops`' old name (a FutureWarning once)."""
        deprecated("stages", "ops", OPS_MEANING)
        return self.ops

    def stage(self, name: str) -> OpStats:
        """:meth:`op`'s old name (a FutureWarning once)."""
        deprecated("stage()", "op()", OPS_MEANING)
        return self.op(name)

    @property
    def data_stall_fraction(self) -> float:
        """Fraction of the loop's wall time the consumer waited for data (0.0 to 1.0)."""
        if self.wall_seconds <= 0:
            return 0.0
        return min(1.0, self.wait_seconds / self.wall_seconds)

    @property
    def cache_hit_rate(self) -> float | None:
        """``cache_hit / (cache_hit + cache_miss)``, or None when neither was counted."""
        hits = self.counters.get("cache_hit", 0)
        total = hits + self.counters.get("cache_miss", 0)
        return hits / total if total else None

    @property
    def regime(self) -> str | None:
        """``"cold"`` or ``"warm"`` by :attr:`cache_hit_rate` (:func:`regime`); None when nothing was read."""
        return regime(self.cache_hit_rate)

    def as_dict(self) -> dict[str, Any]:
        """Return plain data for JSON output."""
        return {
            "batches": self.batches,
            "wait_seconds": self.wait_seconds,
            "wall_seconds": self.wall_seconds,
            "data_stall_fraction": self.data_stall_fraction,
            "cache_hit_rate": self.cache_hit_rate,
            "regime": self.regime,
            "read_threads": self.read_threads,
            "batches_in_flight": self.batches_in_flight,
            "fetches_in_flight": dict(self.fetches_in_flight),
            "counters": dict(self.counters),
            "concurrency": {host: dict(v) for host, v in self.concurrency.items()},
            "ops": {
                name: {
                    "items": s.items,
                    "bytes": s.bytes,
                    "seconds": s.seconds,
                    "items_per_s": s.items_per_s,
                    "bytes_per_s": s.bytes_per_s,
                }
                for name, s in self.ops.items()
            },
        }

    def __str__(self) -> str:
        names = [n for n in OPS if n in self.ops]
        names += sorted(n for n in self.ops if n not in OPS)
        rows = [("op", "items", "MB", "busy s", "items/s", "MB/s")]
        for name in names:
            s = self.ops[name]
            rows.append(
                (
                    name,
                    str(s.items),
                    f"{s.bytes / 1e6:.1f}",
                    f"{s.seconds:.3f}",
                    f"{s.items_per_s:.0f}",
                    f"{s.bytes_per_s / 1e6:.1f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
            for r in rows
        ]
        lines.append(
            f"batches {self.batches}; consumer waited {self.wait_seconds:.3f} s of "
            f"{self.wall_seconds:.3f} s loop wall time: data stall {self.data_stall_fraction:.1%}"
        )
        rate = self.cache_hit_rate
        if rate is not None:
            lines.append(f"cache hit rate {rate:.1%}: {self.regime}")
        for name in sorted(self.counters):
            lines.append(f"{name}: {self.counters[name]}")
        for host, c in sorted(self.concurrency.items()):
            procs = c.get("processes") or {}
            where = ""
            if len(procs) > 1:
                each = ", ".join(f"{name} {p['limit']}" for name, p in procs.items())
                where = f" over {len(procs)} processes ({each})"
            lines.append(f"requests in flight to {host}: settled at {c['limit']}{where} "
                         f"(cap {c['cap']} per process, peak {c['peak']}, cuts {c['cuts']})")
        f = self.fetches_in_flight
        fetches = f"; fetches in flight {f['ahead']} ahead, {f['fetching']} fetching" if f else ""
        lines.append(f"read threads {self.read_threads}; batches in flight {self.batches_in_flight}{fetches}")
        return "\n".join(lines)
