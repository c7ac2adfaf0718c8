"""Tar shards as WebDataset writes and names them: brace patterns, member keys, samples.

Words, as in this module: a *shard* is one tar file; a *member* is one regular file in
it; a *key* names a sample (``dir/000017``); a *suffix* is what follows the key in a
member's name (``jpg``, ``seg.png``); a *sample* is the consecutive members of one key.

These are WebDataset's own rules (webdataset 1.0.2, ``tariterators.py`` and the
``braceexpand`` package it uses), restated here so a ``webdataset`` pipeline and
``fastload.TarDataset`` yield the same keys; webdataset is not imported on the read path.
tests/integration/test_tar_names.py compares both on tricky names.
"""

from __future__ import annotations

import io
import re
import string
import tarfile
from collections.abc import Callable, Iterable
from itertools import product
from typing import Any, Protocol

from fastload.errors import ConfigError, DecodeError

__all__ = ["expand_braces", "group_members", "scan_plain", "split_name"]

Member = tuple[str, int, int]  # (suffix, data offset, size)

# webdataset's base_plus_ext: the key is everything up to the first dot of the last path
# part, the suffix all after it. A name with no dot there, or whose last part starts with a
# dot under a dotted folder, matches nothing and webdataset skips the member.
_KEY_SUFFIX = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
# webdataset's skip_meta: members named like __key__ (its own metadata) are not samples.
_META = re.compile(r"__[^/]*__($|/)")

