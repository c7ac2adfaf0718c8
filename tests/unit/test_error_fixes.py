"""Errors that name the fix (issue 32, item 7): which failures are retried, and what they say.

botocore's errors are built by hand, as s3fs raises them (its OSError from botocore's
ClientError): the road through a real store is tests/integration/test_s3_signed.py
(refused listings) and tests/integration/test_tls_untrusted.py (a self-signed server).
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import pytest

from fastload.errors import CertificateError, CredentialsError, SourceError
from fastload.source import Source, errors, fallback
from fastload.transport.failures import transient, untrusted


def _s3fs_error(code: str, status: int, wrapper: type[OSError] = OSError) -> OSError:
    """What s3fs raises for a refused request: its translation, from botocore's ClientError."""
    from botocore.exceptions import ClientError

    answer: Any = {"Error": {"Code": code, "Message": "Bad Request"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    try:
        try:
            raise ClientError(answer, "HeadObject")
        except ClientError as err:
            raise wrapper(22, "Bad Request") from err
    except OSError as outer:
        return outer


def _translate(err: BaseException, url: str = "s3://bkt/train/") -> Exception:
    return errors.translate(err, url, lambda s: s, http=False)


@pytest.mark.parametrize(("code", "status", "shown"), [
    ("400", 400, "HTTP 400 to a HEAD"),  # a bad session token, as a HEAD reports it
    ("InvalidToken", 400, "InvalidToken, HTTP 400"),
    ("ExpiredToken", 400, "ExpiredToken, HTTP 400"),
    ("SignatureDoesNotMatch", 403, "SignatureDoesNotMatch, HTTP 403"),
    ("403", 403, "HTTP 403 to a HEAD"),
])
def test_a_refusal_is_not_retried_and_names_s3s_code(code: str, status: int, shown: str) -> None:
    pytest.importorskip("botocore")
    err = _s3fs_error(code, status, PermissionError if status == 403 else OSError)
    assert not transient(err)
    out = _translate(err)
    assert isinstance(out, CredentialsError) and shown in str(out) and "fix:" in str(out), out


@pytest.mark.parametrize(("code", "status"), [("SlowDown", 503), ("InternalError", 500), ("RequestTimeout", 400)])
def test_throttles_and_server_errors_are_still_retried(code: str, status: int) -> None:
    pytest.importorskip("botocore")
    assert transient(_s3fs_error(code, status))


@pytest.mark.parametrize("err", [
    ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"),
    ConnectionError("https://h/x: SSL certificate problem: self-signed certificate (libcurl error 60)"),
])
def test_an_untrusted_certificate_is_not_retried_and_names_the_ca_options(err: BaseException) -> None:
    assert untrusted(err) and not transient(err)
    http = Source("https://h/x").translate(err, "https://h/x")
    assert isinstance(http, CertificateError) and "SSL_CERT_FILE" in str(http) and "not retried" in str(http)
    s3 = errors.untrusted_text("s3://bkt/x", "SSLError")
    assert "AWS_CA_BUNDLE" in s3 and "'verify'" in s3


def test_botocores_ssl_error_is_an_untrusted_certificate() -> None:
    pytest.importorskip("botocore")
    from botocore.exceptions import SSLError

    err = SSLError(endpoint_url="https://minio:9000/bkt",
                   error="[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate")
    assert not transient(err) and isinstance(Source("https://h/x").translate(err, "https://h/x"), CertificateError)


def test_other_errors_are_not_taken_for_refusals() -> None:
    assert transient(ConnectionResetError("reset"))
    out = _translate(ValueError("odd"))
    assert type(out) is SourceError


def test_the_fallback_line_is_a_warning_once_per_process(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(fallback, "_noted", set())
    with caplog.at_level(logging.INFO, logger="fastload"):
        fallback.note_fallback("s3://bkt/a/", "storage option 'version_aware' is honoured by s3fs only")
        fallback.note_fallback("s3://bkt/b/", "storage option 'version_aware' is honoured by s3fs only")
        fallback.note_fallback("s3://bkt/c/", "botocore found no credentials")
    levels = [(r.levelno, "s3fs" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.WARNING, True), (logging.INFO, True)], levels
