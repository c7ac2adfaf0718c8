"""Area 5: the cache disk fills up (a small tmpfs, mounted as root, holds the cache)."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import FAULTS
from helpers import make_noise_files, payload_files

import fastload
from fastload.cache import Cache
from fastload.cli import main as cli_main
from fastload.config import Settings
from fastload.errors import CacheFullError

pytestmark = pytest.mark.integration

N, SIZE = 200, 30_000  # 6 MB of incompressible data
DISK = 3 * 1024**2  # the tmpfs; the cache limit (1 GB) is far above it


def train(url: str, settings: Settings, files: dict[str, bytes], epochs: int) -> int:
    ds = fastload.FileDataset(url, settings=settings)
    root = ds.reader.manifest_root(url) + "/"
    loader = fastload.DataLoader(ds, batch_size=10, shuffle=True, collate_fn=lambda b: b, seed=1)
    n = 0
    for _ in range(epochs):
        for batch in loader:
            for sample in batch:
                assert sample["data"] == files[sample["url"][len(root) :]], sample["url"]
                n += 1
    return n


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_full_disk_streams_training_and_fails_staging_clearly(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], tmpfs: Callable[..., Path],
    record: Callable[..., None], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    fault = FAULTS["disk-full"]
    trials = fault.trials_full if variant == "full" else fault.trials_short
    files = make_noise_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    url = server.url + "/"
    cached = []
    for _ in range(trials):
        disk = tmpfs(DISK)
        settings = Settings(cache_dir=disk / "cache", block_bytes=64 * 1024, cache_limit_bytes=10**9)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastload"):
            assert train(url, settings, files, epochs=2) == 2 * N  # every byte right, twice
        streaming = [r.getMessage() for r in caplog.records if "streaming" in r.getMessage()]
        assert len(streaming) == 1, streaming  # warned once, not per item
        assert "is full" in streaming[0] and "fix:" in streaming[0], streaming[0]

        entries = _entries(settings)  # read-only: the disk is full
        assert 0 < len(entries) < N  # it cached what fit, and streamed the rest
        assert {p.name for p in payload_files(settings.cache_dir)} == {Path(e[0]).name for e in entries}  # no orphan
        assert not list(settings.cache_dir.glob("**/*.part"))  # no half-written file
        for rel, stored, *_ in entries:  # no corrupt entry
            assert (settings.cache_dir / "data" / rel).stat().st_size == stored
        cached.append(len(entries))

        # A new process on the full disk cannot open the index: a clear CacheFullError.
        with pytest.raises(CacheFullError, match=r"cache dir .* cannot be created or opened \(database or disk is full\); fix:"):
            Cache(settings)

        # With space again (the tmpfs grown in place), the index opens and every entry is valid.
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        cache = Cache(settings)
        assert all(cache.get(e.key) is not None for e in cache.entries()) and cache.corrupt_count() == 0
        assert cache.check()["bytes"] == sum(e.stored for e in cache.entries())
        cache.close()

        # Staging onto a full disk fails loudly instead of "succeeding" with nothing staged.
        disk2 = tmpfs(DISK)
        capsys.readouterr()
        code = cli_main(["cache", url, "--cache-dir", str(disk2 / "cache"), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 1, err
        assert "fastload cache: error: disk under" in err and "is full while" in err and "fix:" in err, err
        assert server.url in err  # names the item
    record(
        "disk-full", trials,
        f"pass: training read {2 * N} samples bit-exact per run with {', '.join(map(str, cached))} of {N} "
        "items cached and one streaming warning; no corrupt, orphan or temp file; reopening the full "
        "disk and `fastload cache` both end in CacheFullError naming the path, the cause and the fix",
        cached=cached,
    )  # fmt: skip


def _entries(settings: Settings) -> list[tuple[Any, ...]]:
    """Index records, read with sqlite3 directly (diskcache's open writes, and the disk is full)."""
    import pickle
    import sqlite3

    con = sqlite3.connect(f"file:{settings.cache_dir / 'index' / 'cache.db'}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT key, value FROM Cache WHERE key LIKE 'e:%'").fetchall()
    finally:
        con.close()
    # Our own index, written by this test's process: diskcache pickles its values.
    return [tuple(pickle.loads(v)) if isinstance(v, bytes) else tuple(v) for _, v in rows]
