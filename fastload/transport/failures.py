"""Which failures of a request are worth another try, and which say the host is overloaded.

The one classifier of request errors: :func:`transient` decides whether
:class:`~fastload.source.Source` retries (after backoff, outside the request's
slot), :func:`congestion` whether the host's limit is cut
(:mod:`fastload.transport.hostlimit`). Every congestion is transient; a transient error
need not be congestion (a 500, a cut body). Errors are matched by class name,
so that neither botocore nor aiohttp is a dependency.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Iterable, Iterator
from typing import Any

from fastload.errors import FastloadError

# Exceptions whose class name marks missing or rejected credentials (botocore,
# google-auth).
CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "DefaultCredentialsError",
    "RefreshError",
}


class TruncatedBodyError(OSError):
    """A read returned fewer bytes than asked for (a cut connection); retried."""


_CONGESTION_NAMES = {
    "ClientConnectorError",  # refused / reset while connecting (aiohttp)
    "ServerDisconnectedError",
    "ClientOSError",
    "ConnectTimeoutError",
    "ServerTimeoutError",  # aiohttp's connect and socket-read timeouts
    "ConnectionTimeoutError",
    "SocketTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
}


# Error codes of throttling answers (S3 and other AWS APIs, as botocore reports them).
_THROTTLE_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
}


def congestion(err: BaseException) -> str:
    """What in ``err`` says the host is overloaded ("" if nothing): 429, 503, SlowDown, a connect timeout or reset.

    The structure of the error and its causes decides first: botocore's
    ``response["Error"]["Code"]`` (s3fs raises ``OSError(EBUSY)`` from it, whose text
    says only "Please reduce your request rate."), an HTTP status, the exception's
    class. Message text is the fallback for errors that carry no structure.

    >>> congestion(TimeoutError()), congestion(ValueError("bad range"))
    ('TimeoutError', '')
    """
    for e in _chain(err):
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore's ClientError
            code = (response.get("Error") or {}).get("Code")
            if code in _THROTTLE_CODES:
                return str(code)
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status in (429, 503):
                return f"HTTP {status}"
        status = getattr(e, "status", None) or getattr(e, "code", None)
        if status in (429, 503):
            return f"HTTP {status}"
        if isinstance(e, (ConnectionResetError, ConnectionRefusedError, ConnectionAbortedError, TimeoutError, asyncio.TimeoutError)):
            return type(e).__name__
        if type(e).__name__ in _CONGESTION_NAMES:
            return type(e).__name__
    for e in _chain(err):
        # URLs out first: a port or a name holding "429" or "503" (127.0.0.1:42951) is not a status.
        text = _URL.sub("", str(e))
        if _THROTTLE_TEXT.search(text):
            return type(e).__name__
    return ""


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")
_THROTTLE_TEXT = re.compile(r"SlowDown|Throttl|\b429\b|\b503\b|Too Many Requests|Service Unavailable")
# Transient, but no sign of an overloaded host: a cut or stalled answer.
_CUT_NAMES = {
    "ClientPayloadError",
    "FSTimeoutError",
    "ReadTimeoutError",
    "IncompleteReadError",
    "ResponseStreamingError",
    "TruncatedBodyError",
}


# Error codes of an object store's answer that refuse the credentials (not the object): retrying cannot help.
REFUSALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired",
            "InvalidClientTokenId", "AuthorizationHeaderMalformed", "AccessDenied", "AllAccessDisabled"}
_TRANSIENT_4XX = {"RequestTimeout", "RequestTimeTooSkewed"}  # 400s that another try may mend
_UNTRUSTED_NAMES = {"SSLCertVerificationError", "ClientConnectorCertificateError", "CertificateError"}
_UNTRUSTED_TEXT = re.compile(r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|libcurl error (60|77)\)")


def untrusted(err: BaseException) -> str:
    """What in ``err`` says the server's TLS certificate is not trusted ("" if nothing): a self-signed
    one, an unknown CA, another host's name. Another try cannot help; the CA options can
    (errors.untrusted names them). ssl's, aiohttp's and botocore's errors, and libcurl's 60 and 77.

    >>> import ssl
    >>> untrusted(ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] self-signed certificate"))
    'SSLCertVerificationError'
    """
    for e in _chain(err):
        if isinstance(e, ssl.SSLCertVerificationError) or type(e).__name__ in _UNTRUSTED_NAMES:
            return type(e).__name__
    for e in _chain(err):
        if _UNTRUSTED_TEXT.search(str(e)):
            return type(e).__name__
    return ""


def store_answer(err: BaseException) -> tuple[str, int] | None:
    """The error code and HTTP status of an object store's answer behind ``err`` (botocore's
    ClientError, which s3fs raises its errors from), or None. A HEAD's answer has no body: its
    code is the status ("400", "403")."""
    for e in _chain(err):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            code = str((response.get("Error") or {}).get("Code") or "")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return code, int(status) if isinstance(status, int) else 0
    return None


def _refused_by_store(err: BaseException) -> bool:
    """An object store's 4xx answer another try cannot mend: refused credentials, a bad request."""
    answer = store_answer(err)
    if answer is None:
        return False
    code, status = answer
    return code in REFUSALS or (400 <= status < 500 and status not in (408, 429) and code not in _TRANSIENT_4XX
                                and code not in _THROTTLE_CODES)


