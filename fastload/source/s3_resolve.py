"""What botocore resolves for an S3 configuration: where a bucket's GetObject goes, how it is signed, which CAs it trusts.

Why: the fast road (fastload.source.s3) used to re-derive endpoint, region and addressing from
``storage_options`` alone, so an endpoint named by ``AWS_ENDPOINT_URL`` or a profile, a China or
GovCloud region, FIPS, dual-stack or a CA bundle in ``AWS_CA_BUNDLE`` sent its GETs to the wrong
host, or to s3fs once per object (issue 34). Here botocore itself, given what s3fs would give it
(:func:`client_args`, as ``S3FileSystem.set_session`` maps the options), builds a GetObject for the
bucket and stops it before it is signed (a ``before-sign`` handler, run after botocore's own); its
URL, signing region and name, and its client's ``verify`` are what the fast road uses. Nothing is
sent to build it.

Words: a bucket's **target** is where and how its GETs go (:class:`Target`); the **resolver** makes
targets for one set of ``storage_options`` (:class:`Resolver`); a bucket's region is **learned** when
an answer names it (:meth:`Resolver.learn`), for the rest of the process and its forked workers.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("fastload")

PROBE_KEY = "fastload-probe"  # the key of the GetObject botocore builds: its URL less this is the bucket's prefix
# Signature versions whose requests the fast road signs itself (fastload.source.sigv4); None: anonymous.
SIGNED_HERE = {"s3v4", "v4"}
_EXPRESS = "--x-s3"  # an S3 Express One Zone (directory) bucket's name ends so

# A bucket's learned region, by (the resolver's key, bucket), kept for the life of the process: a
# forked DataLoader worker inherits it (tests/integration/test_s3_regions.py).
_LEARNED: dict[tuple[str, str], str] = {}
_LEARNED_LOCK = threading.Lock()


class Stopped(Exception):
    """Raised by the ``before-sign`` handler: the request is built, and goes no further."""

    def __init__(self, request: Any, signing: dict[str, Any]) -> None:
        super().__init__("built, not sent")
        self.request, self.signing = request, signing


@dataclass(frozen=True)
class Target:
    """Where and how one bucket's GETs go, as botocore would send them.

    ``prefix`` is the URL up to the key ("https://b.s3.eu-west-1.amazonaws.com/" or
    "http://host:9000/b/"); ``headers`` the header lines botocore adds for every GetObject
    of this configuration (``x-amz-request-payer``); ``why`` says why these GETs take s3fs ("" when
    they need not).
    """

    prefix: str = ""
    region: str = ""
    signing_name: str = "s3"
    signature_version: str | None = "s3v4"  # None: unsigned (anon)
    headers: tuple[str, ...] = ()
    why: str = ""


def client_args(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(session kwargs, create_client kwargs, Config kwargs)`` for ``storage_options``, as s3fs
    (``S3FileSystem.__init__`` and ``set_session``) passes them to botocore; fsspec's
    ``FSSPEC_S3_*`` defaults (fsspec.config) first, the options over them."""
    import fsspec.config

    opts = {**(fsspec.config.conf.get("s3") or {}), **options}
    client = dict(opts.get("client_kwargs") or {})
    init = {"aws_access_key_id": opts.get("key"), "aws_secret_access_key": opts.get("secret"),
            "aws_session_token": opts.get("token"), "endpoint_url": opts.get("endpoint_url")}
    init = {k: v for k, v in init.items() if v is not None and v != client.get(k)}
    if "use_ssl" not in client:
        init["use_ssl"] = opts.get("use_ssl", True)
    config = dict(opts.get("config_kwargs") or {})
    if opts.get("anon"):
        from botocore import UNSIGNED

        creds = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
        init = {k: v for k, v in init.items() if k not in creds}
        client = {k: v for k, v in client.items() if k not in creds}
        config["signature_version"] = UNSIGNED
    session = {"profile": opts["profile"]} if opts.get("profile") else {}
    return session, {**init, **client}, config


