"""The test servers themselves: real nginx, moto S3 and a kernel-shaped link."""

from __future__ import annotations

import email.utils
import socket
import subprocess
import sys
import time
import urllib.request

import fsspec
import psutil
import pytest

from fastload import _servers

pytestmark = pytest.mark.integration

# Every byte differs from its neighbours, so a shifted range cannot compare equal.
PAYLOAD = bytes(range(256)) * 40


def test_nginx_serves_byte_ranges_through_fsspec(tmp_path, nginx_server):
    (tmp_path / "blob.bin").write_bytes(PAYLOAD)
    server = nginx_server(tmp_path)
    fs = fsspec.filesystem("http", skip_instance_cache=True)

    assert fs.cat_file(f"{server.url}/blob.bin", start=10, end=20) == PAYLOAD[10:20]
    assert fs.cat_file(f"{server.url}/blob.bin", start=10000) == PAYLOAD[10000:]
    assert fs.info(f"{server.url}/blob.bin")["size"] == len(PAYLOAD)


def test_nginx_answers_range_with_206_etag_and_last_modified(tmp_path, nginx_server):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(PAYLOAD)
    server = nginx_server(tmp_path)
    request = urllib.request.Request(f"{server.url}/blob.bin", headers={"Range": "bytes=10-19"})

    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
        headers = response.headers
        status = response.status

    assert status == 206
    assert body == PAYLOAD[10:20]
    assert headers["Content-Range"] == f"bytes 10-19/{len(PAYLOAD)}"
    assert headers["ETag"].startswith('"') and len(headers["ETag"]) > 2
    modified = email.utils.parsedate_to_datetime(headers["Last-Modified"]).timestamp()
    assert modified == int(blob.stat().st_mtime)
    head = urllib.request.Request(f"{server.url}/blob.bin", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as response:
        assert response.headers["Accept-Ranges"] == "bytes"
        assert response.headers["ETag"] == headers["ETag"]


def test_nginx_autoindex_lists_files_and_folders(tmp_path, nginx_server):
    (tmp_path / "a.bin").write_bytes(b"a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"bb")
    server = nginx_server(tmp_path)
    fs = fsspec.filesystem("http", skip_instance_cache=True)

    assert sorted(fs.ls(server.url + "/", detail=False)) == [
        f"{server.url}/a.bin",
        f"{server.url}/sub/",
    ]
    assert fs.ls(server.url + "/sub/", detail=False) == [f"{server.url}/sub/b.bin"]


def test_two_nginx_servers_get_distinct_ports(tmp_path, nginx_server):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    (tmp_path / "one" / "x").write_bytes(b"1")
    (tmp_path / "two" / "x").write_bytes(b"2")
    first, second = nginx_server(tmp_path / "one"), nginx_server(tmp_path / "two")

    assert first.url != second.url
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    assert (fs.cat_file(first.url + "/x"), fs.cat_file(second.url + "/x")) == (b"1", b"2")


def test_nginx_stop_reaps_master_and_workers_and_removes_workdir(tmp_path, nginx_server):
    server = nginx_server(tmp_path, workers=2)
    master = psutil.Process(server.pid)
    # nginx accepts on its first worker while the master may still fork the second.
    deadline = time.monotonic() + 10
    while len(master.children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    processes = [master, *master.children()]
    workdir = server.workdir
    assert len(processes) == 3 and workdir is not None and workdir.is_dir()

    server.stop()

    assert [p.pid for p in processes if p.is_running() and p.status() != "zombie"] == []
    assert not workdir.exists()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(server.port or 0)), timeout=1).close()
    server.stop()  # idempotent


def test_nginx_on_a_busy_port_fails_with_its_error_log(tmp_path, nginx_server):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(_servers.ServerError, match="Address already in use") as caught:
            nginx_server(tmp_path, port=port, start_timeout_s=10)
    assert f"127.0.0.1:{port}" in str(caught.value)


def test_nginx_rejects_a_missing_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        _servers.NginxServer(tmp_path / "missing")


def test_moto_round_trip_through_s3fs(tmp_path, moto_server, s3_bucket, s3_options):
    (tmp_path / "d").mkdir()
    (tmp_path / "top.bin").write_bytes(PAYLOAD)
    (tmp_path / "d" / "inner.txt").write_bytes(b"inner")

    urls = _servers.upload_tree(tmp_path, moto_server.endpoint_url, s3_bucket, prefix="ds")

    assert urls == [f"s3://{s3_bucket}/ds/d/inner.txt", f"s3://{s3_bucket}/ds/top.bin"]
    fs, _ = fsspec.core.url_to_fs(f"s3://{s3_bucket}", skip_instance_cache=True, **s3_options)
    assert sorted(fs.find(s3_bucket)) == [u.removeprefix("s3://") for u in urls]
    assert fs.cat_file(f"{s3_bucket}/ds/top.bin", start=10, end=20) == PAYLOAD[10:20]
    with fsspec.open(urls[0], "rb", **s3_options) as f:
        assert f.read() == b"inner"


def _netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# Runs inside the namespace: downloads a URL, prints "bytes seconds".
_CLIENT = """
import sys, time, urllib.request
start = time.perf_counter()
size = 0
with urllib.request.urlopen(sys.argv[1], timeout=60) as response:
    while chunk := response.read(1 << 20):
        size += len(chunk)
print(size, time.perf_counter() - start)
"""


def test_shaped_link_limits_the_transfer_rate(tmp_path, shaped_link, nginx_server):
    big = 20_000_000
    (tmp_path / "big").write_bytes(bytes(range(256)) * (big // 256) + bytes(big % 256))
    link = shaped_link(rate="200mbit")
    server = nginx_server(tmp_path, netns=link.name)

    done = link.run_in(
        [sys.executable, "-c", _CLIENT, server.url + "/big"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )

    size, seconds = done.stdout.split()
    rate = int(size) / float(seconds)
    assert int(size) == big
    assert rate == pytest.approx(200e6 / 8, rel=0.25), f"{rate * 8 / 1e6:.0f} Mbit/s"


def test_shaped_link_deletes_its_namespace_even_after_an_error():
    reason = _servers.shaping_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with pytest.raises(KeyError):
        with _servers.ShapedLink(name_prefix="flerr") as link:
            name = link.name
            assert name in _netns_names()
            qdisc = link.run_in(
                ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True
            )
            assert "tbf" in qdisc.stdout and "200Mbit" in qdisc.stdout
            raise KeyError("boom")
    assert name not in _netns_names()
