"""TLS for tests: a throwaway CA, an HTTPS file server, and a TLS front for a plain server.

The CA is trusted by nothing until a test names it (``SSL_CERT_FILE``, ``AWS_CA_BUNDLE``),
so a client that ignores the variable fails verification: that is what the tests check.
Servers listen on port 0 and are shut down and joined by their context managers.
"""

from __future__ import annotations

import datetime
import functools
import http.server
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def make_ca(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate it signed for 127.0.0.1 and localhost: ``(ca.pem, cert.pem, key.pem)``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    day = datetime.timedelta(days=1)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fastload test CA")])
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False)
    # The extensions Python 3.13's strict verification (VERIFY_X509_STRICT) asks of a CA.
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - day).not_valid_after(now + day)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(usage, critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - day).not_valid_after(now + day)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def _server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@contextmanager
def https_files(root: Path, cert: Path, key: Path) -> Iterator[str]:
    """Serve ``root`` over HTTPS (Python's http.server: an index page per folder); yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    server.socket = _server_context(cert, key).wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="https-files", daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def tls_front(backend: tuple[str, int], cert: Path, key: Path) -> Iterator[str]:
    """Accept TLS on a port of its own and pass the bytes to the plain ``backend``; yields ``https://host:port``."""
    ctx = _server_context(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()
    threads: list[threading.Thread] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass  # the other direction closed the pair: nothing left to pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already shut by the other pipe

    def serve() -> None:
        while not done.is_set():
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                raw.settimeout(10)
                client = ctx.wrap_socket(raw, server_side=True)
                client.settimeout(None)
            except OSError:
                raw.close()  # a client that refused our certificate: its own test says so
                continue
            upstream = socket.create_connection(backend)
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=pipe, args=(a, b), daemon=True)
                t.start()
                threads.append(t)

    acceptor = threading.Thread(target=serve, name="tls-front", daemon=True)
    acceptor.start()
    try:
        yield f"https://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        acceptor.join()
        listener.close()
        for t in threads:
            t.join(timeout=5)
