"""Settings: one frozen dataclass, human sizes, and the ``FASTLOAD_*`` environment.

Only :func:`Settings.from_env` reads the environment, so a worker process that
receives a pickled ``Settings`` sees exactly what its parent saw.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Parse a human size such as ``"200GB"``, ``"1.5 GiB"`` or ``4096`` into bytes.

    Decimal units (KB, MB, GB, TB) are powers of 1000; binary units (KiB, MiB,
    GiB, TiB) are powers of 1024.

    >>> parse_size("200GB")
    200000000000
    >>> parse_size("4MiB")
    4194304
    """
    if isinstance(value, bool):
        raise ConfigError(f"size {value!r} is not a size; use e.g. '200GB' or 4096")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"size {value!r} is negative; use a positive number of bytes")
        return int(value)
    match = _SIZE_RE.match(value)
    if not match:
        raise ConfigError(f"size {value!r} is not understood; use e.g. '200GB', '512MiB' or 4096")
    number, unit = match.groups()
    factor = _UNITS.get(unit.upper())
    if factor is None:
        raise ConfigError(
            f"size {value!r} has unknown unit {unit!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    return int(float(number) * factor)


def format_size(n: float | None) -> str:
    """A byte count for humans: decimal units, 3 significant digits; None (not measured) is "-".

    The one size formatter: CLI messages, limits and diagnose's prose all print sizes so.

    >>> format_size(1_500_000), format_size(108_000), format_size(65_536), format_size(999), format_size(None)
    ('1.5 MB', '108 KB', '65.5 KB', '999 B', '-')
    """
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if abs(v) < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def default_cache_dir() -> Path:
    """``$FASTLOAD_CACHE_DIR`` if set, else ``~/.cache/fastload``."""
    env = os.environ.get("FASTLOAD_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastload"


# FASTLOAD_* variable -> (Settings field, parser); read only by Settings.from_env.
ENV_FIELDS: dict[str, tuple[str, Any]] = {
    "FASTLOAD_CACHE_DIR": ("cache_dir", Path),
    "FASTLOAD_CACHE_LIMIT": ("cache_limit_bytes", parse_size),
    "FASTLOAD_DISK_RESERVE": ("disk_reserve_bytes", parse_size),
    "FASTLOAD_BLOCK_SIZE": ("block_bytes", parse_size),
    "FASTLOAD_CHUNK_SIZE": ("chunk_bytes", parse_size),
    "FASTLOAD_PACK_MAX": ("pack_max_bytes", parse_size),
    "FASTLOAD_LZ4_LEVEL": ("lz4_level", int),
    "FASTLOAD_MAX_REQUESTS": ("max_requests", int),
    "FASTLOAD_RETRIES": ("retries", int),
    "FASTLOAD_RETRY_BUDGET_S": ("retry_budget_s", float),
    "FASTLOAD_BACKOFF_S": ("backoff_s", float),
    # The cap too, so every retry knob is reachable from the CLI (issue 7).
    "FASTLOAD_BACKOFF_MAX_S": ("backoff_max_s", float),
    "FASTLOAD_TIMEOUT_S": ("request_timeout_s", float),
    "FASTLOAD_HTTP_CLIENT": ("http_client", str),
}
_FIELD_ENV = {field: (name, convert) for name, (field, convert) in ENV_FIELDS.items()}
_DEFAULTS: dict[str, Any] = {}  # field -> its default where no FASTLOAD_* variable is set


def env_value(field: str, env: Mapping[str, str] | None = None) -> Any:
    """What ``FASTLOAD_*`` sets ``field`` to in ``env`` (default ``os.environ``), or None where unset.

    The one reader of the ``FASTLOAD_*`` settings: ``Settings(...)``'s defaults and
    :meth:`Settings.from_env` both come here, so both follow one precedence.
    """
    env = os.environ if env is None else env
    name, convert = _FIELD_ENV[field]
    raw = env.get(name)
    if not raw and field == "max_requests" and env.get("FASTLOAD_WORKERS"):
        deprecated("FASTLOAD_WORKERS", "FASTLOAD_MAX_REQUESTS")
        name, raw = "FASTLOAD_WORKERS", env["FASTLOAD_WORKERS"]
    if raw is None or raw == "":
        return None
    try:
        return convert(raw)
    except (ValueError, ConfigError) as err:
        raise ConfigError(f"environment variable {name}={raw!r} is invalid: {err}") from err


def _env_or(field: str, default: Any) -> Any:
    """A Settings field whose default is its ``FASTLOAD_*`` variable where set: an argument passed to
    ``Settings(...)`` wins over the variable, the variable over the built-in default (issue 32:
    ``FASTLOAD_RETRIES`` was ignored once ``Settings(...)`` was passed). A pickled Settings is not
    built again, so a worker process sees exactly what its parent saw."""
    _DEFAULTS[field] = default

    def factory() -> Any:
        value = env_value(field)
        return default if value is None else value

    return dataclasses.field(default_factory=factory)


@dataclass(frozen=True)
class Settings:
    """Every tunable of fastload, with units in the names.

    Precedence, one rule for every field: an argument passed to ``Settings(...)`` (or to
    :meth:`from_env` / :meth:`replace`) wins; a field not passed takes its ``FASTLOAD_*``
    variable where set (:data:`ENV_FIELDS`); else the default below. ``Settings(retries=3)``
    under ``FASTLOAD_RETRY_BUDGET_S=600`` has both. A Settings object is read once, where it is
    built: a pickled one (a worker process's) does not read the environment again.

    Attributes:
        cache_dir: Where payloads and the index live (created with mode 0700).
        cache_limit_bytes: Upper bound on payload bytes on disk; LRU eviction keeps it.
        disk_reserve_bytes: Space the cache leaves free on its disk, whatever the limit:
            the limit in force is also capped at the cache's bytes plus the disk's free
            space less this. None (default): 5% of the disk, at most 1 GB; 0: no cap.
        block_bytes: Remote files larger than this are cached as fixed-size blocks of
            this size, so random access never downloads a whole multi-GB shard.
        chunk_bytes: LZ4 payloads are split into independent blocks of this raw size,
            so a GPU (nvCOMP inflate) can decompress chunks in parallel. nvCOMP is
            said to work best near 64 KiB chunks; 1 MiB stays the default until a
            GPU measures it (``make gpu-check``'s inflate case compares 64 KiB,
            256 KiB and 1 MiB; none has run yet).
        pack_max_bytes: Payloads of at most this many stored bytes are appended to a
            pack file of the writing process instead of a file each (no temp file,
            rename or inode per object; fastload.cache.packs); 0 = a file each.
        lz4_level: 0 = fast LZ4 block; 1..12 = LZ4-HC at that level (pre-staging only).
        min_saving: Store LZ4 only if it saves at least this fraction, else store raw.
        max_requests: The most requests in flight to one host from one process (staging
            and training alike); an adaptive limit runs under it (fastload.transport.hostlimit).
            Its one home: nothing else (threads, pools) is sized from it.
            ``workers=`` / ``FASTLOAD_WORKERS`` / ``--workers`` are its old names: still
            taken, with a warning once (they read like torch's ``num_workers``).
        head_threads: HEADs in flight while a sizeless listing is completed (a HEAD
            moves no data, so more overlap than transfers: fastload.source.core).
        verify_threads: Threads re-checking cached entries (``fastload cache --verify``).
        local_threads: Threads reading a store without an event loop (local files, NFS)
            at once, where fsspec cannot overlap the reads itself.
        stage_threads: Staging tasks at once, each completing and fetching a chunk of
            ``stage.CHUNK`` items together; the requests in flight are bounded by the
            host limit, not here. Every thread pool's size is one of these fields or,
            for the DataLoader's and the pipelines' CPU threads, a default below
            (:func:`default_read_threads`, :func:`default_decode_threads`).
        retries: A cap on attempts per remote request (1 = no retry); None (default): as many
            as ``retry_budget_s`` allows. Set it for fail-fast jobs and tests.
        retry_budget_s: How long one failing request is tried again, from its first attempt
            to the start of its last (fastload.transport.retry): an outage or a SlowDown storm
            shorter than this slows the epoch and never ends it; 0 = no retry.
        backoff_s: First retry delay; doubles per attempt, with full jitter.
        backoff_max_s: Cap on a single retry delay (a ``Retry-After`` answer may ask for more).
        request_timeout_s: Per-request timeout for remote reads.
        http_client: Who carries the first-block GET of each HTTP object and listing pages: ``"auto"``
            (default): libcurl (``fastload._curl``) where it is built, libcurl is
            installed and the storage_options map onto it, else fsspec's aiohttp
            session; ``"curl"``: the same, but a missing engine is an error;
            ``"aiohttp"``: always aiohttp (fastload.transport.curl). The same choice holds for S3's
            signed first blocks and listing pages, whose other road is s3fs (fastload.source.s3).
        lock_timeout_s: Upper bound on waiting for the cache's eviction lock.
    """

    cache_dir: Path = dataclasses.field(default_factory=default_cache_dir)
    cache_limit_bytes: int = _env_or("cache_limit_bytes", 50 * 1000**3)
    disk_reserve_bytes: int | None = _env_or("disk_reserve_bytes", None)
    block_bytes: int = _env_or("block_bytes", 8 * 1024**2)
    chunk_bytes: int = _env_or("chunk_bytes", 1024**2)
    pack_max_bytes: int = _env_or("pack_max_bytes", 1024**2)
    lz4_level: int = _env_or("lz4_level", 0)
    min_saving: float = 0.05
    max_requests: int = _env_or("max_requests", 64)
    head_threads: int = 64
    verify_threads: int = 8
    local_threads: int = 16
    stage_threads: int = 4
    retries: int | None = _env_or("retries", None)
    retry_budget_s: float = _env_or("retry_budget_s", 300.0)
    backoff_s: float = _env_or("backoff_s", 0.2)
    backoff_max_s: float = _env_or("backoff_max_s", 10.0)
    request_timeout_s: float = _env_or("request_timeout_s", 60.0)
    http_client: str = _env_or("http_client", "auto")
    lock_timeout_s: float = 300.0
    workers: dataclasses.InitVar[int | None] = None  # max_requests' old name (a warning once)

    def __post_init__(self, workers: int | None) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if self.cache_limit_bytes <= 0:
            raise ConfigError(f"cache limit {self.cache_limit_bytes} must be positive")
        if self.disk_reserve_bytes is not None and self.disk_reserve_bytes < 0:
            raise ConfigError(f"disk reserve {self.disk_reserve_bytes} B is negative; use e.g. '1GB', or 0 for none")
        if self.block_bytes < 4096:
            raise ConfigError(f"block size {self.block_bytes} B is below 4 KiB; use e.g. '8MiB'")
        if not 4096 <= self.chunk_bytes <= 2**31 - 1:
            raise ConfigError(f"chunk size {self.chunk_bytes} B must be between 4 KiB and 2 GiB")
        if self.pack_max_bytes < 0:
            raise ConfigError(f"pack size {self.pack_max_bytes} B is negative; use e.g. '1MiB', or 0 for a file per payload")
        if not 0 <= self.lz4_level <= 12:
            raise ConfigError(f"LZ4 level {self.lz4_level} must be 0 (fast) or 1..12 (HC)")
        if workers is not None and not isinstance(workers, _Echo):
            deprecated("workers", "max_requests")
            object.__setattr__(self, "max_requests", workers)
        for name in ("max_requests", "head_threads", "verify_threads", "local_threads", "stage_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.retries is not None and self.retries < 1:
            raise ConfigError(f"retries={self.retries} must be at least 1 (or None: as many as retry_budget_s allows)")
        if self.retry_budget_s < 0:
            raise ConfigError(f"retry_budget_s={self.retry_budget_s} is negative; use e.g. 300, or 0 for no retry")
        if self.http_client not in HTTP_CLIENTS:
            raise ConfigError(f"http_client={self.http_client!r} is not one of {', '.join(HTTP_CLIENTS)}")

    @property
    def first_wait_s(self) -> float:
        """How long an answer to a first-block GET (fetched ahead, or of a batch) is waited for:
        its request's timeout, and once more for a redo (Source and the Fetcher alike)."""
        return 2 * self.request_timeout_s

    @property
    def fetch_wait_s(self) -> float:
        """How long a thread waits for another thread's fetch of a block: that request's retries
        (its budget, or its attempts where ``retries`` caps them sooner), its last attempt, and a backoff."""
        span = self.retry_budget_s + self.request_timeout_s
        if self.retries is not None:
            span = min(span, self.retries * (self.request_timeout_s + self.backoff_max_s))
        return span + self.backoff_max_s

    def replace(self, **changes: Any) -> Settings:
        """Return a copy with ``changes`` applied (sizes may be human strings)."""
        for key in ("cache_limit_bytes", "disk_reserve_bytes", "block_bytes", "chunk_bytes", "pack_max_bytes"):
            if key in changes and changes[key] is not None:
                changes[key] = parse_size(changes[key])
        # workers (max_requests' old name, an InitVar) passed as None unless given: else replace()
        # reads it back through the property, and warns users who never wrote it.
        return dataclasses.replace(self, **{"workers": None, **{k: v for k, v in changes.items() if v is not None}})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``FASTLOAD_*`` variables of ``env`` (default ``os.environ``), then apply ``overrides``.

        ``Settings(...)`` reads the same variables for the fields it is not passed; this
        reads only ``env`` (a test's dict sees no variable of the process). Recognised:
        FASTLOAD_CACHE_DIR, FASTLOAD_CACHE_LIMIT, FASTLOAD_DISK_RESERVE, FASTLOAD_BLOCK_SIZE,
        FASTLOAD_CHUNK_SIZE, FASTLOAD_PACK_MAX, FASTLOAD_LZ4_LEVEL, FASTLOAD_MAX_REQUESTS (or its old name
        FASTLOAD_WORKERS, with a warning), FASTLOAD_RETRIES, FASTLOAD_RETRY_BUDGET_S,
        FASTLOAD_BACKOFF_S, FASTLOAD_BACKOFF_MAX_S, FASTLOAD_TIMEOUT_S, FASTLOAD_HTTP_CLIENT.
        """
        values: dict[str, Any] = {}
        for field in _FIELD_ENV:
            value = env_value(field, env)
            if value is not None:
                values[field] = value
            elif field in _DEFAULTS:  # cache_dir's default reads FASTLOAD_CACHE_DIR of the process (default_cache_dir)
                values[field] = _DEFAULTS[field]
        settings = cls(**values)
        return settings.replace(**overrides) if overrides else settings


class _Echo(int):
    """``max_requests`` read through its old name. ``dataclasses.replace`` reads every init field,
    the InitVar ``workers`` too, and passes it back: an echo is not a new setting."""


def _workers(self: Settings) -> int:
    """``max_requests``' old name, still read (with a warning once)."""
    deprecated("workers", "max_requests")
    return _Echo(self.max_requests)


# After the class: its generated __init__ keeps ``workers=`` (the InitVar), reads go to max_requests.
setattr(Settings, "workers", property(_workers))  # noqa: B010 - after the class, past the dataclass
_warned: set[str] = set()


_MAX_REQUESTS = "the most requests in flight to one host, not torch's num_workers"


def deprecated(old: str, new: str, meaning: str = _MAX_REQUESTS) -> None:
    """Warn once per process that ``old`` is ``new``'s old name (a FutureWarning: shown by default).

    ``meaning`` says what ``new`` is, so the message tells why the name changed.
    """
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"fastload: {old!r} is now {new!r} ({meaning}); {old!r} still works for now",
                      FutureWarning, stacklevel=3)


_ENV_NAMES = (*ENV_FIELDS, "FASTLOAD_WORKERS")  # every variable from_env reads (the last: an old name)
_ENV_KEYS = tuple(os.fsencode(name) for name in _ENV_NAMES)
_ENV_SETTINGS: dict[tuple[Any, ...], Settings] = {}  # FASTLOAD_* values -> their Settings


def env_settings() -> Settings:
    """``Settings.from_env()``, built once per distinct set of ``FASTLOAD_*`` values.

    For paths that run per file (``fastload.open``): from_env costs ~0.4 ms (a copy
    of the environment), this a few microseconds. It reads os.environ's own store
    where it has one (POSIX, bytes -> bytes, kept in step by os.environ's setters).
    """
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        values: tuple[Any, ...] = tuple(map(data.get, _ENV_KEYS))
    else:
        values = tuple(os.environ.get(name) for name in _ENV_NAMES)
    settings = _ENV_SETTINGS.get(values)
    if settings is None:
        settings = _ENV_SETTINGS[values] = Settings.from_env()
    return settings


HTTP_CLIENTS = ("auto", "curl", "aiohttp")


def pure_python() -> bool:
    """Whether ``FASTLOAD_PURE_PYTHON`` (any value but "" or "0") turns off the C extensions: both
    ``fastload._native`` (fastload.cache.gather) and ``fastload._curl`` (fastload.transport.curl) ask here."""
    return os.environ.get("FASTLOAD_PURE_PYTHON", "") not in ("", "0")


def default_read_threads() -> int:
    """The DataLoader's default ``read_threads``: this process's CPUs, 2 to 8.

    Remote requests of a batch overlap on fsspec's event loop, not one per thread,
    so threads only need to cover the CPU work (checks, copies, decode). More cost
    switches and GIL handoffs: on 2 cores a cold epoch ran at 615 objects/s with 8
    threads and 937/s with 2, a warm one at ~11,000/s and ~20,000/s
    (docs/loader.md).
    """
    return max(2, min(8, usable_cpus()))


def default_decode_threads() -> int:
    """The pipelines' default ``threads`` (CPU decode, LZ4 decode): the usable cores."""
    return usable_cpus()


def usable_cpus() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)

