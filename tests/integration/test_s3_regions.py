"""A bucket's region is learned from the first answer that names it, then every GET goes there at once
(issue 34, item 2).

The store is a stand-in for S3's regional behaviour on 127.0.0.1 (path style): a request signed for
another region than its bucket's is answered as S3 answers it, a 301 with ``x-amz-bucket-region``
(no region in the body: the fast road asks a HeadBucket) or a 400 ``AuthorizationHeaderMalformed``
naming the ``<Region>``; one signed for the bucket's region is served (Range, ETag). It checks the
signature's region only (moto's server checks whole signatures: test_s3_signed.py).
"""

from __future__ import annotations

import hashlib
import http.server
import multiprocessing
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from fastload.source import Source, s3_resolve
from fastload.source.items import RemoteItem
from fastload.transport import curl

pytestmark = pytest.mark.integration

BUCKETS = {"west": ("us-west-2", "header"), "euro": ("eu-west-1", "body")}  # bucket -> (its region, how it says so)
OBJECTS = {f"k{i}": bytes([i]) * (3000 + i) for i in range(6)}
_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/([a-z0-9-]+)/s3/aws4_request")


class _Regional(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    log: list[tuple[str, str, str]]  # (method, path, signed region), set on the class per server

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self) -> None:
        found = _SCOPE.search(self.headers.get("Authorization", ""))
        signed = found.group(1) if found else ""
        path = self.path.split("?", 1)[0]
        self.log.append((self.command, path, signed))
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket not in BUCKETS:
            self._answer(404, {}, b"<Error><Code>NoSuchBucket</Code></Error>")
            return
        region, how = BUCKETS[bucket]
        if signed != region:
            if how == "body" and self.command == "GET":
                body = (f"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region '{signed}' is wrong; "
                        f"expecting '{region}'</Message><Region>{region}</Region></Error>").encode()
                self._answer(400, {"Content-Type": "application/xml"}, body)
            else:
                body = b"<Error><Code>PermanentRedirect</Code><Message>use the bucket's endpoint</Message></Error>"
                self._answer(301, {"x-amz-bucket-region": region, "Content-Type": "application/xml"}, body)
            return
        if not key:  # HeadBucket
            self._answer(200, {"x-amz-bucket-region": region})
            return
        data = OBJECTS.get(key)
        if data is None:
            self._answer(404, {}, b"<Error><Code>NoSuchKey</Code></Error>")
            return
        etag = f'"{hashlib.md5(data).hexdigest()}"'  # noqa: S324 - an ETag, as S3's
        common = {"ETag": etag, "Last-Modified": "Wed, 02 Dec 2026 00:00:00 GMT", "Accept-Ranges": "bytes",
                  "x-amz-bucket-region": region}
        ranged = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if ranged and self.command == "GET":
            start = int(ranged.group(1))
            end = min(int(ranged.group(2) or len(data) - 1), len(data) - 1)
            self._answer(206, {**common, "Content-Range": f"bytes {start}-{end}/{len(data)}"}, data[start:end + 1])
        else:
            self._answer(200, common, data if self.command == "GET" else b"")
            if self.command == "HEAD":
                return

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        found = _SCOPE.search(self.headers.get("Authorization", ""))
        bucket, _, key = self.path.split("?", 1)[0].lstrip("/").partition("/")
        if bucket in BUCKETS and found and found.group(1) == BUCKETS[bucket][0] and key in OBJECTS:
            self.log.append(("HEAD", self.path, found.group(1)))
            data = OBJECTS[key]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')  # noqa: S324
            self.send_header("Last-Modified", "Wed, 02 Dec 2026 00:00:00 GMT")
            self.end_headers()
            return
        self._serve()


@pytest.fixture
def regional() -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    log: list[tuple[str, str, str]] = []
    handler = type("Handler", (_Regional,), {"log": log})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", log
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def options(regional: tuple[str, list[Any]], no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    monkeypatch.setattr(s3_resolve, "_LEARNED", {})
    return {"key": "AKID", "secret": "secret", "client_kwargs": {"endpoint_url": regional[0], "region_name": "us-east-1"}}


def _items(bucket: str, keys: list[str]) -> list[RemoteItem]:
    return [RemoteItem(f"s3://{bucket}/{k}", -1, "") for k in keys]


def _gets(log: list[tuple[str, str, str]], start: int) -> list[tuple[str, str, str]]:
    return log[start:]


@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_after_the_first_answer_each_object_is_one_get_in_the_buckets_region(
        bucket: str, regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    region = BUCKETS[bucket][0]
    src = Source(f"s3://{bucket}/k0", options)
    first = src.fetch_first_many(_items(bucket, ["k0"]), 1 << 20)
    assert first[0][1] == OBJECTS["k0"] and first[0][0].size == len(OBJECTS["k0"])
    assert log[0] == ("GET", f"/{bucket}/k0", "us-east-1")  # the configured region, refused
    mark = len(log)
    rest = sorted(OBJECTS)[1:]
    got = src.fetch_first_many(_items(bucket, rest), 1 << 20)
    assert [data for _, data in got] == [OBJECTS[k] for k in rest]
    assert sorted(log[mark:]) == sorted(("GET", f"/{bucket}/{k}", region) for k in rest)  # one request per object


def test_buckets_in_two_regions_keep_their_own_routes_in_one_source(
        regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    src = Source("s3://west/k0", options)
    for bucket in BUCKETS:
        src.fetch_first_many(_items(bucket, ["k0"]), 1 << 20)  # each learns its own region
    mark = len(log)
    mixed = [item for k in sorted(OBJECTS)[1:] for item in (*_items("west", [k]), *_items("euro", [k]))]
    got = src.fetch_first_many(mixed, 1 << 20)
    assert [data for _, data in got] == [OBJECTS[i.url.rsplit("/", 1)[1]] for i in mixed]
    assert sorted(log[mark:]) == sorted(("GET", i.url[len("s3:/"):], BUCKETS[i.url.split("/")[2]][0]) for i in mixed)


def _child(url: str, options: dict[str, Any], keys: list[str], out: Any) -> None:
    src = Source(url, options)
    out.put([bytes(data) for _, data in src.fetch_first_many(_items("west", keys), 1 << 20)])


def test_a_forked_worker_starts_with_the_learned_region(
        regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    Source("s3://west/k0", options).fetch_first_many(_items("west", ["k0"]), 1 << 20)
    mark = len(log)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=("s3://west/k1", options, ["k1", "k2"], out))
    child.start()
    got = out.get(timeout=60)
    child.join(60)
    assert got == [OBJECTS["k1"], OBJECTS["k2"]]
    assert sorted(log[mark:]) == [("GET", "/west/k1", "us-west-2"), ("GET", "/west/k2", "us-west-2")]


def test_a_batch_refused_together_asks_the_buckets_region_once(
        regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    src = Source("s3://west/k0", options)
    got = src.fetch_first_many(_items("west", sorted(OBJECTS)), 1 << 20)  # all out before the first answer
    assert [data for _, data in got] == [OBJECTS[k] for k in sorted(OBJECTS)]
    head_buckets = [entry for entry in log if entry[:2] == ("HEAD", "/west")]
    # One HeadBucket, not one per GET: its 301 names the region, and botocore follows it there once.
    assert head_buckets == [("HEAD", "/west", "us-east-1"), ("HEAD", "/west", "us-west-2")]
