"""Area 1: a flaky remote (HTTP faults through a proxy in front of nginx; S3 SlowDown)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import FAULTS
from helpers import make_files

import fastload
from fastload import _servers
from fastload.cache import Cache
from fastload.config import Settings
from fastload.errors import SourceError
from fastload.source import Source

pytestmark = pytest.mark.integration

SHORT, FULL = pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)
RATES = {"503": 0.1, "reset": 0.1, "truncate": 0.1, "stall": 0.1}


def trials_of(fault_id: str, variant: str) -> int:
    fault = FAULTS[fault_id]
    return fault.trials_full if variant == "full" else fault.trials_short


def flaky_settings(cache_dir: Path) -> Settings:
    # 40% of requests fail; 14 attempts leave 0.4**14 ~ 3e-6 per request to chance.
    return Settings(
        cache_dir=cache_dir, block_bytes=64 * 1024, max_requests=4, retries=14,
        backoff_s=0.01, backoff_max_s=0.2, request_timeout_s=0.5,
    )  # fmt: skip


def read_epoch(url: str, settings: Settings, files: dict[str, bytes], **ds_kwargs: Any) -> int:
    """One shuffled epoch through fastload.DataLoader; returns samples checked bit-exact."""
    ds = fastload.FileDataset(url, settings=settings, **ds_kwargs)
    assert len(ds) == len(files)
    loader = fastload.DataLoader(ds, batch_size=8, shuffle=True, collate_fn=lambda b: b, timeout=120)
    root = ds.reader.manifest_root(url) + "/"
    seen = Counter[str]()
    for batch in loader:
        for sample in batch:
            rel = sample["url"][len(root) :]
            assert sample["data"] == files[rel], f"wrong bytes for {sample['url']}"
            seen[rel] += 1
    assert set(seen) == set(files) and set(seen.values()) == {1}
    return sum(seen.values())


@pytest.mark.parametrize("variant", [SHORT, FULL])
def test_epoch_over_a_flaky_http_remote_is_bit_exact(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], fault_proxy: Callable[..., Any], record: Callable[..., None]
) -> None:
    trials = trials_of("flaky-http", variant)
    n = 60 if variant == "short" else 150
    files = make_files(tmp_path / "www", n, 24_000)
    # A few objects span several blocks, so ranged GETs are faulted too.
    big = make_files(tmp_path / "www" / "big", 3, 200_000, classes=1)
    files |= {f"big/{rel}": data for rel, data in big.items()}
    server = nginx_server(tmp_path / "www")
    injected = Counter[str]()
    checked = 0
    t0 = time.monotonic()
    for epoch in range(trials):
        # A stall outlasts any sane wait: only the per-request timeout gets past it.
        proxy = fault_proxy(server.url, RATES, seed=epoch, stall_s=60.0)
        settings = flaky_settings(tmp_path / f"cache{epoch}")
        checked += read_epoch(proxy.url + "/", settings, files)
        injected += proxy.counts()
        assert Cache(settings).corrupt_count() == 0  # broken bodies never reached the cache
        proxy.stop()
    for fault in RATES:
        assert injected[fault] > 0, f"the proxy never injected {fault!r}: {injected}"
    faulted = sum(v for k, v in injected.items() if k)
    record(
        "flaky-http", trials,
        f"pass: {checked} samples bit-exact; {faulted} of {sum(injected.values())} requests faulted "
        f"(503 {injected['503']}, reset {injected['reset']}, truncate {injected['truncate']}, "
        f"stall {injected['stall']}); {time.monotonic() - t0:.0f} s",
        injected=dict(injected), samples=checked,
    )  # fmt: skip


@pytest.mark.parametrize("variant", [SHORT, FULL])
def test_epoch_over_a_throttling_s3_is_bit_exact(
    variant: str, tmp_path: Path, moto_server: Any, s3_bucket: str, fault_proxy: Callable[..., Any], record: Callable[..., None]
) -> None:
    trials = trials_of("s3-slowdown", variant)
    files = make_files(tmp_path / "data", 16 if variant == "short" else 40, 16_000)
    _servers.upload_tree(tmp_path / "data", moto_server.endpoint_url, s3_bucket, "train")
    injected = Counter[str]()
    checked = 0
    for epoch in range(trials):
        proxy = fault_proxy(moto_server.endpoint_url, {"503": 0.2}, seed=100 + epoch, s3=True)
        options = _servers.s3_storage_options(proxy.url) | {"skip_instance_cache": True}
        settings = flaky_settings(tmp_path / f"cache{epoch}")
        checked += read_epoch(f"s3://{s3_bucket}/train/", settings, files, storage_options=options)
        injected += proxy.counts()
        proxy.stop()
    assert injected["503"] > 0
    record(
        "s3-slowdown", trials,
        f"pass: {checked} samples bit-exact; {injected['503']} of {sum(injected.values())} S3 requests "
        "answered 503 SlowDown",
        injected=dict(injected), samples=checked,
    )  # fmt: skip


def _exhaust(proxy: Any, url: str, env: dict[str, str], cache_dir: Path) -> tuple[SourceError, list[float], float]:
    # Configured from the environment, as a CLI user would.
    settings = Settings.from_env(env, cache_dir=cache_dir)
    src = Source(url, settings=settings)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as info:
        src.fetch(url)
    elapsed = time.monotonic() - t0
    path = "/" + url.split("/", 3)[-1]
    times = [r.at for r in proxy.requests_for(path) if r.method == "GET"]
    return info.value, times, elapsed


@pytest.mark.parametrize("variant", [SHORT, FULL])
def test_exhausted_retries_name_the_url_and_the_last_cause(
    variant: str, tmp_path: Path, nginx_server: Callable[..., Any], fault_proxy: Callable[..., Any], record: Callable[..., None]
) -> None:
    trials = trials_of("retries-exhausted", variant)
    make_files(tmp_path / "www", 8, 10_000, classes=1)
    server = nginx_server(tmp_path / "www")
    env = {"FASTLOAD_RETRIES": "5", "FASTLOAD_BACKOFF_S": "0.1", "FASTLOAD_BACKOFF_MAX_S": "0.25", "FASTLOAD_TIMEOUT_S": "0.5"}
    caps = [min(0.25, 0.1 * 2**k) for k in range(4)]
    gaps: list[float] = []
    for trial in range(trials):
        mode = "503" if trial % 2 == 0 else "stall"
        proxy = fault_proxy(server.url, {mode: 1.0}, stall_s=3.0)
        url = f"{proxy.url}/class_0/item_{trial % 8:05d}.bin"
        err, times, elapsed = _exhaust(proxy, url, env, tmp_path / "cache")
        msg = str(err)
        assert msg.startswith(url) and "failed after 5 attempts" in msg and "fix:" in msg, msg
        if mode == "503":
            assert "ClientResponseError: 503" in msg, msg
        else:
            assert "no answer within request_timeout_s=0.5 s" in msg or "Timeout" in msg, msg
        assert len(times) == 5, f"{len(times)} requests for {url}, expected exactly FASTLOAD_RETRIES=5"
        timeout = 0.5 if mode == "stall" else 0.0
        trial_gaps = [b - a - timeout for a, b in zip(times, times[1:])]
        for gap, cap in zip(trial_gaps, caps):
            assert -0.05 <= gap <= cap + 0.15, (trial_gaps, caps)  # capped exponential backoff
        assert elapsed <= 5 * (timeout + 0.2) + sum(caps) + 1.0  # per-request timeouts hold
        gaps += [g / c for g, c in zip(trial_gaps, caps)]
        proxy.stop()
    # Full jitter: delays are spread over [0, cap], not fixed at the cap.
    assert min(gaps) < 0.8, gaps
    record(
        "retries-exhausted", trials,
        f"pass: every URL got exactly 5 requests, then SourceError naming the URL and the last cause; "
        f"retry gaps {min(gaps):.2f}-{max(gaps):.2f} of their cap (jittered)",
        gap_fractions=[round(g, 3) for g in gaps],
    )  # fmt: skip
