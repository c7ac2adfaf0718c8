"""Parquet folders on nginx through the documented recipes (docs/formats.md): Hugging Face
``datasets.load_dataset`` with ``fastload://`` and ``fastload::`` URLs, and pandas over
``fastload.arrow_filesystem()``. Each reads the right rows, sends one GET per file (and the
folder's listing) on its first pass, and nothing on the second: no HEADs, and the
``_metadata`` files pyarrow looks for beside a folder are not asked for again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import fs as fastload_fs
from fastload.config import Settings

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.integration

FILES = 3


def _folder(tmp_path: Path, nginx_server: Callable[..., Any]) -> tuple[Any, str, int]:
    data = tmp_path / "www" / "data"
    data.mkdir(parents=True)
    for k in range(FILES):
        pq.write_table(pa.table({"x": list(range(100 * k, 100 * k + 100))}), data / f"part-{k}.parquet")
    server = nginx_server(tmp_path / "www")
    return server, server.url + "/data/", sum(range(100 * FILES))


def _requests(server: Any) -> list[str]:
    log = server.workdir / "access.log"
    return [line.split('"')[1] for line in log.read_text().splitlines()] if log.exists() else []


def _one_get_per_file(sent: list[str]) -> None:
    assert sorted(sent) == ["GET /data/ HTTP/1.1"] + [f"GET /data/part-{k}.parquet HTTP/1.1" for k in range(FILES)]


@pytest.mark.parametrize(("form", "streaming"), [("fastload://", False), ("fastload://", True), ("fastload::", False)])
def test_hugging_face_load_dataset_reads_a_remote_parquet_folder_through_the_cache(
    tmp_path: Path, nginx_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, form: str, streaming: bool
) -> None:
    datasets = pytest.importorskip("datasets")
    server, url, total = _folder(tmp_path, nginx_server)
    monkeypatch.setenv("FASTLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fastload_fs, "_SHARED", {})  # a Reader of this test's cache folder
    monkeypatch.setattr(fastload_fs, "_MISSING", {})
    # fsspec keeps one filesystem per set of arguments: an earlier test's, on its own cache
    # folder, would list there while datasets opens the files here.
    fastload.FastloadFileSystem.clear_instance_cache()
    for rerun in range(2):
        before = len(_requests(server))
        rows = datasets.load_dataset("parquet", data_files=form + url + "part-*.parquet", split="train",
                                     streaming=streaming, cache_dir=str(tmp_path / f"hf{rerun}"))
        assert sum(r["x"] for r in rows) == total
        sent = _requests(server)[before:]
        if rerun == 0:
            _one_get_per_file(sent)
        else:
            assert sent == []  # its own cache folder is new (hf1): every byte came from fastload's


def test_pandas_over_arrow_filesystem_sends_one_get_per_file_then_nothing(
    tmp_path: Path, nginx_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pd = pytest.importorskip("pandas")
    server, url, total = _folder(tmp_path, nginx_server)
    monkeypatch.setattr(fastload_fs, "_MISSING", {})
    fs = fastload.arrow_filesystem(settings=Settings(cache_dir=tmp_path / "cache"))
    for rerun in range(2):
        before = len(_requests(server))
        assert int(pd.read_parquet(url, filesystem=fs)["x"].sum()) == total
        sent = _requests(server)[before:]
        if rerun == 0:
            _one_get_per_file(sent)  # no HEAD per file, no _metadata probe (the folder's listing says)
        else:
            assert sent == []


def test_a_missing_file_outside_any_recorded_listing_is_asked_for_once_per_process(
    tmp_path: Path, nginx_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url, _ = _folder(tmp_path, nginx_server)
    monkeypatch.setattr(fastload_fs, "_MISSING", {})
    monkeypatch.setattr(fastload_fs, "MISSING_MAX", 2)
    fs = fastload.FastloadFileSystem(target_protocol="http", settings=Settings(cache_dir=tmp_path / "cache"))
    names = [url + f"none-{k}" for k in range(3)]
    for name in names:
        with pytest.raises(FileNotFoundError):
            fs.info(name)
    asked = len(_requests(server))
    assert asked >= 3
    for name in names[1:]:  # remembered: no request
        with pytest.raises(FileNotFoundError):
            fs.info(name)
    assert len(_requests(server)) == asked
    with pytest.raises(FileNotFoundError):  # the oldest was dropped past MISSING_MAX: asked again
        fs.info(names[0])
    assert len(_requests(server)) > asked
