"""Which CA bundle a process's HTTPS requests trust, as requests and the curl tool read it.

Python's ssl (so aiohttp) and the engine trust SSL_CERT_FILE / SSL_CERT_DIR (Python's
default verify paths). Users of requests name a private CA in REQUESTS_CA_BUNDLE, curl's in
CURL_CA_BUNDLE: both roads trust that one too (libcurl's GETs through a route's
``cainfo``/``capath``, :mod:`fastload.transport.curl`; aiohttp's requests through their
session's SSL context, :func:`fastload.transport.hostlimit.aiohttp_client`), so a file's
first block and its later blocks, HEADs and retries trust the same CA.
"""

from __future__ import annotations

import os
import ssl
from typing import Any

from fastload.errors import ConfigError

CA_VARIABLES = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")  # read in this order, as requests does
SSL_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR")  # Python's ssl reads them: set, they win


def ca_bundle(environ: Any) -> tuple[str | None, str | None]:
    """The CA bundle ``environ`` names as requests reads it (REQUESTS_CA_BUNDLE, else CURL_CA_BUNDLE), as
    ``(cainfo, capath)``: a file, or a folder of hashed certificates; (None, None) when neither is set,
    or when SSL_CERT_FILE or SSL_CERT_DIR is.

    Those two win: machines that set all four to the system's bundle are common (containers, CI),
    and a private CA in SSL_CERT_FILE must not be dropped for the system bundle in
    REQUESTS_CA_BUNDLE (tests/integration/test_tls_ca.py::test_ssl_cert_file_is_trusted_on_the_engine).

    Raises:
        ConfigError: the variable names neither a file nor a folder (requests fails so too).
    """
    if any(environ.get(name) for name in SSL_VARIABLES):
        return None, None
    for name in CA_VARIABLES:
        path = environ.get(name)
        if not path:
            continue
        if os.path.isdir(path):
            return None, path
        if os.path.isfile(path):
            return path, None
        raise ConfigError(f"{name}={path!r} names no CA bundle (no such file or folder); fix: point it at a PEM "
                          "file of CA certificates, or unset it")
    return None, None


def ssl_context(environ: Any) -> ssl.SSLContext | None:
    """An SSL context trusting the CA bundle :func:`ca_bundle` finds (only it, as requests does), or None
    where none is named (Python's defaults then apply)."""
    cafile, capath = ca_bundle(environ)
    if cafile is None and capath is None:
        return None
    return ssl.create_default_context(cafile=cafile, capath=capath)
