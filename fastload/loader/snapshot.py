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
  the interrupted pass's, as torch seeded it.

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
import itertools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data import get_worker_info

__all__ = [
    "WorkerInit", "WorkerStates", "decode_tensor", "encode_tensor", "iterator_state", "rng_state",
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


def iterator_state(fetcher: Any, dataset: Any) -> Any:
    """The state of torch's fetcher's iterator over an IterableDataset, when it has one of its own."""
    it = getattr(fetcher, "dataset_iter", None)
    if it is None or it is dataset or not stateful(it):
        return None
    return it.state_dict()


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
    if w.dataset is not None:
        out["dataset"] = w.dataset.state_dict()
    if w.iterable and caller is not None:
        it = iterator_state(caller.f_locals.get("self"), w.dataset)
        if it is not None:
            out["iterator"] = it
    return wid, out


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
        if st is not None:
            count = int(st["count"])
            set_rng_state(st)
            if st.get("dataset") is not None:
                dataset.load_state_dict(st["dataset"])  # type: ignore[union-attr]
            replay = count - int(st["at"])
            if st.get("iterator") is not None:
                # As torchdata: the dataset's state, then a new iterator, then its state.
                it: Any = iter(dataset)  # type: ignore[arg-type]
                it.load_state_dict(st["iterator"])
                collections.deque(itertools.islice(it, replay * self.per_batch), maxlen=0)
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
    """

    def __init__(
        self, workers: int, loaded: dict[str, Any] | None, start: int, yielded: Callable[[], int], base_seed: int | None
    ) -> None:
        self.workers = workers
        self.base_seed = base_seed  # torch's seed for this pass's workers
        states = loaded.get("states") if loaded else None
        self.cur: list[dict[str, Any]] = [
            dict(s) if s is not None else {"count": 0, "at": 0} for s in (states or [None] * workers)
        ]
        self.next = int(loaded.get("next", 0)) if loaded else 0  # the worker of the next batch
        self.pos = start  # the epoch position of the next batch add() gets
        self.pending: collections.deque[tuple[int, int, dict[str, Any] | None]] = collections.deque()
        self.yielded = yielded

    def add(self, worker: int, changes: dict[str, Any] | None) -> None:
        self.pending.append((self.pos, worker, changes))
        self.pos += 1
        self.fold()

    def fold(self) -> None:
        done = self.yielded()
        pending = self.pending
        while pending and pending[0][0] < done:
            _, worker, changes = pending.popleft()
            cur = self.cur[worker]
            cur["count"] += 1
            if changes is not None:
                cur.update(changes)
                cur["at"] = cur["count"]
            self.next = (worker + 1) % self.workers

    def save(self) -> dict[str, Any]:
        self.fold()
        return {
            "num_workers": self.workers, "next": self.next, "base_seed": self.base_seed, "states": copy.deepcopy(self.cur),
        }  # fmt: skip
