"""`fastload cache` says what happened: an honest progress bar over HTTP, and --verify's counts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastload.cache import Cache
from fastload.cli import main as cli_main
from fastload.config import Settings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _files(root: Path, n: int) -> dict[str, bytes]:
    files = {}
    for k in range(n):
        rel = f"d{k % 4}/f{k:03d}.bin"
        # A few objects of several 64 KiB blocks: an item is done only when all its blocks are.
        files[rel] = os.urandom(150_000 if k % 10 == 0 else 3_000 + k)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(files[rel])
    return files


def test_progress_over_http_counts_items_against_their_known_number(
    tmp_path: Path, nginx_server: Callable[..., Any]
) -> None:
    n = 60
    _files(tmp_path / "www", n)
    server = nginx_server(tmp_path / "www")
    # A real `fastload` process, with every update drawn (tqdm reads TQDM_* when imported).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1"}
    done = subprocess.run([sys.executable, "-m", "fastload", "cache", server.url + "/", "--cache-dir", str(tmp_path / "c"),
                           "--block-size", "64KiB", "--progress"], env=env, capture_output=True, text=True, timeout=120)
    err = done.stderr
    assert done.returncode == 0, err
    frames = [f for f in re.split(r"[\r\n]", err) if f.startswith("staging")]
    assert len(frames) > 3, err
    for frame in frames:
        # The HTTP listing has no sizes: the bar is "done/total items", its percentage theirs.
        match = re.search(r"(\d+)%\|.*\| (\d+)/(\d+) ", frame)
        assert match, frame
        pct, done, total = map(int, match.groups())
        assert total == n and abs(pct - 100 * done / total) <= 0.5 and (pct < 100 or done == total), frame
    assert re.search(rf"100%\|.*\| {n}/{n} .*MB", frames[-1]), frames[-1]  # bytes, as a count


def test_verify_says_all_is_well_and_refetched_entries_add_up(
    tmp_path: Path, nginx_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    files = _files(tmp_path / "www", 20)
    server = nginx_server(tmp_path / "www")
    argv = ["cache", server.url + "/", "--cache-dir", str(tmp_path / "c"), "--block-size", "64KiB", "--no-progress"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    entries = 20 + 2 * 2  # two objects of three blocks
    assert cli_main([*argv, "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"verify      {entries} entries checked, 0 bad" in out, out

    cache = Cache(Settings(cache_dir=tmp_path / "c"))
    for entry in list(cache.entries())[:2]:  # bit rot in two payloads: the last byte of each, in its file or pack
        with open(cache.data_dir / entry.path, "r+b") as f:
            f.seek((entry.offset or 0) + entry.stored - 1)
            last = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([last ^ 0xFF]))
    cache.close()
    assert cli_main([*argv, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "fetched     2 entries, " in out and f"(skipped {entries - 2} already cached)" in out, out
    assert f"verify      {entries} entries checked, 2 bad, dropped and refetched" in out, out
    cache = Cache(Settings(cache_dir=tmp_path / "c"))  # refetched for real, not only counted
    stored = list(cache.entries())
    assert len(stored) == entries and all(cache.get(e.key) is not None for e in stored)
    cache.close()
    assert len(files) == 20
