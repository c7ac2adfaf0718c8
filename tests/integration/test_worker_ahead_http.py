"""DataLoader workers fetch later batches ahead, seen at a real HTTP server.

The server is the standard library's ThreadingHTTPServer (backlog 5, no Range),
as ``python -m http.server`` runs it. It holds its answer to the first file of
batch 0 until it has been asked for a file of a later batch of the same worker,
which torch sends that worker only after batch 0 reached the parent: only a
worker that fetches ahead can ask for it. The hold ends by itself after
HOLD_S, so without fetch-ahead the test fails rather than hangs.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastload
from fastload.config import Settings

pytestmark = pytest.mark.integration

HOLD_S = 20.0
FILES = 24
BATCH = 2  # batch k holds files 2k, 2k+1; with 2 workers, worker 0 reads batches 0, 2, 4, ...


class HoldingServer:
    """Serves ``root``; holds GETs of ``held`` until a GET of any of ``awaited`` arrives (or HOLD_S)."""

    def __init__(self, root: Path, held: set[str], awaited: set[str]) -> None:
        self.lock = threading.Lock()
        self.gets: list[str] = []
        self.released_by: str | None = None  # the awaited path that ended the hold, or the timeout
        self.release = threading.Event()
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with server.lock:
                    server.gets.append(self.path)
                    if self.path in awaited and not server.release.is_set():
                        server.released_by = self.path
                        server.release.set()
                if self.path in held and not server.release.wait(HOLD_S):
                    with server.lock:
                        server.released_by = "the hold timing out"
                        server.release.set()
                super().do_GET()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    out = {}
    for i in range(FILES):
        data = os.urandom(3_000 + i)
        (tmp_path / "www").mkdir(exist_ok=True)
        (tmp_path / "www" / f"f{i:02d}.bin").write_bytes(data)
        out[f"/f{i:02d}.bin"] = data
    return out


@pytest.fixture
def holding(tmp_path: Path) -> Iterator[Any]:
    started: list[HoldingServer] = []

    def start(held: set[str], awaited: set[str]) -> HoldingServer:
        server = HoldingServer(tmp_path / "www", held, awaited)
        server.thread.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.release.set()
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join(timeout=10)


def _urls(batch: list[dict[str, Any]]) -> list[str]:
    return [s["url"] for s in batch]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_worker_asks_for_its_later_batch_while_its_first_is_still_unanswered(
    tmp_path: Path, files: dict[str, bytes], holding: Any, shuffle: bool
) -> None:
    kw: dict[str, Any] = dict(batch_size=BATCH, shuffle=shuffle, seed=4, collate_fn=lambda b: b)
    order = [int(i) for b in fastload.DataLoader(range(FILES), **kw) for i in b]  # the sampler's, alone
    names = sorted(files)
    later = {names[i] for i in order[4 * BATCH : 5 * BATCH]}  # batch 4: worker 0's third
    server = holding(held={names[order[0]]}, awaited=later)
    urls = [server.url + path for path in names]  # a URL list: no listing
    settings = Settings(cache_dir=tmp_path / "cache", max_requests=4, retries=2, backoff_s=0.01)
    loader = fastload.DataLoader(fastload.FileDataset(urls, settings=settings), num_workers=2,
                                 persistent_workers=True, timeout=2 * HOLD_S, **kw)
    batches = list(loader)
    assert server.released_by in later  # asked for while batch 0 was held: fetched ahead, by worker 0
    assert [u for b in batches for u in _urls(b)] == [urls[i] for i in order]  # num_workers=0's order
    assert {s["url"][len(server.url):]: s["data"] for b in batches for s in b} == files
    assert sorted(server.gets) == names  # each file fetched once: the read took its fetch ahead

    # Warm epochs fetch nothing: with the same workers, and with new ones, whose copy of
    # the listing has no sizes (the workers learnt them) and finds the cached files by their pins.
    again = list(loader)
    fresh = list(fastload.DataLoader(loader.dataset, num_workers=2, timeout=HOLD_S, **kw))
    assert sorted(server.gets) == names
    assert sorted(u for b in again for u in _urls(b)) == urls == sorted(u for b in fresh for u in _urls(b))

    torch_loader = torch.utils.data.DataLoader(
        fastload.FileDataset(urls, settings=settings), batch_size=BATCH, shuffle=shuffle, num_workers=2,
        generator=torch.Generator().manual_seed(4), collate_fn=lambda b: b)
    assert [_urls(b) for b in torch_loader] == [_urls(b) for b in batches]
