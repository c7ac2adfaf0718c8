"""`fastload cache` killed with SIGKILL mid-run, then rerun; and 4 stagers at once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastload.cache import Cache
from fastload.config import Settings
from fastload.reader import Reader

pytestmark = pytest.mark.integration


def make_dataset(root: Path, n: int, size: int) -> dict[str, bytes]:
    rng = random.Random(7)
    root.mkdir(parents=True)
    files = {}
    for i in range(n):
        data = bytes(rng.getrandbits(8) for _ in range(64)) * (size // 64)
        (root / f"{i:04d}.bin").write_bytes(data)
        files[f"{i:04d}.bin"] = data
    return files


def count_payloads(cache_dir: Path) -> int:
    return (
        sum(1 for _ in (cache_dir / "data").glob("*/*.flp")) if (cache_dir / "data").exists() else 0
    )


def cli(*args: str, cache_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fastload",
        "cache",
        *args,
        "--cache-dir",
        str(cache_dir),
        "--no-progress",
    ]


def assert_complete(cache_dir: Path, root: Path, files: dict[str, bytes]) -> None:
    out = subprocess.run(
        cli(str(root), "--verify", "--json", cache_dir=cache_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bad_entries"] == 0 and report["fetched_blocks"] == 0
    assert report["items"] == len(files)
    reader = Reader(Settings(cache_dir=cache_dir))
    for name, data in files.items():
        assert reader.read(str(root / name)) == data
    assert reader.misses == 0
    cache = Cache(Settings(cache_dir=cache_dir))
    entries = list(cache.entries())
    assert len(entries) == len(files)  # no duplicates from racing or resumed writers
    assert cache.volume() == sum(e.stored for e in entries)
    assert not list(cache.tmp_dir.glob("*.part"))


@pytest.mark.parametrize(
    "kills", [pytest.param(5, id="short"), pytest.param(20, id="full", marks=pytest.mark.slow)]
)
def test_sigkill_mid_staging_then_rerun_leaves_no_bad_entries(tmp_path: Path, kills: int) -> None:
    root, cache_dir = tmp_path / "remote", tmp_path / "cache"
    files = make_dataset(root, n=400, size=64 * 1024)
    rng = random.Random(11)
    killed_mid_run = 0
    for _ in range(kills):
        # Kill at a random point of progress: once a random number of new payloads landed.
        before = count_payloads(cache_dir)
        target = before + rng.randint(1, max(1, (len(files) - before) // 3))
        proc = subprocess.Popen(
            cli(str(root), "--workers", "2", cache_dir=cache_dir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while (
            proc.poll() is None
            and count_payloads(cache_dir) < target
            and time.monotonic() < deadline
        ):
            time.sleep(0.002)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            killed_mid_run += 1
        proc.wait(timeout=30)
        if proc.returncode == 0:
            break  # it finished before we got to kill it
    assert killed_mid_run >= min(kills, 3)
    done = subprocess.run(
        cli(str(root), cache_dir=cache_dir), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert_complete(cache_dir, root, files)


def test_four_processes_staging_the_same_dataset_agree(tmp_path: Path) -> None:
    root, cache_dir = tmp_path / "remote", tmp_path / "cache"
    files = make_dataset(root, n=120, size=32 * 1024)
    procs = [
        subprocess.Popen(
            cli(str(root), "--workers", "3", cache_dir=cache_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    assert_complete(cache_dir, root, files)
