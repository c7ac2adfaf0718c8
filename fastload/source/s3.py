"""S3 first-block GETs on libcurl's engine, signed there (SigV4): one request per object, off the GIL.

Why: through s3fs each cold object cost a HEAD and then a GET, each signed by
botocore in Python and parsed on fsspec's event loop: 0.23 of a 1 Gbit link at
4.0 ms of CPU per object (issue 21). Here the first-block GET of each object goes
through the C engine that carries HTTP's (:mod:`fastload.transport.curl`). Its Content-Range sizes the object and its
ETag versions it, so a key list needs no HEAD. Each GET is signed here
(fastload.source.sigv4) and handed over with the batch. The client was chosen by
measurement (benchmarks/s3/results/results.md): obstore, the library alternative,
hangs in a forked child (its tokio runtime does not survive fork, and DataLoader
workers fork), and cost more CPU per object in the same run on a 1 Gbit link.

Scope: the first block of each s3:// or s3a:// object, listed (sized) or from a
key list (sizeless), the later blocks of a listed one (fastload.source.ranged), and
the ListObjectsV2 pages of a listing, one per common prefix at a time, all prefixes
of a level together (fastload.source.listing). HEADs and streamed objects stay on s3fs. So do errors: an answer this path does not take as it is (403, 404,
SlowDown...) is done again through s3fs, whose retries, backoff and messages
users see. The host limit governs these GETs like any other (a 503 or SlowDown
cuts it: :func:`fastload.transport.curl.pump`).

Credentials: ``key`` / ``secret`` / ``token`` as given; ``anon=True``: unsigned;
otherwise those botocore's client for these options signs with: keys in ``client_kwargs``, or
botocore's chain (environment variables, the profile file and its ``credential_process``, SSO,
container and instance roles), resolved once per
Source and asked before each batch: botocore refreshes temporary credentials
before they expire, so an epoch outlives them.

Options: ``storage_options`` as s3fs takes them. Where a GET goes (endpoint, addressing,
partition, FIPS, dual-stack), its signing region and name, and the CAs it trusts are what botocore
resolves for them, the environment and the profile (fastload.source.s3_resolve;
tests/unit/test_s3_conformance.py compares the two requests). This path honours the options in
:data:`HONOURED` and ignores those in :data:`S3FS_ONLY` (they shape s3fs's own caches). Any other
one, or a configuration whose requests it cannot sign (S3 Express, SigV2), keeps the source's GETs
on s3fs, and one log line names it: decided once per source, or per bucket, never per object.

Regions: each bucket has its route (:class:`Buckets`). An answer that names the bucket's region
(a 301, 307 or ``AuthorizationHeaderMalformed``: :meth:`S3Route.learn`) moves its GETs and listing
pages there for the rest of the process and its forked workers, and the refused request is sent
again there (tests/integration/test_s3_regions.py).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple, cast
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

from fastload.errors import ConfigError, CredentialsError
from fastload.source import errors, fallback, sigv4
from fastload.source.items import ListPage
from fastload.source.s3_resolve import Resolver
from fastload.transport import curl
from fastload.transport.curl import CurlRoute
from fastload.transport.failures import REFUSALS
from fastload.transport.hostlimit import HostLimit

log = logging.getLogger("fastload")

# storage_options this path honours, and what it honours inside client_kwargs and config_kwargs.
HONOURED = {"key", "secret", "token", "anon", "profile", "endpoint_url", "client_kwargs", "config_kwargs",
            "requester_pays", "use_ssl"}
# Those that say where a GET goes are resolved by botocore (fastload.source.s3_resolve); the rest shape
# botocore's own sending (timeouts, retries, pools, its user agent, its answers' checksums).
_CLIENT_KEYS = {"endpoint_url", "region_name", "verify", "use_ssl", "aws_access_key_id", "aws_secret_access_key",
                "aws_session_token"}
_CONFIG_KEYS = {"connect_timeout", "read_timeout", "retries", "s3", "signature_version", "region_name",
                "use_fips_endpoint", "use_dualstack_endpoint", "max_pool_connections", "user_agent", "user_agent_extra",
                "user_agent_appid", "tcp_keepalive", "parameter_validation", "response_checksum_validation",
                "request_checksum_calculation"}
_CONFIG_S3_KEYS = {"addressing_style", "use_accelerate_endpoint", "use_dualstack_endpoint", "us_east_1_regional_endpoint",
                   "use_arn_region", "payload_signing_enabled"}
# s3fs's own caches and buffers: nothing of a GET.
S3FS_ONLY = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "default_block_size",
             "default_fill_cache", "default_cache_type", "cache_regions", "asynchronous", "loop", "max_concurrency",
             "fixed_upload_size"}


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
    """How one bucket's first-block GETs go through libcurl: where they go (botocore's resolution,
    fastload.source.s3_resolve) and how they are signed; other buckets' GETs take their own
    (:class:`Buckets`), so buckets in several regions each keep theirs."""

    page_types: ClassVar[tuple[str, ...]] = ("application/xml",)  # its listing pages
    # As botocore: a redirect's Location is not followed (libcurl would send it on without the Authorization,
    # an AccessDenied); its answer names the bucket's region, or a HeadBucket asks it (learn).
    follow: ClassVar[bool] = False

    bucket: str = ""
    prefix: str = ""  # the URL up to the key: "https://bucket.s3.<region>.amazonaws.com/" or "<endpoint>/bucket/"
    region: str = "us-east-1"  # the signing region
    signing_name: str = "s3"
    credentials: Any = None  # has get_frozen_credentials() (botocore's, refreshed by it); None: unsigned
    buckets: Any = None  # the Source's Buckets: every bucket's route

    def of(self, bucket: str) -> S3Route | None:
        """``bucket``'s route now (its learned region's), or None: its GETs take s3fs."""
        if self.buckets is None or (bucket == self.bucket and not self.buckets.learned(bucket)):
            return self
        return cast("S3Route | None", self.buckets.route(bucket))

    def takes(self, url: str) -> bool:
        """Whether ``url``'s GETs go on this road (not an S3 Express bucket's, say: decided once per bucket)."""
        return self.of(_bucket(url)) is not None

    def start(self, urls: Sequence[str], nbytes: int, timeout_s: float, limit: HostLimit,
              stop: threading.Event) -> list[curl.Pending]:
        """:meth:`CurlRoute.start`, each bucket's GETs on its own route (its endpoint, its region)."""
        groups: dict[str, list[int]] = {}
        for k, url in enumerate(urls):
            groups.setdefault(_bucket(url), []).append(k)
        out: list[Any] = [None] * len(urls)
        for bucket, ks in groups.items():
            route = self.of(bucket)
            if route is None:  # Source._curl_first asks takes() first
                raise ConfigError(f"s3://{bucket}: its GETs take s3fs, not libcurl")
            for k, pending in zip(ks, CurlRoute.start(route, [urls[k] for k in ks], nbytes, timeout_s, limit, stop)):
                out[k] = pending
        return out

    def start_pages(self, urls: Sequence[str], timeout_s: float, limit: HostLimit,
                    stop: threading.Event) -> list[curl.Pending]:
        """:meth:`CurlRoute.start_pages` of this bucket's listing, signed for its region now."""
        return CurlRoute.start_pages(self.of(self.bucket) or self, urls, timeout_s, limit, stop)

    def wire(self, url: str) -> str:
        """The URL of ``s3://bucket/key`` botocore would send, the key encoded as SigV4 signs it
        (as botocore does: every byte but unreserved ones and "/"; a listing page's URL,
        :meth:`list_url`, is one already)."""
        if not url.startswith(("s3://", "s3a://")):
            return url
        bucket, _, key = url.split("://", 1)[1].partition("/")
        route = self.of(bucket)
        if route is None:
            raise ConfigError(f"s3://{bucket}: its GETs take s3fs, not libcurl")
        return route.prefix + quote(key, safe="/-_.~")

    def list_url(self, bucket: str, prefix: str, token: str | None) -> str:
        """One ListObjectsV2 page of ``prefix`` (``delimiter=/``), after ``token`` if given.

        The query is sent sorted and encoded as SigV4 signs it: libcurl 7.88 signs the
        query as it is given (an unsorted one was refused, tests/integration/test_s3_signed.py).
        """
        params = {"delimiter": "/", "list-type": "2", "prefix": prefix}
        if token:
            params["continuation-token"] = token
        query = "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))
        base = (self.of(bucket) or self).prefix
        if base.endswith(f"/{bucket}/"):  # path style: botocore asks /bucket?list-type=2...
            base = base[:-1]
        return f"{base}?{query}"

    def sign(self, wire: list[str], headers: list[str], amz_date: str | None = None) -> tuple[list[str], list[str] | None]:
        """The batch's x-amz headers and each GET's Authorization (fastload.source.sigv4); none when unsigned.

        ``amz_date`` (YYYYMMDDTHHMMSSZ) is now unless given (tests/unit/test_s3_conformance.py signs at
        botocore's own time, to compare the two).
        """
        if self.credentials is None:
            return [], None
        frozen = self.credentials.get_frozen_credentials()  # botocore refreshes expiring ones here
        amz_date = amz_date or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        batch = [f"x-amz-content-sha256: {sigv4.EMPTY_SHA256}", f"x-amz-date: {amz_date}"]
        if frozen.token:
            batch.append(f"x-amz-security-token: {frozen.token}")
        lines = sigv4.authorizations(wire, [*headers, *batch], frozen.access_key, frozen.secret_key, self.region, amz_date,
                                     self.signing_name)
        return batch, lines

    def parse_page(self, text: str) -> ListPage:
        return parse_list(text)

    def item_url(self, bucket: str, key: str) -> str:
        return f"s3://{bucket}/{key}"

    def learn(self, url: str, err: curl.HttpStatusError) -> bool:
        """Whether ``err`` says the bucket's requests belong in another region than this one was signed
        for; if so its GETs and listing pages go there from now on, in this process and its forked workers
        (fastload.source.s3_resolve), and the caller redoes this one there, once.

        The region comes from the answer's ``<Region>`` (an ``AuthorizationHeaderMalformed``) or else one
        HeadBucket per bucket, as botocore's S3RegionRedirectorv2 asks it: for a 301 (libcurl's engine
        keeps no ``x-amz-bucket-region`` header), a 302 or 307, and a signed request's ``AccessDenied``.
        S3's global endpoint answers a 307 for a bucket made recently in another region; as botocore, the
        route follows no ``Location`` (:attr:`follow`): it re-resolves the endpoint for the region and signs
        for it (:class:`Buckets`). An ``AccessDenied`` is what a 307 followed elsewhere would look like.
        """
        if self.buckets is None:
            return False
        body = err.body or b""
        match = _CODE.search(body)
        code = match.group(1).decode() if match else ""
        followed = err.status == 403 and code == "AccessDenied" and self.credentials is not None
        if not (err.status in _REDIRECTS or (err.status == 400 and code in _WRONG_REGION) or followed):
            return False
        bucket = _bucket(url)
        found = _REGION.search(body)
        with self.buckets.learning:  # a batch's GETs answer together: one HeadBucket, not one per GET
            now = self.of(bucket)
            if now is None:
                return False
            # Moved by an answer to another of its requests while this one was out: redone on its route now.
            moved = self.buckets.learned(bucket) is not None
            region = found.group(1).decode() if found else ""
            if not region and moved:
                return True
            if not region and bucket not in self.buckets.asked:  # a genuine AccessDenied costs one, not one per GET
                self.buckets.asked.add(bucket)
                region = self.buckets.resolver.head_region(bucket) or ""
            if not region or region == now.region:
                return bool(region) and moved
            return bool(self.buckets.resolver.learn(bucket, region))

    def refused(self, url: str, err: curl.HttpStatusError) -> CredentialsError | None:
        """An answer whose S3 error code refuses the credentials, as a CredentialsError (s3fs would see
        no code in a HEAD's answer, which has no body, only "400 Bad Request"); not one that names the
        bucket's region (:meth:`learn`): that one is redone, on s3fs (which follows the region) if it was
        redone on the learned route already."""
        code = refusal(err)
        if not code or (code in _WRONG_REGION and self.learn(url, err)):
            return None
        return errors.refused(url, code, err.status)


