"""The retry policy (fastload.transport.retry), on a fake clock: no test here sleeps."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

from fastload.config import Settings
from fastload.transport import retry
from fastload.transport.retry import Retries, retry_after


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Answer(Exception):
    """An error carrying an answer's headers, as aiohttp's ClientResponseError does."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__("503")
        self.headers = headers


def run(policy: Retries, clock: Clock, fail_s: float = 0.0, err: BaseException | None = None) -> list[float]:
    """Every sleep until the policy gives up, each attempt taking ``fail_s`` to fail."""
    sleeps: list[float] = []
    while True:
        clock.now += fail_s
        sleep = policy.sleep_after(err)
        if sleep is None:
            return sleeps
        sleeps.append(sleep)
        clock.now += sleep


def test_sleeps_double_to_the_cap_with_full_jitter_until_the_budget_ends() -> None:
    clock = Clock()
    policy = Retries(60.0, 0.2, 10.0, clock=clock, rng=random.Random(1))
    sleeps = run(policy, clock)
    caps = [min(10.0, 0.2 * 2**k) for k in range(len(sleeps))]
    assert all(0 <= s <= c for s, c in zip(sleeps[:-1], caps)), (sleeps, caps)
    assert min(s / c for s, c in zip(sleeps, caps)) < 0.5  # jittered, not fixed at the cap
    # The last attempt starts when the budget ends, not after, and then it gives up.
    assert clock.now == pytest.approx(100.0 + 60.0) and sum(sleeps) == pytest.approx(60.0)
    assert policy.attempts == len(sleeps) + 1 and not policy.capped


def test_same_seed_same_sleeps() -> None:
    a, b = Clock(), Clock()
    assert run(Retries(30.0, 0.2, 5.0, clock=a, rng=random.Random(7)), a) == \
        run(Retries(30.0, 0.2, 5.0, clock=b, rng=random.Random(7)), b)


def test_the_budget_counts_the_attempts_time_too() -> None:
    clock = Clock()
    policy = Retries(10.0, 0.2, 1.0, clock=clock, rng=random.Random(2))
    sleeps = run(policy, clock, fail_s=3.0)  # each attempt fails after 3 s (a timeout)
    assert clock.now - 100.0 <= 10.0 + 3.0 and len(sleeps) <= 4, sleeps


def test_retries_caps_the_attempts_before_the_budget() -> None:
    clock = Clock()
    policy = Retries(300.0, 0.2, 10.0, max_attempts=3, clock=clock, rng=random.Random(3))
    assert len(run(policy, clock)) == 2 and policy.attempts == 3 and policy.capped


def test_a_zero_budget_never_retries() -> None:
    clock = Clock()
    assert run(Retries(0.0, 0.2, 10.0, clock=clock), clock) == []


def test_retry_after_is_honoured_beyond_the_cap_but_not_past_the_budget() -> None:
    clock = Clock()
    policy = Retries(20.0, 0.2, 1.0, clock=clock, rng=random.Random(4))
    assert policy.sleep_after(Answer({"Retry-After": "7"})) == 7.0
    clock.now += 7.0
    assert policy.sleep_after(Answer({"Retry-After": "3600"})) == pytest.approx(13.0)


@pytest.mark.parametrize(("err", "want"), [
    (Answer({"Retry-After": "2.5"}), 2.5),
    (Answer({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}), 0.0),  # a date in the past: now
    (Answer({"Retry-After": "soon"}), None),
    (Answer({}), None),
    (ValueError("no answer"), None),
])
def test_retry_after_reads_seconds_or_a_date(err: BaseException, want: float | None) -> None:
    assert retry_after(err) == want


def test_retry_after_under_s3fs_reads_botocore_headers() -> None:
    class ClientError(Exception):
        response: dict[str, Any] = {"Error": {"Code": "SlowDown"},
                                    "ResponseMetadata": {"HTTPStatusCode": 503, "HTTPHeaders": {"retry-after": "4"}}}

    try:
        try:
            raise ClientError("SlowDown")
        except ClientError as inner:
            raise OSError(16, "Please reduce your request rate.") from inner
    except OSError as outer:
        assert retry_after(outer) == 4.0


def test_one_warning_per_outage_naming_the_budget_and_both_ways_to_set_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(retry, "_outages", {})
    clock, settings = Clock(), Settings.from_env({}, retry_budget_s=120)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        said = [retry.note_retry("store:9000", "HTTP 503", settings, clock)]
        for _ in range(50):  # retries of many requests, 1 s apart: the same outage
            clock.now += 1.0
            said.append(retry.note_retry("store:9000", "HTTP 503", settings, clock))
        said.append(retry.note_retry("other:80", "HTTP 503", settings, clock))  # another host, its own
        clock.now += retry.QUIET_S + 1  # quiet this long: the next is a new outage
        said.append(retry.note_retry("store:9000", "ConnectionResetError", settings, clock))
    assert said.count(True) == 3 and said[0] and said[-2] and said[-1]
    msg = caplog.records[0].getMessage()
    assert "store:9000" in msg and "HTTP 503" in msg and "retry_budget_s=120 s" in msg
    assert "Settings(retry_budget_s=...)" in msg and "FASTLOAD_RETRY_BUDGET_S" in msg
