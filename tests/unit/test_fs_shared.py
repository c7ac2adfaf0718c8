"""fastload.open and the fastload:: filesystem: one Reader per process (a fork builds its
own), and folders that are folders (info, ls, find) over local paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fastload
from fastload import fs as flfs
from fastload.fs import FastloadFileSystem


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FASTLOAD_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"a" * 1000)
    (root / "sub" / "b.bin").write_bytes(b"b" * 2000)
    return root


def test_opens_share_one_reader_and_a_fork_builds_its_own(tree: Path) -> None:
    path = str(tree / "a.bin")
    with fastload.open(path) as f1, fastload.open(path) as f2:
        assert f1.raw.reader is f2.raw.reader  # type: ignore[attr-defined]
        assert f1.read() == b"a" * 1000
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Reader inherited; its own reads through its own handles
        ok = not flfs._SHARED
        with fastload.open(path) as f:
            ok = ok and f.read() == b"a" * 1000 and len(flfs._SHARED) == 1
        os.write(write_end, b"1" if ok else b"0")
        os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 1) == b"1"
    os.close(read_end)
    assert os.waitpid(pid, 0)[1] == 0
    assert len(flfs._SHARED) >= 1  # the parent keeps its own


def test_local_folders_are_folders(tree: Path) -> None:
    fs = FastloadFileSystem(skip_instance_cache=True)  # no target: every path picks its own filesystem
    root = str(tree)
    assert fs.info(root)["type"] == "directory"
    assert fs.info(root + "/a.bin") == {"name": root + "/a.bin", "size": 1000, "type": "file",
                                        "version": fs.info(root + "/a.bin")["version"]}
    assert fs.isdir(root) and fs.isfile(root + "/sub/b.bin")
    assert fs.ls(root, detail=False) == [root + "/a.bin", root + "/sub"]
    assert fs.find(root) == [root + "/a.bin", root + "/sub/b.bin"]
    assert fs.find(root, withdirs=True) == [root + "/a.bin", root + "/sub", root + "/sub/b.bin"]
    assert fs.cat_file(root + "/sub/b.bin") == b"b" * 2000
    assert fs.info(root + "/sub")["type"] == "directory"
