"""An in-process slow link for the cache benchmark when kernel shaping is unavailable.

:class:`ThrottledProxy` is a reverse HTTP proxy on 127.0.0.1 in front of a real
server (nginx). Every response body it forwards draws from one token bucket
shared by all connections, so N parallel requests share ``rate`` bytes/s the way
they share a ``tc tbf`` link. It is an approximation of the kernel shaper, and
the benchmark labels it as such: it throttles response bodies only (not headers,
not requests), and it runs in the benchmark's own Python process.

Example:
    >>> with NginxServer(root) as http, ThrottledProxy(http.url, 25e6) as proxy:  # doctest: +SKIP
    ...     urllib.request.urlopen(proxy.url + "/big").read()
"""

from __future__ import annotations

import http.client
import http.server
import sys
import threading
import time
import urllib.parse
from typing import Any

__all__ = ["ThrottledProxy", "TokenBucket"]

# Headers that describe one hop, not the resource (RFC 9110 section 7.6.1).
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
}
_CHUNK = 64 * 1024


class TokenBucket:
    """A token bucket of ``rate`` bytes/s holding at most ``burst`` bytes, safe across threads.

    A caller takes its tokens at once and may drive the bucket into debt; it
    then sleeps until the debt is repaid. Callers therefore queue in arrival
    order and the long-run rate never exceeds ``rate``.
    """

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate ({rate}) and burst ({burst}) must be positive")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.held_s = 0.0  # how long callers were held back, all together: > 0 once the bucket shaped anything

    def take(self, nbytes: int) -> None:
        """Blocks until ``nbytes`` may pass."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait_s = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.held_s += wait_s
        if wait_s > 0:
            time.sleep(wait_s)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as fsspec/aiohttp pool connections
    timeout = 60  # an idle keep-alive connection ends after this long
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # one line per request would drown the benchmark's output

    def do_GET(self) -> None:
        self._forward("GET")

    def do_HEAD(self) -> None:
        self._forward("HEAD")

    _conn: http.client.HTTPConnection | None = None

    def _upstream(self) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is None:
            host, port = self.server.upstream
            conn = self._conn = http.client.HTTPConnection(host, port, timeout=60)
        return conn

    def _forward(self, method: str) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            conn = self._upstream()
            conn.request(method, self.path, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            # A stale upstream keep-alive connection: reconnect once.
            self._conn = None
            conn = self._upstream()
            conn.request(method, self.path, headers=headers)
            resp = conn.getresponse()
        # A body without a length (nginx's autoindex pages) is relayed chunked, as
        # nginx sent it: fsspec and fastload take a sizeless HTML page for a folder.
        chunked = resp.getheader("Content-Length") is None and method != "HEAD"
        self.send_response(resp.status, resp.reason)
        for key, value in resp.getheaders():
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if method == "HEAD":
            resp.read()
            return
        bucket = self.server.bucket
        while chunk := resp.read(_CHUNK):
            bucket.take(len(chunk))
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True  # a client's idle keep-alive connection must not block close()

    def __init__(self, upstream: tuple[str, int], bucket: TokenBucket) -> None:
        self.upstream = upstream
        self.bucket = bucket
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that exits drops its idle keep-alive connections: not an error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class ThrottledProxy:
    """A reverse proxy to ``upstream_url`` whose response bodies share one token bucket.

    Args:
        upstream_url: Base URL of the real server, e.g. ``http://127.0.0.1:8123``.
        rate_bytes_per_s: Shared throughput limit.
        burst_bytes: Bucket size (what may pass at once after an idle spell).
    """

    def __init__(self, upstream_url: str, rate_bytes_per_s: float, burst_bytes: float = 128 * 1024) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream {upstream_url!r} must look like http://host:port")
        self.upstream = (parts.hostname, parts.port)
        self.bucket = TokenBucket(rate_bytes_per_s, burst_bytes)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the proxy, without a trailing slash."""
        if self._server is None:
            raise RuntimeError("ThrottledProxy.url is only known after start()")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> ThrottledProxy:
        self._server = _Server(self.upstream, self.bucket)
        self._thread = threading.Thread(target=self._server.serve_forever, name="throttled-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the listening socket. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> ThrottledProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