class Buckets:
    """Each bucket's :class:`S3Route` for one Source, from botocore's resolution (s3_resolve.Resolver):
    made on a bucket's first GET, again once its region is learned; a bucket whose GETs the fast
    road cannot send (its :attr:`Target.why`) is named once in the log and takes s3fs."""

    def __init__(self, resolver: Resolver, base: S3Route) -> None:
        self.resolver = resolver
        self._base = replace(base, buckets=self)  # what every bucket's route shares: credentials, TLS, headers
        self._lock = threading.Lock()
        self.learning = threading.Lock()  # held while a bucket's region is asked (S3Route.learn)
        self.asked: set[str] = set()  # buckets whose region a HeadBucket was asked for: once each
        self._routes: dict[tuple[str, str | None], S3Route | None] = {}

    def learned(self, bucket: str) -> str | None:
        return self.resolver.learned(bucket)

    def route(self, bucket: str) -> S3Route | None:
        key = (bucket, self.resolver.learned(bucket))
        found = self._routes.get(key, False)
        if found is not False:
            return cast("S3Route | None", found)
        target = self.resolver.target(bucket)
        made = None if target.why else replace(
            self._base, bucket=bucket, prefix=target.prefix, region=target.region, signing_name=target.signing_name,
            headers=(*self._base.headers, *target.headers),
            credentials=None if target.signature_version is None else self._base.credentials)
        if target.why:
            fallback.note_fallback(f"s3://{bucket}", target.why)
        with self._lock:
            self._routes[key] = made
        return made


