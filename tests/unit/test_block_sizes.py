"""A dataset staged with one block size and read, listed and cleared with another.

Staged with ``--block-size``, a dataset read with the default had a hit rate of 0 and was
stored twice; `fastload info` showed 0/800 and `fastload clear URL` cleared 0 entries
(issue 24, item 5).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

import fastload
from fastload.cache import Cache
from fastload.cli import main
from fastload.config import Settings

SMALL, LARGE = 20, 3
BLOCK = 64 * 1024  # staged with this; read with the default (8 MiB)


@pytest.fixture()
def folder(tmp_path: Path) -> dict[str, bytes]:
    files = {f"s{i:02d}.bin": os.urandom(10_000) for i in range(SMALL)}  # one block under either size
    files |= {f"l{i}.bin": os.urandom(200_000) for i in range(LARGE)}  # 4 blocks of 64 KiB, or one of 8 MiB
    for rel, data in files.items():
        (tmp_path / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / rel).write_bytes(data)
    return files


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_another_block_size_reads_what_it_can_says_why_once_and_info_and_clear_see_both(
    folder: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    url, cache_dir = str(tmp_path / "data"), str(tmp_path / "cache")
    staged = _cli(capsys, "cache", url, "--block-size", "64KiB", "--cache-dir", cache_dir, "--no-progress")
    assert staged["fetched_blocks"] == SMALL + LARGE * 4

    with caplog.at_level(logging.WARNING, logger="fastload"):
        ds = fastload.FileDataset(url, settings=Settings(cache_dir=Path(cache_dir)))  # the default block size
        for i in range(len(ds)):
            sample = ds[i]
            assert sample["data"] == folder[Path(sample["url"]).name]
        for i in range(len(ds)):
            ds[i]  # noqa: B018 - a second pass: the warning is not repeated
    # The small objects are the same bytes under any block size: hits. The large ones are refetched.
    assert (ds.reader.hits, ds.reader.misses) == (2 * SMALL + LARGE, LARGE)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert f"{LARGE} of the {SMALL + LARGE} objects" in said[0] and "blocks of 65.5 KB" in said[0], said[0]
    assert "fetched again" in said[0] and f"FASTLOAD_BLOCK_SIZE={BLOCK}" in said[0], said[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastload"):  # a later reader finds both copies: nothing to say
        later = fastload.FileDataset(url, settings=Settings(cache_dir=Path(cache_dir)))
        assert [later[i]["data"] for i in range(len(later))] == [folder[Path(i.url).name] for i in later.items]
    assert not caplog.records and later.reader.misses == 0, [r.getMessage() for r in caplog.records]

    info = _cli(capsys, "info", "--cache-dir", cache_dir)  # the default block size, as the reader above
    assert info["entries"] == SMALL + LARGE * 4 + LARGE
    (dataset,) = info["datasets"]
    assert (dataset["cached_items"], dataset["items"]) == (SMALL + LARGE, SMALL + LARGE)
    assert dataset["stored_bytes"] == info["stored_bytes"]  # both copies of the large objects are this dataset's

    cleared = _cli(capsys, "clear", url, "--cache-dir", cache_dir)
    assert cleared["entries"] == SMALL + LARGE * 4 + LARGE
    after = _cli(capsys, "info", "--cache-dir", cache_dir)
    assert (after["entries"], after["datasets"]) == (0, [])
    assert not list((tmp_path / "cache" / "data").glob("*/*.flp"))  # no orphan payload (packs are punched)
    assert Cache(Settings(cache_dir=Path(cache_dir))).volume() == 0
