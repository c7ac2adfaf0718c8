"""AWS Signature Version 4 for the S3 GETs that libcurl's engine sends (fastload.source.s3).

Why here and not libcurl's ``CURLOPT_AWS_SIGV4``: libcurl 7.88 spent about
0.055 ms of CPU signing each GET (0.085 ms per request against 0.031 unsigned,
2,000 GETs of 110 KB from nginx, one run), a sixth of a cold object's whole
budget; this signs one in 4-6 us with hashlib and hmac, for the batch
at once, before the batch is handed to the engine (benchmarks/s3/signing.py
measures both in one run). botocore's signer costs more still, and needs a
request object per GET.

What is signed: the method (GET), the path and query exactly as sent, the host,
and every header the request carries whose name is ``range`` or starts with
``x-amz-``; the payload is the SHA-256 of the empty body a GET carries (:data:`EMPTY_SHA256`, said
in ``x-amz-content-sha256``), as botocore signs a GetObject, so the two sign alike
(tests/unit/test_s3_conformance.py compares them, header for header).
moto's server checks every signature in tests/integration/test_s3_signed.py and
the Source contract suite.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Sequence

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED = "UNSIGNED-PAYLOAD"
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # hashlib.sha256(b"").hexdigest()
_DEFAULT_PORTS = {"http": ":80", "https": ":443"}


@functools.lru_cache(maxsize=16)
def signing_key(secret: str, day: str, region: str, service: str = "s3") -> bytes:
    """The day's key derived from ``secret`` (AWS's kDate -> kRegion -> kService -> kSigning)."""
    key = hmac.new(("AWS4" + secret).encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def authorizations(urls: Sequence[str], headers: Sequence[str], access_key: str, secret: str, region: str,
                   amz_date: str, service: str = "s3") -> list[str]:
    """One ``Authorization:`` header line per GET of ``urls``, each sent with ``headers``.

    Args:
        urls: What libcurl requests: ``scheme://host[:port]/path[?query]``, the path
            and query already encoded as SigV4 wants them (each key segment once,
            the query's names sorted: fastload.source.s3 builds them so).
        headers: The batch's header lines ("Name: value"), ``x-amz-date: <amz_date>``
            and ``x-amz-content-sha256`` among them.
        access_key, secret: The credentials.
        region: The bucket's region.
        amz_date: ``YYYYMMDDTHHMMSSZ``, as in the ``x-amz-date`` header.
        service: The signing name botocore resolved for the endpoint ("s3").

    >>> line = authorizations(["http://127.0.0.1:9000/b/k"], ["x-amz-date: 20261202T000000Z"], "AK", "SK",
    ...                       "us-east-1", "20261202T000000Z")[0]
    >>> line.split(",")[0]
    'Authorization: AWS4-HMAC-SHA256 Credential=AK/20261202/us-east-1/s3/aws4_request'
    """
    signed = sorted((name.strip().lower(), value.strip()) for name, _, value in (h.partition(":") for h in headers)
                    if name.strip().lower() == "range" or name.strip().lower().startswith("x-amz-"))
    names = ";".join(["host", *(n for n, _ in signed)])
    payload = next((v for n, v in signed if n == "x-amz-content-sha256"), UNSIGNED)
    block = "".join(f"{n}:{v}\n" for n, v in signed) + f"\n{names}\n{payload}"
    scope = f"{amz_date[:8]}/{region}/{service}/aws4_request"
    head = f"{ALGORITHM}\n{amz_date}\n{scope}\n"
    key = signing_key(secret, amz_date[:8], region, service)
    prefix = f"Authorization: {ALGORITHM} Credential={access_key}/{scope}, SignedHeaders={names}, Signature="
    out = []
    for url in urls:
        scheme, _, rest = url.partition("://")
        host, _, target = rest.partition("/")
        port = _DEFAULT_PORTS.get(scheme, "")
        if port and host.endswith(port):
            host = host[: -len(port)]  # libcurl sends no default port in Host
        path, _, query = target.partition("?")
        canonical = f"GET\n/{path}\n{query}\nhost:{host.lower()}\n{block}"
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        out.append(prefix + hmac.new(key, (head + digest).encode(), hashlib.sha256).hexdigest())
    return out
