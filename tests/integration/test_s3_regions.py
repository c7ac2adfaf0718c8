"""A bucket's region is learned from the first answer that names it (a 301, 400 or 307), then every GET
and listing page goes there at once, and the refused ones are redone there (issue 34, item 2).

The store is a stand-in for S3's regional behaviour on 127.0.0.1 (path style): a request signed for
another region than its bucket's is answered as S3 answers it, a 301 with ``x-amz-bucket-region``
(no region in the body: the fast road asks a HeadBucket), a 400 ``AuthorizationHeaderMalformed``
naming the ``<Region>``, or (a bucket made recently, asked at the global endpoint) a 307 whose
``Location`` names another host; one signed for the bucket's region is served (Range, ETag,
ListObjectsV2 pages of ``PAGE`` entries), an unsigned one refused (a private bucket's
``AccessDenied``). It checks the signature's region only (moto's server checks whole signatures:
test_s3_signed.py).
"""

from __future__ import annotations

import hashlib
import http.server
import multiprocessing
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

import pytest

import fastload
from fastload.config import Settings
from fastload.errors import CredentialsError
from fastload.source import Source, s3, s3_resolve
from fastload.source.items import RemoteItem
from fastload.transport import curl

pytestmark = pytest.mark.integration

# bucket -> (its region, how it says so to a request signed for another: 301, 400, 307)
BUCKETS = {"west": ("us-west-2", "header"), "euro": ("eu-west-1", "body"), "fresh": ("us-west-2", "temporary")}
LOCKED = "locked"  # in the configured region (us-east-1), its objects refused to these keys: AccessDenied
OBJECTS = {f"k{i}": bytes([i]) * (3000 + i) for i in range(6)}  # read by key
TREE = {"d/a0": b"a0" * 700, "d/a1": b"a1" * 800, "d/a2": b"a2" * 900, "d/sub/b0": b"b0" * 1000}  # listed under d/
STORE = {**OBJECTS, **TREE}
PAGE = 2  # keys and common prefixes per listing page: d/ lists in two pages, d/sub/ in one
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
        path, _, query = self.path.partition("?")
        listing = self.command == "GET" and "list-type" in parse_qs(query)
        self.log.append((self.command, self.path if listing else path, signed))  # a page by its query
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket not in BUCKETS and bucket != LOCKED:
            self._answer(404, {}, b"<Error><Code>NoSuchBucket</Code></Error>")
            return
        region, how = BUCKETS.get(bucket, ("us-east-1", "denies"))
        # Unsigned (a 307 followed by a client that drops the Authorization on the way to another host), or denied.
        if not signed or (how == "denies" and key):
            self._answer(403, {"Content-Type": "application/xml"}, b"<Error><Code>AccessDenied</Code></Error>")
            return
        if signed != region:
            if how == "temporary":  # S3's global endpoint while a new bucket's name propagates
                body = (b"<Error><Code>TemporaryRedirect</Code><Message>Please re-send this request to the specified "
                        b"temporary endpoint.</Message></Error>")
                port = str(self.headers.get("Host", "")).rsplit(":", 1)[-1]
                moved = f"http://localhost:{port}{self.path}"  # another host name, as S3's
                self._answer(307, {"Location": moved, "x-amz-bucket-region": region, "Content-Type": "application/xml"},
                             body)
            elif how == "body" and self.command == "GET":
                body = (f"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region '{signed}' is wrong; "
                        f"expecting '{region}'</Message><Region>{region}</Region></Error>").encode()
                self._answer(400, {"Content-Type": "application/xml"}, body)
            else:
                body = b"<Error><Code>PermanentRedirect</Code><Message>use the bucket's endpoint</Message></Error>"
                self._answer(301, {"x-amz-bucket-region": region, "Content-Type": "application/xml"}, body)
            return
        if listing:
            self._answer(200, {"Content-Type": "application/xml"}, _page(bucket, parse_qs(query)))
            return
        if not key:  # HeadBucket
            self._answer(200, {"x-amz-bucket-region": region})
            return
        data = STORE.get(key)
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
        if bucket in BUCKETS and found and found.group(1) == BUCKETS[bucket][0] and key in STORE:
            self.log.append(("HEAD", self.path, found.group(1)))
            data = STORE[key]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')  # noqa: S324
            self.send_header("Last-Modified", "Wed, 02 Dec 2026 00:00:00 GMT")
            self.end_headers()
            return
        self._serve()


