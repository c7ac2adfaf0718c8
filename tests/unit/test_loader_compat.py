"""fastload.DataLoader against torch.utils.data.DataLoader: same signature, batches, errors, RNG."""

from __future__ import annotations

import inspect
import threading
import time
import traceback
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from _loader_helpers import (
    CountingDS,
    DictDS,
    RandomDS,
    RangeIterDS,
    ReadBatchDS,
    TensorDS,
    assert_same,
)

from fastload.errors import ConfigError, LoaderError
from fastload.loader.dataloader import DataLoader


def _gen(seed: int = 1234) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _run_both(dataset: Any, epochs: int = 1, **kw: Any) -> tuple[list[Any], list[Any]]:
    """Iterate torch's and fastload's loader with identical fresh arguments and seeds."""
    out = []
    for cls in (tud.DataLoader, DataLoader):
        args = dict(kw)
        if args.pop("seeded", False):
            args["generator"] = _gen()
        torch.manual_seed(99)
        loader = cls(dataset, **args)
        out.append([b for _ in range(epochs) for b in loader])
    return out[0], out[1]


def test_signature_matches_torch() -> None:
    ours = list(inspect.signature(DataLoader.__init__).parameters.values())
    theirs = list(inspect.signature(tud.DataLoader.__init__).parameters.values())
    assert len(theirs) == 18  # self + 17; a torch upgrade that adds one must be mirrored
    for p, q in zip(ours, theirs):
        assert (p.name, p.kind, p.default) == (q.name, q.kind, q.default)
    extras = ours[len(theirs) :]
    assert extras, "fastload adds keyword-only arguments"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras)
    assert issubclass(DataLoader, tud.DataLoader)


def test_positional_arguments_land_where_torch_puts_them() -> None:
    sampler = tud.SequentialSampler(range(5))
    fn = tud.default_collate
    a = tud.DataLoader(range(5), 2, None, sampler, None, 0, fn, False, True)
    b = DataLoader(range(5), 2, None, sampler, None, 0, fn, False, True)
    for name in ("batch_size", "drop_last", "collate_fn", "num_workers", "pin_memory", "timeout"):
        assert getattr(a, name) == getattr(b, name), name
    assert b.sampler is sampler
    assert len(a) == len(b) == 2


def _reversed_sampler(n: int) -> list[int]:
    return list(reversed(range(n)))


def _collate_sum(batch: list[Any]) -> Any:
    return [sum(float(x[0].sum()) for x in batch), len(batch)]


GRID = [
    pytest.param(dict(batch_size=None), id="bs-None"),
    pytest.param(dict(batch_size=1), id="bs-1"),
    pytest.param(dict(batch_size=7), id="bs-7"),
    pytest.param(dict(batch_size=7, drop_last=True), id="bs-7-drop"),
    pytest.param(dict(batch_size=7, shuffle=True, seeded=True), id="shuffle-gen"),
    pytest.param(dict(batch_size=7, shuffle=True), id="shuffle-global"),
    pytest.param(dict(batch_size=None, shuffle=True, seeded=True), id="shuffle-nobatch"),
    pytest.param(dict(batch_size=3, sampler=_reversed_sampler(23)), id="custom-sampler"),
    pytest.param(
        dict(batch_size=4, sampler=tud.RandomSampler(range(23), num_samples=30, replacement=True)),
        id="replacement-sampler",
    ),
    pytest.param(dict(batch_sampler=[[0, 5], [22, 1, 2], [7]]), id="batch-sampler"),
    pytest.param(dict(batch_size=5, collate_fn=_collate_sum), id="collate-fn"),
    pytest.param(dict(batch_size=None, collate_fn=lambda s: s[1]), id="collate-nobatch"),
    pytest.param(dict(batch_size=5, shuffle=True, device="cpu"), id="device-cpu"),
]


@pytest.mark.parametrize("kw", GRID)
def test_grid_num_workers_0(kw: dict[str, Any]) -> None:
    kw = dict(kw)
    device = kw.pop("device", None)
    if device is not None:  # fastload-only argument: torch yields the same values on CPU
        expected = list(tud.DataLoader(TensorDS(), generator=_gen(), **kw))
        got = list(DataLoader(TensorDS(), generator=_gen(), device=device, **kw))
        assert_same(expected, got)
        return
    expected, got = _run_both(TensorDS(), epochs=2, **kw)
    assert len(expected) > 0
    assert_same(expected, got)


