"""The layer order is import-linter's to enforce (pyproject.toml, [tool.importlinter]; `make lint`).

These tests show that its contracts bite: each plants one bad import in a copy of the package
and expects `lint-imports` to name it. What they plant is what STYLE.md forbids: a package that
imports one above it (at module level, or only under TYPE_CHECKING) and two modules of one
package that import each other. The hand-written cycle finder that stood here before is gone:
import-linter's acyclic_siblings contract checks every package, TYPE_CHECKING imports included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="lint-imports not installed: pip install -e '.[test]'")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy, not the installed package, is analysed
    return subprocess.run(
        [str(LINT), "--no-cache", str(root / "pyproject.toml")], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "fastload", tmp_path / "fastload", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_the_tree_keeps_both_contracts(tmp_path: Path) -> None:
    out = _lint(_copy(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


PLANTED = {
    "an upward import": (
        "fastload.cache.keys",
        "from fastload.loader import dataloader  # noqa",
        ["fastload.cache is not allowed to import fastload.loader", "fastload.cache.keys -> fastload.loader.dataloader"],
    ),
    "an upward import under TYPE_CHECKING": (
        "fastload.transport.answers",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastload.read import reader  # noqa",
        ["fastload.transport is not allowed to import fastload.read"],
    ),
    # transport.failures is imported by transport.answers; the planted import closes the circle.
    "two modules of one package importing each other": (
        "fastload.transport.failures",
        "from fastload.transport import answers  # noqa",
        ["No cycles are allowed in fastload.transport"],
    ),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_bad_import_breaks_a_contract(tmp_path: Path, case: str) -> None:
    module, line, said = PLANTED[case]
    root = _copy(tmp_path)
    _plant(root, module, line)
    out = _lint(root)
    assert out.returncode == 1
    for words in said:
        assert words in out.stdout, out.stdout


def test_a_module_placed_in_no_layer_breaks_the_layers(tmp_path: Path) -> None:
    # exhaustive = true: a new package or module at fastload/'s root must be given a layer.
    root = _copy(tmp_path)
    (root / "fastload" / "newcomer.py").write_text('"""A module nobody placed."""\n')
    out = _lint(root)
    assert out.returncode == 1
    assert "fastload.newcomer" in out.stdout
