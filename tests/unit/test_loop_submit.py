"""fastload.transport.loop.submit_all: many coroutines handed to a loop thread with one wake-up each call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from fastload.transport.loop import submit_all


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_each_coroutine_gets_its_own_result_or_error_and_the_loop_is_woken_once(
        loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    wakes = []
    real = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: wakes.append(a) or real(*a))

    async def value(k: int) -> int:
        await asyncio.sleep(0.001 * (5 - k))  # finish out of order
        if k == 3:
            raise ValueError("three")
        return k * 10

    futures = submit_all(loop, [lambda k=k: value(k) for k in range(5)])
    assert len(wakes) == 1
    assert [f.result(5) for f in futures[:3]] == [0, 10, 20]
    with pytest.raises(ValueError, match="three"):
        futures[3].result(5)
    assert futures[4].result(5) == 40


def test_cancelling_a_future_cancels_its_task_and_one_cancelled_early_never_starts(loop: asyncio.AbstractEventLoop) -> None:
    started, cancelled = [], threading.Event()
    gate = threading.Event()
    loop.call_soon_threadsafe(gate.wait, 5)  # hold the loop so the second future is cancelled before it starts

    async def slow(k: int) -> None:
        started.append(k)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    first, second = submit_all(loop, [lambda: slow(1), lambda: slow(2)])
    assert second.cancel()
    gate.set()
    while not started:
        threading.Event().wait(0.01)
    assert first.cancel()
    assert cancelled.wait(5)
    assert started == [1]
    with pytest.raises(concurrent.futures.CancelledError):
        first.result(1)


def test_a_coroutine_that_cannot_be_made_fails_alone(loop: asyncio.AbstractEventLoop) -> None:
    async def fine() -> str:
        return "ok"

    def broken() -> Any:
        raise ValueError("no coroutine")

    first, second, third = submit_all(loop, [fine, broken, fine])
    assert first.result(5) == third.result(5) == "ok"
    with pytest.raises(ValueError, match="no coroutine"):
        second.result(5)
