"""S3 first-block GETs on libcurl's engine, signed there (SigV4): one request per object, off the GIL.

Why: through s3fs each cold object cost a HEAD and then a GET, each signed by
botocore in Python and parsed on fsspec's event loop: 0.23 of a 1 Gbit link at
4.0 ms of CPU per object (issue 21). Here the first-block GET of each object goes
through the C engine that carries HTTP's (:mod:`fastload.transport.curl`), and libcurl
signs it (``CURLOPT_AWS_SIGV4``). Its Content-Range sizes the object and its
ETag versions it, so a key list needs no HEAD. Each GET is signed here
(fastload.source.sigv4) and handed over with the batch. The client was chosen by
measurement (benchmarks/s3/results/results.md): obstore, the library alternative,
hangs in a forked child (its tokio runtime does not survive fork, and DataLoader
workers fork), and cost more CPU per object in the same run on a 1 Gbit link.

Scope: the first block of each s3:// or s3a:// object, listed (sized) or from a
key list (sizeless), and the ListObjectsV2 pages of a listing, one per common
prefix at a time, all prefixes of a level together (fastload.source.listing). HEADs,
later blocks and streamed objects stay on s3fs. So do errors: an answer this path does not take as it is (403, 404,
SlowDown...) is done again through s3fs, whose retries, backoff and messages
users see. The host limit governs these GETs like any other (a 503 or SlowDown
cuts it: :func:`fastload.transport.curl.pump`).

Credentials: ``key`` / ``secret`` / ``token`` as given; ``anon=True``: unsigned;
otherwise botocore's chain (environment variables, the profile file and its
``credential_process``, SSO, container and instance roles), resolved once per
Source and asked before each batch: botocore refreshes temporary credentials
before they expire, so an epoch outlives them.

Options: ``storage_options`` as s3fs takes them. This path honours those in
:data:`HONOURED` and ignores those in :data:`S3FS_ONLY` (they shape s3fs's own
caches). Any other one keeps the source's GETs on s3fs, and one log line names it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

from fastload.errors import CredentialsError
from fastload.source import errors, sigv4
from fastload.source.items import ListPage
from fastload.transport import curl
from fastload.transport.curl import CurlRoute
from fastload.transport.failures import REFUSALS

# storage_options this path honours, and what it honours inside client_kwargs and config_kwargs.
HONOURED = {"key", "secret", "token", "anon", "profile", "endpoint_url", "client_kwargs", "config_kwargs",
            "requester_pays", "use_ssl"}
_CLIENT_KEYS = {"endpoint_url", "region_name"}
_CONFIG_KEYS = {"connect_timeout", "read_timeout", "retries", "s3", "signature_version"}
# s3fs's own caches and buffers: nothing of a GET.
S3FS_ONLY = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "default_block_size",
             "default_fill_cache", "default_cache_type", "cache_regions", "asynchronous", "loop", "max_concurrency",
             "fixed_upload_size"}
_DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]\Z")  # a bucket name that can be a host name (no dots: TLS)


class Frozen(NamedTuple):
    """One set of credentials, as botocore's ``get_frozen_credentials()`` gives them."""

    access_key: str
    secret_key: str
    token: str | None


class _Static:
    """Credentials given in storage_options: they never change."""

    def __init__(self, key: str, secret: str, token: str | None) -> None:
        self._frozen = Frozen(key, secret, token)

    def get_frozen_credentials(self) -> Frozen:
        return self._frozen


@dataclass(frozen=True)
class S3Route(CurlRoute):
    """How an S3 source's first-block GETs go through libcurl: where they go and how they are signed."""

    page_types: ClassVar[tuple[str, ...]] = ("application/xml",)  # its listing pages

    base: str = ""  # the endpoint: "https://s3.<region>.amazonaws.com", or endpoint_url
    virtual: bool = False  # virtual-hosted style (bucket.host/key); else path style (host/bucket/key)
    region: str = "us-east-1"
    credentials: Any = None  # has get_frozen_credentials() (botocore's, refreshed by it); None: unsigned

    def wire(self, url: str) -> str:
        """The HTTPS URL of ``s3://bucket/key`` at this endpoint, the key encoded as SigV4 signs it
        (a listing page's URL, :meth:`list_url`, is one already)."""
        if not url.startswith(("s3://", "s3a://")):
            return url
        bucket, _, key = url.split("://", 1)[1].partition("/")
        key = quote(key, safe="/-_.~")
        if self.virtual:
            parts = urlsplit(self.base)
            return f"{parts.scheme}://{bucket}.{parts.netloc}/{key}"
        return f"{self.base}/{bucket}/{key}"

    def list_url(self, bucket: str, prefix: str, token: str | None) -> str:
        """One ListObjectsV2 page of ``prefix`` (``delimiter=/``), after ``token`` if given.

        The query is sent sorted and encoded as SigV4 signs it: libcurl 7.88 signs the
        query as it is given (an unsorted one was refused, tests/integration/test_s3_signed.py).
        """
        params = {"delimiter": "/", "list-type": "2", "prefix": prefix}
        if token:
            params["continuation-token"] = token
        query = "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))
        if self.virtual:
            parts = urlsplit(self.base)
            return f"{parts.scheme}://{bucket}.{parts.netloc}/?{query}"
        return f"{self.base}/{bucket}?{query}"

    def sign(self, wire: list[str], headers: list[str]) -> tuple[list[str], list[str] | None]:
        """The batch's x-amz headers and each GET's Authorization (fastload.source.sigv4); none when unsigned."""
        if self.credentials is None:
            return [], None
        frozen = self.credentials.get_frozen_credentials()  # botocore refreshes expiring ones here
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        batch = [f"x-amz-content-sha256: {sigv4.UNSIGNED}", f"x-amz-date: {amz_date}"]
        if frozen.token:
            batch.append(f"x-amz-security-token: {frozen.token}")
        lines = sigv4.authorizations(wire, [*headers, *batch], frozen.access_key, frozen.secret_key, self.region, amz_date)
        return batch, lines

    def parse_page(self, text: str) -> ListPage:
        return parse_list(text)

    def item_url(self, bucket: str, key: str) -> str:
        return f"s3://{bucket}/{key}"

    def refused(self, url: str, err: curl.HttpStatusError) -> CredentialsError | None:
        """An answer whose S3 error code refuses the credentials, as a CredentialsError (s3fs would see
        no code in a HEAD's answer, which has no body, only "400 Bad Request")."""
        code = refusal(err)
        return errors.refused(url, code, err.status) if code else None