class Resolver:
    """botocore's resolution for one set of ``storage_options``: each bucket's :class:`Target`.

    The botocore session and a client per region are made on first use and kept: a client
    costs about 0.1 s of CPU the first time (botocore loads S3's model), 0.01 s after.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.key = repr(sorted((k, repr(v)) for k, v in options.items()))  # learned regions are kept under it
        self._lock = threading.RLock()
        self._session: Any = None
        self._clients: dict[str | None, Any] = {}
        self._targets: dict[tuple[str, str | None], Target] = {}

    # -- botocore ------------------------------------------------------------

    def session(self) -> Any:
        """The botocore session of these options (its profile), made once."""
        with self._lock:
            if self._session is None:
                import botocore.session

                kwargs, _, _ = client_args(self.options)
                self._session = botocore.session.Session(**kwargs)
                loader = self._session.get_component("data_loader")
                _known_services(loader)
                if isinstance(getattr(loader, "BUILTIN_DATA_PATH", None), str):
                    loader.file_loader = _Plain(loader.file_loader, loader.BUILTIN_DATA_PATH)
            return self._session

    def configured_region(self) -> str | None:
        """The region these options, the environment or the profile name (None: none does).

        ``AWS_REGION`` counts too, as the AWS CLI v2 and the other SDKs read it; botocore reads
        only ``AWS_DEFAULT_REGION`` and the profile, and is then given it as ``region_name``.
        """
        _, args, config = client_args(self.options)
        return (args.get("region_name") or config.get("region_name") or self.session().get_config_variable("region")
                or os.environ.get("AWS_REGION") or None)

    def client(self, region: str | None = None) -> Any:
        """botocore's S3 client for these options (in ``region`` where one was learned)."""
        with self._lock:
            found = self._clients.get(region)
            if found is not None:
                return found
            from botocore.config import Config

            _, args, config = client_args(self.options)
            args = dict(args)
            if region is not None:
                args["region_name"] = region
            elif not (args.get("region_name") or config.get("region_name")) and os.environ.get("AWS_REGION") \
                    and not self.session().get_config_variable("region"):
                args["region_name"] = os.environ["AWS_REGION"]
            client = self.session().create_client("s3", config=Config(**config), **args)
            # Last of all before-sign handlers (botocore's own, such as the accelerate host, run first).
            client.meta.events.register_last("before-sign", _stop_before_signing)
            self._clients[region] = client
            return client

    def verify(self) -> bool | str:
        """What botocore's client checks TLS with: True (its default CAs), False, or a CA bundle's
        path (``client_kwargs`` ``verify``, ``AWS_CA_BUNDLE``, a profile's ``ca_bundle``, then
        ``REQUESTS_CA_BUNDLE``), read from the client botocore built."""
        verify = getattr(getattr(getattr(self.client(), "_endpoint", None), "http_session", None), "_verify", None)
        if verify is None:  # another botocore's shape: its own order (botocore.endpoint._get_verify_value)
            verify = client_args(self.options)[1].get("verify")
            if verify is None:
                verify = self.session().get_config_variable("ca_bundle") or os.environ.get("REQUESTS_CA_BUNDLE")
        return True if verify is None else verify

    def credentials(self) -> Any:
        """The credentials botocore's client signs with (keys in ``client_kwargs`` too; its chain's
        refreshed by botocore), or None (none found)."""
        found = getattr(getattr(self.client(), "_request_signer", None), "_credentials", None)
        return found if found is not None else self.session().get_credentials()

    # -- targets -------------------------------------------------------------

    def learned(self, bucket: str) -> str | None:
        """The region an answer named for ``bucket`` in this process (None: none yet)."""
        return _LEARNED.get((self.key, bucket))

    def learn(self, bucket: str, region: str) -> bool:
        """Send ``bucket``'s GETs to ``region`` from now on; False if that was known already."""
        with _LEARNED_LOCK:
            if _LEARNED.get((self.key, bucket)) == region:
                return False
            _LEARNED[(self.key, bucket)] = region
        log.info("fastload: s3://%s is in %s: its GETs go there now, signed for it", bucket, region)
        return True

    def target(self, bucket: str) -> Target:
        """Where and how ``bucket``'s GETs go now (its learned region, else the configured one)."""
        region = self.learned(bucket)
        with self._lock:
            found = self._targets.get((bucket, region))
            if found is None:
                found = self._targets[(bucket, region)] = self._build(bucket, region)
            return found

    def _build(self, bucket: str, region: str | None) -> Target:
        if bucket.endswith(_EXPRESS):  # botocore would first send a CreateSession: not here
            return Target(why=f"bucket {bucket!r} is an S3 Express One Zone bucket (its GETs need CreateSession "
                              "credentials, which only botocore fetches)")
        try:
            self.client(region).get_object(Bucket=bucket, Key=PROBE_KEY, Range="bytes=0-0")
        except Stopped as built:
            return _target(built, bucket)
        except Exception as err:  # botocore refuses the configuration: s3fs will say how
            return Target(why=f"botocore cannot build a GetObject for bucket {bucket!r} ({type(err).__name__}: {err})")
        return Target(why="botocore sent a GetObject it was asked only to build")  # never: the handler stops it

    def head_region(self, bucket: str) -> str | None:
        """The bucket's region as a HeadBucket answers it (``x-amz-bucket-region``), or None."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self.client(self.learned(bucket)).head_bucket(Bucket=bucket)
        except ClientError as err:
            answer = err.response
        except BotoCoreError as err:
            log.debug("fastload: HeadBucket of %r failed: %s", bucket, err)
            return None
        headers = (answer.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
        return headers.get("x-amz-bucket-region") or None


def _known_services(loader: Any) -> None:
    """Tell botocore's loader its services' names from one listing of each data folder.

    Why: botocore checks a service's name against every service it knows before loading its model,
    and learns them with a listing of each of ~870 folders: 0.04-0.08 s of CPU, most of a
    client's first cost here (the start-up figure in docs/storage.md). A folder's name is its
    service's name; botocore still lists the versions of the one it loads. Where the loader keeps no
    such cache (another botocore), nothing changes.
    """
    cache = getattr(loader, "_cache", None)
    if not isinstance(cache, dict):
        return
    names: set[str] = set()
    for path in getattr(loader, "search_paths", ()):
        try:
            names.update(n for n in os.listdir(path) if not n.startswith(("_", ".")))
        except OSError:
            continue
    for type_name in ("service-2", "endpoint-rule-set-1"):
        cache.setdefault(("list_available_services", type_name), sorted(names))


class _Plain:
    """botocore's file loader, parsing its own data files (its S3 model, endpoint rules, endpoints)
    into plain dicts rather than OrderedDicts (dicts keep their order).

    Why: parsing them was most of what a botocore client costs; an OrderedDict per JSON object
    doubles json's time (0.058 s against 0.030 s of CPU for the three files, one run), and a
    client's set-up is most of an s3:// dataset's before its first GET (issue 34, item 6: the figure
    is in docs/storage.md). Files from elsewhere (``~/.aws/models``) are read as botocore reads them.
    """

    def __init__(self, inner: Any, builtin: str) -> None:
        self.inner, self.builtin = inner, builtin

    def exists(self, file_path: str) -> bool:
        return bool(self.inner.exists(file_path))

    def load_file(self, file_path: str) -> Any:
        if not file_path.startswith(self.builtin):
            return self.inner.load_file(file_path)
        for ext, opener in ((".json", open), (".json.gz", gzip.open)):  # botocore's order (_JSON_OPEN_METHODS)
            if os.path.isfile(file_path + ext):
                with opener(file_path + ext, "rb") as f:
                    return json.loads(f.read())
        return None


def _stop_before_signing(request: Any, signing_name: str = "s3", region_name: str = "", signature_version: Any = None,
                         operation_name: str = "", **kwargs: Any) -> None:
    # Only the GetObject of PROBE_KEY that Resolver.target asks for: a HeadBucket (head_region) is sent.
    if operation_name == "GetObject" and request.url.split("?", 1)[0].endswith("/" + PROBE_KEY):
        raise Stopped(request, {"signing_name": signing_name, "region": region_name, "version": signature_version})


def _target(built: Stopped, bucket: str) -> Target:
    """The :class:`Target` a built GetObject shows, or one that says why the fast road cannot send it."""
    from botocore import UNSIGNED

    url = built.request.url.split("?", 1)
    version = built.signing["version"]
    if len(url) > 1:
        return Target(why=f"botocore's GetObject for bucket {bucket!r} carries a query ({url[1]!r})")
    if version is not UNSIGNED and version not in SIGNED_HERE:
        return Target(why=f"signature version {version!r} (config_kwargs 'signature_version', or the endpoint's "
                          "rules for this bucket) is signed by botocore only")
    headers = tuple(f"{k.lower()}: {v.decode() if isinstance(v, bytes) else v}" for k, v in built.request.headers.items()
                    if k.lower().startswith("x-amz-") and k.lower() not in _OURS)
    return Target(prefix=url[0][: -len(PROBE_KEY)], region=str(built.signing["region"]),
                  signing_name=str(built.signing["signing_name"]), signature_version=None if version is UNSIGNED else "s3v4",
                  headers=headers)


# Headers the fast road sets itself, per batch (S3Route.sign), or does without: botocore's response
# checksum check (x-amz-checksum-mode) reads its answer; the cache checks its own xxh3.
_OURS = {"x-amz-date", "x-amz-content-sha256", "x-amz-security-token", "x-amz-checksum-mode"}
