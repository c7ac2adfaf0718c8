"""gs:// on libcurl's engine (fastload.source.gcs) against a GCS emulator, and its credentials against a
local server that plays GCS's media endpoint and Google's token endpoint.

Each emulator test reads objects through the user's road (FileDataset + DataLoader,
or staging) and counts the requests in the emulator's own log: a media download is
``GET /download/storage/v1/b/<bucket>/o/<object>?alt=media``; gcsfs's metadata
request is ``GET /storage/v1/b/<bucket>/o/<object>``.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload.config import Settings
from fastload.errors import CredentialsError
from fastload.source import RemoteItem, Source
from fastload.source.gcs import GcsRoute
from fastload.transport import curl

pytestmark = pytest.mark.integration

N = 10


def _data(i: int) -> bytes:
    return bytes([i]) * (4000 + i)


@pytest.fixture
def bucket(gcs_emulator: _servers.GcsEmulator) -> str:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    name = f"gcs-{uuid.uuid4().hex[:8]}"
    gcs_emulator.create_bucket(name)
    for i in range(N):
        gcs_emulator.upload(name, f"keys/{i:03d} x+y.bin", _data(i))
    return name


def _urls(bucket: str) -> list[str]:
    return [f"gs://{bucket}/keys/{i:03d} x+y.bin" for i in range(N)]


def _epoch(cache: Path, options: dict[str, Any], urls: list[str] | str, **loader: Any) -> list[bytes]:
    ds = fastload.FileDataset(urls, storage_options=options, settings=Settings(cache_dir=cache, retries=2))
    return [d for batch in fastload.DataLoader(ds, batch_size=4, **loader) for d in batch["data"]]


def _counts(emulator: _servers.GcsEmulator, bucket: str) -> tuple[int, int]:
    """(media downloads, metadata requests) of ``bucket``'s objects under keys/ so far (gcsfs's
    listing asks for ``keys`` itself once, to learn it is no object: not counted)."""
    return (emulator.requests("GET", f"/download/storage/v1/b/{bucket}/o/"),
            sum(emulator.requests("GET", f"/storage/v1/b/{bucket}/o/keys{sep}") for sep in ("/", "%2F")))


def test_a_key_list_takes_one_get_per_object_and_no_metadata_request(
        tmp_path: Path, gcs_emulator: _servers.GcsEmulator, bucket: str) -> None:
    assert isinstance(Source(_urls(bucket)[0], gcs_emulator.storage_options()).route, GcsRoute)
    got = _epoch(tmp_path / "cache", gcs_emulator.storage_options(), _urls(bucket))
    assert got == [_data(i) for i in range(N)]
    assert _counts(gcs_emulator, bucket) == (N, 0)  # sized by each GET's Content-Range


def test_a_listed_prefix_reads_each_object_with_one_get(
        tmp_path: Path, gcs_emulator: _servers.GcsEmulator, bucket: str) -> None:
    got = _epoch(tmp_path / "cache", gcs_emulator.storage_options(), f"gs://{bucket}/keys/")
    assert got == [_data(i) for i in range(N)]
    assert _counts(gcs_emulator, bucket) == (N, 0)


def test_both_roads_give_an_object_one_identity(
        tmp_path: Path, gcs_emulator: _servers.GcsEmulator, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged through gcsfs (FASTLOAD_HTTP_CLIENT=aiohttp), read on the engine: every item a hit, no request.
    Both roads version an object by its generation (fastload.source.items.version_of)."""
    cache = tmp_path / "cache"
    options = gcs_emulator.storage_options()
    generation = gcs_emulator.upload(bucket, "keys/000 x+y.bin", _data(0))["generation"]
    monkeypatch.setenv("FASTLOAD_HTTP_CLIENT", "aiohttp")
    assert Source(f"gs://{bucket}/keys/", options, Settings.from_env()).route is None
    fastload.stage(f"gs://{bucket}/keys/", storage_options=options, settings=Settings(cache_dir=cache, http_client="aiohttp"),
                   progress=False)
    monkeypatch.delenv("FASTLOAD_HTTP_CLIENT")
    listed = Source(f"gs://{bucket}/keys/", options).list()
    assert listed[0].version == generation and all(i.version.isdigit() for i in listed)  # generations, not etags
    before = _counts(gcs_emulator, bucket)
    assert _epoch(cache, options, f"gs://{bucket}/keys/") == [_data(i) for i in range(N)]
    assert _counts(gcs_emulator, bucket)[0] == before[0]  # no GET: the staged entries were found


