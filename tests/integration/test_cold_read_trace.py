"""The objects a cold read crosses: a new one on the path fails here until the trace is written down.

One sizeless HTTP item (nginx's folder listing has no sizes) read through
FileDataset + DataLoader(num_workers=0), the cache cold. At each hand-over of
the read (the GET handed to libcurl's engine, its slot leased and its outcome counted, its answer taken,
its bytes written to a pack and published in the index, the batch collated) the
test takes the classes of ``self`` on the Python stack, the object handed to
included. Their union is the path; docs/architecture.md ("The cold read, object
by object") lists it with each object's file and thread, and this test reads
that table: an object that joins (or leaves) the path fails it until the table
says so, and the path stays within ISSUE_BOUND objects (issue 25).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cache import Cache, packs
from fastload.config import Settings
from fastload.samples import make_image_folder
from fastload.transport import curl, hostlimit

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
ISSUE_BOUND = 14  # issue 25: "a cold read of a sizeless HTTP item crosses at most about 14 objects"
OWN = ("fastload.", "torch.")  # the objects of the path; pytest's and the standard library's frames are not


def _role(name: str) -> str:
    """A thread's role in the trace: the consumer (the training loop's thread), a read thread, the pump."""
    if name == threading.main_thread().name:
        return "consumer"
    return {"fastload-read": "read", "fastload-curl-pump": "pump"}.get(re.sub(r"-\d+(_\d+)?$", "", name), name)


def _documented() -> dict[str, set[str]]:
    """The trace table of docs/architecture.md: class -> the thread roles it runs in."""
    text = DOC.read_text()
    section = text[text.index("### The cold read, object by object"):]
    section = section[: section.index("\n#", 1)] if "\n#" in section[1:] else section
    rows = re.findall(r"^\| `([\w.\[\]]+)` \| `[^`]+` \| ([a-z, ]+) \|", section, re.M)
    return {cls: {r.strip() for r in roles.split(",")} for cls, roles in rows}


def test_a_cold_read_crosses_the_documented_objects_and_no_more(
    tmp_path: Path, nginx_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_image_folder(tmp_path / "www" / "train", n=1)
    server = nginx_server(tmp_path / "www")
    ds = fastload.FileDataset(server.url + "/train/", pattern="**/*.jpg", settings=Settings(cache_dir=tmp_path / "cache"))
    assert [item.size for item in ds.items] == [-1]  # sizeless: completed by its first GET
    path: dict[str, set[str]] = {}

    def take(handed: object) -> None:
        role = _role(threading.current_thread().name)
        frame = sys._getframe(2)
        owners = [handed]
        while frame is not None:
            owners.append(frame.f_locals.get("self"))
            frame = frame.f_back
        for owner in owners:
            kind = type(owner)
            if owner is not None and kind.__module__.startswith(OWN):
                path.setdefault(f"{kind.__module__}.{kind.__qualname__}", set()).add(role)

    def hook(owner: type, name: str) -> None:
        real = getattr(owner, name)

        def taken(self: object, *args: Any, **kwargs: Any) -> Any:
            take(self)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(owner, name, taken)

    hook(curl.CurlRoute, "_submit")  # the GET handed to libcurl's engine
    hook(hostlimit.HostLimit, "lease")  # its slot, where its host holds none spare
    # ...and its outcome, counted against its host's limit: always, where a lease may not be needed (a
    # slot leased for the listing's page and not yet given back; CI 2026-12-04 met that order once)
    hook(hostlimit.HostLimit, "account")
    hook(curl.Pending, "result")  # its answer taken
    hook(packs.PackWriter, "append")  # its bytes written
    hook(Cache, "put_many")  # stored
    hook(type(ds.reader.cache.index), "add_many")  # and published in the index

    def collate(batch: list[Any]) -> list[Any]:
        take(batch)
        return batch

    loader = fastload.DataLoader(ds, batch_size=1, num_workers=0, collate_fn=collate)
    (sample,) = next(iter(loader))
    assert sample["data"][:3] == b"\xff\xd8\xff" and ds.reader.misses == 1
    # A GET's outcome reaches its HostLimit at the next pump, which may come after its answer was taken.
    deadline = time.monotonic() + 5
    while "fastload.transport.hostlimit.HostLimit" not in path and time.monotonic() < deadline:
        curl.pump()
        time.sleep(0.01)
    documented = _documented()
    assert set(path) == set(documented), (
        "the cold read's objects changed; update docs/architecture.md's table (class: its thread roles):\n"
        + "\n".join(f"{c}: {sorted(r)}" for c, r in sorted(path.items()))
    )
    # A slot may be leased wherever Python passes by the engine first: the table lists each place it may run.
    assert all(path[c] <= documented[c] for c in path), {c: (path[c], documented[c]) for c in path}
    assert len(path) <= ISSUE_BOUND, sorted(path)
