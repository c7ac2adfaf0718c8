"""DevicePrefetcher on a CPU device: the same ring, nesting and error logic as on CUDA."""

from __future__ import annotations

import collections
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from _loader_helpers import assert_same
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.device.batch_tree import collect_tensors, rebuild
from fastload.device.prefetch import DevicePrefetcher
from fastload.device.slots import MIN_SLOT_BYTES, HostBackend, Slot, slot_size
from fastload.errors import ConfigError, LoaderError
from fastload.stats import StatsCollector


class Pair(NamedTuple):
    x: torch.Tensor
    y: Any


def _batch(i: int, n: int = 4) -> dict[str, Any]:
    return {
        "img": torch.full((n, 3), i, dtype=torch.uint8),
        "label": torch.arange(n, dtype=torch.int64) + i,
        "meta": ["name", i, None],
        "pair": Pair(torch.tensor(float(i)), "tag"),
        "nested": (torch.zeros(0, 5), [torch.tensor([True, False])]),
        "arr": np.arange(3),
    }


def _tensors(batch: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    collect_tensors(batch, out)
    return out


def test_nested_batch_roundtrip_copies_tensors_keeps_other_leaves() -> None:
    src = [_batch(i) for i in range(5)]
    got = list(DevicePrefetcher(src, "cpu"))
    assert_same(src, got)
    for a, b in zip(src, got):
        assert type(b["pair"]) is Pair and b["pair"].y == "tag"
        assert b["arr"] is a["arr"] and b["meta"][0] == "name"
        for x, y in zip(_tensors(a), _tensors(b)):
            assert y.data_ptr() != x.data_ptr() or x.numel() == 0  # went through the ring
            assert y.is_contiguous()


def test_outputs_survive_slot_reuse() -> None:
    """Earlier batches must not be views of a slot that later batches overwrite."""
    src = [torch.full((64,), i, dtype=torch.float32) for i in range(9)]
    got = list(DevicePrefetcher(src, "cpu", slots=2))
    assert [int(t[0]) for t in got] == list(range(9))
    assert all(torch.equal(t, torch.full((64,), i, dtype=torch.float32)) for i, t in enumerate(got))


@pytest.mark.parametrize("slots", [2, 3])
def test_slots_allocated_once_and_reused(slots: int) -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=slots)
    for _ in range(2):  # two passes share the ring
        out = list(pf.iterate([_batch(i) for i in range(10)]))
        assert len(out) == 10
    assert pf.slot_allocations == slots
    assert pf.copies == 20
    assert pf.pinned is False


def test_slots_grow_when_a_batch_outgrows_them() -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2)
    small = [torch.ones(1000, dtype=torch.uint8)] * 4
    list(pf.iterate(small))
    assert pf.slot_allocations == 2
    cap = pf.slot_capacities
    big = [torch.ones(cap[0] + 1, dtype=torch.uint8)] * 4
    out = list(pf.iterate(big))
    assert all(torch.equal(o, b) for o, b in zip(out, big))
    assert pf.slot_allocations == 4  # each slot grew once
    assert all(c >= cap[0] + 1 for c in pf.slot_capacities)
    list(pf.iterate(small + big))  # fits now: no more allocations
    assert pf.slot_allocations == 4


def test_max_slot_bytes_caps_slots_and_bypasses_larger_batches() -> None:
    col = StatsCollector()
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", max_slot_bytes=4096, collector=col)
    batches = [torch.arange(100), torch.arange(2000), torch.arange(10)]  # 800 B, 16 kB, 80 B
    with pytest.warns(RuntimeWarning, match="max_slot_bytes=4096"):
        out = list(pf.iterate(batches))
    assert all(torch.equal(o, b) for o, b in zip(out, batches))
    assert pf.oversize_batches == 1
    assert col.snapshot().counters["oversize_batch"] == 1
    assert max(pf.slot_capacities) <= 4096


def test_alignment_with_mixed_dtypes_and_noncontiguous_inputs() -> None:
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    batch = [
        torch.tensor([1], dtype=torch.int8),
        base.t(),  # non-contiguous
        torch.tensor(3.5),  # 0-dim
        torch.tensor([1 + 2j], dtype=torch.complex64),
        torch.zeros(0, dtype=torch.int32),
        torch.tensor([True, False, True]),
        base[:, ::3],
    ]
    (out,) = list(DevicePrefetcher([batch], "cpu"))
    assert_same(batch, [t.contiguous() for t in out])


def test_batches_without_tensors_pass_through() -> None:
    src = [["a", 1], {"k": None}, 3]
    assert list(DevicePrefetcher(src, "cpu")) == src


