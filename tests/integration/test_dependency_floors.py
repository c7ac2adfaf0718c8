"""The declared dependency floors install together and ``import fastload`` works with them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_floors.py"


@pytest.mark.slow  # a fresh venv and seven downloads from the package index: about a minute
@pytest.mark.integration
def test_import_with_every_dependency_at_its_floor() -> None:
    # fsspec>=2023.6 was declared while fastload.fs imports fsspec.implementations.chained
    # (new in 2025.10.0): `import fastload` failed at the floor.
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fsspec==2025.10.0" in done.stdout
    assert "import fastload: ok" in done.stdout