WORKER_GRID = [
    pytest.param(dict(batch_size=4, shuffle=True, seeded=True), id="shuffle"),
    pytest.param(dict(batch_size=None), id="bs-None"),
    pytest.param(dict(batch_size=3, persistent_workers=True, seeded=True), id="persistent"),
    # Workers return their stats with each batch; the user's collate output and
    # the batch order must come through untouched.
    pytest.param(dict(batch_size=5, collate_fn=_collate_sum), id="collate-fn"),
    pytest.param(dict(batch_sampler=[[0, 5], [22, 1, 2], [7]]), id="batch-sampler"),
]


@pytest.mark.parametrize("kw", WORKER_GRID)
def test_grid_num_workers_2(kw: dict[str, Any]) -> None:
    expected, got = _run_both(TensorDS(), epochs=2, num_workers=2, **kw)
    assert_same(expected, got)


def test_dict_samples_and_nested_collation() -> None:
    expected, got = _run_both(DictDS(), batch_size=4, shuffle=True, seeded=True)
    assert isinstance(got[0]["name"], list) and isinstance(got[0]["a"], torch.Tensor)
    assert_same(expected, got)


def test_dict_samples_with_workers() -> None:
    expected, got = _run_both(DictDS(), batch_size=5, num_workers=2)
    assert_same(expected, got)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset(num_workers: int) -> None:
    expected, got = _run_both(RangeIterDS(), batch_size=3, num_workers=num_workers)
    assert_same(expected, got)
    assert sorted(int(x) for b in got for x in b) == list(range(11))


def test_iterable_dataset_unbatched_drop_last() -> None:
    expected, got = _run_both(RangeIterDS(), batch_size=None)
    assert_same(expected, got)
    expected, got = _run_both(RangeIterDS(), batch_size=4, drop_last=True)
    assert_same(expected, got)


INVALID = [
    pytest.param(dict(shuffle=True, sampler=[0, 1]), id="shuffle+sampler"),
    pytest.param(dict(batch_sampler=[[0]], batch_size=2), id="batch_sampler+batch_size"),
    pytest.param(dict(batch_sampler=[[0]], drop_last=True), id="batch_sampler+drop_last"),
    pytest.param(dict(batch_size=None, drop_last=True), id="None+drop_last"),
    pytest.param(dict(num_workers=-1), id="num_workers<0"),
    pytest.param(dict(timeout=-1), id="timeout<0"),
    pytest.param(dict(prefetch_factor=2), id="prefetch_factor-no-workers"),
    pytest.param(dict(num_workers=1, prefetch_factor=-1), id="prefetch_factor<0"),
    pytest.param(dict(persistent_workers=True), id="persistent-no-workers"),
    pytest.param(dict(multiprocessing_context="spawn"), id="mp-context-no-workers"),
    pytest.param(dict(num_workers=1, multiprocessing_context="nope"), id="mp-context-bad"),
    pytest.param(dict(num_workers=1, multiprocessing_context=3), id="mp-context-type"),
]


