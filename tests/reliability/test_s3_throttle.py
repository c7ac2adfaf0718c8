"""S3 throttling reaches the host limit: real moto S3 behind a proxy answering S3's own 503 SlowDown.

botocore and s3fs retried SlowDown inside the request (sleeping in its slot), so a
20% SlowDown rate never reached fastload's host limit: it never cut. Now a request
makes one attempt, fastload retries it with backoff outside the slot, and the
limit halves on the error's code (botocore's ``Error.Code``, not message text).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import make_files

import fastload
from fastload import _servers
from fastload.config import Settings
from fastload.source import Source
from fastload.transport import hostlimit

pytestmark = pytest.mark.integration


def _settings(cache_dir: Path, **kwargs: Any) -> Settings:
    return Settings(cache_dir=cache_dir, block_bytes=64 * 1024, request_timeout_s=10, **kwargs)


def test_slowdown_halves_the_limit_and_the_read_succeeds_after_retry(
    tmp_path: Path, moto_server: Any, s3_bucket: str, fault_proxy: Callable[..., Any]
) -> None:
    files = make_files(tmp_path / "data", 1, 20_000)
    _servers.upload_tree(tmp_path / "data", moto_server.endpoint_url, s3_bucket, "train")
    (rel, data), = files.items()
    proxy = fault_proxy(moto_server.endpoint_url, {"503": 1.0}, s3=True, match="/train/")  # every GET: SlowDown
    options = _servers.s3_storage_options(proxy.url) | {"skip_instance_cache": True}
    src = Source(f"s3://{s3_bucket}/train/", options, _settings(tmp_path / "cache", retries=30, backoff_s=0.2, backoff_max_s=0.4))
    limit = src.host_limit
    assert limit is not None and limit.limit == hostlimit.START
    got: list[Any] = []
    # A block's ranged GET, as the fetch layer sends (a HEAD's 503 has no body, so no code: "HTTP 503").
    reader = threading.Thread(target=lambda: got.append(src.fetch(f"s3://{s3_bucket}/train/{rel}", 0, len(data))), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while limit.cuts == 0:
        assert reader.is_alive() and time.monotonic() < deadline, f"no cut: {limit.as_dict()}, proxy saw {proxy.counts()}"
        time.sleep(0.01)
    with limit._lock:  # each SlowDown of a request on its own halves the limit
        assert limit.limit == max(1.0, hostlimit.START / 2**limit.cuts) and limit.last_cut == "SlowDown", limit.as_dict()
    proxy.set_rates({})
    reader.join(timeout=30)
    assert got == [data]  # retried after backoff, by fastload
    answered = [r for r in proxy.requests_for(f"/train/{rel}") if r.method == "GET"]
    assert [r.fault for r in answered][-1] == "" and len(answered) == limit.cuts + 1  # one attempt per request


def test_an_epoch_over_a_throttling_s3_cuts_the_limit_and_is_bit_exact(
    tmp_path: Path, moto_server: Any, s3_bucket: str, fault_proxy: Callable[..., Any]
) -> None:
    files = make_files(tmp_path / "data", 32, 8_000)
    _servers.upload_tree(tmp_path / "data", moto_server.endpoint_url, s3_bucket, "train")
    proxy = fault_proxy(moto_server.endpoint_url, {"503": 0.25}, s3=True, seed=7, match="/train/")
    options = _servers.s3_storage_options(proxy.url) | {"skip_instance_cache": True}
    settings = _settings(tmp_path / "cache", max_requests=8, retries=14, backoff_s=0.01, backoff_max_s=0.1)
    ds = fastload.FileDataset(f"s3://{s3_bucket}/train/", settings=settings, storage_options=options)
    loader = fastload.DataLoader(ds, batch_size=8, collate_fn=lambda b: b)
    root = ds.reader.manifest_root(f"s3://{s3_bucket}/train/") + "/"
    seen = {s["url"][len(root):]: s["data"] for batch in loader for s in batch}
    assert seen == files
    assert proxy.counts()["503"] > 0
    state = loader.stats().concurrency[proxy.url]
    # S3 first blocks signed on libcurl report the status (the engine keeps no error body): "HTTP 503".
    assert state["cuts"] >= 1 and state["last_cut"] in ("SlowDown", "HTTP 503"), state
