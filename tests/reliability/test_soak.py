"""Area 9: many epochs with a cache limit below the dataset: memory, fds and disk stay flat."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import FAULTS
from helpers import PYTHON, child_env, make_noise_files

from fastload import codec

pytestmark = pytest.mark.integration

CHILD = Path(__file__).with_name("train_child.py")
N, SIZE = 150, 20_000
LIMIT = 1_000_000  # a third of the dataset: every epoch evicts and refetches
BLOCK = SIZE + codec.HEADER_BYTES + 2 + codec.LINE - 1  # meta "{}" and at most 63 B of line padding (codec.line_pad)
INDEX_BOUND = 8 * 1024**2  # SQLite db + WAL (checkpointed every 1000 pages, 4 MiB)
FD_SLACK = 12  # 8 read-ahead threads may still hold their connections at the sample, plus keep-alive sockets; a leak is +16 per epoch


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_soak_with_a_small_cache_limit(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], record: Callable[..., None]
) -> None:
    epochs = FAULTS["soak"].trials_full if variant == "full" else FAULTS["soak"].trials_short
    make_noise_files(tmp_path / "www", N, SIZE)
    server = nginx_server(tmp_path / "www")
    cmd = [PYTHON, str(CHILD), "--url", server.url + "/", "--cache-dir", str(tmp_path / "cache"), "--size", str(SIZE),
           "--noise", "--epochs", str(epochs), "--limit", str(LIMIT), "--block", "64KiB"]  # fmt: skip
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=60 + 20 * epochs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["samples"], r["bad"]) for r in rows] == [(N, 0)] * epochs
    rss = [r["rss"] for r in rows]
    fds = [r["fds"] for r in rows]
    base_rss, base_fds = rss[1], fds[1]  # after epoch 2: imports, pools and caches are warm
    growth = max(rss[2:]) / base_rss - 1
    assert growth < 0.05, f"RSS grew {growth:.1%} after epoch 2: {rss}"
    assert max(fds[1:]) - base_fds <= FD_SLACK, f"open fds grew: {fds}"
    assert all(r["payload_bytes"] <= LIMIT + BLOCK for r in rows), [r["payload_bytes"] for r in rows]
    assert all(r["cache_dir_bytes"] <= LIMIT + BLOCK + INDEX_BOUND for r in rows), [r["cache_dir_bytes"] for r in rows]
    assert all(r["corrupt"] == 0 for r in rows)
    record(
        "soak", epochs,
        f"pass: {epochs} epochs of {N} items bit-exact; RSS {base_rss / 1e6:.0f} MB after epoch 2, max growth "
        f"{growth:+.1%}; open fds {min(fds[1:])}-{max(fds[1:])}; payload bytes <= "
        f"{max(r['payload_bytes'] for r in rows) / LIMIT:.0%} of the limit; cache dir <= "
        f"{max(r['cache_dir_bytes'] for r in rows) / 1e6:.1f} MB",
        rss=rss, fds=fds, payload_bytes=[r["payload_bytes"] for r in rows],
        cache_dir_bytes=[r["cache_dir_bytes"] for r in rows],
    )  # fmt: skip
