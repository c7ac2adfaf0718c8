"""The loader's state: what ``DataLoader.state_dict()`` saves and ``load_state_dict()`` restores.

A state always describes where the *next* batch comes from: the epoch, the
batches of it already handed out, and what is needed to regenerate the rest
exactly. It is plain JSON data: ``json.loads(json.dumps(state))`` resumes the
same as ``state`` (only a stateful dataset's or sampler's own ``state_dict()``,
stored as they return it, can make it otherwise). :func:`save` builds it,
:func:`load` checks it and keeps it for the next ``iter()``, where
:func:`begin_epoch`, :func:`worker_plan` and :func:`after_build` apply it.

The parts:

* index order (map-style datasets): :class:`fastload.loader.sampler.ResumableSampler`
  regenerates the epoch's order from the RNG state recorded when it was drawn
  (:func:`encode_rng`) and drops the first ``k`` index batches without reading them;
* stateful samplers (``state_dict``/``load_state_dict``): their state when the
  epoch began, loaded back before the order is regenerated;
* with ``num_workers=0``: the dataset's state at ``state_dict()`` when it has
  ``state_dict``/``load_state_dict`` (loaded before ``iter()``), likewise the iterator
  an IterableDataset's ``iter()`` returned (loaded after it; a dataset whose
  ``__iter__`` returns itself is its own iterator), and this process's ``random``,
  ``numpy`` and ``torch`` RNG states (the dataset draws from them). At an epoch's end
  the dataset's state is taken after its iterator finished;
* with workers, each worker's snapshot (:mod:`fastload.loader.snapshot`: its RNG and
  dataset states, taken with its batches and restored in the worker with the same
  id); the resumed iterator hands its first index batch to the worker that was next
  (:func:`resumed_iterator`), so in-order delivery continues exactly where it stopped.
  Persistent workers carry their end states into the next epoch (and into a state
  saved between epochs);
* an IterableDataset with no state at all (nor its iterator) is replayed: run again
  from the epoch's start, dropping the samples already yielded (per worker), with one
  warning;
* out of order (``in_order=False`` with workers, map-style): ``out_of_order`` is
  ``{"prefix", "extra"}``, every batch before ``prefix`` delivered and those at the
  positions ``extra`` after it; the resumed order skips exactly those.

RNG states are encoded as :mod:`fastload.loader.snapshot` describes (all lossless);
the index order's RNG state (a :class:`fastload.loader.sampler.RngSnapshot`) is
``{"phase", "global_state", "generator_states", "drawn"}``, each state so encoded.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud

from fastload.errors import ConfigError, LoaderError
from fastload.loader.received import receiver
from fastload.loader.sampler import RngSnapshot
from fastload.loader.snapshot import (
    WorkerInit,
    WorkerStates,
    dataset_state,
    decode_tensor,
    drop,
    encode_tensor,
    iterator_state,
    rng_state,
    set_rng_state,
    stateful,
)

__all__ = [
    "STATE_VERSION", "after_build", "begin_epoch", "decode_rng", "encode_rng", "load", "resumed_iterator",
    "save", "worker_plan", "worker_states",
]  # fmt: skip

STATE_VERSION = 2


# -- the index order's RNG state --------------------------------------------------------


def encode_rng(snap: RngSnapshot) -> dict[str, Any]:
    """An index-order RNG snapshot as JSON data."""
    return {
        "phase": snap.phase,
        "global_state": encode_tensor(snap.global_state),
        "generator_states": [encode_tensor(s) for s in snap.generator_states],
        "drawn": snap.drawn,
    }


def decode_rng(state: dict[str, Any]) -> RngSnapshot:
    """Inverse of :func:`encode_rng`."""
    return RngSnapshot(
        phase=str(state["phase"]),
        global_state=decode_tensor(state["global_state"]),
        generator_states=tuple(decode_tensor(s) for s in state["generator_states"]),
        drawn=bool(state.get("drawn", True)),
    )


# -- workers --------------------------------------------------------------------------


def worker_states(
    loader: Any,
    pending: dict[str, Any] | None,
    loaded: dict[str, Any] | None,
    reused: bool,
    start: int,
    progress: Any,
    source: Any,
) -> WorkerStates:
    """The tracker of a pass with workers: from the loaded states, or carried on by persistent workers."""
    rec = receiver(source)
    if loaded is None and reused and loader._fl_workers is not None:
        # The same workers go on: their end states (and torch's seed) carry over. A
        # worker with no batch yet this epoch is saved with these, not with the
        # state it had when the previous epoch ended (tests/unit/test_resume_cases.py, case 3).
        loaded = {**loader._fl_workers.carry(), "next": 0}
    rec.ended.clear()
    base_seed = loaded.get("base_seed") if loaded else None
    if base_seed is None:
        base_seed = getattr(source, "_base_seed", None)
    unordered = None
    if not loader.in_order and not isinstance(loader.dataset, tud.IterableDataset):
        ooo = pending.get("out_of_order") if pending is not None and pending.get("in_epoch") else None
        unordered = (int(ooo["prefix"]), [int(e) for e in ooo["extra"]]) if ooo else (start, [])
    return WorkerStates(
        loader.num_workers, loaded, start, lambda: progress.yielded, base_seed, rec.ended, rec.last, unordered
    )


def resumed_iterator(loader: Any, first: int, undo: Callable[[], None] | None) -> Any:
    """torch's multi-process iterator for a resumed pass.

    Its first index batch goes to worker ``first`` (its later epochs, with persistent
    workers, start at worker 0 as torch's do), and ``undo`` runs between its base-seed
    draw and its first index batches (torch's ``_reset`` draws them).
    """
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    class _Resumed(_MultiProcessingDataLoaderIter):
        def __init__(self, loader: Any) -> None:
            self._fl_rotate = first
            super().__init__(loader)

        def _reset(self, loader: Any, first_iter: bool = False) -> None:
            if first_iter and undo is not None:
                undo()
            super()._reset(loader, first_iter)

        @property
        def _worker_queue_idx_cycle(self) -> Any:
            return self.__dict__["_fl_cycle"]

        @_worker_queue_idx_cycle.setter
        def _worker_queue_idx_cycle(self, cycle: Any) -> None:
            # torch's _reset sets a fresh cycle, then primes the workers from it.
            for _ in range(self.__dict__.pop("_fl_rotate", 0)):
                next(cycle)
            self.__dict__["_fl_cycle"] = cycle

    return _Resumed(loader)


# -- the loader's state ----------------------------------------------------------------


def begin_epoch(
    loader: Any, pending: dict[str, Any] | None
) -> tuple[int, list[torch.Tensor], list[Any], Callable[[], None] | None]:
    """At ``iter()``: apply a loaded state's RNG, sampler and dataset parts.

    Returns the epoch position of the first batch, the tracked generators' and the
    stateful samplers' states at the epoch's start, and what to call once torch's
    iterator is built, to undo its base-seed draw (None: keep it). A mid-epoch resume
    puts the caller's global RNG back (the interrupted run drew the base seed from it
    already); the epoch after a boundary state of persistent workers puts back the
    saved RNG states (the interrupted run's iterator drew no new base seed).
    """
    gens = loader._generators()
    samplers = [s for s in loader._samplers() if stateful(s)]
    in_epoch = bool(pending and pending.get("in_epoch"))
    if pending is not None and in_epoch:
        # Put the generators where the interrupted epoch started, so torch's own draws
        # (base seed, eager samplers) repeat.
        for g, st in zip(gens, pending.get("generator_start") or ()):
            g.set_state(decode_tensor(st))
        for s, st in zip(samplers, pending.get("sampler_start") or ()):
            s.load_state_dict(st)
        if loader.num_workers == 0 and pending.get("dataset") is not None:
            loader.dataset.load_state_dict(pending["dataset"])  # before iter(): it may read it there
        caller = torch.get_rng_state()
        undo: Callable[[], None] | None = lambda: torch.set_rng_state(caller)  # noqa: E731
    else:
        undo = None
        if pending is not None and loader.num_workers == 0 and pending.get("dataset") is not None:
            # Its state after the finished epoch's iterator ended (it may count epochs there).
            loader.dataset.load_state_dict(pending["dataset"])
        start = None if pending is None else pending.get("start_rng")
        if start is not None:
            torch.set_rng_state(decode_tensor(start["global"]))
            for g, st in zip(gens, start["generators"]):
                g.set_state(decode_tensor(st))
            if start.get("reuse") and loader.num_workers > 0:
                saved = torch.get_rng_state(), [g.get_state() for g in gens]

                def undo() -> None:
                    torch.set_rng_state(saved[0])
                    for g, st in zip(gens, saved[1]):
                        g.set_state(st)

    skip = int(pending["batches_yielded"]) if pending is not None and in_epoch else 0
    return skip, [g.get_state() for g in gens], [s.state_dict() for s in samplers], undo


def after_build(loader: Any, pending: dict[str, Any] | None, source: Any) -> None:
    """Once torch's single-process iterator exists: its dataset iterator's saved state, or a replay.

    The iterator's state is loaded after ``iter(dataset)``, which may reset it (a
    dataset that is its own iterator). A dataset with no state is read again from
    the epoch's start up to where the state was saved; the RNG states are put back
    after, so the draws that follow are the interrupted run's.
    """
    if pending is None or not pending.get("in_epoch") or loader.num_workers != 0:
        return
    if not isinstance(loader.dataset, tud.IterableDataset):
        return
    fetcher = source._dataset_fetcher
    it = fetcher.dataset_iter
    if pending.get("ended"):
        fetcher.ended = True  # saved after a short last batch: the epoch has nothing left
    elif pending.get("iterator") is not None:
        it.load_state_dict(pending["iterator"])
    elif _replays(loader, pending):
        saved = rng_state()
        n = int(pending["batches_yielded"]) * _per_batch(loader)
        drop(it, n)
        set_rng_state(saved)


def _per_batch(loader: Any) -> int:
    return int(loader.batch_size) if loader._auto_collation and loader.batch_size else 1


def _replays(loader: Any, state: dict[str, Any]) -> bool:
    """Whether a mid-epoch ``state`` of an IterableDataset resumes by replay (no state of its own)."""
    workers = state.get("workers") or {}
    saved = [s for s in workers.get("states", []) if s and (s.get("iterator") is not None or s.get("dataset") is not None)]
    return not (stateful(loader.dataset) or state.get("iterator") is not None or saved)


def worker_plan(loader: Any, pending: dict[str, Any] | None) -> tuple[WorkerInit | None, int, dict[str, Any] | None]:
    """At ``iter()`` with workers: their init function, the worker of the first batch, the loaded states.

    States saved by another number of workers are dropped: a map-style order still
    resumes exactly (it lives in this process); those workers' RNG is not replayed.
    """
    if loader.num_workers == 0:
        return None, 0, None
    loaded = pending.get("workers") if pending is not None else None
    if loaded is not None and loaded.get("num_workers") != loader.num_workers:
        loaded = None
    iterable = isinstance(loader.dataset, tud.IterableDataset)
    every = (loader.snapshot_every_n_steps or sys.maxsize) if iterable and not loader.persistent_workers else 1
    per_batch = _per_batch(loader)
    if loaded is None:
        return WorkerInit(loader.worker_init_fn, None, every, per_batch), 0, None
    init = WorkerInit(loader.worker_init_fn, loaded["states"], every, per_batch, loaded.get("base_seed"))
    return init, int(loaded["next"]), loaded


def _warn_replay(loader: Any, skip: int, workers: dict[str, Any] | None) -> None:
    # As torchdata: slow but right. One warning per load, with the cost and the fix.
    batches = sum(int(s.get("count", 0)) for s in workers["states"] if s) if workers else skip
    where = f" across its {workers['num_workers']} worker processes" if workers else ""
    warnings.warn(
        f"fastload.DataLoader: {type(loader.dataset).__name__} (an IterableDataset) has no "
        f"state_dict(), so resuming after {skip} batches runs it again from the start of the "
        f"epoch and drops the {batches * _per_batch(loader)} samples already yielded{where}; "
        "fix: give the dataset state_dict() and load_state_dict() (or its iterator) to resume "
        "without replaying",
        stacklevel=3,
    )


def _json(x: Any) -> Any:
    return copy.deepcopy(x)


def save(loader: Any) -> dict[str, Any]:
    """``loader.state_dict()``: where the next batch comes from."""
    pending = loader._fl_pending
    if pending is not None:  # loaded, not iterated yet: the loaded position is the next one
        return _json(pending)
    progress = loader._fl_progress
    in_epoch = progress is not None and progress.active
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "epoch": loader._fl_epoch,
        "sampler_epochs": [getattr(s, "epoch", None) for s in loader._samplers()],
        "in_epoch": in_epoch,
        "batches_yielded": 0,
        "rng": None,
        "generator_start": None,
        "sampler_start": None,
        "dataset": None,
        "main_rng": None,
        "iterator": None,
        "workers": None,
        "generator_state": None if loader.generator is None else encode_tensor(loader.generator.get_state()),
        "world_size": loader.world_size,
        "rank": loader.rank,
    }
    iterable = isinstance(loader.dataset, tud.IterableDataset)
    if not in_epoch:
        # Between epochs: the next epoch starts from the RNG states as they are now, so
        # the state fixes its order (and its workers' seeds).
        reuse = bool(loader.persistent_workers and loader._iterator is not None)
        state["start_rng"] = {
            "global": encode_tensor(torch.get_rng_state()),
            "generators": [encode_tensor(g.get_state()) for g in loader._generators()],
            "reuse": reuse,  # the next epoch reuses persistent workers: no new base seed
        }
        if reuse and loader._fl_workers is not None:
            # ...and its workers go on from their end states (RNG, dataset).
            state["workers"] = {**loader._fl_workers.carry(), "next": 0}
        if loader.num_workers == 0:
            # The same dataset object starts the next epoch: its state now, taken after
            # its iterator finished (a generator may count its epochs after its last item).
            it = getattr(progress.fetcher, "dataset_iter", None) if progress is not None else None
            state["dataset"] = dataset_state(loader.dataset, it)  # (its own iterator: a position iter() resets)
        return state
    state["batches_yielded"] = progress.yielded
    state["generator_start"] = None if progress.gen_start is None else [encode_tensor(s) for s in progress.gen_start]
    state["sampler_start"] = progress.sampler_start
    wrapper = loader._fl_resumable
    if wrapper is not None and not iterable:
        # A lazy sampler that has not drawn yet draws from the current state.
        state["rng"] = encode_rng(wrapper.snapshot or wrapper.capture())
    if loader.num_workers == 0:
        # The dataset drew from this process's RNGs: they are part of its position.
        state["main_rng"] = rng_state()
        it = None
        if iterable:
            fetcher = progress.fetcher
            it = getattr(fetcher, "dataset_iter", None)
            state["iterator"] = iterator_state(it)
            state["ended"] = bool(getattr(fetcher, "ended", False))
        state["dataset"] = dataset_state(loader.dataset, it)
    elif loader._fl_workers is not None:
        state["workers"] = loader._fl_workers.save()
        state["out_of_order"] = loader._fl_workers.out_of_order()
    return state


def load(loader: Any, state: dict[str, Any]) -> None:
    """``loader.load_state_dict(state)``: checks it, and makes it the next ``iter()``'s start."""
    if state.get("version") != STATE_VERSION:
        raise ConfigError(
            f"loader state version {state.get('version')!r} is not {STATE_VERSION}; "
            "it was saved by another fastload version"
        )
    if (state.get("world_size"), state.get("rank")) != (loader.world_size, loader.rank):
        raise ConfigError(
            f"state saved with world_size={state.get('world_size')} rank={state.get('rank')} "
            f"cannot resume a loader with world_size={loader.world_size} rank={loader.rank}"
        )
    loader.set_epoch(int(state["epoch"]))
    for s, e in zip(loader._samplers(), state.get("sampler_epochs", [])):
        if e is not None and callable(getattr(s, "set_epoch", None)):
            s.set_epoch(e)  # the user may have called sampler.set_epoch directly
    if state.get("generator_state") is not None and loader.generator is not None:
        loader.generator.set_state(decode_tensor(state["generator_state"]))
    skip = int(state.get("batches_yielded", 0))
    workers = state.get("workers")
    if isinstance(loader.dataset, tud.IterableDataset) and state.get("in_epoch") and skip:
        if loader.num_workers > 0 and (workers is None or workers["num_workers"] != loader.num_workers):
            raise LoaderError(
                f"cannot resume {type(loader.dataset).__name__} (an IterableDataset) with "
                f"num_workers={loader.num_workers}: its state was saved by "
                f"{0 if workers is None else workers['num_workers']} worker processes, each with "
                "its own shard; fix: resume with the num_workers that saved it"
            )
        if loader.num_workers == 0 and workers is not None:
            raise LoaderError(
                f"cannot resume {type(loader.dataset).__name__} with num_workers=0 from a state "
                f"saved by {workers['num_workers'] if workers else 0} worker processes; fix: resume "
                "with the num_workers that saved it"
            )
        if _replays(loader, state):
            _warn_replay(loader, skip, workers)
    if state.get("main_rng") is not None and loader.num_workers == 0:
        set_rng_state(state["main_rng"])
    if state.get("in_epoch") and not isinstance(loader.dataset, tud.IterableDataset):
        rng = None if state.get("rng") is None else decode_rng(state["rng"])
        ooo = state.get("out_of_order")
        if ooo is not None:  # out of order: skip the first gap's prefix and the batches after it
            loader._resumable().resume_at(int(ooo["prefix"]), rng, [int(e) for e in ooo["extra"]])
        else:
            loader._resumable().resume_at(skip, rng)
    if loader.persistent_workers and loader._iterator is not None:
        loader._iterator = None  # its workers hold the old position: start new ones
    loader._fl_pending = _json(state)
