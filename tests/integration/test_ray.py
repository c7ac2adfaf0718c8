"""Ray Data reads an HTTP folder through fastload's cache: the second pass sends nginx nothing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.config import Settings

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.integration


@pytest.fixture
def ray_local() -> Iterator[Any]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _requests(server: Any) -> list[str]:
    log = server.workdir / "access.log"
    return log.read_text().splitlines() if log.exists() else []


def test_ray_data_reads_an_http_folder_twice_and_the_second_pass_sends_nothing(
    tmp_path: Path, nginx_server: Callable[..., Any], ray_local: Any
) -> None:
    www = tmp_path / "www" / "shards"
    www.mkdir(parents=True)
    files = {f"{i:02d}.bin": os.urandom(3000 + i) for i in range(12)}
    for name, data in files.items():
        (www / name).write_bytes(data)
    server = nginx_server(tmp_path / "www")
    fs = fastload.arrow_filesystem(settings=Settings(cache_dir=tmp_path / "cache"))
    url = f"{server.url}/shards/"

    def read() -> dict[str, bytes]:
        rows = ray.data.read_binary_files(url, filesystem=fs, include_paths=True).take_all()
        return {row["path"].rsplit("/", 1)[-1]: row["bytes"] for row in rows}

    assert read() == files
    first = len(_requests(server))
    assert first > 0
    assert read() == files
    assert _requests(server)[first:] == []  # listing and files came from the cache
