"""A worker's snapshot: its part of the state, taken in the worker and collected in the parent.

Vocabulary:

* **snapshot**: a worker's part of the state (its ``random``, ``numpy`` and ``torch``
  RNG states, its dataset's ``state_dict()``, and its IterableDataset iterator's,
  when they have one), shipped with one of that worker's batches;
  :func:`worker_changes` takes it after the batch is collated;
* **changes**: only the parts that changed since the worker's previous snapshot
  cross (an unchanged RNG costs a comparison);
* **count** / **at**: the batches a worker produced in the epoch / the count at its
  latest snapshot; a resumed worker loads that snapshot and **replays** the
  ``count - at`` batches it produced after it (an IterableDataset reads and drops them);
* **next**: the worker that produces the next batch (the resumed iterator hands it
  its first index batch, so in-order delivery continues exactly);
* **base seed**: torch's seed for a pass's workers; a resumed worker is seeded from
  the interrupted pass's, as torch seeded it;
* **end state**: a worker's state once its iterator finished its shard (:class:`Ended`,
  which rides on torch's own end-of-shard message): a generator may still work after
  its last item (count its epochs), and persistent workers carry that into the next epoch;
* **carry**: the states a persistent worker starts its next epoch with (count 0; its end
  state, or its latest one when the epoch was cut short; never an iterator's state: the
  epoch makes a new iterator);
* **replay from the start**: an IterableDataset with no state of its own (no
  ``state_dict()``, nor its iterator) is run again from the epoch's start and the
  ``count`` batches the worker produced are dropped, as torchdata does.

An IterableDataset whose ``__iter__`` returns itself is its own iterator: its state is
saved as the iterator's and loaded *after* ``iter()`` (which resets its position), as
torchdata restores it.

A worker snapshots every ``snapshot_every_n_steps`` of its batches (and with its
first). Map-style datasets and persistent workers snapshot every batch: their
replay would have to re-read samples by index.

Worker side: :class:`WorkerInit` (restores the snapshot in the worker with the same
id) and :func:`worker_changes`. Parent side: :class:`WorkerStates`, each worker's
latest snapshot as of the batches the consumer received.

The RNG states' JSON encodings (all lossless), shared with the loader's state:

* a torch RNG or ``torch.Generator`` state (a uint8 tensor): the base64 of its bytes;
* Python ``random``: ``[version, [625 ints], gauss]``;
* NumPy's legacy global RNG: ``["MT19937", base64 of the 624 uint32 keys
  (little-endian), pos, has_gauss, cached_gaussian]``.
"""

from __future__ import annotations

import base64
import collections
import copy
import dataclasses
import itertools
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data import get_worker_info
from torch.utils.data._utils import worker as torch_worker

__all__ = [
    "Ended", "WorkerInit", "WorkerStates", "dataset_state", "decode_tensor", "drop", "encode_tensor", "iterator_state", "rng_state",
    "set_rng_state", "stateful", "worker_changes",
]  # fmt: skip


# -- lossless JSON encodings ----------------------------------------------------------


def encode_tensor(t: torch.Tensor) -> str:
    """A uint8 tensor (an RNG state) as base64 text."""
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def decode_tensor(text: str) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _python_state(state: Any = None) -> list[Any]:
    version, internal, gauss = random.getstate() if state is None else state
    return [version, list(internal), gauss]


