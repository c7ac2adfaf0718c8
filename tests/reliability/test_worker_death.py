"""Area 7: a DataLoader worker dies; the remote under the read-ahead threads dies or stalls."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from faults import FAULTS
from helpers import make_files

import fastload
from fastload.config import Settings
from fastload.errors import LoaderError, SourceError

pytestmark = pytest.mark.integration


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def slow(data: bytes) -> bytes:
    time.sleep(0.02)  # keeps the epoch running while the test kills a worker
    return data


def worker_pids(exclude: set[int]) -> list[int]:
    me = psutil.Process()
    return [c.pid for c in me.children() if c.pid not in exclude and c.exe() == psutil.Process().exe()]


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_killed_worker_is_a_clear_error_within_seconds(
    variant: str, tmp_path: Path, record: Callable[..., None]
) -> None:
    trials = FAULTS["worker-sigkill"].trials_full if variant == "full" else FAULTS["worker-sigkill"].trials_short
    make_files(tmp_path / "data", 400, 4000)
    settings = Settings(cache_dir=tmp_path / "cache")
    ds = fastload.FileDataset(str(tmp_path / "data"), transform=slow, settings=settings)
    waits = []
    for trial in range(trials):
        before = {c.pid for c in psutil.Process().children()}
        loader = fastload.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=as_list, timeout=60)
        it = iter(loader)
        next(it)
        victims = worker_pids(before)
        assert len(victims) == 2, victims
        t0 = time.monotonic()
        # torch's SIGCHLD handler may raise as soon as the worker dies, so the kill
        # sits inside the raises block too.
        with pytest.raises(RuntimeError) as info:
            os.kill(victims[trial % 2], signal.SIGKILL)
            for _ in range(10_000):
                next(it)
        waits.append(time.monotonic() - t0)
        msg = str(info.value)
        assert f"pid {victims[trial % 2]}" in msg or str(victims[trial % 2]) in msg, msg
        assert "killed by signal" in msg or "exited unexpectedly" in msg, msg
        assert waits[-1] < 15, waits  # torch checks worker liveness every 5 s at most
        del info, it, loader
        gc.collect()
    record(
        "worker-sigkill", trials,
        f"pass: RuntimeError naming the worker pid and the signal {min(waits):.2f}-{max(waits):.2f} s after each kill",
        waits=[round(w, 3) for w in waits],
    )  # fmt: skip


MODES = [("dead", 0), ("stall", 0), ("dead", 2), ("stall", 2)]


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_remote_dying_or_stalling_under_the_loader_is_a_clear_error(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], record: Callable[..., None], fast_worker_shutdown: None
) -> None:
    trials = FAULTS["source-dies"].trials_full if variant == "full" else FAULTS["source-dies"].trials_short
    # More objects than the loader fetches ahead (fastload.fetch.AHEAD_FLIGHTS): with 300, libcurl's
    # GETs had fetched every one by the second batch, and the kill met an epoch with nothing left to fetch.
    make_files(tmp_path / "www", 1500, 4000)
    rows = []
    for trial in range(trials):
        mode, workers = MODES[trial % len(MODES)]
        server = nginx_server(tmp_path / "www")
        url = server.url + "/"
        settings = Settings(
            cache_dir=tmp_path / f"cache{trial}", retries=3, backoff_s=0.05,
            request_timeout_s=1.0 if mode == "dead" else 60.0,
        )  # fmt: skip
        ds = fastload.FileDataset(url, settings=settings)
        # timeout= bounds each batch: read-ahead threads (num_workers=0) or torch workers.
        loader = fastload.DataLoader(
            ds, batch_size=4, num_workers=workers, collate_fn=as_list, device="cpu", timeout=3,
        )  # fmt: skip
        it = iter(loader)
        next(it)
        next(it)
        nginx = psutil.Process(server.pid)
        group = [nginx, *nginx.children()]
        t0 = time.monotonic()
        try:
            if mode == "dead":
                os.killpg(server.pid, signal.SIGKILL)
            else:
                os.killpg(server.pid, signal.SIGSTOP)
            with pytest.raises((SourceError, LoaderError, RuntimeError)) as info:
                for _ in range(1000):
                    next(it)
            took = time.monotonic() - t0
        finally:
            if mode == "stall":
                for p in group:
                    p.send_signal(signal.SIGCONT)
        msg = str(info.value)
        if mode == "dead":
            # The original error, from a thread or re-raised from a worker by torch.
            assert isinstance(info.value, SourceError), repr(info.value)
            assert server.url in msg and "failed after 3 attempts" in msg and "fix:" in msg, msg
            assert took < 3 * 1.0 + 3 * 0.1 + 5, took
        elif workers == 0:
            assert isinstance(info.value, LoaderError), repr(info.value)
            assert "did not return within timeout=3" in msg and "Raise timeout=" in msg, msg
            assert took < 3 + 2, took
        else:
            assert "timed out after 3 seconds" in msg, msg
            assert took < 3 + 2, took
        rows.append({"mode": mode, "workers": workers, "error": type(info.value).__name__, "seconds": round(took, 2)})
        # The traceback keeps the failed iterator, its read-ahead threads or workers
        # alive in a cycle; end them now, not in some later test's gc pass.
        del info, it, loader
        gc.collect()
        server.stop()
    record(
        "source-dies", trials,
        "pass: " + "; ".join(
            f"{r['mode']} remote, {'threads' if r['workers'] == 0 else str(r['workers']) + ' workers'}: "
            f"{r['error']} after {r['seconds']:.1f} s" for r in rows
        ),
        rows=rows,
    )  # fmt: skip

