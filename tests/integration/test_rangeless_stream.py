"""A large object from a server that ignores Range (Python's http.server): one GET, streamed
into its blocks as it arrives, memory bounded, and a Ctrl-C keeps the blocks written."""

from __future__ import annotations

import functools
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _memory import peak_while

import fastload
from fastload.cache import Cache
from fastload.config import Settings
from fastload.read.reader import Reader

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MB = 1024**2
# The child's peak resident memory, measured by the kernel (the same figure /usr/bin/time -v prints).
_PEAK_RSS = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(code)")
_DEFAULT_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


class _Handler(http.server.SimpleHTTPRequestHandler):
    """http.server's own handler (it ignores Range), recording each GET: its Range header and
    whether its whole body went out; ``pace`` slows the body down (seconds per MiB)."""

    gets: list[dict[str, Any]]
    lock: threading.Lock
    pace: threading.Event  # set: full speed
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        record = {"path": self.path, "range": self.headers.get("Range"), "whole": False}
        with self.lock:
            self.gets.append(record)
        super().do_GET()

    def copyfile(self, source: Any, outputfile: Any) -> None:
        record = self.gets[-1] if self.gets and self.gets[-1]["path"] == self.path else {}
        try:
            while chunk := source.read(MB):
                outputfile.write(chunk)
                if not self.pace.is_set():
                    time.sleep(0.1)
            record["whole"] = True
        except OSError:  # the client hung up: this GET's body did not go out whole
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-answer: expected here


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Any, Path]]:
    www = tmp_path / "www"
    (www / "big").mkdir(parents=True)
    handler = type("H", (_Handler,), {"gets": [], "lock": threading.Lock(), "pace": threading.Event()})
    handler.pace.set()
    httpd = _Server(("127.0.0.1", 0), functools.partial(handler, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler, www
    handler.pace.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def _write(path: Path, mb: int) -> None:
    with path.open("wb") as f:
        for _ in range(mb):
            f.write(os.urandom(MB))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "FASTLOAD_RETRIES": "2", **extra}


def test_a_large_file_from_a_server_without_range_is_one_get_streamed_in_bounded_memory(
    tmp_path: Path, server: tuple[str, Any, Path]
) -> None:
    # `fastload cache http://host/big/one.bin` of a 1 GB file sent 8 whole-file GETs (one per
    # ranged request of a fetch call) and peaked at 13.7 GB; 3.1 GB for this 256 MB one.
    base, handler, www = server
    _write(www / "big" / "one.bin", 256)
    cmd = [sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "fastload", "cache", f"{base}/big/one.bin",
           "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    peak = int(run.stdout.strip().splitlines()[-1])
    assert peak < 224 * MB, f"peak RSS {peak / MB:.0f} MB staging a 256 MB object"
    gets = [g for g in handler.gets if g["path"] == "/big/one.bin"]
    # One GET brings the object: the single-file URL's listing looks at its answer's
    # headers only (a GET whose body is not read), then one ranged GET, answered whole.
    assert [g["whole"] for g in gets].count(True) == 1, gets
    assert len(gets) <= 2, gets
    cache = Cache(Settings(cache_dir=tmp_path / "cache"))
    assert sum(e.raw for e in cache.entries()) == 256 * MB
    cache.close()


def test_ctrl_c_while_streaming_keeps_the_blocks_written_and_the_rerun_stores_only_the_rest(
    tmp_path: Path, server: tuple[str, Any, Path], load_script: Callable[[str], Any]
) -> None:
    published = load_script("tests/reliability/helpers.py").count_published
    base, handler, www = server
    _write(www / "big" / "one.bin", 64)
    handler.pace.clear()  # 0.1 s per MiB: Ctrl-C lands mid-body
    cache_dir = tmp_path / "cache"
    url = f"{base}/big/one.bin"
    env = _env(FASTLOAD_BLOCK_SIZE="2MiB")  # larger than a pack's payloads: a file per block, its inode kept or not
    cmd = [sys.executable, "-c", _DEFAULT_SIGINT, sys.executable, "-m", "fastload", "cache", url, "--cache-dir",
           str(cache_dir), "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while published(cache_dir) < 4:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no block was stored while the object streamed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    settings = Settings(cache_dir=cache_dir, block_bytes=2 * MB, retries=2)
    cache = Cache(settings)
    kept = {e.key: e for e in cache.entries()}
    cache.close()
    assert 4 <= len(kept) < 32, f"{len(kept)} of 32 blocks kept after Ctrl-C"
    files = {k: os.stat(cache_dir / "data" / e.path) for k, e in kept.items()}
    before = len(handler.gets)
    handler.pace.set()
    report = fastload.stage(url, settings=settings, progress=False)
    assert report.skipped_blocks == len(kept) and report.fetched_blocks == 32 - len(kept)
    assert [g["whole"] for g in handler.gets[before:] if g["path"] == "/big/one.bin"].count(True) == 1
    for key, st in files.items():  # not written again: the same file, untouched
        now = os.stat(cache_dir / "data" / kept[key].path)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), key
    cache = Cache(settings)
    assert sorted(e.block for e in cache.entries()) == list(range(32))
    cache.close()
    gets = len(handler.gets)
    assert Reader(settings).read(url) == (www / "big" / "one.bin").read_bytes()
    assert not [g for g in handler.gets[gets:] if g["range"] or g["whole"]]  # from the cache


def test_a_read_of_one_block_of_a_sized_object_is_one_get_streamed(tmp_path: Path, server: tuple[str, Any, Path]) -> None:
    # The read path (a DataLoader's miss) on a sized item, a host not known yet: the ranged GET
    # for the block came back whole and was held, then split, in memory (64 MB here).
    base, handler, www = server
    _write(www / "big" / "one.bin", 64)
    reader = Reader(Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=2))
    item = reader.stat(f"{base}/big/one.bin")  # a HEAD: sized, no GET yet
    block, peak = peak_while(lambda: reader.read_block(item, 40))
    assert peak < 16 * MB, f"{peak / MB:.1f} MB held reading one block of a 64 MB object"
    with (www / "big" / "one.bin").open("rb") as f:
        f.seek(40 * MB)
        assert block == f.read(MB)
    gets = [g for g in handler.gets if g["path"] == "/big/one.bin"]
    assert len(gets) == 1 and gets[0]["whole"] and gets[0]["range"] == f"bytes={40 * MB}-{41 * MB - 1}", gets
    assert reader.read_block(item, 63) and len(handler.gets) == 1  # every block was stored from that answer


def test_staging_a_streamed_object_reads_none_of_its_blocks_back(
        tmp_path: Path, server: tuple[str, Any, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole object streams in the first fetch call; the later calls found its blocks stored by
    # this process and read each back only to count it, two calls' blocks (128 MB of 256) at once.
    base, handler, www = server
    _write(www / "big" / "one.bin", 32)
    monkeypatch.setattr(sys.modules["fastload.stage"], "BATCH_BYTES", 4 * MB)  # four blocks a fetch call: eight calls
    reads: list[str] = []
    real = Cache.get
    monkeypatch.setattr(Cache, "get", lambda self, key, *a, **k: reads.append(key) or real(self, key, *a, **k))
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=MB, retries=2)
    report = fastload.stage(f"{base}/big/one.bin", settings=settings, progress=False)
    assert report.fetched_blocks == 32 and report.fetched_bytes == 32 * MB
    assert reads == []
    assert [g["whole"] for g in handler.gets if g["path"] == "/big/one.bin"].count(True) == 1
