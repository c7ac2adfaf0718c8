"""Helper servers for the peers benchmark, each run as its own process inside the link's namespace.

``python servers.py proxy --upstream unix:/path.sock --delay-ms 20``
    A per-request latency proxy: an asyncio HTTP/1.1 reverse proxy on
    ``127.0.0.1`` (port printed as JSON on stdout). Every request waits
    ``--delay-ms`` before it is forwarded, which models an object store's time to
    first byte (S3: p90 ~20 ms regardless of size; github.com/dvassallo/s3-benchmark).
    The upstream leg is a Unix socket, so the response bytes cross the shaped
    loopback once (proxy -> client), not twice; ``tc tbf`` on ``lo`` shapes the
    proxy's replies exactly as it shapes nginx's own.

``python servers.py proxy --upstream unix:/a.sock --listen-unix /b.sock --delay-ms 20``
    The same proxy listening on a Unix socket instead (its path printed as JSON):
    nginx's TLS front (benchmarks/peers/tls.py) passes HTTPS requests to it, so the
    delay sits behind TLS as S3's does, and no byte crosses the shaped loopback twice.

``python servers.py moto --socket /path.sock --preload BUCKET=DIR ...``
    moto's S3 server (the same app as ``moto.server.ThreadedMotoServer``) on a
    Unix socket, with each DIR's files put into BUCKET in-process before it
    serves, so filling it costs no link time. Clients reach it through a proxy
    (``--delay-ms 0`` for the plain links, 20 for the cloud variant).

Both print one JSON line once ready and run until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

_CHUNK = 256 * 1024


class _Closed(Exception):
    """The peer closed the connection between requests."""


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as err:
        if not err.partial:
            raise _Closed from err
        raise
    except asyncio.LimitOverrunError as err:
        raise ValueError("HTTP head too large") from err


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return lines[0], fields


async def _copy_exact(src: asyncio.StreamReader, dst: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        chunk = await src.read(min(_CHUNK, n))
        if not chunk:
            raise ConnectionError(f"upstream closed with {n} B of the body left")
        dst.write(chunk)
        n -= len(chunk)
        await dst.drain()


async def _copy_chunked(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    while True:
        line = await src.readuntil(b"\r\n")
        dst.write(line)
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:  # trailers, then the empty line
                trailer = await src.readuntil(b"\r\n")
                dst.write(trailer)
                if trailer == b"\r\n":
                    await dst.drain()
                    return
        await _copy_exact(src, dst, size + 2)


class LatencyProxy:
    """Forwards HTTP/1.1 requests to a Unix-socket upstream after ``delay_s``."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.requests = 0

    async def handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await _read_head(creader)
                except _Closed:
                    return
                request_line, fields = _headers(head)
                body = b""
                if int(fields.get("content-length", "0") or 0):
                    body = await creader.readexactly(int(fields["content-length"]))
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)  # the time to first byte
                self.requests += 1
                if up is None:
                    up = await asyncio.open_unix_connection(self.upstream, limit=1 << 20)
                ureader, uwriter = up
                uwriter.write(head + body)
                await uwriter.drain()
                rhead = await _read_head(ureader)
                status_line, rfields = _headers(rhead)
                cwriter.write(rhead)
                status = int(status_line.split()[1])
                method = request_line.split(" ", 1)[0]
                close = False
                if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                    pass
                elif "content-length" in rfields:
                    await _copy_exact(ureader, cwriter, int(rfields["content-length"]))
                elif "chunked" in rfields.get("transfer-encoding", "").lower():
                    await _copy_chunked(ureader, cwriter)
                else:  # delimited by the upstream closing
                    while chunk := await ureader.read(_CHUNK):
                        cwriter.write(chunk)
                        await cwriter.drain()
                    close = True
                await cwriter.drain()
                if rfields.get("connection", "").lower() == "close":
                    up[1].close()
                    up = None
                if close or fields.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, asyncio.CancelledError):
            return  # a client that goes away mid-response, or shutdown, is not an error here
        finally:
            if up is not None:
                up[1].close()
            cwriter.close()


async def _serve_proxy(args: argparse.Namespace) -> None:
    proxy = LatencyProxy(args.upstream.removeprefix("unix:"), args.delay_ms / 1000)
    if args.listen_unix:
        Path(args.listen_unix).unlink(missing_ok=True)
        server = await asyncio.start_unix_server(proxy.handle, args.listen_unix, limit=1 << 20, backlog=1024)
        print(json.dumps({"socket": args.listen_unix, "delay_ms": args.delay_ms}), flush=True)
    else:
        server = await asyncio.start_server(proxy.handle, "127.0.0.1", args.port, limit=1 << 20, backlog=1024)
        port = server.sockets[0].getsockname()[1]
        print(json.dumps({"port": port, "delay_ms": args.delay_ms}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with server:
        await stop.wait()


def _serve_moto(args: argparse.Namespace) -> None:
    import logging

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.s3.models import s3_backends
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    objects = 0
    for spec in args.preload:
        bucket, _, folder = spec.partition("=")
        backend.create_bucket(bucket, "us-east-1")
        root = Path(folder)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            backend.put_object(bucket, path.relative_to(root).as_posix(), path.read_bytes())
            objects += 1
    Path(args.socket).unlink(missing_ok=True)
    app = DomainDispatcherApplication(create_backend_app)
    server = make_server(f"unix://{args.socket}", 0, app, threaded=True, request_handler=MotoRequestHandler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(json.dumps({"socket": args.socket, "objects": objects}), flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        Path(args.socket).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    px = sub.add_parser("proxy", help="per-request latency proxy to a Unix-socket upstream")
    px.add_argument("--upstream", required=True, help="unix:/path/to.sock")
    px.add_argument("--delay-ms", type=float, default=20.0)
    px.add_argument("--port", type=int, default=0)
    px.add_argument("--listen-unix", default="", help="listen on this Unix socket instead of 127.0.0.1:PORT")
    mo = sub.add_parser("moto", help="moto's S3 server on a Unix socket, preloaded")
    mo.add_argument("--socket", required=True)
    mo.add_argument("--preload", action="append", default=[], help="BUCKET=DIR (repeatable)")
    args = p.parse_args(argv)
    if args.cmd == "proxy":
        asyncio.run(_serve_proxy(args))
    else:
        _serve_moto(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
