"""``fastload.DataLoader``: torch's DataLoader, plus device prefetch, sharding, resume, stats.

The class *is* a ``torch.utils.data.DataLoader`` (a subclass): the positional
parameters, defaults, argument checks, error messages, samplers, collation and
worker processes are torch's own, so any torch Dataset yields exactly what
torch's loader yields, in the same order for the same seed. With
``num_workers=0`` and a plain Dataset, ``__getitem__`` runs in the calling thread
inside ``next()``, as in torch, so RNG draws in the dataset and in the training
step interleave exactly as before (``tests/unit/test_loader_compat.py``).

The class holds the arguments (torch's, checked by torch, and fastload's, checked
here) and the index order; a pass (``iter(loader)``) is wired by
:mod:`fastload.loader.chain`. Neither holds the parts' logic:

* index order, sharding and resume: :mod:`fastload.loader.sampler`
* parallel reads for datasets with ``read_batch``: :mod:`fastload.loader.readahead`
* index batches announced ahead (``fetch_ahead``), here or to workers: :mod:`fastload.fetch.ahead`
* host-to-device transfer: :mod:`fastload.device.prefetch`
* counters: :mod:`fastload.stats`
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.data as tud

from fastload.device.prefetch import DevicePrefetcher
from fastload.errors import ConfigError
from fastload.fetch import AheadSampler, depth_for
from fastload.loader import chain, resume
from fastload.loader.iterator import _LoaderIter, _Progress, loader_stats
from fastload.loader.resume import resumed_iterator
from fastload.loader.sampler import ResumableSampler, ShardedSampler
from fastload.loader.snapshot import WorkerStates
from fastload.loader.torch_surface import TORCH_DATALOADER
from fastload.read import heap
from fastload.stats import LoaderStats, StatsCollector

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


def _dist_settings(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "distributed=True needs rank= and world_size=, or an initialised process "
                "group (torch.distributed.init_process_group) to read them from"
            )
        world_size = dist.get_world_size() if world_size is None else world_size
        rank = dist.get_rank() if rank is None else rank
    return world_size, rank


# torch's class, as imported here: a later rebinding of torch's name (patch_torch)
# never changes the base, and no method looks the class up through torch's module.
class DataLoader(tud.DataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` that also moves, shards, resumes and measures.

    Every torch parameter keeps its position, default and meaning; see the torch
    documentation. The additions are keyword-only.

    Args:
        dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
            pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context,
            generator, prefetch_factor, persistent_workers, pin_memory_device, in_order:
            As in torch. ``timeout`` also bounds each batch of the read_batch path.
        device: Where batches arrive (``"cuda"``, ``"cuda:1"``, ``"cpu"``); tensors
            travel through a :class:`~fastload.device.prefetch.DevicePrefetcher` ring. None
            (default) leaves batches where collate_fn put them.
        prefetch_to_device: Batches in transit to the device (>= 1). When the loader may
            read ahead (workers, or the read_batch path) up to ``prefetch_to_device - 1``
            batches beyond the current one are copied early; with ``num_workers=0`` and a
            plain dataset none are, so ``__getitem__`` keeps torch's timing.
        distributed: Shard a map-style dataset across ranks with a
            :class:`~fastload.loader.sampler.ShardedSampler` (DistributedSampler semantics;
            ``drop_last`` then also cuts, instead of padding, the shard tail). Never
            implied by an initialised process group.
        rank, world_size: This process's shard; default from ``torch.distributed``.
        partition, nodes, node_rank: With ``distributed=True``, ``"global"`` (default,
            DistributedSampler's split) or ``"node"`` (a fixed part per node, so each
            node's cache holds and fetches only its part); see :class:`ShardedSampler`.
        seed: With ``distributed=True``, the shard permutation seed (default 0, as
            DistributedSampler). Otherwise, when ``generator`` is None, seeds a private
            generator for shuffling.
        stats: Record per-op counters (see :meth:`stats`); costs well under 2%.
        read_threads: Threads for the read_batch hook (default: the CPUs, 2 to 8); 0 disables the hook.
        read_ahead: Batches read ahead of the consumer on the read_batch path (default
            2). For a plain map-style dataset with ``num_workers=0``, a value > 0 opts
            in to background reads: ``__getitem__`` (or ``__getitems__``) then runs on
            ``read_threads`` threads and must be thread-safe and draw no global RNG.
        max_slot_bytes: Cap on one host slot of the device prefetcher (see DevicePrefetcher).
        log_every: Every ``log_every`` batches, log the interval's :meth:`stats` (batches/s,
            data stall, cache hits, slowest op) at INFO on the ``fastload.live`` logger.
            The lines are shown without any logging setup: that logger is set to INFO
            unless it or ``fastload`` has a level, and while no handler of yours (on
            ``fastload.live``, ``fastload`` or the root logger) takes them they go to stderr.
        summary_writer: Anything with ``add_scalar(tag, value, step)`` (e.g. a TensorBoard
            ``SummaryWriter``): the same interval stats as ``fastload/...`` scalars, every
            ``log_every`` batches (100 when ``log_every`` is None). See
            :mod:`fastload.loader.live`.
        snapshot_every_n_steps: As torchdata's: a worker ships its state with every n-th
            of its batches (0: its first only); a resume replays the batches since. Default
            1: no replay. Map-style datasets and persistent workers snapshot every batch.

    The ``read_batch`` hook. A map-style dataset may define
    ``read_batch(self, indices: list[int]) -> list`` returning the samples for
    ``indices``, one per index and in order, equal to ``[self[i] for i in indices]``.
    With ``num_workers=0`` (and ``read_threads != 0``) the loader then calls it instead
    of ``__getitem__``: each index batch is split into up to ``read_threads``
    contiguous chunks read concurrently from a thread pool, ``read_ahead`` batches
    ahead of the consumer, and the chunks are joined in order and passed to
    ``collate_fn`` in the calling thread. ``read_batch`` must therefore be
    thread-safe and must not draw from global RNGs (its timing is not torch's).
    Inside it, ``fastload.stats.current_collector()`` is this loader's collector.
    An exception it raises is re-raised by ``next()`` for that batch with its
    original traceback. With ``num_workers > 0`` the hook is not used: workers call
    ``__getitem__``/``__getitems__`` as in torch. A dataset with
    ``fetch_ahead(indices)`` is announced index batches about
    :data:`~fastload.fetch.AHEAD_ITEMS` samples ahead of each reading
    process: this one, or (``in_order=True``) the worker that will read them,
    carried by an earlier index batch of that worker (:mod:`fastload.fetch.ahead`).

    Resuming. A :meth:`state_dict` taken after ``k`` batches makes a new loader built
    with the same arguments yield batches ``k+1...``; the skipped samples are not read,
    and the state is JSON data (:mod:`fastload.loader.resume`).

    Example:
        >>> loader = DataLoader(list(range(10)), batch_size=4)
        >>> [b.tolist() for b in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    def __init__(
        self,
        dataset: tud.Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: tud.Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: tud.Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | torch.device | None = None,
        prefetch_to_device: int = 2,
        distributed: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        partition: str = "global",
        nodes: int | None = None,
        node_rank: int | None = None,
        seed: int | None = None,
        stats: bool = True,
        read_threads: int | None = None,
        read_ahead: int | None = None,
        max_slot_bytes: int | None = 2 * 1024**3,
        log_every: int | None = None,
        summary_writer: Any = None,
        snapshot_every_n_steps: int = 1,
    ) -> None:
        if snapshot_every_n_steps < 0:
            raise ConfigError(f"snapshot_every_n_steps={snapshot_every_n_steps} must be >= 0")
        if prefetch_to_device < 1:
            raise ConfigError(f"prefetch_to_device={prefetch_to_device} must be >= 1")
        if read_threads is not None and read_threads < 0:
            raise ConfigError(f"read_threads={read_threads} must be >= 0 (0 disables read_batch)")
        if read_ahead is not None and read_ahead < 0:
            raise ConfigError(f"read_ahead={read_ahead} must be >= 0")
        if log_every is not None and log_every < 1:
            raise ConfigError(f"log_every={log_every} must be >= 1 (or None to not log)")
        if not stats and (log_every is not None or summary_writer is not None):
            raise ConfigError("log_every= and summary_writer= report the stats; they need stats=True")
        if device is not None:
            dev = torch.device(device)
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ConfigError(
                    f"device={str(device)!r} but torch.cuda.is_available() is False; "
                    "pass device=None (or 'cpu')"
                )
            if dev.type not in ("cuda", "cpu"):
                raise ConfigError(f"device={str(device)!r}: only 'cuda' and 'cpu' are supported")
            if pin_memory:
                warnings.warn(
                    "pin_memory=True is redundant with device=: fastload copies batches "
                    "through its own reused pinned slots; pin_memory=True pins each batch "
                    "again (a per-batch allocation)",
                    stacklevel=2,
                )
        if distributed:
            if isinstance(dataset, tud.IterableDataset):
                raise ConfigError(
                    "distributed=True shards map-style datasets; an IterableDataset must "
                    "shard itself (see torch.utils.data.get_worker_info and the rank)"
                )
            if sampler is not None or batch_sampler is not None:
                raise ConfigError(
                    "distributed=True builds its own ShardedSampler; pass sampler=/"
                    "batch_sampler= or distributed=True, not both"
                )
            world_size, rank = _dist_settings(world_size, rank)
            sampler = ShardedSampler(
                dataset,  # type: ignore[arg-type]
                world_size,
                rank,
                shuffle=bool(shuffle),
                seed=0 if seed is None else seed,
                drop_last=drop_last,
                partition=partition,
                nodes=nodes,
                node_rank=node_rank,
            )
            shuffle = None  # the sampler shuffles; torch rejects sampler= with shuffle=True
        elif rank is not None or world_size is not None or partition != "global" or nodes is not None or node_rank is not None:
            raise ConfigError("rank=, world_size=, partition=, nodes= and node_rank= only apply with distributed=True")
        elif seed is not None and generator is None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        heap.keep_freed()  # each batch's samples reuse the last one's memory (fastload.read.heap)
        # Public, under their parameter names, so code that rebuilds a loader from its
        # attributes (as Lightning does) finds them.
        self.device = None if device is None else torch.device(device)
        self.prefetch_to_device = prefetch_to_device
        self.distributed = distributed
        self.rank = rank
        self.world_size = world_size
        self.partition, self.nodes, self.node_rank = partition, nodes, node_rank
        self.seed = seed
        self.stats_enabled = stats
        self.read_threads = read_threads
        self.read_ahead = read_ahead
        self.max_slot_bytes = max_slot_bytes
        self._fl_collector = StatsCollector(enabled=stats)
        self._fl_prefetcher: DevicePrefetcher[Any] | None = None
        self._fl_resumable: ResumableSampler[Any] | None = None
        self._fl_progress: _Progress | None = None
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._fl_pending: dict[str, Any] | None = None  # a loaded state the next iter() starts from
        self._fl_workers: WorkerStates | None = None  # the workers' states, this pass
        self._fl_live: weakref.ref[_LoaderIter] | None = None
        self._fl_epoch = 0
        self._fl_warned_pickled = False
        self.log_every = log_every
        self.summary_writer = summary_writer
        self._fl_live_stats = None
        if log_every is not None or summary_writer is not None:
            from fastload.loader.live import DEFAULT_WRITE_EVERY, LiveStats

            self._fl_live_stats = LiveStats(
                self.stats, log_every or DEFAULT_WRITE_EVERY, log=log_every is not None, writer=summary_writer
            )

    # -- index order --------------------------------------------------------------------

    @property
    def _index_sampler(self) -> Any:
        # torch's iterators read this property once per iterator (and per persistent
        # worker reset); returning one long-lived ResumableSampler lets a loaded state
        # skip at the index level without touching torch's frozen attributes.
        # torch's class as captured at import: after `torch.utils.data.DataLoader =
        # fastload.DataLoader` (patch_torch), the module attribute is this class.
        # With workers that fetch ahead, torch's multi-process iterator draws from an
        # AheadSampler around it (fastload.fetch.ahead): the resume skip stays inside.
        if isinstance(self.dataset, tud.IterableDataset):
            return TORCH_DATALOADER._index_sampler.fget(self)  # type: ignore[attr-defined]
        wrapper = self._resumable()
        workers = self._workers_fetch_ahead()
        if not workers:
            return wrapper
        depth = depth_for(self.batch_size, workers)
        ahead = self.__dict__.get("_fl_ahead")
        if ahead is None or (ahead.inner, ahead.depth, ahead.workers) != (wrapper, depth, workers):
            ahead = AheadSampler(wrapper, depth, workers)
            self.__dict__["_fl_ahead"] = ahead
        return ahead

    def _resumable(self) -> ResumableSampler[Any]:
        """The long-lived ResumableSampler around torch's index sampler (map-style datasets)."""
        inner = TORCH_DATALOADER._index_sampler.fget(self)  # type: ignore[attr-defined]
        wrapper = self.__dict__.get("_fl_resumable")
        if wrapper is None or wrapper.inner is not inner:
            gens = [self.generator] + [getattr(s, "generator", None) for s in self._samplers()]
            wrapper = ResumableSampler(inner, gens)
            self.__dict__["_fl_resumable"] = wrapper
        return wrapper

    def _workers_fetch_ahead(self) -> int:
        """Worker processes that get index batches announced ahead (0: none).

        Needs map-style batches a dataset can fetch ahead (``fetch_ahead``), and
        ``in_order=True``, where torch hands batch ``j`` to worker ``j % num_workers``
        (out of order, it picks any worker with room, and most guesses would miss).
        """
        if self.num_workers < 1 or not self._auto_collation or not self.in_order:
            return 0
        if isinstance(self.dataset, tud.IterableDataset) or not callable(getattr(self.dataset, "fetch_ahead", None)):
            return 0
        return int(self.num_workers)

    def _generators(self) -> tuple[torch.Generator, ...]:
        if isinstance(self.dataset, tud.IterableDataset):
            return ()
        return self._resumable().generators

    def _samplers(self) -> list[Any]:
        found: list[Any] = []
        for s in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if s is not None and all(s is not f for f in found):
                found.append(s)
        return found

    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch``: forwarded to every sampler (and the dataset) with set_epoch.

        DistributedSampler and ShardedSampler reshuffle per epoch only when told.
        """
        self._fl_epoch = epoch
        for s in self._samplers():
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    # -- iteration ---------------------------------------------------------------------

    def _get_iterator(self) -> Any:
        first, undo = self.__dict__.get("_fl_first_worker", (0, None))
        if self.num_workers > 0 and (first or undo is not None):
            self.check_worker_number_rationality()
            return resumed_iterator(self, first, undo)
        return super()._get_iterator()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return chain.new_pass(self, super().__iter__)

    # -- stats and state ----------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """Return a snapshot of this loader's counters (all zero when ``stats=False``).

        Exact when called from the thread that iterates; from another thread the
        loader's own counters may lag by up to ``TICK_S`` (0.05 s) of batches.
        """
        live = self._fl_live() if self._fl_live is not None else None
        threads = (self.read_threads or chain.DEFAULT_READ_THREADS) if chain.read_fn(self) is not None else 0
        return loader_stats(self._fl_collector, self.dataset, live, threads)

    def reset_stats(self) -> None:
        """Forget the counters recorded so far."""
        self._fl_collector.reset()

    def state_dict(self) -> dict[str, Any]:
        """Return where the next batch comes from, as JSON data (see :mod:`fastload.loader.resume`).

        Just after :meth:`load_state_dict` that is the loaded position; mid-epoch, the
        batch after the last one handed out; between epochs, the next epoch's start
        (its RNG states included, so they fix its order).

        With ``in_order=False`` and workers it also names the batches already
        delivered (they need not be the epoch's first ones); the resume skips exactly those.
        """
        return resume.save(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; takes effect at the next ``iter(loader)``.

        Raises:
            ConfigError: The state comes from another version or another sharding.
            LoaderError: A mid-epoch state of an IterableDataset saved by another number
                of workers.

        Warns:
            UserWarning: A mid-epoch state of an IterableDataset with no state of its own
                (no ``state_dict()``, nor its iterator): it is replayed from the epoch's start.
        """
        resume.load(self, state)
