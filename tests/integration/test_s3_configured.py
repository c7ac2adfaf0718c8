"""S3 configured the ways users configure it reads on the fast road, one GET per object (issue 34, item 1).

Each test reads an epoch from moto with the source's s3fs road closed (``Source._fetch_first``
raises), so a configuration that fell back, or a GET sent to the wrong place, fails the test
rather than being redone quietly. The https tests put moto behind a TLS front whose certificate
a private CA signed, named only the way the test names it (``client_kwargs`` verify,
``AWS_CA_BUNDLE``, a profile's ``ca_bundle``): they need libcurl's engine to apply the route's
``cainfo`` per request (native/_curl.c; CurlRoute.cainfo).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import fastload
from fastload.config import Settings
from fastload.source import Source
from fastload.transport import curl

pytestmark = pytest.mark.integration

N = 6


def _expected() -> list[bytes]:
    return [bytes([i]) * (4000 + i) for i in range(N)]


@pytest.fixture
def objects(moto_server: Any, s3_bucket: str, no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    import boto3

    client = boto3.client("s3", endpoint_url=moto_server.endpoint_url, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    for i, data in enumerate(_expected()):
        client.put_object(Bucket=s3_bucket, Key=f"conf/{i:02d}.bin", Body=data)
    for var in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")

    def not_s3fs(*args: Any) -> Any:
        raise AssertionError("a GET went to s3fs, not the fast road")

    monkeypatch.setattr(Source, "_fetch_first", not_s3fs)
    return [f"s3://{s3_bucket}/conf/{i:02d}.bin" for i in range(N)]


def _epoch(tmp_path: Path, options: dict[str, Any], urls: list[str]) -> list[bytes]:
    ds = fastload.FileDataset(urls, storage_options=options, settings=Settings(cache_dir=tmp_path / "cache", retries=2))
    got: list[bytes] = []
    for batch in fastload.DataLoader(ds, batch_size=3):
        got.extend(bytes(d) for d in batch["data"])
    return got


def test_an_endpoint_given_only_by_aws_endpoint_url(tmp_path: Path, moto_server: Any, objects: list[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    route = Source(objects[0], {}).route
    assert route is not None and route.wire(objects[0]).startswith(moto_server.endpoint_url + "/")
    assert _epoch(tmp_path, {}, objects) == _expected()


def test_an_endpoint_and_region_from_a_profile(tmp_path: Path, moto_server: Any, objects: list[str]) -> None:
    import os

    Path(os.environ["AWS_CONFIG_FILE"]).write_text(
        f"[profile lab]\nregion = us-east-1\nendpoint_url = {moto_server.endpoint_url}\n")
    Path(os.environ["AWS_SHARED_CREDENTIALS_FILE"]).write_text(
        "[lab]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    assert _epoch(tmp_path, {"profile": "lab"}, objects) == _expected()


@pytest.fixture
def tls(moto_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    pytest.importorskip("cryptography")
    import _tls

    ca, cert, key = _tls.make_ca(tmp_path_factory.mktemp("ca"))
    plain = urlsplit(moto_server.endpoint_url)
    with _tls.tls_front((plain.hostname or "127.0.0.1", plain.port or 80), cert, key) as endpoint:
        yield endpoint, ca


@pytest.mark.parametrize("how", ["client_kwargs verify", "AWS_CA_BUNDLE", "profile ca_bundle"])
def test_https_with_a_private_ca_named_the_way_botocore_reads_it(
        how: str, tmp_path: Path, objects: list[str], tls: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    endpoint, ca = tls
    client: dict[str, Any] = {"endpoint_url": endpoint, "region_name": "us-east-1"}
    options: dict[str, Any] = {"client_kwargs": client}
    if how == "client_kwargs verify":
        client["verify"] = str(ca)
    elif how == "AWS_CA_BUNDLE":
        monkeypatch.setenv("AWS_CA_BUNDLE", str(ca))
    else:
        Path(os.environ["AWS_CONFIG_FILE"]).write_text(f"[profile tls]\nca_bundle = {ca}\n")
        Path(os.environ["AWS_SHARED_CREDENTIALS_FILE"]).write_text(
            "[tls]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
        options["profile"] = "tls"
    route = Source(objects[0], options).route
    assert route is not None and route.cainfo == str(ca) and route.verify is True
    assert _epoch(tmp_path, options, objects) == _expected()  # needs the engine to apply cainfo per request


def test_verify_false_reads_on_the_fast_road_with_one_warning(
        tmp_path: Path, objects: list[str], tls: tuple[str, Path], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload.source import s3

    monkeypatch.setattr(s3, "_unverified_warned", set())
    options = {"client_kwargs": {"endpoint_url": tls[0], "region_name": "us-east-1", "verify": False}}
    with caplog.at_level("WARNING", logger="fastload"):
        route = Source(objects[0], options).route
        Source(objects[1], options).route  # noqa: B018 - a second source: no second warning
    assert route is not None and route.verify is False
    assert caplog.text.count("TLS certificates are not checked") == 1
    assert _epoch(tmp_path, options, objects) == _expected()  # needs the engine to apply verify=False per request