def parse_list(text: str) -> ListPage:
    """Read one ListObjectsV2 answer (XML; expat refuses entity expansion bombs)."""
    root = ElementTree.fromstring(text)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    objects = [(c.findtext(f"{ns}Key") or "", int(c.findtext(f"{ns}Size") or 0), (c.findtext(f"{ns}ETag") or "").strip('"'))
               for c in root.iter(f"{ns}Contents")]
    prefixes = [p.findtext(f"{ns}Prefix") or "" for p in root.iter(f"{ns}CommonPrefixes")]
    truncated = (root.findtext(f"{ns}IsTruncated") or "").lower() == "true"
    return ListPage(objects, prefixes, root.findtext(f"{ns}NextContinuationToken") if truncated else None)


def route_for(url: str, options: dict[str, Any], choice: str) -> tuple[S3Route | None, str]:
    """An S3 source's route through libcurl, or (None, why its GETs stay on s3fs).

    ``choice`` is ``Settings.http_client``: "aiohttp" keeps every GET off libcurl.
    """
    if why := curl.closed_by(choice):
        return None, why
    client = dict(options.get("client_kwargs") or {})
    config = dict(options.get("config_kwargs") or {})
    addressing = (config.get("s3") or {}).get("addressing_style", "auto")
    odd = sorted(set(options) - HONOURED - S3FS_ONLY) + [f"client_kwargs.{k}" for k in sorted(set(client) - _CLIENT_KEYS)] \
        + [f"config_kwargs.{k}" for k in sorted(set(config) - _CONFIG_KEYS)] \
        + [f"config_kwargs.s3.{k}" for k in sorted(set(config.get("s3") or {}) - {"addressing_style"})]
    if config.get("signature_version", "s3v4") != "s3v4":
        odd.append("config_kwargs.signature_version")
    if odd:
        return None, f"storage option {odd[0]!r} is honoured by s3fs only"
    endpoint = str(options.get("endpoint_url") or client.get("endpoint_url") or "").rstrip("/")
    import botocore.session  # s3fs's dependency

    session = botocore.session.Session(profile=options.get("profile"))
    # AWS_REGION as the AWS CLI and SDKs read it; botocore reads AWS_DEFAULT_REGION and the profile.
    region = client.get("region_name") or os.environ.get("AWS_REGION") or session.get_config_variable("region")
    if not region:
        if not endpoint:
            return None, "no region is set (client_kwargs={'region_name': ...}, or AWS_REGION)"
        region = "us-east-1"  # what S3-compatible stores expect when none is named
    credentials: Any = None  # anon: unsigned
    if options.get("key") and options.get("secret") and not options.get("anon"):
        credentials = _Static(str(options["key"]), str(options["secret"]), options.get("token"))
    elif not options.get("anon"):
        credentials = session.get_credentials()
        if credentials is None:
            return None, "botocore found no credentials"  # s3fs then raises the named CredentialsError
    if not endpoint:
        scheme = "http" if options.get("use_ssl") is False else "https"
        endpoint = f"{scheme}://s3.{region}.amazonaws.com"
    bucket = url.split("://", 1)[1].partition("/")[0]
    virtual = addressing == "virtual" or (addressing == "auto" and "amazonaws.com" in endpoint
                                          and bool(_DNS_BUCKET.match(bucket)))
    headers = ("x-amz-request-payer: requester",) if options.get("requester_pays") else ()
    return S3Route(headers=headers, userpwd=None, trust_env=True, encode=None, base=endpoint, virtual=virtual,
                   region=str(region), credentials=credentials), ""


_CODE = re.compile(rb"<Code>([A-Za-z]+)</Code>")


def refusal(err: BaseException) -> str:
    """The S3 error code of an answer that refuses the credentials ("" for any other failure)."""
    match = _CODE.search(getattr(err, "body", b"") or b"")
    code = match.group(1).decode() if match else ""
    return code if code in REFUSALS else ""
