"""Ctrl-C on `fastload cache`: a real SIGINT to a real process staging from a real server that holds requests."""

from __future__ import annotations

import functools
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cache import Cache
from fastload.config import Settings
from fastload.read.reader import Reader

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def published(load_script: Callable[[str], Any]) -> Callable[[Path], int]:
    """Counts a cache's published entries without writing (the reliability suite's helper)."""
    return load_script("tests/reliability/helpers.py").count_published


class _Held(http.server.SimpleHTTPRequestHandler):
    """Answers the first ``served`` file GETs; holds every later one until ``release`` is set."""

    served = 160  # more than the first 4 staging chunks of 32 (stage.CHUNK, Settings.stage_threads): some get cached
    release: threading.Event
    lock: threading.Lock
    counts: dict[str, int]  # "answered": file GETs let through; "held": waiting now

    def do_GET(self) -> None:
        cls = type(self)
        if not self.path.endswith("/"):
            with cls.lock:
                hold = cls.counts["answered"] >= cls.served and not cls.release.is_set()
                cls.counts["answered" if not hold else "held"] += 1
            if hold:
                cls.release.wait(timeout=300)  # let go at the end of the test
                with cls.lock:
                    cls.counts["held"] -= 1
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the interrupted client hangs up mid-answer: expected here


def _serve(tmp_path: Path) -> tuple[Any, Any, threading.Thread, str, dict[str, bytes]]:
    """A ThreadingHTTPServer over 400 files that holds every GET after its first ``served``."""
    www = tmp_path / "www"
    www.mkdir()
    files = {f"f{k:03d}.bin": os.urandom(20_000) for k in range(400)}
    for name, data in files.items():
        (www / name).write_bytes(data)
    handler = type("H", (_Held,), {"release": threading.Event(), "lock": threading.Lock(),
                                   "counts": {"answered": 0, "held": 0}})
    httpd = _Server(("127.0.0.1", 0), functools.partial(handler, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    return handler, httpd, thread, f"http://127.0.0.1:{httpd.server_address[1]}/", files


_DEFAULT_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def _interrupt_mid_run(cmd: list[str], cache_dir: Path, handler: Any, published: Callable[[Path], int]) -> tuple[int, str, str]:
    """Run ``cmd``, SIGINT it once ``published(cache_dir)`` counts some entries and the server holds its next
    requests, and return (exit code, stdout, stderr). Held requests would answer only after
    300 s (the request timeout): a Ctrl-C that waited for them (17 s with a 1 s-per-file
    server, 23 s in issue 14) would not end before communicate()'s limit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FASTLOAD_RETRIES": "3", "FASTLOAD_TIMEOUT_S": "300"}
    # A Ctrl-C from a terminal reaches a process whose SIGINT is at its default. A suite
    # started in the background (`make test &`, a CI runner's job) hands its children SIGINT
    # ignored, and Python then installs no handler: the command starts with it reset, here.
    cmd = [sys.executable, "-c", _DEFAULT_SIGINT, *cmd]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (published(cache_dir) and handler.counts["held"] > 0):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"staging never reached the held requests: {handler.counts}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert handler.counts["held"] > 0  # it ended while its requests were still unanswered
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:  # it did not stop: no process outlives the test
            proc.kill()
            proc.wait()


def _check_nothing_half_written_and_resume(cache_dir: Path, url: str, handler: Any, files: dict[str, bytes]) -> Settings:
    assert not list(cache_dir.glob("**/*.part"))
    settings = Settings(cache_dir=cache_dir, retries=1)
    cache = Cache(settings)
    entries = list(cache.entries())
    assert 0 < len(entries) < len(files)
    assert all(cache.get(e.key) is not None for e in entries)
    assert cache.check()["orphans"] == 0
    cache.close()
    handler.release.set()
    report = fastload.stage(url, settings=settings, progress=False)
    assert report.skipped_blocks == len(entries) and report.fetched_blocks == len(files) - len(entries)
    return settings


def _stop(handler: Any, httpd: Any, thread: threading.Thread) -> None:
    handler.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def test_ctrl_c_stops_without_waiting_for_requests_in_flight_and_the_rerun_resumes(tmp_path: Path, published: Callable[[Path], int]) -> None:
    handler, httpd, thread, url, files = _serve(tmp_path)
    cache_dir = tmp_path / "cache"
    try:
        code, _, err = _interrupt_mid_run(
            [sys.executable, "-m", "fastload", "cache", url, "--cache-dir", str(cache_dir), "--no-progress"], cache_dir, handler, published)
        assert code == 130, err
        assert "interrupted; rerun the same command to resume" in err
        settings = _check_nothing_half_written_and_resume(cache_dir, url, handler, files)
    finally:
        _stop(handler, httpd, thread)
    reader = Reader(settings)  # the server is gone: every byte from the cache
    for item in reader.list(url):
        assert reader.read(item) == files[item.url.rsplit("/", 1)[1]]


_STAGE_FROM_PYTHON = """
import sys
import fastload
from fastload.config import Settings
try:
    fastload.stage(sys.argv[1], settings=Settings.from_env(cache_dir=sys.argv[2]), progress=False)
except KeyboardInterrupt:
    print("KeyboardInterrupt re-raised", flush=True)
    sys.exit(130)
"""


def test_ctrl_c_in_python_stops_stage_and_its_threads(tmp_path: Path, published: Callable[[Path], int]) -> None:
    # fastload.stage() from a notebook: the KeyboardInterrupt must reach the caller and
    # every staging thread must end, not retry held requests one by one in the background
    # (the interpreter joins those threads at exit: the process would outlive communicate()).
    handler, httpd, thread, url, files = _serve(tmp_path)
    cache_dir = tmp_path / "cache"
    try:
        code, out, err = _interrupt_mid_run([sys.executable, "-c", _STAGE_FROM_PYTHON, url, str(cache_dir)], cache_dir, handler, published)
        assert (code, out.strip()) == (130, "KeyboardInterrupt re-raised"), err
        _check_nothing_half_written_and_resume(cache_dir, url, handler, files)
    finally:
        _stop(handler, httpd, thread)
