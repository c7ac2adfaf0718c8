"""What a user is told when a URL or a request fails: named URL, cause and fix.

:func:`check_url` refuses URLs that fsspec would misread; :func:`translate` maps a
backend's exception (botocore, aiohttp, fsspec, an S3 answer) to a
:class:`~fastload.errors.FastloadError`. Whether a failure is worth another try is
:mod:`fastload.transport.failures`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import urlsplit

from fsspec.registry import known_implementations

from fastload.errors import (
    ConfigError,
    CredentialsError,
    FastloadError,
    RemoteChangedError,
    RemoteNotFoundError,
    SourceError,
)
from fastload.source.items import RemoteItem
from fastload.transport.failures import CREDENTIAL_ERRORS, REFUSALS, store_answer

INSTALL_HINTS = {
    "s3": "pip install 'fastload[s3]'",
    "s3a": "pip install 'fastload[s3]'",
    "gs": "pip install 'fastload[gcs]'",
    "gcs": "pip install 'fastload[gcs]'",
    "http": "pip install aiohttp",
    "https": "pip install aiohttp",
}


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)")
# Protocols whose URLs name a host or bucket right after "://".
_NEEDS_HOST = {"http": "host", "https": "host", "s3": "bucket", "s3a": "bucket", "gs": "bucket", "gcs": "bucket"}


def check_url(url: str) -> None:
    """Reject URLs that fsspec would misread rather than refuse.

    "s3:/b/k" became a local path "./s3:/b/k" (then "not found"), "http://" and
    "http://[::1" were reported as "http:: not found", and "s3://" as "Cannot
    traverse all of S3" (tests/reliability/test_hostile_input.py).
    """
    if "::" in url.split("://", 1)[0]:
        return  # a chained URL ("simplecache::s3://..."): fsspec parses the chain
    match = _SCHEME.match(url)
    if match is None or len(match.group(1)) == 1:  # no scheme, or a Windows drive "C:/"
        return
    scheme, slashes = match.group(1).lower(), match.group(2)
    if len(slashes) < 2 and scheme in known_implementations:
        rest = url[match.end() :]
        fixed = f"file:///{rest}" if scheme in ("file", "local") else f"{scheme}://{rest}"
        raise ConfigError(f"URL {url!r} needs two slashes after '{scheme}:'; fix: write '{fixed}'")
    kind = _NEEDS_HOST.get(scheme)
    if kind is None:
        return
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as err:
        raise ConfigError(f"URL {url!r} is malformed ({err}); fix: check the {kind} and the port") from err
    if not parts.netloc:
        example = "s3://bucket/prefix/" if kind == "bucket" else "https://host/path/"
        raise ConfigError(f"URL {url!r} names no {kind}; fix: write e.g. '{example}'")



def translate(err: BaseException, url: str, scrub: Callable[[str], str], http: bool) -> FastloadError:
    """Map a backend exception to a FastloadError naming ``url``, the cause and the fix."""
    cause = scrub(f"{type(err).__name__}: {err}")
    name = type(err).__name__
    answer = store_answer(err)
    if answer is not None and url.startswith(("s3://", "s3a://")):
        code, answered = answer  # a HEAD's answer has no body: its "code" is the status
        if code in REFUSALS or (answered in (400, 401, 403) and code in ("", str(answered), "BadRequest", "Forbidden")):
            return refused(url, code, answered, cause)
    if name in CREDENTIAL_ERRORS or isinstance(err, PermissionError):
        return CredentialsError(
            f"{url}: access denied or no credentials ({cause}); fix: pass credentials in "
            "storage_options (e.g. --storage-options '{\"key\": ..., \"secret\": ...}') or the "
            "provider's environment variables"
        )
    if isinstance(err, FileNotFoundError) or "NoSuchBucket" in cause:
        return RemoteNotFoundError(f"{url}: not found ({cause}); fix: check the bucket, path and spelling")
    status = getattr(err, "status", None)  # aiohttp's ClientResponseError
    if http and status in (401, 403):
        # nginx without autoindex answers a folder with 403, as it does a missing login.
        folder = status == 403 and url.endswith("/")
        return CredentialsError(
            f"{url}: the server refused the request (HTTP {status}: no login, or a wrong one"
            f"{'; or it does not list folders' if folder else ''}; {cause}); fix: pass the login in "
            "storage_options, e.g. --storage-options '{\"headers\": {\"Authorization\": \"Basic ...\"}}' (or "
            "client_kwargs={'auth': aiohttp.BasicAuth(user, password)} from Python)"
            + ("; or pass the objects' URLs as a list (--url-list; docs/storage.md)" if folder else "")
        )
    if isinstance(err, FastloadError):
        return err
    return SourceError(f"{url}: read failed ({cause}); fix: check the URL, storage_options and that the store is reachable")



def untrusted_text(url: str, cause: str) -> str:
    """What a CertificateError says (Source.translate): where a CA goes, not a retry."""
    s3 = url.startswith(("s3://", "s3a://"))
    where = ("storage_options={'client_kwargs': {'verify': '/path/to/ca.pem'}} or AWS_CA_BUNDLE=/path/to/ca.pem "
             "(s3fs's requests), and SSL_CERT_FILE=/path/to/ca.pem (libcurl's)" if s3 else "SSL_CERT_FILE=/path/to/ca.pem (or SSL_CERT_DIR), which libcurl's and aiohttp's "
             "requests both trust")
    return (f"{url}: the server's TLS certificate is not trusted ({cause}); not retried; fix: trust its CA: {where}; "
            "or check that the URL names the right host (a certificate for another name fails so too)")


def refused(url: str, code: str, status: int, cause: str = "") -> CredentialsError:
    """An S3 answer that refuses the credentials (fastload.source.s3.refusal, or botocore's error
    under s3fs's): its code, and where valid ones go."""
    if code in ("", str(status)):  # botocore's code for an answer without a body
        what = (f"HTTP {status} to a HEAD, whose answer carries no S3 error code: a wrong key, secret or "
                "session token, or a wrong region")
    else:
        what = f"{code}, HTTP {status}"
    return CredentialsError(
        f"{url}: S3 refused the credentials ({what}{'; ' + cause if cause else ''}); fix: pass valid ones in storage_options "
        "(key, secret, and token for temporary ones), or set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
        "AWS_SESSION_TOKEN or AWS_PROFILE; temporary credentials expire: renew them"
    )


def unchanged(listed: RemoteItem, now: RemoteItem) -> RemoteItem:
    """``listed``, if the object still has its size and version (as ``now`` reports them).

    Raises:
        RemoteChangedError: It has another size or version.
    """
    if now.size != listed.size or (listed.version and now.version and now.version != listed.version):
        raise RemoteChangedError(
            f"{listed.url}: remote now has {now.size} B (version {now.version!r}), {listed.size} B "
            f"(version {listed.version!r}) when listed; the object changed; fix: `fastload cache --refresh` or refresh=True"
        )
    return listed



def changed(listed: RemoteItem, why: str) -> RemoteChangedError:
    """The error for a GET that named ``listed``'s version and was refused (``why``: a 412): the object
    was rewritten since it was listed, maybe while it was read."""
    return RemoteChangedError(
        f"{listed.url}: remote now has another version than {listed.version!r} ({why}), {listed.size} B when listed; "
        "the object changed; fix: `fastload cache --refresh` or refresh=True"
    )