def test_depth_controls_how_far_the_source_is_pulled() -> None:
    pulled: list[int] = []

    def source(n: int) -> Iterator[torch.Tensor]:
        for i in range(n):
            pulled.append(i)
            yield torch.tensor([i])

    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=3)
    it = pf.iterate(source(6), depth=0)
    next(it)
    assert pulled == [0]  # exactly what a plain loop would have pulled
    pulled.clear()
    it = pf.iterate(source(6), depth=2)
    assert int(next(it)) == 0
    assert pulled == [0, 1, 2]
    assert [int(x) for x in it] == [1, 2, 3, 4, 5]


def test_lookahead_is_deprecated_for_depth_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload import config

    monkeypatch.setattr(config, "_warned", set())
    with pytest.warns(FutureWarning, match="'lookahead' is now 'depth'"):
        pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=3, lookahead=1)
    assert pf.depth == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second use is silent
        assert pf.lookahead == 1
        pulled: list[int] = []
        it = pf.iterate((pulled.append(i) or torch.tensor([i]) for i in range(4)), lookahead=2)
        next(it)
        assert pulled == [0, 1, 2]
    with pytest.raises(ConfigError, match="pass depth only"):
        DevicePrefetcher(None, "cpu", slots=3, depth=1, lookahead=1)


class _ProducerError(RuntimeError):
    pass


def _failing_producer(n_ok: int) -> Iterator[torch.Tensor]:
    for i in range(n_ok):
        yield torch.tensor([i])
    raise _ProducerError("disk went away")


@pytest.mark.parametrize("depth", [0, 1])
def test_producer_error_reraised_in_order_with_traceback(depth: int) -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2)
    it = pf.iterate(_failing_producer(3), depth=depth)
    got = [int(next(it)) for _ in range(3)]  # every good batch arrives first
    assert got == [0, 1, 2]
    with pytest.raises(_ProducerError, match="disk went away") as info:
        next(it)
    assert "_failing_producer" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    with pytest.raises(StopIteration):
        next(it)


class _NeverDone(HostBackend):
    """A copy that never completes, as if the device hung."""

    def is_done(self, slot: Slot) -> bool:
        return slot.buf is None


def test_hung_copy_raises_instead_of_hanging() -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2, timeout=0.2)
    pf._backend = _NeverDone(torch.device("cpu"))
    it = pf.iterate([torch.ones(8)] * 5, depth=0)
    next(it), next(it)  # both slots fresh
    t0 = time.monotonic()
    with pytest.raises(LoaderError, match="timeout=0.2"):
        next(it)  # slot 0 is still "copying"
    assert time.monotonic() - t0 < 2


def test_new_pass_supersedes_old_one() -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu")
    old = pf.iterate([torch.ones(2)] * 4)
    next(old)
    new = pf.iterate([torch.zeros(2)] * 3)
    with pytest.raises(LoaderError, match="newer pass"):
        next(old)
    assert len(list(new)) == 3


def test_stage_and_h2d_are_recorded() -> None:
    col = StatsCollector()
    src = [torch.ones(1000, dtype=torch.uint8)] * 3
    list(DevicePrefetcher(src, "cpu", collector=col))
    s = col.snapshot()
    assert s.op("pin").items == 3 and s.op("pin").bytes >= 3000
    # Every copy is recorded, the last ones too (they once waited for a reuse that never came).
    assert s.op("h2d").items == 3 and s.op("h2d").bytes == 3 * 1024


