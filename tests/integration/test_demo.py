"""`make demo` (examples/demo.py): its pieces, and the whole run unshaped and shaped.

Speed is not checked here (timing belongs in benchmarks); what is checked is what
decides speed: the fallback server's listen backlog and keep-alive, the shaped link
the cold epoch runs over, and the training step that gives the stall figure meaning.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload.config import Settings

pytest.importorskip("PIL", reason="the demo's sample data needs Pillow")
pytestmark = pytest.mark.integration  # real HTTP servers, a shaped namespace

# Namespace names start with this (FASTLOAD_TEST_NETNS_PREFIX picks another), so a
# shared machine can tell whose they are.
NETNS_PREFIX = os.environ.get("FASTLOAD_TEST_NETNS_PREFIX", "fltest-demo")


@pytest.fixture(scope="module")
def demo(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("examples/demo.py")


@pytest.fixture
def fallback(demo: ModuleType, tmp_path: Path) -> Iterator[Any]:
    root = tmp_path / "www"
    for i in range(40):  # the demo's layout: train/<class>/<n>.jpg (bytes only; nothing decodes them)
        path = root / "train" / f"c{i % 2}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (1000 + 37 * i))
    server = demo.FallbackHTTP(root)
    yield server
    server.stop()


def test_link_limit_reads_tc_rates(demo: ModuleType) -> None:
    assert demo.link_limit_mb_s("200mbit") == 25.0
    assert demo.link_limit_mb_s("1gbit") == 125.0
    assert demo.link_limit_mb_s("800kbit") == 0.1
    with pytest.raises(ValueError, match="not a tc rate"):
        demo.link_limit_mb_s("fast")


def test_fallback_server_listens_with_a_deep_backlog(fallback: Any) -> None:
    # http.server's backlog of 5 dropped the SYNs of fastload's parallel connects,
    # each then waiting a 1 s retransmit: the old demo staged at 1.0 MB/s.
    port = fallback.httpd.server_address[1]
    if shutil.which("ss") is None:
        assert fallback.httpd.request_queue_size >= 64
        return
    listing = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=30)
    fields = listing.stdout.split()
    assert fields and fields[0] == "LISTEN", listing.stdout
    assert int(fields[2]) >= 64, listing.stdout  # a listening socket's Send-Q is its backlog


def test_fallback_server_keeps_a_connection_for_many_requests(fallback: Any) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", fallback.httpd.server_address[1], timeout=10)
    try:
        for i in range(3):  # one connection, HTTP/1.1 keep-alive
            conn.request("GET", f"/train/c{i % 2}/{i:03d}.jpg")
            response = conn.getresponse()
            assert response.status == 200 and response.version == 11
            assert len(response.read()) == 1000 + 37 * i
    finally:
        conn.close()


def test_fallback_server_stages_every_file(fallback: Any, tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", max_requests=8)
    report = fastload.stage(f"{fallback.url}/train/", pattern="**/*.jpg", settings=settings, progress=False)
    assert report.items == 40
    assert report.fetched_bytes == sum(1000 + 37 * i for i in range(40))


def test_loader_epoch_takes_a_training_step_per_batch(
    demo: ModuleType, fallback: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    url = f"{fallback.url}/train/"
    settings = Settings(cache_dir=tmp_path / "cache")
    stats = demo.loader_epoch(url, settings, step_s=0.25).stats()
    # 40 samples in batches of 32: 2 batches. The loop's wall time runs to the last
    # batch, so it holds the step after the first one: 250 ms not spent waiting for
    # data, which is what makes "data stall" mean something (it was 99.5% without).
    assert stats.batches == 2
    assert stats.wall_seconds - stats.wait_seconds >= 0.25
    out = capsys.readouterr().out
    assert "with a simulated 250 ms training step per batch" in out and "2 classes" in out


def test_demo_unshaped_says_so_and_prints_both_rates(
    demo: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    monkeypatch.setattr(_servers, "nginx_available", lambda: False)  # the fallback server's path
    assert demo.main(["--no-shape", "--images", "24", "--step-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "link: unshaped loopback (--no-shape)" in out
    assert "serving over HTTP with Python's http.server" in out
    assert re.search(r"summary: +link unshaped \(loopback\) +\| +cold [\d.]+ MB/s +\| +warm [\d.]+ MB/s", out), out
    assert "items       24 (24 cache entries)" in out
    assert "simulated 5 ms training step" in out


def test_demo_shapes_the_cold_epoch_where_it_can(demo: ModuleType, capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    problem = demo.shaping_problem()
    if problem is not None:
        pytest.skip(f"the demo cannot shape a link here: {problem}")
    assert demo.main(["--images", "24", "--netns-prefix", NETNS_PREFIX]) == 0
    out = capfd.readouterr().out  # the epochs run in a child process inside the namespace
    if "cannot build a shaped network namespace here" in out:  # root, but a container without netns
        pytest.skip(out.split("cannot build", 1)[1].splitlines()[0])
    assert re.search(rf"link: 200mbit \(25\.0 MB/s\), shaped with tc tbf .* namespace {NETNS_PREFIX}-", out), out
    assert re.search(r"summary: +link limit 25\.0 MB/s \(200mbit, shaped\) +\| +cold [\d.]+ MB/s \(\d+% of the link\)", out), out
    assert "items       24 (24 cache entries)" in out
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert NETNS_PREFIX not in names  # deleted on exit
