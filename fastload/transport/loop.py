"""Coroutines handed to fsspec's event loop from other threads, many per wake-up.

``asyncio.run_coroutine_threadsafe`` wakes the loop once per coroutine: a write
to its self-pipe and a thread switch, ~50-90 us of the calling thread's time
each. The DataLoader announces 64 objects ahead per batch; started one by one
that cost ~0.1 ms per object on the consumer thread, under the GIL the read
threads need (benchmarks/peers/results/profile.md). :func:`submit_all` starts a
whole list with one wake-up; each coroutine still gets its own future,
cancellable as ``run_coroutine_threadsafe``'s is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any


def submit_all(loop: asyncio.AbstractEventLoop,
               makers: Sequence[Callable[[], Coroutine[Any, Any, Any]]]) -> list[concurrent.futures.Future[Any]]:
    """Run ``maker()`` of each as a task on ``loop`` (from another thread); one future each.

    Cancelling a future cancels its task; a future cancelled before the loop got to
    it never makes its coroutine (tests/unit/test_loop_submit.py).

    Raises:
        RuntimeError: ``loop`` is closed.
    """
    futures: list[concurrent.futures.Future[Any]] = [concurrent.futures.Future() for _ in makers]

    def start() -> None:
        for make, future in zip(makers, futures):
            if future.cancelled():
                continue
            try:
                task = loop.create_task(make())
            except BaseException as err:  # this one's error, not its neighbours' hang
                if future.set_running_or_notify_cancel():
                    future.set_exception(err)
                continue
            task.add_done_callback(functools.partial(_copy_outcome, future))
            future.add_done_callback(functools.partial(_cancel_task, loop, task))

    loop.call_soon_threadsafe(start)
    return futures


def _copy_outcome(future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    # The future stays pending while its task runs, so that cancel() still works on it.
    if task.cancelled():
        future.cancel()
        return
    if not future.set_running_or_notify_cancel():
        return  # cancelled meanwhile
    err = task.exception()
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(task.result())


def _cancel_task(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], future: concurrent.futures.Future[Any]) -> None:
    if future.cancelled() and not task.done():
        with contextlib.suppress(RuntimeError):  # the loop is closed: the task is gone with it
            loop.call_soon_threadsafe(task.cancel)
