"""A Source inherited by a forked DataLoader worker lets go of the parent's HTTP session without stalling."""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec.implementations.http as fsspec_http

from fastload._servers import NginxServer
from fastload.source import Source


def _child(source: Source, url: str, out: Any) -> None:
    inherited = source._fs._loop  # type: ignore[union-attr]  # the parent's fsspec loop, copied by fork
    waits: list[object] = []
    sync = fsspec_http.sync

    def counting_sync(loop: Any, *args: Any, **kwargs: Any) -> Any:
        if loop is inherited:  # a loop no thread of this process runs: sync waits out its timeout
            waits.append(loop)
        return sync(loop, *args, **kwargs)

    fsspec_http.sync = counting_sync
    try:
        data = source.fs.cat_file(url)  # reopened in the child; the inherited filesystem is dropped
        gc.collect()  # its finalizer (fsspec's close_session) runs here
        out.put((len(data), len(waits)))
    except BaseException as err:  # the parent's assertion shows it
        out.put(repr(err))


def test_forked_child_never_waits_on_the_parents_loop(
    tmp_path: Path, nginx_server: Callable[..., NginxServer]
) -> None:
    # Found by py-spy in DataLoader(num_workers=2) workers: close_session of the
    # inherited filesystem ran on fsspec's loop thread and waited 0.1 s there for the
    # parent's loop, each time, stalling the worker's requests (profile.md, round 4).
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    server = nginx_server(tmp_path)
    url = server.url + "/a.bin"
    source = Source(server.url + "/")
    assert len(source.fs.cat_file(url)) == 1000  # the parent's session exists, on its running loop
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(source, url, out))
    child.start()
    try:
        result = out.get(timeout=60)
    finally:
        child.join(timeout=60)
    assert result == (1000, 0), result
