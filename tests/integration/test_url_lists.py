"""A dataset given as a list of URLs: no listing, sizes from each object's first GET, a recorded manifest."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cli import dataset_summaries
from fastload.cli import main as cli_main
from fastload.config import Settings
from fastload.errors import ConfigError, EmptyDatasetError
from fastload.read.reader import Reader
from fastload.source import Source

pytestmark = pytest.mark.integration


def _files(root: Path, n: int = 6) -> dict[str, bytes]:
    root.mkdir(parents=True)
    files = {f"obj_{k}.bin": os.urandom(2000 + k) for k in range(n)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def _requests(server: Any, method: str) -> list[str]:
    log = (server.workdir / "access.log").read_text()
    return [line for line in log.splitlines() if f'"{method} ' in line]


def test_file_dataset_over_a_url_list_reads_in_order_without_listing(
    tmp_path: Path, nginx_server: Callable[..., Any]
) -> None:
    files = _files(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    names = sorted(files, reverse=True)  # the list's order, not a sorted listing's
    urls = [f"{server.url}/{n}" for n in names]
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=64 * 1024)
    ds = fastload.FileDataset(urls, label=list(range(len(urls))), settings=settings)
    assert [s["url"] for s in (ds[i] for i in range(len(ds)))] == urls
    assert [ds[i]["data"] for i in range(len(ds))] == [files[n] for n in names]
    assert [ds[i]["label"] for i in range(len(ds))] == list(range(len(urls)))
    assert not _requests(server, "HEAD")  # sizes came from each object's first GET
    assert all(" /obj_" in line for line in _requests(server, "GET"))  # no folder page was asked for
    assert len(_requests(server, "GET")) == len(urls)

    base = server.url
    server.stop()  # the list was recorded as a manifest: a new dataset needs no server
    again = fastload.FileDataset([f"{base}/{n}" for n in names], label=lambda url: url.rsplit("_", 1)[1], settings=settings)
    assert [again[i]["label"] for i in range(len(again))] == [n.rsplit("_", 1)[1] for n in names]
    info = dataset_summaries(settings)["datasets"]
    assert [(d["url"].split(":")[:2], d["items"], d["cached_items"]) for d in info] == [(["urls", str(len(urls))], len(urls), len(urls))]


def test_staging_a_url_list_from_the_cli(tmp_path: Path, nginx_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    files = _files(tmp_path / "www")
    server = nginx_server(tmp_path / "www")
    (tmp_path / "urls.txt").write_text("# one per line\n" + "".join(f"{server.url}/{n}\n" for n in files))
    code = cli_main(["cache", "--url-list", str(tmp_path / "urls.txt"), "--cache-dir", str(tmp_path / "c"), "--json"])
    assert code == 0, capsys.readouterr().err
    import json

    report = json.loads(capsys.readouterr().out)
    assert (report["items"], report["fetched_blocks"], report["remote_bytes"]) == (len(files), len(files), sum(map(len, files.values())))
    # A pattern has no listing to filter: a usage error, not a pattern silently dropped.
    code = cli_main(["cache", "--url-list", str(tmp_path / "urls.txt"), "--pattern", "*.jpg", "--cache-dir", str(tmp_path / "c")])
    assert code == 2 and "--pattern filters a listing and --url-list has none" in capsys.readouterr().err


def test_bad_url_lists_get_short_errors_naming_the_entry(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache")
    urls: list[Any] = [f"http://127.0.0.1:9/{k}.jpg" for k in range(100_000)]
    urls[17] = 42
    with pytest.raises(ConfigError, match=r"URL list entry 17 is 42 \(int\), not a URL string") as err:
        fastload.FileDataset(urls, settings=settings)
    assert len(str(err.value)) < 200
    with pytest.raises(EmptyDatasetError, match="the URL list is empty"):
        fastload.FileDataset([], settings=settings)
    with pytest.raises(ConfigError) as err:
        Source(urls)  # type: ignore[arg-type]
    assert len(str(err.value)) < 300 and "list" in str(err.value)
    # A pattern has no listing to filter: refused by Reader.list, for the datasets and staging alike.
    local = []
    for k in range(3):
        (tmp_path / f"{k}.jpg").write_bytes(b"x")
        local.append(str(tmp_path / f"{k}.jpg"))
    for call in (lambda: fastload.FileDataset(local, pattern="*.jpg", settings=settings),
                 lambda: fastload.stage(local, pattern="*.jpg", settings=settings, progress=False),
                 lambda: Reader(settings).list(local, "*.jpg")):
        with pytest.raises(ConfigError, match=r"pattern='\*\.jpg' filters a listing and a URL list has none"):
            call()
    assert not list(Reader(settings).cache.entries())  # nothing staged
    with pytest.raises(ConfigError, match="label= has 2 entries for 3 samples"):
        fastload.FileDataset([str(tmp_path / f"{k}") for k in range(3)], label=[0, 1], settings=settings)


def test_tar_and_array_datasets_take_url_lists_too(tmp_path: Path) -> None:
    import io
    import tarfile

    import numpy as np

    shards = []
    for s in range(2):
        path = tmp_path / f"shard-{s}.tar"
        with tarfile.open(path, "w") as tar:
            for k in range(3):
                data = f"sample {s}-{k}".encode()
                info = tarfile.TarInfo(f"{s}_{k}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        shards.append(str(path))
    settings = Settings(cache_dir=tmp_path / "cache")
    tars = fastload.TarDataset(list(reversed(shards)), settings=settings)
    assert [tars[i]["txt"] for i in range(len(tars))] == [f"sample {s}-{k}".encode() for s in (1, 0) for k in range(3)]
    arrays = []
    for k in range(3):
        np.save(tmp_path / f"a{k}.npy", np.full((2, 2), k, dtype=np.int16))
        arrays.append(str(tmp_path / f"a{k}.npy"))
    ds = fastload.ArrayDataset(arrays, settings=settings)
    assert [int(ds[i]["data"][0, 0]) for i in range(len(ds))] == [0, 1, 2]