def _numpy_state(state: Any = None) -> list[Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state() if state is None else state
    return [name, base64.b64encode(np.asarray(keys, dtype="<u4").tobytes()).decode("ascii"), int(pos), int(has_gauss), float(gauss)]


def rng_state() -> dict[str, Any]:
    """This process's ``random``, ``numpy`` and ``torch`` global RNG states, as JSON data."""
    return {"random": _python_state(), "numpy": _numpy_state(), "torch": encode_tensor(torch.get_rng_state())}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (each part that is present)."""
    if state.get("random") is not None:
        version, internal, gauss = state["random"]
        random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.frombuffer(base64.b64decode(keys), dtype="<u4").astype(np.uint32), pos, has_gauss, gauss))
    if state.get("torch") is not None:
        torch.set_rng_state(decode_tensor(state["torch"]))


# -- objects with a state of their own -------------------------------------------------


def stateful(obj: Any) -> bool:
    """Whether ``obj`` (a dataset, sampler or iterator) has ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def iterator_state(it: Any) -> Any:
    """The state of torch's fetcher's iterator over an IterableDataset (None: it has none).

    The iterator may be the dataset itself (``__iter__`` returns self): its state is then
    saved here, not as the dataset's, so it is loaded after ``iter()`` resets it.
    """
    return it.state_dict() if it is not None and stateful(it) else None


def dataset_state(dataset: Any, it: Any) -> Any:
    """A stateful dataset's ``state_dict()``, unless it is its own iterator ``it`` (see :func:`iterator_state`)."""
    return dataset.state_dict() if stateful(dataset) and it is not dataset else None


# -- worker side --------------------------------------------------------------------------


class _Worker:
    """One worker process's snapshot bookkeeping (set by :class:`WorkerInit`)."""

    def __init__(self, every: int, count: int, dataset: Any) -> None:
        self.every = every
        self.count = count  # batches this worker produced in the epoch, resumed ones included
        self.first = True
        self.dataset = dataset if stateful(dataset) else None
        self.iterable = isinstance(dataset, tud.IterableDataset)
        self.raw: tuple[Any, Any, bytes] | None = None  # RNG states at the previous snapshot


# Set in each worker process by WorkerInit; None in the parent.
_WORKER: _Worker | None = None


def worker_changes(caller: Any = None) -> tuple[int, dict[str, Any] | None]:
    """Worker, per batch: its id, and its state when a snapshot is due (changed parts only).

    Called by :class:`fastload.loader.worker_stats.WorkerCollate` after the batch is collated,
    so the state is the one after this batch. ``caller`` is the frame of torch's
    fetcher that called it: an IterableDataset's iterator (``fetcher.dataset_iter``)
    is found there, and saved when it has ``state_dict()``.
    """
    info = get_worker_info()
    wid = 0 if info is None else info.id
    w = _WORKER
    if w is None:
        return wid, None
    w.count += 1
    if w.count % w.every and not w.first:
        return wid, None
    w.first = False
    out: dict[str, Any] = {}
    py, nps, ts = random.getstate(), np.random.get_state(), torch.get_rng_state().numpy().tobytes()
    old = w.raw
    if old is None or old[0] != py:
        out["random"] = _python_state(py)
    if old is None or not _same_numpy(old[1], nps):
        out["numpy"] = _numpy_state(nps)
    if old is None or old[2] != ts:
        out["torch"] = base64.b64encode(ts).decode("ascii")
    w.raw = (py, nps, ts)
    fetcher = caller.f_locals.get("self") if w.iterable and caller is not None else None
    it = getattr(fetcher, "dataset_iter", None)
    if getattr(fetcher, "ended", False):
        # A short last batch: the iterator already finished (its state is past the end).
        out["ended"] = True
    if w.dataset is not None and it is not w.dataset:
        out["dataset"] = w.dataset.state_dict()
    state = iterator_state(it)
    if state is not None:
        out["iterator"] = state
    return wid, out


# torch's end-of-shard message, as torch defines it (before a worker rebinds the name).
_TorchEnded = torch_worker._IterableDatasetStopIteration


@dataclasses.dataclass(frozen=True)
class Ended(_TorchEnded):
    """torch's end-of-shard message from a worker, with the worker's end state (torch reads it as its own)."""

    state: dict[str, Any] | None = None


def _ended(worker_id: int) -> Ended:
    # Called by torch's _worker_loop in place of _IterableDatasetStopIteration, once the
    # worker's iterator finished: its frame holds the fetcher and the dataset.
    frame = sys._getframe(1).f_locals
    dataset = frame.get("dataset")
    it = getattr(frame.get("fetcher"), "dataset_iter", None)
    state: dict[str, Any] = rng_state()
    if isinstance(it, _Done):  # resumed after its shard ended: the state it was resumed with
        ds = it.state
    else:
        ds = None if it is None else dataset_state(dataset, it)  # (no iterator: nothing ran)
    if ds is not None:
        state["dataset"] = ds
    return Ended(worker_id, state)


def drop(it: Iterator[Any], n: int) -> None:
    """Read and drop ``n`` items of ``it`` (fewer when it ends).

    ``next()`` only: ``islice(it, n)`` calls ``iter(it)``, which resets a dataset that is
    its own iterator (tests/unit/test_resume_cases.py, case 1).
    """
    for _ in range(n):
        try:
            next(it)
        except StopIteration:
            return


class _Done(Iterator[Any]):
    """The iterator of a worker resumed after its shard ended: yields nothing; keeps the dataset state loaded."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def __next__(self) -> Any:
        raise StopIteration


def _hand_out(dataset: Any, it: Any) -> None:
    """Make the next ``iter(dataset)`` (torch's fetcher's) return ``it``, once."""
    cls = type(dataset)

    def once(self: Any) -> Any:
        self.__class__ = cls
        return it

    dataset.__class__ = type(cls.__name__, (cls,), {"__iter__": once, "__module__": cls.__module__})


def _same_numpy(a: Any, b: Any) -> bool:
    return bool(a[2] == b[2] and a[3] == b[3] and a[4] == b[4] and np.array_equal(a[1], b[1]))


class WorkerInit:
    """The ``worker_init_fn`` torch's workers run: the user's, then this worker's saved state.

    Args:
        user: The loader's ``worker_init_fn`` (runs first, with the worker id).
        states: Per worker id, the state :class:`WorkerStates` saved (None: none).
        every: Snapshot every this many of a worker's batches.
        per_batch: Items an IterableDataset yields per batch (for replay).
        base_seed: The interrupted pass's base seed: workers are seeded from it, as
            torch seeded that pass's workers (None: keep torch's seeds).
    """

    def __init__(
        self,
        user: Callable[[int], None] | None,
        states: list[dict[str, Any] | None] | None,
        every: int,
        per_batch: int,
        base_seed: int | None = None,
    ) -> None:
        self.user, self.states, self.every, self.per_batch = user, states, every, per_batch
        self.base_seed = base_seed

    def __call__(self, worker_id: int) -> None:
        global _WORKER
        if self.base_seed is not None:
            from torch.utils.data._utils.worker import _generate_state

            seed = self.base_seed + worker_id  # as torch's _worker_loop seeds a worker
            random.seed(seed)
            torch.manual_seed(seed)
            np.random.seed(_generate_state(self.base_seed, worker_id))
        if self.user is not None:
            self.user(worker_id)
        info = get_worker_info()
        dataset = None if info is None else info.dataset
        st = self.states[worker_id] if self.states else None
        count = 0
        iterable = isinstance(dataset, tud.IterableDataset)
        if iterable:
            # torch's end-of-shard message carries this worker's end state (fastload.loader.received).
            torch_worker._IterableDatasetStopIteration = _ended  # type: ignore[assignment,misc]
        if st is not None:
            count = int(st["count"])
            replay = count - int(st["at"])
            if iterable and count and not stateful(dataset) and st.get("iterator") is None:
                # No state to load: run the shard again from the epoch's start, from the
                # RNG states it started with, and drop the batches it produced.
                set_rng_state(st.get("begin") or {})
                again = iter(dataset)  # type: ignore[arg-type]
                drop(again, count * self.per_batch)
                _hand_out(dataset, again)
                _WORKER = _Worker(self.every, count, dataset)
                return
            set_rng_state(st)
            if st.get("dataset") is not None:
                dataset.load_state_dict(st["dataset"])  # type: ignore[union-attr]
            if st.get("ended"):
                _hand_out(dataset, _Done(st.get("dataset")))  # this worker's shard is done for the epoch
            elif st.get("iterator") is not None:
                # As torchdata: the dataset's state, then a new iterator, then its state.
                it: Any = iter(dataset)  # type: ignore[arg-type]
                it.load_state_dict(st["iterator"])
                drop(it, replay * self.per_batch)
                _hand_out(dataset, it)
            elif replay and isinstance(dataset, tud.IterableDataset):
                # The batches this worker produced after its snapshot: read and dropped.
                collections.deque(itertools.islice(iter(dataset), replay * self.per_batch), maxlen=0)
                dataset.load_state_dict(dataset.state_dict())  # type: ignore[attr-defined]
        _WORKER = _Worker(self.every, count, dataset)


# -- parent side --------------------------------------------------------------------------


class WorkerStates:
    """Parent: each worker's latest state, as of the batches the consumer received.

    Batches reach :meth:`add` (from :class:`fastload.loader.worker_stats.Unwrap`) possibly
    ahead of the consumer (the device prefetcher copies ahead); a batch's state is
    folded in only once :attr:`yielded` (the loader's count) passed it.

    Out of order (``in_order=False``, map-style), the batches delivered are not a prefix
    of the epoch: ``unordered`` is ``(prefix, extra)`` at the pass's start (every batch
    before ``prefix`` delivered, and those at the positions ``extra`` after it), and
    ``position(j)`` maps torch's j-th index batch of the pass to its epoch position.
    """

    def __init__(
        self,
        workers: int,
        loaded: dict[str, Any] | None,
        start: int,
        yielded: Callable[[], int],
        base_seed: int | None,
        ended: dict[int, Any] | None = None,
        sent: Callable[[], int] | None = None,
        unordered: tuple[int, list[int]] | None = None,
    ) -> None:
        self.workers = workers
        self.base_seed = base_seed  # torch's seed for this pass's workers
        states = loaded.get("states") if loaded else None
        self.cur: list[dict[str, Any]] = [
            dict(s) if s is not None else {"count": 0, "at": 0} for s in (states or [None] * workers)
        ]
        self.next = int(loaded.get("next", 0)) if loaded else 0  # the worker of the next batch
        self.pos = start  # the epoch position of the next batch add() gets
        self.pending: collections.deque[tuple[int, int, dict[str, Any] | None, int | None]] = collections.deque()
        self.yielded = yielded
        self.ended = {} if ended is None else ended  # worker id -> its end state, this epoch
        self.sent = sent  # torch's index of the batch just received (out of order)
        self.unordered = unordered is not None
        self.prefix, extra = unordered or (0, [])
        self.start_prefix = self.prefix
        self.skipped = sorted(extra)  # delivered before this pass: its index batches skip them
        self.delivered = set(extra)  # positions >= prefix delivered

    def position(self, j: int) -> int:
        """The epoch position of this pass's j-th index batch (out of order)."""
        pos = self.start_prefix + j
        for e in self.skipped:  # ascending: the j-th position not delivered before
            if e <= pos:
                pos += 1
        return pos

    def add(self, worker: int, changes: dict[str, Any] | None) -> None:
        where = self.position(self.sent()) if self.unordered and self.sent is not None else None
        self.pending.append((self.pos, worker, changes, where))
        self.pos += 1
        self.fold()

    def fold(self) -> None:
        done = self.yielded()
        pending = self.pending
        while pending and pending[0][0] < done:
            _, worker, changes, where = pending.popleft()
            cur = self.cur[worker]
            cur["count"] += 1
            if changes is not None:
                cur.update(changes)
                cur["at"] = cur["count"]
            self.next = (worker + 1) % self.workers
            if where is not None:
                self.delivered.add(where)
                while self.prefix in self.delivered:
                    self.delivered.discard(self.prefix)
                    self.prefix += 1

    def save(self) -> dict[str, Any]:
        self.fold()
        return {
            "num_workers": self.workers, "next": self.next, "base_seed": self.base_seed, "states": copy.deepcopy(self.cur),
        }  # fmt: skip

    def out_of_order(self) -> dict[str, Any] | None:
        """Which batches of an out-of-order epoch were delivered (None: in order)."""
        self.fold()
        return {"prefix": self.prefix, "extra": sorted(self.delivered)} if self.unordered else None

    def carry(self) -> dict[str, Any]:
        """The states persistent workers start their next epoch with (no ``next``).

        Each worker's end state when its iterator finished, else (the epoch was cut
        short) its latest state; no iterator state (the next epoch makes a new
        iterator), count 0, and the RNG states it starts from (``begin``: a dataset with
        no state is replayed from them).
        """
        self.fold()
        states = []
        for w, cur in enumerate(self.cur):
            src = self.ended.get(w) or cur
            rng = {k: src[k] for k in ("random", "numpy", "torch") if k in src}
            st: dict[str, Any] = {"count": 0, "at": 0, **copy.deepcopy(rng), "begin": copy.deepcopy(rng)}
            if src.get("dataset") is not None:
                st["dataset"] = copy.deepcopy(src["dataset"])
            states.append(st)
        return {"num_workers": self.workers, "base_seed": self.base_seed, "states": states}
