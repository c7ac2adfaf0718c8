"""GCS first-block GETs on libcurl's engine: one request per object, off the GIL, with gcsfs's credentials.

Why: through gcsfs each cold object of a key list cost a metadata request and then a
GET, both made in Python on fsspec's event loop, as S3's did through s3fs
(fastload.source.s3). Here the first-block GET of each gs:// object goes through
the C engine that carries HTTP's and S3's (:mod:`fastload.transport.curl`): a JSON API media
download (``/download/storage/v1/b/<bucket>/o/<object>?alt=media``) with a Range.
Its Content-Range sizes the object and its ``x-goog-generation`` versions it, the
same generation a listing gives (fastload.source.items.version_of), so a key list
needs no metadata request and an object has one identity whichever road fetched it.

Credentials are gcsfs's own (``GCSFileSystem.credentials``): whatever ``token`` the
user gave gcsfs (a service-account file, "google_default", "cloud", "anon", a
google-auth Credentials object...) authorises these GETs as it does gcsfs's, and
gcsfs refreshes an expiring token before each batch. The endpoint is gcsfs's too
(``endpoint_url``, else ``STORAGE_EMULATOR_HOST``, else Google's).

Scope: the first block of each object, listed (sized) or from a key list
(sizeless), and the objects.list pages of a listing (JSON), one per common prefix, a
whole level in flight (fastload.source.listing.store_find); the later blocks of a
listed one go through the engine too (fastload.source.ranged). Streamed objects stay on gcsfs. So do errors, but for a refusal
(401, 403: a CredentialsError at once, as gcsfs's retries cannot help) and a 404.

TLS: these GETs trust the CAs gcsfs's requests trust. gcsfs's aiohttp session trusts what
Python's ``ssl`` does (``SSL_CERT_FILE``, ``SSL_CERT_DIR``, the system's store), and that is
libcurl's engine's own CA (:func:`fastload.transport.curl.engine`), so a GCS route names none
(its ``cainfo`` stays None; tests/integration/test_tls_ca.py reads through a private CA given
by ``SSL_CERT_FILE``). gcsfs takes no other CA setting: a CA or ``ssl=False`` reaches it only in
an aiohttp connector in ``session_kwargs``, whose SSL context libcurl cannot read, so that option
keeps the source on gcsfs, by name. The GETs ask for HTTP/1.1 (``CurlRoute.http2``) until
HTTP/2 against real GCS is measured (issue 34, item 7).

Options: ``storage_options`` as gcsfs takes them; this path honours those in
:data:`HONOURED` and ignores those in :data:`GCSFS_ONLY`. Any other one keeps the
source's GETs on gcsfs, and one log line names it (fastload.source.fallback.note_fallback).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote

from fastload.errors import CredentialsError
from fastload.source.items import ListPage
from fastload.transport import curl
from fastload.transport.curl import CurlRoute

# storage_options this path honours; gcsfs's own caches, buffers and write settings are nothing of a GET.
HONOURED = {"project", "access", "token", "endpoint_url", "requester_pays", "timeout", "requests_timeout"}
GCSFS_ONLY = {"block_size", "consistency", "cache_timeout", "secure_serialize", "check_connection", "asynchronous",
              "loop", "default_location", "listings_expiry_time", "use_listings_cache", "max_paths",
              "skip_instance_cache"}
GOOGLE = "https://storage.googleapis.com"
_FIELDS = "items(name,size,generation),prefixes,nextPageToken"  # what a listing page needs, no more


@dataclass(frozen=True)
class GcsRoute(CurlRoute):
    """How a GCS source's first-block GETs go through libcurl: where they go and how they are authorised."""

    page_types: ClassVar[tuple[str, ...]] = ("application/json",)  # its listing pages

    base: str = GOOGLE  # the endpoint, as gcsfs's _location gives it
    user_project: str = ""  # requester pays: the project billed (gcsfs's userProject)
    credentials: Any = None  # gcsfs's GoogleCredentials (refreshes google-auth's token); None: anonymous

    def wire(self, url: str) -> str:
        """The media download URL of ``gs://bucket/object`` at this endpoint (the object name encoded whole)."""
        if not url.startswith(("gs://", "gcs://")):
            return url
        bucket, _, name = url.split("://", 1)[1].partition("/")
        wire = f"{self.base}/download/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}?alt=media"
        return wire + (f"&userProject={quote(self.user_project, safe='')}" if self.user_project else "")

    def sign(self, wire: list[str], headers: list[str]) -> tuple[list[str], list[str] | None]:
        """The batch's Authorization line (one bearer token for all its GETs); none when anonymous."""
        if self.credentials is None:
            return [], None
        out: dict[str, str] = {}
        self.credentials.apply(out)  # refreshes an expiring token first (gcsfs's maybe_refresh)
        return [f"{name}: {value}" for name, value in out.items()], None

    def list_url(self, bucket: str, prefix: str, token: str | None) -> str:
        """One objects.list page of ``prefix`` (``delimiter=/``, only the fields a RemoteItem needs), after
        ``token`` if given."""
        url = (f"{self.base}/storage/v1/b/{quote(bucket, safe='')}/o?delimiter=%2F&prefix={quote(prefix, safe='')}"
               f"&fields={quote(_FIELDS, safe='')}")
        if token:
            url += f"&pageToken={quote(token, safe='')}"
        return url + (f"&userProject={quote(self.user_project, safe='')}" if self.user_project else "")

    def parse_page(self, text: str) -> ListPage:
        """Read one objects.list answer (JSON): names, sizes and generations, prefixes, the next page's token."""
        page = json.loads(text)
        objects = [(str(o["name"]), int(o["size"]), str(o.get("generation", ""))) for o in page.get("items", ())]
        return ListPage(objects, [str(p) for p in page.get("prefixes", ())], page.get("nextPageToken") or None)

    def item_url(self, bucket: str, key: str) -> str:
        return f"gs://{bucket}/{key}"

    def refused(self, url: str, err: curl.HttpStatusError) -> CredentialsError | None:
        """A 401 or 403 answer as the CredentialsError it stands for: the message GCS gave, and where
        credentials go (retrying cannot help)."""
        if err.status not in (401, 403):
            return None
        try:
            said = str(json.loads(err.body or b"{}").get("error", {}).get("message", ""))[:200]
        except (ValueError, AttributeError):
            said = ""
        return CredentialsError(
            f"{url}: GCS refused the request (HTTP {err.status}{': ' + said if said else ''}); fix: pass credentials "
            "in storage_options as gcsfs takes them ({'token': '/path/to/service-account.json'}, 'google_default', "
            "or 'anon' for a public bucket), or set GOOGLE_APPLICATION_CREDENTIALS, or run "
            "`gcloud auth application-default login`; the account needs storage.objects.get on the bucket"
        )


