"""Exceptions raised by fastload.

Every error is a :class:`FastloadError`, and most also inherit the builtin that
callers would naturally catch (``OSError``, ``ValueError``...), following
fsspec's ``fsspec/exceptions.py``. Messages name the item, the cause and the fix.
Secrets from ``storage_options`` never appear in a message: sources format
errors from URLs only.
"""

from __future__ import annotations


class FastloadError(Exception):
    """Base class of every error fastload raises on purpose."""


class ConfigError(FastloadError, ValueError):
    """A setting or argument is invalid (bad size string, bad JSON, bad combination)."""


class EmptyDatasetError(ConfigError):
    """A URL (and pattern) names no data item: an empty folder, or a pattern that matches nothing."""


class SourceError(FastloadError, OSError):
    """The remote could not be read (after retries, where retrying made sense)."""


class RemoteNotFoundError(SourceError, FileNotFoundError):
    """The URL, bucket or object does not exist."""


class CredentialsError(SourceError, PermissionError):
    """The remote refused access, or no credentials were found."""


class CertificateError(CredentialsError):
    """The server's TLS certificate is not trusted (self-signed, an unknown CA, another host's name):
    not retried; the message names the CA options."""


class RemoteChangedError(SourceError):
    """The remote object differs from the fingerprint recorded when it was listed or staged."""


class CacheError(FastloadError, OSError):
    """The local cache could not be used."""


class SQLiteVersionError(FastloadError, RuntimeError):
    """The SQLite library Python loads is older than the cache index runs on (``SQLITE_FLOOR``).

    Not a :class:`CacheError` (an ``OSError``): the cache's open reads those as a disk that
    refuses writes, and this is no disk's fault."""


class CacheFullError(CacheError):
    """The cache limit or the disk cannot hold what was asked of it."""


class CacheReadOnlyError(CacheFullError):
    """The cache is on a read-only file system: reads are served, new data streams uncached."""


class CacheLimitError(CacheFullError, ValueError):
    """The cache limit is smaller than a single item, so nothing could ever be cached."""


class CodecError(FastloadError, ValueError):
    """A payload header or body is malformed (bad magic, sizes, checksum)."""


class DecodeError(FastloadError, ValueError):
    """A sample could not be decoded (corrupt JPEG, wrong dtype or shape)."""


class StoppedError(FastloadError):
    """A request refused because its Reader is stopping (staging's Ctrl-C); the caller re-raises the interrupt."""


class LoaderError(FastloadError, RuntimeError):
    """The DataLoader or its background work failed (worker death, timeout)."""
