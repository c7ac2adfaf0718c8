"""Area 3: a training process filling the cache is SIGKILLed; a new run reuses what is valid."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import FAULTS
from helpers import PYTHON, child_env, count_published, make_files, unreferenced_tails

from fastload.cache import Cache
from fastload.config import Settings

pytestmark = pytest.mark.integration

CHILD = Path(__file__).with_name("train_child.py")
N, SIZE = 240, 32_000


def shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


def gets(server: Any) -> int:
    log = server.workdir / "access.log"
    # Object GETs only: a run killed before its listing was recorded lists again (folder pages).
    return sum(1 for line in log.read_text().splitlines() if '"GET /class_' in line and '.bin HTTP' in line) if log.exists() else 0


def train(url: str, cache_dir: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [PYTHON, str(CHILD), "--url", url, "--cache-dir", str(cache_dir), "--size", str(SIZE),
           "--workers", "2", "--batch", "4", "--block", "64KiB", *extra]  # fmt: skip
    # Its own session: the kill takes the trainer and its workers at once, as a
    # scheduler's SIGKILL of a job would.
    return subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_sigkilled_training_leaves_a_cache_the_next_run_reuses(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], record: Callable[..., None]
) -> None:
    fault = FAULTS["train-sigkill"]
    trials = fault.trials_full if variant == "full" else fault.trials_short
    make_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    rng = random.Random(3)
    rows = []
    for trial in range(trials):
        cache_dir = tmp_path / f"cache{trial}"
        shm_before = shm_names()
        target = rng.randint(N // 10, N * 2 // 3)
        first = train(server.url + "/", cache_dir)
        deadline = time.monotonic() + 120
        while first.poll() is None and count_published(cache_dir) < target and time.monotonic() < deadline:
            time.sleep(0.005)
        assert first.poll() is None, f"the first run ended before the kill: {first.communicate()[1][-2000:]}"
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate(timeout=30)
        # Give orphaned workers (if any escaped the group) no chance to keep writing.
        time.sleep(0.2)

        cache = Cache(Settings(cache_dir=cache_dir))
        valid = sum(1 for e in cache.entries() if cache.contains(e.key))
        leftover_tmp = sorted(p.name for p in cache.temp_files())
        cache.close()
        before = gets(server)
        t0 = time.monotonic()
        second = train(server.url + "/", cache_dir)
        out, err = second.communicate(timeout=180)
        took = time.monotonic() - t0
        assert second.returncode == 0, err[-3000:]
        epoch = json.loads(out.strip().splitlines()[-1])
        assert epoch["samples"] == N and epoch["bad"] == 0
        refetched = gets(server) - before
        # Every valid entry was reused; only what was missing crossed the link again.
        assert refetched == N - valid, (refetched, N, valid)

        # Nothing left blocks a third run: the eviction lock is free, the index takes
        # writes at once, and no fastload shared-memory name survived.
        cache = Cache(Settings(cache_dir=cache_dir))
        fd = os.open(cache.root / "evict.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        cache.index.set("probe", 1)
        new_shm = shm_names() - shm_before
        assert not [n for n in new_shm if "fastload" in n], new_shm
        # Temp files can only be the killed run's (the second run finished its
        # writes); `check()`, which every `fastload cache` runs, removes them.
        assert {p.name for p in cache.temp_files()} <= set(leftover_tmp)
        repaired = cache.check()
        assert not cache.temp_files()
        assert repaired["bytes"] == sum(e.charged for e in cache.entries())
        # The killed workers' packs: what they appended but never published is reclaimed.
        assert any(e.offset is not None for e in cache.entries())  # small payloads were packed
        assert not unreferenced_tails(cache)
        cache.close()
        rows.append({"killed_at_payloads": target, "valid_reused": valid, "refetched": refetched,
                     "tmp_left": len(leftover_tmp), "rerun_s": round(took, 1)})  # fmt: skip
    record(
        "train-sigkill", trials,
        "pass: " + "; ".join(
            f"killed with {r['valid_reused']}/{N} cached, rerun reused all {r['valid_reused']} and refetched {r['refetched']}"
            for r in rows
        ) + f"; {sum(r['tmp_left'] for r in rows)} temp file(s) of killed writers, removed by check(); no lock or shm name left",
        trials_detail=rows,
    )  # fmt: skip
