"""Area 2: `fastload cache` killed with SIGKILL mid-run, then rerun; and 4 stagers at once.

(Moved here from tests/integration/ so its kill counts come from the fault registry
and land in docs/reliability.md.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faults import FAULTS
from helpers import count_published, unreferenced_tails

from fastload.cache import Cache
from fastload.config import Settings
from fastload.read.reader import Reader

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
    assert cache.volume() == sum(e.charged for e in entries)
    assert not cache.temp_files()
    assert all(e.offset is not None for e in entries)  # every payload here is packed
    cache.check()  # every writer has exited: their unpublished pack bytes go
    assert not unreferenced_tails(cache)


@pytest.mark.parametrize(
    "kills",
    [
        pytest.param(FAULTS["stage-sigkill"].trials_short, id="short"),
        pytest.param(FAULTS["stage-sigkill"].trials_full, id="full", marks=pytest.mark.slow),
    ],
)
def test_sigkill_mid_staging_then_rerun_leaves_no_bad_entries(
    tmp_path: Path, kills: int, record: Callable[..., None]
) -> None:
    root, cache_dir = tmp_path / "remote", tmp_path / "cache"
    # Room for every kill: a run overshoots its kill point by up to ~10% of the
    # dataset between two polls, and the full count needs 20 runs' worth.
    files = make_dataset(root, n=400 if kills < 10 else 1000, size=64 * 1024 if kills < 10 else 32 * 1024)
    rng = random.Random(11)
    killed_mid_run = trials = 0
    landed: list[int] = []
    for k in range(kills):
        trials += 1
        # Kill at a random point of progress: once a random number of new payloads
        # landed, within this kill's share of what is left, so all `kills` fit in one
        # dataset (the full count, 20, used to run out of dataset after ~13).
        # Progress is counted in the index: payload files include orphans of killed
        # writers, which a rerun's check() deletes, and counting those made a run
        # finish before its kill.
        before = count_published(cache_dir)
        target = before + rng.randint(1, max(1, (len(files) - before) // (2 * (kills - k + 1))))
        proc = subprocess.Popen(
            cli(str(root), "--max-requests", "2", cache_dir=cache_dir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while (
            proc.poll() is None
            and count_published(cache_dir) < target
            and time.monotonic() < deadline
        ):
            time.sleep(0.002)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            killed_mid_run += 1
            landed.append(count_published(cache_dir))
        proc.wait(timeout=30)
        if proc.returncode == 0:
            break  # it finished before we got to kill it
    assert killed_mid_run >= min(kills, 3)
    done = subprocess.run(
        cli(str(root), cache_dir=cache_dir), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert_complete(cache_dir, root, files)
    record(
        "stage-sigkill", trials,
        f"pass: {killed_mid_run} SIGKILLs mid-run (entries published at each kill: "
        f"{', '.join(map(str, landed))} of {len(files)}); after the rerun --verify found 0 bad entries, "
        "all items bit-exact, no temp files",
        killed_mid_run=killed_mid_run, payloads_at_kill=landed,
    )  # fmt: skip


def test_four_processes_staging_the_same_dataset_agree(tmp_path: Path) -> None:
    root, cache_dir = tmp_path / "remote", tmp_path / "cache"
    files = make_dataset(root, n=120, size=32 * 1024)
    procs = [
        subprocess.Popen(
            cli(str(root), "--max-requests", "3", cache_dir=cache_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    assert_complete(cache_dir, root, files)


APPENDER = """
import sys
from fastload.cache import Cache
from fastload.config import Settings
from helpers import content
cache = Cache(Settings(cache_dir=sys.argv[1], pack_max_bytes=1 << 20))
run, i = sys.argv[2], 0
print("ready", flush=True)
while True:  # batches of 16 x 200 KB: each append is one pwrite burst of ~3 MB, then one COMMIT
    batch = [(f"{run}-{i + k}", content(f"{run}-{i + k}", 200_000), f"mem://{run}/{i + k}", 0) for k in range(16)]
    cache.put_many(batch)
    i += 16
"""


def test_sigkill_mid_append_never_serves_a_half_packed_entry(tmp_path: Path) -> None:
    """A writer killed between (or inside) its pack appends and their COMMIT leaves only
    unreferenced bytes: every published entry reads back exact, none counts as corrupt,
    and check() reclaims what the killed writers appended."""
    from helpers import ROOT, child_env, content

    cache_dir = tmp_path / "cache"
    rng = random.Random(5)
    for run in range(5):
        proc = subprocess.Popen([sys.executable, "-c", APPENDER, str(cache_dir), f"r{run}"], env=child_env(
            PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)])), stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        cache = Cache(Settings(cache_dir=cache_dir))
        entries = list(cache.entries())
        assert entries and all(e.offset is not None for e in entries)
        for e in entries:
            assert cache.get(e.key) == content(e.key, 200_000), e
        assert cache.corrupt_count() == 0
        cache.close()
    cache = Cache(Settings(cache_dir=cache_dir))
    report = cache.check()
    assert not unreferenced_tails(cache), report
    assert cache.volume() == sum(e.charged for e in cache.entries())
    assert all(cache.get(e.key) == content(e.key, 200_000) for e in cache.entries())
