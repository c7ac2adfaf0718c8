"""Area 11: secrets stay out of every output; the cache dir is private; remote bytes stay data."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import stat
import tarfile
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faults import FAULTS
from helpers import ROOT, make_files

import fastload
from fastload import _servers
from fastload.cache import Cache, migrate
from fastload.cli import main as cli_main
from fastload.config import Settings
from fastload.errors import DecodeError, FastloadError

pytestmark = pytest.mark.integration


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def _failure_text(fn: Callable[[], Any]) -> str:
    """The message and the whole chained traceback of what ``fn`` raises."""
    try:
        fn()
    except FastloadError as err:
        return "".join(traceback.format_exception(err))
    raise AssertionError("expected a FastloadError")


def test_secrets_never_reach_the_cache_logs_stats_or_errors(
    tmp_path: Path, moto_server: Any, s3_bucket: str, nginx_server: Callable[..., Any], fault_proxy: Callable[..., Any],
    record: Callable[..., None], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    secret = f"fl-secret-{uuid.uuid4().hex}"
    files = make_files(tmp_path / "data", 12, 5000)
    _servers.upload_tree(tmp_path / "data", moto_server.endpoint_url, s3_bucket, "train")
    server = nginx_server(tmp_path / "data")
    s3 = _servers.s3_storage_options(moto_server.endpoint_url) | {"secret": secret, "token": secret + "-session"}
    http = {"client_kwargs": {"headers": {"Authorization": f"Bearer {secret}"}}}
    cache_dir = tmp_path / "cache"
    settings = Settings(cache_dir=cache_dir, retries=2, backoff_s=0.01, request_timeout_s=2)
    outputs: dict[str, str] = {}
    caplog.set_level(logging.DEBUG, logger="fastload")
    # Staging from the CLI (the secret on its command line), then training from S3 and HTTP.
    assert cli_main(["cache", f"s3://{s3_bucket}/train/", "--cache-dir", str(cache_dir), "--json",
                     "--storage-options", json.dumps(s3)]) == 0  # fmt: skip
    for url, options in ((f"s3://{s3_bucket}/train/", s3), (server.url + "/", http)):
        ds = fastload.FileDataset(url, storage_options=options, settings=settings)
        loader = fastload.DataLoader(ds, batch_size=4, collate_fn=as_list)
        assert sorted(s["data"] for b in loader for s in b) == sorted(files.values())
        outputs[f"stats {url}"] = repr(loader.stats()) + str(loader.stats())
    assert cli_main(["info", "--json", "--cache-dir", str(cache_dir)]) == 0
    # Failing calls: a missing bucket, and retries run out behind a proxy answering 503.
    proxy = fault_proxy(moto_server.endpoint_url, {"503": 1.0}, s3=True)
    throttled = s3 | {"client_kwargs": {"endpoint_url": proxy.url, "region_name": "us-east-1"},
                      "config_kwargs": {"retries": {"max_attempts": 1}}}  # fmt: skip
    outputs["error: missing bucket"] = _failure_text(
        lambda: fastload.stage(f"s3://{s3_bucket}-missing/", storage_options=s3, settings=settings, progress=False)
    )
    outputs["error: retries exhausted"] = _failure_text(
        lambda: fastload.stage(f"s3://{s3_bucket}/other/", storage_options=throttled, settings=settings, progress=False)
    )
    http_down = fault_proxy(server.url, {"503": 1.0})
    outputs["error: http 503"] = _failure_text(
        lambda: fastload.FileDataset(http_down.url + "/", storage_options=http, settings=settings)
    )
    assert cli_main(["cache", f"s3://{s3_bucket}-missing/", "--cache-dir", str(cache_dir),
                     "--storage-options", json.dumps(s3)]) == 1  # fmt: skip
    captured = capsys.readouterr()
    outputs["cli stdout+stderr"] = captured.out + captured.err
    outputs["fastload logs"] = "\n".join(r.getMessage() for r in caplog.records)
    cache_bytes = b"".join(p.read_bytes() for p in cache_dir.rglob("*") if p.is_file())
    needles = (secret, secret + "-session")
    for name, text in outputs.items():
        assert not any(n in text for n in needles), f"secret found in {name}"
    assert not any(n.encode() in cache_bytes for n in needles), "secret found in the cache dir"
    assert "503" in outputs["error: retries exhausted"] + outputs["error: http 503"]  # the errors did say why
    targets = ["cache dir files", "fastload logs (DEBUG)", "stats and `fastload info`", "error messages and tracebacks", "CLI output"]
    assert len(targets) == FAULTS["secrets"].trials_short
    record(
        "secrets", len(targets),
        f"pass: a unique secret (S3 secret and session token, HTTP Authorization header) found in none of: "
        f"{', '.join(targets)} ({len(cache_bytes)} cache bytes, {sum(map(len, outputs.values()))} characters of output)",
    )  # fmt: skip


def test_cache_dir_is_private(tmp_path: Path, record: Callable[..., None]) -> None:
    old = os.umask(0)
    checked = []
    try:
        for umask in (0o000, 0o022):
            os.umask(umask)
            cache = Cache(Settings(cache_dir=tmp_path / f"umask{umask:03o}" / "cache"))
            cache.put("a" * 40, b"x" * 1000, url="memory://x")
            assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700, oct(cache.root.stat().st_mode)
            for sub in (cache.data_dir, cache.tmp_dir, *cache.data_dir.iterdir()):
                assert stat.S_IMODE(sub.stat().st_mode) & 0o077 == 0, (sub, oct(sub.stat().st_mode))
            cache.close()
            checked.append(f"umask {umask:03o}")
        existing = tmp_path / "existing"
        existing.mkdir(mode=0o755)
        os.chmod(existing, 0o755)
        Cache(Settings(cache_dir=existing)).close()
        assert stat.S_IMODE(existing.stat().st_mode) == 0o700
        checked.append("pre-existing 0755 dir")
    finally:
        os.umask(old)
    assert len(checked) == FAULTS["cache-dir-mode"].trials_short
    record("cache-dir-mode", len(checked), f"pass: cache dir 0700 (data/, tmp/ and block folders no group/other bits) for {', '.join(checked)}")


class _Evil:
    """Unpickling this creates the marker file: the proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_remote_bytes_are_never_unpickled(tmp_path: Path, record: Callable[..., None]) -> None:
    marker = tmp_path / "UNPICKLED"
    evil = pickle.dumps(_Evil(marker))
    settings = Settings(cache_dir=tmp_path / "cache")
    # 1. A plain file of pickle bytes comes back as those bytes.
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "evil.pkl").write_bytes(evil)
    ds = fastload.FileDataset(str(tmp_path / "files"), settings=settings)
    assert ds[0]["data"] == evil
    # 2. An object-dtype .npy (numpy pickles its elements) is refused.
    arr = np.empty(1, dtype=object)
    arr[0] = _Evil(marker)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    (tmp_path / "arrays").mkdir()
    (tmp_path / "arrays" / "evil.npy").write_bytes(buf.getvalue())
    with pytest.raises(DecodeError, match="never unpickles"):
        fastload.ArrayDataset(str(tmp_path / "arrays"), settings=settings)[0]
    with pytest.raises(DecodeError, match="never unpickles"):
        fastload.ArrayDataset(str(tmp_path / "arrays" / "evil.npy"), settings=settings)
    # 3. A tar member of pickle bytes is bytes too.
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "s.tar", "w") as tar:
        info = tarfile.TarInfo("sample.pkl")
        info.size = len(evil)
        tar.addfile(info, io.BytesIO(evil))
    assert fastload.TarDataset(str(tmp_path / "shards"), settings=settings)[0]["pkl"] == evil
    assert not marker.exists()
    # And no code path that could: no unpickling call anywhere in the package.
    pattern = re.compile(r"pickle\.loads?\(|Unpickler|torch\.load\(|allow_pickle\s*=\s*True|np\.load\(|numpy\.load\(|marshal\.loads?\(")
    # One unpickler is allowed: the old index's migration reads values diskcache pickled, through
    # a subclass that refuses every global; the planted pickle is refused by it, running nothing.
    restricted = ("fastload/cache/migrate.py", "class _Plain(pickle.Unpickler):")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in (ROOT / "fastload").rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line.split("#", 1)[0]) and (str(p.relative_to(ROOT)), line.strip()) != restricted
    ]
    assert not offenders, offenders
    with pytest.raises(pickle.UnpicklingError, match="not a plain value"):
        migrate._Plain(io.BytesIO(evil)).load()
    assert not marker.exists()
    record(
        "no-unpickle", 3,
        "pass: a marker-creating pickle served as a .pkl file, an object .npy and a tar member: bytes stay bytes, "
        "the .npy is a DecodeError ('never unpickles'), the marker never appears; no unpickling call in fastload/",
    )  # fmt: skip
