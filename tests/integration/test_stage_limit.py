"""--cache-limit is checked before the download, with requests counted in the server's own log.

`fastload cache URL --cache-limit 1MB` on a 10 MB HTTP folder sent 800 GETs, then said the
dataset did not fit (issue 24, item 8).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastload import _servers
from fastload.cli import build_parser, main
from fastload.config import Settings
from fastload.stage import CHUNK
from fastload.transport import curl

pytestmark = pytest.mark.integration

N, SIZE = 800, 12_500  # 10 MB, as in the issue


def _requests(server: _servers.NginxServer, method: str) -> int:
    assert server.workdir is not None
    log = (server.workdir / "access.log").read_text()
    return sum(1 for line in log.splitlines() if f'"{method} ' in line and ".bin HTTP" in line)


def _folder(tmp_path: Path, nginx_server: Callable[..., Any], locations: str = "") -> _servers.NginxServer:
    www = tmp_path / "www"
    for i in range(N):
        (www / f"c{i % 4}").mkdir(parents=True, exist_ok=True)
        (www / f"c{i % 4}" / f"{i:04d}.bin").write_bytes(os.urandom(SIZE))
    return nginx_server(www, locations=locations)


@pytest.fixture()
def http_folder(tmp_path: Path, nginx_server: Callable[..., Any]) -> _servers.NginxServer:
    """nginx's folder pages with autoindex_exact_size off: they show "12K", so the listing has no sizes."""
    return _folder(tmp_path, nginx_server, "location ~ /$ { autoindex on; autoindex_exact_size off; }")


@pytest.fixture()
def sized_folder(tmp_path: Path, nginx_server: Callable[..., Any]) -> _servers.NginxServer:
    """nginx as configured by default: its folder pages show each file's exact size."""
    return _folder(tmp_path, nginx_server)


def test_a_sizeless_listing_stops_once_the_sizes_learned_pass_the_limit(
    http_folder: _servers.NginxServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["cache", http_folder.url + "/", "--cache-limit", "1MB", "--cache-dir", str(tmp_path / "c"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "is at least" in err and "objects; staging stopped before fetching the rest" in err, err
    assert "the cache limit is 1 MB" in err and "fix:" in err, err
    gets = _requests(http_folder, "GET")
    # A staging task learns its chunk's sizes with a GET per object, then adds them up: the
    # chunks that fit the limit, then at most one chunk per task in flight when it is passed.
    fit = -(-(10**6) // (CHUNK * SIZE))
    assert gets <= (fit + Settings.stage_threads) * CHUNK < N, gets
    assert _requests(http_folder, "HEAD") == 0


def test_exact_sizes_on_the_index_pages_refuse_before_any_request(
    sized_folder: _servers.NginxServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for args in (["--dry-run"], []):
        code = main(["cache", sized_folder.url + "/", "--cache-limit", "1MB", "--cache-dir", str(tmp_path / "c"),
                     "--no-progress", *args])
        out, err = capsys.readouterr()
        assert code == 1 and ("does NOT fit" in out if args else f"is {N * SIZE // 10**6} MB but the cache limit is 1 MB" in err)
    assert (_requests(sized_folder, "HEAD"), _requests(sized_folder, "GET")) == (0, 0)


def test_dry_run_over_http_costs_a_head_per_object_as_its_help_says(
    http_folder: _servers.NginxServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = next(a for a in build_parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
                 if a.prog.endswith(" cache"))
    assert "a HEAD per object" in " ".join(cache.format_help().split())
    code = main(["cache", http_folder.url + "/", "--dry-run", "--cache-limit", "1MB", "--cache-dir",
                 str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert code == 1 and "does NOT fit" in out, out
    assert (_requests(http_folder, "HEAD"), _requests(http_folder, "GET")) == (N, 0)


def test_listed_sizes_refuse_before_any_get(
    tmp_path: Path, signed_moto: _servers.SignedMotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # An S3 listing carries sizes: the limit refuses before the first GET of an object.
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    s3 = signed_moto.client("s3")
    for i in range(40):
        s3.put_object(Bucket="signed", Key=f"limit/{i:03d}.bin", Body=os.urandom(50_000))
    import json

    options = {"key": signed_moto.key, "secret": signed_moto.secret,
               "client_kwargs": {"endpoint_url": signed_moto.endpoint_url, "region_name": "us-east-1"}}
    gets = signed_moto.requests("GET", "/signed/limit/0")
    code = main(["cache", "s3://signed/limit/", "--cache-limit", "1MB", "--storage-options", json.dumps(options),
                 "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "dataset s3://signed/limit is 2 MB but the cache limit is 1 MB" in err, err
    assert signed_moto.requests("GET", "/signed/limit/0") == gets


def test_a_sizeless_folder_over_a_small_limit_stops_within_a_few_objects_of_it(
    tmp_path: Path, nginx_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    # The case: 120 files of 100 KB (12 MB) behind sizeless folder pages, --cache-limit 1MB:
    # whole chunks of 32 per staging task sent 130 GETs. Parts admitted by the room left at the
    # mean size learned (fastload.stage._Progress.admitted) stop about ten objects past it.
    www = tmp_path / "www"
    www.mkdir()
    for i in range(120):
        (www / f"{i:03d}.bin").write_bytes(os.urandom(100_000))
    server = nginx_server(www, locations="location ~ /$ { autoindex on; autoindex_exact_size off; }")
    code = main(["cache", server.url + "/", "--cache-limit", "1MB", "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "staging stopped before fetching the rest" in err, err
    assert 10 <= _requests(server, "GET") <= 20, _requests(server, "GET")


def test_a_sizeless_folder_within_the_limit_is_staged_whole_under_admission(
    http_folder: _servers.NginxServer, tmp_path: Path
) -> None:
    # Admission only holds items back near the limit: a folder that fits is staged whole, one GET each.
    code = main(["cache", http_folder.url + "/", "--cache-limit", "50MB", "--cache-dir", str(tmp_path / "c"),
                 "--no-progress"])
    assert code == 0
    assert _requests(http_folder, "GET") == N and _requests(http_folder, "HEAD") == 0


def test_completions_of_a_sizeless_folder_far_within_the_limit_go_out_together(
    http_folder: _servers.NginxServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before any size is known, a part holds as many items as the limit holds blocks (completing
    # one fetches one block at most). One item a part put each chunk's first completion through
    # Source.fetch_first alone (aiohttp, imported for it: 0.5 s), not the batch road: staging
    # 200 files from python -m http.server took 1.69 s instead of 0.46.
    from fastload.source.core import Source

    lone: list[str] = []
    real = Source.fetch_first

    def fetch_first(self: Source, item: Any, nbytes: int) -> Any:
        lone.append(item.url)
        return real(self, item, nbytes)

    monkeypatch.setattr(Source, "fetch_first", fetch_first)
    code = main(["cache", http_folder.url + "/", "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    assert code == 0
    assert _requests(http_folder, "GET") == N
    assert lone == []
