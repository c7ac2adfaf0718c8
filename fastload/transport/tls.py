"""Which CA bundle a process's HTTPS requests trust, as requests and the curl tool read it.

Python's ssl (so aiohttp) and the engine trust SSL_CERT_FILE / SSL_CERT_DIR (Python's
default verify paths). Users of requests name a private CA in REQUESTS_CA_BUNDLE, curl's in
CURL_CA_BUNDLE: both roads trust that one as well as the defaults (libcurl's GETs through a route's
``cainfo``/``capath``, :mod:`fastload.transport.curl`; aiohttp's requests through their
session's SSL context, :func:`fastload.transport.hostlimit.aiohttp_client`), so a file's
first block and its later blocks, HEADs and retries trust the same CA.
"""

from __future__ import annotations

import atexit
import os
import ssl
import tempfile
from typing import Any

from fastload.errors import ConfigError

CA_VARIABLES = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")  # read in this order, as requests does
_MERGED: dict[tuple[str, ...], str] = {}  # CA files -> one file holding them all, made once per process


def ca_bundle(environ: Any) -> tuple[str | None, str | None]:
    """What a route trusts where REQUESTS_CA_BUNDLE (else CURL_CA_BUNDLE) names a CA bundle, as
    ``(cainfo, capath)``: that bundle (a file, or a folder of hashed certificates) together with
    what Python's ssl trusts (SSL_CERT_FILE / SSL_CERT_DIR, else the system's); (None, None) when
    neither variable is set (the engine's own, Python's defaults, then apply).

    Together, not one instead of the other: machines that set SSL_CERT_DIR, or all four, to the
    system's bundle are common (containers, CI), and a private CA named in either place must hold
    (tests/integration/test_tls_ca.py). libcurl takes one CA file, so two are joined into one file
    made once per process; folders are joined with ``:``, as OpenSSL reads a list of them.

    Raises:
        ConfigError: the variable names neither a file nor a folder (requests fails so too).
    """
    bundle = _named(environ)
    if bundle is None:
        return None, None
    defaults = ssl.get_default_verify_paths()  # SSL_CERT_FILE / SSL_CERT_DIR where set
    files = [p for p in (defaults.cafile, bundle) if p and os.path.isfile(p)]
    folders = [p for p in (defaults.capath, bundle) if p and os.path.isdir(p)]
    files = list(dict.fromkeys(os.path.realpath(p) for p in files))
    folders = list(dict.fromkeys(os.path.realpath(p) for p in folders))
    cainfo = files[0] if len(files) == 1 else _merged(files) if files else None
    return cainfo, ":".join(folders) or None


def _named(environ: Any) -> str | None:
    """The CA bundle REQUESTS_CA_BUNDLE (else CURL_CA_BUNDLE) names, or None; ConfigError where it names nothing."""
    for name in CA_VARIABLES:
        path = environ.get(name)
        if not path:
            continue
        if not (os.path.isfile(path) or os.path.isdir(path)):
            raise ConfigError(f"{name}={path!r} names no CA bundle (no such file or folder); fix: point it at a "
                              "PEM file of CA certificates, or unset it")
        return str(path)
    return None


def _merged(files: list[str]) -> str:
    """One PEM file holding the certificates of ``files`` (made once per process, removed at exit)."""
    key = tuple(files)
    path = _MERGED.get(key)
    if path is None or not os.path.exists(path):
        fd, path = tempfile.mkstemp(prefix="fastload-ca-", suffix=".pem")
        with os.fdopen(fd, "wb") as out:
            for name in files:
                with open(name, "rb") as f:
                    out.write(f.read().rstrip(b"\n") + b"\n")
        _MERGED[key] = path
        atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # gone already


def ssl_context(environ: Any) -> ssl.SSLContext | None:
    """An SSL context trusting Python's defaults and the CA bundle :func:`ca_bundle` finds, or None
    where none is named (aiohttp's default context then applies)."""
    bundle = _named(environ)
    if bundle is None:
        return None
    context = ssl.create_default_context()  # SSL_CERT_FILE / SSL_CERT_DIR, else the system's
    if os.path.isdir(bundle):
        context.load_verify_locations(capath=bundle)
    else:
        context.load_verify_locations(cafile=bundle)
    return context