def _page(bucket: str, query: dict[str, list[str]]) -> bytes:
    """One ListObjectsV2 page: ``PAGE`` keys and common prefixes (``delimiter=/``; s3fs's find lists with
    none), then a continuation token."""
    prefix, delimiter = query.get("prefix", [""])[0], query.get("delimiter", [""])[0]
    entries = sorted({k if not delimiter or delimiter not in k[len(prefix):] else
                      prefix + k[len(prefix):].split(delimiter, 1)[0] + delimiter for k in STORE if k.startswith(prefix)})
    start = int(query.get("continuation-token", ["0"])[0])
    shown, more = entries[start:start + PAGE], start + PAGE < len(entries)
    xml = [f"<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>{bucket}</Name>"
           f"<Prefix>{escape(prefix)}</Prefix><KeyCount>{len(shown)}</KeyCount><MaxKeys>{PAGE}</MaxKeys>"
           f"<Delimiter>{escape(delimiter)}</Delimiter><IsTruncated>{str(more).lower()}</IsTruncated>"]
    for name in shown:
        if name.endswith("/"):
            xml.append(f"<CommonPrefixes><Prefix>{escape(name)}</Prefix></CommonPrefixes>")
        else:
            etag = hashlib.md5(STORE[name]).hexdigest()  # noqa: S324 - an ETag, as S3's
            xml.append(f"<Contents><Key>{escape(name)}</Key><LastModified>2026-12-02T00:00:00.000Z</LastModified>"
                       f"<ETag>&quot;{etag}&quot;</ETag><Size>{len(STORE[name])}</Size>"
                       "<StorageClass>STANDARD</StorageClass></Contents>")
    if more:
        xml.append(f"<NextContinuationToken>{start + PAGE}</NextContinuationToken>")
    return ('<?xml version="1.0" encoding="UTF-8"?>' + "".join(xml) + "</ListBucketResult>").encode()


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


