"""The examples in docs/storage.md and docs/egpu.md run, against real servers.

Each ```python or ```console block in those guides follows a marker line,
``<!-- test: KIND -->``, that says how it runs here:

* ``s3``: against the moto S3 server (s3fs), with ``my-bucket`` and the endpoint
  ``http://127.0.0.1:9000`` replaced by the test's;
* ``http``: against nginx, for ``http://data.example.com``;
* ``nfs``: on a local folder, for ``/mnt/nfs/train``;
* ``cpu``: as written; ``cpu-or-gpu``: as written on CUDA, with ``device="cuda"``
  replaced by ``device="cpu"`` elsewhere;
* ``skip (why)``: not run.

Blocks of one kind run in order in one namespace; console lines ``$ fastload ...``
run through ``fastload.cli.main``, which must return 0. A block without a marker
fails the test, so a new example cannot go untested by accident.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload.cli import main as cli_main

pytestmark = pytest.mark.integration  # moto, nginx

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"(?:<!-- test: (?P<kind>[^>]*?) -->\n)?```(?P<lang>python|console)\n(?P<code>.*?)```", re.S)
KINDS = ("s3", "http", "nfs", "cpu", "cpu-or-gpu")


def blocks(doc: str) -> list[tuple[str, str, str]]:
    """(kind, language, code) of every python/console block of ``doc``, in order."""
    out = []
    for m in _BLOCK.finditer((DOCS / doc).read_text()):
        kind = m["kind"] or ""
        assert kind in KINDS or kind.startswith("skip ("), f"{doc}: a {m['lang']} block has no test marker:\n{m['code']}"
        out.append((kind, m["lang"], m["code"]))
    return out


def run_blocks(doc: str, kind: str, subs: dict[str, str], ns: dict[str, Any]) -> str:
    """Runs the ``kind`` blocks of ``doc`` with ``subs`` applied; returns what they printed."""
    todo = [(lang, code) for k, lang, code in blocks(doc) if k == kind]
    assert todo, f"{doc} has no {kind!r} example"
    out = io.StringIO()
    for lang, code in todo:
        for old, new in subs.items():
            code = code.replace(old, new)
        with contextlib.redirect_stdout(out):
            if lang == "python":
                exec(compile(code, f"{doc}:{kind}", "exec"), ns)
                continue
            for line in code.replace("\\\n", " ").splitlines():
                if line.startswith("$ "):
                    argv = shlex.split(line[2:])
                    assert argv[0] == "fastload", line
                    assert cli_main(argv[1:] + ["--no-progress"]) == 0, line
    return out.getvalue()


@pytest.fixture
def photos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("PIL", reason="sample JPEGs need Pillow")
    from fastload.samples import make_image_folder

    monkeypatch.setenv("FASTLOAD_CACHE_DIR", str(tmp_path / "cache"))  # the examples use the default cache
    root = tmp_path / "www"
    make_image_folder(root / "train", n=8, classes=2, size=(64, 48))
    return root


def test_every_block_has_a_marker() -> None:
    for doc in ("storage.md", "egpu.md"):
        assert len(blocks(doc)) >= 4


def test_storage_s3_examples(photos: Path, moto_server: _servers.MotoServer, s3_bucket: str) -> None:
    pytest.importorskip("torch")
    _servers.upload_tree(photos, moto_server.endpoint_url, s3_bucket)
    options = {"key": "my-access-key", "secret": "my-secret-key", "endpoint_url": moto_server.endpoint_url}
    subs = {"my-bucket": s3_bucket, "http://127.0.0.1:9000": moto_server.endpoint_url}
    ns: dict[str, Any] = {"s3_options": options}
    out = run_blocks("storage.md", "s3", subs, ns)
    assert "8 items staged" in out and "8 images, 2 classes" in out, out
    assert re.search(r"requests +settled at \d+ in flight \(cap 64,", out), out  # the Concurrency section's report
    assert ns["report"].fetched_bytes == sum(p.stat().st_size for p in (photos / "train").rglob("*.jpg"))


def test_storage_http_examples(photos: Path, nginx_server: Callable[..., _servers.NginxServer]) -> None:
    http = nginx_server(photos)
    ns: dict[str, Any] = {"fastload": fastload}
    out = run_blocks("storage.md", "http", {"http://data.example.com": http.url}, ns)
    assert "8 images" in out, out
    assert len(ns["ds"]) == 8 and ns["ds"][0]["data"][:3] == b"\xff\xd8\xff"  # the headers example's dataset


def test_storage_nfs_examples(photos: Path, tmp_path: Path) -> None:
    mount = tmp_path / "nfs" / "train"
    shutil.copytree(photos / "train", mount)
    ns: dict[str, Any] = {"fastload": fastload}
    run_blocks("storage.md", "nfs", {"/mnt/nfs/train": str(mount)}, ns)  # its asserts check the snapshot
    assert ns["fresh"][0]["data"] == b"new bytes" and ns["before"] != b"new bytes"


def test_egpu_examples(photos: Path) -> None:
    torch = pytest.importorskip("torch")
    cuda = torch.cuda.is_available()
    ns: dict[str, Any] = {"train_folder": str(photos / "train")}
    out = run_blocks("egpu.md", "cpu", {}, ns)
    assert "fp32    602,112 B    4,484 img/s" in out, out
    assert out.rstrip().splitlines()[-4].startswith("True - Thunderbolt 3/4 or USB4 class"), out
    subs = {} if cuda else {'device="cuda"': 'device="cpu"'}
    out = run_blocks("egpu.md", "cpu-or-gpu", subs, ns)
    device = "cuda:0" if cuda else "cpu"
    assert f"torch.Size([8, 3, 224, 224]) torch.float16 {device}" in out, out
    assert f"{device} torch.uint8 torch.float32" in out, out
