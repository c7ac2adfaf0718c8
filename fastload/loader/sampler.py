"""Samplers: rank sharding without a process group, and resumable epochs.

:class:`ShardedSampler` gives each of ``world_size`` ranks a disjoint shard of a
map-style dataset. It yields *exactly* what ``torch.utils.data.DistributedSampler``
yields for the same ``(seed, epoch, shuffle, drop_last)`` (pinned by
``tests/unit/test_resume.py::test_sharded_matches_distributed_sampler``), but needs
no initialised ``torch.distributed`` and can start an epoch at an offset in O(1).

Shard semantics (the same as DistributedSampler):

* ``shuffle=True``: one permutation of ``range(len(dataset))`` drawn from a private
  generator seeded with ``seed + epoch``, identical on every rank, so the shards stay
  disjoint. Call :meth:`ShardedSampler.set_epoch` each epoch or every epoch repeats.
* ``drop_last=False`` (padding): the index list is extended with its own head until
  its length divides by ``world_size``; every rank gets ``ceil(N / world_size)``
  indices and up to ``world_size - 1`` samples are seen twice per epoch. Equal
  lengths keep the ranks' step counts equal, so collective ops cannot hang.
* ``drop_last=True``: the tail is cut so the length divides by ``world_size``; every
  rank gets ``N // world_size`` indices and up to ``world_size - 1`` samples are
  skipped this epoch (with shuffling, different ones each epoch).
* Rank ``r`` takes positions ``r, r + world_size, r + 2 * world_size, ...``.

``partition="node"`` splits the dataset into one fixed part per node instead
(:mod:`fastload.read.partition`): each epoch permutes the node's part (seeded with
``seed + epoch``) and deals it to the node's ranks. Every rank of every node takes
``ceil(largest part / ranks per node)`` indices (padding each part with its own
head), or with ``drop_last`` ``smallest part // ranks per node``, so step counts
stay equal across the whole job.

Either split holds only if every rank splits the same items: under an initialised
process group the ranks compare their listings when the sampler is built, and a
mismatch raises on every rank (:mod:`fastload.loader.listing_check`).

:class:`ResumableSampler` wraps any sampler or batch sampler and can begin the
next epoch after ``k`` items *without fetching them*: it regenerates the epoch's
index order (replaying the RNG state recorded when the epoch's order was drawn)
and drops the first ``k`` entries at the index level.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import BatchSampler, Sampler

from fastload.errors import ConfigError
from fastload.loader import listing_check
from fastload.read import partition as parts

__all__ = ["ResumableSampler", "RngSnapshot", "ShardedSampler"]

T = TypeVar("T")


class ShardedSampler(Sampler[int]):
    """One rank's disjoint shard of ``range(len(dataset))``; DistributedSampler-compatible.

    Args:
        dataset: A sized dataset (only ``len()`` is used).
        world_size: Number of ranks sharing the dataset.
        rank: This rank, in ``[0, world_size)``.
        shuffle: Permute the indices with a generator seeded by ``seed + epoch``.
        seed: Base seed; must be the same on every rank.
        drop_last: Cut the tail (True) or pad with the head (False); see the module docs.
        partition: ``"global"`` (default): DistributedSampler's split, a new one each
            epoch. ``"node"``: a fixed part per node, shuffled within it
            (:mod:`fastload.read.partition`).
        nodes, node_rank: With ``partition="node"``, the node count and this rank's node;
            default from torchrun's or Slurm's environment (:func:`fastload.read.partition.topology`).

    Raises:
        ConfigError: ``world_size < 1`` or ``rank`` outside ``[0, world_size)``; an
            unknown ``partition``; a node topology that cannot be found or does not fit;
            under a process group of ``world_size`` ranks, ranks whose datasets list
            different items (raised on every rank; :mod:`fastload.loader.listing_check`).

    Example:
        >>> s = ShardedSampler(range(10), world_size=2, rank=1, shuffle=False)
        >>> list(s)
        [1, 3, 5, 7, 9]
    """

    def __init__(
        self,
        dataset: Sized,
        world_size: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        partition: str = "global",
        nodes: int | None = None,
        node_rank: int | None = None,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise ConfigError(
                f"rank={rank} is outside [0, {world_size - 1}] for world_size={world_size}; "
                "pass the rank of this process"
            )
        self.dataset = dataset
        self.world_size = world_size
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start = 0
        n = len(dataset)
        if drop_last and n % world_size != 0:
            self.num_samples = math.ceil((n - world_size) / world_size)
        else:
            self.num_samples = math.ceil(n / world_size)
        self.total_size = self.num_samples * world_size
        self.partition = partition
        self.topology: parts.Topology | None = None
        self._part: list[int] = []
        if partition == "node":
            self._split(nodes, node_rank)
        elif partition != "global" or nodes is not None or node_rank is not None:
            raise ConfigError(
                f"partition={partition!r} with nodes={nodes}, node_rank={node_rank}: use partition='global' "
                "(DistributedSampler's split; no nodes=) or partition='node' (a fixed part per node)"
            )
        else:
            listing_check.check(dataset, world_size, rank)

    def _split(self, nodes: int | None, node_rank: int | None) -> None:
        """Find this rank's node, and that node's part; size the shard so all ranks step alike."""
        top = parts.topology(self.world_size, self.rank, nodes, node_rank)
        keys, sizes = parts.dataset_weights(self.dataset)
        # Sizes too: the parts weigh bytes, so ranks that disagree on one size split apart.
        listing_check.check(self.dataset, self.world_size, self.rank, keys, sizes)
        owner = parts.assign(keys, sizes, top.nodes)
        parts.log_move(self.dataset, keys, sizes, top.nodes, announce=top.local_rank == 0)
        self.topology = top
        self._part = parts.node_items(owner, top.node_rank)
        counts = [int((owner == k).sum()) for k in range(top.nodes)]
        per = top.local_world_size
        if min(counts) == 0 or (self.drop_last and min(counts) < per):
            raise ConfigError(
                f"the dataset's {len(owner)} items split over {top.nodes} nodes leave a part of {min(counts)} "
                f"items for {per} ranks per node (drop_last={self.drop_last}); fix: use partition='global' "
                "for a dataset this small"
            )
        self.num_samples = min(counts) // per if self.drop_last else math.ceil(max(counts) / per)
        self.total_size = self.num_samples * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of epoch ``epoch`` (same on every rank)."""
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        """Make the next iteration (only) begin at position ``start`` of this rank's shard."""
        if start < 0:
            raise ConfigError(f"start={start} must be >= 0")
        self._start = start

    def indices(self) -> list[int]:
        """Return this rank's full index list for the current epoch."""
        if self.topology is not None:
            return self._node_indices(self.topology)
        n = len(self.dataset)
        if self.shuffle:
            # Same generator construction as DistributedSampler, so the orders match.
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if not self.drop_last:
            pad = self.total_size - len(order)
            if 0 < pad <= len(order):
                order += order[:pad]
            elif pad > 0:
                order += (order * math.ceil(pad / len(order)))[:pad]
        else:
            order = order[: self.total_size]
        return order[self.rank : self.total_size : self.world_size]

    def _node_indices(self, top: parts.Topology) -> list[int]:
        part = self._part
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = [part[j] for j in torch.randperm(len(part), generator=g).tolist()]
        else:
            order = list(part)
        size = self.num_samples * top.local_world_size
        order = (order * math.ceil(size / len(order)))[:size]  # pads with the part's own head, or cuts
        return order[top.local_rank :: top.local_world_size]

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        # Eager like DistributedSampler: the order is fixed when iteration starts.
        return iter(self.indices()[start:])

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "seed"}``; the shard is a pure function of these."""
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])


@dataclass(frozen=True)
class RngSnapshot:
    """RNG states recorded just before an epoch drew its index order.

    Attributes:
        phase: ``"iter"`` when the sampler drew in ``iter()``, ``"next"`` when it drew
            lazily at the first ``next()`` (generator-function samplers such as
            RandomSampler).
        global_state: ``torch.get_rng_state()`` at that moment.
        generator_states: ``g.get_state()`` of each tracked generator, in order.
        drawn: False when the snapshot was taken before the epoch's first draw (a state
            saved between ``iter()`` and the first ``next()``): the draw then still has
            to consume the caller's global stream when it is replayed.
    """

    phase: str
    global_state: torch.Tensor
    generator_states: tuple[torch.Tensor, ...]
    drawn: bool = True

    def to_state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (tensors are torch.save-able)."""
        return {
            "phase": self.phase,
            "global_state": self.global_state.clone(),
            "generator_states": [s.clone() for s in self.generator_states],
            "drawn": self.drawn,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RngSnapshot:
        """Inverse of :meth:`to_state`."""
        return cls(
            phase=str(state["phase"]),
            global_state=state["global_state"],
            generator_states=tuple(state["generator_states"]),
            drawn=bool(state.get("drawn", True)),
        )


def _consume(it: Iterator[Any], n: int) -> None:
    # islice + a zero-length deque advance the iterator in C: index generation only.
    collections.deque(itertools.islice(it, n), maxlen=0)


def _dropping(it: Iterator[T], first: int, exclude: frozenset[int]) -> Iterator[T]:
    # Items at epoch positions first, first + 1, ...; those in ``exclude`` are dropped.
    for pos, item in enumerate(it, first):
        if pos not in exclude:
            yield item


class ResumableSampler(Sampler[T], Generic[T]):
    """Wrap a sampler or batch sampler so an epoch can resume after ``k`` items.

    Each iteration records an :class:`RngSnapshot` of the global torch RNG and of the
    given generators at the moment the inner sampler draws its order. After
    :meth:`resume_at`, the next iteration restores that snapshot, regenerates the same
    order, drops the first ``k`` entries (indices only: no sample is read), and puts
    the global RNG back as the caller left it; tracked generators keep their post-draw
    state, exactly as in an uninterrupted run.

    The resume request is consumed by the first ``next()`` of an iteration, not by
    ``iter()``: torch's multi-process iterator calls ``iter()`` twice and uses the
    second iterator.

    Deterministic samplers (sequential, DistributedSampler, ShardedSampler) need no
    snapshot. A custom sampler with its *own* RNG (Python ``random``, NumPy) is not
    replayed unless its generator is a ``torch.Generator`` passed in ``generators``.

    Args:
        inner: The sampler or batch sampler to wrap.
        generators: Extra ``torch.Generator`` objects the inner sampler draws from.
    """

    def __init__(
        self, inner: Iterable[T], generators: Sequence[torch.Generator | None] = ()
    ) -> None:
        self.inner = inner
        seen: dict[int, torch.Generator] = {}
        for g in generators:
            if isinstance(g, torch.Generator) and g.device.type == "cpu":
                seen.setdefault(id(g), g)
        self.generators: tuple[torch.Generator, ...] = tuple(seen.values())
        self._skip = 0
        self._exclude: frozenset[int] = frozenset()  # epoch positions past the skip to drop too
        self._replay: RngSnapshot | None = None
        self._pending = False
        self._snapshot: RngSnapshot | None = None

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    @property
    def snapshot(self) -> RngSnapshot | None:
        """The RNG snapshot of the most recent epoch (None before its order is drawn)."""
        return self._snapshot

    @property
    def resume_pending(self) -> bool:
        """Whether the next iteration resumes (set by :meth:`resume_at`)."""
        return self._pending

    @property
    def pending_skip(self) -> int:
        """Items the next iteration will skip (0 when no resume is pending)."""
        return self._skip if self._pending else 0

    def capture(self) -> RngSnapshot:
        """Snapshot the RNG states now, for an epoch whose order is not drawn yet."""
        return RngSnapshot(
            "next",
            torch.get_rng_state(),
            tuple(g.get_state() for g in self.generators),
            drawn=False,
        )

    def resume_at(self, skip: int, replay: RngSnapshot | None = None, exclude: Iterable[int] = ()) -> None:
        """Make the next iteration (only) start after ``skip`` items of an epoch.

        Args:
            skip: Items (indices or index batches) to drop without reading them.
            replay: The snapshot recorded when the interrupted epoch drew its order.
            exclude: Epoch positions after ``skip`` to drop as well (the batches an
                out-of-order epoch delivered beyond its first gap).

        Raises:
            ConfigError: ``skip < 0``, or the snapshot tracks a different number of
                generators than this sampler.
        """
        if skip < 0:
            raise ConfigError(f"skip={skip} must be >= 0")
        if replay is not None and len(replay.generator_states) != len(self.generators):
            raise ConfigError(
                f"the saved state tracks {len(replay.generator_states)} generator(s) but this "
                f"loader has {len(self.generators)}; build the loader with the same sampler "
                "and generator arguments as the one that saved the state"
            )
        self._skip = skip
        self._exclude = frozenset(exclude)
        self._replay = replay
        self._pending = True

    def _capture(self, phase: str) -> RngSnapshot:
        return RngSnapshot(
            phase, torch.get_rng_state(), tuple(g.get_state() for g in self.generators)
        )

    def _restore(self, snap: RngSnapshot) -> None:
        torch.set_rng_state(snap.global_state)
        for g, s in zip(self.generators, snap.generator_states):
            g.set_state(s)

    def _fast_skip(self, skip: int) -> int:
        # A ShardedSampler can start at an offset itself: no index list walk.
        inner = self.inner
        if isinstance(inner, ShardedSampler):
            inner.set_start(skip)
            return 0
        if type(inner) is BatchSampler and isinstance(inner.sampler, ShardedSampler):
            # Every batch before the last is full, so k batches are k * batch_size indices.
            inner.sampler.set_start(skip * inner.batch_size)
            return 0
        return skip

    def _take(self) -> frozenset[int]:
        exclude = self._exclude
        self._skip, self._replay, self._pending, self._exclude = 0, None, False, frozenset()
        return exclude

    def __iter__(self) -> Iterator[T]:
        if self._pending:
            return self._iter_resumed()
        before = self._capture("iter")
        it = iter(self.inner)
        after = self._capture("iter")
        eager = not torch.equal(before.global_state, after.global_state) or any(
            not torch.equal(a, b) for a, b in zip(before.generator_states, after.generator_states)
        )
        if eager:
            # The inner sampler drew its order inside iter() (DistributedSampler style).
            self._snapshot = before
            return it
        self._snapshot = None
        return self._lazy(it)

    def _lazy(self, it: Iterator[T]) -> Iterator[T]:
        # Runs at the first next(): the moment generator-function samplers draw.
        self._snapshot = self._capture("next")
        yield from it

    def _iter_resumed(self) -> Iterator[T]:
        # May run more than once before the first next() (torch's workers call iter()
        # twice); each call repeats what the interrupted run did at that call.
        skip = self._fast_skip(self._skip) if self._skip else 0
        replay = self._replay
        if replay is not None and replay.phase == "iter":
            caller = torch.get_rng_state()
            self._restore(replay)
            it = iter(self.inner)
            if replay.drawn:
                torch.set_rng_state(caller)
            self._snapshot = replay
            return self._start(it, skip, None)
        return self._start(iter(self.inner), skip, replay)

    def _start(self, it: Iterator[T], skip: int, replay: RngSnapshot | None) -> Iterator[T]:
        base = self._skip - skip  # the epoch position of it's first item (a fast skip started later)
        exclude = self._take()
        if exclude:
            it = _dropping(it, base, exclude)
        if replay is None:
            self._snapshot = None
            _consume(it, skip)
            yield from it
            return
        caller = torch.get_rng_state()
        self._restore(replay)
        self._snapshot = replay
        try:
            _consume(it, skip)
            # Pull the first kept item while the replayed state is in place: a lazy
            # sampler draws its order now.
            first = list(itertools.islice(it, 1))
        finally:
            if replay.drawn:
                torch.set_rng_state(caller)
        yield from first
        yield from it
