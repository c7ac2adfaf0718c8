"""One pass of ``fastload.DataLoader``: the chain of iterators that ``iter(loader)`` builds.

:class:`~fastload.loader.dataloader.DataLoader` holds the arguments and the index order;
this module wires a pass from them, each part from its own module:

* the source of batches: torch's own iterator (workers, or ``__getitem__`` in the calling
  thread), or, for datasets with ``read_batch`` (or ``read_ahead=N``), a torch
  single-process iterator whose ``_next_data`` is a :class:`~fastload.loader.readahead.ReadAhead`;
* resume's plan for the pass (:mod:`fastload.loader.resume`);
* with workers, their batches unwrapped (stats, shared-memory payloads:
  :mod:`fastload.loader.worker_stats`, :mod:`fastload.device.worker_pack`);
* with ``device=``, the :class:`~fastload.device.prefetch.DevicePrefetcher`;
* the iterator handed to the user (:mod:`fastload.loader.iterator`).

``torch_iter`` is torch's ``DataLoader.__iter__`` bound to the loader (``super().__iter__``
in the class), so torch builds its own iterators exactly as it would for its own class.
"""

from __future__ import annotations

import functools
import multiprocessing
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data as tud

from fastload.config import default_read_threads
from fastload.dataset import _CachedDataset
from fastload.device.prefetch import DevicePrefetcher
from fastload.device.torch_compat import accelerator_available
from fastload.device.worker_pack import SharedBuffers, set_forking
from fastload.fetch import Announcer, depth_for
from fastload.loader import forks, resume
from fastload.loader.iterator import (
    _Calls,
    _LiveLoaderIter,
    _LoaderIter,
    _Progress,
    _TimedCollate,
    _TimedNext,
    new_iter,
)
from fastload.loader.readahead import GROUP_SAMPLES, ReadAhead
from fastload.loader.snapshot import WorkerInit
from fastload.loader.torch_surface import TORCH_BASE_ITER, TORCH_SINGLE_ITER
from fastload.loader.worker_stats import Unwrap, WorkerCollate

__all__ = ["DEFAULT_READ_THREADS", "new_pass", "read_fn"]

DEFAULT_READ_THREADS = default_read_threads()
DEFAULT_READ_AHEAD = 2  # batches, for datasets with read_batch
# A fastload dataset's batch with more than this crossing pickled warns once.
PICKLED_WARN_BYTES = 1_000_000
# torch's multi-process iterator -> the WorkerCollate its workers run.
_WORKER_COLLATE: weakref.WeakKeyDictionary[Any, WorkerCollate] = weakref.WeakKeyDictionary()


