"""What a listing yields: :class:`RemoteItem`, and the glob that filters it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastload.errors import EmptyDatasetError


@dataclass(frozen=True)
class RemoteItem:
    """One remote object as listed.

    Attributes:
        url: Canonical URL with its protocol (``s3://b/k``, ``file:///p``, ``http://h/p``).
        size: Size in bytes.
        version: ETag, generation or mtime as a string; "" when the store has none.
    """

    url: str
    size: int
    version: str

    def to_json(self) -> list[Any]:
        return [self.url, self.size, self.version]

    @classmethod
    def from_json(cls, row: list[Any]) -> RemoteItem:
        return cls(str(row[0]), int(row[1]), str(row[2]))


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob where ``**`` spans folders and ``*`` stays within one.

    >>> bool(glob_to_regex("**/*.jpg").match("a/b/c.jpg")), bool(glob_to_regex("*.jpg").match("a/c.jpg"))
    (True, False)
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class ListPage:
    """One page of an object store's listing: its objects (key, size, version), its common prefixes, the
    next page's token (None on the last page)."""

    objects: list[tuple[str, int, str]]
    prefixes: list[str]
    token: str | None


def version_of(info: dict[str, Any]) -> str:
    """An object's version as its store reports it. A GCS generation comes first: it changes with the
    bytes only, and both a listing and a GET's x-goog-generation give it (an ETag there also
    changes with metadata, and a JSON API listing's etag is not a GET's)."""
    for key in ("generation", "ETag", "etag", "md5Hash", "LastModified", "Last-Modified", "last_modified", "updated", "mtime", "created"):
        value = info.get(key)
        if value not in (None, ""):
            return str(value).strip('"')
    return ""



def matching(url: str, files: dict[str, RemoteItem], folders: int, pattern: str | None) -> list[RemoteItem]:
    """The items of ``url``'s listing (by relative path) that ``pattern`` matches, in path order.

    Raises:
        EmptyDatasetError: None does (:func:`nothing_matched`).
    """
    regex = glob_to_regex(pattern) if pattern else None
    items = [item for rel, item in sorted(files.items()) if regex is None or regex.match(rel)]
    if not items:
        raise nothing_matched(url, pattern, folders, list(files))
    return items


def nothing_matched(url: str, pattern: str | None, folders: int, files: Sequence[str]) -> EmptyDatasetError:
    """The error for a listing that yields no item: what was found, and the likely fix."""
    found = f"{folders} folder{'s' * (folders != 1)} and {len(files)} file{'s' * (len(files) != 1)}"
    if not files:
        return EmptyDatasetError(
            f"{url}: no data items: the listing found {found}"
            + (f" (pattern {pattern!r})" if pattern else "")
            + "; fix: check the URL (an empty folder lists as nothing), or put the data there"
        )
    deep = "**/" + pattern.lstrip("/") if pattern and not pattern.startswith("**") else None
    if deep and any(glob_to_regex(deep).match(f) for f in files):
        fix = f"pass --pattern {deep!r} (pattern={deep!r}): '*' stays within one folder, '**/' spans nested folders"
    else:
        examples = ", ".join(repr(f) for f in sorted(files)[:3])
        fix = f"check the pattern against the files' relative paths (e.g. {examples})"
    return EmptyDatasetError(f"{url}: pattern {pattern!r} matches nothing: the listing found {found}, 0 matching; fix: {fix}")