PROTOCOLS = ("s3", "s3a")  # s3fs's


def strip(url: str) -> str:
    """``url``'s path as s3fs names it ("bucket/key"): fsspec's ``_strip_protocol`` for s3fs's protocols,
    without importing s3fs (Source opens it on first use)."""
    for protocol in PROTOCOLS:
        if url.startswith(protocol + "://"):
            url = url[len(protocol) + 3:]
        elif url.startswith(protocol + "::"):
            url = url[len(protocol) + 2:]
    return url.rstrip("/")


def unstrip(path: str) -> str:
    """``path`` as s3fs's ``unstrip_protocol`` gives it: "s3://bucket/key"."""
    return path if path.startswith(tuple(f"{p}://" for p in PROTOCOLS)) else f"s3://{path}"


def _bucket(url: str) -> str:
    return url.split("://", 1)[1].partition("/")[0]


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
    return configured(url, options)


def configured(url: str, options: dict[str, Any]) -> tuple[S3Route | None, str]:
    """:func:`route_for` less the engine's check: the route botocore's resolution of ``options``, the
    environment and the profile gives ``url``'s bucket, or (None, the setting that keeps it on s3fs).

    Decided once per Source (its ``route``), never per object; a bucket of the same Source
    that cannot take it (an S3 Express bucket among others) is decided once too (:class:`Buckets`).
    """
    client = dict(options.get("client_kwargs") or {})
    config = dict(options.get("config_kwargs") or {})
    odd = sorted(set(options) - HONOURED - S3FS_ONLY) + [f"client_kwargs.{k}" for k in sorted(set(client) - _CLIENT_KEYS)] \
        + [f"config_kwargs.{k}" for k in sorted(set(config) - _CONFIG_KEYS)] \
        + [f"config_kwargs.s3.{k}" for k in sorted(set(config.get("s3") or {}) - _CONFIG_S3_KEYS)]
    if odd:
        return None, f"storage option {odd[0]!r} is honoured by s3fs only"
    resolver = Resolver(options)
    bucket = _bucket(url)
    target = resolver.target(bucket)
    if target.why:
        return None, target.why
    if not resolver.configured_region() and urlsplit(target.prefix).netloc.endswith(_AWS_DOMAINS):
        return None, "no region is set (client_kwargs={'region_name': ...}, AWS_REGION or a profile's region)"
    verify = resolver.verify()  # True, False, or a CA bundle file's or folder's path
    folder = isinstance(verify, str) and os.path.isdir(verify)
    credentials: Any = None  # anon: unsigned (a Target without a signature version)
    if target.signature_version is not None:
        if options.get("key") and options.get("secret"):
            credentials = _Static(str(options["key"]), str(options["secret"]), options.get("token"))
        else:
            credentials = resolver.credentials()
            if credentials is None:
                return None, "botocore found no credentials"  # s3fs then raises the named CredentialsError
    if verify is False:
        _warn_unverified(url)
    headers = ("x-amz-request-payer: requester",) if options.get("requester_pays") else ()
    shared = S3Route(headers=headers, userpwd=None, trust_env=True, encode=None,
                     cainfo=verify if isinstance(verify, str) and not folder else None,
                     capath=verify if isinstance(verify, str) and folder else None, verify=verify is not False,
                     credentials=credentials)
    return Buckets(resolver, shared).route(bucket), ""


