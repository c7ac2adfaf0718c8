"""S3 through s3fs against a real moto server: staging, errors, secrets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload.cli import main
from fastload.config import Settings
from fastload.errors import CredentialsError, RemoteNotFoundError
from fastload.read.reader import Reader

pytestmark = pytest.mark.integration


def test_stage_from_s3_and_read_back(
    tmp_path: Path, moto_server: Any, s3_bucket: str, s3_options: dict[str, Any]
) -> None:
    local = tmp_path / "data"
    local.mkdir()
    files = {f"s{i}.npy": os.urandom(1000) + bytes(20_000) for i in range(5)}
    for name, data in files.items():
        (local / name).write_bytes(data)
    _servers.upload_tree(local, moto_server.endpoint_url, s3_bucket, "train")
    settings = Settings(cache_dir=tmp_path / "cache", max_requests=4)
    report = fastload.stage(
        f"s3://{s3_bucket}/train/", storage_options=s3_options, settings=settings, progress=False
    )
    assert report.items == 5 and report.stored_bytes < report.remote_bytes
    reader = Reader(settings, s3_options)
    assert all(reader.read(f"s3://{s3_bucket}/train/{n}") == d for n, d in files.items())
    assert reader.misses == 0


def test_nonexistent_bucket_is_named(tmp_path: Path, s3_options: dict[str, Any]) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", retries=1)
    with pytest.raises(RemoteNotFoundError, match="no-such-bucket-xyz"):
        fastload.stage(
            "s3://no-such-bucket-xyz/data/",
            storage_options=s3_options,
            settings=settings,
            progress=False,
        )


def test_missing_credentials_are_a_credentials_error(
    tmp_path: Path, moto_server: Any, s3_bucket: str, no_aws_env: None
) -> None:
    options = {
        "client_kwargs": {"endpoint_url": moto_server.endpoint_url, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    settings = Settings(cache_dir=tmp_path / "cache", retries=1)
    with pytest.raises(CredentialsError, match=rf"{s3_bucket}.*credentials.*storage_options"):
        fastload.stage(
            f"s3://{s3_bucket}/", storage_options=options, settings=settings, progress=False
        )


def test_secrets_never_reach_the_cache_dir_or_messages(
    tmp_path: Path, moto_server: Any, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "SuperSecretValue-7f3a9c"
    local = tmp_path / "data"
    local.mkdir()
    (local / "x.bin").write_bytes(b"payload" * 100)
    _servers.upload_tree(local, moto_server.endpoint_url, s3_bucket)
    options = _servers.s3_storage_options(moto_server.endpoint_url) | {"secret": secret}
    cache_dir = tmp_path / "cache"
    argv = [
        "cache",
        f"s3://{s3_bucket}/",
        "--cache-dir",
        str(cache_dir),
        "--storage-options",
        __import__("json").dumps(options),
        "--json",
    ]
    assert main(argv) == 0
    # A failing call too: its message must not echo the secret either.
    assert (
        main(
            [
                "cache",
                f"s3://{s3_bucket}-missing/",
                "--cache-dir",
                str(cache_dir),
                "--storage-options",
                __import__("json").dumps(options),
            ]
        )
        == 1
    )
    out = capsys.readouterr()
    assert secret not in out.out + out.err
    for path in cache_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
