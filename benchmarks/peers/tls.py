"""HTTPS for the benchmarks: a private CA, and nginx with ``ssl`` (and optionally ``http2``).

The CA comes from tests/integration/_tls.py (``cryptography``; a certificate for
127.0.0.1 and localhost), so the tests and the benchmarks trust the same kind of
chain. It is trusted by nothing until a client is told about it (``SSL_CERT_FILE``,
``AWS_CA_BUNDLE``, ``client_kwargs={"verify": ca}``).

:class:`TlsNginx` is :class:`fastload._servers.NginxServer` with a second server
block that listens with ``ssl`` on a port of its own (``tls_url``). That block either
serves the same root and locations as the plain one, or, with ``via_unix=PATH``,
passes every request to a Unix socket: benchmarks/peers/servers.py's latency proxy
listening there (``proxy --listen-unix``), which forwards to nginx's own plain Unix
socket. So 20 ms to first byte over TLS is the same proxy as over HTTP, and the bytes
still cross the shaped loopback once (nginx's TLS front -> the client). The plain
server's access log counts the requests either way (the front logs nothing when
it passes requests on).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fastload import _servers  # noqa: E402
from fastload._servers.ports import free_port  # noqa: E402


def _tls_module() -> ModuleType:
    path = ROOT / "tests" / "integration" / "_tls.py"
    spec = importlib.util.spec_from_file_location("fastload_bench_tls_ca", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_ca(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a certificate for 127.0.0.1: ``(ca.pem, cert.pem, key.pem)`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    return _tls_module().make_ca(folder)


class TlsNginx(_servers.NginxServer):
    """nginx serving ``root`` over HTTP (``url``) and HTTPS (``tls_url``), in one process.

    Args:
        cert, key: the server's certificate and key (from :func:`make_ca`).
        http2: offer HTTP/2 by ALPN on the TLS port (``listen ... ssl http2``).
        via_unix: pass the TLS port's requests to this Unix socket (a latency proxy)
            instead of serving files there.
        conn_log: the TLS port logs to ``tls_access.log`` in the work dir, one line per
            request: ``connection-number protocol uri`` (how many connections carried
            the requests, and over which HTTP version), instead of ``access.log``.
        Others as :class:`fastload._servers.NginxServer`.
    """

    def __init__(self, root: Path, *, cert: Path, key: Path, http2: bool = False, via_unix: Path | None = None,
                 conn_log: bool = False, **kwargs: object) -> None:
        super().__init__(root, **kwargs)  # type: ignore[arg-type]
        self.cert, self.key, self.http2, self.via_unix, self.conn_log = cert, key, http2, via_unix, conn_log
        self.tls_port: int | None = None

    @property
    def tls_url(self) -> str:
        """``https://127.0.0.1:PORT``, known after start()."""
        if self.tls_port is None or self.pid is None:
            raise _servers.ServerError("TlsNginx.tls_url is only known after start()")
        return f"https://{self.host}:{self.tls_port}"

    def _write_config(self, tmp: Path) -> Path:
        path = super()._write_config(tmp)
        self.tls_port = free_port(self.host)  # a race lost here fails the start, as nginx's own port would
        text = path.read_text().rstrip()
        if not text.endswith("}"):
            raise _servers.ServerError("unexpected nginx.conf shape: cannot add the TLS server")
        if self.via_unix is not None:
            upstream = f"""
    upstream delayed {{ server unix:{self.via_unix}; keepalive 512; }}"""
            body = ("" if self.conn_log else """
        access_log off;""") + """
        location / {
            proxy_pass http://delayed;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering on;
        }"""
        else:
            upstream = ""
            body = f"""
{self.locations}
        location / {{ autoindex on; autoindex_format html; etag on; }}"""
        if self.conn_log:
            upstream += """
    log_format conn '$connection $server_protocol $request_uri';"""
            body = f"""
        access_log "{tmp / 'tls_access.log'}" conn;""" + body
        server = f"""{upstream}
    server {{
        listen {self.host}:{self.tls_port} ssl{" http2" if self.http2 else ""};
        server_name localhost;
        root "{self.root}";
        ssl_certificate "{self.cert}";
        ssl_certificate_key "{self.key}";
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_session_cache shared:TLS:10m;
        http2_max_concurrent_streams 256;
{body}
    }}
}}
"""
        path.write_text(text[:-1] + server)
        return path