@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_a_batch_refused_together_asks_the_buckets_region_once_and_is_redone_on_its_route(
        bucket: str, regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    region, how = BUCKETS[bucket]
    src = Source(f"s3://{bucket}/k0", options)
    keys = sorted(OBJECTS)
    got = src.fetch_first_many(_items(bucket, keys), 1 << 20)  # all out before the first answer
    assert [data for _, data in got] == [OBJECTS[k] for k in keys]
    head_buckets = [entry for entry in log if entry[:2] == ("HEAD", f"/{bucket}")]
    # One HeadBucket, not one per GET (none where the answer names the region): botocore follows its
    # 301 or 307 to the bucket's region once.
    assert head_buckets == ([] if how == "body" else [("HEAD", f"/{bucket}", "us-east-1"), ("HEAD", f"/{bucket}", region)])
    # Each refused GET is redone on the learned route (one GET signed for the region), not on s3fs (a HEAD, then a GET).
    objects = [entry for entry in log if entry[1].startswith(f"/{bucket}/")]
    assert sorted(e for e in objects if e[2] == region) == sorted(("GET", f"/{bucket}/{k}", region) for k in keys)
    # A 307's Location is not followed (libcurl would send the GET there without its Authorization): no unsigned GET.
    assert [entry for entry in log if not entry[2]] == []


def test_a_genuine_access_denied_asks_the_buckets_region_once_and_stays_a_credentials_error(
        regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    src = Source(f"s3://{LOCKED}/k0", options)
    for _ in range(2):
        with pytest.raises(CredentialsError, match="AccessDenied"):
            src.fetch_first_many(_items(LOCKED, sorted(OBJECTS)), 1 << 20)
    # Its region is the configured one: the refusal stands. One HeadBucket in all, not one per GET.
    assert [entry for entry in log if entry[0] == "HEAD"] == [("HEAD", f"/{LOCKED}", "us-east-1")]


def test_a_307_the_engine_did_not_follow_moves_the_bucket_to_its_region(
        regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    # As botocore, a 307 (the engine does not follow an S3 route's redirects) is a wrong region too: the
    # bucket's region is asked (HeadBucket), and its route moves there.
    route = Source("s3://fresh/k0", options).route
    assert isinstance(route, s3.S3Route)
    err = curl.HttpStatusError(307, "s3://fresh/k0", b"<Error><Code>TemporaryRedirect</Code></Error>")
    assert route.learn("s3://fresh/k0", err)
    moved = route.of("fresh")
    assert moved is not None and moved.region == "us-west-2"
    _, lines = moved.sign([moved.wire("s3://fresh/k0")], [])
    assert lines is not None and lines[0].split("/")[2] == "us-west-2"  # signed for it


def _page_path(bucket: str, prefix: str, token: str = "") -> str:
    """A ListObjectsV2 page's path and query, as the fast road sends it (sorted, encoded: S3Route.list_url)."""
    token = f"continuation-token={token}&" if token else ""
    return f"/{bucket}?{token}delimiter=%2F&list-type=2&prefix={prefix.replace('/', '%2F')}"


@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_a_prefix_lists_in_the_buckets_region_at_one_request_per_page_after_the_first_answer(
        bucket: str, regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    region, how = BUCKETS[bucket]
    items = Source(f"s3://{bucket}/d/", options).list()
    assert sorted((i.url, i.size) for i in items) == sorted((f"s3://{bucket}/{k}", len(v)) for k, v in TREE.items())
    root = _page_path(bucket, "d/")
    refused = [("GET", root, "us-east-1")]  # a 307 is not followed (as botocore): no unsigned page to the new host
    asked = [] if how == "body" else [("HEAD", f"/{bucket}", "us-east-1"), ("HEAD", f"/{bucket}", region)]
    assert log[:len(refused) + len(asked)] == refused + asked
    # The root page again, signed for the bucket's region, then its continuation and d/sub/: one request each,
    # and nothing through s3fs (whose pages ask encoding-type=url).
    assert sorted(log[len(refused) + len(asked):]) == sorted(
        [("GET", root, region), ("GET", _page_path(bucket, "d/", "2"), region), ("GET", _page_path(bucket, "d/sub/"), region)])


@pytest.mark.parametrize("bucket", ["west", "euro"])
def test_a_prefix_dataset_of_a_bucket_in_another_region_reads_each_object_with_one_get(
        bucket: str, tmp_path: Path, regional: tuple[str, list[tuple[str, str, str]]], options: dict[str, Any]) -> None:
    _, log = regional
    region = BUCKETS[bucket][0]
    ds = fastload.FileDataset(f"s3://{bucket}/d/", storage_options=options, settings=Settings(cache_dir=tmp_path / "cache"))
    got = {url: data for batch in fastload.DataLoader(ds, batch_size=2) for url, data in zip(batch["url"], batch["data"])}
    assert got == {f"s3://{bucket}/{k}": v for k, v in TREE.items()}
    reads = [entry for entry in log if entry[1].startswith(f"/{bucket}/")]
    assert sorted(reads) == sorted(("GET", f"/{bucket}/{k}", region) for k in TREE)  # no HEAD, no s3fs
    assert [entry for entry in log if "list-type" in entry[1] and entry[2] != region] == [("GET", _page_path(bucket, "d/"),
                                                                                          "us-east-1")]
