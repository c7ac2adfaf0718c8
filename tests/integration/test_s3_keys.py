"""S3 keys are sent as they are named and signed (issue 34, item 4), on libcurl's road.

A key may hold "./" and "../" segments, "//", spaces, "+", "=", "~", "%", any UTF-8 and
up to 1024 bytes. libcurl squashes dot segments unless told not to (CURLOPT_PATH_AS_IS,
native/_curl.c): a signed GET was then refused (its signature covered the name as given)
and an unsigned one fetched another object, the one the squashed name names, and cached
it under the key. Each test reads every key byte for byte through the user's road
(FileDataset + DataLoader) beside decoys that hold the squashed names, and fails if any
GET left libcurl for s3fs.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload.config import Settings
from fastload.source import Source
from fastload.transport import curl

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(curl.engine() is None, reason=f"no curl engine here: {curl.unavailable()}"),
]

# Each odd key; the decoys below hold what libcurl would have made of the dotted ones.
KEYS = [
    "a/./b",
    "a/../b",
    "./x",
    "c/../../up",
    "a//b",
    "sp ace/f i.bin",
    "plus+eq=til~de",
    "100% done/%41%2F",
    "ünïcødé/データ ß.bin",
    "long/" + "k" * 1000,
]
DECOYS = ["a/b", "b", "x", "../up"]  # "<prefix>../up": "up" at the bucket's root (from "<prefix>c/../../up")


def _body(key: str) -> bytes:
    return f"<{key}>".encode() * 40


def _put(client: Any, bucket: str, prefix: str) -> list[str]:
    for key in KEYS + DECOYS:
        name = key[3:] if key.startswith("../") else prefix + key
        client.put_object(Bucket=bucket, Key=name, Body=_body(key), ACL="public-read")
    return [f"s3://{bucket}/{prefix}{key}" for key in KEYS]


def _epoch(tmp_path: Path, urls: list[str], options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """One epoch over ``urls``; a GET redone on s3fs fails the test (libcurl's road alone)."""

    def not_s3fs(self: Source, item: Any, nbytes: int) -> Any:
        raise AssertionError(f"{item.url}: the GET went to s3fs, not over libcurl")

    monkeypatch.setattr(Source, "_fetch_first", not_s3fs)
    assert Source(urls[0], options).route is not None  # on libcurl's road, not s3fs's
    ds = fastload.FileDataset(urls, storage_options=options, settings=Settings(cache_dir=tmp_path / "cache", retries=1))
    return [d for batch in fastload.DataLoader(ds, batch_size=3) for d in batch["data"]]


def test_odd_keys_read_byte_exact_on_signed_gets(
        tmp_path: Path, signed_moto: _servers.SignedMotoServer, no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """moto checks each signature over the path it received: a squashed path is SignatureDoesNotMatch."""
    prefix = f"odd-{uuid.uuid4().hex[:8]}/"
    urls = _put(signed_moto.client("s3"), "signed", prefix)
    gets = signed_moto.requests("GET", f"/signed/{prefix}")
    options = {"key": signed_moto.key, "secret": signed_moto.secret,
               "client_kwargs": {"endpoint_url": signed_moto.endpoint_url, "region_name": "us-east-1"}}
    assert _epoch(tmp_path, urls, options, monkeypatch) == [_body(k) for k in KEYS]
    assert signed_moto.requests("GET", f"/signed/{prefix}", status=403) == 0
    assert signed_moto.requests("GET", f"/signed/{prefix}") - gets == len(KEYS)  # one GET per key


def test_odd_keys_read_byte_exact_on_anonymous_gets(
        tmp_path: Path, moto_server: _servers.MotoServer, s3_bucket: str, no_aws_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsigned, a squashed path is no error: the decoy's bytes would come back, cached under the key."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto_server.endpoint_url, aws_access_key_id="a",
                          aws_secret_access_key="b", region_name="us-east-1")
    urls = _put(client, s3_bucket, "pub/")
    options = {"anon": True, "client_kwargs": {"endpoint_url": moto_server.endpoint_url, "region_name": "us-east-1"}}
    route = Source(urls[0], options).route
    assert route is not None and route.sign([route.wire(urls[0])], []) == ([], None)  # unsigned
    assert _epoch(tmp_path, urls, options, monkeypatch) == [_body(k) for k in KEYS]
