"""How long a failed request is tried again: exponential backoff with full jitter, within a time budget.

The one home of the retry policy, used by every road (libcurl's failed GETs, aiohttp,
s3fs, gcsfs and local files are all redone through ``Source._call``). Words:

* an *attempt* is one request; a *retry* one after a failure that
  :func:`fastload.transport.failures.transient` says another try may mend;
* the *budget* (``Settings.retry_budget_s``) bounds the time from a request's first
  attempt to the start of its last: an outage or a SlowDown storm shorter than it
  slows the epoch and never ends it, and a dead store still ends in bounded time;
* a *sleep* is drawn from ``[0, min(backoff_max_s, backoff_s * 2**n)]`` (full
  jitter: many workers do not retry in lockstep), at least what the answer's
  ``Retry-After`` asks, and never past the budget;
* ``Settings.retries``, where set, caps the attempts as well (fail-fast jobs, tests).

An *outage* is a host's run of retries with no quiet gap of :data:`QUIET_S`: it is
announced by one warning (:func:`note_retry`), not one per request.
"""

from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastload.config import Settings

_log = logging.getLogger("fastload")
QUIET_S = 60.0  # retries of a host this far apart are two outages, each with its warning
_MAX_EXPONENT = 30  # 2**30 x backoff_s is past any cap; a larger power only risks an overflow


@dataclass
class Retries:
    """One request's retries: :meth:`sleep_after` says how long to wait before the next attempt, or None.

    ``clock`` and ``rng`` are injectable so the policy can be tested without waiting
    (tests/unit/test_retry.py).
    """

    budget_s: float
    backoff_s: float
    backoff_max_s: float
    max_attempts: int | None = None
    clock: Callable[[], float] = time.monotonic
    rng: random.Random | Any = random  # the module's shared generator by default
    attempts: int = 0
    started: float = field(default=-1.0)

    @classmethod
    def of(cls, settings: Settings, **kwargs: Any) -> Retries:
        return cls(settings.retry_budget_s, settings.backoff_s, settings.backoff_max_s, settings.retries, **kwargs)

    def __post_init__(self) -> None:
        if self.started < 0:
            self.started = self.clock()

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.started

    @property
    def capped(self) -> bool:
        """Whether ``retries`` (the attempt cap), not the budget, ended the retries."""
        return self.max_attempts is not None and self.attempts >= self.max_attempts

    def sleep_after(self, err: BaseException | None = None) -> float | None:
        """Count a failed attempt; return the sleep before the next one, or None: give up."""
        self.attempts += 1
        if self.capped:
            return None
        left = self.budget_s - self.elapsed_s
        if left <= 0:
            return None
        cap = min(self.backoff_max_s, self.backoff_s * 2 ** min(self.attempts - 1, _MAX_EXPONENT))
        sleep = self.rng.uniform(0, cap)
        asked = retry_after(err) if err is not None else None
        if asked is not None:  # the store said when to come back: not sooner
            sleep = max(sleep, asked)
        return min(sleep, left)  # the last attempt starts when the budget ends, not after


def retry_after(err: BaseException) -> float | None:
    """The seconds a ``Retry-After`` header of the answer behind ``err`` asks for (None: none).

    aiohttp's ClientResponseError carries the answer's headers; botocore's ClientError
    its ``ResponseMetadata.HTTPHeaders`` (s3fs raises from it). Seconds or an HTTP date.
    """
    e: BaseException | None = err
    for _ in range(6):
        if e is None:
            return None
        value = _header(e)
        if value is not None:
            return _seconds(value)
        e = e.__cause__ or e.__context__
    return None


def _header(err: BaseException) -> str | None:
    headers = getattr(err, "headers", None)
    if headers is not None and hasattr(headers, "get"):
        value = headers.get("Retry-After")
        if value is not None:
            return str(value)
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        found = ((response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("retry-after")
        if found is not None:
            return str(found)
    return None


def _seconds(value: str) -> float | None:
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


_outages: dict[str, float] = {}  # host -> when a request of it last failed and was retried
_outages_lock = threading.Lock()


def note_retry(host: str, cause: str, settings: Settings, clock: Callable[[], float] = time.monotonic) -> bool:
    """Record a retry of a request to ``host``; warn once per outage (True when this one warned).

    One line while it waits, not one per request: under a 30% SlowDown storm every
    batch retries, and the first of a host's retries in :data:`QUIET_S` says it all.
    """
    now = clock()
    with _outages_lock:
        last = _outages.get(host)
        _outages[host] = now
    if last is not None and now - last < QUIET_S:
        return False
    cap = f" (at most {settings.retries} attempts: retries={settings.retries})" if settings.retries else ""
    _log.warning(
        "fastload: requests to %s fail (%s); each is retried with backoff for up to retry_budget_s=%g s%s, "
        "and the epoch goes on when the store answers; a longer wait: Settings(retry_budget_s=...) or "
        "FASTLOAD_RETRY_BUDGET_S", host, cause, settings.retry_budget_s, cap)
    return True