class _Unpinned:
    """A loader as torch's iterator constructor reads it, with pin_memory off."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    pin_memory = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def read_fn(loader: Any) -> Callable[[list[Any]], Any] | None:
    """The function a pass reads index batches with on threads (the read_batch path), or None."""
    if loader.num_workers != 0 or isinstance(loader.dataset, tud.IterableDataset):
        return None
    if loader.read_threads == 0:
        return None
    read_batch = getattr(loader.dataset, "read_batch", None)
    if callable(read_batch):
        return read_batch  # type: ignore[no-any-return]
    if not loader.read_ahead:
        return None  # plain datasets read in the calling thread, as torch does
    getitems = getattr(loader.dataset, "__getitems__", None)
    if callable(getitems):
        return getitems  # type: ignore[no-any-return]
    ds = loader.dataset
    return lambda idx: [ds[i] for i in idx]


def _items_per_index_batch(loader: Any) -> int | None:
    # Known when torch's own BatchSampler draws map-style batches (all full but the
    # last); None: count them (fastload.loader.iterator._TimedCollate).
    if not loader._auto_collation:
        return 1
    if type(loader.batch_sampler) is tud.BatchSampler and not isinstance(
        loader.dataset, tud.IterableDataset
    ):
        return int(loader.batch_sampler.batch_size)
    return None


def _packs(loader: Any) -> bool:
    # fastload's datasets hand out bytes payloads (FileDataset, TarDataset): with
    # workers they cross to the parent through shared memory (fastload.device.worker_pack).
    return loader.num_workers > 0 and isinstance(loader.dataset, _CachedDataset)


def _warn_pickled(loader: Any, size: int) -> None:
    # Once per loader: batches that still cross from workers pickled are the slow
    # path (issue 13 measured 3x fewer samples/s than num_workers=0).
    if size < PICKLED_WARN_BYTES or loader._fl_warned_pickled:
        return
    loader._fl_warned_pickled = True
    warnings.warn(
        f"fastload.DataLoader: {size / 1e6:.1f} MB of each batch from {type(loader.dataset).__name__} "
        f"crosses from the {loader.num_workers} worker processes pickled through a pipe (values "
        "that are neither torch tensors nor bytes, e.g. numpy arrays or images from a transform); "
        "fix: make the transform or collate_fn return torch tensors (they cross as shared memory), "
        "or use num_workers=0 (fastload reads on threads)",
        stacklevel=3,
    )


def _torch_iter(
    loader: Any,
    torch_iter: Callable[[], Any],
    stats: bool,
    init: WorkerInit | None,
    first: int,
    undo: Callable[[], None] | None,
) -> Any:
    if loader.num_workers == 0:
        return torch_iter()
    # Workers run a collate_fn that also ships their stats with each batch
    # (fastload.loader.worker_stats); torch reads loader.collate_fn only while it builds
    # the iterator, so the user's attribute is back in place before any batch.
    # Its _collate_fn is the user's again too: torch hands it to workers only while
    # it starts them, in the constructor.
    if loader.persistent_workers and loader._iterator is not None:
        return torch_iter()  # its workers keep the WorkerCollate they started with
    if _forks(loader):
        forks.before_fork()
        locate = getattr(loader.dataset, "locate", None)
        if callable(locate):
            locate()  # forked workers start from these slots (fastload.read.located)
    user, user_init = loader.collate_fn, loader.worker_init_fn
    buffers = _buffers(loader) if _packs(loader) else None
    collate = WorkerCollate(user, loader._auto_collation, stats=stats, buffers=buffers, resume=True)
    # ...and fastload's worker_init_fn (the user's, then the saved state: fastload.loader.snapshot).
    loader.collate_fn, loader.worker_init_fn = collate, init
    loader.__dict__["_fl_first_worker"] = (first, undo)
    if buffers is not None and _forks(loader):
        set_forking(buffers, user is tud.default_collate)  # forked workers pack from their first batch
    try:
        it = torch_iter()
    finally:
        set_forking(None)
        loader.collate_fn, loader.worker_init_fn = user, user_init
        loader.__dict__["_fl_first_worker"] = (0, None)
    it._collate_fn = user
    _WORKER_COLLATE[it] = collate  # the parent's buffers live as long as torch's iterator
    if buffers is not None:
        loader.__dict__["_fl_buffers"] = (buffers, weakref.ref(it))
    return it


def _forks(loader: Any) -> bool:
    """Whether the workers start as forks of this process (a spawned one gets the dataset pickled)."""
    ctx = loader.multiprocessing_context
    return (ctx.get_start_method() if ctx is not None else multiprocessing.get_start_method()) == "fork"


def _buffers(loader: Any) -> SharedBuffers:
    """The shared buffers of the workers this pass starts: the previous pass's, where they are free.

    Workers forked from this process take over the buffers it mapped from the previous
    pass's workers (fastload.device.worker_pack), so a pass without persistent workers
    does not make and fault in new ones. Only once those workers are gone: two sets of
    workers writing the same buffers would corrupt each other's batches.
    """
    depth = (loader.prefetch_factor or 2) + 1  # a buffer per batch in flight (prefetch_factor), plus one
    kept, by = loader.__dict__.get("_fl_buffers", (None, None))
    if kept is not None and (kept.workers, kept.depth) == (loader.num_workers, depth) and kept.idle():
        before = by()
        if before is None or getattr(before, "_shutdown", False):  # torch sets it once its workers are joined
            return kept  # type: ignore[no-any-return]
    return SharedBuffers(loader.num_workers, depth)


def _read_ahead_iter(loader: Any, read: Callable[[list[Any]], Any]) -> tuple[Any, ReadAhead]:
    # The read_batch path is a torch single-process iterator whose _next_data is
    # the ReadAhead: torch's own constructor draws the sampler iterator and the base
    # seed (so RNG streams match torch's loader), torch's __next__ counts
    # _num_yielded, and isinstance checks see torch's class. Its __init__ is
    # skipped: it only rejects timeout != 0 and makes a fetcher that is not used.
    # Pinning is the ReadAhead's (`post`), decided by fastload's torch>=2.1 shim.
    state = TORCH_SINGLE_ITER.__new__(TORCH_SINGLE_ITER)
    TORCH_BASE_ITER.__init__(state, _Unpinned(loader))  # type: ignore[arg-type]
    post = None
    state._pin_memory = loader.pin_memory and accelerator_available()  # torch.accelerator: 2.6+
    if state._pin_memory:
        from torch.utils.data._utils.pin_memory import pin_memory

        post = pin_memory
    ahead = DEFAULT_READ_AHEAD if loader.read_ahead is None else loader.read_ahead
    collector = loader._fl_collector if loader.stats_enabled else None
    batches: Iterator[Any] = state._sampler_iter
    hint = getattr(loader.dataset, "fetch_ahead", None)
    if callable(hint) and loader._auto_collation:
        batches = Announcer(batches, depth_for(loader.batch_size), hint=hint)
    state._sampler_iter = batches
    ahead_iter = ReadAhead(
        batches,
        read,
        loader.collate_fn,  # type: ignore[arg-type]
        auto_collation=loader._auto_collation,
        threads=loader.read_threads or DEFAULT_READ_THREADS,
        ahead=ahead,
        timeout=float(loader.timeout),
        collector=collector,
        post=post,
        name=type(loader.dataset).__name__,
        # Left unset, small batches are read in groups (ReadAhead: a read per sample of batch_size=1
        # cost 5x the CPU); a read_ahead the user gave counts batches exactly.
        group_samples=GROUP_SAMPLES if loader.read_ahead is None else 1,
    )
    state._next_data = ahead_iter.__next__  # type: ignore[method-assign]
    return state, ahead_iter


def new_pass(loader: Any, torch_iter: Callable[[], Any]) -> Any:
    """Build the iterator of one pass over ``loader`` (what ``iter(loader)`` returns)."""
    collector = loader._fl_collector if loader.stats_enabled else None
    read = read_fn(loader)
    timed = None
    pending, loader._fl_pending = loader._fl_pending, None
    start, gen_start, sampler_start, undo_seed = resume.begin_epoch(loader, pending)
    init, first, loaded = resume.worker_plan(loader, pending)
    reused = loader.persistent_workers and loader._iterator is not None
    keep: Any
    if read is not None:
        source, keep = _read_ahead_iter(loader, read)
    else:
        source = keep = _torch_iter(
            loader, torch_iter, collector is not None, init, first, undo_seed
        )
        if collector is not None and hasattr(source, "_dataset_fetcher"):
            # Splits time inside next() into reading samples and collating them.
            timed = _TimedCollate(source, _items_per_index_batch(loader))
    resume.after_build(loader, pending, source)
    if undo_seed is not None and loader.num_workers == 0:  # (workers: in torch's _reset)
        undo_seed()  # the interrupted run drew no (new) base seed here
    progress = _Progress(start, gen_start, sampler_start)
    if loader.num_workers == 0 and isinstance(loader.dataset, tud.IterableDataset):
        progress.fetcher = getattr(source, "_dataset_fetcher", None)
    nxt: Callable[[], Any] = source.__next__
    plain = nxt
    tracker = None
    if loader.num_workers > 0:
        tracker = resume.worker_states(loader, pending, loaded, reused, start, progress, source)
        # Before the prefetcher: it must see plain batches.
        nxt = Unwrap(
            nxt,
            collector,
            _WORKER_COLLATE.get(source),
            functools.partial(_warn_pickled, loader),
            tracker,
        )
    loader._fl_workers = tracker
    timed_next = None
    if loader.device is not None:
        if loader._fl_prefetcher is None:
            loader._fl_prefetcher = DevicePrefetcher(
                None,
                loader.device,
                slots=max(2, loader.prefetch_to_device),
                max_slot_bytes=loader.max_slot_bytes,
                collector=collector,
            )
        # Copy ahead only when reading ahead is already allowed (workers or the
        # read_batch path); otherwise __getitem__ would run before torch runs it.
        may_read_ahead = loader.num_workers > 0 or read is not None
        depth = loader.prefetch_to_device - 1 if may_read_ahead else 0
        if timed is not None:
            timed_next = _TimedNext(nxt)
            nxt = timed_next
        feed = source if nxt is plain else _Calls(nxt)
        nxt = loader._fl_prefetcher.iterate(feed, depth).__next__
    loader._fl_progress = progress
    kind = _LoaderIter if loader._fl_live_stats is None else _LiveLoaderIter
    live = loader._fl_live_stats
    it = new_iter(
        kind, source, nxt, progress, collector, timed, timed_next, lambda: len(loader), keep, live
    )
    loader._fl_live = weakref.ref(it)
    return it
