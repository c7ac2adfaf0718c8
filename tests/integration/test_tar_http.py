"""TarDataset over a real nginx: a brace pattern through fastload.DataLoader, shuffled, cold then warm."""

from __future__ import annotations

import io
import random
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

import fastload
from fastload import _servers
from fastload.config import Settings

pytestmark = pytest.mark.integration


def test_a_brace_pattern_over_http_reads_every_sample_once_cold_and_warm(
        tmp_path: Path, nginx_server: Callable[..., _servers.NginxServer]) -> None:
    (tmp_path / "www").mkdir()
    rng = random.Random(0)
    want: dict[str, bytes] = {}
    for s in range(3):
        with tarfile.open(tmp_path / "www" / f"shard-{s:06d}.tar", "w") as tar:
            for k in range(40):
                key = f"{s}-{k:03d}"
                for ext, data in (("jpg", rng.randbytes(3000)), ("cls", str(k).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                    if ext == "jpg":
                        want[key] = data
    server = nginx_server(tmp_path / "www")
    settings = Settings(cache_dir=tmp_path / "cache", block_bytes=16384)  # shards of many blocks
    url = server.url + "/shard-{000000..000002}.tar"
    for _ in ("cold", "warm"):
        ds = fastload.TarDataset(url, settings=settings, kept_bytes=4 * 16384)  # fewer blocks than the shards
        seen: dict[str, bytes] = {}
        for batch in fastload.DataLoader(ds, batch_size=16, shuffle=True):
            for key, jpg in zip(batch["__key__"], batch["jpg"]):
                assert key not in seen
                seen[key] = jpg
        assert seen == want
        assert ds.kept.stats()["bytes"] <= 4 * 16384
