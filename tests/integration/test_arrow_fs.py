"""fastload.arrow_filesystem: pyarrow.dataset over folders of Parquet files on nginx and
moto S3, read through the cache; and a wrapped fsspec filesystem's own credentials."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload.config import Settings

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ds = pytest.importorskip("pyarrow.dataset")

pytestmark = pytest.mark.integration


def _parquet_folder(root: Path) -> Any:
    """Three Parquet files (one in a subfolder); the table they hold together."""
    (root / "more").mkdir(parents=True)
    tables = []
    for k, rel in enumerate(("a0.parquet", "a1.parquet", "more/b0.parquet")):
        table = pa.table({"x": list(range(10 * k, 10 * k + 10)), "s": [f"r{k}"] * 10})
        pq.write_table(table, root / rel)
        tables.append(table)
    return pa.concat_tables(tables)


def _rows(table: Any) -> list[tuple[int, str]]:
    return sorted(zip(table.column("x").to_pylist(), table.column("s").to_pylist()))


def _requests(server: Any) -> int:
    log = server.workdir / "access.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_pyarrow_dataset_over_an_http_folder(tmp_path: Path, nginx_server: Callable[..., Any]) -> None:
    expected = _parquet_folder(tmp_path / "www" / "tables")
    server = nginx_server(tmp_path / "www")
    fs = fastload.arrow_filesystem(settings=Settings(cache_dir=tmp_path / "cache"))
    base = f"{server.url}/tables"
    for url in (base, base + "/"):  # with or without the folder's slash
        info = fs.get_file_info(url)
        assert info.type == pa.fs.FileType.Directory, url
    table = ds.dataset(base + "/", filesystem=fs, format="parquet").to_table()
    assert _rows(table) == _rows(expected)
    files = fs.get_file_info(pa.fs.FileSelector(base, recursive=True))
    assert sorted((f.path.rsplit("/", 1)[-1], f.type) for f in files) == [
        ("a0.parquet", pa.fs.FileType.File), ("a1.parquet", pa.fs.FileType.File),
        ("b0.parquet", pa.fs.FileType.File), ("more", pa.fs.FileType.Directory),
    ]  # fmt: skip
    before = _requests(server)
    again = ds.dataset(base + "/", filesystem=fs, format="parquet").to_table()
    assert _rows(again) == _rows(expected)
    assert _requests(server) == before  # listed and read from the cache: the server saw nothing


def test_pyarrow_dataset_over_an_s3_prefix(
    tmp_path: Path, moto_server: Any, s3_bucket: str, s3_options: dict[str, Any]
) -> None:
    expected = _parquet_folder(tmp_path / "local")
    _servers.upload_tree(tmp_path / "local", moto_server.endpoint_url, s3_bucket, "tables")
    fs = fastload.arrow_filesystem(s3_options, Settings(cache_dir=tmp_path / "cache"))
    url = f"s3://{s3_bucket}/tables"
    assert fs.get_file_info(url).type == pa.fs.FileType.Directory
    assert fs.get_file_info(url + "/a0.parquet").type == pa.fs.FileType.File
    table = ds.dataset(url, filesystem=fs, format="parquet").to_table()
    assert _rows(table) == _rows(expected)


def test_a_wrapped_s3fs_filesystem_reads_with_its_own_credentials(
    tmp_path: Path, moto_server: Any, s3_bucket: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
    no_aws_env: None,
) -> None:
    import s3fs

    monkeypatch.setenv("FASTLOAD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "x.bin").write_bytes(b"secret data")
    _servers.upload_tree(tmp_path / "local", moto_server.endpoint_url, s3_bucket, "p")
    target = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options)  # key= and secret= among them
    fs = fastload.FastloadFileSystem(fs=target, skip_instance_cache=True)
    assert fs.cat_file(f"{s3_bucket}/p/x.bin") == b"secret data"
    with fs.open(f"s3://{s3_bucket}/p/x.bin") as f:
        assert f.read() == b"secret data"
