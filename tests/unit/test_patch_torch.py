"""torch's name rebound to fastload's class, fastload.patch_torch(), and torch's iterator surface."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud
import torch.utils.data.dataloader as tdl
from _loader_helpers import ReadBatchDS, TensorDS, assert_same
from test_loader_compat import GRID, WORKER_GRID

import fastload
from fastload.errors import ConfigError
from fastload.loader.dataloader import DataLoader
from fastload.loader.torch_surface import TORCH_DATALOADER


def _gen() -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(1234)
    return g


def _epochs(cls: Any, dataset: Any, epochs: int = 2, **kw: Any) -> tuple[list[Any], int]:
    args = dict(kw)
    if args.pop("seeded", False):
        args["generator"] = _gen()
    torch.manual_seed(99)
    loader = cls(dataset, **args)
    return [b for _ in range(epochs) for b in loader], len(loader)


@pytest.fixture
def rebound() -> Iterator[None]:
    """torch's names rebound by hand, as a user's start-up script does."""
    saved = tud.DataLoader, tdl.DataLoader
    tud.DataLoader = tdl.DataLoader = DataLoader  # type: ignore[misc]
    try:
        yield
    finally:
        tud.DataLoader, tdl.DataLoader = saved  # type: ignore[misc]


def _through_torch_name(dataset: Any, **kw: Any) -> tuple[list[Any], int]:
    # Looked up at call time, as a framework does.
    return _epochs(torch.utils.data.DataLoader, dataset, **kw)


@pytest.mark.parametrize("kw", GRID)
def test_rebound_name_yields_torchs_batches_num_workers_0(
    rebound: None, kw: dict[str, Any]
) -> None:
    kw = dict(kw)
    kw.pop("device", None)  # fastload-only; its own grid case covers it
    expected, n_expected = _epochs(TORCH_DATALOADER, TensorDS(), **kw)
    got, n_got = _through_torch_name(TensorDS(), **kw)
    assert isinstance(torch.utils.data.DataLoader(TensorDS()), DataLoader)
    assert len(expected) > 0 and n_got == n_expected
    assert_same(expected, got)


@pytest.mark.parametrize("kw", WORKER_GRID)
def test_rebound_name_yields_torchs_batches_num_workers_2(
    rebound: None, kw: dict[str, Any]
) -> None:
    expected, n_expected = _epochs(TORCH_DATALOADER, TensorDS(), num_workers=2, **kw)
    got, n_got = _through_torch_name(TensorDS(), num_workers=2, **kw)
    assert n_got == n_expected
    assert_same(expected, got)


def test_rebound_name_read_batch_path_and_len(rebound: None) -> None:
    expected, n_expected = _epochs(
        TORCH_DATALOADER, TensorDS(), batch_size=4, shuffle=True, seeded=True
    )
    got, n_got = _through_torch_name(ReadBatchDS(), batch_size=4, shuffle=True, seeded=True)
    assert n_got == n_expected == 6
    assert_same(expected, got)


def test_patch_torch_context_manager_restores_both_names() -> None:
    before = tud.DataLoader, tdl.DataLoader
    with fastload.patch_torch() as patch:
        assert tud.DataLoader is tdl.DataLoader is DataLoader
        assert patch.active and patch.loader_class is DataLoader
        loader = torch.utils.data.DataLoader(
            TensorDS(), batch_size=5, shuffle=True, generator=_gen()
        )
    assert (tud.DataLoader, tdl.DataLoader) == before
    assert not patch.active
    assert type(loader) is DataLoader
    assert_same(
        list(TORCH_DATALOADER(TensorDS(), batch_size=5, shuffle=True, generator=_gen())),
        list(loader),
    )


def test_patch_torch_undo_restores_and_is_idempotent() -> None:
    before = tud.DataLoader, tdl.DataLoader
    patch = fastload.patch_torch()
    assert tud.DataLoader is DataLoader
    patch.undo()
    assert (tud.DataLoader, tdl.DataLoader) == before
    patch.undo()
    assert (tud.DataLoader, tdl.DataLoader) == before
    assert "undone" in repr(patch)


def test_nested_patches_undo_in_any_order() -> None:
    before = tud.DataLoader
    outer = fastload.patch_torch()
    inner = fastload.patch_torch(stats=False)
    assert tud.DataLoader is inner.loader_class
    outer.undo()  # the inner patch is still in force and keeps torch's name
    assert tud.DataLoader is inner.loader_class
    inner.undo()
    assert tud.DataLoader is DataLoader  # what the inner patch found
    tud.DataLoader = tdl.DataLoader = before  # type: ignore[misc]


def test_patch_defaults_apply_while_in_force_and_callers_win() -> None:
    with fastload.patch_torch(stats=False, read_threads=0) as patch:
        plain = torch.utils.data.DataLoader(TensorDS(), batch_size=4)
        explicit = torch.utils.data.DataLoader(TensorDS(), batch_size=4, stats=True)
        direct = DataLoader(TensorDS(), batch_size=4)  # fastload's own name: no defaults
        kept = torch.utils.data.DataLoader  # a framework holding on to the class
    after = torch.utils.data.DataLoader(TensorDS(), batch_size=4)
    assert kept(TensorDS(), batch_size=4).stats_enabled is True  # the patch is undone
    assert patch.defaults == {"stats": False, "read_threads": 0}
    assert (
        isinstance(plain, DataLoader) and plain.stats_enabled is False and plain.read_threads == 0
    )
    assert explicit.stats_enabled is True
    assert direct.stats_enabled is True and direct.read_threads is None
    assert type(after) is TORCH_DATALOADER
    # Frameworks rebuild loaders from the signature: it must be DataLoader's.
    assert inspect.signature(type(plain).__init__) == inspect.signature(DataLoader.__init__)
    assert type(plain).__name__ == "DataLoader"


def test_patch_rejects_defaults_for_torchs_own_arguments() -> None:
    with pytest.raises(ConfigError, match=r"\['num_workers'\].*device"):
        fastload.patch_torch(num_workers=4)
    assert tud.DataLoader is TORCH_DATALOADER


# -- torch's iterator surface --------------------------------------------------------------

SURFACE = (
    "_workers", "_worker_pids_set", "_num_workers", "_sampler_iter", "_num_yielded", "_dataset",
    "_index_sampler", "_persistent_workers", "_pin_memory", "_prefetch_factor", "_timeout", "_collate_fn",
)  # fmt: skip


def _wait_dead(procs: list[Any], timeout: float = 10.0) -> list[bool]:
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p.is_alive() for p in procs]


def test_worker_iterator_has_torchs_surface_and_shuts_down() -> None:
    loader = DataLoader(TensorDS(), batch_size=4, num_workers=2)
    theirs = iter(TORCH_DATALOADER(TensorDS(), batch_size=4, num_workers=2))
    it = iter(loader)
    assert isinstance(it, tdl._MultiProcessingDataLoaderIter)
    first = next(it)
    next(theirs)
    for name in SURFACE:
        if name in ("_index_sampler", "_sampler_iter"):  # the loader's ResumableSampler
            continue
        assert type(getattr(it, name)) is type(getattr(theirs, name)), name
    assert it._index_sampler is loader._index_sampler and len(it._index_sampler) == 6
    assert next(it._sampler_iter) == next(theirs._sampler_iter) == [20, 21, 22]  # 5 batches sent
    assert (it._num_workers, it._num_yielded, it._prefetch_factor, it._timeout) == (2, 1, 2, 0)
    assert it._dataset is loader.dataset and it._persistent_workers is False
    assert it._worker_pids_set is True
    assert len(it._workers) == 2 and all(w.is_alive() and w.pid for w in it._workers)
    assert loader._iterator is None  # as torch: only persistent workers are kept
    workers = list(it._workers)
    it._shutdown_workers()
    assert _wait_dead(workers) == [False, False]
    assert it._shutdown is True and it._worker_pids_set is False
    theirs._shutdown_workers()
    assert_same(first, list(TORCH_DATALOADER(TensorDS(), batch_size=4))[0])


def test_writes_reach_torchs_iterator() -> None:
    loader = DataLoader(TensorDS(), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    assert isinstance(loader._iterator, tdl._MultiProcessingDataLoaderIter)
    assert type(loader._iterator) is tdl._MultiProcessingDataLoaderIter  # torch's own object
    assert it._workers is loader._iterator._workers
    it._num_yielded = 5
    assert loader._iterator._num_yielded == 5
    loader._iterator._shutdown_workers()


def test_additions_work_after_lightning_style_teardown_and_new_iter() -> None:
    # Lightning's _shutdown_workers_and_reset_iterator: shut down, then drop _iterator.
    loader = DataLoader(TensorDS(), batch_size=4, num_workers=2, persistent_workers=True, seed=3)
    expected = list(TORCH_DATALOADER(TensorDS(), batch_size=4, generator=_seeded(3)))
    assert_same(expected, list(loader))
    workers = list(loader._iterator._workers)
    assert isinstance(loader._iterator, tdl._MultiProcessingDataLoaderIter)
    loader._iterator._shutdown_workers()
    loader._iterator = None
    assert _wait_dead(workers) == [False, False]
    it = iter(loader)
    assert loader._iterator is not None and all(w.is_alive() for w in it._workers)
    assert not {w.pid for w in it._workers} & {w.pid for w in workers}
    batches = [next(it), next(it)]
    assert loader.state_dict()["batches_yielded"] == 2
    batches += list(it)
    assert_same(expected, batches)
    assert loader.stats().batches == 2 * len(expected)
    loader._iterator._shutdown_workers()


def _seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.mark.parametrize("dataset", [TensorDS(), ReadBatchDS()], ids=["plain", "read_batch"])
def test_single_process_iterator_is_torchs_class(dataset: Any) -> None:
    it = iter(DataLoader(dataset, batch_size=4))
    assert isinstance(it, tdl._SingleProcessDataLoaderIter)
    next(it), next(it)
    assert it._num_yielded == 2 and it._num_workers == 0 and it._dataset is dataset
    assert len(it) == 6
