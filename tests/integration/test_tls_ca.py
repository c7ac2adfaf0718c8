"""A private CA, given the ways users give it, on libcurl's road (issue 34, item 3), and the HTTP/2 choice.

Each server's certificate is signed by a throwaway CA (tests/integration/_tls.py) that
nothing trusts until a test names it. With the CA named (SSL_CERT_FILE in a fresh
process, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, a route's ``cainfo``) the first-block GETs
go over the engine and verify; with ``ssl=False`` (``verify=False``) they go over it
unverified; with no CA they fail with the untrusted-certificate error
(tests/integration/test_tls_untrusted.py). A GET whose answer would be redone on the
other road fails the test wherever the road is the point.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload._servers.ports import free_port, wait_listening
from fastload.config import Settings
from fastload.errors import CertificateError, ConfigError
from fastload.source import RemoteItem, Source, gcs
from fastload.transport import curl

pytest.importorskip("cryptography")

import _tls  # noqa: E402 - needs cryptography, checked above

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(curl.engine() is None, reason=f"no curl engine here: {curl.unavailable()}"),
]

N = 4
CA_ENV = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def _data(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (100 + i)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return _tls.make_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def no_ca_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CA_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def https_url(tmp_path: Path, ca: tuple[Path, Path, Path]) -> Iterator[str]:
    """A fresh HTTPS file server (a host of its own: one that failed verification goes to aiohttp for good)."""
    root = tmp_path / "www"
    root.mkdir()
    for i in range(N):
        (root / f"f{i}.bin").write_bytes(_data(i))
    with _tls.https_files(root, ca[1], ca[2]) as url:
        yield url


def _urls(base: str) -> list[str]:
    return [f"{base}/f{i}.bin" for i in range(N)]


def _on_engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_aiohttp(self: Source, item: Any, nbytes: int) -> Any:
        raise AssertionError(f"{item.url}: the GET left libcurl's engine")

    monkeypatch.setattr(Source, "_fetch_first", not_aiohttp)


def _epoch(tmp_path: Path, urls: list[str], options: dict[str, Any] | None = None) -> list[bytes]:
    ds = fastload.FileDataset(urls, storage_options=options or {}, settings=Settings(cache_dir=tmp_path / "cache", retries=1))
    return [d for batch in fastload.DataLoader(ds, batch_size=2) for d in batch["data"]]


# -- HTTP ----------------------------------------------------------------------------------------


def test_no_ca_given_is_the_untrusted_certificate_error(https_url: str, tmp_path: Path, no_ca_env: None) -> None:
    src = Source(_urls(https_url)[0], settings=Settings(cache_dir=tmp_path / "cache"))
    assert src.route is not None and src.route.cainfo is None and src.route.verify
    with pytest.raises(CertificateError, match="not trusted"):
        src.fetch_first(RemoteItem(_urls(https_url)[0], -1, ""), 100)


@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"])
def test_a_ca_bundle_named_as_requests_and_curl_read_it_verifies_on_the_engine(
        variable: str, https_url: str, ca: tuple[Path, Path, Path], tmp_path: Path, no_ca_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, str(ca[0]))
    route = Source(_urls(https_url)[0]).route
    assert route is not None and route.cainfo is not None and route.verify
    assert ca[0].read_bytes().strip() in Path(route.cainfo).read_bytes()  # with the system's CAs, in one file
    _on_engine_only(monkeypatch)
    assert _epoch(tmp_path, _urls(https_url)) == [_data(i) for i in range(N)]


def test_requests_ca_bundle_before_curl_ca_bundle_and_a_folder_of_cas(
        https_url: str, ca: tuple[Path, Path, Path], tmp_path: Path, no_ca_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """requests reads REQUESTS_CA_BUNDLE first, and takes a folder as a folder of hashed CA files."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl (the command) names a CA folder's files by hash; not installed")
    folder = tmp_path / "cas"
    folder.mkdir()
    digest = subprocess.run([openssl, "x509", "-hash", "-noout", "-in", str(ca[0])], capture_output=True, text=True,
                            check=True).stdout.strip()
    shutil.copy(ca[0], folder / f"{digest}.0")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(folder))
    monkeypatch.setenv("CURL_CA_BUNDLE", str(tmp_path / "not-read.pem"))
    route = Source(_urls(https_url)[0]).route
    assert route is not None and route.capath is not None and str(folder) in route.capath.split(":")
    assert route.cainfo is None or "not-read" not in route.cainfo
    _on_engine_only(monkeypatch)
    assert _epoch(tmp_path, _urls(https_url)) == [_data(i) for i in range(N)]


