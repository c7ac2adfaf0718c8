"""Every documented import path, the CLI and the ``fastload::`` protocol still answer after the
layout of issue 37, and what was pickled or saved before it still loads."""

from __future__ import annotations

import importlib
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

import fastload
from fastload import _moved
from fastload.cli import main

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _resolve(path: str) -> object:
    """The module or attribute a dotted path names (``a.b.C``: module a.b, attribute C)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


def _documented_imports() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        for module, names in re.findall(r"^\s*(?:>>> )?from (fastload[\w.]*) import ([\w, ]+)$", doc.read_text(), re.M):
            found |= {(module, n.strip()) for n in names.split(",") if n.strip()}
    return sorted(found)


# Logger names the docs give in backticks, not import paths.
LOGGERS = {"fastload.live"}


def _documented_paths() -> list[str]:
    # `fastload.a.b` in backticks, or :mod:/:class:/:func: roles, in the docs
    found: set[str] = set()
    for doc in DOCS:
        for path in re.findall(r"`~?(fastload(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", doc.read_text()):
            found.add(path)
    return sorted(found - LOGGERS)


def test_the_docs_name_import_paths_to_check() -> None:
    assert ("fastload.pipelines", "ImageClassification") in _documented_imports()
    assert "fastload.stats" in _documented_paths() or "fastload.stats.regime" in _documented_paths()


@pytest.mark.parametrize(("module", "name"), _documented_imports())
def test_each_documented_from_import_works(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("path", _documented_paths())
def test_each_dotted_path_in_the_docs_resolves(path: str) -> None:
    assert _resolve(path) is not None


@pytest.mark.parametrize("name", fastload.__all__)
def test_each_public_name_resolves(name: str) -> None:
    assert getattr(fastload, name) is not None


def test_the_cli_and_the_protocol_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0 and "pre-stage a remote dataset" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "fastload", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "diagnose" in out.stdout
    assert type(fsspec.filesystem("fastload", target_protocol="file")) is fastload.FastloadFileSystem


@pytest.mark.parametrize(("old", "new"), sorted(_moved.MOVED.items()))
def test_an_old_module_path_is_the_module_at_its_new_one(old: str, new: str) -> None:
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__spec__ is not None and moved.__spec__.name == new  # the module still says where it lives


def test_fastload_loader_still_names_the_dataloader() -> None:
    assert importlib.import_module("fastload.loader").DataLoader is fastload.DataLoader


def test_a_sampler_pickled_before_the_layout_unpickles() -> None:
    # Written by the tree before issue 37 (commit f69b172): pickle protocol 2 names the class
    # as "fastload.sampler\nShardedSampler".
    raw = (DATA / "sampler_before_layout.pkl").read_bytes()
    assert b"cfastload.sampler\nShardedSampler\n" in raw
    saved = pickle.loads(raw)
    assert type(saved["sampler"]) is fastload.ShardedSampler
    assert list(saved["sampler"]) == saved["order"]


def test_a_state_saved_before_the_layout_resumes() -> None:
    # Written by the tree before issue 37: state_dict() after 3 of 10 batches, and the 7 after.
    saved = json.loads((DATA / "resume_state_before_layout.json").read_text())
    loader = fastload.DataLoader(list(range(40)), batch_size=4, shuffle=True, seed=7)
    loader.load_state_dict(saved["state"])
    assert [b.tolist() for b in loader] == saved["rest"]