class _LateCopies(HostBackend):
    """Copies that complete only when asked a second time, as on a busy GPU."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.asked: collections.Counter[int] = collections.Counter()

    def is_done(self, slot: Slot) -> bool:
        if not slot.timed_bytes:  # recorded already: nothing in flight
            return True
        self.asked[id(slot)] += 1
        return self.asked[id(slot)] % 2 == 0


@pytest.mark.parametrize("slots,n", [(2, 2), (2, 5), (3, 7)])
def test_pending_copies_are_recorded_at_the_end_of_the_pass(slots: int, n: int) -> None:
    col = StatsCollector()
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=slots, collector=col, depth=0)
    pf._backend = _LateCopies(torch.device("cpu"))
    it = pf.iterate([torch.ones(1000, dtype=torch.uint8)] * n)
    next(it)
    assert col.snapshot().op("h2d").items == 0  # not complete at hand-over: nothing to time yet
    assert len(list(it)) == n - 1
    s = col.snapshot().op("h2d")
    assert s.items == n and s.bytes == n * 1024


def test_copy_seen_complete_at_hand_over_is_recorded_then() -> None:
    col = StatsCollector()
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2, collector=col)
    it = pf.iterate([torch.ones(100, dtype=torch.uint8)] * 4)
    next(it)
    assert col.snapshot().op("h2d").items == 1  # before any slot is reused, before the end


class _NeverDone(HostBackend):
    """Copies that never complete (a hung device)."""

    def is_done(self, slot: Slot) -> bool:
        return not slot.timed_bytes


@pytest.mark.parametrize("stats", [False, True])
def test_the_end_of_a_pass_waits_for_copies_only_to_record_them(stats: bool) -> None:
    col = StatsCollector() if stats else None
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2, depth=0, timeout=0.05, collector=col)
    pf._backend = _NeverDone(torch.device("cpu"))
    it = pf.iterate([torch.ones(100, dtype=torch.uint8)] * 2)  # two slots: no reuse waits
    assert len([next(it), next(it)]) == 2
    if stats:  # recording a copy needs its time, so the end of the pass waits (bounded)
        with pytest.raises(LoaderError, match="did not complete within timeout"):
            next(it)
    else:
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_pass_ended_early_records_its_completed_copies(how: str) -> None:
    col = StatsCollector()
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2, collector=col)
    it = pf.iterate([torch.ones(100, dtype=torch.uint8)] * 5)  # depth 1
    next(it), next(it)  # the third batch is staged and copied, never handed out
    assert col.snapshot().op("h2d").items == 2
    if how == "close":
        it.close()  # type: ignore[attr-defined]
        assert list(it) == []
    else:
        del it
    assert col.snapshot().op("h2d").items == 3  # every copy made is counted
    assert len(list(pf.iterate([torch.ones(8)] * 2))) == 2  # the ring is free for the next pass


class _CountingReleases(HostBackend):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.releases = 0
        self.sizes: list[int] = []

    def alloc(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return super().alloc(nbytes)

    def release_cached(self, timeout: float) -> None:
        self.releases += 1


def test_slots_grow_in_powers_of_two_and_release_the_old_block() -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2)
    backend = _CountingReleases(torch.device("cpu"))
    pf._backend = backend
    list(pf.iterate([torch.ones(1000, dtype=torch.uint8)] * 2))
    assert backend.sizes == [MIN_SLOT_BYTES] * 2 and backend.releases == 0  # first use: nothing to release
    list(pf.iterate([torch.ones(300_000, dtype=torch.uint8)] * 2))
    assert backend.sizes[2:] == [2**19, 2**19] and backend.releases == 2  # one per grown slot
    list(pf.iterate([torch.ones(2**19, dtype=torch.uint8)] * 3))  # an exact power of two fits
    assert len(backend.sizes) == 4 and backend.releases == 2


@pytest.mark.parametrize(
    "need,cap,want",
    [(1, None, MIN_SLOT_BYTES), (MIN_SLOT_BYTES + 1, None, 2 * MIN_SLOT_BYTES), (2**20, None, 2**20),
     (2**20 + 1, 3 * 2**20, 2**21), (5 * 2**20, 6 * 2**20, 6 * 2**20), (5000, 4096, 5000)],
)
def test_slot_size(need: int, cap: int | None, want: int) -> None:
    assert slot_size(need, cap) == want


def test_docstring_examples_run() -> None:
    import doctest

    from fastload.device import slots

    result = doctest.testmod(slots, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(slots=1), "slots=1"),
        (dict(depth=2), "depth=2"),
        (dict(max_slot_bytes=0), "max_slot_bytes=0"),
        (dict(timeout=0), "timeout=0"),
        (dict(device="meta"), "only 'cuda' and 'cpu'"),
    ],
)
def test_config_errors(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"device": "cpu", **kw}
    with pytest.raises(ConfigError, match=match):
        DevicePrefetcher(None, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="is_available"):
        DevicePrefetcher(None, "cuda")
    with pytest.raises(ConfigError, match="iterate"):
        iter(DevicePrefetcher(None, "cpu"))


class _MyDict(collections.OrderedDict):  # a Mapping subclass keeps its type
    pass


def test_container_types_rebuilt_like_torch_pin_memory() -> None:
    batch = (_MyDict(a=torch.ones(1)), collections.defaultdict(int, b=torch.ones(2)), range(3))
    new = rebuild(batch, iter([torch.zeros(1), torch.zeros(2)]))
    assert (
        type(new) is tuple and type(new[0]) is _MyDict and type(new[1]) is collections.defaultdict
    )
    assert torch.equal(new[0]["a"], torch.zeros(1)) and torch.equal(new[1]["b"], torch.zeros(2))
    assert new[2] == [0, 1, 2]  # as torch: a range cannot be rebuilt, so it becomes a list


_dtypes = st.sampled_from(
    [torch.uint8, torch.int16, torch.int64, torch.float16, torch.float32, torch.bool]
)
_leaf = st.one_of(
    st.builds(
        lambda shape, dtype: (torch.arange(int(np.prod(shape))).reshape(shape) % 7).to(dtype),
        st.lists(st.integers(0, 4), max_size=3).map(tuple),
        _dtypes,
    ),
    st.integers(),
    st.text(max_size=3),
    st.none(),
)
_tree = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.tuples(kids, kids),
        st.dictionaries(st.text(min_size=1, max_size=2), kids, max_size=3),
    ),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_tree, min_size=1, max_size=4))
def test_any_nesting_roundtrips(batches: list[Any]) -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cpu", slots=2)
    assert_same(batches, list(pf.iterate(batches)))
    assert pf.slot_allocations <= 2 * len(batches)
