"""Area 6: 4 processes x 2 workers share one cache whose limit is below the dataset size."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import FAULTS
from helpers import PYTHON, child_env, make_noise_files, payload_bytes

from fastload import codec
from fastload.cache import Cache
from fastload.config import Settings

pytestmark = pytest.mark.integration

CHILD = Path(__file__).with_name("train_child.py")
N, SIZE = 200, 20_000
LIMIT = 1_000_000  # a quarter of the dataset
BLOCK = SIZE + codec.HEADER_BYTES + 2 + codec.LINE - 1  # the one payload size here: one item, stored raw, meta "{}" and at most 63 B of line padding
PAGE = 4096


def tmpfs_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class DiskMonitor(threading.Thread):
    """Samples the payload bytes on disk every few milliseconds; keeps the maximum.

    With root, the payloads (data/ and tmp/) sit alone on a tmpfs whose used
    bytes one statvfs() reads atomically; the index lives on a second tmpfs.
    Without root it sums file sizes, a scan that files can race.
    """

    def __init__(self, cache_dir: Path, exact: bool) -> None:
        super().__init__(daemon=True)
        self.cache_dir, self.exact = cache_dir, exact
        self.peak = 0
        self.samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            used = tmpfs_used(self.cache_dir) if self.exact else payload_bytes(self.cache_dir)
            self.peak = max(self.peak, used)
            self.samples += 1
            time.sleep(0.001)


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_four_processes_with_two_workers_share_a_small_cache(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], record: Callable[..., None],
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    fault = FAULTS["concurrency"]
    exact = os.geteuid() == 0
    mount = request.getfixturevalue("tmpfs") if exact else None
    # At most this many payloads fit under limit + one block; on tmpfs each takes whole pages.
    # Packed payloads (64 B offsets) share pages: each pack's live run of entries may hold
    # two pages only partly its own, and each of the 4 x 3 processes may write a pack.
    files_max = (LIMIT + BLOCK) // BLOCK
    shared = 2 * PAGE * 4 * 3
    bound = files_max * (-(-BLOCK // PAGE) * PAGE) + shared if exact else LIMIT + BLOCK + shared
    trials = fault.trials_full if variant == "full" else fault.trials_short
    make_noise_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    peaks, walls = [], []
    for trial in range(trials):
        if mount is not None:
            cache_dir = mount(8 * 1024**2)
            mount(64 * 1024**2, at=cache_dir / "index")
        else:
            cache_dir = tmp_path / f"cache{trial}"
        Cache(Settings(cache_dir=cache_dir)).close()
        monitor = DiskMonitor(cache_dir, exact)
        monitor.start()
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(
                [PYTHON, str(CHILD), "--url", server.url + "/", "--cache-dir", str(cache_dir), "--size", str(SIZE),
                 "--noise", "--workers", "2", "--batch", "4", "--epochs", "2", "--limit", str(LIMIT),
                 "--block", "64KiB", "--seed", str(p), "--timeout", "60"],
                env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            for p in range(4)
        ]
        try:
            # A deadlock would show as a process still running at this deadline.
            outs = [p.communicate(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            monitor.stop.set()
            monitor.join()
        walls.append(time.monotonic() - t0)
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
            epochs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            assert [(e["samples"], e["bad"]) for e in epochs] == [(N, 0), (N, 0)], epochs
        assert monitor.samples > 50
        peaks.append(monitor.peak)
        assert monitor.peak <= bound, f"payload bytes peaked at {monitor.peak}, limit {LIMIT} + one block {BLOCK} + shared pages: {bound}"
        cache = Cache(Settings(cache_dir=cache_dir, cache_limit_bytes=LIMIT))
        assert cache.volume() == sum(e.charged for e in cache.entries()) <= LIMIT
        cache.close()
    record(
        "concurrency", trials,
        f"pass: 4 x 2 epochs of {N} items bit-exact per run; payload bytes peaked at "
        f"{max(peaks) / LIMIT:.0%} of the limit (bound: limit + one {BLOCK} B block); runs took "
        f"{', '.join(f'{w:.0f}' for w in walls)} s",
        peaks=peaks, limit=LIMIT, block=BLOCK,
    )  # fmt: skip