_AWS_DOMAINS = (".amazonaws.com", ".amazonaws.com.cn")


_unverified_warned: set[str] = set()


def _warn_unverified(url: str) -> None:
    """One warning per process for GETs whose server certificates are not checked."""
    if not _unverified_warned:
        _unverified_warned.add(url)
        log.warning("fastload: %s: TLS certificates are not checked (verify=False, as botocore was told); "
                    "name a CA bundle instead (client_kwargs={'verify': '/path/ca.pem'} or AWS_CA_BUNDLE)", url)


_CODE = re.compile(rb"<Code>([A-Za-z]+)</Code>")
_REGION = re.compile(rb"<Region>([a-z0-9-]+)</Region>")
# Error codes of a GET signed for another region than the bucket's (botocore's S3RegionRedirectorv2 reads them).
_WRONG_REGION = {"AuthorizationHeaderMalformed", "IllegalLocationConstraintException", "PermanentRedirect"}
_REDIRECTS = (301, 302, 307)  # the statuses botocore's S3RegionRedirectorv2 follows to the bucket's region


def refusal(err: BaseException) -> str:
    """The S3 error code of an answer that refuses the credentials ("" for any other failure)."""
    match = _CODE.search(getattr(err, "body", b"") or b"")
    code = match.group(1).decode() if match else ""
    return code if code in REFUSALS else ""
