"""``fastload diagnose`` measures the road training takes, with its CA, and names it (issue 32).

Its storage probe once read through an fsspec filesystem of its own: over https with
the CA in ``SSL_CERT_FILE`` it failed with an SSL error while training ran, and with
``AWS_CA_BUNDLE`` it measured s3fs without saying so. Now it reads through the
loader's Source; the CA below is trusted only where a test names it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("cryptography")

import _tls  # noqa: E402 - needs cryptography, checked above

FILES = 10


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return _tls.make_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def https_url(tmp_path_factory: pytest.TempPathFactory, ca: tuple[Path, Path, Path]) -> Iterator[str]:
    root = tmp_path_factory.mktemp("www")
    (root / "train").mkdir()
    for k in range(FILES):
        (root / "train" / f"{k:02d}.npy").write_bytes(b"\x93NUMPY" + bytes([k]) * (20_000 + k))
    with _tls.https_files(root, ca[1], ca[2]) as base:
        yield f"{base}/train/"


def _diagnose(url: str, tmp_path: Path, env: dict[str, str], *extra: str) -> tuple[int, dict[str, Any], str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR", "AWS_CA_BUNDLE")}
    cmd = [sys.executable, "-m", "fastload", "diagnose", "--json", "--quick", "--no-gpu",
           "--cache-dir", str(tmp_path / "cache"), *extra, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**clean, **env})
    return done.returncode, json.loads(done.stdout), done.stderr


def _curl_runs() -> bool:
    from fastload.transport import curl

    return curl.engine() is not None and os.environ.get("FASTLOAD_HTTP_CLIENT") != "aiohttp"


@pytest.mark.timeout(200)
def test_https_with_the_ca_in_ssl_cert_file_is_measured_on_the_loaders_road(https_url, ca, tmp_path):
    code, report, err = _diagnose(https_url, tmp_path, {"SSL_CERT_FILE": str(ca[0])})
    store = report["storage"]
    assert code == 0 and store["status"] == "ok", (store, err[-2000:])
    assert store["objects"] == FILES and store["best_bps"] > 0 and store["ttfb_ms"]["n"] == 5
    # The samples for the data-kind probe come through the same road.
    assert report["data"]["kind"] == "npy" and "jpeg_fetch_error" not in store
    road = store["road"]
    if _curl_runs():
        assert road["name"] == "libcurl" and road["later_blocks"] == "aiohttp", road
    else:
        assert road["name"] == "aiohttp" and road["why"], road


@pytest.mark.timeout(200)
def test_without_the_ca_the_storage_section_says_the_certificate_failed(https_url, tmp_path):
    # The server above really needs the CA: the test before this one would pass on a road that ignores it.
    code, report, _ = _diagnose(https_url, tmp_path, {})
    store = report["storage"]
    assert code == 1 and store["status"] == "error"
    assert "certificate" in store["reason"].lower(), store


@pytest.mark.timeout(200)
def test_s3_with_aws_ca_bundle_names_the_road_it_measured(moto_server, s3_bucket, ca, tmp_path):
    from urllib.parse import urlsplit

    from fastload._servers import upload_tree

    (tmp_path / "train").mkdir()
    for k in range(FILES):
        (tmp_path / "train" / f"{k:02d}.bin").write_bytes(bytes([k]) * 10_000)
    upload_tree(tmp_path / "train", moto_server.endpoint_url, s3_bucket, "train")
    plain = urlsplit(moto_server.endpoint_url)
    with _tls.tls_front((plain.hostname or "127.0.0.1", plain.port or 80), ca[1], ca[2]) as endpoint:
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        code, report, err = _diagnose(f"s3://{s3_bucket}/train/", tmp_path, {"AWS_CA_BUNDLE": str(ca[0])},
                                      "--storage-options", json.dumps(options))
    store = report["storage"]
    assert code == 0 and store["status"] == "ok", (store, err[-2000:])
    assert store["objects"] == FILES and store["sizes_from"] == "listing" and store["best_bps"] > 0
    road = store["road"]
    # libcurl's engine trusts what Python's ssl does (SSL_CERT_FILE, the system's store). Where it does
    # not read AWS_CA_BUNDLE, its first GET fails verification and, as in training, the host's GETs move
    # to s3fs, which trusts the bundle: the report names s3fs and libcurl's error. Where it does, its GETs
    # succeed and it is the road measured (a failed one would have moved the host to s3fs).
    assert road["name"] in ("libcurl", "s3fs"), road
    if road["name"] == "s3fs" and _curl_runs():
        assert "libcurl cannot speak to" in road["why"] and "error 60" in road["why"], road
    elif road["name"] == "s3fs":
        assert road["why"], road
    else:
        assert road["later_blocks"] == "s3fs", road