def test_workers_fork_and_read_in_the_child(
        tmp_path: Path, gcs_emulator: _servers.GcsEmulator, bucket: str, capfd: pytest.CaptureFixture[str]) -> None:
    got = _epoch(tmp_path / "cache", gcs_emulator.storage_options(), _urls(bucket), num_workers=2)
    assert sorted(got) == sorted(_data(i) for i in range(N))
    assert _counts(gcs_emulator, bucket) == (N, 0)
    assert "Unclosed client session" not in capfd.readouterr().err


def test_an_unknown_option_keeps_gets_on_gcsfs_and_says_which(
        gcs_emulator: _servers.GcsEmulator, bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    options = gcs_emulator.storage_options() | {"version_aware": True}
    with caplog.at_level("INFO", logger="fastload"):
        src = Source(_urls(bucket)[0], options)
        assert src.route is None
    assert "'version_aware'" in caplog.text and "gcsfs" in caplog.text
    done, first = src.fetch_first(RemoteItem(_urls(bucket)[0], -1, ""), 100)
    assert (done.size, first) == (4000, bytes(100))
    assert _counts(gcs_emulator, bucket)[1] >= 1  # gcsfs sized it with a metadata request


# -- credentials, against a local server playing GCS and Google's token endpoint ---------------


class _FakeGoogle(ThreadingHTTPServer):
    """Answers media downloads to holders of :attr:`valid` (else 401, as GCS does), and hands out a
    new token per POST /token (google-auth's refresh). Records each Authorization it was sent."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.valid = "first-token"
        self.issued = 0
        self.seen: list[str] = []
        self.pages: list[str] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _FakeGoogle
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.issued += 1
            self.server.valid = f"refreshed-{self.server.issued}"
            token = self.server.valid
        self._send(200, json.dumps({"access_token": token, "expires_in": 3600, "token_type": "Bearer"}).encode(),
                   {"Content-Type": "application/json"})

    def do_GET(self) -> None:  # noqa: N802
        auth = self.headers.get("Authorization") or ""
        with self.server.lock:
            self.server.seen.append(auth)
            ok = auth == f"Bearer {self.server.valid}"
        if not ok:
            error = {"error": {"code": 401, "message": "Invalid Credentials", "errors": [{"reason": "authError"}]}}
            self._send(401, json.dumps(error).encode(), {"Content-Type": "application/json"})
            return
        if self.path.startswith("/storage/v1/b/bkt/o?"):  # objects.list of big/: two pages
            with self.server.lock:
                self.server.pages.append(self.path)
            second = "pageToken=next%2Fpage" in self.path
            names = ["big/2.bin"] if second else ["big/0.bin", "big/1.bin"]
            page: dict[str, Any] = {"kind": "storage#objects",
                                    "items": [{"name": n, "size": "3000", "generation": "17"} for n in names]}
            if not second:
                page["nextPageToken"] = "next/page"
            self._send(200, json.dumps(page).encode(), {"Content-Type": "application/json; charset=UTF-8"})
            return
        body = b"g" * 3000
        self._send(206, body[:100], {"Content-Range": "bytes 0-99/3000", "x-goog-generation": "1700000000000001",
                                     "ETag": "CIGAgICAgICAAQE="})


@pytest.fixture
def google() -> Iterator[_FakeGoogle]:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    server = _FakeGoogle()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _credentials(google: _FakeGoogle, token: str, expires_in_s: float) -> Any:
    from google.oauth2.credentials import Credentials

    expiry = (datetime.now(timezone.utc) + timedelta(seconds=expires_in_s)).replace(tzinfo=None)  # google-auth: naive UTC
    return Credentials(token=token, refresh_token="refresh", token_uri=f"{google.url}/token", client_id="id",
                       client_secret="client-secret", expiry=expiry)


def test_a_token_is_sent_and_the_generation_versions_the_object(google: _FakeGoogle) -> None:
    options = {"endpoint_url": google.url, "token": _credentials(google, "first-token", 3600), "project": "p"}
    src = Source("gs://bkt/a.bin", options)
    assert isinstance(src.route, GcsRoute)
    done, first = src.fetch_first(RemoteItem("gs://bkt/a.bin", -1, ""), 100)
    assert (done.size, done.version, first) == (3000, "1700000000000001", b"g" * 100)
    assert google.seen == ["Bearer first-token"] and google.issued == 0


def test_an_expiring_token_is_refreshed_between_batches_with_no_error(google: _FakeGoogle) -> None:
    from gcsfs.credentials import LOCAL_REFRESH_BUFFER

    # Valid for the first batch; within gcsfs's refresh buffer 2 s later, when GCS stops taking it.
    options = {"endpoint_url": google.url, "token": _credentials(google, "first-token", LOCAL_REFRESH_BUFFER + 2),
               "project": "p"}
    src = Source("gs://bkt/", options)
    items = [RemoteItem(f"gs://bkt/{i}.bin", -1, "") for i in range(3)]
    assert [d.size for d, _ in src.fetch_first_many(items, 100)] == [3000] * 3
    threading.Event().wait(2.5)
    with google.lock:
        google.valid = "expired-now"  # what GCS does once the hour is up
    assert [d.size for d, _ in src.fetch_first_many(items, 100)] == [3000] * 3
    assert google.issued == 1  # one refresh, through google-auth, before the second batch
    assert google.seen[3:] == ["Bearer refreshed-1"] * 3


def test_a_refused_token_is_a_credentials_error_naming_the_fix_without_the_token(google: _FakeGoogle) -> None:
    token = "ya29.revoked-3f9c1d"
    options = {"endpoint_url": google.url, "token": _credentials(google, token, 3600), "project": "p"}
    src = Source("gs://bkt/", options, Settings(retries=2, backoff_s=0.01))
    with pytest.raises(CredentialsError) as info:
        src.fetch_first(RemoteItem("gs://bkt/x/a.bin", -1, ""), 100)
    message = str(info.value)
    assert "gs://bkt/x/a.bin" in message and "HTTP 401" in message and "Invalid Credentials" in message
    assert "GOOGLE_APPLICATION_CREDENTIALS" in message and token not in message


def test_listing_fans_out_per_common_prefix_on_the_engine(
        tmp_path: Path, gcs_emulator: _servers.GcsEmulator, bucket: str) -> None:
    tree = {"top.bin": b"t", "a/1.bin": b"one", "a/b/2.bin": b"two", "c/3.bin": b"three"}
    for rel, data in tree.items():
        gcs_emulator.upload(bucket, f"tree/{rel}", data)
    pages = gcs_emulator.requests("GET", f"/storage/v1/b/{bucket}/o?")
    src = Source(f"gs://{bucket}/tree", gcs_emulator.storage_options())
    found, folders = src.find()
    assert isinstance(found, dict) and sorted(found) == sorted(tree) and folders == 3  # a/, a/b/, c/
    assert found["a/b/2.bin"] == RemoteItem(f"gs://{bucket}/tree/a/b/2.bin", 3, found["a/b/2.bin"].version)
    assert found["a/b/2.bin"].version.isdigit()  # the generation
    # One page per prefix (tree/, a/, a/b/, c/), each with delimiter=/ and only the fields an item needs.
    assert gcs_emulator.requests("GET", f"/storage/v1/b/{bucket}/o?delimiter=%2F&prefix=tree%2F") - pages >= 1
    assert gcs_emulator.requests("GET", f"/storage/v1/b/{bucket}/o?") - pages == 4
    ds = fastload.FileDataset(f"gs://{bucket}/tree/", pattern="a/**", storage_options=src.storage_options,
                              settings=Settings(cache_dir=tmp_path / "cache"))
    assert sorted(d for b in fastload.DataLoader(ds, batch_size=2) for d in b["data"]) == [b"one", b"two"]


def test_listing_follows_page_tokens_with_the_token_sent(google: _FakeGoogle) -> None:
    options = {"endpoint_url": google.url, "token": _credentials(google, "first-token", 3600), "project": "p"}
    found, folders = Source("gs://bkt/big", options).find()
    assert isinstance(found, dict)
    assert {rel: (i.size, i.version) for rel, i in found.items()} == {f"{k}.bin": (3000, "17") for k in range(3)}
    assert folders == 0 and len(google.pages) == 2 and "pageToken=next%2Fpage" in google.pages[1]
    assert all("delimiter=%2F" in p and "prefix=big%2F" in p for p in google.pages)
    assert google.seen == ["Bearer first-token"] * 2
