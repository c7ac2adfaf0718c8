"""An object rewritten on the remote is never served as a mix of its versions: nginx, moto's S3 (libcurl and
s3fs roads), gcp-storage-emulator behind a proxy that adds GCS's generations (libcurl and gcsfs roads)."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
from _cache import cached_blocks

import fastload
from fastload import _servers
from fastload.cache import Cache
from fastload.config import Settings
from fastload.errors import RemoteChangedError
from fastload.read.reader import Reader
from fastload.transport import curl
from fastload.transport.curl import CurlRoute

pytestmark = pytest.mark.integration

MB = 1024**2


def _rewrite(path: Path, version: int) -> bytes:
    """The file rewritten in place at the same size, with a later mtime (nginx's ETag is mtime-size)."""
    data = bytes([version]) * (4 * MB)
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, (1_700_000_000 + version, 1_700_000_000 + version))
    return data


def _evict(settings: Settings, url: str, blocks: set[int]) -> None:
    cache = Cache(settings)
    for entry in list(cache.entries()):
        if entry.url == url and entry.block in blocks:
            assert cache.drop(entry.key)
    cache.close()


def test_a_rewritten_object_is_a_remote_changed_error_never_a_torn_read(
    tmp_path: Path, nginx_server: Callable[..., Any]
) -> None:
    # Stage a 4 MiB file (1 MiB blocks), rewrite it at the same size, evict part, read;
    # repeat: the read returned blocks 0-1 of version 3, block 2 of 1 and block 3 of 2.
    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "obj.bin"
    path.write_bytes(b"")
    v1 = _rewrite(path, 1)
    server = nginx_server(tmp_path / "www")
    folder = server.url.rstrip("/") + "/"
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=2, backoff_s=0.01)
    fastload.stage(folder, settings=settings, progress=False)
    reader = Reader(settings)
    (item,) = reader.list(folder)
    assert reader.read(item) == v1
    _rewrite(path, 2)
    _evict(settings, item.url, {2, 3})
    for reader in (Reader(settings), Reader(settings)):  # a first read, then one of a warm process
        (item,) = reader.list(folder)  # the recorded listing: version 1's size and ETag
        with pytest.raises(RemoteChangedError, match=r"obj\.bin: remote now has .*the object changed; fix: `fastload cache --refresh`"):
            reader.read(item)
    _rewrite(path, 3)
    _evict(settings, item.url, {0, 1})
    reader = Reader(settings)
    (item,) = reader.list(folder)
    with pytest.raises(RemoteChangedError, match=r"obj\.bin"):
        reader.read(item)
    fastload.stage(folder, settings=settings, progress=False, refresh=True)  # the fix the message names
    reader = Reader(settings)
    (item,) = reader.list(folder)
    assert reader.read(item) == bytes([3]) * (4 * MB)


# -- every store: a same-size rewrite while an object is read, or between listing and reading ------------
#
# 20 MiB objects of 1 MiB blocks, one letter per version (the repro: "ABBBBBBBBBBBBBBBBBBB" was read and
# cached). Each store's later blocks come through its fsspec road (s3fs, gcsfs, aiohttp), which names the
# listed version (If-Match, ifGenerationMatch) and checks the answer's (fastload.source.versioned); the
# first block comes through libcurl on the "curl" roads (a key list's completion), checked there.

OBJECT = 20 * MB


class _Store:
    """One store and road: where its object is (``url``, in ``folder``), how to rewrite it, how to read it."""

    def __init__(self, folder: str, url: str, write: Callable[[bytes], None], options: dict[str, Any], client: str) -> None:
        self.folder, self.url, self.write, self.options, self.client = folder, url, write, options, client

    def settings(self, tmp_path: Path) -> Settings:
        return Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=2, backoff_s=0.01, http_client=self.client)


