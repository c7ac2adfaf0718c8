"""DevicePrefetcher and DataLoader(device='cuda') on a real GPU."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from _loader_helpers import DictDS, TensorDS  # noqa: E402

from fastload.device.prefetch import DevicePrefetcher  # noqa: E402
from fastload.device.torch_compat import empty_host_cache  # noqa: E402
from fastload.loader.dataloader import DataLoader  # noqa: E402
from fastload.stats import StatsCollector  # noqa: E402

pytestmark = pytest.mark.gpu


def _host_allocs() -> int | None:
    torch.cuda.init()  # the host stats are empty before CUDA is initialised
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    value = stats().get("num_host_alloc")
    return None if value is None else int(value)


def _to_cpu(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        assert batch.is_cuda
        return batch.cpu()
    if isinstance(batch, dict):
        return {k: _to_cpu(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_cpu(v) for v in batch)
    return batch


def test_slots_reused_no_new_pinned_allocations_after_warmup() -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=3)
    assert pf.pinned
    batches = [{"x": torch.randn(256, 1024), "y": torch.arange(256)} for _ in range(8)]
    list(pf.iterate(batches[:4]))  # warm-up: slots allocated here
    torch.cuda.synchronize()
    allocs, host = pf.slot_allocations, _host_allocs()
    assert allocs == 3
    for _ in range(5):
        out = list(pf.iterate(batches))
    torch.cuda.synchronize()
    assert pf.slot_allocations == allocs
    if host is not None:
        assert _host_allocs() == host, "a pinned allocation happened after warm-up"
    assert all(torch.equal(o["x"].cpu(), b["x"]) for o, b in zip(out, batches))


def test_copy_runs_on_one_side_stream_without_blocking_the_host() -> None:
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=2)
    side = pf._backend.stream  # type: ignore[attr-defined]
    assert side != torch.cuda.current_stream()
    data = [torch.full((1 << 20,), float(i)) for i in range(4)]
    list(pf.iterate(data[:2]))  # warms both slots: a cold one is pinned (cudaHostAlloc, a sync) in next()
    torch.cuda.synchronize()
    assert pf.slot_allocations == 2
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time queued on the side stream
    t0 = time.perf_counter()
    it = pf.iterate(data, depth=0)
    first = next(it)
    host_s = time.perf_counter() - t0
    assert host_s < 0.05, f"next() blocked the host for {host_s:.3f} s"
    assert not side.query()  # the copy is queued behind the sleep on the side stream
    assert pf._backend.stream is side  # type: ignore[attr-defined]
    assert float(first.sum()) == 0.0  # the consumer stream waited on the copy's event
    assert [float(t[0]) for t in it] == [1.0, 2.0, 3.0]


def _delayed(batches: list[torch.Tensor], seed: int) -> Iterator[torch.Tensor]:
    rng = random.Random(seed)
    for b in batches:
        time.sleep(rng.random() * 0.004)
        yield b


@pytest.mark.parametrize("slots,depth", [(2, 0), (2, 1), (3, 2)])
def test_correct_under_random_producer_delays(slots: int, depth: int) -> None:
    gen = torch.Generator().manual_seed(slots + depth)
    batches = [
        torch.randn(int(torch.randint(1, 64, (1,), generator=gen)), 257, generator=gen)
        for _ in range(40)
    ]
    w = torch.randn(257, 33, device="cuda")
    expected = [(b.cuda() @ w).cpu() for b in batches]
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=slots)
    got = []
    for b in pf.iterate(_delayed(batches, seed=depth), depth=depth):
        got.append(b @ w)  # consumed on the current stream right away
        torch.cuda._sleep(int(random.random() * 2_000_000))  # a step of random length
    assert all(torch.allclose(g.cpu(), e) for g, e in zip(got, expected))


def test_batches_used_on_a_non_default_stream() -> None:
    s = torch.cuda.Stream()
    batches = [torch.full((4096,), float(i)) for i in range(10)]
    with torch.cuda.stream(s):
        pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda")
        sums = [b.sum() for b in pf.iterate(batches)]
    s.synchronize()
    assert [float(x) for x in sums] == [4096.0 * i for i in range(10)]


def _step_for(seconds: float, a: torch.Tensor) -> tuple[int, float]:
    """Matmuls per step so that one step takes about ``seconds`` of GPU time, and the time of one."""
    torch.mm(a, a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) / 20
    return max(1, round(seconds / one)), one


@pytest.mark.parametrize("depth", [0, 2])
def test_overlap_hides_copy_time_behind_compute(depth: int) -> None:
    # Compute is sized to the measured copy time, so that perfect overlap (max) and
    # none (sum) are far apart whatever the link: the bound is max + half of min.
    n, mb = 12, 64
    batches = [torch.randn(mb * 1024 * 256) for _ in range(n)]  # 64 MB each
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # few, long kernels: not launch-bound
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=3)
    for _ in pf.iterate(batches[:3], depth=2):  # warm-up: slots, kernels, clocks
        pass
    torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in pf.iterate(batches, depth=depth):
        pass
    torch.cuda.synchronize()
    t_copy = time.perf_counter() - t0
    reps, _ = _step_for(t_copy / n, a)

    def step(x: torch.Tensor) -> None:
        for _ in range(reps):
            torch.mm(a, a)
        x.add_(1)

    resident = batches[0].cuda()
    t0 = time.perf_counter()
    for _ in range(n):
        step(resident)
    torch.cuda.synchronize()
    t_compute = time.perf_counter() - t0

    t0 = time.perf_counter()
    for x in pf.iterate(batches, depth=depth):
        step(x)
    torch.cuda.synchronize()
    t_both = time.perf_counter() - t0
    longer, shorter = max(t_copy, t_compute), min(t_copy, t_compute)
    print(f"depth {depth}: copy {t_copy:.3f} s, compute {t_compute:.3f} s, overlapped {t_both:.3f} s")
    assert t_both < longer + 0.5 * shorter, (t_copy, t_compute, t_both)


def test_next_copy_runs_while_the_step_still_computes_at_depth_0() -> None:
    # The side stream must not wait for the consumer's queued step: copy N+1 completes
    # while step N (a long sleep on the consumer stream) is still running.
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=2, depth=0)
    batches = [torch.full((1 << 20,), float(i)) for i in range(3)]
    list(pf.iterate(batches))  # warm-up: slots allocated
    torch.cuda.synchronize()
    it = pf.iterate(batches, depth=0)
    first = next(it)
    torch.cuda._sleep(2_000_000_000)  # step N: about a second of GPU time on the consumer stream
    second = next(it)  # pins and copies batch N+1
    copy_done = pf._ring[(pf._next_slot - 1) % pf.slots].done
    consumer = torch.cuda.current_stream()
    while not copy_done.query() and not consumer.query():
        time.sleep(1e-3)
    assert copy_done.query() and not consumer.query(), "copy N+1 waited for step N"
    torch.cuda.synchronize()
    assert float(first[0]) == 0.0 and float(second[0]) == 1.0


def test_dropped_batch_never_lands_in_a_later_tensor() -> None:
    # A batch copied but never handed out (the loop breaks) is freed while its copy
    # is still queued; the consumer's next allocation of that size must not get its
    # block, or the copy would write into it afterwards.
    n = 32 * 2**20
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=2)
    side = pf._backend.stream  # type: ignore[attr-defined]
    list(pf.iterate([torch.zeros(n, dtype=torch.uint8)] * 2))  # slots and blocks allocated first
    torch.cuda.synchronize()

    def source() -> Iterator[torch.Tensor]:
        yield torch.full((n,), 7, dtype=torch.uint8)
        with torch.cuda.stream(side):  # batch 1's copy waits ~0.2 s behind this; batch 0's does not
            torch.cuda._sleep(400_000_000)
        yield torch.full((n,), 9, dtype=torch.uint8)
        yield torch.full((n,), 9, dtype=torch.uint8)

    it = pf.iterate(source(), depth=1)
    first = next(it)  # batch 0 handed out; batch 1 staged, its copy still queued
    del it  # the loop breaks: batch 1's device buffer is freed before its copy ran
    fresh = torch.zeros(n, dtype=torch.uint8, device="cuda")  # same size, on the consumer stream
    torch.cuda.synchronize()
    assert int(fresh.max()) == 0, "a dropped batch's copy wrote into a new tensor"
    assert bool((first == 7).all())


def test_every_copy_reaches_the_stats() -> None:
    col = StatsCollector()
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=2, collector=col)
    out = list(pf.iterate([torch.ones(1 << 20, dtype=torch.uint8)] * 2))
    h2d = col.snapshot().op("h2d")
    assert len(out) == 2 and h2d.items == 2 and h2d.bytes == 2 * (1 << 20) and h2d.seconds > 0


def _pinned_bytes_owned() -> int | None:
    """Bytes of pinned blocks torch's host allocator holds, in use or cached (None: no such stat).

    torch renamed the stat: ``reserved_bytes`` (held) beside ``allocated_bytes`` (in use
    only, which cannot see a stale cached block), later ``allocated_bytes`` (held)
    beside ``active_bytes`` (in use).
    """
    stats: dict[str, Any] = getattr(torch.cuda, "host_memory_stats", dict)()
    key = "allocated_bytes.current" if "active_bytes.current" in stats else "reserved_bytes.current"
    return None if key not in stats else int(stats[key])


def test_grown_slots_leave_no_stale_pinned_block() -> None:
    torch.cuda.init()  # host_memory_stats() is empty until CUDA is initialised (this test alone)
    torch.empty(1, pin_memory=True)  # the host allocator exists, so it has stats
    if _pinned_bytes_owned() is None:
        pytest.skip(f"torch {torch.__version__} has no host stat of the pinned bytes it holds")
    if not empty_host_cache():
        pytest.skip(f"torch {torch.__version__} cannot empty its host cache")
    torch.cuda.synchronize()
    base = cast(int, _pinned_bytes_owned())  # live pinned blocks only: the cache was emptied
    pf: DevicePrefetcher[Any] = DevicePrefetcher(None, "cuda", slots=2)
    for size in (1 << 20, 3 << 20, 9 << 20):  # each pass outgrows both slots
        list(pf.iterate([torch.ones(size, dtype=torch.uint8)] * 2))
        torch.cuda.synchronize()
    assert pf.slot_capacities == [16 << 20, 16 << 20]
    held = cast(int, _pinned_bytes_owned()) - base
    assert held == sum(pf.slot_capacities), f"{held} B pinned for a {sum(pf.slot_capacities)} B ring"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_device_cuda_matches_cpu_loader(num_workers: int) -> None:
    kw = dict(batch_size=5, shuffle=True, num_workers=num_workers)
    expected = list(
        torch.utils.data.DataLoader(DictDS(), generator=torch.Generator().manual_seed(1), **kw)
    )
    loader = DataLoader(DictDS(), generator=torch.Generator().manual_seed(1), device="cuda", **kw)
    got = [_to_cpu(b) for b in loader]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (
            torch.equal(g["x"], e["x"]) and torch.equal(g["a"], e["a"]) and g["name"] == e["name"]
        )
    s = loader.stats()
    assert s.op("h2d").items == len(got) and s.op("h2d").seconds > 0  # the last copies too


def test_dataloader_read_batch_path_on_cuda() -> None:
    class RB(TensorDS):
        def read_batch(self, indices: list[int]) -> list[Any]:
            return [self[i] for i in indices]

    got = [
        _to_cpu(b) for b in DataLoader(RB(40), batch_size=8, device="cuda", prefetch_to_device=3)
    ]
    expected = list(torch.utils.data.DataLoader(TensorDS(40), batch_size=8))
    assert all(torch.equal(g[0], e[0]) and torch.equal(g[1], e[1]) for g, e in zip(got, expected))


@pytest.mark.parametrize("device", [None, "cuda"])
def test_workers_pin_memory_with_stats(device: str | None) -> None:
    # Workers send their stats along with each batch (fastload.loader.worker_stats); torch's
    # pin_memory thread must still pin the batch inside, and device= must get it plain.
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, pin_memory=device is None)
    theirs = list(torch.utils.data.DataLoader(TensorDS(), **kw))
    loader = DataLoader(TensorDS(), device=device, **kw)
    ours = list(loader)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert type(a) is type(b)
        if device is None:
            assert a[0].is_pinned() and torch.equal(a[0], b[0])
        else:
            assert a[0].is_cuda and torch.equal(a[0].cpu(), b[0])
    assert loader.stats().op("collate").items == len(TensorDS())