def _chain(err: BaseException) -> Iterator[BaseException]:
    e: BaseException | None = err
    for _ in range(6):
        if e is None:
            return
        yield e
        e = e.__cause__ or e.__context__


def transient(err: BaseException) -> bool:
    """Whether another try of the request that raised ``err`` may succeed (network, timeout, 5xx, throttling)."""
    # fsspec's HTTP info() reports a refused connection as FileNotFoundError; the
    # network error underneath decides.
    cause = err.__cause__ or err.__context__
    if isinstance(err, FileNotFoundError) and cause is not None and transient(cause):
        return True
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FastloadError)):
        return False
    if type(err).__name__ in CREDENTIAL_ERRORS or untrusted(err) or _refused_by_store(err):
        return False
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, ConnectionError, TruncatedBodyError)):
        return True
    if congestion(err):  # 429, 503, SlowDown...: worth another try, after backoff
        return True
    if type(err).__name__ in _CUT_NAMES:
        return True
    status = getattr(err, "status", None) or getattr(err, "code", None)
    if isinstance(status, int):
        return status >= 500  # 429 and 503 were congestion() above
    text = str(err)
    if any(s in text for s in ("500 Internal", "RequestTimeout", "Connection reset")):  # throttles: congestion()
        return True
    # A bare OSError from a network stack is usually transient; a ValueError is not.
    return isinstance(err, OSError) and not isinstance(err, FileExistsError)


def describe(err: BaseException, timeout_s: float) -> str:
    """``Type: message`` of the error worth naming, with the backend error beneath it.

    fsspec's HTTP info() reports a 503 or a reset as ``FileNotFoundError(url)``, and
    s3fs turns S3's ``SlowDown`` into ``OSError(EBUSY)``: the user needs the error
    underneath (tests/reliability/test_flaky_remote.py checks the messages).
    """
    cause = err.__cause__ or err.__context__
    while isinstance(err, FileNotFoundError) and cause is not None and transient(cause):
        err, cause = cause, cause.__cause__ or cause.__context__
    # Timeouts often carry no message; say what expired instead of printing "".
    text = str(err) or (
        f"no answer within request_timeout_s={timeout_s:g} s"
        if isinstance(err, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(err).__name__
        else "no message"
    )
    if err.__cause__ is not None and str(err.__cause__) and str(err.__cause__) not in text:
        text += f" (from {type(err.__cause__).__name__}: {err.__cause__})"
    return f"{type(err).__name__}: {text}"



_SECRET_KEY = re.compile(r"key|secret|token|pass|session|cred|auth|sig|sas", re.IGNORECASE)


def secrets(value: Any, secret: bool = False) -> Iterable[str]:
    """String leaves stored under secret-looking keys (key, secret, token, password...)."""
    if isinstance(value, str):
        if secret and len(value) >= 3:
            yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from secrets(v, secret or bool(_SECRET_KEY.search(str(k))))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from secrets(v, secret)
