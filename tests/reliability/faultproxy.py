"""A fault-injecting HTTP proxy for the reliability suite.

:class:`FaultProxy` listens on a free port, forwards every request to a real
upstream (nginx, or moto's S3 server) and, at a set rate per fault, breaks the
answer the way flaky networks and stores do:

* ``"503"``: a 503 answer (for S3, the ``SlowDown`` error body S3 sends when it
  throttles), without contacting the upstream.
* ``"reset"``: the headers and half the body, then a TCP RST (SO_LINGER 0).
* ``"truncate"``: the headers (with the full Content-Length) and half the body,
  then a clean close: the body is cut short.
* ``"stall"``: the headers and half the body (nothing at all for HEAD), then
  silence for ``stall_s`` seconds, longer than the client's request timeout.

:meth:`FaultProxy.outage` takes the store down for a while: every request meanwhile
gets its connection reset before any answer (logged as fault ``"down"``), as a store
that is down behind its load balancer does.

Faults are drawn from one seeded RNG, so a run's fault mix is reproducible up
to thread scheduling. Every request is logged with the fault it got, so tests
can count attempts. The proxy is a thread of the test process; :meth:`stop`
wakes stalled handlers, closes the socket and joins the thread.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

FAULTS = ("503", "reset", "truncate", "stall")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>FAULTPROXY</RequestId></Error>"
)


@dataclass(frozen=True)
class Request:
    """One request the proxy saw: method, path, Range header, fault applied (or "")."""

    method: str
    path: str
    range: str
    fault: str
    at: float


class FaultProxy:
    """Forward to ``upstream`` (``http://host:port``), breaking answers at ``rates``.

    Args:
        upstream: Base URL of the real server.
        rates: Probability per request of each fault in :data:`FAULTS`; they are
            drawn exclusively, so their sum must be <= 1.
        seed: Seed of the fault RNG.
        stall_s: How long a stalled answer stays silent.
        s3: Answer "503" faults with S3's SlowDown XML (and an XML content type).
        match: Only requests whose path contains this substring may be faulted.
    """

    def __init__(
        self,
        upstream: str,
        rates: dict[str, float] | None = None,
        *,
        seed: int = 0,
        stall_s: float = 5.0,
        s3: bool = False,
        match: str = "",
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.rates: dict[str, float] = {}
        self.set_rates(rates or {})
        self.stall_s = stall_s
        self.s3 = s3
        self.match = match
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.log: list[Request] = []
        self._outages: list[threading.Thread] = []
        self.down = False  # while set, every request is reset unanswered (outage)
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def set_rates(self, rates: dict[str, float]) -> None:
        """Change the fault rates (takes effect on the next request)."""
        unknown = set(rates) - set(FAULTS)
        if unknown or sum(rates.values()) > 1.0 + 1e-9:
            raise ValueError(f"rates {rates} must use {FAULTS} and sum to <= 1")
        self.rates = dict(rates)

    def outage(self, after_s: float, for_s: float) -> threading.Thread:
        """Take the store down ``after_s`` seconds from now, for ``for_s`` seconds (a thread; joined by stop)."""

        def run() -> None:
            if self._stop.wait(after_s):
                return
            self.down = True
            self._stop.wait(for_s)
            self.down = False

        thread = threading.Thread(target=run, name="fault-proxy-outage", daemon=True)
        thread.start()
        self._outages.append(thread)
        return thread

    @property
    def url(self) -> str:
        """Base URL of the proxy, e.g. ``http://127.0.0.1:40123``."""
        if self._server is None:
            raise RuntimeError("FaultProxy.url is only known after start()")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def counts(self) -> Counter[str]:
        """How many requests got each fault ("" = forwarded untouched)."""
        with self._lock:
            return Counter(r.fault for r in self.log)

    def requests_for(self, path_part: str) -> list[Request]:
        with self._lock:
            return [r for r in self.log if path_part in r.path]

    def _draw(self, path: str) -> str:
        with self._lock:
            x = self._rng.random()
        if self.match and self.match not in path:
            return ""
        acc = 0.0
        for fault in FAULTS:
            acc += self.rates.get(fault, 0.0)
            if x < acc:
                return fault
        return ""

    def _record(self, method: str, path: str, rng: str, fault: str) -> None:
        with self._lock:
            self.log.append(Request(method, path, rng, fault, time.monotonic()))

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
                return None  # quiet: the proxy keeps its own log

            def do_GET(self) -> None:  # noqa: N802 - stdlib naming
                proxy._handle(self, "GET")

            def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
                proxy._handle(self, "HEAD")

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                return None  # a client hanging up on a broken answer is expected here

        server = Server(("127.0.0.1", 0), Handler)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Wake stalled handlers, stop serving, close the socket and join. Idempotent."""
        self._stop.set()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for thread in self._outages:
            thread.join(timeout=10)
        self.down = False

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- one request ---------------------------------------------------------------

    def _forward(self, h: http.server.BaseHTTPRequestHandler, method: str) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP}
            conn.request(method, h.path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            # HEAD answers keep the upstream's Content-Length (the object's size).
            drop = _HOP_BY_HOP if method == "HEAD" else _HOP_BY_HOP | {"content-length"}
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in drop]
            return resp.status, out, body
        finally:
            conn.close()

    def _handle(self, h: http.server.BaseHTTPRequestHandler, method: str) -> None:
        if self.down:
            self._record(method, h.path, h.headers.get("Range", ""), "down")
            self._break(h, "reset")
            return
        fault = self._draw(h.path)
        self._record(method, h.path, h.headers.get("Range", ""), fault)
        if fault == "503":
            body = _SLOWDOWN if self.s3 else b"fault proxy: 503 Service Unavailable\n"
            h.send_response(503, "Slow Down" if self.s3 else "Service Unavailable")
            h.send_header("Content-Type", "application/xml" if self.s3 else "text/plain")
            h.send_header("Content-Length", str(len(body)))
            h.send_header("Retry-After", "0")
            h.end_headers()
            if method != "HEAD":
                h.wfile.write(body)
            return
        try:
            status, headers, body = self._forward(h, method)
        except OSError as err:
            h.send_error(502, f"upstream failed: {err}")
            return
        if fault and method == "HEAD":
            # No body to cut: a HEAD fault breaks the connection before any answer.
            self._break(h, fault)
            return
        h.send_response(status)
        for k, v in headers:
            h.send_header(k, v)
        if method != "HEAD":
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if method == "HEAD":
            return
        if not fault:
            h.wfile.write(body)
            return
        h.wfile.write(body[: len(body) // 2])
        h.wfile.flush()
        self._break(h, fault)

    def _break(self, h: http.server.BaseHTTPRequestHandler, fault: str) -> None:
        h.close_connection = True
        if fault == "reset":
            # SO_LINGER with a zero timeout turns close() into an RST.
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.connection.close()
        elif fault == "truncate":
            h.connection.shutdown(socket.SHUT_WR)
        elif fault == "stall":
            self._stop.wait(self.stall_s)