def route_for(fs: Any, options: dict[str, Any], choice: str) -> tuple[GcsRoute | None, str]:
    """A GCS source's route through libcurl, made from its gcsfs filesystem ``fs``, or (None, why its
    GETs stay on gcsfs). ``choice`` is ``Settings.http_client``: "aiohttp" keeps every GET off libcurl."""
    if why := curl.closed_by(choice):
        return None, why
    odd = sorted(set(options) - HONOURED - GCSFS_ONLY)
    if odd:
        return None, f"storage option {odd[0]!r} is honoured by gcsfs only"
    credentials = getattr(fs, "credentials", None)
    if credentials is None or not hasattr(credentials, "apply"):
        return None, "its filesystem has no gcsfs credentials"
    if getattr(credentials, "credentials", None) is None:  # token="anon": gcsfs sends no Authorization either
        credentials = None
    base = str(getattr(fs, "_location", "") or options.get("endpoint_url") or GOOGLE).rstrip("/")
    pays = getattr(fs, "requester_pays", False)
    user_project = pays if isinstance(pays, str) else (str(getattr(fs, "project", "") or "") if pays else "")
    if pays and not user_project:
        return None, "requester_pays without a project to bill"
    return GcsRoute(headers=(), userpwd=None, trust_env=True, encode=None, base=base, user_project=user_project,
                    credentials=credentials), ""
