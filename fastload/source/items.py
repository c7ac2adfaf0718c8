"""What a listing yields: :class:`RemoteItem`, and the glob that filters it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from fsspec.utils import glob_translate

from fastload.errors import ConfigError, EmptyDatasetError


@dataclass(frozen=True, slots=True)
class RemoteItem:
    """One remote object as listed.

    Attributes:
        url: Canonical URL with its protocol (``s3://b/k``, ``file:///p``, ``http://h/p``).
        size: Size in bytes; -1 until known with the object's version (an HTTP listing).
        version: ETag, generation or mtime as a string; "" when the store has none.
        index_size: The exact size an HTTP index page showed for an object whose ``size`` is
            not known yet (-1: none shown). The page gives no version, and a size without
            one would name a cache entry that no answer can check (tests/integration/
            test_torn_objects.py), so it only plans (:attr:`plan_size`); never compared, hashed or recorded.
    """

    url: str
    size: int
    version: str
    index_size: int = field(default=-1, compare=False, repr=False)

    @property
    def plan_size(self) -> int:
        """The size to plan with (node parts, dry runs, the cache limit): ``size``, else
        ``index_size``; -1 when neither is known (then it costs a HEAD or a first GET).

        >>> RemoteItem("http://h/a.jpg", -1, "", index_size=3000).plan_size
        3000
        """
        return self.size if self.size >= 0 else self.index_size

    def __reduce__(self) -> tuple[type[RemoteItem], tuple[str, int, str, int]]:
        # Python 3.10's frozen slots dataclasses do not unpickle (they set fields one by one).
        return RemoteItem, (self.url, self.size, self.version, self.index_size)

    def to_json(self) -> list[Any]:
        return [self.url, self.size, self.version]

    @classmethod
    def from_json(cls, row: list[Any]) -> RemoteItem:
        """The item of a recorded listing's row (:meth:`to_json`), made as :func:`listed` makes
        one: reading a manifest of 100,000 spent 0.26 s of a rerun's 1.1 in ``__init__`` (cProfile)."""
        return _made(str(row[0]), int(row[1]), str(row[2]), -1)


_SLOTS = tuple(RemoteItem.__dict__[name].__set__ for name in ("url", "size", "version", "index_size"))


def _made(url: str, size: int, version: str, index_size: int, _new: Any = object.__new__,
          _slots: tuple[Any, ...] = _SLOTS) -> RemoteItem:
    """``RemoteItem(url, size, version, index_size)``, made faster: a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``: 0.93 us an item, where setting
    its slots directly takes 0.56 (timeit, 1,000 URLs)."""
    item = _new(RemoteItem)
    _slots[0](item, url)
    _slots[1](item, size)
    _slots[2](item, version)
    _slots[3](item, index_size)
    return item


def listed(url: str, index_size: int) -> RemoteItem:
    """``RemoteItem(url, -1, "", index_size)``: an item as an HTTP listing gives it (:func:`_made`;
    0.4 s of a 1,000,000-object listing, fastload.source.listing.crawl).

    >>> listed("http://h/a.jpg", 3000) == RemoteItem("http://h/a.jpg", -1, "", 3000)
    True
    >>> RemoteItem.from_json(["http://h/a.jpg", 3, "v"]) == RemoteItem("http://h/a.jpg", 3, "v")
    True
    """
    return _made(url, -1, "", index_size)


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob as fsspec's ``glob`` reads it, for paths relative to a listing's root.

    fsspec's own translation (``fsspec.utils.glob_translate``): ``*`` and ``?`` stay
    within one folder, ``[...]`` and ``[!...]`` are classes, a whole ``**`` component
    spans any number of folders (none included). A hand-written translation escaped
    classes, so ``class_[01]/*.jpg`` matched nothing (issue 24; tests/integration/
    test_source_contract.py checks each form against fsspec's own ``glob`` on every store).

    >>> bool(glob_to_regex("**/*.jpg").match("a/b/c.jpg")), bool(glob_to_regex("*.jpg").match("a/c.jpg"))
    (True, False)
    >>> bool(glob_to_regex("class_[01]/?.jpg").match("class_1/7.jpg"))
    True

    Raises:
        ConfigError: ``**`` inside a component (``a**b``), which fsspec refuses too.
    """
    try:
        return re.compile(glob_translate(pattern.lstrip("/")))
    except ValueError as err:  # fsspec's word for '**' that is not a whole component
        fix = "**/" + pattern.replace("**", "*").lstrip("/")
        raise ConfigError(f"pattern {pattern!r} is not a glob fsspec reads ({err}); fix: make '**' a whole path "
                          f"component, e.g. {fix!r}") from err


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
    # Sorted keys, not items: 100,000 (path, item) pairs were young objects the collector
    # tracks (fastload.source.listing.no_collection), for the length of one sort.
    items = [files[rel] for rel in sorted(files) if regex is None or regex.match(rel)]
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


class Picked(Sequence[RemoteItem]):
    """``[items[i] for i in picks]``, each item taken when asked for: a dataset's located read
    asks for none (at a million samples each item touched is a CPU cache miss; fastload.read.located)."""

    __slots__ = ("_items", "_picks")

    def __init__(self, items: list[RemoteItem], picks: Sequence[int]) -> None:
        self._items, self._picks = items, picks

    def __len__(self) -> int:
        return len(self._picks)

    @overload
    def __getitem__(self, k: int) -> RemoteItem: ...
    @overload
    def __getitem__(self, k: slice) -> list[RemoteItem]: ...
    def __getitem__(self, k: int | slice) -> RemoteItem | list[RemoteItem]:
        if isinstance(k, slice):
            return [self._items[i] for i in self._picks[k]]
        return self._items[self._picks[k]]
