"""Ranged GETs through s3fs and gcsfs that name the version of the object they expect, and report the
version that answered.

Why: a block of an object must come from the version the object was listed (or first read) with.
s3fs's and gcsfs's ``_cat_file`` send no condition and drop the answer's headers, so an object
rewritten at the same size while it was read came back torn (its first MiB of the old version, the
rest of the new) and was cached so (issue 32). Here each GET names the expected version where the
store can check it (S3: ``If-Match: "<ETag>"``; GCS: ``ifGenerationMatch=<generation>``; a
mismatch is a 412), and each answer's own version (S3's ETag, GCS's ``x-goog-generation``) comes
back with its size, for the caller to compare with the listed ones
(:func:`fastload.source.fallback.checked`): a store that ignores the condition (an emulator, a
proxy) is still caught. HTTP's GET is :func:`fastload.source.aio.http_get_range`.

Words: the **expected** version is the listed one (``RemoteItem.version``), "" when unknown (then
the GET names none, and only the size is compared). An answer refused by its condition is an info
dict with :data:`CHANGED` set (the reason) and no size.
"""

from __future__ import annotations

import re
from typing import Any

CHANGED = "changed"  # an answer's info key: the store refused the GET's condition (why)
_TOTAL = re.compile(r"/(\d+)\s*\Z")  # the object's size at the end of a Content-Range


def road_of(fs: Any) -> str:
    """``"s3"`` or ``"gcs"`` for s3fs's and gcsfs's filesystems, else "" (their GETs cannot be checked here)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if {"s3", "s3a"} & set(protocols):
        return "s3"
    if {"gs", "gcs"} & set(protocols):
        return "gcs"
    return ""


def size_of(content_range: str | None, content_length: Any) -> int | None:
    """The object's size from an answer's Content-Range (a 206), else its Content-Length (the whole object).

    >>> size_of("bytes 0-99/3000", "100"), size_of(None, "3000"), size_of(None, None)
    (3000, 3000, None)
    """
    match = _TOTAL.search(content_range or "")
    if match:
        return int(match.group(1))
    return int(content_length) if content_length is not None and str(content_length).isdigit() else None


def refused(path: str, why: str) -> tuple[dict[str, Any], bytes]:
    """The (info, body) of an answer whose store refused the GET's condition: the object changed."""
    return {"name": path, "size": None, CHANGED: why}, b""


async def s3_get_range(fs: Any, path: str, start: int, end: int | None, etag: str) -> tuple[dict[str, Any], bytes]:
    """A GetObject of ``path[start:end]`` (``end`` None: to the end) through s3fs, with ``If-Match`` when
    ``etag`` is known: (info with the answer's size and ETag, body)."""
    bucket, key, version_id = fs.split_path(path)
    kwargs: dict[str, Any] = {}
    if not (start == 0 and end is None):
        kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    if etag:
        kwargs["IfMatch"] = f'"{etag}"'
    if version_id:
        kwargs["VersionId"] = version_id
    try:
        # s3fs's own call: its session, its region and credentials, its error translation.
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kwargs)
    except OSError as err:
        if _s3_code(err) == "PreconditionFailed":
            return refused(path, "HTTP 412 to If-Match")
        raise
    try:
        body = await answer["Body"].read()
    finally:
        answer["Body"].close()
    info = {"name": path, "size": size_of(answer.get("ContentRange"), answer.get("ContentLength"))}
    if answer.get("ETag"):
        info["ETag"] = answer["ETag"]
    return info, body


def _s3_code(err: BaseException) -> str:
    """The S3 error code beneath s3fs's translated error (its ``__cause__`` is botocore's ClientError)."""
    for cause in (err, err.__cause__, err.__context__):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


async def gcs_get_range(fs: Any, path: str, start: int, end: int | None, generation: str) -> tuple[dict[str, Any], bytes]:
    """A media download of ``path[start:end]`` (``end`` None: to the end) through gcsfs, with
    ``ifGenerationMatch`` when ``generation`` is known: (info with the answer's size and generation, body)."""
    headers = {} if start == 0 and end is None else {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
    condition = {"ifGenerationMatch": generation} if generation.isdigit() else {}
    try:
        answer, body = await fs._call("GET", fs.url(path), headers=headers, **condition)
    except FileExistsError:  # gcsfs's word for a 412
        if condition:
            return refused(path, "HTTP 412 to ifGenerationMatch")
        raise
    info = {"name": path, "size": size_of(answer.get("Content-Range"), answer.get("Content-Length"))}
    if answer.get("x-goog-generation"):
        info["generation"] = answer["x-goog-generation"]
    return info, body
