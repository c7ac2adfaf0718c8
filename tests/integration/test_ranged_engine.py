"""An object's later blocks as ranged GETs on libcurl's engine (fastload.source.ranged): nginx, moto's S3
(signatures checked), and a same-size rewrite mid-read refused by If-Match on that road."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from _cache import cached_blocks

import fastload
from fastload import _servers
from fastload.config import Settings
from fastload.errors import RemoteChangedError
from fastload.read.reader import Reader
from fastload.transport import curl
from fastload.transport.curl import CurlRoute

pytestmark = pytest.mark.integration

MB = 1024**2
BLOCKS = 12


@pytest.fixture(autouse=True)
def _engine() -> None:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every span handed to the engine's ranged GETs."""
    seen: list[tuple[str, int, int]] = []
    start = CurlRoute.start_ranges

    def counting(self: CurlRoute, batch: Sequence[tuple[str, int, int]], *args: Any, **kwargs: Any) -> Any:
        seen.extend(batch)
        return start(self, batch, *args, **kwargs)

    monkeypatch.setattr(CurlRoute, "start_ranges", counting)
    return seen


def _gets(server: _servers.NginxServer) -> list[str]:
    assert server.workdir is not None
    return [line for line in (server.workdir / "access.log").read_text().splitlines() if '"GET /obj.bin' in line]


def test_a_multi_block_object_is_staged_through_the_engine_byte_exact(
        tmp_path: Path, nginx_server: Callable[..., _servers.NginxServer], spans: list[tuple[str, int, int]]) -> None:
    (tmp_path / "www").mkdir()
    data = os.urandom(BLOCKS * MB - 12345)  # a short last block: its GET asks for its own byte count
    (tmp_path / "www" / "obj.bin").write_bytes(data)
    server = nginx_server(tmp_path / "www")
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=2)
    report = fastload.stage(server.url + "/obj.bin", settings=settings, progress=False)
    assert report.fetched_bytes == len(data)
    (item,) = Reader(settings).list(server.url + "/obj.bin")
    assert Reader(settings).read(item) == data
    # Every block but the first (one GET that also sizes the object) came as a ranged GET of the engine,
    # which sends no User-Agent; aiohttp's GETs name themselves.
    later = sorted((start, end) for _, start, end in spans)
    assert later == [(b * MB, min(len(data), (b + 1) * MB)) for b in range(1, BLOCKS)]
    gets = _gets(server)
    assert sum('" 206 ' in g and g.endswith('"-" "-"') for g in gets) >= BLOCKS - 1
    assert sum("aiohttp" in g for g in gets) <= 1


def test_a_same_size_rewrite_mid_read_is_refused_by_if_match_on_the_engine_and_nothing_of_itcached_blocks(
        tmp_path: Path, nginx_server: Callable[..., _servers.NginxServer], spans: list[tuple[str, int, int]]) -> None:
    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "obj.bin"
    path.write_bytes(b"A" * (BLOCKS * MB))
    os.utime(path, (1_700_000_000, 1_700_000_000))
    server = nginx_server(tmp_path / "www")
    folder = server.url + "/"
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=2, backoff_s=0.01)
    reader = Reader(settings)
    (item,) = reader.list(folder)
    assert reader.read_block(item, 0) == b"A" * MB
    path.write_bytes(b"B" * (BLOCKS * MB))  # the same size, a later mtime: nginx's ETag changes
    os.utime(path, (1_700_000_100, 1_700_000_100))
    with pytest.raises(RemoteChangedError, match=r"obj\.bin: remote now has .*the object changed"):
        reader.read(item)
    assert spans, "the later blocks never reached the engine"
    assert any('" 412 ' in g and g.endswith('"-" "-"') for g in _gets(server))  # nginx refused the engine's If-Match
    assert cached_blocks(settings, item.url) == {0: b"A" * MB}


@pytest.fixture(scope="module")
def signed(signed_moto: _servers.SignedMotoServer) -> _servers.SignedMotoServer:
    signed_moto.client("s3").put_object(Bucket="signed", Key="ranged/obj.bin", Body=bytes(range(256)) * (BLOCKS * MB // 256))
    return signed_moto


def test_s3_later_blocks_are_signed_ranged_gets_on_the_engine(
        tmp_path: Path, signed: _servers.SignedMotoServer, spans: list[tuple[str, int, int]]) -> None:
    # moto checks each signature: the Range and If-Match each GET adds are its own, outside the signed headers.
    options = {"key": signed.key, "secret": signed.secret,
               "client_kwargs": {"endpoint_url": signed.endpoint_url, "region_name": "us-east-1"}}
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=1)
    url = "s3://signed/ranged/obj.bin"
    fastload.stage(url, settings=settings, storage_options=options, progress=False)
    (item,) = Reader(settings, options).list(url)
    assert Reader(settings, options).read(item) == bytes(range(256)) * (BLOCKS * MB // 256)
    # A listed (sized, versioned) key needs no first-block GET: block 0 may be a ranged GET as well.
    assert {start for _, start, _ in spans} >= {b * MB for b in range(1, BLOCKS)}
    body = bytes(range(256)) * (BLOCKS * MB // 256)
    assert cached_blocks(settings, item.url) == {b: body[b * MB:(b + 1) * MB] for b in range(BLOCKS)}


def test_s3_a_same_size_rewrite_mid_read_is_a_remote_changed_error_on_the_engine(
        tmp_path: Path, signed: _servers.SignedMotoServer, spans: list[tuple[str, int, int]]) -> None:
    options = {"key": signed.key, "secret": signed.secret,
               "client_kwargs": {"endpoint_url": signed.endpoint_url, "region_name": "us-east-1"}}
    s3 = signed.client("s3")
    s3.put_object(Bucket="signed", Key="ranged/torn.bin", Body=b"A" * (BLOCKS * MB))
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=1)
    reader = Reader(settings, options)
    (item,) = reader.list("s3://signed/ranged/torn.bin")
    assert reader.read_block(item, 0) == b"A" * MB
    s3.put_object(Bucket="signed", Key="ranged/torn.bin", Body=b"B" * (BLOCKS * MB))
    with pytest.raises(RemoteChangedError, match=r"torn\.bin: remote now has .*the object changed"):
        reader.read(item)
    assert spans
    assert cached_blocks(settings, item.url) == {0: b"A" * MB}