@pytest.mark.parametrize("kw", INVALID)
def test_invalid_combinations_raise_like_torch(kw: dict[str, Any]) -> None:
    with pytest.raises(Exception) as theirs:
        tud.DataLoader(TensorDS(), **kw)
    with pytest.raises(Exception) as ours:
        DataLoader(TensorDS(), **kw)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "kw",
    [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])],
    ids=["shuffle", "sampler", "batch_sampler"],
)
def test_invalid_iterable_combinations_raise_like_torch(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as theirs:
        tud.DataLoader(RangeIterDS(), **kw)
    with pytest.raises(ValueError) as ours:
        DataLoader(RangeIterDS(), **kw)
    assert str(ours.value) == str(theirs.value)


def test_setting_frozen_attributes_raises_like_torch() -> None:
    for cls in (tud.DataLoader, DataLoader):
        loader = cls(TensorDS(), batch_size=2)
        with pytest.raises(ValueError, match="batch_size attribute should not be set"):
            loader.batch_size = 3


@pytest.mark.parametrize(
    "dataset,kw",
    [
        (TensorDS(23), dict(batch_size=7)),
        (TensorDS(23), dict(batch_size=7, drop_last=True)),
        (TensorDS(23), dict(batch_size=None)),
        (TensorDS(23), dict(batch_sampler=[[0], [1, 2]])),
        (RangeIterDS(11), dict(batch_size=4)),
        (RangeIterDS(11), dict(batch_size=4, drop_last=True)),
    ],
)
def test_len_matches_torch(dataset: Any, kw: dict[str, Any]) -> None:
    assert len(DataLoader(dataset, **kw)) == len(tud.DataLoader(dataset, **kw))
    assert len(iter(DataLoader(dataset, **kw))) == len(DataLoader(dataset, **kw))


@pytest.mark.parametrize("device", [None, "cpu"])
def test_rng_interleaving_num_workers_0(device: str | None) -> None:
    """Dataset and loop both draw from the global RNG: identical sequences and batches."""

    def trace(cls: Any, **extra: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(7)
        loader = cls(RandomDS(), batch_size=3, shuffle=True, **extra)
        batches, draws = [], []
        for _ in range(2):
            for b in loader:
                batches.append(b)
                draws.append(torch.rand(1))  # the "model" draws (dropout) between batches
        draws.append(torch.rand(4))  # and the global stream ends in the same state
        return batches, draws

    extra = {} if device is None else {"device": device}
    assert_same(trace(tud.DataLoader), trace(DataLoader, **extra))


def test_getitem_runs_in_calling_thread_inside_next() -> None:
    events: list[str] = []

    class Spy(TensorDS):
        def __getitem__(self, i: int) -> Any:
            events.append(f"get{i}:{threading.current_thread().name}")
            return super().__getitem__(i)

    it = iter(DataLoader(Spy(4), batch_size=2, device="cpu"))
    assert events == []  # nothing is read before the first next()
    next(it)
    me = threading.current_thread().name
    assert events == [f"get0:{me}", f"get1:{me}"]


# -- the read_batch hook ---------------------------------------------------------------


def test_read_batch_hook_equals_torch_and_skips_getitem() -> None:
    ds = ReadBatchDS(41)
    expected = list(tud.DataLoader(TensorDS(41), batch_size=8, shuffle=True, generator=_gen()))
    got = list(DataLoader(ds, batch_size=8, shuffle=True, generator=_gen(), read_threads=3))
    assert_same(expected, got)
    assert ds.getitem_calls == 0
    assert sorted(ds.read_indices) == list(range(41))
    assert ds.read_batch_calls >= 2  # batches of 8 read in groups of GROUP_SAMPLES (32) samples: 41 take two or more
    assert all(name.startswith("fastload-read") for name in ds.threads)


def test_read_batch_disabled_by_read_threads_0() -> None:
    ds = ReadBatchDS(10)
    got = list(DataLoader(ds, batch_size=4, read_threads=0))
    assert_same(list(tud.DataLoader(TensorDS(10), batch_size=4)), got)
    assert (ds.getitem_calls, ds.read_batch_calls) == (10, 0)


def test_read_batch_unbatched_and_with_workers() -> None:
    ds = ReadBatchDS(6)
    assert_same(
        list(tud.DataLoader(TensorDS(6), batch_size=None)), list(DataLoader(ds, batch_size=None))
    )
    ds2 = ReadBatchDS(6)
    got = list(DataLoader(ds2, batch_size=2, num_workers=2))
    assert_same(list(tud.DataLoader(TensorDS(6), batch_size=2)), got)
    assert ds2.read_batch_calls == 0  # workers use torch's own fetcher


def test_read_ahead_opt_in_for_plain_dataset() -> None:
    ds = CountingDS(20)
    it = iter(DataLoader(ds, batch_size=4, read_ahead=2, read_threads=2))
    first = next(it)
    deadline = time.monotonic() + 5
    while len(ds.reads) < 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ds.reads) == 12  # this batch plus two read ahead, and no more
    rest = list(it)
    assert_same(list(tud.DataLoader(TensorDS(20), batch_size=4)), [first, *rest])


class _Boom(ReadBatchDS):
    def read_batch(self, indices: list[int]) -> list[Any]:
        if 5 in indices:
            raise KeyError(f"no sample {indices}")
        return super().read_batch(indices)


def test_read_batch_error_reraised_with_original_traceback() -> None:
    it = iter(DataLoader(_Boom(12), batch_size=4, read_threads=2))
    assert next(it)[1].tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="no sample") as info:
        next(it)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "read_batch" in frames
    assert next(it)[1].tolist() == [8 % 5, 9 % 5, 10 % 5, 11 % 5]  # later batches still come


