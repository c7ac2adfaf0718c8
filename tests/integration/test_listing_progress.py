"""`fastload cache` says how far its listing got while it lists (issue 31: a million objects
listed for tens of seconds in silence)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.config import Settings
from fastload.source.listing import LISTING_PROGRESS


def _tree(root: Path, folders: int, per: int) -> None:
    for f in range(folders):
        (root / f"d{f:02d}").mkdir(parents=True)
        for i in range(per):
            (root / f"d{f:02d}" / f"{i:03d}.bin").write_bytes(os.urandom(100))


def test_staging_shows_a_listing_line_and_a_quiet_stage_shows_none(
    tmp_path: Path, nginx_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    _tree(tmp_path / "www", 6, 5)
    server = nginx_server(tmp_path / "www")
    fastload.stage(server.url + "/", settings=Settings(cache_dir=tmp_path / "c1"), progress=True)
    err = capsys.readouterr().err
    assert f"listing {server.url}" in err and "objects in" in err and "folders" in err
    fastload.stage(server.url + "/", settings=Settings(cache_dir=tmp_path / "c2"), progress=False)
    assert "listing" not in capsys.readouterr().err
    assert LISTING_PROGRESS.get() is None  # reset after the stage


def test_the_listing_reports_every_level_of_folders(tmp_path: Path, nginx_server: Callable[..., Any]) -> None:
    _tree(tmp_path / "www", 4, 3)
    server = nginx_server(tmp_path / "www")
    heard: list[tuple[int, int]] = []
    token = LISTING_PROGRESS.set(lambda files, folders: heard.append((files, folders)))
    try:
        from fastload.read.reader import Reader

        items = Reader(Settings(cache_dir=tmp_path / "c")).sources.lister(server.url + "/").list(None, complete=False)
    finally:
        LISTING_PROGRESS.reset(token)
    assert len(items) == 12
    assert heard[0] == (0, 4) and heard[-1] == (12, 4)  # the root's page: 4 folders; their pages: 12 objects
