"""The Source contract: one suite, run against every kind of store users point fastload at.

Stores: local files, fsspec's memory filesystem, nginx (Range, autoindex), Python's
``http.server`` (no Range, listen backlog 5, a connection per answer), moto's S3
(listing, signatures checked: ``signed_moto``), nginx serving S3 path-style
GETs (``/bucket/key``; no listing, no signature check) and a GCS emulator
(gcp-storage-emulator: JSON API listing and media downloads; no credentials checked). Each test states what
every store must do; where a store cannot be asked (no listing API, no
credentials, no network to stall), the test skips and says why.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest

from fastload import _servers
from fastload.config import Settings
from fastload.errors import CredentialsError, EmptyDatasetError, RemoteNotFoundError, StoppedError
from fastload.source import RemoteItem, Source
from fastload.transport import curl

pytestmark = pytest.mark.integration

FILES = {"a.bin": os.urandom(300_000), "sub/b.bin": os.urandom(5_000), "sub/deeper/c.bin": b"c" * 70_000}
STORES = ["local", "memory", "nginx", "http.server", "s3", "nginx-s3", "gcs"]


@dataclass
class Store:
    """One store holding FILES under :attr:`root`, and how to reach it."""

    name: str
    root: str  # the folder's URL, ending in "/"
    options: dict[str, Any]
    write: Callable[[str, bytes], None]  # (relative path, bytes): create or replace an object
    lists: bool = True  # has a listing (nginx-s3 answers GETs only)
    sizes_listed: bool = True  # its listing gives sizes (an HTTP index page does not)
    refused: dict[str, Any] | None = None  # storage_options it refuses; None: it takes no credentials
    upstream: str = ""  # its HTTP endpoint, for a proxy in front ("": no network)
    via: Callable[[str], tuple[str, dict[str, Any]]] | None = None  # proxy URL -> (root, options) through it
    ranges: bool = True  # answers a ranged GET with the range
    versions_answered: bool = True  # a GET's answer carries the object's version (the GCS emulator's does not)
    stops: list[Callable[[], None]] = field(default_factory=list)

    def url(self, rel: str) -> str:
        return self.root + rel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _python_http_server(root: Path) -> tuple[str, Callable[[], None]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)

    def stop() -> None:
        proc.terminate()
        proc.wait(10)

    return f"http://127.0.0.1:{port}", stop


def _files_store(name: str, www: Path, base: str, prefix: str) -> Store:
    def write(rel: str, data: bytes) -> None:
        path = www / prefix / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return Store(name, f"{base}/{prefix}/", {}, write, sizes_listed=False, upstream=base,
                 via=lambda proxy: (f"{proxy}/{prefix}/", {}), ranges=name != "http.server")


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    name: str = request.param
    prefix = f"contract-{uuid.uuid4().hex[:8]}"
    made: Store
    if name == "local":
        folder = tmp_path / "local"

        def write_local(rel: str, data: bytes) -> None:
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)

        made = Store(name, folder.as_uri() + "/", {}, write_local)
    elif name == "memory":
        mem = fsspec.filesystem("memory")
        made = Store(name, f"memory://{prefix}/", {}, lambda rel, data: mem.pipe(f"memory://{prefix}/{rel}", data))
    elif name in ("nginx", "nginx-s3"):
        request.getfixturevalue("nginx_server")  # skips, saying why, where nginx is missing
        www = tmp_path / "www"
        (www / prefix).mkdir(parents=True)
        server = request.getfixturevalue("nginx_server")(www)
        if name == "nginx":
            made = _files_store(name, www, server.url, prefix)
        else:
            def write_s3(rel: str, data: bytes) -> None:
                path = www / "bucket" / prefix / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)

            def s3_opts(endpoint: str) -> dict[str, Any]:
                return {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}

            made = Store(name, f"s3://bucket/{prefix}/", s3_opts(server.url), write_s3, lists=False,
                         upstream=server.url, via=lambda proxy: (f"s3://bucket/{prefix}/", s3_opts(proxy)))
    elif name == "http.server":
        www = tmp_path / "www"
        (www / prefix).mkdir(parents=True)
        base, stop = _python_http_server(www)
        made = _files_store(name, www, base, prefix)
        made.stops.append(stop)
    elif name == "gcs":
        emulator: _servers.GcsEmulator = request.getfixturevalue("gcs_emulator")
        bucket = f"contract-{uuid.uuid4().hex[:8]}"
        emulator.create_bucket(bucket)

        def gcs_opts(endpoint: str) -> dict[str, Any]:
            return {"endpoint_url": endpoint, "token": "anon", "project": "fastload"}

        made = Store(name, f"gs://{bucket}/{prefix}/", gcs_opts(emulator.endpoint_url),
                     lambda rel, data: emulator.upload(bucket, f"{prefix}/{rel}", data) and None,
                     upstream=emulator.endpoint_url, via=lambda proxy: (f"gs://{bucket}/{prefix}/", gcs_opts(proxy)),
                     versions_answered=False)
    else:  # s3: moto, signatures checked
        moto: _servers.SignedMotoServer = request.getfixturevalue("signed_moto")
        s3 = moto.client("s3")

        def s3_opts(endpoint: str, secret: str = moto.secret) -> dict[str, Any]:
            return {"key": moto.key, "secret": secret,
                    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}

        made = Store(name, f"s3://signed/{prefix}/", s3_opts(moto.endpoint_url),
                     lambda rel, data: s3.put_object(Bucket="signed", Key=f"{prefix}/{rel}", Body=data),
                     refused=s3_opts(moto.endpoint_url, "Wrong-Secret-0c41f2"), upstream=moto.endpoint_url,
                     via=lambda proxy: (f"s3://signed/{prefix}/", s3_opts(proxy)))
    for rel, data in FILES.items():
        made.write(rel, data)
    yield made
    for stop in made.stops:
        stop()


def _settings(**kw: Any) -> Settings:
    return Settings(retries=2, backoff_s=0.01, request_timeout_s=20, **kw)


def _source(store: Store, url: str | None = None, options: dict[str, Any] | None = None, **kw: Any) -> Source:
    return Source(url or store.root, store.options if options is None else options, _settings(**kw))


def _rel(store: Store, item: RemoteItem) -> str:
    root = _source(store).url + "/"
    return item.url[len(root):] if item.url.startswith(root) else item.url


def test_listing_finds_every_object_with_size_and_version(store: Store) -> None:
    if not store.lists:
        pytest.skip(f"{store.name} has no listing: its objects are read from a key list")
    items = _source(store).list()
    assert {_rel(store, i): i.size for i in items} == {rel: len(data) for rel, data in FILES.items()}
    assert all(i.version for i in items), items  # a fingerprint for the cache's identity


def test_listing_without_sizes_is_completed_by_first_blocks(store: Store) -> None:
    if not store.lists:
        pytest.skip(f"{store.name} has no listing: its objects are read from a key list")
    src = _source(store)
    items = src.list(complete=False)
    assert all(i.size >= 0 for i in items) == store.sizes_listed
    got = src.fetch_first_many(items, 1000)
    assert {_rel(store, done): (done.size, data) for done, data in got} == \
        {rel: (len(d), d[:1000]) for rel, d in FILES.items()}


def test_a_key_list_is_sized_by_the_first_block(store: Store) -> None:
    src = _source(store)
    for rel, data in FILES.items():
        done, first = src.fetch_first(RemoteItem(src.canonical(store.url(rel)), -1, ""), 4096)
        assert (done.size, first) == (len(data), data[:4096])
        assert bool(done.version) == store.versions_answered  # real GCS sends x-goog-generation; its emulator does not


def test_ranged_reads_and_whole_reads(store: Store) -> None:
    src = _source(store)
    data = FILES["a.bin"]
    item, _ = src.fetch_first(RemoteItem(src.canonical(store.url("a.bin")), -1, ""), 65536)
    assert src.ignores_ranges(item.url) == (not store.ranges)
    if store.ranges:
        assert src.fetch(item.url, 70_000, 70_100, expect=100) == data[70_000:70_100]
    blocks: dict[int, bytes] = {}
    src.fetch_whole(item, 65536, lambda _item, b, data: blocks.__setitem__(b, data))  # one GET, block by block: what a Range-less host gets
    assert b"".join(blocks[k] for k in sorted(blocks)) == data and len(blocks) == 5


def test_a_missing_object_and_a_missing_folder_are_named(store: Store) -> None:
    src = _source(store)
    missing = src.canonical(store.url("no/such/object.bin"))
    with pytest.raises(RemoteNotFoundError, match="object.bin"):
        src.fetch_first(RemoteItem(missing, -1, ""), 1000)
    if store.lists:
        with pytest.raises((RemoteNotFoundError, EmptyDatasetError), match="no-such-folder"):
            _source(store, store.url("no-such-folder/")).list()


def test_a_changed_object_has_another_fingerprint(store: Store) -> None:
    src = _source(store)
    url = src.canonical(store.url("sub/b.bin"))
    before, _ = src.fetch_first(RemoteItem(url, -1, ""), 100)
    time.sleep(1.1)  # mtimes and Last-Modified tick in seconds on some stores
    store.write("sub/b.bin", b"changed" * 3)
    after, first = _source(store).fetch_first(RemoteItem(url, -1, ""), 100)
    assert (after.size, first) == (21, b"changed" * 3)
    assert (after.size, after.version) != (before.size, before.version)


def test_refused_credentials_are_a_credentials_error_without_the_secret(store: Store) -> None:
    if store.refused is None:
        pytest.skip(f"{store.name} takes no credentials here")
    src = _source(store, options=store.refused)
    with pytest.raises(CredentialsError) as info:
        src.fetch_first(RemoteItem(src.canonical(store.url("a.bin")), -1, ""), 1000)
    assert "a.bin" in str(info.value)
    assert store.refused["secret"] not in str(info.value)


def test_a_stop_ends_a_request_in_the_middle_and_gives_its_slot_back(
        store: Store, load_script: Callable[[str], Any]) -> None:
    if not store.upstream or store.via is None:
        pytest.skip(f"{store.name} has no network request to stop in the middle")
    faultproxy = load_script("tests/reliability/faultproxy.py")
    proxy = faultproxy.FaultProxy(store.upstream, {"stall": 1.0}, stall_s=60, s3=store.root.startswith("s3"))
    proxy.start()
    try:
        root, options = store.via(proxy.url)
        src = Source(root, options, _settings(max_requests=4))
        item = RemoteItem(src.canonical(root + "a.bin"), -1, "")
        outcome: list[BaseException] = []

        def read() -> None:
            try:
                src.fetch_first(item, len(FILES["a.bin"]))  # all of it: the proxy sends half, then stalls
            except BaseException as err:
                outcome.append(err)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 20
        while not proxy.counts().get("stall") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.counts().get("stall"), "the request never reached the store"
        time.sleep(0.2)  # its answer has begun and stalled
        src.stop.set()
        reader.join(10)
        assert not reader.is_alive(), "the stop did not end the request"
        assert outcome and isinstance(outcome[0], StoppedError), outcome
        limit = src.host_limit
        assert limit is not None
        deadline = time.monotonic() + 5
        while limit.in_flight and time.monotonic() < deadline:
            curl.pump()
            time.sleep(0.02)
        assert limit.in_flight == 0
    finally:
        proxy.stop()


# Every form fsspec's glob reads ([...], [!...], ?, *, **), on a layout of class folders.
GLOB_FILES = [f"class_{c}/{i:04d}.jpg" for c in range(4) for i in range(3)] + [
    "class_1/extra.png", "class_10/0000.jpg", "top.jpg", "deep/a/b/x.jpg", "deep/a/y.txt"]
GLOBS = ["class_[01]/*.jpg", "class_[!0]/*.jpg", "class_?/000[0-1].jpg", "**/*.jpg", "*.jpg", "deep/**",
         "**/a/*", "class_[0-9]*/*", "**/[tx]*.jpg", "class_1/*.[jp][pn]g", "deep/**/*.txt"]


def test_a_glob_matches_what_fsspecs_glob_matches(store: Store, tmp_path: Path) -> None:
    # fastload read '[...]' as literal brackets: 'class_[01]/*.jpg' matched nothing, while
    # fsspec's glob found the files (issue 24, item 9). The expected set is fsspec's own
    # glob over the same layout in a local folder.
    if not store.lists:
        pytest.skip(f"{store.name} has no listing: its objects are read from a key list")
    local = tmp_path / "glob-expected"
    for rel in GLOB_FILES:
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(rel.encode())
        store.write(f"glob/{rel}", rel.encode())
    fs = fsspec.filesystem("file")
    for pattern in GLOBS:
        want = sorted(p[len(str(local)) + 1 :] for p in fs.glob(f"{local}/{pattern}") if fs.isfile(p))
        assert want, pattern  # each pattern is a real test: fsspec finds something
        root = _source(store).url + "/glob"
        got = sorted(i.url[len(root) + 1 :] for i in _source(store, store.url("glob/")).list(pattern))
        assert got == want, (store.name, pattern)
        # fsspec's own glob over the same HTTP folder agrees (but where '?' starts a query string there).
        if store.name == "nginx" and "?" not in pattern:
            http = fsspec.filesystem("http", skip_instance_cache=True)
            over_http = sorted(p[len(root) + 1 :] for p in http.glob(f"{root}/{pattern}") if not p.endswith("/"))
            assert over_http == want, pattern