_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_ALPHABET = string.ascii_uppercase + string.ascii_lowercase


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, suffix)`` of a member name as webdataset forms them (suffix lowercased), or
    None for a member webdataset skips (no suffix, or its ``__meta__`` members).

    >>> split_name("train/a.b/000017.seg.PNG")
    ('train/a.b/000017', 'seg.png')
    >>> split_name("README") is None
    True
    """
    if _META.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
        return None
    match = _KEY_SUFFIX.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


class _File(Protocol):
    def seek(self, offset: int, whence: int = ..., /) -> int: ...
    def read(self, size: int = ..., /) -> bytes | None: ...


_BLOCK = 512
_REGULAR = (b"0", b"\x00", b"7")  # tarfile's REGULAR_TYPES less GNU sparse ("S")
_OTHER = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, FIFOs: no data follows


def scan_plain(f: _File) -> tuple[list[tuple[str, int, int]], int] | None:
    """The regular members ``(name, data offset, size)`` of a plain ustar/v7 tar, and the
    offset where its headers end, as tarfile gives them; None for anything else.

    Why: tarfile builds a TarInfo per header, most of a cold shard's Python time
    (benchmarks/tar/results/). Here a header is a slice and an octal field. Anything
    this does not read exactly as tarfile does (PAX and GNU long names, sparse files,
    base-256 sizes, bad checksums, a cut header) returns None, and the caller gives
    the whole shard to tarfile (tests/unit/test_tar_names.py compares both).
    """
    found: list[tuple[str, int, int]] = []
    pos = 0
    while True:
        f.seek(pos)
        buf = f.read(_BLOCK) or b""
        if len(buf) != _BLOCK:
            return (found, pos) if not buf and pos else None
        if buf.count(0) == _BLOCK:  # the end-of-archive marker
            return (found, pos) if pos else None
        kind = buf[156:157]
        if kind not in _REGULAR and kind not in _OTHER:
            return None
        try:
            chksum = _octal(buf[148:156])
            size = _octal(buf[124:136])
        except ValueError:
            return None
        if chksum != 256 + sum(buf[:148]) + sum(buf[156:]):
            return None  # or a signed sum, which tarfile also takes: its case
        name = _text(buf[0:100])
        prefix = _text(buf[345:500])
        if prefix:
            name = prefix + "/" + name
        regular = kind in _REGULAR and not (kind == b"\x00" and name.endswith("/"))
        if regular:
            found.append((name, pos + _BLOCK, size))
            pos += _BLOCK + -(-size // _BLOCK) * _BLOCK
        else:
            pos += _BLOCK


def _octal(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):
        raise ValueError("base-256")
    text = field.split(b"\x00", 1)[0].decode("ascii").strip()
    return int(text or "0", 8)


def _text(field: bytes) -> str:
    return field.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def group_members(members: Iterable[tuple[str, int, int]], url: str) -> list[tuple[str, list[Member]]]:
    """Samples of a shard from its regular members ``(name, data offset, size)``, in order.

    Consecutive members sharing a key are one sample, as webdataset groups them; a key that
    comes back after another is a new sample, as in webdataset. Two members of one sample
    with one suffix are an error there and here (``DecodeError``, naming the shard and name).
    """
    samples: list[tuple[str, list[Member]]] = []
    for name, offset, size in members:
        split = split_name(name)
        if split is None:
            continue
        key, suffix = split
        if not samples or samples[-1][0] != key:
            samples.append((key, []))
        group = samples[-1][1]
        if any(s == suffix for s, _, _ in group):
            raise DecodeError(f"{url}: member {name!r} repeats suffix {suffix!r} of sample {key!r} (webdataset refuses "
                              "it too); fix: rebuild that shard with one member per suffix and key")
        group.append((suffix, offset, size))
    return samples


def expand_braces(pattern: str) -> list[str]:
    """The URLs a brace pattern names, as webdataset expands them (the ``braceexpand`` rules).

    ``{a,b}`` lists, ``{000..007}`` ranges (zero-padded as written, with an optional
    ``..step``), ``{a..e}`` letter ranges, nested; ``\\{`` is a literal brace, and braces
    around anything else (``{x}``) stay as written.

    >>> expand_braces("s3://b/shard-{000000..000002}.tar")
    ['s3://b/shard-000000.tar', 's3://b/shard-000001.tar', 's3://b/shard-000002.tar']
    >>> expand_braces("{train,val}/{0..1}.tar")
    ['train/0.tar', 'train/1.tar', 'val/0.tar', 'val/1.tar']

    Raises:
        ConfigError: Braces that do not pair up.
    """
    try:
        return [_unescape("".join(parts)) for parts in _pattern(pattern)]
    except ValueError as err:
        raise ConfigError(f"{pattern!r}: unbalanced braces; fix: pair every '{{' with a '}}', or write "
                          "a literal brace as '\\{'") from err


def _pattern(pattern: str) -> Iterable[tuple[str, ...]]:
    start = pos = depth = 0
    items: list[list[str]] = []
    while pos < len(pattern):
        ch = pattern[pos]
        if ch == "\\":
            pos += 2
            continue
        if ch == "{":
            if depth == 0 and pos > start:
                items.append([pattern[start:pos]])
                start = pos
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                expr = pattern[start + 1 : pos]
                got = _expression(expr)
                if got is None:  # neither a range nor a list: the braces are literal
                    items.extend([["{"], ["".join(p) for p in _pattern(expr)], ["}"]])
                else:
                    items.append(got)
                start = pos + 1
        pos += 1
    if depth != 0:
        raise ValueError(pattern)
    if start < pos:
        items.append([pattern[start:]])
    return product(*items)


def _expression(expr: str) -> list[str] | None:
    if m := _INT_RANGE.match(expr):
        first, last, step = m.groups()
        padded = any(s.startswith(("0", "-0")) for s in (first, last) if s not in ("0", "-0"))
        width = max(len(first), len(last)) if padded else 0
        a, b, k = int(first), int(last), (int(step) or 1) if step else 1
        values = range(a, b + 1, k) if a < b else range(a, b - 1, -k)
        return [f"{v:0{width}d}" if width else str(v) for v in values]
    if m := _CHAR_RANGE.match(expr):
        first, last, step = m.groups()
        k = (int(step) or 1) if step else 1
        a, b = _ALPHABET.index(first), _ALPHABET.index(last)
        if a < b:
            return list(_ALPHABET[a : b + 1 : k])
        return list(_ALPHABET[a : (b or -len(_ALPHABET)) - 1 : -k])
    return _sequence(expr)


def _sequence(seq: str) -> list[str] | None:
    start = pos = depth = 0
    parts: list[str] = []
    while pos < len(seq):
        ch = seq[pos]
        if ch == "\\":
            pos += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(seq[start:pos])
            start = pos + 1
        pos += 1
    if depth != 0 or not parts:
        return None
    parts.append(seq[start:])
    return ["".join(p) for part in parts for p in _pattern(part)]


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def list_members(open_shard: Callable[[], Any], url: str, size: int) -> list[tuple[str, int, int]]:
    """The file members of the tar shard ``url`` of ``size`` bytes (``open_shard()`` opens a raw file
    over it), as ``(name, data offset, size)``, in order; links and devices, which would point outside
    the shard, skipped. :func:`scan_plain` reads plain ustar headers; PAX or GNU names, or damage, go to
    tarfile's reading and its errors.

    Raises:
        DecodeError: Not a readable tar, or cut off (tarfile stops quietly at a cut header and never
            reads members' data).
    """
    with open_shard() as raw:
        plain = scan_plain(raw)
    if plain is not None:
        found, end = plain
    else:
        found = []
        try:
            with io.BufferedReader(open_shard()) as f, tarfile.open(fileobj=f, mode="r:") as archive:
                for member in archive:
                    if member.isfile():
                        found.append((member.name, member.offset_data, member.size))
            end = archive.offset  # where tarfile stopped: the end-of-archive marker, or a cut header
        except tarfile.TarError as err:
            raise DecodeError(f"{url}: not a readable tar shard ({err}); fix: check or rebuild that shard") from err
    cut = cut_at(size, end, found)
    if cut is not None:
        raise DecodeError(f"{url}: tar shard truncated at byte {cut} of {size} (a member or header is cut off there); "
                          "fix: re-upload or rebuild that shard")
    return found


def cut_at(size: int, end: int, members: Iterable[tuple[str, int, int]]) -> int | None:
    """Where a tar shard of ``size`` bytes is cut off, or None if it is whole.

    ``end`` is where the headers' reading stopped. A whole shard ends with two zero blocks
    (and padding), so at least 1 KiB follows; a member whose data runs past ``size`` is cut in its data.
    """
    past = [offset for _, offset, n in members if offset + n > size]
    if past:
        return max(past)
    return end if size - end < 2 * tarfile.BLOCKSIZE else None