def test_read_batch_wrong_length_is_loader_error() -> None:
    class Short(ReadBatchDS):
        def read_batch(self, indices: list[int]) -> list[Any]:
            return super().read_batch(indices)[:-1]

    with pytest.raises(LoaderError, match="returned 1 samples for 2 indices"):
        next(iter(DataLoader(Short(4), batch_size=2, read_threads=1)))


def test_hanging_read_batch_times_out() -> None:
    release = threading.Event()

    class Hang(ReadBatchDS):
        def read_batch(self, indices: list[int]) -> list[Any]:
            release.wait(10)
            return super().read_batch(indices)

    t0 = time.monotonic()
    with pytest.raises(LoaderError, match="timeout=0.3"):
        next(iter(DataLoader(Hang(4), batch_size=2, timeout=0.3)))
    assert time.monotonic() - t0 < 3
    release.set()


# -- fastload arguments ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(rank=0), "only apply with distributed=True"),
        (dict(distributed=True), "needs rank= and world_size="),
        (dict(distributed=True, rank=0, world_size=2, sampler=[0]), "not both"),
        (dict(distributed=True, rank=2, world_size=2), "rank=2 is outside"),
        (dict(prefetch_to_device=0), "prefetch_to_device=0"),
        (dict(read_threads=-1), "read_threads=-1"),
        (dict(device="cuda:0" if not torch.cuda.is_available() else "meta"), "device="),
    ],
)
def test_fastload_argument_errors(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DataLoader(TensorDS(), **kw)


def test_distributed_rejects_iterable_dataset() -> None:
    with pytest.raises(ConfigError, match="IterableDataset"):
        DataLoader(RangeIterDS(), distributed=True, rank=0, world_size=2)


def test_distributed_shards_are_disjoint_and_cover() -> None:
    shards = []
    for rank in range(3):
        loader = DataLoader(
            TensorDS(24), batch_size=5, shuffle=True, distributed=True, rank=rank, world_size=3
        )
        assert len(loader) == 2  # 8 samples per rank
        shards.append([int(v) for b in loader for v in (b[0][:, 0] / 10)])
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(24))


def test_seed_seeds_a_private_generator() -> None:
    a = [b[1].tolist() for b in DataLoader(TensorDS(), batch_size=5, shuffle=True, seed=3)]
    b = [b[1].tolist() for b in DataLoader(TensorDS(), batch_size=5, shuffle=True, seed=3)]
    c = [
        x[1].tolist()
        for x in tud.DataLoader(TensorDS(), batch_size=5, shuffle=True, generator=_gen(3))
    ]
    assert a == b == c


def test_workers_leave_collate_fn_alone_and_batches_pin_through() -> None:
    from torch.utils.data._utils.pin_memory import pin_memory

    from fastload.loader.worker_stats import WorkerBatch

    loader = DataLoader(TensorDS(), batch_size=5, num_workers=2, collate_fn=_collate_sum)
    list(loader)
    assert loader.collate_fn is _collate_sum  # swapped only while torch builds its iterator
    # torch's pin_memory thread calls pin_memory() on what a worker sent: the wrapper
    # must survive it, with the batch inside pinned by torch's own rules.
    wb = pin_memory(WorkerBatch({"x": [1, 2], "s": "a"}, ((("fetch", 1, 2, 0.5),), (), None)))
    assert type(wb) is WorkerBatch and wb.batch == {"x": [1, 2], "s": "a"}
    assert wb.delta == ((("fetch", 1, 2, 0.5),), (), None)