class _GcsWithGenerations(ThreadingHTTPServer):
    """A proxy before gcp-storage-emulator that does what GCS does and the emulator does not: a media
    download carries ``x-goog-generation``, and one whose ``ifGenerationMatch`` names another generation
    is refused with a 412. Counts the downloads that named a generation."""

    daemon_threads = True

    def __init__(self, emulator: str) -> None:
        super().__init__(("127.0.0.1", 0), _GcsProxy)
        self.emulator, self.conditional = emulator, 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _GcsProxy(BaseHTTPRequestHandler):
    server: _GcsWithGenerations
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path, _, query = self.path.partition("?")
        extra = {}
        if path.startswith("/download/storage/v1/b/"):
            bucket, _, name = path.removeprefix("/download/storage/v1/b/").partition("/o/")
            with urllib.request.urlopen(f"{self.server.emulator}/storage/v1/b/{bucket}/o/{name}", timeout=30) as r:
                generation = str(json.loads(r.read())["generation"])
            wanted = parse_qs(query).get("ifGenerationMatch")
            if wanted:
                self.server.conditional += 1
                if wanted[0] != generation:
                    self._send(412, b'{"error": {"code": 412, "message": "Precondition Failed"}}', {})
                    return
            extra["x-goog-generation"] = generation
        request = urllib.request.Request(self.server.emulator + self.path,
                                         headers={k: v for k, v in self.headers.items() if k.lower() == "range"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                status, body, headers = r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as err:
            status, body, headers = err.code, err.read(), dict(err.headers)
        keep = {k: v for k, v in headers.items() if k.lower() in ("content-type", "content-range")}
        self._send(status, body, keep | extra)

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def gcs_generations(gcs_emulator: _servers.GcsEmulator) -> Iterator[_GcsWithGenerations]:
    server = _GcsWithGenerations(gcs_emulator.endpoint_url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(params=["http", "s3-curl", "s3-s3fs", "gcs-curl", "gcs-gcsfs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> _Store:
    kind, _, road = request.param.partition("-")
    client = "aiohttp" if road in ("s3fs", "gcsfs") else "auto"
    if road == "curl" and curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    if kind == "http":
        (tmp_path / "www").mkdir()
        path = tmp_path / "www" / "obj.bin"
        stamp = [1_700_000_000]

        def rewrite(data: bytes) -> None:
            path.write_bytes(data)
            stamp[0] += 10  # nginx's ETag is mtime-size: a later mtime, a new ETag
            os.utime(path, (stamp[0], stamp[0]))

        rewrite(b"")
        server = request.getfixturevalue("nginx_server")(tmp_path / "www")
        folder = server.url.rstrip("/") + "/"
        return _Store(folder, folder + "obj.bin", rewrite, {}, client)
    if kind == "s3":
        import s3fs

        moto = request.getfixturevalue("moto_server")
        bucket = request.getfixturevalue("s3_bucket")
        options = _servers.s3_storage_options(moto.endpoint_url)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        return _Store(f"s3://{bucket}/torn/", f"s3://{bucket}/torn/obj.bin",
                      lambda data: fs.pipe_file(f"{bucket}/torn/obj.bin", data), options, client)
    emulator = request.getfixturevalue("gcs_emulator")
    proxy = request.getfixturevalue("gcs_generations")
    bucket = f"torn-{uuid.uuid4().hex[:8]}"
    emulator.create_bucket(bucket)
    options = {"endpoint_url": proxy.url, "token": "anon", "project": "fastload"}

    def upload(data: bytes) -> None:
        emulator.upload(bucket, "torn/obj.bin", data)

    return _Store(f"gs://{bucket}/torn/", f"gs://{bucket}/torn/obj.bin", upload, options, client)


def _version(letter: bytes) -> bytes:
    return letter * OBJECT


CHANGED = r"obj\.bin: remote now has .*the object changed; fix: `fastload cache --refresh`"


def test_an_object_rewritten_mid_read_is_a_remote_changed_error_and_nothing_of_it_iscached_blocks(
        tmp_path: Path, store: _Store) -> None:
    settings = store.settings(tmp_path)
    store.write(_version(b"A"))
    reader = Reader(settings, store.options)
    (item,) = reader.list(store.folder)  # the listing: version A's size and version
    assert item.version
    assert reader.read_block(item, 0) == b"A" * MB  # the read begins...
    store.write(_version(b"B"))  # ... the object is rewritten at the same size ...
    with pytest.raises(RemoteChangedError, match=CHANGED):
        reader.read(item)  # ... and its later blocks are refused, never served as "ABBB..."
    assert cached_blocks(settings, item.url) == {0: b"A" * MB}  # nothing of version B under version A's name
    later = Reader(settings, store.options)  # a later process, with the recorded listing
    (again,) = later.list(store.folder)
    with pytest.raises(RemoteChangedError, match=CHANGED):
        later.read(again)
    assert cached_blocks(settings, item.url) == {0: b"A" * MB}
    (fresh,) = Reader(settings, store.options).list(store.folder, refresh=True)  # the fix the message names
    assert fresh.version != item.version and Reader(settings, store.options).read(fresh) == _version(b"B")


def test_an_object_rewritten_between_listing_and_reading_is_a_remote_changed_error(
        tmp_path: Path, store: _Store) -> None:
    settings = store.settings(tmp_path)
    store.write(_version(b"A"))
    reader = Reader(settings, store.options)
    (item,) = reader.list(store.folder)
    store.write(_version(b"B"))
    out = bytearray(OBJECT)
    with pytest.raises(RemoteChangedError, match=CHANGED):
        reader.read_into([(item, 0, OBJECT, 0)], out)  # every block in one batch, the first included
    with pytest.raises(RemoteChangedError, match=CHANGED):
        reader.sources.of(item.url).fetch_first(item, MB)  # the first-block GET (libcurl's on the curl roads)
    assert cached_blocks(settings, item.url) == {}


@pytest.mark.parametrize("store", ["s3-curl", "gcs-curl"], indirect=True)  # a key list's first block: one GET on libcurl
def test_a_key_lists_first_block_on_libcurl_then_a_rewrite_is_a_remote_changed_error(
        tmp_path: Path, store: _Store, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    start = CurlRoute.start

    def counting(self: CurlRoute, urls: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        started.extend(urls)
        return start(self, urls, *args, **kwargs)

    monkeypatch.setattr(CurlRoute, "start", counting)
    settings = store.settings(tmp_path)
    store.write(_version(b"A"))
    reader = Reader(settings, store.options)
    (item,) = reader.list([store.url], complete=False)
    (done,), fresh = reader.fetcher.complete([item])  # one GET: size, version and block 0
    assert started == [store.url] and done.version and done.size == OBJECT
    store.write(_version(b"B"))
    with pytest.raises(RemoteChangedError, match=CHANGED):
        reader.read(done, fresh)
    assert cached_blocks(settings, store.url) == {0: b"A" * MB}
