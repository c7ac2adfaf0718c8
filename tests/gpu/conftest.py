"""Skip the ``gpu`` tests, with a reason, where CUDA is absent; and those that need sample photos without them."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest


@pytest.fixture(scope="session")
def sample_photos() -> None:
    """fastload.samples needs Pillow and scikit-learn (its bundled photos): skip, naming them, without."""
    missing = [name for name in ("PIL", "sklearn") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"sample photos need {' and '.join(missing)}: pip install 'fastload[samples]'")


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory, sample_photos: None) -> list[dict[str, Any]]:
    """16 real photos (4 classes) as dict samples: ``data`` (JPEG bytes), ``label``, ``url``."""
    from fastload.samples import make_image_folder

    root = tmp_path_factory.mktemp("photos")
    paths = make_image_folder(root, n=16, classes=4)
    return [{"data": p.read_bytes(), "label": i % 4, "url": str(p)} for i, p in enumerate(paths)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if available:
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