def test_a_ca_bundle_variable_that_names_nothing_is_a_config_error(
        https_url: str, tmp_path: Path, no_ca_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CURL_CA_BUNDLE", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="CURL_CA_BUNDLE=.*missing.pem.*names no CA bundle"):
        _ = Source(_urls(https_url)[0]).route


def test_ssl_false_reads_a_private_ca_server_unverified_on_the_engine(
        https_url: str, tmp_path: Path, no_ca_env: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    options = {"ssl": False}  # aiohttp's per-request option; fsspec passes it to every request
    with caplog.at_level("WARNING", logger="fastload"):
        route = Source(_urls(https_url)[0], options).route
    assert route is not None and not route.verify and "ssl=False" in caplog.text
    _on_engine_only(monkeypatch)
    assert _epoch(tmp_path, _urls(https_url), options) == [_data(i) for i in range(N)]


def test_an_ssl_context_stays_on_aiohttp_and_is_honoured_there(
        https_url: str, ca: tuple[Path, Path, Path], tmp_path: Path, no_ca_env: None) -> None:
    """What an SSLContext trusts cannot be read back whole (a CA folder loads lazily): aiohttp applies it."""
    options = {"ssl": ssl.create_default_context(cafile=str(ca[0]))}
    assert Source(_urls(https_url)[0], options).route is None
    assert _epoch(tmp_path, _urls(https_url), options) == [_data(i) for i in range(N)]


_FRESH = textwrap.dedent("""
    import hashlib, json, sys
    import fastload
    from fastload.config import Settings
    from fastload.source import Source
    from fastload.transport import curl

    urls, options, cache = json.loads(sys.argv[1])
    route = Source(urls[0], options).route
    def not_other_road(self, item, nbytes):
        raise AssertionError(item.url + ": the GET left libcurl's engine")
    Source._fetch_first = not_other_road
    ds = fastload.FileDataset(urls, storage_options=options, settings=Settings(cache_dir=cache, retries=1))
    got = [bytes(d) for b in fastload.DataLoader(ds, batch_size=2) for d in b["data"]]
    print(json.dumps({"route": type(route).__name__, "cainfo": route and route.cainfo,
                      "sha": [hashlib.sha256(d).hexdigest() for d in got]}))
""")


def _fresh_process(urls: list[str], options: dict[str, Any], cache: Path, env: dict[str, str]) -> dict[str, Any]:
    """Read ``urls`` in a new Python (the engine reads SSL_CERT_FILE once, when it starts)."""
    base = {k: v for k, v in os.environ.items() if k not in CA_ENV}
    proc = subprocess.run([sys.executable, "-c", _FRESH, json.dumps([urls, options, str(cache)])], cwd=ROOT,
                          env={**base, **env}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("others", [False, True])
def test_ssl_cert_file_is_trusted_on_the_engine(
        others: bool, https_url: str, ca: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """SSL_CERT_FILE holds beside REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE (``others``: each names another CA, as
    machines that set all of them to the system's bundle do): the route trusts both, one file of them."""
    env = {"SSL_CERT_FILE": str(ca[0])}
    if others:
        other = _tls.make_ca(tmp_path)[0]
        env |= {"REQUESTS_CA_BUNDLE": str(other), "CURL_CA_BUNDLE": str(other)}
    out = _fresh_process(_urls(https_url), {}, tmp_path / "cache", env)
    assert out["route"] == "CurlRoute"
    assert (out["cainfo"] is None) == (not others)  # alone: the engine's own, Python ssl's defaults
    assert out["sha"] == [hashlib.sha256(_data(i)).hexdigest() for i in range(N)]


def test_a_ca_bundle_variable_holds_where_ssl_cert_dir_names_the_system_s(
        https_url: str, ca: tuple[Path, Path, Path], tmp_path: Path, no_ca_env: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers often set SSL_CERT_DIR to the system's folder; a private CA in REQUESTS_CA_BUNDLE must
    still be trusted, on both roads (it was ignored on libcurl's: error 60)."""
    from fsspec.implementations.http import HTTPFileSystem

    if not os.path.isdir("/etc/ssl/certs"):
        pytest.skip("no /etc/ssl/certs here to name in SSL_CERT_DIR")
    monkeypatch.setenv("SSL_CERT_DIR", "/etc/ssl/certs")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca[0]))
    HTTPFileSystem.clear_instance_cache()
    _on_engine_only(monkeypatch)
    assert _epoch(tmp_path, _urls(https_url)) == [_data(i) for i in range(N)]


# -- S3 and GCS behind TLS -------------------------------------------------------------------------


def test_an_s3_route_with_a_ca_or_without_verification_reads_on_the_engine(
        moto_server: _servers.MotoServer, s3_bucket: str, ca: tuple[Path, Path, Path], tmp_path: Path,
        no_aws_env: None, no_ca_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine side of an S3 route's ``cainfo`` and ``verify`` (fastload.source.s3 fills them in)."""
    import boto3

    boto3.client("s3", endpoint_url=moto_server.endpoint_url, aws_access_key_id="a", aws_secret_access_key="b",
                 region_name="us-east-1").put_object(Bucket=s3_bucket, Key="k/x.bin", Body=_data(7),
                                                       ACL="public-read")
    url = f"s3://{s3_bucket}/k/x.bin"
    with _tls.tls_front((moto_server.host, int(moto_server.port or 0)), ca[1], ca[2]) as front:
        options = {"anon": True, "client_kwargs": {"endpoint_url": front, "region_name": "us-east-1"}}
        routes = []
        for change in ({"cainfo": str(ca[0])}, {"verify": False}, {}):
            src = Source(url, options, settings=Settings(cache_dir=tmp_path / "cache", retries=1))
            assert src.route is not None
            src.__dict__["route"] = dataclasses.replace(src.route, **change)  # Source.route is a cached_property
            routes.append(src)
        _on_engine_only(monkeypatch)
        for src in routes[:2]:
            assert src.fetch_first(RemoteItem(url, -1, ""), 1 << 20)[1] == _data(7)
        (pending,) = routes[2]._curl_first([RemoteItem(url, -1, "")], 100) or [None]
        with pytest.raises(ConnectionError, match="libcurl error 60"):  # the CA given before carried over to nothing
            pending.result(timeout=30)


def test_gcs_trusts_ssl_cert_file_on_the_engine(
        gcs_emulator: _servers.GcsEmulator, ca: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """gcsfs's aiohttp trusts what Python's ssl does (SSL_CERT_FILE); the GCS route's GETs the same."""
    bucket = f"tls-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    gcs_emulator.create_bucket(bucket)
    for i in range(N):
        gcs_emulator.upload(bucket, f"k/{i}.bin", _data(i))
    with _tls.tls_front((gcs_emulator.host, int(gcs_emulator.port or 0)), ca[1], ca[2]) as front:
        options = {**gcs_emulator.storage_options(), "endpoint_url": front}
        out = _fresh_process([f"gs://{bucket}/k/{i}.bin" for i in range(N)], options, tmp_path / "cache",
                             {"SSL_CERT_FILE": str(ca[0])})
    assert out["route"] == "GcsRoute"
    assert out["sha"] == [hashlib.sha256(_data(i)).hexdigest() for i in range(N)]


def test_a_gcs_session_of_the_users_own_keeps_its_gets_on_gcsfs_by_name() -> None:
    """gcsfs takes a CA (or ssl=False) only in an aiohttp connector in session_kwargs: libcurl cannot read it."""
    route, why = gcs.route_for(None, {"token": "anon", "session_kwargs": {"connector": object()}}, "auto")
    assert route is None and why == "storage option 'session_kwargs' is honoured by gcsfs only"


# -- nginx over TLS: connection reuse, and HTTP/2 ------------------------------------------------------


class _TlsNginx:
    """nginx with ``ssl http2`` on a free port over ``root``; its access log names each request's protocol."""

    def __init__(self, root: Path, cert: Path, key: Path, work: Path) -> None:
        self.log = work / "access.log"
        self.port = free_port("127.0.0.1")
        conf = work / "nginx.conf"
        temp = "\n".join(f"    {k}_temp_path {work / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        user = "user root;" if os.geteuid() == 0 else ""
        conf.write_text(f"""
daemon off;
worker_processes 1;
pid {work / 'nginx.pid'};
error_log {work / 'error.log'} warn;
{user}
events {{ worker_connections 256; }}
http {{
    log_format proto '$request_uri $server_protocol';
    access_log {self.log} proto;
{temp}
    server {{
        listen 127.0.0.1:{self.port} ssl http2;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        root {root};
        location / {{ etag on; }}
    }}
}}
""")
        self.proc = subprocess.Popen([_servers.find_nginx() or "nginx", "-p", str(work), "-c", str(conf), "-e",
                                      str(work / "error.log")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.url = f"https://127.0.0.1:{self.port}"
        try:
            wait_listening("127.0.0.1", self.port, self.proc, "nginx (TLS)", work / "error.log")
        except Exception:
            self.stop()
            raise

    def protocols(self) -> dict[str, str]:
        """Each path asked for -> the protocol it was asked over (nginx writes the log as it answers)."""
        lines = self.log.read_text().split("\n") if self.log.exists() else []
        return dict(line.split(" ", 1) for line in lines if " " in line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def tls_nginx(tmp_path: Path, ca: tuple[Path, Path, Path], nginx_server: Any) -> Iterator[_TlsNginx]:
    # nginx_server: skips (or fails, under FASTLOAD_REQUIRE_SERVERS=1) where nginx is missing; its own
    # servers speak plain HTTP, so this one is started here, with ssl and http2.
    root, work = tmp_path / "www", tmp_path / "nginx"
    root.mkdir()
    work.mkdir()
    for i in range(3 * N):
        (root / f"f{i}.bin").write_bytes(_data(i))
    server = _TlsNginx(root, ca[1], ca[2], work)
    yield server
    server.stop()


def _read(src: Source, route: curl.CurlRoute, names: list[str], base: str) -> list[Any]:
    """The first-block GETs of ``names`` on ``route``, each one's answer (or the error it raised)."""
    urls = [f"{base}/{n}" for n in names]
    limit = src.limit_of(urls[0])
    assert limit is not None
    pendings = route.start(urls, 1 << 20, 30.0, limit, threading.Event())
    out: list[Any] = []
    for p in pendings:
        try:
            out.append(p.result(timeout=30)[1])
        except Exception as err:  # noqa: BLE001 - the error is the answer here
            out.append(err)
    return out


def _until_logged(server: _TlsNginx, paths: list[str]) -> dict[str, str]:
    deadline = time.monotonic() + 10
    while not set(paths) <= set(server.protocols()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.protocols()


def test_http2_is_asked_for_only_when_the_route_says_so(
        tls_nginx: _TlsNginx, ca: tuple[Path, Path, Path], tmp_path: Path, no_ca_env: None) -> None:
    """HTTP/2 first: libcurl asks for it when it connects (ALPN), and a request that wants HTTP/2 takes an
    idle HTTP/1.1 connection to its host as it is; one that wants HTTP/1.1 takes no HTTP/2 connection."""
    src = Source(tls_nginx.url + "/", settings=Settings(cache_dir=tmp_path / "cache"))
    assert src.route is not None and src.route.http2 is False
    plain = dataclasses.replace(src.route, cainfo=str(ca[0]))
    assert _read(src, dataclasses.replace(plain, http2=True), ["f0.bin", "f1.bin"], tls_nginx.url) == [_data(0), _data(1)]
    assert _read(src, plain, ["f2.bin", "f3.bin"], tls_nginx.url) == [_data(2), _data(3)]
    seen = _until_logged(tls_nginx, [f"/f{i}.bin" for i in range(4)])
    assert [seen[f"/f{i}.bin"] for i in range(4)] == ["HTTP/2.0", "HTTP/2.0", "HTTP/1.1", "HTTP/1.1"], seen


@pytest.mark.parametrize("http2", [False, True])
def test_a_connection_made_unverified_is_not_reused_by_a_verifying_route(
        http2: bool, tls_nginx: _TlsNginx, ca: tuple[Path, Path, Path], tmp_path: Path, no_ca_env: None) -> None:
    """Three routes to one host, one after another on the same engine: a connection (and an easy handle)
    of the route that does not verify, or of the one given the CA, serves no route that has neither."""
    src = Source(tls_nginx.url + "/", settings=Settings(cache_dir=tmp_path / "cache"))
    assert src.route is not None
    off = dataclasses.replace(src.route, verify=False, http2=http2)
    given = dataclasses.replace(src.route, cainfo=str(ca[0]), http2=http2)
    neither = dataclasses.replace(src.route, http2=http2)
    assert _read(src, off, ["f0.bin", "f1.bin"], tls_nginx.url) == [_data(0), _data(1)]
    assert _read(src, given, ["f2.bin", "f3.bin"], tls_nginx.url) == [_data(2), _data(3)]
    refused = _read(src, neither, ["f4.bin", "f5.bin"], tls_nginx.url)
    assert all(isinstance(r, ConnectionError) and "libcurl error 60" in str(r) for r in refused), refused
    assert "/f4.bin" not in tls_nginx.protocols()  # no request was sent over a connection it must not trust


def test_a_ca_bundle_variable_is_trusted_by_aiohttp_too_for_what_libcurl_does_not_send(
        ca: tuple[Path, Path, Path], tmp_path: Path, no_ca_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file larger than a block has its later blocks fetched by aiohttp: REQUESTS_CA_BUNDLE must
    hold there as on libcurl's first-block GETs (transport/tls.py), or the read fails as untrusted."""
    from fsspec.implementations.http import HTTPFileSystem

    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca[0]))
    HTTPFileSystem.clear_instance_cache()  # an earlier test's filesystem holds a session made without the CA
    root = tmp_path / "big"
    root.mkdir()
    files = {f"b{i}.bin": os.urandom(20_000 + i) for i in range(2)}  # five blocks of 4 KiB each
    for name, data in files.items():
        (root / name).write_bytes(data)
    with _tls.https_files(root, ca[1], ca[2]) as base:
        ds = fastload.FileDataset([f"{base}/{n}" for n in files],
                                  settings=Settings(cache_dir=tmp_path / "cache", retries=1, block_bytes=4096))
        assert [bytes(ds[i]["data"]) for i in range(len(files))] == list(files.values())
