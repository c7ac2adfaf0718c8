"""fastload.transport.hostlimit: the slot accounting, with real threads and a real event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

import fastload.errors
from fastload.transport import failures, hostlimit
from fastload.transport.failures import congestion
from fastload.transport.hostlimit import HostLimit


def test_threads_and_coroutines_share_one_cap() -> None:
    limit = HostLimit("http://h", cap=3)
    lock = threading.Lock()
    now, peak, done = [0], [0], []

    def enter() -> None:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])

    def leave() -> None:
        with lock:
            now[0] -= 1
            done.append(1)

    def thread_request() -> None:
        with limit.slot():
            enter()
            time.sleep(0.01)
            leave()

    async def coro_request() -> None:
        async with limit.aslot():
            enter()
            await asyncio.sleep(0.01)
            leave()

    async def coros() -> None:
        await asyncio.gather(*(coro_request() for _ in range(12)))

    threads = [threading.Thread(target=thread_request) for _ in range(12)]
    threads.append(threading.Thread(target=asyncio.run, args=(coros(),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(done) == 24 and peak[0] == 3 and limit.in_flight == 0


def test_a_cancelled_waiter_gives_its_slot_back() -> None:
    limit = HostLimit("http://h", cap=1)

    async def main() -> bool:
        async with limit.aslot():
            waiter = asyncio.ensure_future(limit.aslot().__aenter__())
            await asyncio.sleep(0)
            waiter.cancel()
        await asyncio.sleep(0.01)  # the slot handed to the cancelled waiter comes back
        async with limit.aslot():
            return limit.in_flight == 1

    assert asyncio.run(asyncio.wait_for(main(), 5))
    assert limit.in_flight == 0


def test_busy_answers_halve_the_limit_once_per_window_and_closing_hosts_stay_small() -> None:
    limit = HostLimit("http://h", cap=64)
    limit.limit = 16.0
    slots = [limit.slot() for _ in range(3)]
    for slot in slots:
        slot.__enter__()
    err = OSError("503 Service Unavailable")
    for slot in slots:  # three 503s of requests that were in flight together: one cut
        assert slot.__exit__(OSError, err, None) is False
    assert (limit.limit, limit.cuts, limit.last_cut) == (8.0, 1, "OSError")
    limit.closes_connections()
    assert limit.limit == hostlimit.CLOSING_MAX
    limit._step(10)
    assert limit.limit == hostlimit.CLOSING_MAX


@pytest.mark.parametrize(
    ("err", "congested"),
    [
        (OSError("An error occurred (SlowDown) when calling the GetObject operation"), True),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (TimeoutError(), True),
        (FileNotFoundError("http://h/x"), False),
        (ValueError("bad range"), False),
    ],
)
def test_what_counts_as_congestion(err: BaseException, congested: bool) -> None:
    assert bool(congestion(err)) is congested


def test_http_status_on_the_error_or_beneath_it() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    info = aiohttp.RequestInfo(url=__import__("yarl").URL("http://h/x"), method="GET", headers={}, real_url=__import__("yarl").URL("http://h/x"))
    for status, congested in ((429, True), (503, True), (404, False), (500, False)):
        err = aiohttp.ClientResponseError(info, (), status=status)
        wrapped = FileNotFoundError("http://h/x")
        wrapped.__cause__ = err
        assert bool(congestion(err)) is congested and bool(congestion(wrapped)) is congested


def test_s3_throttling_is_read_from_botocores_error_code_not_its_text() -> None:
    # s3fs turns S3's SlowDown into OSError(EBUSY, "Please reduce your request rate."),
    # raised from botocore's ClientError: the code there decides, whatever the texts say.
    botocore = pytest.importorskip("botocore.exceptions")
    s3fs_errors = pytest.importorskip("s3fs.errors")

    def client_error(code: str, status: int, message: str) -> BaseException:
        response = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return botocore.ClientError(response, "GetObject")  # type: ignore[arg-type]

    slow = s3fs_errors.translate_boto_error(client_error("SlowDown", 503, "Please reduce your request rate."))
    assert isinstance(slow, OSError) and "SlowDown" not in str(slow)
    assert congestion(slow) == "SlowDown"
    # A code no text pattern knows, and a 503 under another code.
    assert congestion(client_error("RequestLimitExceeded", 400, "Request limit exceeded.")) == "RequestLimitExceeded"
    assert congestion(client_error("InternalError", 503, "We encountered an internal error.")) == "HTTP 503"
    assert congestion(s3fs_errors.translate_boto_error(client_error("NoSuchKey", 404, "The key does not exist."))) == ""
    # EBUSY alone is no throttle: s3fs gives it to OperationAborted too.
    assert congestion(s3fs_errors.translate_boto_error(client_error("OperationAborted", 409, "A conflicting operation."))) == ""


def test_a_wait_for_a_slot_that_never_comes_raises_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostlimit, "SLOT_WAIT_S", 0.05)
    limit = HostLimit("http://h", cap=1)
    with limit.slot():  # held, and never given back while the others wait
        with pytest.raises(fastload.errors.SourceError, match=r"http://h: no request slot came free .*fix:"):
            with limit.slot():
                pass

        async def wait() -> None:
            async with limit.aslot():
                pass

        with pytest.raises(fastload.errors.SourceError, match="no request slot"):
            asyncio.run(wait())
    assert limit.in_flight == 0 and not limit._waiters
    with limit.slot():  # the waiters that gave up left nothing behind
        assert limit.in_flight == 1


def test_a_stop_ends_a_threads_wait_for_a_slot_and_leaves_nothing_behind() -> None:
    # Staging's Ctrl-C (Reader.stop): a thread queued for a slot of a host whose requests
    # hang must not wait SLOT_WAIT_S (900 s) for it.
    limit, stop = HostLimit("http://h", cap=1), threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            with limit.slot(stop):
                errors.append(AssertionError("got a slot that was never free"))
        except BaseException as err:
            errors.append(err)

    with limit.slot():  # held throughout, as by a request the server never answers
        thread = threading.Thread(target=waiter, daemon=True)  # without a stop it would wait 900 s
        thread.start()
        deadline = time.monotonic() + 30
        while not limit._waiters and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert limit._waiters, errors  # queued behind the held slot
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], fastload.errors.StoppedError), errors
        assert limit.in_flight == 1 and not limit._waiters
    assert limit.in_flight == 0


def test_a_stopped_source_starts_no_request(tmp_path: Path) -> None:
    from fastload.source import Source

    (tmp_path / "a.bin").write_bytes(b"abc")
    stop = threading.Event()
    src = Source(str(tmp_path), stop=stop)
    assert src.fetch(str(tmp_path / "a.bin")) == b"abc"
    calls: list[int] = []
    stop.set()
    with pytest.raises(fastload.errors.StoppedError):
        src._call(lambda: calls.append(1), str(tmp_path / "a.bin"))
    assert calls == []


def _rounds(monkeypatch: pytest.MonkeyPatch, latencies: list[float], requests: int = 200) -> list[int]:
    """Run ``requests`` coroutines through a fresh limit, answering all those in flight once per
    round after that round's latency (a fake clock); the limit after each round."""
    clock = [1000.0]
    monkeypatch.setattr(hostlimit, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    limit = HostLimit("http://h", cap=64)
    gates: list[asyncio.Future[None]] = []

    async def request() -> None:
        async with limit.aslot() as outcome:
            outcome.nbytes = 100_000
            gate = asyncio.get_running_loop().create_future()
            gates.append(gate)
            await gate

    async def main() -> list[int]:
        tasks = [asyncio.ensure_future(request()) for _ in range(requests)]
        for _ in range(5):
            await asyncio.sleep(0)
        seen = []
        for latency in latencies:
            clock[0] += latency
            answered, gates[:] = list(gates), []
            for gate in answered:
                gate.set_result(None)
            for _ in range(10):  # the answers release their slots; the waiters handed one start
                await asyncio.sleep(0)
            seen.append(int(limit.limit))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return seen

    return asyncio.run(main())


def test_slow_start_doubles_the_limit_each_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 ms to first byte: a limit doubled once per window (>= 50 ms) needed ~3 round trips a step.
    assert _rounds(monkeypatch, [0.02] * 5) == [8, 16, 32, 64, 64]


def test_slow_start_grows_only_on_answers_that_did_not_queue_and_only_under_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _rounds(monkeypatch, [0.02, 0.05, 0.05]) == [8, 8, 8]  # answers now take 2.5x the fastest: queueing
    assert _rounds(monkeypatch, [0.02, 0.02], requests=3) == [4, 4]  # nobody waits: nothing to grow for


def test_a_status_in_a_url_is_not_a_congestion_signal() -> None:
    # A 404 from a server on port 42951 read as "429" (the text fallback matched the URL): the
    # missing object was retried as throttling and reported as "failed after 2 attempts".
    class ClientResponseError(Exception):
        pass

    assert failures.congestion(ClientResponseError("404, message='Not Found', url='http://127.0.0.1:42951/503.bin'")) == ""
    assert failures.congestion(ClientResponseError("503, message='Service Unavailable', url='http://h/x'")) == "ClientResponseError"
    assert failures.congestion(OSError("Please reduce your request rate. (SlowDown)")) == "OSError"
