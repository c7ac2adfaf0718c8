"""An HTTPS server whose certificate is not trusted: a CertificateError at once, naming the CA options.

It was retried (5 times, then for the whole retry budget) and the message suggested more
retries (issue 32, item 7). The server is a local one with a self-signed certificate.
"""

from __future__ import annotations

import datetime
import http.server
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.config import Settings
from fastload.errors import CertificateError
from fastload.source import RemoteItem, Source

pytestmark = pytest.mark.integration


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    connections = 0  # TCP connections accepted: each is one attempt's handshake

    def get_request(self) -> tuple[Any, Any]:
        self.connections += 1
        return super().get_request()

    def handle_error(self, request: Any, client_address: Any) -> None:
        return None  # the client refusing the certificate is the point


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[_Server]:
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"data")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
            return None

    server = _Server(("127.0.0.1", 0), Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.parametrize("client", ["auto", "aiohttp"])
def test_an_untrusted_certificate_is_not_retried_and_names_the_ca_options(
        client: str, tmp_path: Path, https_server: _Server) -> None:
    url = f"https://127.0.0.1:{https_server.server_address[1]}/x.bin"
    # Default retries: a budget of minutes, had the error been taken for a transient one.
    src = Source(url, settings=Settings.from_env({}, cache_dir=tmp_path / "cache", http_client=client))
    with pytest.raises(CertificateError) as info:
        src.fetch_first(RemoteItem(url, -1, ""), 4)
    msg = str(info.value)
    assert msg.startswith(url) and "not trusted" in msg and "SSL_CERT_FILE" in msg and "not retried" in msg, msg
    assert "retry_budget_s" not in msg and "FASTLOAD_RETRIES" not in msg, msg
    # One attempt per road (libcurl's, then aiohttp's), never a retry.
    assert https_server.connections <= 2, https_server.connections
